package citustest_test

import (
	"os"
	"testing"

	"github.com/pgidem/idem/internal/citustest"
)

func TestMain(m *testing.M) { os.Exit(citustest.Main(m)) }

func TestHarness(t *testing.T) {
	db := citustest.New(t, nil)
	t.Log(db)
}
