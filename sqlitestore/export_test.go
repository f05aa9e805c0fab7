package sqlitestore

// OnLockWait has s call f whenever a writer starts waiting for the write
// lock. Call it while s is not in use.
func OnLockWait(s *Store, f func()) { s.lockWait = f }
