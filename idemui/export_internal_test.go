package idemui

// SetMaxExportBytes sets the bound on the stored text an export of the
// trail holds, for a test, and returns the previous one.
func SetMaxExportBytes(n int64) int64 { return maxExportBytes.Swap(n) }
