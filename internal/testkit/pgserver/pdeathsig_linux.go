package pgserver

import "syscall"

// setParentDeathSignal asks the kernel to send sig to the child when this
// process dies, so a temp cluster never outlives it.
func setParentDeathSignal(attr *syscall.SysProcAttr, sig syscall.Signal) {
	attr.Pdeathsig = sig
}
