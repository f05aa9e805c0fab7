package idem

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// A store that refuses every call for the same reason (a database setting
// that makes every completion fail, say) would otherwise write one log
// line per attempt, thousands a second under load, burying the one line
// that says what is wrong. logRepeated writes the first line of each kind
// and counts the ones like it that follow within repeatedLogInterval; the
// first line after the interval carries that count (attribute
// "repeated").

// repeatedLogInterval is how long lines like one just written are counted
// instead of written.
const repeatedLogInterval = 10 * time.Second

// maxRepeatedKinds bounds the kinds of lines remembered at once; past it,
// the ones whose interval ended are forgotten, and if none has, all are.
const maxRepeatedKinds = 1024

// repeatedKind is what makes two log lines alike: the same logger, message
// and error text (the other attributes, a user or an operation, differ).
type repeatedKind struct {
	logger   *slog.Logger
	msg, err string
}

type repeatedState struct {
	until   time.Time // lines like it are counted until then
	skipped int       // lines like it not written since
}

var repeated = struct {
	mu    sync.Mutex
	kinds map[repeatedKind]*repeatedState
}{kinds: map[repeatedKind]*repeatedState{}}

// logRepeated logs msg at level with args and err (attribute "err"),
// unless logger wrote msg with the same error text less than
// repeatedLogInterval ago: then the line is only counted, and the next
// one written says how many were left out.
//
// A line counted instead of written is still written at the debug level,
// when the logger takes it: an operator looking for every operation a
// failure touched can turn it on.
func logRepeated(ctx context.Context, logger *slog.Logger, level slog.Level, msg string, err error, args ...any) {
	if !logger.Enabled(ctx, level) {
		return
	}
	k := repeatedKind{logger: logger, msg: msg, err: err.Error()}
	now := time.Now()
	repeated.mu.Lock()
	st := repeated.kinds[k]
	if st != nil && now.Before(st.until) {
		st.skipped++
		repeated.mu.Unlock()
		if level > slog.LevelDebug && logger.Enabled(ctx, slog.LevelDebug) {
			logger.Log(ctx, slog.LevelDebug, msg, append(args, "err", err, "repeat", true)...)
		}
		return
	}
	skipped := 0
	if st != nil {
		skipped = st.skipped
	}
	if st == nil && len(repeated.kinds) >= maxRepeatedKinds {
		for kk, s := range repeated.kinds {
			if !now.Before(s.until) {
				delete(repeated.kinds, kk)
			}
		}
		if len(repeated.kinds) >= maxRepeatedKinds {
			clear(repeated.kinds)
		}
	}
	repeated.kinds[k] = &repeatedState{until: now.Add(repeatedLogInterval)}
	repeated.mu.Unlock()
	args = append(args, "err", err)
	if skipped > 0 {
		args = append(args, "repeated", skipped)
	}
	logger.Log(ctx, level, msg, args...)
}
