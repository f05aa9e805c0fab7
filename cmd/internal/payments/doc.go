// Package payments is a payment gateway that speaks a Stripe-compatible
// subset of the PaymentIntents and Refunds APIs, and the client the order
// service pays through.
//
// # Server
//
// [NewServer] returns an http.Handler for POST, GET, list and search
// (a subset of Stripe's search query language, see search.go) on
// /v1/payment_intents and POST and list on /v1/refunds, close enough to
// Stripe that the official stripe-go client works against it unchanged.
// Creating a PaymentIntent or a refund is made idempotent by this module's
// own middleware ([idem.Middleware]): it is written to the [Ledger] in the
// same transaction as the stored response, so a PaymentIntent or a refund
// exists exactly when its idempotent outcome committed. Every parameter
// has a bound close to Stripe's (see [MaxAmount] and the limits beside
// it), so that every valid answer is small enough to be stored
// ([MaxStoredAnswer]) and replayed. Idempotency keys are kept for
// [Config].KeyRetention (24 hours, as at Stripe); [Server.CleanExpiredKeys]
// deletes the expired ones in batches, never one whose request is running.
// Faults can be injected for tests: latency before each charge, dropped
// connections after a committed charge, and declines above an amount.
//
// # Ledgers
//
// Where the gateway keeps its idempotency keys and PaymentIntents decides
// whether it survives a restart; an order service that retries a payment
// after a crash counts on it. [MemLedger] with a memstore store keeps them
// in memory (the default). [OpenPostgres] returns a pgstore store and a
// [PGLedger] on one PostgreSQL pool, [OpenSQLite] a sqlitestore store and a
// [SQLiteLedger] on one SQLite file; each migrates its tables first.
// On PostgreSQL both keep their tables in a schema that every statement
// names, whatever the pool's search_path, so that an in-process gateway
// sharing the order service's database (schema [DefaultSchema]) keeps its
// idempotency keys apart, also through a pooler in transaction mode
// (PgBouncer) that refuses or drops search_path; [PostgresPool] opens a
// pool for it that sets no search_path. A ledger only
// commits with its own store's transactions: in another store's it
// returns [ErrForeignTx]. [ListAll], [ListAllRefunds] and [CountSucceeded]
// read a ledger for audits.
//
// # Client
//
// [Client] wraps stripe-go: [Client.Charge] creates and confirms a
// PaymentIntent with the caller's idempotency key, [Client.Refund] refunds
// one (errors match [ErrAlreadyRefunded], [ErrRefundTooLarge],
// [ErrNotRefundable], [ErrNotFound]) and [Client.Refunds] lists its
// refunds; [Client.FindByOrderRef] finds an order's succeeded payment by
// its metadata[order_ref] with the Search API ([Client.Search]); stripe-go retries network errors and lock timeouts with the
// key. [InProcess] serves a
// Client's requests from a handler in the same process, without a socket.
//
// # Command
//
// The `payments` command (package cmd/internal/paymentsapp) serves a [Server]:
// `payments serve`.
package payments
