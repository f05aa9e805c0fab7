package idemdriver

import "time"

// OperationID names the operation of (user, key) created at createdAt in
// logs and reports without showing the key: 16 hex characters of a hash.
func OperationID(user, key string, createdAt time.Time) string {
	return (&Lease{User: user, Key: key, CreatedAt: createdAt}).ChildKey("operation-id")[:16]
}

// KeyID names (user, key) in logs without showing the key, before its
// operation is known: 16 hex characters of a hash. Keys are logged only so.
func KeyID(user, key string) string {
	return (&Lease{User: user, Key: key}).ChildKey("key-id")[:16]
}
