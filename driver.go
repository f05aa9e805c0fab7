package idem

import "github.com/idem-go/idem/idemdriver"

// Store is where the middleware, Do and the completer keep idempotency
// records: memstore, sqlitestore, pgstore, redisfront, or your own. What
// a store implements, and the types it works with, are in package
// idemdriver; a user only passes one to Middleware, Do, NewCompleter and
// NewCleaner.
type Store = idemdriver.Store

// Tx is the transaction of a claimed request (or Do operation), as
// TxFromContext hands it to the handler: the handler's writes commit with
// the stored answer, or not at all.
type Tx = idemdriver.Tx

// Defaults, defined with the store interface in package idemdriver.
const (
	// DefaultTTL is how long a key is kept after its first request
	// (Options.TTL, DoParams.TTL).
	DefaultTTL = idemdriver.DefaultTTL
	// DefaultLease is how long one attempt holds its key (Options.Lease,
	// DoParams.Lease).
	DefaultLease = idemdriver.DefaultLease
	// DefaultCompleterMaxAttempts is CompleterOptions.MaxAttempts' default.
	DefaultCompleterMaxAttempts = idemdriver.DefaultCompleterMaxAttempts
)

// ErrNotFound: no record for this key (a store's answer to a lookup).
var ErrNotFound = idemdriver.ErrNotFound
