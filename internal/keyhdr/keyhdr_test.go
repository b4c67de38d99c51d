package keyhdr

import "testing"

// Format's value reads back as the key, whatever visible ASCII it holds.
func TestFormatRoundTrip(t *testing.T) {
	for _, key := range []string{"k", "8e03978e-40d5", "a,b", `"lead`, `trail"`, `back\slash`, `"`, `,`, `a"b,c\`} {
		got, err := Parse([]string{Format(key)})
		if err != nil || got != key {
			t.Errorf("%q: sent %q, read %q, %v", key, Format(key), got, err)
		}
	}
	if Format("plain-key") != "plain-key" {
		t.Errorf("a bare key is sent as %q", Format("plain-key"))
	}
}
