// Package sqlitestore is an idem.Store on SQLite, through the pure Go driver
// modernc.org/sqlite: the embedded default that needs no server.
//
// [Open] creates the database file if need be and migrates it; the
// service's own tables may live in the same file ([Store.DB],
// [ApplyMigrations]), and a handler writes them through the request's
// transaction, which [FromContext] returns as a [HandlerTx]: *sql.Tx's
// statement methods, with Commit and Rollback refused, since the
// middleware commits it with the answer. Example creates an order once
// and replays it to the retry.
//
// A key is claimed in one short write transaction whose INSERT … ON
// CONFLICT DO NOTHING, on the primary key (user_id, key), decides who owns
// it; a lease that ran out is taken over with an UPDATE conditioned on the
// previous owner, the fencing token. The handler writes through the
// transaction Begin opens ([Tx.SQL], or [FromContext] in a handler), and
// [Tx.Complete] stores the response in that same transaction, so the work
// and its outcome commit together or not at all.
//
// # Expiry
//
// Only completed records expire. A record without a response (its attempt
// may have paid) is never replaced or deleted by expiry: once its lease ran
// out it is taken over, by a retry or the completer, keeping its CreatedAt,
// and an attempt that completes after the expiry keeps the key for its TTL
// again from the completion, so that a retry replays the answer. A Claim
// resent with the same ClaimParams.Owner (its answer lost) returns the
// lease that owner already holds.
//
// # Clock
//
// Leases and expiry are measured by the process clock (Options.Now, by
// default time.Now), not by a database server's as pgstore's are: there is
// no server, and every process that shares one SQLite file runs on one
// machine (the database is in WAL mode, whose shared-memory index does not
// work over a network file system), so every one of them reads the same
// clock, and one process cannot be ahead of another.
//
// # Locking
//
// SQLite lets one connection write at a time. Every write transaction the
// store opens starts with BEGIN IMMEDIATE, so it takes the write lock at
// once, waiting for it under busy_timeout, instead of failing with
// SQLITE_BUSY when a read lock is upgraded. Within a process the store's
// writers also queue first in the pool's write queue (LockWrites), which
// hands the write lock over in turn, without SQLite's polling; the
// outbox's relay (sqliteoutbox) waits in the same queue, and so should
// the application's own write transactions on DB(). Use one Store per
// file per process.
// A handler's transaction holds the lock from its first use to Complete or
// Rollback: claims of other keys wait for it (up to the busy timeout, then
// ErrBusy), so handlers should keep slow calls out of the transaction (the
// middleware begins it lazily, on first use) and must always end it. Reads
// (Get, Abandoned) do not wait for writers, the database being in WAL mode.
package sqlitestore

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	_ "modernc.org/sqlite" // registers the "sqlite" driver
)

var (
	_ idem.Store         = (*Store)(nil)
	_ idemdriver.Sweeper = (*Store)(nil)
	_ idem.Tx            = (*Tx)(nil)
)

//go:embed migrations/*.sql
var migrations embed.FS

// ErrBusy reports that a write waited the whole busy timeout
// (Options.BusyTimeout) for another write transaction of this process to
// end.
var ErrBusy = errors.New("database is busy")

// Component is the name under which Open records this package's
// migrations in schema_migrations.
const Component = "idem"

// DefaultBusyTimeout is the default Options.BusyTimeout.
const DefaultBusyTimeout = 10 * time.Second

// Options configures a Store. The zero value is usable.
type Options struct {
	// Now is the clock that leases and expiry are measured by. Default
	// time.Now, the machine's clock, which every process sharing the
	// database file reads (see the package doc); set it in tests.
	Now func() time.Time
	// BusyTimeout is how long a write waits for another write transaction
	// to end: one of this process (then it fails with ErrBusy) or of
	// another connection (SQLite's busy_timeout, then SQLITE_BUSY).
	// Default DefaultBusyTimeout (10s).
	BusyTimeout time.Duration
}

// Store is an idem.Store and idemdriver.Sweeper on a SQLite database. It is safe
// for concurrent use, and several processes may share its file. Make one
// with Open.
type Store struct {
	db  *sql.DB
	now func() time.Time

	// writes is the queue of db's writers in this process (see
	// LockWrites), shared with every other user of db.
	writes *writeQueue

	// lockWait, if set (by tests, before the store is used), is called
	// when a writer starts waiting for the write lock.
	lockWait func()
}

// Open opens (creating it if need be) the SQLite database at path, applies
// the store's migrations and returns the store.
//
// path is a file name, or a "file:" URI. Every connection of the pool gets
// busy_timeout, WAL journal mode, synchronous=FULL (a committed outcome
// survives a power loss, as a charge does) and foreign keys; every
// read-write transaction begins with BEGIN IMMEDIATE. An in-memory database
// (":memory:") is refused: each pooled connection would get its own.
func Open(ctx context.Context, path string, opts Options) (*Store, error) {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.BusyTimeout <= 0 {
		opts.BusyTimeout = DefaultBusyTimeout
	}
	if path == "" || path == ":memory:" || strings.Contains(path, "mode=memory") {
		return nil, fmt.Errorf("sqlitestore: Open %q: a database file is required", path)
	}
	if err := createPrivate(path); err != nil {
		return nil, fmt.Errorf("sqlitestore: open %s: %w", path, err)
	}
	db, err := sql.Open("sqlite", dsn(path, opts.BusyTimeout))
	if err != nil {
		return nil, interpretError("open "+path, err)
	}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, interpretError("open "+path, err)
	}
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("sqlitestore: %w", err)
	}
	if err := ApplyMigrations(ctx, db, Component, sub); err != nil {
		db.Close()
		return nil, err
	}
	return &Store{db: db, now: opts.Now, writes: queueOf(db, opts.BusyTimeout)}, nil
}

// ErrNoDatabase is matched (errors.Is) by OpenExisting's error when no
// database file is at path.
var ErrNoDatabase = errors.New("sqlitestore: no database file")

// OpenExisting opens the SQLite database at path as Open does (the same
// connection settings), but only when its file exists already, and
// without applying any migration: it creates no file and no table. A
// missing file is an error matching ErrNoDatabase. It is for commands
// that must not change a database that is not there or not up to date:
// check the store's schema with Pending (and the application's with
// PendingMigrations) before using the store. path is a file name (a
// "file:" URI is opened with mode=rw, so that SQLite does not create it
// either); ":memory:" is refused.
func OpenExisting(ctx context.Context, path string, opts Options) (*Store, error) {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.BusyTimeout <= 0 {
		opts.BusyTimeout = DefaultBusyTimeout
	}
	if path == "" || path == ":memory:" || strings.Contains(path, "mode=memory") {
		return nil, fmt.Errorf("sqlitestore: OpenExisting %q: a database file is required", path)
	}
	if strings.HasPrefix(path, "file:") {
		if !strings.Contains(path, "mode=") {
			sep := "?"
			if strings.Contains(path, "?") {
				sep = "&"
			}
			path += sep + "mode=rw"
		}
	} else {
		name, _, _ := strings.Cut(path, "?")
		switch fi, err := os.Stat(name); {
		case errors.Is(err, fs.ErrNotExist):
			return nil, fmt.Errorf("%w at %s", ErrNoDatabase, name)
		case err != nil:
			return nil, fmt.Errorf("sqlitestore: open %s: %w", name, err)
		case !fi.Mode().IsRegular():
			return nil, fmt.Errorf("sqlitestore: open %s: not a regular file", name)
		}
	}
	db, err := sql.Open("sqlite", dsn(path, opts.BusyTimeout))
	if err != nil {
		return nil, interpretError("open "+path, err)
	}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, interpretError("open "+path, err)
	}
	return &Store{db: db, now: opts.Now, writes: queueOf(db, opts.BusyTimeout)}, nil
}

// createPrivate creates path's file, empty, readable and writable by its
// owner only (0600), when path is a plain file name and no file is there:
// the keys, stored answers and request bodies are nobody else's to read.
// SQLite then gives its -wal and -shm files the database file's mode. An
// existing file keeps its mode, and a "file:" URI is left to SQLite.
func createPrivate(path string) error {
	if strings.HasPrefix(path, "file:") {
		return nil
	}
	name, _, _ := strings.Cut(path, "?")
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return f.Close()
}

// dsn returns the driver's data source name for path. The _pragma
// parameters run on every new connection of the pool, busy_timeout first;
// _txlock=immediate makes BeginTx issue BEGIN IMMEDIATE (read-only
// transactions excepted).
func dsn(path string, busy time.Duration) string {
	sep := "?"
	if strings.Contains(path, "?") {
		sep = "&"
	}
	return path + sep + strings.Join([]string{
		"_pragma=busy_timeout(" + strconv.FormatInt(busy.Milliseconds(), 10) + ")",
		"_pragma=journal_mode(WAL)",
		"_pragma=synchronous(FULL)",
		"_pragma=foreign_keys(1)",
		"_txlock=immediate",
	}, "&")
}

// DB returns the store's database handle, for the application's own tables
// (see ApplyMigrations) and queries.
func (s *Store) DB() *sql.DB { return s.db }

// Close closes the database.
func (s *Store) Close() error { return interpretError("close", s.db.Close()) }

// Claim implements idem.Store.
//
// A record without a response never expires here (an attempt that may have
// paid keeps its key): it is taken over once its lease ran out, keeping its
// CreatedAt and expiry. Only a completed record whose expiry passed is
// replaced by a new operation. A record already held by p.Owner is that
// attempt's own earlier claim, whose answer was lost: its lease is
// returned as stored. A completer's claim (p.Redrive set) never inserts or
// replaces a record; see claimRedrive.
func (s *Store) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	if err := ctx.Err(); err != nil {
		return idemdriver.Claim{}, err
	}
	p = p.Normalize()
	header, err := encodeHeader(p.Header)
	if err != nil {
		return idemdriver.Claim{}, err
	}
	// One short transaction, begun IMMEDIATE: the INSERT decides, and the
	// row read when it did not insert cannot change before we commit.
	unlock, err := s.lockWrites(ctx)
	if err != nil {
		return idemdriver.Claim{}, err
	}
	defer unlock()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return idemdriver.Claim{}, interpretError("claim", err)
	}
	defer tx.Rollback()

	now := s.now()
	owner := p.Owner
	if owner == "" {
		owner = idemdriver.NewOwner()
	}
	leaseUntil := toNanos(now.Add(p.Lease))
	if p.Redrive != nil {
		return s.claimRedrive(ctx, tx, p, now, owner, leaseUntil)
	}
	c := claimRequest{p: p, header: header, now: now, owner: owner, leaseUntil: leaseUntil, expires: toNanos(now.Add(p.TTL))}
	inserted, err := c.insert(ctx, tx)
	if err != nil {
		return idemdriver.Claim{}, err
	}
	l := c.fresh()
	if !inserted {
		var answer *idemdriver.Claim
		l, answer, err = c.claimExisting(ctx, tx)
		if err != nil {
			return idemdriver.Claim{}, err
		}
		if answer != nil {
			return *answer, nil
		}
	}
	return commitLease(tx, p, owner, leaseUntil, l.attempts, l.created, max(0, fromNanos(l.expires).Sub(now)))
}

// claimRequest is a Claim of a new operation (not a completer's) inside
// its transaction: the normalized params, their encoded header, the
// store's now, and the owner, lease end and expiry it writes (nanoseconds).
type claimRequest struct {
	p          idemdriver.ClaimParams
	header     string
	now        time.Time
	owner      string
	leaseUntil int64
	expires    int64
}

// claimedLease is what commitLease needs of the record a claim wrote: the
// attempt, and its operation's CreatedAt and expiry (nanoseconds).
type claimedLease struct {
	attempts int
	created  time.Time
	expires  int64
}

// fresh is the lease of a new operation: attempt 1, created now.
func (c *claimRequest) fresh() claimedLease {
	return claimedLease{attempts: 1, created: fromNanos(toNanos(c.now)), expires: c.expires}
}

// insert inserts the record of a new operation unless (user, key) has a
// record already, and reports whether it did.
func (c *claimRequest) insert(ctx context.Context, tx *sql.Tx) (bool, error) {
	p := c.p
	res, err := tx.ExecContext(ctx, `
		INSERT INTO idempotency_keys (user_id, key, fingerprint, method, path, request_header, request_body,
			owner, lease_until, attempts, redrives, created_at, expires_at)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 0, ?, ?)
		ON CONFLICT (user_id, key) DO NOTHING`,
		p.User, p.Key, p.Fingerprint, p.Method, p.Path, c.header, p.Body,
		c.owner, c.leaseUntil, toNanos(c.now), c.expires)
	if err != nil {
		return false, interpretError("claim", err)
	}
	inserted, err := res.RowsAffected()
	if err != nil {
		return false, interpretError("claim", err)
	}
	return inserted != 0, nil
}

// claimExisting decides a claim of a key that has a record, read in tx:
// it replaces a completed, expired record by a new operation or takes
// over one whose lease ran out (and returns the lease written), or it
// answers the claim itself (answer: a replay, or an attempt's own lease
// sent again; or an error: mismatch, in flight).
func (c *claimRequest) claimExisting(ctx context.Context, tx *sql.Tx) (l claimedLease, answer *idemdriver.Claim, err error) {
	p, now := c.p, c.now
	rec, err := scanRecord(tx.QueryRowContext(ctx, selectRecord+` WHERE user_id = ? AND key = ?`, p.User, p.Key))
	if err != nil {
		return claimedLease{}, nil, interpretError("claim", err)
	}
	l = c.fresh()
	expiresIn := max(0, rec.ExpiresAt.Sub(now))
	var res sql.Result
	switch {
	case rec.Response != nil && !now.Before(rec.ExpiresAt):
		// Completed and expired: the key starts a new operation.
		res, err = tx.ExecContext(ctx, `
			UPDATE idempotency_keys SET fingerprint = ?, method = ?, path = ?, request_header = ?, request_body = ?,
				owner = ?, lease_until = ?, attempts = 1, redrives = 0,
				response_status = NULL, response_header = NULL, response_body = NULL, response_trailer = NULL,
				created_at = ?, completed_at = NULL, expires_at = ?
			WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NOT NULL`,
			p.Fingerprint, p.Method, p.Path, c.header, p.Body,
			c.owner, c.leaseUntil, toNanos(now), c.expires,
			p.User, p.Key, rec.Owner)
	case rec.Fingerprint != p.Fingerprint:
		return claimedLease{}, nil, idem.ErrFingerprintMismatch
	case rec.Response != nil:
		return claimedLease{}, &idemdriver.Claim{Response: rec.Response, ExpiresIn: expiresIn}, nil
	case p.Owner != "" && rec.Owner == p.Owner:
		// This attempt's own claim, sent again: its lease as stored.
		return claimedLease{}, &idemdriver.Claim{Lease: &idemdriver.Lease{
			User:      p.User,
			Key:       p.Key,
			Owner:     rec.Owner,
			Until:     rec.LeaseUntil,
			Attempt:   rec.Attempts,
			CreatedAt: rec.CreatedAt,
		}, ExpiresIn: expiresIn}, nil
	case now.Before(rec.LeaseUntil):
		return claimedLease{}, nil, &idem.InFlightError{LeaseUntil: rec.LeaseUntil}
	default:
		// The lease ran out: take the key over, whatever its expiry,
		// keeping the operation's CreatedAt and expiry.
		res, err = tx.ExecContext(ctx, `
			UPDATE idempotency_keys SET owner = ?, lease_until = ?, attempts = attempts + 1
			WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL`,
			c.owner, c.leaseUntil, p.User, p.Key, rec.Owner)
		l = claimedLease{attempts: rec.Attempts + 1, created: rec.CreatedAt, expires: toNanos(rec.ExpiresAt)}
	}
	if err := oneRowChanged(res, err); err != nil {
		return claimedLease{}, nil, err
	}
	return l, nil, nil
}

// oneRowChanged checks the result of Claim's conditional UPDATE. BEGIN
// IMMEDIATE took the write lock before the row was read, so no other
// writer can have changed it since: a miss is reported, not decided again.
func oneRowChanged(res sql.Result, err error) error {
	if err != nil {
		return interpretError("claim", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return interpretError("claim", err)
	} else if n == 0 {
		return errors.New("sqlitestore: claim: record changed under the write lock")
	}
	return nil
}

// commitLease commits Claim's transaction and returns the lease it took.
func commitLease(tx *sql.Tx, p idemdriver.ClaimParams, owner string, leaseUntil int64, attempt int, created time.Time, expiresIn time.Duration) (idemdriver.Claim, error) {
	if err := tx.Commit(); err != nil {
		return idemdriver.Claim{}, interpretError("claim", err)
	}
	return idemdriver.Claim{Lease: &idemdriver.Lease{
		User:      p.User,
		Key:       p.Key,
		Owner:     owner,
		Until:     fromNanos(leaseUntil),
		Attempt:   attempt,
		CreatedAt: created,
	}, ExpiresIn: expiresIn}, nil
}

// claimRedrive is Claim for a completer (p.Redrive set), in tx, the write
// transaction Claim began (BEGIN IMMEDIATE, so the row read cannot change
// before tx ends): it reads the row and decides in Go, by the store's
// clock now. It never inserts or replaces a record: it takes over only the
// operation the completer listed (p.Redrive.CreatedAt), only once its lease
// ran out and it is due by p.Redrive.Due (idemdriver.AbandonedParams.Due), and
// answers idem.ErrNotDue otherwise, changing nothing. The takeover counts
// in attempts and redrives.
func (s *Store) claimRedrive(ctx context.Context, tx *sql.Tx, p idemdriver.ClaimParams, now time.Time, owner string, leaseUntil int64) (idemdriver.Claim, error) {
	rec, err := scanRecord(tx.QueryRowContext(ctx, selectRecord+` WHERE user_id = ? AND key = ?`, p.User, p.Key))
	if errors.Is(err, sql.ErrNoRows) {
		return idemdriver.Claim{}, idem.ErrNotDue
	}
	if err != nil {
		return idemdriver.Claim{}, interpretError("claim", err)
	}
	created := toNanos(rec.CreatedAt)
	expiresIn := max(0, rec.ExpiresAt.Sub(now))
	switch {
	case rec.Response != nil || created != toNanos(p.Redrive.CreatedAt):
		// Answered, or another operation on the same key: not the one listed.
		return idemdriver.Claim{}, idem.ErrNotDue
	case rec.Fingerprint != p.Fingerprint:
		return idemdriver.Claim{}, idem.ErrFingerprintMismatch
	case p.Owner != "" && rec.Owner == p.Owner:
		// This completer's own takeover, sent again: its lease as stored.
		return idemdriver.Claim{Lease: &idemdriver.Lease{
			User:      p.User,
			Key:       p.Key,
			Owner:     rec.Owner,
			Until:     rec.LeaseUntil,
			Attempt:   rec.Attempts,
			CreatedAt: rec.CreatedAt,
		}, ExpiresIn: expiresIn}, nil
	case now.Before(rec.LeaseUntil):
		return idemdriver.Claim{}, &idem.InFlightError{LeaseUntil: rec.LeaseUntil}
	case !p.Redrive.Due.Due(rec, now):
		// In its backoff, or the budget is spent.
		return idemdriver.Claim{}, idem.ErrNotDue
	}
	// Compare-and-set on what was read; under the write lock it cannot
	// miss, and a miss is reported rather than decided again.
	res, err := tx.ExecContext(ctx, `
		UPDATE idempotency_keys SET owner = ?, lease_until = ?, attempts = attempts + 1, redrives = redrives + 1
		WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL
			AND lease_until <= ? AND created_at = ? AND redrives = ?`,
		owner, leaseUntil, p.User, p.Key, rec.Owner, toNanos(now), created, rec.Redrives)
	if err := oneRowChanged(res, err); err != nil {
		return idemdriver.Claim{}, err
	}
	return commitLease(tx, p, owner, leaseUntil, rec.Attempts+1, rec.CreatedAt, expiresIn)
}

// Begin implements idem.Store. It opens the transaction, taking the
// database's write lock until the Tx ends with Complete or Rollback, which
// the caller must make sure of; it does not check the lease (Complete does).
func (s *Store) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	unlock, err := s.lockWrites(ctx)
	if err != nil {
		return nil, err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		unlock()
		return nil, interpretError("begin", err)
	}
	return &Tx{s: s, lease: l, tx: tx, h: HandlerTx{tx}, unlock: unlock}, nil
}

// Release implements idem.Store.
func (s *Store) Release(ctx context.Context, l *idemdriver.Lease) error {
	unlock, err := s.lockWrites(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	res, err := s.db.ExecContext(ctx, `
		DELETE FROM idempotency_keys
		WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL`,
		l.User, l.Key, l.Owner)
	return fenced("release", res, err)
}

// Fail implements idem.Store. The attempt was counted when it claimed the
// key; Fail ends its lease so that a retry may take the key over at once.
func (s *Store) Fail(ctx context.Context, l *idemdriver.Lease) error {
	unlock, err := s.lockWrites(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	res, err := s.db.ExecContext(ctx, `
		UPDATE idempotency_keys SET lease_until = ?
		WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL`,
		toNanos(s.now()), l.User, l.Key, l.Owner)
	return fenced("fail", res, err)
}

// lockWrites waits for the store's turn in its database's write queue
// (see LockWrites), up to the busy timeout, and returns the function that
// lets the next writer go.
func (s *Store) lockWrites(ctx context.Context) (unlock func(), err error) {
	return s.writes.lock(ctx, s.lockWait)
}

// fenced interprets the result of a statement fenced on a lease's owner:
// no row means the lease was lost.
func fenced(op string, res sql.Result, err error) error {
	if err != nil {
		return interpretError(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return interpretError(op, err)
	}
	if n == 0 {
		return idem.ErrFenced
	}
	return nil
}

// interpretError translates an error of the database driver, once, at the
// store's edge: no row is idem.ErrNotFound, anything else is wrapped with
// the operation.
func interpretError(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, sql.ErrNoRows):
		return idem.ErrNotFound
	}
	return fmt.Errorf("sqlitestore: %s: %w", op, err)
}
