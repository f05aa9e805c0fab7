package pgstore

// AbandonedSQL is Abandoned's statement, for the test that EXPLAINs it.
const AbandonedSQL = abandonedSQL

// TxStore is the store tx belongs to.
func TxStore(tx *Tx) *Store { return tx.s }
