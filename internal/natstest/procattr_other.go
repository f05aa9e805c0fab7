//go:build !linux

package natstest

import "os/exec"

// dieWithTest does nothing where the kernel cannot kill a child with its
// parent: a test binary killed at its timeout leaves its servers running.
func dieWithTest(*exec.Cmd) {}
