package idem

import "time"

// PublicErr is publicErr, for the tests of the conversion.
var PublicErr = publicErr

// SetFastBound sets how long r's fast batches wait for their sends (before
// Run).
func SetFastBound(r *Relay, d time.Duration) { r.fastBound = d }
