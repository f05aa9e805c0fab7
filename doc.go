// Package idem makes unsafe HTTP requests idempotent: a client that retries
// with the same Idempotency-Key gets the same answer, and the operation behind
// it runs once, however many copies of the request race or fail.
//
// # Adopting it
//
// Wrap the handler with [Middleware] and a store, write through the
// request's transaction, so that the work and the stored answer commit
// together, and run a [Completer] beside it:
//
//	// pool is a *pgxpool.Pool on which pgstore.Migrate ran.
//	store := pgstore.New(pool, pgstore.Options{}) // or memstore, sqlitestore, redisfront
//
//	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
//		tx, err := pgstore.FromContext(r.Context()) // or sqlitestore.FromContext, memstore.FromContext
//		if err != nil {
//			http.Error(w, err.Error(), http.StatusInternalServerError)
//			return
//		}
//		// ... write the order through tx; never commit or roll it back:
//		// the middleware commits it with the answer ...
//		w.WriteHeader(http.StatusCreated)
//	})
//	// The scope of a key: the authenticated caller (required).
//	opts := idem.Options{User: func(r *http.Request) string { return userFrom(r.Context()) }}
//	mux.Handle("POST /v1/orders", idem.Middleware(store, opts)(createOrder))
//
//	// Finishes, in the background, requests whose instance died or that failed.
//	completer := idem.NewCompleter(store, createOrder, idem.CompleterOptions{Middleware: opts})
//	go completer.Run(ctx)
//
//	// Deletes expired keys (their answers) in the background.
//	go idem.NewCleaner(store, idem.CleanerOptions{}).Run(ctx)
//
// A retry with the same Idempotency-Key is then answered from the store,
// with Idempotent-Replayed: true, and the handler does not run again.
//
// The examples run in go test: ExampleMiddleware (on memstore),
// ExampleMiddleware_serveMux (on a router), ExampleTxFromContext,
// ExampleNewCompleter, ExampleDo, each store package's Example and the
// client's ExampleTransport.
//
// # Programmer errors
//
// Every constructor of this package ([Middleware], [NewCompleter],
// [NewCleaner]) checks its arguments when it is called, not on the first
// request or sweep, and panics with a message that starts with its own
// name and names the field at fault: a nil store, a missing
// [Options.User], a negative duration or size, a lease not shorter than
// the key's TTL (a key that expired under a live attempt could be claimed
// and run again), an invalid header or operation name. Zero values take
// their documented defaults. Errors that depend on the world (a store
// that is down, a client's bad request) are returned, never panicked.
//
// # Without HTTP
//
// [Do] is the same protocol for queue consumers, jobs and RPC handlers: it
// claims (user, key), runs a [DoFunc] that writes through
// [TxFromContext] (or a store's FromContext), commits its output with
// those writes, fenced, and hands a repeat of the key the stored output
// without running the function again. A function that fails or panics
// leaves the key bound to its operation and input; a [Completer] finishes
// it with the function registered under its name in
// [CompleterOptions.Funcs]. Its records have an empty Method and a
// fingerprint of their own, so an HTTP request and a Do call never
// share one. ExampleDo shows a consumer that applies a message once.
//
// # How it works
//
// [Middleware] wraps an [http.Handler]. For every request that carries an
// Idempotency-Key it claims the (user, key) pair in a [Store] before the
// handler runs. The claim is a lease held by a random owner token. The handler
// writes its rows through the transaction returned by [TxFromContext], and the
// middleware stores the response in that same transaction, fenced on the owner
// token: the data and the stored answer commit together or not at all, and an
// attempt whose lease was taken over can no longer commit.
//
// The middleware owns that transaction: it commits it, with the answer,
// or rolls it back, once the handler returned. A handler that committed
// it itself would leave its writes without an answer and its key to run
// again, so every handle a handler gets on it refuses to commit or roll
// back ([ErrTxOwned]): the Tx of [TxFromContext], pgstore.FromContext's
// pgx.Tx (a savepoint of it, from Begin, still commits and rolls back),
// sqlitestore.FromContext's HandlerTx and memstore.FromContext's Tx.
//
// A repeat of a completed request is answered from the store with
// Idempotent-Replayed: true. A repeat with another body is refused with 422
// ([ErrFingerprintMismatch]); a repeat while the first attempt still runs is
// answered 409 ([ErrInFlight]) or waits, see [Options.InFlightWait].
//
// # What is stored
//
// By default 2xx, 3xx and 402 answers are stored and replayed. Any other 4xx
// on a key's first attempt means the request was refused before anything
// happened: the key is released so a corrected request may reuse it; on a
// later attempt an earlier one may have paid, so the key stays bound. A
// 5xx or a panic keeps the key bound to its fingerprint and ends the lease
// at once, so the same request may run again and a different one still
// gets 422. Once the handler's work commits the key is never released: an
// answer over [Options.MaxStoredBody] is replaced, for replays, by a
// problem naming its status. A body whose JSON repeats a member name is
// refused before the claim.
//
// # Failures and expiry
//
// A claim carries its owner token (idemdriver.ClaimParams.Owner), so the middleware
// sends store calls again after a lost connection without ever answering
// its own claim with 409. A record without an answer never expires: its
// attempt may have paid. [NewCompleter] re-drives abandoned requests; the
// store counts its re-drives and says which keys are due
// (idemdriver.Sweeper.Abandoned). Downstream calls take keys from [ChildKey].
//
// # Stores
//
// The [Store] interface is small. Four packages implement it, each a
// module of its own but memstore, and each passes the conformance suite
// [github.com/idem-go/idem/storetest]:
//
//   - [github.com/idem-go/idem/memstore]: in memory, for tests and a single
//     process;
//   - [github.com/idem-go/idem/sqlitestore]: SQLite through a pure Go
//     driver, the embedded default that needs no server;
//   - [github.com/idem-go/idem/pgstore]: PostgreSQL, for many instances on
//     one database;
//   - [github.com/idem-go/idem/redisfront]: Redis in front of any store
//     (pgstore in production), answering replays and duplicates in flight
//     without a database statement; the inner store decides everything else.
//
// What a store implements, and the types it works with (claims, leases,
// records, the sweeper, the inspector, purge), are in package
// [github.com/idem-go/idem/idemdriver], out of this package's way: a
// user of the library never needs it, a store's author starts there.
//
// Clients of such APIs retry with the same key through
// [github.com/idem-go/idem/client].
package idem
