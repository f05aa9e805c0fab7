package ordersapp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	neturl "net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/natsembed"
)

// The stream and consumer of the order events (invariants 5 and 6).
const (
	eventStream     = "ORDERS"
	eventSubject    = orders.EventSubject
	eventDuplicates = 2 * time.Minute // JetStream's duplicate window on Nats-Msg-Id
	receiptsDurable = "receipts"
	receiptsUser    = orders.ReservedUserPrefix + "consumer:receipts" // the idem user the consumer claims message ids under; no token's sub can be it
	receiptsOp      = "orders.receipt"                                // the idem.Do operation (CompleterOptions.Funcs)
)

// natsURLFile is the file in the data dir where the process that runs the
// embedded NATS server writes its URL, so that `orders consume` and
// `orders audit` without --nats-url reach it.
const natsURLFile = "nats.url"

// natsTokenFile is the file in the data dir (mode 0600) that keeps the
// embedded NATS server's token: made at the server's first start on the
// data dir, and given by every client of that server (this process's,
// and `orders consume` and `orders audit` joining it through nats.url).
// The server refuses any client without it.
const natsTokenFile = "nats.token"

// natsFlag registers --nats-url: a nats:// or tls:// URL, or several
// separated by commas (the servers of one cluster).
func (c *Config) natsFlag(fs *cli.FlagSet, usage string) {
	fs.Func("nats-url", "NATS_URL", "", usage, func(v string) error {
		if err := checkNATSURL(v); err != nil {
			return err
		}
		c.NATSURL = v
		return nil
	})
	fs.Secret("nats-url") // it may hold a user and password
}

// natsEmbeddedHelp says in --help what the default is.
const natsEmbeddedHelp = "NATS server with JetStream for the order events: nats://host:port or tls://host:port, several comma-separated for a cluster " +
	"(default: none, a NATS server embedded in the process, its files in <data-dir>/nats, listening on 127.0.0.1 only, its URL in <data-dir>/nats.url, refusing any client without the token kept in <data-dir>/nats.token, mode 0600). " +
	"Several serve instances must share one NATS: give them all the same --nats-url"

// checkNATSURL refuses what is not a list of nats:// or tls:// URLs with
// a host. The message does not repeat the URL, which may hold a password.
func checkNATSURL(v string) error {
	if v == "" {
		return nil
	}
	for i, r := range v {
		if unicode.IsControl(r) {
			return fmt.Errorf("a control character at byte %d; want nats://host:port", i)
		}
	}
	for _, part := range strings.Split(v, ",") {
		u, err := neturl.Parse(strings.TrimSpace(part))
		if err != nil {
			return errors.New("not a URL; want nats://host:port or tls://host:port")
		}
		if s := strings.ToLower(u.Scheme); s != "nats" && s != "tls" {
			return errors.New("want nats://host:port or tls://host:port")
		}
		if u.Hostname() == "" {
			return errors.New("no host; want nats://host:port or tls://host:port")
		}
		if u.Path != "" && u.Path != "/" {
			return errors.New("a path; want nats://host:port or tls://host:port")
		}
	}
	return nil
}

// broker is one command's connection to NATS: the server --nats-url names,
// or the embedded one (started by this process, or found through
// <data-dir>/nats.url when another process runs it), which it reaches
// with the token of <data-dir>/nats.token.
type broker struct {
	name     string // for logs: the URL without its password, or "embedded …"
	embedded *natsembed.Server
	urlFile  string // the nats.url this process wrote; "" if none
	url      string // what urlFile holds
	nc       *nats.Conn
	js       jetstream.JetStream
}

// brokerMode says what a command does without --nats-url.
type brokerMode int

const (
	// brokerOwn: start the embedded server; another process running it on
	// the same data dir is an error (serve).
	brokerOwn brokerMode = iota
	// brokerJoin: reach the embedded server another process runs on the
	// data dir, or start one of its own when none does (consume, audit).
	brokerJoin
)

// brokerOptions are openBroker's settings.
type brokerOptions struct {
	mode brokerMode
	// client names the connection on the server ("orders serve").
	client string
	// publishURL: when this process starts the embedded server, write its
	// URL to <data-dir>/nats.url (serve, consume; not the short audit).
	publishURL bool
	// waitConnect: keep trying an external server that does not answer at
	// start instead of failing (serve and consume run without NATS, the
	// relay and the consumer catch up once it answers).
	waitConnect bool
	logger      *slog.Logger
}

// openBroker connects as c and o say.
func openBroker(ctx context.Context, c *Config, o brokerOptions) (*broker, error) {
	b := &broker{}
	url := c.NATSURL
	var token string // the embedded server's; never in b.name or a log line
	if url != "" {
		b.name = redactNATS(url)
	} else {
		dir := filepath.Join(c.DataDir, "nats")
		if err := os.MkdirAll(c.DataDir, 0o700); err != nil {
			return nil, fmt.Errorf("creating the data dir: %w", err)
		}
		tokenPath := filepath.Join(c.DataDir, natsTokenFile)
		var err error
		if token, err = natsembed.LoadOrCreateToken(tokenPath); err != nil {
			return nil, fmt.Errorf("the embedded NATS server's credential: %w", err)
		}
		srv, err := natsembed.Start(natsembed.Options{Dir: dir, Token: token, Logger: slog.New(minLevel{o.logger.Handler(), slog.LevelWarn})})
		switch {
		case err == nil:
			b.embedded = srv
			url = srv.URL()
			b.name = "embedded " + url + " (files in " + dir + ")"
			if o.publishURL {
				if err := b.writeURLFile(filepath.Join(c.DataDir, natsURLFile), url); err != nil {
					srv.Shutdown()
					return nil, err
				}
			}
		case errors.Is(err, natsembed.ErrDirInUse) && o.mode == brokerOwn:
			return nil, fmt.Errorf("the embedded NATS server's directory %s is in use by another process (another orders serve on this data dir?): "+
				"instances that share a database must share one NATS: run one NATS server (or cluster) and give every instance the same --nats-url (NATS_URL); "+
				"a data dir of its own, with an embedded NATS of its own, is only for an instance with a database of its own", dir)
		case errors.Is(err, natsembed.ErrDirInUse):
			url, err = readURLFile(ctx, filepath.Join(c.DataDir, natsURLFile))
			if err != nil {
				return nil, err
			}
			b.name = "embedded " + url + " (run by another process on " + dir + ")"
		default:
			return nil, fmt.Errorf("starting the embedded NATS server: %w", err)
		}
	}
	opts := []nats.Option{
		nats.Name(o.client),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.Timeout(2 * time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				o.logger.Warn("orders: NATS disconnected; reconnecting", "nats", b.name, "err", err)
			}
		}),
		nats.ReconnectHandler(func(*nats.Conn) { o.logger.Info("orders: NATS reconnected", "nats", b.name) }),
	}
	if o.waitConnect && b.embedded == nil {
		opts = append(opts, nats.RetryOnFailedConnect(true))
	}
	if token != "" {
		opts = append(opts, nats.Token(token))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		b.close()
		return nil, fmt.Errorf("connecting to NATS at %s: %w", b.name, err)
	}
	b.nc = nc
	b.js, err = jetstream.New(nc)
	if err != nil {
		b.close()
		return nil, fmt.Errorf("JetStream at %s: %w", b.name, err)
	}
	return b, nil
}

// writeURLFile writes url to path (mode 0600) through a temporary file,
// so that a reader never sees part of it.
func (b *broker) writeURLFile(path, url string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".nats.url-*")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(url + "\n"); err != nil {
		tmp.Close()
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	b.urlFile, b.url = path, url
	return nil
}

// readURLFile reads the URL another process wrote to path. That process
// writes it right after its server starts: a missing file is awaited a
// few seconds.
func readURLFile(ctx context.Context, path string) (string, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		raw, err := os.ReadFile(path)
		if err == nil {
			if u := strings.TrimSpace(string(raw)); u != "" && checkNATSURL(u) == nil {
				return u, nil
			}
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("reading the embedded NATS server's URL: %w", err)
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("another process runs the embedded NATS server of this data dir but %s does not name it; give --nats-url", path)
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(50 * time.Millisecond): // a poll with a deadline: the file appears as soon as the other process wrote it
		}
	}
}

// close closes the connection, shuts the embedded server down (waiting for
// it) and removes the nats.url this process wrote, if it still holds its
// URL.
func (b *broker) close() {
	if b.nc != nil {
		b.nc.Close()
	}
	if b.embedded != nil {
		b.embedded.Shutdown()
	}
	if b.urlFile != "" {
		if raw, err := os.ReadFile(b.urlFile); err == nil && strings.TrimSpace(string(raw)) == b.url {
			os.Remove(b.urlFile)
		}
	}
}

// redactNATS returns the URLs of v with their passwords hidden.
func redactNATS(v string) string {
	parts := strings.Split(v, ",")
	for i, p := range parts {
		parts[i] = redactURL(strings.TrimSpace(p))
	}
	return strings.Join(parts, ",")
}

// minLevel is a slog.Handler that drops records below level (the embedded
// server's notices: its start-up banner is a dozen lines).
type minLevel struct {
	slog.Handler
	level slog.Level
}

func (h minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.level && h.Handler.Enabled(ctx, l)
}

func (h minLevel) WithAttrs(as []slog.Attr) slog.Handler {
	return minLevel{h.Handler.WithAttrs(as), h.level}
}

func (h minLevel) WithGroup(name string) slog.Handler {
	return minLevel{h.Handler.WithGroup(name), h.level}
}
