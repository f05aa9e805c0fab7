package ordersapp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/idemnats"
)

// streamRecord is the stream of the order events that the database
// records (table event_stream, migration 0006).
type streamRecord struct {
	created string    // the stream's creation time as JetStream reports it (RFC 3339, nanoseconds, UTC)
	nats    string    // where it was found, for the operator (no credentials)
	at      time.Time // when it was recorded
}

// streamIdentity is what tells stream ORDERS on one NATS from stream
// ORDERS on another: its creation time, to the nanosecond.
func streamIdentity(st jetstream.Stream) string {
	return st.CachedInfo().Created.UTC().Format(time.RFC3339Nano)
}

// errOtherStream is returned at start by an instance that would run an
// embedded NATS whose stream ORDERS is not the one the database records.
var errOtherStream = errors.New("the database's order events go to another NATS")

// checkEmbeddedStream is the start of a command that runs on the embedded
// NATS (serve, consume): it sets up stream ORDERS there and records it in
// the database when the database records none; when the database records
// another stream (another instance's embedded NATS, or a NATS that the
// fleet reaches through --nats-url), it refuses, so that two relays never
// drain the one outbox into two streams.
func checkEmbeddedStream(ctx context.Context, be *backend, b *broker, replicas int, maxAge time.Duration, logger *slog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := idemnats.EnsureStream(ctx, b.js, streamConfig(replicas, maxAge, logger))
	if err != nil {
		if idemnats.ReplicasRefused(err) {
			return replicasError(b, replicas, err)
		}
		return fmt.Errorf("stream %s on the embedded NATS: %w", eventStream, err)
	}
	id := streamIdentity(st)
	if err := be.putStream(ctx, id, b.name, false); err != nil {
		return fmt.Errorf("recording stream %s in the database: %w", eventStream, err)
	}
	rec, _, err := be.streamOf(ctx)
	if err != nil {
		return fmt.Errorf("reading the stream the database records: %w", err)
	}
	if rec.created != id {
		return otherStreamError(rec, b, id)
	}
	return nil
}

// checkAuditStream is the audit's look, read-only, at the stream it would
// read on the embedded NATS: refused when the database records another
// one (the report would count that one's events as lost).
func checkAuditStream(ctx context.Context, be *backend, b *broker) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rec, found, err := be.streamOf(ctx)
	if err != nil {
		return fmt.Errorf("reading the stream the database records: %w", err)
	}
	if !found {
		return nil
	}
	st, err := b.js.Stream(ctx, eventStream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return otherStreamError(rec, b, "none")
	case err != nil:
		return fmt.Errorf("stream %s on the embedded NATS: %w", eventStream, err)
	}
	if id := streamIdentity(st); id != rec.created {
		return otherStreamError(rec, b, id)
	}
	return nil
}

func otherStreamError(rec streamRecord, b *broker, found string) error {
	return fmt.Errorf("%w: this database's events go to stream %s created %s on %s (recorded %s), "+
		"and the embedded NATS of this data dir (%s) holds another one (created %s): the relays would split the events between two streams. "+
		"Give every instance, consume and audit on this database the same --nats-url (NATS_URL); "+
		"if the recorded NATS and its files are gone for good, delete the row of table event_stream, then start again",
		errOtherStream, eventStream, rec.created, rec.nats, rec.at.UTC().Format(time.RFC3339), b.name, found)
}

// replicasError is the error that stops a command whose NATS refuses
// --stream-replicas.
func replicasError(b *broker, replicas int, err error) error {
	return fmt.Errorf("stream %s: NATS at %s cannot keep %d copies (--stream-replicas, ORDERS_STREAM_REPLICAS): "+
		"give a count no larger than its servers that are up (1 for a server that is not clustered), or add servers: %w",
		eventStream, b.name, replicas, err)
}

// noteStream records st as the stream of the database's events, once the
// events are set up on an external NATS. A database that recorded another
// one moved to this NATS (or the stream was deleted and made again): the
// events sent before are in the other stream, which the audit of this one
// does not see, so it says so.
func (e *events) noteStream(ctx context.Context, st jetstream.Stream) error {
	id := streamIdentity(st)
	rec, found, err := e.be.streamOf(ctx)
	if err != nil {
		return err
	}
	if found && rec.created == id {
		return nil
	}
	if err := e.be.putStream(ctx, id, e.broker.name, true); err != nil {
		return err
	}
	// Said once it is recorded: whoever reads it may rely on the record.
	if found {
		e.logger.Warn("orders: this database's events went to another stream ORDERS until now; from here on they go to this one, and the audit of this one counts the events sent before as missing",
			"recorded_stream_created", rec.created, "recorded_nats", rec.nats, "recorded_at", rec.at, "stream_created", id, "nats", e.broker.name)
	}
	return nil
}
