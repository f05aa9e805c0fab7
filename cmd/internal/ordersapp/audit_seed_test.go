package ordersapp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemnats"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/sqlitestore"
)

// Seeded orders: written straight into the database and stream ORDERS,
// each with everything the service writes for it (its idempotency key with
// the stored 201 answer, the in-process gateway's succeeded PaymentIntent,
// its orders.created event in the outbox marked sent, its message in the
// stream and its receipt), so that `orders audit` can be measured on
// millions of orders that it finds consistent. Order i is the one that
// user "u<i%1000>" made with key "k<i>", whose record was created at
// seedBase + i µs; every id and time follows from i, so the same i always
// seeds the same rows.

const (
	// seedPaymentsKey is --payments-key's default: the gateway account
	// whose PaymentIntents the audit lists.
	seedPaymentsKey = "sk_test_local"
	// seedKeyTTL is how long the seeded keys live: long, so that no
	// cleaner deletes them while seeded data is kept to audit again.
	seedKeyTTL   = 10 * 365 * 24 * time.Hour
	seedKeyLease = 30 * time.Second // serve's default --key-lease
	seedUsers    = 1000
	// The orders written in one transaction on SQLite, and copied in one
	// batch (one COPY per table) on PostgreSQL.
	seedSQLiteBatch   = 50_000
	seedPostgresBatch = 20_000
	// seedSQLiteCacheKiB is the page cache of a connection that writes a
	// batch on SQLite, in KiB: with SQLite's default (2 MB) the batch's
	// dirty pages spill to the WAL before the commit, and the random
	// indexes' pages are read again and again.
	seedSQLiteCacheKiB = 512 << 10
	// seedPublishWindow bounds the messages published and not yet
	// acknowledged by JetStream.
	seedPublishWindow = 2048
	// seedProgressEvery is how often seedAudit logs its progress.
	seedProgressEvery = 5 * time.Second
)

// seedBase is when the first seeded order's key was created.
var seedBase = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// seedRequest is the request that made every seeded order, for its
// fingerprint: the middleware hashes its method, path and body.
var seedRequest = &http.Request{Method: http.MethodPost, URL: &neturl.URL{Path: "/v1/orders"}}

// seedStage is how far the seeded orders' events have gone
// (seedAuditTo): every order, its key and its payment are written, with
// its event in the outbox, whatever the stage.
type seedStage int

const (
	// seedUnsent: the event is in the outbox unsent (sent_at NULL, no
	// attempt), not in the stream, and no receipt is written: as orders
	// wait for the relay.
	seedUnsent seedStage = iota
	// seedPublished: the event is marked sent and is in the stream, and
	// no receipt is written: as messages wait for the consumer.
	seedPublished
	// seedReceipted: the receipt is written too; the order is consistent
	// (seedAudit).
	seedReceipted
)

// seedOrder is one seeded order and what the service writes with it.
type seedOrder struct {
	o       orders.Order
	stage   seedStage // how far its event has gone
	request []byte    // the body of the POST that made it
	items   []byte    // its items' JSON, as the orders table keeps them
	// body is orders.OrderJSON: the stored answer, the event's body and
	// the message's data.
	body        []byte
	fingerprint string
	header      string // the stored answer's header, as JSON
	owner       string // the fencing token of the key's last attempt
	receiptID   string
	// When the gateway charged, the event was added (with the order), the
	// key was completed, the relay sent the event and the consumer wrote
	// the receipt (the last two as if the stage had been reached).
	paidAt, addedAt, completedAt, sentAt, receiptAt time.Time
}

// newSeedOrder returns seeded order i, its event at stage seedReceipted.
func newSeedOrder(i int) (seedOrder, error) {
	user, key := "u"+strconv.Itoa(i%seedUsers), "k"+strconv.Itoa(i)
	keyCreated := seedBase.Add(time.Duration(i) * time.Microsecond)
	items := []orders.Item{{SKU: "SKU-" + strconv.Itoa(i%7), Quantity: int64(1 + i%3), UnitPrice: int64(100 + i%900)}}
	s := seedOrder{stage: seedReceipted, o: orders.Order{
		ID:             orders.OrderID(user, key, keyCreated),
		UserID:         user,
		Status:         orders.StatusPaid,
		Items:          items,
		Total:          items[0].Quantity * items[0].UnitPrice,
		Currency:       "EUR",
		PaymentID:      seedID("payment", i, "pi_", 24, seedAlnum),
		CreatedAt:      keyCreated.Add(2 * time.Millisecond),
		IdempotencyKey: key,
		KeyCreatedAt:   keyCreated,
		EventAdded:     true,
	}}
	s.paidAt = keyCreated.Add(time.Millisecond)
	s.addedAt = s.o.CreatedAt.Add(100 * time.Microsecond)
	s.completedAt = s.o.CreatedAt.Add(200 * time.Microsecond)
	s.sentAt = s.o.CreatedAt.Add(5 * time.Millisecond)
	s.receiptAt = s.o.CreatedAt.Add(10 * time.Millisecond)
	s.owner = seedID("owner", i, "", 32, seedHex)
	s.receiptID = seedID("receipt", i, "rcp_", 24, seedHex)
	s.header = `{"Content-Type":["application/json"],"Location":["/v1/orders/` + s.o.ID + `"]}`
	var err error
	if s.request, err = json.Marshal(orders.CreateRequest{Items: items, Currency: s.o.Currency}); err != nil {
		return s, err
	}
	if s.items, err = json.Marshal(items); err != nil {
		return s, err
	}
	if s.body, err = orders.OrderJSON(&s.o); err != nil {
		return s, err
	}
	if s.fingerprint, err = idem.Fingerprint(seedRequest, s.request); err != nil {
		return s, err
	}
	return s, nil
}

// The alphabets of seeded ids: Stripe's ids are alphanumeric, the
// service's own hexadecimal.
const (
	seedAlnum = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
	seedHex   = "0123456789abcdef"
)

// seedID returns prefix and n (at most 32) characters of alphabet drawn
// from the hash of kind and i: the same for every run, where the service
// draws them at random.
func seedID(kind string, i int, prefix string, n int, alphabet string) string {
	raw := sha256.Sum256([]byte("seed/" + kind + "/" + strconv.Itoa(i)))
	b := make([]byte, len(prefix)+n)
	copy(b, prefix)
	for k := range n {
		b[len(prefix)+k] = alphabet[int(raw[k])%len(alphabet)]
	}
	return string(b)
}

// seedAudit writes orders first … first+n-1 (newSeedOrder) into be's
// database and js's stream ORDERS as the service would have written them:
// the order (paid, marked event_added), its idempotency key completed with
// the 201 answer the middleware stores, the in-process gateway's succeeded
// PaymentIntent (metadata order_ref, amount the total), the orders.created
// event in the outbox marked sent, its message in the stream (Nats-Msg-Id
// the event id) and the receipt the consumer writes. It creates the
// gateway's ledger and the stream when they do not exist yet, and records
// the stream in the database when it records none. It writes batches:
// on PostgreSQL seedPostgresBatch orders, each table's rows copied by one
// COPY, the tables' at once (seedPostgres); on SQLite seedSQLiteBatch
// orders in one transaction of each database (seedSQLite). The messages
// of a batch are published while it is written, and the next batch is
// built meanwhile. It logs its progress and rates to tb. A batch that
// fails may be written in part.
func seedAudit(ctx context.Context, tb testing.TB, be *backend, js jetstream.JetStream, first, n int) error {
	return seedAuditTo(ctx, tb, be, js, first, n, seedReceipted)
}

// seedAuditTo is seedAudit with the orders' events taken only as far as
// stage: at seedUnsent they wait in the outbox for a relay (no message, no
// receipt), at seedPublished in the stream for a consumer (no receipt).
// The stream is created (and recorded) whatever the stage.
func seedAuditTo(ctx context.Context, tb testing.TB, be *backend, js jetstream.JetStream, first, n int, stage seedStage) error {
	gst, _, err := be.gateway(ctx)
	if err != nil {
		return fmt.Errorf("the in-process gateway: %w", err)
	}
	st, err := idemnats.EnsureStream(ctx, js, streamConfig(0, 0, slog.New(slog.DiscardHandler)))
	if err != nil {
		return fmt.Errorf("stream %s: %w", eventStream, err)
	}
	if err := be.putStream(ctx, streamIdentity(st), redactNATS(js.Conn().ConnectedUrl()), false); err != nil {
		return fmt.Errorf("recording stream %s: %w", eventStream, err)
	}

	var (
		write func(context.Context, []seedOrder) error
		batch int
	)
	switch {
	case be.pg != nil:
		write = func(ctx context.Context, rows []seedOrder) error { return seedPostgres(ctx, be.pg, rows) }
		batch = seedPostgresBatch
	default:
		orderStore, ok1 := be.store.(*sqlitestore.Store)
		gwStore, ok2 := gst.(*sqlitestore.Store)
		if !ok1 || !ok2 {
			return fmt.Errorf("seeding needs SQLite or PostgreSQL, not %T and %T", be.store, gst)
		}
		db, err := openSeedSQLite(ctx, orderStore.DB())
		if err != nil {
			return err
		}
		defer db.close()
		gw, err := openSeedSQLite(ctx, gwStore.DB())
		if err != nil {
			return err
		}
		defer gw.close()
		write = func(ctx context.Context, rows []seedOrder) error { return seedSQLite(ctx, db, gw, rows) }
		batch = seedSQLiteBatch
	}

	// The batches are built ahead of the one being written.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type built struct {
		rows []seedOrder
		err  error
	}
	batches := make(chan built, 1)
	go func() {
		defer close(batches)
		for start := first; start < first+n; start += batch {
			rows := make([]seedOrder, min(batch, first+n-start))
			var err error
			for k := range rows {
				if rows[k], err = newSeedOrder(start + k); err != nil {
					break
				}
				rows[k].stage = stage
			}
			select {
			case batches <- built{rows, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()

	began, lastLog := time.Now(), time.Now()
	var done, publishedMsgs int
	var dbTime, publishTime time.Duration
	for b := range batches {
		if b.err != nil {
			return b.err
		}
		published := make(chan error, 1)
		toPublish := seedAtLeast(b.rows, seedPublished)
		publishedMsgs += len(toPublish)
		go func() {
			t0 := time.Now()
			err := seedPublish(ctx, js, toPublish)
			publishTime += time.Since(t0) // read after the receive below
			published <- err
		}()
		t0 := time.Now()
		err := write(ctx, b.rows)
		dbTime += time.Since(t0)
		if perr := <-published; err != nil || perr != nil {
			return errors.Join(err, perr)
		}
		done += len(b.rows)
		if time.Since(lastLog) >= seedProgressEvery {
			lastLog = time.Now()
			tb.Logf("seeded %d of %d orders (%.0f orders/s)", done, n, float64(done)/time.Since(began).Seconds())
		}
	}
	if done != n {
		return fmt.Errorf("seeded %d orders of %d", done, n)
	}
	el := time.Since(began)
	tb.Logf("seeded orders %d to %d (events %s) in %s: %.0f orders/s; database writes %s (%.0f orders/s), publishing %d messages to stream %s %s (%.0f messages/s), at once",
		first, first+n-1, stage, el.Round(time.Millisecond), float64(n)/el.Seconds(),
		dbTime.Round(time.Millisecond), float64(n)/dbTime.Seconds(), publishedMsgs, eventStream, publishTime.Round(time.Millisecond),
		float64(publishedMsgs)/max(publishTime.Seconds(), 1e-9))
	return nil
}

// String names the stage for seedAuditTo's log.
func (s seedStage) String() string {
	switch s {
	case seedUnsent:
		return "unsent"
	case seedPublished:
		return "published, no receipts"
	case seedReceipted:
		return "published and receipted"
	}
	return "stage " + strconv.Itoa(int(s))
}

// seedAtLeast returns the rows whose event has reached stage, in their
// order: all of rows (not a copy) when every one has.
func seedAtLeast(rows []seedOrder, stage seedStage) []seedOrder {
	if !slices.ContainsFunc(rows, func(s seedOrder) bool { return s.stage < stage }) {
		return rows
	}
	var out []seedOrder
	for _, s := range rows {
		if s.stage >= stage {
			out = append(out, s)
		}
	}
	return out
}

// seedPublish publishes the messages of rows to stream ORDERS as the relay
// does (subject orders.created, Nats-Msg-Id the event id, data the
// order's JSON), asynchronously, at most seedPublishWindow awaiting their
// acknowledgement. A message JetStream reports as a duplicate is an error:
// its order was seeded before.
func seedPublish(ctx context.Context, js jetstream.JetStream, rows []seedOrder) error {
	pending := make([]jetstream.PubAckFuture, seedPublishWindow) // a ring, by row
	wait := func(f jetstream.PubAckFuture) error {
		select {
		case ack := <-f.Ok():
			if ack.Duplicate {
				return fmt.Errorf("message %s is already in stream %s", f.Msg().Header.Get(jetstream.MsgIDHeader), eventStream)
			}
			return nil
		case err := <-f.Err():
			return fmt.Errorf("publishing %s: %w", f.Msg().Header.Get(jetstream.MsgIDHeader), err)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for k := range rows {
		slot := k % seedPublishWindow
		if f := pending[slot]; f != nil {
			if err := wait(f); err != nil {
				return err
			}
		}
		msg := &nats.Msg{Subject: eventSubject, Header: nats.Header{jetstream.MsgIDHeader: {orders.EventID(rows[k].o.ID)}}, Data: rows[k].body}
		f, err := js.PublishMsgAsync(msg)
		if err != nil {
			return fmt.Errorf("publishing %s: %w", orders.EventID(rows[k].o.ID), err)
		}
		pending[slot] = f
	}
	for _, f := range pending {
		if f != nil {
			if err := wait(f); err != nil {
				return err
			}
		}
	}
	return nil
}

// seedSQLiteTime is how the orders' tables on SQLite keep a time: UTC RFC
// 3339 text with nine fractional digits (package orders' formatTime).
func seedSQLiteTime(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000000000Z07:00") }

// seedSQLiteConn is the connection to one SQLite database that seedAudit
// writes through: one connection for every batch, whose page cache is
// seedSQLiteCacheKiB until close.
type seedSQLiteConn struct {
	db    *sql.DB
	conn  *sql.Conn
	cache int64 // the connection's page cache before
}

// openSeedSQLite takes a connection of db for seeding.
func openSeedSQLite(ctx context.Context, db *sql.DB) (*seedSQLiteConn, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	c := &seedSQLiteConn{db: db, conn: conn}
	err = conn.QueryRowContext(ctx, `PRAGMA cache_size`).Scan(&c.cache)
	if err == nil {
		_, err = conn.ExecContext(ctx, `PRAGMA cache_size = `+strconv.Itoa(-seedSQLiteCacheKiB))
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	return c, nil
}

// close gives the connection its page cache back and returns it to db.
func (c *seedSQLiteConn) close() {
	// A connection that cannot take its cache back is closed anyway.
	_, _ = c.conn.ExecContext(context.Background(), `PRAGMA cache_size = `+strconv.FormatInt(c.cache, 10))
	c.conn.Close()
}

// tx runs fn in a write transaction of the connection, in this process's
// turn among the database's writers, and commits.
func (c *seedSQLiteConn) tx(ctx context.Context, fn func(*sql.Tx) error) error {
	unlock, err := sqlitestore.LockWrites(ctx, c.db)
	if err != nil {
		return err
	}
	defer unlock()
	tx, err := c.conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// seedSQLite writes rows in one transaction of the orders' database db
// and, at the same time, one of the gateway's gw.
func seedSQLite(ctx context.Context, db, gw *seedSQLiteConn, rows []seedOrder) error {
	paid := make(chan error, 1)
	go func() { paid <- gw.tx(ctx, func(tx *sql.Tx) error { return seedSQLitePayments(ctx, tx, rows) }) }()
	err := db.tx(ctx, func(tx *sql.Tx) error { return seedSQLiteOrders(ctx, tx, rows) })
	return errors.Join(err, <-paid)
}

// seedSQLiteInsert prepares query, an INSERT of one row of table, in tx
// and runs it for each of rows, in the order of key (seedOrderBy), with
// the arguments args returns for row k.
func seedSQLiteInsert(ctx context.Context, tx *sql.Tx, table, query string, rows []seedOrder, key func(*seedOrder) string, args func(k int, s *seedOrder) []any) error {
	stmt, err := tx.PrepareContext(ctx, query)
	if err != nil {
		return fmt.Errorf("%s: %w", table, err)
	}
	defer stmt.Close()
	order := seedOrderBy(rows, key)
	for _, k := range order {
		if _, err := stmt.ExecContext(ctx, args(k, &rows[k])...); err != nil {
			return fmt.Errorf("%s: order %s: %w", table, rows[k].o.ID, err)
		}
	}
	return nil
}

// seedSQLiteOrders inserts the orders, their keys, events and receipts.
func seedSQLiteOrders(ctx context.Context, tx *sql.Tx, rows []seedOrder) error {
	err := seedSQLiteInsert(ctx, tx, "orders", `INSERT INTO orders
		(id, user_id, status, items, total, currency, payment_id, idempotency_key, idempotency_key_created_at, created_at, event_added)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)`, rows, seedByOrderID, func(_ int, s *seedOrder) []any {
		o := &s.o
		return []any{o.ID, o.UserID, o.Status, string(s.items), o.Total, o.Currency, o.PaymentID,
			o.IdempotencyKey, seedSQLiteTime(o.KeyCreatedAt), seedSQLiteTime(o.CreatedAt)}
	})
	if err != nil {
		return err
	}
	// Times in Unix nanoseconds; the request's body and headers are not
	// kept (request_header is the JSON of an empty http.Header).
	err = seedSQLiteInsert(ctx, tx, "idempotency_keys", `INSERT INTO idempotency_keys
		(user_id, key, fingerprint, method, path, request_header, request_body, owner, lease_until, attempts,
		 response_status, response_header, response_body, created_at, completed_at, expires_at, redrives, response_trailer)
		VALUES (?, ?, ?, 'POST', '/v1/orders', '{}', NULL, ?, ?, 1, 201, ?, ?, ?, ?, ?, 0, NULL)`, rows, seedByKey, func(_ int, s *seedOrder) []any {
		o := &s.o
		return []any{o.UserID, o.IdempotencyKey, s.fingerprint, s.owner, o.KeyCreatedAt.Add(seedKeyLease).UnixNano(),
			s.header, s.body, o.KeyCreatedAt.UnixNano(), s.completedAt.UnixNano(), o.KeyCreatedAt.Add(seedKeyTTL).UnixNano()}
	})
	if err != nil {
		return err
	}
	// seq goes on from the largest there is, as sqliteoutbox's Add draws
	// it, in the orders' order (k), whatever the order of the inserts.
	var seq int64
	if err := tx.QueryRowContext(ctx, `SELECT coalesce(max(seq), 0) FROM idem_outbox`).Scan(&seq); err != nil {
		return fmt.Errorf("idem_outbox: %w", err)
	}
	err = seedSQLiteInsert(ctx, tx, "idem_outbox", `INSERT INTO idem_outbox
		(id, seq, ordering_key, subject, body, created_at, sent_at, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)`, rows, seedByOrderID, func(k int, s *seedOrder) []any {
		o := &s.o
		sentAt, attempts := seedSent(s)
		if sentAt != nil {
			sentAt = s.sentAt.UnixNano()
		}
		return []any{orders.EventID(o.ID), seq + 1 + int64(k), o.UserID, eventSubject, s.body, s.addedAt.UnixNano(), sentAt, attempts}
	})
	if err != nil {
		return err
	}
	return seedSQLiteInsert(ctx, tx, "receipts", `INSERT INTO receipts
		(id, order_id, event_id, user_id, total, currency, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)`, seedAtLeast(rows, seedReceipted), seedByReceiptID, func(_ int, s *seedOrder) []any {
		o := &s.o
		return []any{s.receiptID, o.ID, orders.EventID(o.ID), o.UserID, o.Total, o.Currency, seedSQLiteTime(s.receiptAt)}
	})
}

// seedSent returns the outbox columns sent_at (nil: NULL, unsent) and
// attempts of s's event.
func seedSent(s *seedOrder) (sentAt any, attempts int32) {
	if s.stage < seedPublished {
		return nil, 0
	}
	return s.sentAt, 1
}

// seedSQLitePayments inserts the orders' PaymentIntents into the
// in-process gateway's ledger, as the gateway writes a succeeded one
// (created_at in Unix nanoseconds).
func seedSQLitePayments(ctx context.Context, tx *sql.Tx, rows []seedOrder) error {
	account := payments.AccountFor(seedPaymentsKey)
	return seedSQLiteInsert(ctx, tx, "payment_intents", `INSERT INTO payment_intents
		(id, account, amount, amount_capturable, amount_received, currency, status, capture_method, confirmation_method,
		 description, livemode, metadata, payment_method, payment_method_types, last_payment_error, created, amount_refunded, created_at)
		VALUES (?, ?, ?, 0, ?, ?, ?, 'automatic', 'automatic', NULL, 0, ?, 'pm_card_visa', '["card"]', NULL, ?, 0, ?)`, rows, seedByPaymentID, func(_ int, s *seedOrder) []any {
		o := &s.o
		return []any{o.PaymentID, account, o.Total, o.Total, strings.ToLower(o.Currency), payments.StatusSucceeded,
			seedMetadata(o.ID), s.paidAt.Unix(), s.paidAt.UnixNano()}
	})
}

// seedMetadata is the PaymentIntent's metadata: the order's reference.
func seedMetadata(orderID string) string { return `{"order_ref":"` + orderID + `"}` }

// seedPostgresTable is one table that seedPostgres copies into: its
// columns, what sorts its rows (its primary key), a row's values, and the
// stage an order's event must have reached for its row to be written.
type seedPostgresTable struct {
	name   pgx.Identifier
	cols   []string
	key    func(s *seedOrder) string
	values func(s *seedOrder) []any
	stage  seedStage
}

// seedPostgresTables are the tables of the orders and of the in-process
// gateway's ledger (in its schema, payments.DefaultSchema, of the same
// database), as the service and the gateway write them.
var seedPostgresTables = []seedPostgresTable{
	{pgx.Identifier{"orders"}, []string{"id", "user_id", "status", "items", "total", "currency", "payment_id",
		"idempotency_key", "idempotency_key_created_at", "created_at", "event_added"},
		seedByOrderID,
		func(s *seedOrder) []any {
			o := &s.o
			return []any{o.ID, o.UserID, o.Status, s.items, o.Total, o.Currency, o.PaymentID, o.IdempotencyKey, o.KeyCreatedAt, o.CreatedAt, true}
		}, seedUnsent},
	// request_body and response_trailer stay NULL.
	{pgx.Identifier{"idempotency_keys"}, []string{"user_id", "key", "fingerprint", "method", "path", "request_header", "owner",
		"lease_until", "attempts", "response_status", "response_header", "response_body", "created_at", "completed_at", "expires_at", "redrives"},
		seedByKey,
		func(s *seedOrder) []any {
			o := &s.o
			return []any{o.UserID, o.IdempotencyKey, s.fingerprint, "POST", "/v1/orders", "{}", s.owner, o.KeyCreatedAt.Add(seedKeyLease), int32(1),
				int32(201), s.header, s.body, o.KeyCreatedAt, s.completedAt, o.KeyCreatedAt.Add(seedKeyTTL), int32(0)}
		}, seedUnsent},
	// seq is drawn by the table (an identity column), as in Add: the
	// events are copied in the order of the orders, so that one user's
	// follow each other in seq.
	{pgx.Identifier{"idem_outbox"}, []string{"id", "ordering_key", "subject", "body", "created_at", "sent_at", "attempts"},
		nil,
		func(s *seedOrder) []any {
			sentAt, attempts := seedSent(s)
			return []any{orders.EventID(s.o.ID), s.o.UserID, eventSubject, s.body, s.addedAt, sentAt, attempts}
		}, seedUnsent},
	{pgx.Identifier{"receipts"}, []string{"id", "order_id", "event_id", "user_id", "total", "currency", "created_at"},
		seedByReceiptID,
		func(s *seedOrder) []any {
			o := &s.o
			return []any{s.receiptID, o.ID, orders.EventID(o.ID), o.UserID, o.Total, o.Currency, s.receiptAt}
		}, seedReceipted},
	// description and last_payment_error stay NULL.
	{pgx.Identifier{payments.DefaultSchema, "payment_intents"}, []string{"id", "account", "amount", "amount_capturable", "amount_received",
		"currency", "status", "capture_method", "confirmation_method", "livemode", "metadata", "payment_method", "payment_method_types",
		"created", "amount_refunded", "created_at"},
		seedByPaymentID,
		func(s *seedOrder) []any {
			o := &s.o
			return []any{o.PaymentID, payments.AccountFor(seedPaymentsKey), o.Total, int64(0), o.Total, strings.ToLower(o.Currency), payments.StatusSucceeded,
				"automatic", "automatic", false, seedMetadata(o.ID), "pm_card_visa", `["card"]`, s.paidAt.Unix(), int64(0), s.paidAt}
		}, seedUnsent},
}

// seedPostgres copies rows into every table (seedPostgresTables) of
// pool's database, all at once, one COPY (and transaction) per table; a
// table gets the rows whose event has reached its stage.
func seedPostgres(ctx context.Context, pool *pgxpool.Pool, rows []seedOrder) error {
	errs := make(chan error, len(seedPostgresTables))
	for _, t := range seedPostgresTables {
		go func() {
			rows := seedAtLeast(rows, t.stage)
			if len(rows) == 0 {
				errs <- nil
				return
			}
			order := seedOrderBy(rows, t.key)
			src := pgx.CopyFromSlice(len(order), func(k int) ([]any, error) { return t.values(&rows[order[k]]), nil })
			if _, err := pool.CopyFrom(ctx, t.name, t.cols, src); err != nil {
				errs <- fmt.Errorf("copying into %s: %w", t.name.Sanitize(), err)
				return
			}
			errs <- nil
		}()
	}
	var err error
	for range seedPostgresTables {
		err = errors.Join(err, <-errs)
	}
	return err
}

// The orders of the tables' rows (seedOrderBy): by their primary keys.
func seedByOrderID(s *seedOrder) string   { return s.o.ID }
func seedByKey(s *seedOrder) string       { return s.o.UserID + "\x00" + s.o.IdempotencyKey }
func seedByReceiptID(s *seedOrder) string { return s.receiptID }
func seedByPaymentID(s *seedOrder) string { return s.o.PaymentID }

// seedOrderBy returns the indexes of rows sorted by key (nil: as they
// are). Rows written in the order of a table's primary key fill its
// index's pages one after the other, instead of one page at random for
// each row.
func seedOrderBy(rows []seedOrder, key func(*seedOrder) string) []int {
	order := make([]int, len(rows))
	for k := range order {
		order[k] = k
	}
	if key == nil {
		return order
	}
	keys := make([]string, len(rows))
	for k := range rows {
		keys[k] = key(&rows[k])
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(keys[a], keys[b]) })
	return order
}

// TestAuditSeededIsClean: the audit finds seeded orders consistent, on
// SQLite and on PostgreSQL, and counts each of them once in every table
// and in the stream; the service replays a seeded key's stored answer.
func TestAuditSeededIsClean(t *testing.T) {
	skipInShort(t, "seeds orders and runs the audit")
	t.Run("sqlite", func(t *testing.T) { auditSeededIsClean(t, "") })
	t.Run("postgres", func(t *testing.T) { auditSeededIsClean(t, pgtest.Database(t)) })
}

// auditSeededIsClean seeds orders into a service's database (dbURL, or
// SQLite in its data dir when empty) and the stream of its embedded NATS,
// in two calls, and audits them.
func auditSeededIsClean(t *testing.T, dbURL string) {
	const n = 3000
	ctx := context.Background()
	c := Config{DataDir: t.TempDir(), DatabaseURL: dbURL, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: seedKeyLease,
		PaymentsKey: seedPaymentsKey, RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	for _, part := range [][2]int{{0, n / 3}, {n / 3, n - n/3}} { // a second call goes on from the first
		if err := seedAudit(ctx, t, srv.backend, srv.broker.js, part[0], part[1]); err != nil {
			t.Fatalf("seeding orders %d to %d: %v", part[0], part[0]+part[1]-1, err)
		}
	}

	rep, err := runAudit(ctx, srv.backend, srv.payer, srv.broker.js, nil)
	if err != nil {
		t.Fatalf("audit: %v", err)
	}
	var out bytes.Buffer
	rep.print(&out)
	ev := rep.events
	counts := []struct {
		what      string
		got, want int
	}{
		{"orders", rep.Orders, n},
		{"keys", rep.Keys, n},
		{"keys with a stored answer", rep.KeysCompleted, n},
		{"keys without one", rep.KeysPending, 0},
		{"operations", rep.Operations, 0},
		{"payments", rep.Charges, n},
		{"succeeded payments", rep.ChargesSucceeded, n},
		{"refunded payments", rep.ChargesRefunded, 0},
		{"pending", len(rep.Pending), 0},
		{"given up", len(rep.GivenUp), 0},
		{"events in the outbox", ev.Events, n},
		{"events sent", ev.EventsSent, n},
		{"events unsent", ev.EventsUnsent, 0},
		{"orders with one event", ev.EventsPerOrder[1], n},
		{"stream messages", ev.StreamMsgs, n},
		{"distinct message ids", ev.StreamIDs, n},
		{"repeated message ids", ev.Repeats, 0},
		{"receipts", ev.Receipts, n},
		{"orders with one receipt", ev.ReceiptsPerOrder[1], n},
		{"receipts pending", ev.ReceiptsPending, 0},
		{"violations", len(rep.Violations), 0},
	}
	for _, c := range counts {
		if c.got != c.want {
			t.Errorf("audit counted %d %s, want %d", c.got, c.what, c.want)
		}
	}
	if t.Failed() {
		t.Logf("audit report:\n%s", tail(out.String(), 40))
	}

	// The middleware replays a seeded key's stored answer: its fingerprint
	// is the request's, and the order reads back as the answer shows it.
	hs := httptest.NewServer(srv.handler)
	defer hs.Close()
	for _, i := range []int{0, n - 1} {
		s, err := newSeedOrder(i)
		if err != nil {
			t.Fatal(err)
		}
		status, body, replayed := seedPost(t, hs.URL, s)
		if status != http.StatusCreated || body != string(s.body) || replayed != "true" {
			t.Errorf("order %d sent again: %d %q replayed=%q; want 201, the seeded answer %q, replayed", i, status, body, replayed, s.body)
		}
	}
}

// seedPost sends again the request that made seeded order s and returns
// the answer's status, body and Idempotent-Replayed header.
func seedPost(t *testing.T, base string, s seedOrder) (status int, body, replayed string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+"/v1/orders", bytes.NewReader(s.request))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token(t, s.o.UserID))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", s.o.IdempotencyKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header.Get("Idempotent-Replayed")
}

// TestAuditAtScale measures `orders audit` on ORDERS_AUDIT_SCALE seeded
// orders in a new database (ORDERS_AUDIT_STORE: sqlite, in a new data
// dir, or postgres, database audit_scale dropped and made again) with
// their stream on the data dir's embedded NATS, run by this test: the
// audit joins it through <data-dir>/nats.url, as it joins serve's. It logs
// the seeding's rate, and the audit's wall time, maximum resident memory
// and report; it fails if the audit does not exit 0 with every order
// counted. With ORDERS_AUDIT_KEEP=1 the data stays, for the audit to be
// run again by hand.
func TestAuditAtScale(t *testing.T) {
	n, err := strconv.Atoi(os.Getenv("ORDERS_AUDIT_SCALE"))
	store := os.Getenv("ORDERS_AUDIT_STORE")
	if err != nil || n <= 0 || (store != "sqlite" && store != "postgres") {
		t.Skip("measures the audit on many seeded orders: set ORDERS_AUDIT_SCALE to a number of orders and ORDERS_AUDIT_STORE to sqlite or postgres " +
			"(e.g. ORDERS_AUDIT_SCALE=1000000 ORDERS_AUDIT_STORE=postgres go test ./internal/ordersapp -run TestAuditAtScale -v -timeout 0; " +
			"ORDERS_AUDIT_KEEP=1 keeps the data)")
	}
	keep := os.Getenv("ORDERS_AUDIT_KEEP") == "1"
	ctx := context.Background()
	dir := t.TempDir()
	if keep {
		if dir, err = os.MkdirTemp("", "orders-audit-scale-"); err != nil {
			t.Fatal(err)
		}
	}
	c := Config{DataDir: dir, KeyLease: seedKeyLease, PaymentsKey: seedPaymentsKey}
	if store == "postgres" {
		c.DatabaseURL = scaleDatabase(t, "audit_scale", !keep)
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))

	// The data dir's embedded NATS, started and recorded as serve does.
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	b, err := openBroker(ctx, &c, brokerOptions{mode: brokerOwn, client: "audit seed", publishURL: true, logger: logger})
	if err != nil {
		be.close()
		t.Fatal(err)
	}
	t.Cleanup(b.close)
	if err := checkEmbeddedStream(ctx, be, b, 0, 0, logger); err != nil {
		be.close()
		t.Fatal(err)
	}
	t.Logf("seeding %d orders on %s, stream %s on %s", n, be.name, eventStream, b.name)
	err = seedAudit(ctx, t, be, b.js, 0, n)
	if err == nil && be.pg != nil {
		// As a database that has run a while: its tables vacuumed and
		// analysed, not by autovacuum in the middle of the audit.
		t0 := time.Now()
		_, err = be.pg.Exec(ctx, `VACUUM (ANALYZE)`)
		t.Logf("VACUUM (ANALYZE) took %s", time.Since(t0).Round(time.Millisecond))
	}
	be.close()
	if err != nil {
		t.Fatal(err)
	}

	bin := filepath.Join(t.TempDir(), "orders")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/idem-go/idem/cmd/orders").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	args := []string{"audit", "--data-dir", dir}
	if c.DatabaseURL != "" {
		args = append(args, "--database-url", c.DatabaseURL)
	}
	// GNU time reports the audit's own peak RSS. The rusage of a child
	// of this process would not: Linux records the peak of the memory a
	// child replaces at exec, and the child shares this process's memory
	// until then (os/exec clones with CLONE_VM), so its maximum RSS would
	// be this process's, seeded data and NATS included.
	timeBin, err := exec.LookPath("time")
	if _, statErr := os.Stat("/usr/bin/time"); statErr == nil {
		timeBin, err = "/usr/bin/time", nil
	}
	if err != nil {
		t.Fatalf("GNU time (Debian's package time) measures the audit's peak RSS: %v", err)
	}
	const rssMark = "orders-audit-max-rss-kb="
	cmd := exec.Command(timeBin, append([]string{"-f", rssMark + "%M", bin}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	t0 := time.Now()
	err = cmd.Run()
	wall := time.Since(t0)
	var maxRSS int64
	if i := strings.LastIndex(stderr.String(), rssMark); i >= 0 {
		maxRSS, _ = strconv.ParseInt(strings.TrimSpace(stderr.String()[i+len(rssMark):]), 10, 64)
	}
	t.Logf("orders %s: %d orders (%s) in %.1f s wall, max RSS %d KB (%.0f MB), %.0f orders/s; exit %v",
		strings.Join(args, " "), n, store, wall.Seconds(), maxRSS, float64(maxRSS)/1024, float64(n)/wall.Seconds(), err)
	t.Logf("audit stdout:\n%s", stdout.String())
	t.Logf("audit stderr (last lines):\n%s", tail(stderr.String(), 10))
	if err != nil {
		t.Errorf("orders audit: %v", err)
	}
	if !strings.Contains(stdout.String(), "OK: every invariant holds") || !strings.Contains(stdout.String(), fmt.Sprintf("orders:            %d\n", n)) {
		t.Errorf("the audit did not say OK with %d orders", n)
	}
	if keep {
		where, again := dir, "orders audit --data-dir "+dir
		if c.DatabaseURL != "" {
			where += " and " + c.DatabaseURL
			again += " --database-url " + c.DatabaseURL
		}
		t.Logf("ORDERS_AUDIT_KEEP=1: the data stays in %s; to audit it again (the audit then starts the data dir's NATS itself): %s", where, again)
	}
}

// scaleDatabase drops the PostgreSQL database name on the test server if
// it exists, creates it again and returns its URL; with drop, it is
// dropped when t ends.
func scaleDatabase(t *testing.T, name string, drop bool) string {
	t.Helper()
	admin := pgtest.URL(t)
	ctx := context.Background()
	execAdmin := func(sql string) {
		t.Helper()
		conn, err := pgx.Connect(ctx, admin)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	ident := pgx.Identifier{name}.Sanitize()
	execAdmin("DROP DATABASE IF EXISTS " + ident + " WITH (FORCE)")
	execAdmin("CREATE DATABASE " + ident)
	if drop {
		t.Cleanup(func() { execAdmin("DROP DATABASE IF EXISTS " + ident + " WITH (FORCE)") })
	}
	u, err := neturl.Parse(admin)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}
