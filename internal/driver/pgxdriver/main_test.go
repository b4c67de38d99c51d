package pgxdriver_test

import (
	"os"
	"testing"

	"github.com/pgidem/idem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
