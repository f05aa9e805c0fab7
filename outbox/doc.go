// Package outbox is a transactional outbox: a service adds events to the
// table idem_outbox in the same database transaction as the writes they
// announce (an order, its stored answer), so they commit together or not
// at all, and a Relay publishes the committed events to a broker
// afterwards, marking each sent once the broker acknowledged it.
//
// Delivery is at least once: a relay that stops between the broker's
// acknowledgement and its commit publishes the event again, with the same
// Event.ID, which the broker (NATS JetStream's Nats-Msg-Id within its
// duplicate window) or the consumer (its own idempotency keys) drops.
//
// # Tables
//
// Package sqliteoutbox (modernc.org/sqlite) and package pgoutbox (pgx/v5's
// pgxpool), each a module of its own that pulls only its driver, keep
// the table in the caller's database: Migrate creates it (safe from
// several processes at once), Add writes an event in the caller's
// transaction, and Take, through the Table interface, is the relay's
// step: it holds ordering keys by locking each one's oldest unsent event,
// calls the publisher for a batch of those keys' events, and marks the
// published ones sent in the same transaction.
//
// # Order and sharing
//
// Events of one Event.OrderingKey are published in the order they were
// added, by one Take at a time, and a failed publish holds back its key's
// later events (only them). On PostgreSQL any number of relays share the
// table with FOR UPDATE SKIP LOCKED: each key's oldest unsent event, the
// key's lock, is held by at most one of them, and the others go on with
// other keys (see pgoutbox's Table.Take for why the order holds). On SQLite a Take
// holds the database's write lock (BEGIN IMMEDIATE), so relays take turns.
// Either way a Take publishes while it holds its locks: PublishTimeout
// (DefaultPublishTimeout) bounds how long, and what it did not publish by
// then is left for the next pass.
//
// # Keeping sent events
//
// A sent event stays in the table until it is deleted: both tables
// implement Sweeper, whose DeleteSent deletes, in batches, the events
// marked sent before a time (never an unsent one; an index on sent_at,
// from the tables' second migration, serves it). How long to keep them is
// the service's choice: as long as its audits compare the table with the
// broker's stream, and no longer than anything that would add a deleted
// event again (a backfill of events that looks for missing rows) can tell
// it was sent. Nothing deletes them by itself.
package outbox
