package ordersapp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	neturl "net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
)

// Config is what the flags and environment of the orders commands set.
type Config struct {
	Addr         string
	MetricsAddr  string
	DataDir      string
	DatabaseURL  string
	RedisURL     string
	PaymentsURL  string
	JWTSecret    string
	KeyTTL       time.Duration
	RequireKey   bool
	InFlightWait time.Duration
	KeyLease     time.Duration
	PaymentsKey  string
	// NATSURL is the NATS server (or cluster) with JetStream of the order
	// events; empty: the embedded one in <data-dir>/nats.
	NATSURL string
	// Consume runs the receipts consumer in serve.
	Consume bool
	// AckWait is the receipts consumer's AckWait; 0: consumerAckWait.
	AckWait time.Duration
	// StreamReplicas is the count of copies asked of stream ORDERS; an
	// existing stream's higher count is kept.
	StreamReplicas int
	// StreamMaxAge is the maximum age asked of stream ORDERS; 0 keeps the
	// stream's own (none for a new stream).
	StreamMaxAge time.Duration
	// GuestCheckout turns on the checkout page's guest sign-in (POST
	// /checkout/session) and the API's acceptance of guest tokens.
	GuestCheckout bool
	// UserRate bounds each user's POST /v1/orders per second on this
	// instance (a burst of twice as many); 0: no bound.
	UserRate float64
	// MaxKeysPerUser bounds each user's unexpired keys; 0: no bound.
	MaxKeysPerUser int
	// OutboxRetention is how long serve keeps a sent event in the outbox
	// before it deletes it; 0: for ever.
	OutboxRetention time.Duration

	// gatewayLatency slows the in-process gateway (demo only).
	gatewayLatency time.Duration
	// outboxSweepEvery, set by tests only, is how often serve sweeps the
	// outbox's sent events; 0: outboxSweepInterval.
	outboxSweepEvery time.Duration
	// gatewayHold, set by tests only, is the in-process gateway's
	// payments.Config.Hold: each charge waits for it to return.
	gatewayHold func()
	// gatewayDeclineOver, set by tests only, makes the in-process gateway
	// decline amounts above it (payments.Config.DeclineOver). 0: no limit.
	gatewayDeclineOver int64
	// testClock, set by tests only (no flag), is the instance's own clock
	// as the order handler reads it (token expiry, an order's created_at,
	// the age of an operation whose payment lookup failed), so that tests
	// can run instances whose clocks disagree. Nil: time.Now. Leases,
	// expiry and the completer's backoff follow the database's clock
	// whatever it says.
	testClock func() time.Time
}

// Flag groups: each command registers the ones it uses.
func (c *Config) storageFlags(fs *cli.FlagSet) {
	fs.String(&c.DataDir, "data-dir", "ORDERS_DATA_DIR", "./data", "directory for the embedded database and the generated JWT secret (with a postgres:// --database-url the secret is kept in the database: one that this directory already holds is stored there if the database has none yet)")
	fs.String(&c.DatabaseURL, "database-url", "DATABASE_URL", "", "database: empty for the embedded SQLite file in the data dir, postgres://… for PostgreSQL")
}

func (c *Config) secretFlags(fs *cli.FlagSet) {
	fs.String(&c.JWTSecret, "jwt-secret", "ORDERS_JWT_SECRET", "", "HS256 secret for bearer tokens, at least 32 bytes; it wins over a secret kept in the data dir or the database (default: random; with a postgres:// --database-url kept in the database, so that every instance on it and token agree; else kept in <data-dir>/jwt-secret so serve and token agree)")
}

func (c *Config) serveFlags(fs *cli.FlagSet) {
	fs.String(&c.Addr, "addr", "ORDERS_ADDR", "127.0.0.1:8080", "address to listen on")
	fs.String(&c.MetricsAddr, "metrics-addr", "ORDERS_METRICS_ADDR", "", "serve GET /metrics on this address only (default: none, /metrics is on --addr)")
	c.storageFlags(fs)
	fs.String(&c.RedisURL, "redis-url", "REDIS_URL", "", "Redis fast path in front of the database: redis://host:port, or redis://h1:p1?addr=h2:p2&addr=h3:p3 for a Redis Cluster (default: none)")
	fs.String(&c.PaymentsURL, "payments-url", "PAYMENTS_URL", "", "payment gateway base URL (default: an in-process gateway)")
	c.secretFlags(fs)
	fs.Duration(&c.KeyTTL, "key-ttl", "ORDERS_KEY_TTL", 24*time.Hour, "how long an idempotency key lives after its first use")
	fs.Bool(&c.RequireKey, "require-key", "ORDERS_REQUIRE_KEY", true, "answer 400 to POST /v1/orders without an Idempotency-Key")
	fs.Duration(&c.InFlightWait, "in-flight-wait", "ORDERS_IN_FLIGHT_WAIT", 0, "how long a repeat waits for the first attempt before 409 (0: answer 409 at once)")
	fs.Duration(&c.KeyLease, "key-lease", "ORDERS_KEY_LEASE", 30*time.Second, "how long one attempt holds a key; after it a retry or the completer takes over")
	fs.String(&c.PaymentsKey, "payments-key", "PAYMENTS_API_KEY", "sk_test_local", "secret key sent to the payment gateway")
	c.natsFlag(fs, natsEmbeddedHelp)
	fs.Bool(&c.Consume, "consume", "ORDERS_CONSUME", true, "run the receipts consumer in this process: it applies each orders.created event of stream ORDERS once (false: leave it to `orders consume`)")
	c.ackWaitFlag(fs)
	c.streamReplicasFlag(fs)
	c.streamMaxAgeFlag(fs)
	fs.Bool(&c.GuestCheckout, "guest-checkout", "ORDERS_GUEST_CHECKOUT", false,
		"turn on the checkout page's guest sign-in: POST /checkout/session makes a new guest user and a 15-minute guest token (at most 10 a minute per client address, 429 beyond), "+
			"which may make at most 10 orders; off, that route answers 404, guest tokens are refused (401), and the page asks for a token from `orders token --user ID`")
	fs.Float(&c.UserRate, "user-rate", "ORDERS_USER_RATE", 1000, 0, 1e6,
		"orders per second one user may send to this instance, with a burst of twice as many; beyond, 429 rate-limited with Retry-After, before the key is claimed (0: no bound)")
	fs.Int(&c.MaxKeysPerUser, "max-keys-per-user", "ORDERS_MAX_KEYS_PER_USER", 1_000_000, 0, 1<<31-1,
		"unexpired idempotency keys one user may hold; an order with a new key past it is answered 429 too-many-keys with Retry-After, before it is paid (0: no bound)")
	fs.Duration(&c.OutboxRetention, "outbox-retention", "ORDERS_OUTBOX_RETENTION", 0,
		"how long an order's event stays in the outbox after it was published to stream ORDERS; serve then deletes it (every minute, in batches; an unsent event is never deleted), "+
			"and `orders audit` checks the stream's message against the order instead. 0 (the default): keep every event. "+
			"Set it only once no binary older than this one can start on the database again (the upgrade done, no rollback planned): "+
			"an older binary's start writes the event of every order it finds without one, and would publish every deleted event a second time")
}

// maxStreamReplicas is JetStream's own bound on a stream's replicas.
const maxStreamReplicas = 5

// streamReplicasFlag registers --stream-replicas, for serve and consume.
func (c *Config) streamReplicasFlag(fs *cli.FlagSet) {
	fs.Int(&c.StreamReplicas, "stream-replicas", "ORDERS_STREAM_REPLICAS", 1, 1, maxStreamReplicas,
		"copies of stream ORDERS that a JetStream cluster keeps, 1 to 5: a new stream gets this many, an existing one with fewer is raised to it, "+
			"and one with more keeps its own (a warning says so; the count is never lowered). More than 1 needs a clustered NATS (--nats-url) with that many servers up; "+
			"a count the servers refuse stops the command with an error")
}

// streamMaxAgeFlag registers --stream-max-age, for serve and consume.
func (c *Config) streamMaxAgeFlag(fs *cli.FlagSet) {
	fs.Func("stream-max-age", "ORDERS_STREAM_MAX_AGE", "0",
		"how long stream ORDERS keeps a message; JetStream removes older ones, and `orders audit` then accepts that an order older than it (and a minute) has lost its message, not its receipt. "+
			"0 (the default): a new stream keeps messages for ever and an existing one keeps the age it has (an operator's `nats stream edit`). "+
			"Otherwise at least "+streamMaxAgeMin.String()+" (the duplicate window, which JetStream requires it to exceed, and room for the receipts consumer to fall behind), set on the stream at each start, longer or shorter",
		func(v string) error {
			d, err := time.ParseDuration(v)
			if err != nil {
				return fmt.Errorf("want a duration such as 720h, got %q", v)
			}
			if d < 0 {
				return fmt.Errorf("%s is negative", d)
			}
			if d != 0 && d < streamMaxAgeMin {
				return fmt.Errorf("%s is under %s: the consumer must have time to apply a message before it goes", d, streamMaxAgeMin)
			}
			c.StreamMaxAge = d
			return nil
		})
}

// streamMaxAgeMin is the shortest --stream-max-age: an hour, well over the
// stream's 2-minute duplicate window and the receipts consumer's usual
// delay.
const streamMaxAgeMin = time.Hour

// ackWaitFlag registers --ack-wait, for serve and consume.
func (c *Config) ackWaitFlag(fs *cli.FlagSet) {
	fs.Duration(&c.AckWait, "ack-wait", "ORDERS_ACK_WAIT", 0,
		"how long JetStream waits for the receipts consumer's ack before it delivers the message again; longer than --key-lease, "+
			"so that a second delivery does not find the first one's claim in flight; "+
			"0 means the larger of --key-lease + 10s and 30s. Each start sets it on the durable consumer \"receipts\", which all consumers share: give them all the same")
}

// checkAckWait refuses an --ack-wait that is negative, or not longer than
// --key-lease.
func (c *Config) checkAckWait(cmd string) error {
	switch {
	case c.AckWait < 0:
		return cli.Usagef("%s--ack-wait must not be negative", cmd)
	case c.AckWait > 0 && c.AckWait <= c.KeyLease:
		return cli.Usagef("%s--ack-wait %v is not longer than --key-lease %v: a message would be delivered again while its first delivery still holds its id", cmd, c.AckWait, c.KeyLease)
	}
	return nil
}

// minJWTSecret is the shortest --jwt-secret accepted: HS256 wants a key
// of at least its hash's size.
const minJWTSecret = 32

func (c *Config) validate() error {
	if err := c.checkStorage(); err != nil {
		return err
	}
	if c.JWTSecret != "" && len(c.JWTSecret) < minJWTSecret {
		return cli.Usagef("--jwt-secret is %d bytes; want at least %d", len(c.JWTSecret), minJWTSecret)
	}
	if c.KeyTTL <= 0 {
		return cli.Usagef("--key-ttl must be positive")
	}
	if c.KeyLease <= 0 {
		return cli.Usagef("--key-lease must be positive")
	}
	// A key must outlive the attempt that holds it: a retry that came
	// after the key's expiry but within its lease would otherwise find
	// neither an answer nor a key it may take over.
	if c.KeyTTL <= c.KeyLease {
		return cli.Usagef("--key-ttl %v is not longer than --key-lease %v: a key must outlive the lease of the attempt that holds it", c.KeyTTL, c.KeyLease)
	}
	if err := c.checkAckWait(""); err != nil {
		return err
	}
	if c.OutboxRetention < 0 {
		return cli.Usagef("--outbox-retention %v is negative: want a duration, or 0 to keep every event", c.OutboxRetention)
	}
	// The key is sent in an Authorization header: an empty one, or one
	// with a space or a control character, no gateway accepts, and every
	// order would be answered 502. The message does not repeat the secret.
	if c.PaymentsKey == "" || strings.IndexFunc(c.PaymentsKey, func(r rune) bool { return r < 0x21 || r > 0x7e }) >= 0 {
		return cli.Usagef("--payments-key: want the gateway's secret key, 1 or more visible ASCII characters (such as sk_test_…)")
	}
	if c.RedisURL != "" {
		if _, err := newRedis(c.RedisURL); err != nil {
			return err
		}
	}
	if c.PaymentsURL != "" && !strings.HasPrefix(c.PaymentsURL, "http://") && !strings.HasPrefix(c.PaymentsURL, "https://") {
		return cli.Usagef("--payments-url %q: want an http:// or https:// URL", redactURL(c.PaymentsURL))
	}
	// An external gateway forgets a payment key after its retention (24h
	// at Stripe): an order key that outlives it would pay again on a retry.
	if c.PaymentsURL != "" && c.KeyTTL > externalKeyRetention {
		return cli.Usagef("--key-ttl %v is longer than the %v for which the gateway at --payments-url keeps idempotency keys: a retry after that would pay twice", c.KeyTTL, externalKeyRetention)
	}
	return nil
}

// checkStorage refuses a --database-url (or DATABASE_URL) with a control
// character (a newline pasted in): it is a bad value, not a database to
// try. The message does not repeat the URL, which may hold a password.
func (c *Config) checkStorage() error {
	for i, r := range c.DatabaseURL {
		if unicode.IsControl(r) {
			return cli.Usagef("--database-url: a control character (%q at byte %d); want the URL on one line, without control characters", r, i)
		}
	}
	return nil
}

// sqlitePath returns the SQLite file the storage flags name, and whether
// they name one (not PostgreSQL or another scheme).
func (c *Config) sqlitePath() (string, bool) {
	switch u := c.DatabaseURL; {
	case u == "":
		return filepath.Join(c.DataDir, "orders.db"), true
	case strings.HasPrefix(u, "sqlite:"):
		return strings.TrimPrefix(strings.TrimPrefix(u, "sqlite:"), "//"), true
	}
	return "", false
}

// redactURL returns u with the password of its user info, if any,
// replaced by "xxxxx", for messages. When url.Parse cannot tell the user
// info (it refuses u, or an '@' after it finds none: a password with a
// '/', '?' or '#' not escaped), everything between the first ':' after
// the scheme and the last '@' is replaced, which may hide more than the
// password but never less.
// dsnPassword is a password=value pair of a key=value connection string,
// its value bare or single-quoted (with \' and \\ inside).
var dsnPassword = regexp.MustCompile(`(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s]*)`)

func redactURL(u string) string {
	if !strings.Contains(u, "://") && strings.Contains(u, "=") {
		// A key=value connection string: its password's value goes.
		return dsnPassword.ReplaceAllString(u, "${1}xxxxx")
	}
	p, err := neturl.Parse(u)
	if err == nil && (p.User != nil || !strings.Contains(u, "@")) {
		return p.Redacted()
	}
	i := strings.Index(u, "://")
	if i < 0 {
		if strings.Contains(u, "@") {
			return "(not shown: not a URL)"
		}
		return u
	}
	start := i + len("://")
	at := strings.LastIndex(u[start:], "@")
	if at < 0 {
		return u
	}
	colon := strings.Index(u[start:start+at], ":")
	if colon < 0 {
		return u
	}
	return u[:start+colon+1] + "xxxxx" + u[start+at:]
}

// secretInDatabase reports whether the JWT secret is the one kept in the
// database (SharedSecret): no --jwt-secret, and PostgreSQL, which several
// instances with data dirs of their own may share.
func (c *Config) secretInDatabase() bool {
	u := c.DatabaseURL
	return c.JWTSecret == "" && (strings.HasPrefix(u, "postgres://") || strings.HasPrefix(u, "postgresql://"))
}

// secretPath is the file in the data dir that keeps the generated secret.
func (c *Config) secretPath() string { return filepath.Join(c.DataDir, "jwt-secret") }

// readSecretFile returns the secret kept in the data dir, or nil when
// there is none. Errors name the file, never its content.
func (c *Config) readSecretFile() ([]byte, error) {
	path := c.secretPath()
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return nil, fmt.Errorf("%s is empty; delete it or set --jwt-secret", path)
	}
	if len(s) < minJWTSecret {
		return nil, fmt.Errorf("%s holds %d bytes; want at least %d (delete it to get a new random one, or set --jwt-secret)", path, len(s), minJWTSecret)
	}
	return []byte(s), nil
}

// newSecret returns a new random secret: 32 random bytes, hex-encoded.
func newSecret() string {
	var raw [32]byte
	rand.Read(raw[:])
	return hex.EncodeToString(raw[:])
}

// sharedSecret returns the JWT secret of an instance for which
// secretInDatabase holds: the one kept in the database, stored by the
// first instance that needed it. That one offers the secret of its data
// dir when it has one, so that tokens issued before the instances shared
// the database keep working, else a new random one; the data dir is left
// as it is. An instance whose data dir holds another secret logs that
// tokens signed with it are refused now. No message holds a secret.
func (c *Config) sharedSecret(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) ([]byte, error) {
	own, err := c.readSecretFile()
	if err != nil {
		return nil, err
	}
	offer := newSecret()
	if own != nil {
		offer = string(own)
	}
	s, stored, err := orders.SharedSecret(ctx, pool, offer)
	if err != nil {
		return nil, err
	}
	switch {
	case own != nil && stored:
		logger.Info("orders: the JWT secret of the data dir is now kept in the database, where every instance on it reads it; tokens signed with it stay valid",
			"file", c.secretPath())
	case own != nil && s != string(own):
		logger.Warn("orders: the data dir's JWT secret differs from the one kept in the database, which this instance signs and checks tokens with: "+
			"tokens signed with the data dir's (made before this instance shared the database, or by `orders token` without --database-url) are refused with 401; "+
			"make them again with `orders token --database-url …`, or give every instance one --jwt-secret",
			"file", c.secretPath())
	}
	return []byte(s), nil
}

// secret returns the JWT secret: the configured one, or the one kept in the
// data dir, created on first use.
func (c *Config) secret() ([]byte, error) {
	if c.JWTSecret != "" {
		if len(c.JWTSecret) < minJWTSecret {
			return nil, cli.Usagef("--jwt-secret is %d bytes; want at least %d", len(c.JWTSecret), minJWTSecret)
		}
		return []byte(c.JWTSecret), nil
	}
	path := c.secretPath()
	if b, err := c.readSecretFile(); b != nil || err != nil {
		return b, err
	}
	if err := os.MkdirAll(c.DataDir, 0o700); err != nil {
		return nil, err
	}
	s := newSecret()
	// Write a temporary file and link it into place, so that two processes
	// starting at once agree on one secret and none reads a partial file.
	tmp, err := os.CreateTemp(c.DataDir, ".jwt-secret-*")
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(s + "\n"); err != nil {
		tmp.Close()
		return nil, err
	}
	if err := tmp.Close(); err != nil {
		return nil, err
	}
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return c.secret()
		}
		return nil, err
	}
	return []byte(s), nil
}
