package idem_test

import (
	"testing"

	"github.com/pgidem/idem/internal/testkit/callertest"
)

// Reservations made with a window, through idem on pgx: see
// callertest.Resume.
func TestResume(t *testing.T) {
	t.Parallel()
	callertest.Resume(t, callertest.PgxFront(newPool(t)))
}

// Two recovery workers and the client's retry race for each attempt in
// doubt: see callertest.ResumeRace.
func TestResumeRace(t *testing.T) {
	t.Parallel()
	callertest.ResumeRace(t, callertest.PgxFront(newPool(t)), callertest.Trials(40))
}
