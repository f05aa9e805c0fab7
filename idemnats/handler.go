package idemnats

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem"
)

// DefaultNakDelay is ConsumerOptions.NakDelay's default.
const DefaultNakDelay = time.Second

// ConsumerOptions configure Handler.
type ConsumerOptions struct {
	// User is the idem user (namespace) the message ids are claimed under,
	// one per consumer, for example "$consumer:receipts": two consumers of
	// one stream each apply a message once. Required.
	User string
	// Operation names the function; it is fingerprinted with the message's
	// data and is the name a completer finds the function by
	// (idem.CompleterOptions.Funcs). Required.
	Operation string
	// Lease and TTL are idem.DoParams' (zero: idem.DefaultLease,
	// idem.DefaultTTL). The TTL is how long a message id is remembered:
	// keep it longer than a repeat can arrive (the stream's duplicate
	// window catches repeats within it; the TTL catches later ones, from a
	// relay that was down longer, and redeliveries).
	Lease, TTL time.Duration
	// NakDelay is how long the server waits before it redelivers a message
	// whose function failed, or whose id another delivery holds (in
	// flight). Default DefaultNakDelay.
	NakDelay time.Duration
	// Logger receives the handler's warnings and errors (and idem.Do's);
	// nil: slog.Default().
	Logger *slog.Logger
	// Metrics, if set, counts idem.Do's outcomes (idem.DoParams.Metrics).
	Metrics *idem.Metrics
}

// Handler returns a jetstream.MessageHandler that applies each message
// once: it runs fn through idem.Do with key = the message's Nats-Msg-Id
// header (see MessageKey), input = the message's data, and acknowledges
// the message only once fn's transaction has committed:
//
//   - fn committed, or the id was already applied (a redelivery, or a
//     repeat published after the stream's duplicate window): the message is
//     acknowledged with DoubleAck, which waits for the server's
//     confirmation. Should the ack be lost, the server redelivers and the
//     redelivery replays.
//   - Another delivery of the same id holds it (idem.ErrInFlight): negative
//     ack with NakDelay; the redelivery finds the outcome.
//   - The id was applied with different data (idem.ErrFingerprintMismatch):
//     the message is terminated (never redelivered) and an error logged.
//   - fn failed or panicked, the lease was lost, or the store failed: negative
//     ack with NakDelay, and the message runs again. The consumer's
//     MaxDeliver bounds the attempts; a message past it stays claimed and
//     unfinished in the store, where a completer with fn registered under
//     Operation finishes it.
//
// fn writes through idem.TxFromContext (and the store's FromContext); see
// idem.Do. Handler panics when User or Operation is empty.
func Handler(store idem.Store, o ConsumerOptions, fn idem.DoFunc) jetstream.MessageHandler {
	if o.User == "" || o.Operation == "" {
		panic("idemnats: Handler needs ConsumerOptions.User and Operation")
	}
	if store == nil || fn == nil {
		panic("idemnats: Handler needs a store and a function")
	}
	if o.NakDelay <= 0 {
		o.NakDelay = DefaultNakDelay
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	h := &handler{store: store, o: o, fn: fn}
	return h.handle
}

type handler struct {
	store idem.Store
	o     ConsumerOptions
	fn    idem.DoFunc
}

func (h *handler) handle(msg jetstream.Msg) {
	ctx := context.Background()
	key, err := MessageKey(msg)
	if err != nil {
		h.o.Logger.Error("idemnats: message without an id or JetStream metadata; terminated",
			"subject", msg.Subject(), "err", err)
		h.term(msg, key)
		return
	}
	_, err = h.do(ctx, key, msg)
	switch {
	case err == nil:
		if err := msg.DoubleAck(ctx); err != nil {
			// The outcome is committed: the redelivery replays it.
			h.o.Logger.Warn("idemnats: ack not confirmed; the message will be redelivered and replayed",
				"operation", h.o.Operation, "key", key, "err", err)
		}
	case errors.Is(err, idem.ErrFingerprintMismatch):
		h.o.Logger.Error("idemnats: message id already applied with other data; terminated",
			"operation", h.o.Operation, "key", key, "subject", msg.Subject(), "err", err)
		h.term(msg, key)
	case errors.Is(err, idem.ErrInFlight):
		h.nak(msg, key)
	default:
		h.o.Logger.Warn("idemnats: message not applied; redelivered after the nak delay",
			"operation", h.o.Operation, "key", key, "delay", h.o.NakDelay, "err", err)
		h.nak(msg, key)
	}
}

// do runs the message through idem.Do (which turns a panic of fn into an
// error wrapping idem.ErrHandlerPanicked, after rolling back).
func (h *handler) do(ctx context.Context, key string, msg jetstream.Msg) (idem.DoResult, error) {
	return idem.Do(ctx, h.store, idem.DoParams{
		User:      h.o.User,
		Key:       key,
		Operation: h.o.Operation,
		Input:     msg.Data(),
		Lease:     h.o.Lease,
		TTL:       h.o.TTL,
		Logger:    h.o.Logger,
		Metrics:   h.o.Metrics,
	}, h.fn)
}

func (h *handler) nak(msg jetstream.Msg, key string) {
	if err := msg.NakWithDelay(h.o.NakDelay); err != nil {
		h.o.Logger.Warn("idemnats: nak failed; the server redelivers after the ack wait",
			"operation", h.o.Operation, "key", key, "err", err)
	}
}

func (h *handler) term(msg jetstream.Msg, key string) {
	// Term, not TermWithReason: servers before 2.10 do not read a reason
	// and would take the message as unacknowledged.
	if err := msg.Term(); err != nil {
		h.o.Logger.Warn("idemnats: term failed; the server redelivers after the ack wait",
			"operation", h.o.Operation, "key", key, "err", err)
	}
}

// MessageKey returns the idempotency key Handler claims a message under:
// its Nats-Msg-Id header when that is a valid idem key (idem.ParseKey, as
// it is) that does not start with "seq-" or "msgid-sha256-", else
// "msgid-sha256-" and the hex SHA-256 of the id; a message
// without the header gets "seq-<stream>-<stream sequence>" (unique while
// the stream is not deleted and created again).
func MessageKey(msg jetstream.Msg) (string, error) {
	if id := msg.Headers().Get(jetstream.MsgIDHeader); id != "" {
		if k, err := idem.ParseKey(id); err == nil && k == id && !derivedKey(id) {
			return id, nil
		}
		sum := sha256.Sum256([]byte(id))
		return hashPrefix + hex.EncodeToString(sum[:]), nil
	}
	md, err := msg.Metadata()
	if err != nil {
		return "", fmt.Errorf("idemnats: message key: %w", err)
	}
	return fmt.Sprintf("%s%s-%d", seqPrefix, md.Stream, md.Sequence.Stream), nil
}

// The prefixes of the keys MessageKey derives. A publisher's id that
// starts with one is hashed like an invalid one, so that it cannot take
// the key of a message without an id, or of one whose id was hashed.
const (
	seqPrefix  = "seq-"
	hashPrefix = "msgid-sha256-"
)

func derivedKey(id string) bool {
	return strings.HasPrefix(id, seqPrefix) || strings.HasPrefix(id, hashPrefix)
}
