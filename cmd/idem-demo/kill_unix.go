//go:build unix

package main

import (
	"os"
	"syscall"
)

// killSelf ends the process as kill -9 does: no deferred function, no
// cleanup, the connections cut by the kernel.
func killSelf() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}
