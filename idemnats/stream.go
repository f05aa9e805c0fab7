package idemnats

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// DefaultDuplicates is the duplicate window EnsureStream gives a stream when
// StreamConfig.Duplicates is zero (JetStream's own default).
const DefaultDuplicates = 2 * time.Minute

// StreamConfig is what EnsureStream asks of a stream. Settings it does not
// name (limits, retention, an operator's edits) are left as the stream has
// them.
type StreamConfig struct {
	// Name is the stream's name; required.
	Name string
	// Subjects the stream captures; at least one is required.
	Subjects []string
	// Duplicates is the window within which JetStream drops a message whose
	// Nats-Msg-Id it has already stored. Zero: DefaultDuplicates. The server
	// refuses windows under 100ms.
	Duplicates time.Duration
	// Storage is where the stream keeps its messages; the zero value is
	// jetstream.FileStorage. It cannot be changed on an existing stream.
	Storage jetstream.StorageType
	// Replicas is the number of copies in a JetStream cluster. Zero: 1.
	Replicas int
}

// ensureAttempts bounds EnsureStream's create/update rounds: another process
// may delete the stream between a failed create and the update.
const ensureAttempts = 5

// EnsureStream creates the stream c names or, when it exists with other
// settings, updates it to c's (keeping the settings c does not name). It is
// idempotent, and safe to call from several processes at once: each ends
// with the stream as c asks, or an error (wrapped with %w; for example a
// Storage different from the existing stream's).
func EnsureStream(ctx context.Context, js jetstream.JetStream, c StreamConfig) (jetstream.Stream, error) {
	if c.Name == "" {
		return nil, errors.New("idemnats: EnsureStream: StreamConfig.Name is required")
	}
	if len(c.Subjects) == 0 {
		return nil, fmt.Errorf("idemnats: EnsureStream %s: StreamConfig.Subjects is required", c.Name)
	}
	if c.Duplicates == 0 {
		c.Duplicates = DefaultDuplicates
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	var lastErr error
	for range ensureAttempts {
		// A create with the settings the stream already has succeeds on the
		// server, so the usual case (a restart) is one request.
		st, err := js.CreateStream(ctx, jetstream.StreamConfig{
			Name:       c.Name,
			Subjects:   c.Subjects,
			Duplicates: c.Duplicates,
			Storage:    c.Storage,
			Replicas:   c.Replicas,
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

// update brings the existing stream to c, keeping its other settings; it
// sends nothing when the stream already matches.
func update(ctx context.Context, js jetstream.JetStream, c StreamConfig) (jetstream.Stream, error) {
	st, err := js.Stream(ctx, c.Name)
	if err != nil {
		return nil, fmt.Errorf("idemnats: stream %s: %w", c.Name, err)
	}
	cfg := st.CachedInfo().Config
	if slices.Equal(cfg.Subjects, c.Subjects) && cfg.Duplicates == c.Duplicates &&
		cfg.Storage == c.Storage && cfg.Replicas == c.Replicas {
		return st, nil
	}
	if cfg.Storage != c.Storage {
		return nil, fmt.Errorf("idemnats: stream %s has %s storage, asked for %s: JetStream cannot change a stream's storage",
			c.Name, cfg.Storage, c.Storage)
	}
	cfg.Subjects = c.Subjects
	cfg.Duplicates = c.Duplicates
	cfg.Replicas = c.Replicas
	st, err = js.UpdateStream(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("idemnats: update stream %s: %w", c.Name, err)
	}
	return st, nil
}
