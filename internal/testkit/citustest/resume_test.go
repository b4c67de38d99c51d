package citustest_test

import (
	"database/sql"
	"testing"

	"github.com/pgidem/idem/internal/testkit/callertest"
)

// Reservations made with a window through the coordinator: resumed inside
// the window (the new token from the coordinator's sequence), left alone
// by ExpireLeases (its Citus form), a person's past it; two recovery
// workers and the client's retry racing for each attempt; when a record
// became unknown (callertest.UnknownAt: MarkUnknown's least(unknown_at,
// now()), ExpireLeases' Citus form). With idem, and
// with idemsql's NewCitus Client on both database/sql drivers.
func TestCallsResume(t *testing.T) {
	t.Parallel()
	t.Run("idem", func(t *testing.T) {
		t.Parallel()
		_, p := newDB(t)
		callertest.Resume(t, callertest.PgxFront(p))
		_, p = newDB(t)
		callertest.ResumeRace(t, callertest.PgxFront(p), callertest.Trials(8))
		_, p = newDB(t)
		callertest.UnknownAt(t, callertest.PgxFront(p))
	})
	for _, driverName := range []string{"pgx", "postgres"} {
		t.Run("idemsql/"+driverName, func(t *testing.T) {
			t.Parallel()
			for _, scenario := range []func(t *testing.T, f callertest.NewFront){
				func(t *testing.T, f callertest.NewFront) { callertest.Resume(t, f) },
				func(t *testing.T, f callertest.NewFront) { callertest.ResumeRace(t, f, callertest.Trials(8)) },
				func(t *testing.T, f callertest.NewFront) { callertest.UnknownAt(t, f) },
			} {
				cdb, _ := newDB(t)
				db, err := sql.Open(driverName, cdb.URL)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = db.Close() })
				scenario(t, callertest.SQLFront(db, true))
			}
		})
	}
}
