package pgxdriver_test

import (
	"os"
	"testing"

	"github.com/pgidem/idem/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
