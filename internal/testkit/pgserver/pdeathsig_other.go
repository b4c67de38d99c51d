//go:build unix && !linux

package pgserver

import "syscall"

// setParentDeathSignal is a no-op where the kernel offers no parent-death
// signal; a temp cluster whose owner dies without Close keeps running there
// until stopped by hand.
func setParentDeathSignal(*syscall.SysProcAttr, syscall.Signal) {}
