package draw

import (
	"slices"
	"testing"
)

func TestPickFollowsWeights(t *testing.T) {
	table := []Prize{{Name: "rare", Weight: 1}, {Name: "common", Weight: 9}}
	// Feed every value in [0, total) once: each prize comes up weight times.
	next := 0
	intn := func(n int) int {
		if n != 10 {
			t.Fatalf("intn(%d), want intn(10)", n)
		}
		v := next
		next++
		return v
	}
	got := pick(table, 10, intn)
	want := []string{"rare", "common", "common", "common", "common", "common", "common", "common", "common", "common"}
	if !slices.Equal(got, want) {
		t.Errorf("pick = %q, want %q", got, want)
	}
}
