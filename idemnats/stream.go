package idemnats

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// DefaultDuplicates is the duplicate window EnsureStream gives a stream when
// StreamConfig.Duplicates is zero (JetStream's own default).
const DefaultDuplicates = 2 * time.Minute

// StreamConfig is what EnsureStream asks of a stream. Settings it does not
// name (limits, retention, an operator's edits) are left as the stream has
// them, and it never lowers an existing stream's Replicas or Duplicates
// (see EnsureStream).
type StreamConfig struct {
	// Name is the stream's name; required.
	Name string
	// Subjects the stream captures; at least one is required.
	Subjects []string
	// Duplicates is the window within which JetStream drops a message whose
	// Nats-Msg-Id it has already stored. Zero: DefaultDuplicates for a new
	// stream; an existing one keeps its own. The server refuses windows
	// under 100ms. A window shorter than an existing stream's is not
	// applied: the stream keeps the longer one.
	Duplicates time.Duration
	// Storage is where the stream keeps its messages; the zero value is
	// jetstream.FileStorage. It cannot be changed on an existing stream.
	Storage jetstream.StorageType
	// Replicas is the number of copies of the stream's messages in a
	// JetStream cluster (a server that is not clustered takes only 1).
	// Zero: 1 for a new stream; an existing one keeps its own. A count
	// lower than an existing stream's is not applied: the stream keeps its
	// copies (losing the server that holds the only copy loses the
	// messages on its disk).
	Replicas int
	// MaxAge is how long the stream keeps a message (JetStream removes
	// older ones). Zero: a new stream keeps its messages for ever and an
	// existing one keeps its own age. Non-zero is set on an existing stream
	// as asked, shorter or longer: how long to keep messages is the
	// caller's choice, not a safety setting. JetStream refuses an age
	// shorter than the duplicate window.
	MaxAge time.Duration
	// Logger receives a warning each time EnsureStream keeps an existing
	// stream's higher Replicas or longer Duplicates instead of the asked
	// value. Nil: slog.Default().
	Logger *slog.Logger
}

// ensureAttempts bounds EnsureStream's create/update rounds: another process
// may delete the stream between a failed create and the update.
const ensureAttempts = 5

// EnsureStream creates the stream c names or, when it exists with other
// settings, updates it to c's, keeping the settings c does not name. It
// never lowers what keeps messages safe: an existing stream with more
// Replicas, or a longer Duplicates window, than c asks keeps them, and
// c.Logger says so. It is idempotent, and safe to call from several
// processes at once: each ends with the stream as c asks (or higher), or an
// error (wrapped with %w; for example a Storage different from the
// existing stream's, or a jetstream.APIError when the servers cannot hold
// c.Replicas copies: see ReplicasRefused).
func EnsureStream(ctx context.Context, js jetstream.JetStream, c StreamConfig) (jetstream.Stream, error) {
	if c.Name == "" {
		return nil, errors.New("idemnats: EnsureStream: StreamConfig.Name is required")
	}
	if len(c.Subjects) == 0 {
		return nil, fmt.Errorf("idemnats: EnsureStream %s: StreamConfig.Subjects is required", c.Name)
	}
	if c.Replicas < 0 {
		return nil, fmt.Errorf("idemnats: EnsureStream %s: StreamConfig.Replicas %d is negative", c.Name, c.Replicas)
	}
	if c.MaxAge < 0 {
		return nil, fmt.Errorf("idemnats: EnsureStream %s: StreamConfig.MaxAge %s is negative", c.Name, c.MaxAge)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	var lastErr error
	for range ensureAttempts {
		// A create with the settings the stream already has succeeds on the
		// server, so the usual case (a restart) is one request.
		st, err := js.CreateStream(ctx, jetstream.StreamConfig{
			Name:       c.Name,
			Subjects:   c.Subjects,
			Duplicates: cmp.Or(c.Duplicates, DefaultDuplicates),
			Storage:    c.Storage,
			Replicas:   cmp.Or(c.Replicas, 1),
			MaxAge:     c.MaxAge,
		})
		if err == nil {
			return st, nil
		}
		if !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return nil, fmt.Errorf("idemnats: create stream %s: %w", c.Name, err)
		}
		st, err = update(ctx, js, c)
		if err == nil {
			return st, nil
		}
		if !errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, err
		}
		lastErr = err // deleted since: create again
	}
	return nil, fmt.Errorf("idemnats: ensure stream %s: gave up after %d attempts: %w", c.Name, ensureAttempts, lastErr)
}

// update brings the existing stream to c, keeping its other settings (its
// maximum age too, when c names none) and its higher replicas and longer
// duplicate window; it sends nothing when the stream already matches.
func update(ctx context.Context, js jetstream.JetStream, c StreamConfig) (jetstream.Stream, error) {
	st, err := js.Stream(ctx, c.Name)
	if err != nil {
		return nil, fmt.Errorf("idemnats: stream %s: %w", c.Name, err)
	}
	cfg := st.CachedInfo().Config
	if cfg.Storage != c.Storage {
		return nil, fmt.Errorf("idemnats: stream %s has %s storage, asked for %s: JetStream cannot change a stream's storage",
			c.Name, cfg.Storage, c.Storage)
	}
	replicas, dups := cfg.Replicas, cfg.Duplicates
	if c.Replicas > replicas {
		replicas = c.Replicas
	} else if c.Replicas != 0 && c.Replicas < replicas {
		c.Logger.Warn("idemnats: the stream has more replicas than asked; it keeps them (EnsureStream never lowers them)",
			"stream", c.Name, "replicas", replicas, "asked", c.Replicas)
	}
	if c.Duplicates > dups {
		dups = c.Duplicates
	} else if c.Duplicates != 0 && c.Duplicates < dups {
		c.Logger.Warn("idemnats: the stream has a longer duplicate window than asked; it keeps it (EnsureStream never shortens it)",
			"stream", c.Name, "duplicates", dups, "asked", c.Duplicates)
	}
	maxAge := cfg.MaxAge
	if c.MaxAge != 0 {
		maxAge = c.MaxAge
	}
	if slices.Equal(cfg.Subjects, c.Subjects) && cfg.Duplicates == dups && cfg.Replicas == replicas && cfg.MaxAge == maxAge {
		return st, nil
	}
	cfg.Subjects = c.Subjects
	cfg.Duplicates = dups
	cfg.Replicas = replicas
	cfg.MaxAge = maxAge
	st, err = js.UpdateStream(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("idemnats: update stream %s: %w", c.Name, err)
	}
	return st, nil
}

// ReplicasRefused reports whether err (from EnsureStream) is the servers'
// refusal of the replica count: a server that is not clustered takes only
// one copy, and a cluster cannot place more copies than it has servers
// (able to hold them) up. The first never changes without a new server
// configuration; the second may pass once the servers are back.
func ReplicasRefused(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	switch apiErr.ErrorCode {
	case jsStreamReplicasNotSupported, jsInsufficientResources, jsClusterNoPeers:
		return true
	}
	return false
}

// The JetStream API's error codes ReplicasRefused looks for (the server's
// JSStreamReplicasNotSupportedErr, JSInsufficientResourcesErr and
// JSClusterNoPeersErr).
const (
	jsClusterNoPeers             jetstream.ErrorCode = 10005
	jsInsufficientResources      jetstream.ErrorCode = 10023
	jsStreamReplicasNotSupported jetstream.ErrorCode = 10074
)
