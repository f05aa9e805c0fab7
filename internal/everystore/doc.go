// Package everystore holds the library's behaviour tests that run on every
// store (memory, SQLite, PostgreSQL, and Redis in front of PostgreSQL) and
// with the observability wrappers around them, and the model checker
// (package modelcheck). It is a module of its own, so that the root
// module's tests need only the standard library and memstore, while these
// tests may import every driver. It has no code beyond its tests.
package everystore
