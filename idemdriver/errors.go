package idemdriver

import "errors"

// ErrNotFound is returned by a store for a key it holds no record of.
// Package idem exports it as idem.ErrNotFound.
var ErrNotFound = errors.New("idem: key not found")
