package pgstore

// AbandonedSQL is Abandoned's statement, for the test that EXPLAINs it.
const AbandonedSQL = abandonedSQL

// TxStore is the store tx belongs to.
func TxStore(tx *Tx) *Store { return tx.s }

// InsertOrReadSQL is the claim's statement on a schema without idem_claim,
// for the test that compares the two.
const InsertOrReadSQL = insertOrReadSQL

// ClaimFuncInUse reports whether s's claims still call idem_claim (no
// claim fell back to InsertOrReadSQL).
func ClaimFuncInUse(s *Store) bool { return !s.noClaimFunc.Load() }
