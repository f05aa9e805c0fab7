package sqlitestore

import (
	"context"
	"database/sql"
	"fmt"
	"runtime"
	"sync"
	"time"
	"weak"
)

// writeQueue is the queue in which the writers of one *sql.DB of this
// process wait for their turn. SQLite lets one connection write at a
// time, and its busy handler polls for the lock with sleeps of up to
// 100ms: a writer that ends a transaction and begins the next one at once
// (a relay draining a backlog) takes the lock again before a polling
// waiter wakes, and the waiter runs out of busy_timeout. Waiting in this
// queue first hands the lock over in the order the writers came, and
// keeps waiting writers from holding connections.
type writeQueue struct {
	token chan struct{}
	busy  time.Duration // how long a writer waits here before ErrBusy
}

// writeQueues maps each *sql.DB (held weakly: a pool that is no longer
// used takes its entry with it) to its writeQueue.
var writeQueues sync.Map // weak.Pointer[sql.DB] → *writeQueue

// queueOf returns db's write queue, making it on first use with busy as
// its wait (later calls keep the first one's).
func queueOf(db *sql.DB, busy time.Duration) *writeQueue {
	k := weak.Make(db)
	if q, ok := writeQueues.Load(k); ok {
		return q.(*writeQueue)
	}
	q, loaded := writeQueues.LoadOrStore(k, &writeQueue{token: make(chan struct{}, 1), busy: busy})
	if !loaded {
		runtime.AddCleanup(db, func(k weak.Pointer[sql.DB]) { writeQueues.Delete(k) }, k)
	}
	return q.(*writeQueue)
}

// LockWrites waits until no other writer of db in this process holds
// db's write queue, and returns the function that lets the next one go
// (safe to call more than once). It waits up to the busy timeout of the
// Store that opened db (DefaultBusyTimeout for a pool that no Store
// opened), then fails with an error matching ErrBusy; or until ctx ends.
//
// The Store takes it around each of its write transactions, and
// sqliteoutbox's Take around its pass. Take it also around write
// transactions of your own on Store.DB() (a BeginTx on it is BEGIN
// IMMEDIATE): then this process's writers take SQLite's write lock in
// turn, and none is starved by another that writes again as soon as it
// commits. The queue is db's, the pool's, not the file's: writers of
// another *sql.DB on the same file, in this process (a second Open of the
// path, an outbox table given a pool of its own) or in another, are kept
// apart from these only by SQLite's own lock (busy_timeout, then
// SQLITE_BUSY), which is still safe but hands the lock over by polling,
// not in turn; give every writer of the process the Store's DB(). Do not
// take it twice in one goroutine: the second call waits for the first.
// Inside an idempotent request the same holds across goroutines: the
// request's transaction, once begun (FromContext), holds db's queue until
// the middleware ends it, so a LockWrites there waits for its own request
// up to the busy timeout (and one held while the handler begins the
// transaction makes the transaction wait for it); write through the
// request's transaction instead.
func LockWrites(ctx context.Context, db *sql.DB) (unlock func(), err error) {
	return queueOf(db, DefaultBusyTimeout).lock(ctx, nil)
}

// lock is LockWrites on q; onWait, if not nil, is called when the writer
// has to wait.
func (q *writeQueue) lock(ctx context.Context, onWait func()) (unlock func(), err error) {
	select {
	case q.token <- struct{}{}:
	default:
		if onWait != nil {
			onWait()
		}
		t := time.NewTimer(q.busy)
		defer t.Stop()
		select {
		case q.token <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-t.C:
			return nil, fmt.Errorf("sqlitestore: %w: no write lock after %v", ErrBusy, q.busy)
		}
	}
	var once sync.Once
	return func() { once.Do(func() { <-q.token }) }, nil
}
