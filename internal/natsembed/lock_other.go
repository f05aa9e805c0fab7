//go:build !unix

package natsembed

// lockDir is a no-op where flock is not available: on these systems the
// caller must not start two servers on one directory.
func lockDir(string) (func(), error) { return func() {}, nil }
