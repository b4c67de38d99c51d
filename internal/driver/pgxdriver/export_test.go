package pgxdriver

// The planner settings, for the plans tests check.
const (
	SQLIndexLookup = sqlIndexLookup
	SQLIndexWalk   = sqlIndexWalk
)
