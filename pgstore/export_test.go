package pgstore

// AbandonedSQL is Abandoned's statement, for the test that EXPLAINs it.
const AbandonedSQL = abandonedSQL
