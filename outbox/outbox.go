package outbox

import (
	"context"
	"errors"
	"time"
)

// Component is the name under which Migrate records the outbox's
// migrations in the database's schema_migrations table.
const Component = "outbox"

// DefaultPublishTimeout is the default of the tables' PublishTimeout
// (sqliteoutbox.Table, pgoutbox.Table): how long one Take may spend publishing while it
// holds its rows' locks.
const DefaultPublishTimeout = 10 * time.Second

// ErrExists reports that Add found an event with the same ID.
var ErrExists = errors.New("outbox: an event with this id exists")

// Event is one message waiting in the outbox, or sent from it.
type Event struct {
	// ID is unique per event; it is the broker's deduplication id (for
	// NATS JetStream, the Nats-Msg-Id header). Required.
	ID string
	// Subject is where the broker delivers the event. Required.
	Subject string
	// OrderingKey groups events that must be published in the order they
	// were added (for example a user's id). The empty key is a key like
	// any other.
	OrderingKey string
	// Body is the payload, stored and published as it is.
	Body []byte
	// CreatedAt is set by Add to the current time when zero.
	CreatedAt time.Time
}

// Publisher hands an event to a broker. It returns nil only once the
// broker has it (acknowledged). Publishing the same ID again must be
// harmless (the broker or the consumer drops the repeat): an event is
// published at least once.
type Publisher interface {
	Publish(ctx context.Context, e Event) error
}

// PublishFunc is a function that is a Publisher.
type PublishFunc func(ctx context.Context, e Event) error

// Publish calls f.
func (f PublishFunc) Publish(ctx context.Context, e Event) error { return f(ctx, e) }

// Table is what a relay and an audit need of an outbox table. SQLite and
// Postgres implement it.
type Table interface {
	// Take holds up to limit ordering keys by locking each one's oldest
	// unsent event (no other Take holds it, or publishes any of the key's
	// events, meanwhile), calls publish for those events and, as long as
	// the batch has room (limit events in all), the ones that follow them
	// in their keys, each key's in the order they were added; it marks the
	// published ones sent in the same transaction, and commits. It returns
	// how many were marked sent.
	//
	// An event whose publish failed stays unsent (its attempts counted),
	// and its key's later events wait behind it; the other keys' events
	// are still published. Their errors are returned, joined, after the
	// commit, together with the number sent. The ctx handed to publish
	// ends PublishTimeout after the rows were locked (see
	// DefaultPublishTimeout); from then on Take publishes nothing more in
	// this pass. If ctx ends before the commit, nothing is marked: the
	// published events are published again by a later Take, with the same
	// ID.
	Take(ctx context.Context, limit int, publish func(ctx context.Context, e Event) error) (int, error)
	// Unsent returns the number of events not yet marked sent.
	Unsent(ctx context.Context) (int, error)
	// Each calls fn for every event, sent or not, oldest first (for
	// audits); sentAt is zero for an unsent event. An error of fn stops
	// Each, which returns it.
	Each(ctx context.Context, fn func(e Event, sentAt time.Time) error) error
}

// Sweeper deletes the events sent long enough ago. The broker has them,
// and the outbox keeps them only for audits and operators: without
// sweeping, the table grows by every event ever added. SQLite and
// Postgres tables implement it.
type Sweeper interface {
	// DeleteSent deletes up to limit events marked sent before
	// sentBefore, the earliest sent first, and returns how many it
	// deleted. It never deletes an unsent event, however old, and an
	// event it deleted is never published again. Call it again while it
	// returns limit.
	DeleteSent(ctx context.Context, sentBefore time.Time, limit int) (int, error)
}
