package idemsql_test

import (
	"testing"

	"github.com/pgidem/idem/internal/testkit/callertest"
)

// Reservations made with a window, through idemsql with both drivers: see
// callertest.Resume and callertest.ResumeRace.
func TestResume(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, _ := migrated(t, driver)
		callertest.Resume(t, callertest.SQLFront(db, false))
		db, _ = migrated(t, driver)
		callertest.ResumeRace(t, callertest.SQLFront(db, false), callertest.Trials(16))
	})
}

// When a record became unknown, through idemsql with both drivers: see
// callertest.UnknownAt.
func TestUnknownAt(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		db, _ := migrated(t, driver)
		callertest.UnknownAt(t, callertest.SQLFront(db, false))
	})
}
