package ordersapp

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
)

// keysBudget is the re-drive budget of serve's completer (its
// CompleterOptions.MaxAttempts is left at the default): a key re-driven
// this many times is given up.
var keysBudget = idemdriver.Budget(0)

// keysSubcommands are the operator's commands on idempotency keys.
var keysSubcommands = []struct{ name, summary string }{
	{"show", "one key: state, attempts, lease, expiry, stored status, the order it made"},
	{"list", "keys in one state: in-flight, abandoned, given-up or completed"},
	{"redrive", "hand a key the completer gave up on back to it"},
	{"purge", "delete an abandoned or given-up key that made no payment, so its next request starts anew"},
}

func (a *App) keys(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return cli.Usagef("orders keys: want a subcommand: show, list, redrive or purge (see orders keys --help)")
	}
	switch args[0] {
	case "-h", "--help", "-help", "help":
		a.keysUsage(a.Stdout)
		return flag.ErrHelp
	case "show":
		return a.keysShow(ctx, args[1:])
	case "list":
		return a.keysList(ctx, args[1:])
	case "redrive":
		return a.keysRedrive(ctx, args[1:])
	case "purge":
		return a.keysPurge(ctx, args[1:])
	}
	return cli.Usagef("orders keys: unknown subcommand %q: want show, list, redrive or purge (see orders keys --help)", args[0])
}

func (a *App) keysUsage(w io.Writer) {
	var b strings.Builder
	b.WriteString("Usage: orders keys <subcommand> [flags]\n\nLooks at the order service's idempotency keys in its database, hands the\nkeys the completer gave up on back to it, and deletes a key that no attempt\nholds and whose operation made no payment.\n\nSubcommands:\n")
	for _, c := range keysSubcommands {
		fmt.Fprintf(&b, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(&b, `
States, by the database's clock (SQLite's: this machine's):
  in-flight  no stored answer, and an attempt holds the key (its lease is live)
  abandoned  no stored answer, the lease ran out: the completer re-drives it (at
             once, or after its backoff)
  given-up   no stored answer, and the completer re-drove it %d times, its budget:
             it waits for an operator ("orders keys redrive") or the client's retry
  completed  a stored answer that has not expired

Run "orders keys <subcommand> --help" for its flags and environment variables.
`, keysBudget)
	io.WriteString(w, b.String())
}

// keyFlags are the flags naming one key.
func keyFlags(fs *cli.FlagSet, user, key *string) {
	fs.String(user, "user", "ORDERS_KEYS_USER", "", "the user the key belongs to, a token's sub (required)")
	fs.String(key, "key", "ORDERS_KEYS_KEY", "", "the Idempotency-Key, as the client sent it, its quotes left out or kept (required)")
}

// checkKeyFlags checks --user as the service checks a token's subject and
// --key as the middleware reads an Idempotency-Key (idem.ParseKey: 1 to
// 255 visible ASCII characters, or an sf-string of them), and returns the
// key as stored: a value no stored key can be is a usage error, not a
// lookup.
func checkKeyFlags(cmd, user, key string) (string, error) {
	if user == "" {
		return "", cli.Usagef("%s: --user is required", cmd)
	}
	if err := orders.CheckUser(user); err != nil {
		return "", cli.Usagef("%s: --user: %v", cmd, err)
	}
	if key == "" {
		return "", cli.Usagef("%s: --key is required", cmd)
	}
	k, err := idem.ParseKey(key)
	if err != nil {
		return "", cli.Usagef("%s: --key: no stored key can be this value: %v", cmd, err)
	}
	return k, nil
}

// openInspector opens the database c names and its store as an
// idemdriver.Inspector. The database must exist already with this binary's
// schema (openExisting): the keys commands look at a service's keys, or
// change those rows, and never create or migrate a database; a mistyped
// --data-dir would otherwise get a new, empty database that has none.
func openInspector(ctx context.Context, c *Config) (*backend, idemdriver.Inspector, error) {
	be, err := openExisting(ctx, c)
	if err != nil {
		return nil, nil, err
	}
	in, ok := be.store.(idemdriver.Inspector)
	if !ok {
		be.close()
		return nil, nil, fmt.Errorf("the store %T cannot list or re-drive keys", be.store)
	}
	return be, in, nil
}

// keyView is what `orders keys show --json` prints, and `list --json` for
// each key (without the order).
type keyView struct {
	User         string     `json:"user"`
	Key          string     `json:"key"`
	State        string     `json:"state"`
	Attempts     int        `json:"attempts"`
	Redrives     int        `json:"redrives"`
	MaxRedrives  int        `json:"max_redrives"`
	CreatedAt    time.Time  `json:"created_at"`
	LeaseUntil   time.Time  `json:"lease_until"`
	ExpiresAt    time.Time  `json:"expires_at"`
	CompletedAt  *time.Time `json:"completed_at"`
	StoredStatus *int       `json:"stored_status"`
	StoredBytes  *int       `json:"stored_body_bytes"`
	Method       string     `json:"method"`
	Path         string     `json:"path"`
	RequestBytes int        `json:"request_body_bytes"`
	Fingerprint  string     `json:"fingerprint_prefix"`
	Operation    string     `json:"operation"`
	OrderID      string     `json:"order_id"`
	Order        *orderView `json:"order"`
	StoreTime    time.Time  `json:"store_time"`
}

// orderView is the order a key made, as show prints it.
type orderView struct {
	ID        string    `json:"id"`
	Status    string    `json:"status"`
	Total     int64     `json:"total"`
	Currency  string    `json:"currency"`
	PaymentID string    `json:"payment_id"`
	CreatedAt time.Time `json:"created_at"`
}

func viewOf(info *idemdriver.KeyInfo) keyView {
	v := keyView{
		User: info.User, Key: info.Key, State: string(info.State),
		Attempts: info.Attempts, Redrives: info.Redrives, MaxRedrives: keysBudget,
		CreatedAt: info.CreatedAt.UTC(), LeaseUntil: info.LeaseUntil.UTC(), ExpiresAt: info.ExpiresAt.UTC(),
		Method: info.Method, Path: withoutQueryValues(info.Path), RequestBytes: len(info.Body),
		Fingerprint: info.Fingerprint[:min(12, len(info.Fingerprint))],
		Operation:   idemdriver.OperationID(info.User, info.Key, info.CreatedAt),
		OrderID:     orders.OrderID(info.User, info.Key, info.CreatedAt),
		StoreTime:   info.At.UTC(),
	}
	if !info.CompletedAt.IsZero() {
		t := info.CompletedAt.UTC()
		v.CompletedAt = &t
	}
	if r := info.Response; r != nil {
		st, n := r.Status, len(r.Body)
		v.StoredStatus, v.StoredBytes = &st, &n
	}
	return v
}

func (a *App) keysShow(ctx context.Context, args []string) error {
	var c Config
	var user, key string
	var asJSON bool
	fs := cli.NewFlagSet("orders keys show", "Shows one idempotency key: its state, attempts and re-drives, lease, expiry, stored status, and the order it made (looked up by the order id the key's operation gives). The stored request and answer bodies are not printed, only their sizes.", a.Getenv)
	c.storageFlags(fs)
	keyFlags(fs, &user, &key)
	fs.Bool(&asJSON, "json", "ORDERS_KEYS_JSON", false, "print one JSON object instead of text")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	key, err := checkKeyFlags("orders keys show", user, key)
	if err != nil {
		return err
	}
	be, in, err := openInspector(ctx, &c)
	if err != nil {
		return err
	}
	defer be.close()
	info, err := in.InspectKey(ctx, user, key, keysBudget)
	if errors.Is(err, idem.ErrNotFound) {
		return fmt.Errorf("show: user %s has no key %s (never used, released, or completed and expired)", quoteIfNeeded(user), quoteIfNeeded(key))
	}
	if err != nil {
		return err
	}
	v := viewOf(info)
	o, err := be.repo.Get(ctx, user, v.OrderID)
	switch {
	case errors.Is(err, orders.ErrNotFound):
	case err != nil:
		return fmt.Errorf("show: looking up order %s: %w", v.OrderID, err)
	default:
		v.Order = &orderView{ID: o.ID, Status: o.Status, Total: o.Total, Currency: o.Currency, PaymentID: o.PaymentID, CreatedAt: o.CreatedAt.UTC()}
	}
	if asJSON {
		enc := json.NewEncoder(a.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	a.printKey(v)
	return nil
}

func (a *App) printKey(v keyView) {
	var b strings.Builder
	line := func(name, format string, args ...any) {
		fmt.Fprintf(&b, "%-14s %s\n", name+":", fmt.Sprintf(format, args...))
	}
	line("user", "%s", quoteIfNeeded(v.User))
	line("key", "%s", quoteIfNeeded(v.Key))
	line("state", "%s", stateNote(v))
	line("attempts", "%d (re-drives by the completer: %d of %d)", v.Attempts, v.Redrives, v.MaxRedrives)
	line("created", "%s", stamp(v.CreatedAt))
	if v.StoredStatus != nil {
		line("lease until", "%s (over: the key is completed)", stamp(v.LeaseUntil))
	} else {
		line("lease until", "%s", relative(v.LeaseUntil, v.StoreTime))
	}
	if v.StoredStatus == nil && !v.ExpiresAt.After(v.StoreTime) {
		line("expires", "%s, kept past it: a key without an answer never expires", relative(v.ExpiresAt, v.StoreTime))
	} else {
		line("expires", "%s", relative(v.ExpiresAt, v.StoreTime))
	}
	if v.CompletedAt != nil {
		line("completed at", "%s", stamp(*v.CompletedAt))
	} else {
		line("completed at", "-")
	}
	if v.StoredStatus != nil {
		line("stored status", "%d (idempotent answer: %d bytes, replayed to every retry)", *v.StoredStatus, *v.StoredBytes)
	} else {
		line("stored status", "none")
	}
	line("request", "%s %s (%d bytes), fingerprint %s…", v.Method, v.Path, v.RequestBytes, v.Fingerprint)
	line("operation", "%s", v.Operation)
	if o := v.Order; o != nil {
		line("order", "%s: %s, total %d %s, payment %s, created %s", o.ID, o.Status, o.Total, o.Currency, orNone(o.PaymentID), stamp(o.CreatedAt))
	} else {
		line("order", "none (%s was not created)", v.OrderID)
	}
	line("store time", "%s", stamp(v.StoreTime))
	io.WriteString(a.Stdout, b.String())
}

func stateNote(v keyView) string {
	switch idemdriver.KeyState(v.State) {
	case idemdriver.KeyInFlight:
		return "in-flight (an attempt holds the key)"
	case idemdriver.KeyAbandoned:
		return "abandoned (the completer re-drives it)"
	case idemdriver.KeyGivenUp:
		return "given-up (the completer stopped re-driving it: see orders keys redrive)"
	case idemdriver.KeyCompleted:
		return "completed (its answer is replayed to every retry)"
	}
	return v.State
}

func (a *App) keysList(ctx context.Context, args []string) error {
	var c Config
	var state string
	var limit int
	var asJSON bool
	fs := cli.NewFlagSet("orders keys list", "Lists the idempotency keys in one state, one line each. Keys without a stored answer (in-flight, abandoned, given-up) come longest waiting first: the earliest lease end, then the oldest key; completed keys come most recently completed first.", a.Getenv)
	c.storageFlags(fs)
	fs.String(&state, "state", "ORDERS_KEYS_STATE", "", "in-flight, abandoned, given-up or completed (required)")
	fs.Int(&limit, "limit", "ORDERS_KEYS_LIMIT", 100, 1, 10000, "at most this many keys")
	fs.Bool(&asJSON, "json", "ORDERS_KEYS_JSON", false, "print a JSON array instead of text")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	if state == "" {
		return cli.Usagef("orders keys list: --state is required: in-flight, abandoned, given-up or completed")
	}
	st, err := idemdriver.ParseKeyState(state)
	if err != nil {
		return cli.Usagef("orders keys list: --state %q: want in-flight, abandoned, given-up or completed", state)
	}
	be, in, err := openInspector(ctx, &c)
	if err != nil {
		return err
	}
	defer be.close()
	infos, err := in.ListKeys(ctx, idemdriver.ListParams{State: st, Limit: limit, MaxRedrives: keysBudget})
	if err != nil {
		return err
	}
	if asJSON {
		views := make([]keyView, len(infos))
		for i := range infos {
			views[i] = viewOf(&infos[i])
		}
		enc := json.NewEncoder(a.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(views)
	}
	if len(infos) == 0 {
		fmt.Fprintf(a.Stdout, "no %s keys\n", st)
		return nil
	}
	tw := tabwriter.NewWriter(a.Stdout, 0, 4, 2, ' ', 0)
	// A completed key's lease is over and says nothing: its completion
	// is shown instead.
	when := "LEASE UNTIL"
	if st == idemdriver.KeyCompleted {
		when = "COMPLETED AT"
	}
	fmt.Fprintf(tw, "USER\tKEY\tSTATE\tATTEMPTS\tREDRIVES\t%s\tEXPIRES\n", when)
	for i := range infos {
		v := viewOf(&infos[i])
		t := relative(v.LeaseUntil, v.StoreTime)
		if v.CompletedAt != nil {
			t = relative(*v.CompletedAt, v.StoreTime)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%s\n", quoteIfNeeded(v.User), quoteIfNeeded(v.Key), v.State,
			v.Attempts, v.Redrives, t, relative(v.ExpiresAt, v.StoreTime))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(infos) == limit {
		fmt.Fprintf(a.Stderr, "(--limit %d reached: there may be more keys)\n", limit)
	}
	return nil
}

func (a *App) keysRedrive(ctx context.Context, args []string) error {
	var c Config
	var user, key, operation string
	fs := cli.NewFlagSet("orders keys redrive", fmt.Sprintf("Hands a key the completer gave up on (%d re-drives) back to it: its count of re-drives goes back to 0, so a running serve's completer re-drives it at its next scan, up to %d times again, with its backoff from the start. Nothing else changes: the key keeps its operation (the same order id and payment key, so it never pays twice) and its lease. Refused (exit 1) for a key in any other state. Prints the operation and order id it re-drove.", keysBudget, keysBudget), a.Getenv)
	c.storageFlags(fs)
	keyFlags(fs, &user, &key)
	fs.String(&operation, "operation", "ORDERS_KEYS_OPERATION", "", "refuse unless the key's operation is this one (its id, as orders keys show prints it): the key may have been completed, expired and used again since. Checked just before the re-drive, not in the same step; a newer operation would have to be given up in between to be re-driven instead (default: any)")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	key, err := checkKeyFlags("orders keys redrive", user, key)
	if err != nil {
		return err
	}
	if operation != "" && !isOperationID(operation) {
		return cli.Usagef("orders keys redrive: --operation %q: want an operation id, 16 hex characters, as orders keys show prints it", operation)
	}
	be, in, err := openInspector(ctx, &c)
	if err != nil {
		return err
	}
	defer be.close()
	// The operation the key holds now, to name it and to check
	// --operation; Redrive itself decides, atomically, whether it may.
	info, err := in.InspectKey(ctx, user, key, keysBudget)
	if errors.Is(err, idem.ErrNotFound) {
		return fmt.Errorf("redrive: user %s has no key %s (never used, released, or completed and expired)", quoteIfNeeded(user), quoteIfNeeded(key))
	}
	if err != nil {
		return err
	}
	op := idemdriver.OperationID(info.User, info.Key, info.CreatedAt)
	orderID := orders.OrderID(info.User, info.Key, info.CreatedAt)
	if operation != "" && operation != op {
		return fmt.Errorf("redrive: refused: key %s of user %s now holds operation %s (order %s, %s), not --operation %s; nothing changed", quoteIfNeeded(key), quoteIfNeeded(user), op, orderID, info.State, operation)
	}
	n, err := in.Redrive(ctx, user, key, keysBudget)
	var ng *idemdriver.NotGivenUpError
	switch {
	case errors.Is(err, idem.ErrNotFound):
		return fmt.Errorf("redrive: user %s has no key %s (never used, released, or completed and expired)", quoteIfNeeded(user), quoteIfNeeded(key))
	case errors.As(err, &ng):
		return fmt.Errorf("redrive: refused: key %s of user %s is %s, not given-up; only a key the completer gave up on is re-driven", quoteIfNeeded(key), quoteIfNeeded(user), ng.State)
	case err != nil:
		return err
	}
	fmt.Fprintf(a.Stdout, "re-drive: key %s of user %s, operation %s (order %s), was given up after %d re-drives; its count is now 0: the completer re-drives it at its next scan (up to %d times)\n",
		quoteIfNeeded(key), quoteIfNeeded(user), op, orderID, n, keysBudget)
	return nil
}

// isOperationID reports whether s has the form of idemdriver.OperationID's
// ids: 16 lowercase hex characters.
func isOperationID(s string) bool {
	if len(s) != 16 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// withoutQueryValues returns a stored request path with the values of its
// query replaced by "…" (a client may carry a credential there, such as
// access_token); the parameters' names are kept.
func withoutQueryValues(path string) string {
	p, q, ok := strings.Cut(path, "?")
	if !ok {
		return path
	}
	parts := strings.Split(q, "&")
	for i, part := range parts {
		if name, _, ok := strings.Cut(part, "="); ok {
			parts[i] = name + "=…"
		} else if part != "" {
			parts[i] = "…"
		}
	}
	return p + "?" + strings.Join(parts, "&")
}

// quoteIfNeeded returns s as it is when it reads unambiguously on a line,
// else quoted (Go syntax; bytes that are not UTF-8 as \x escapes).
func quoteIfNeeded(s string) string {
	if s == "" || !utf8.ValidString(s) || strings.IndexFunc(s, func(r rune) bool { return r == '"' || r == '\\' || unicode.IsSpace(r) || !unicode.IsPrint(r) }) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

func stamp(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000000Z") }

// relative prints t and how far it is from now (the store's time).
func relative(t, now time.Time) string {
	d := t.Sub(now)
	if d > -time.Second && d < time.Second {
		d = d.Round(time.Millisecond)
	} else {
		d = d.Round(time.Second)
	}
	switch {
	case d > 0:
		return fmt.Sprintf("%s (in %s)", stamp(t), d)
	case d < 0:
		return fmt.Sprintf("%s (%s ago)", stamp(t), -d)
	}
	return fmt.Sprintf("%s (now)", stamp(t))
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// purgeQuiet is how long after a key's lease ended `orders keys purge`
// waits before it asks the gateway whether the key's operation paid: an
// attempt makes no payment call later than the order handler's payment
// timeout after it began (which is before its lease ended); a gateway's
// search (Stripe's) finds a payment only once it is indexed, within
// about a minute; and the rest covers a call still on the wire and the
// instances' clocks against the database's.
const purgeQuiet = orders.DefaultPaymentTimeout + 100*time.Second

func (a *App) keysPurge(ctx context.Context, args []string) error {
	var c Config
	var user, key, operation string
	fs := cli.NewFlagSet("orders keys purge", fmt.Sprintf("Deletes one idempotency key that no attempt holds and whose operation has neither an order nor a succeeded payment, so that the next request with the key starts a new operation (a new order id and payment key) instead of taking the old one over. Only an abandoned or given-up key is purged, and only once its lease ended %s ago or more (by then its last attempt has stopped calling the gateway, and the gateway's search finds what it paid); the gateway is asked. Refused (exit 1), with nothing deleted, for a key in flight, a completed key (its stored answer keeps retries from paying twice: orders gc deletes it once it expires), a key whose payment has no order (let the completer make the order: orders keys redrive), a key whose payment is not final at the gateway (processing, waiting for an action or a capture: it may still succeed), a key whose order exists, or when the gateway cannot be asked. The delete is one atomic step conditioned on the key being still the one looked at (the same attempt and operation, no answer, its lease run out): a retry or the completer that takes the key over in between makes it refuse. Prints what it deleted.", purgeQuiet), a.Getenv)
	c.storageFlags(fs)
	keyFlags(fs, &user, &key)
	fs.String(&operation, "operation", "ORDERS_KEYS_OPERATION", "", "refuse unless the key's operation is this one (its id, as orders keys show prints it); the delete is fenced on the operation looked at either way (default: any)")
	fs.String(&c.PaymentsURL, "payments-url", "PAYMENTS_URL", "", "the payment gateway serve pays through, asked whether the key's operation paid (default: the in-process gateway's ledger in the same database)")
	fs.String(&c.PaymentsKey, "payments-key", "PAYMENTS_API_KEY", "sk_test_local", "secret key of the gateway account serve pays with")
	fs.String(&c.RedisURL, "redis-url", "REDIS_URL", "", "the Redis serve runs in front of the database, if any: the purged attempt's lease lock there is deleted too (without it, a retry may be answered 409 for up to a second after the purge)")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	key, err := checkKeyFlags("orders keys purge", user, key)
	if err != nil {
		return err
	}
	if operation != "" && !isOperationID(operation) {
		return cli.Usagef("orders keys purge: --operation %q: want an operation id, 16 hex characters, as orders keys show prints it", operation)
	}
	if c.PaymentsKey == "" || strings.IndexFunc(c.PaymentsKey, func(r rune) bool { return r < 0x21 || r > 0x7e }) >= 0 {
		return cli.Usagef("orders keys purge: --payments-key: want the gateway's secret key, 1 or more visible ASCII characters (such as sk_test_…)")
	}
	if c.PaymentsURL != "" && !strings.HasPrefix(c.PaymentsURL, "http://") && !strings.HasPrefix(c.PaymentsURL, "https://") {
		return cli.Usagef("orders keys purge: --payments-url %q: want an http:// or https:// URL", c.PaymentsURL)
	}
	if c.RedisURL != "" {
		rdb, err := newRedis(c.RedisURL)
		if err != nil {
			return err
		}
		rdb.Close()
	}
	be, in, err := openInspector(ctx, &c)
	if err != nil {
		return err
	}
	defer be.close()
	if c.RedisURL != "" {
		if _, _, err := withRedis(ctx, be, c.RedisURL); err != nil {
			return err
		}
	}
	pu, ok := findPurger(be.store)
	if !ok {
		return fmt.Errorf("the store %T cannot purge keys", be.store)
	}
	who := fmt.Sprintf("key %s of user %s", quoteIfNeeded(key), quoteIfNeeded(user))
	noKey := fmt.Errorf("purge: user %s has no key %s (never used, released, purged, or completed and expired)", quoteIfNeeded(user), quoteIfNeeded(key))
	info, err := in.InspectKey(ctx, user, key, keysBudget)
	if errors.Is(err, idem.ErrNotFound) {
		return noKey
	}
	if err != nil {
		return err
	}
	op := idemdriver.OperationID(info.User, info.Key, info.CreatedAt)
	orderID := orders.OrderID(info.User, info.Key, info.CreatedAt)
	refuse := func(format string, args ...any) error {
		return fmt.Errorf("purge: refused: %s (operation %s): %s; nothing purged", who, op, fmt.Sprintf(format, args...))
	}
	if operation != "" && operation != op {
		return refuse("it holds this operation, not --operation %s", operation)
	}
	switch info.State {
	case idemdriver.KeyInFlight:
		return refuse("it is in-flight, an attempt holds it until %s; wait for it to end, then look again (orders keys show)", stamp(info.LeaseUntil))
	case idemdriver.KeyCompleted:
		return refuse("it is completed: its stored answer keeps the client's retries from paying twice; orders gc deletes it once it expires (%s)", stamp(info.ExpiresAt))
	}
	if since := info.At.Sub(info.LeaseUntil); since < purgeQuiet {
		return refuse("its lease ended only %s ago, and its last attempt may still be paying for up to %s after it; try again later", since.Round(time.Millisecond), purgeQuiet)
	}
	// The work the operation did, in the database and at the gateway: a
	// key whose operation made an order or a payment is not a key nobody
	// ran. (Its order would have stored the answer in the same
	// transaction; one without it is a damaged key, not one to free.)
	switch _, err := be.repo.Get(ctx, info.User, orderID); {
	case err == nil:
		return refuse("its order %s exists, though the key has no stored answer; look at it (orders keys show, orders audit) before anything else", orderID)
	case !errors.Is(err, orders.ErrNotFound):
		return refuse("looking up its order %s failed: %v", orderID, err)
	}
	if c.PaymentsURL == "" {
		// The in-process gateway is asked. Its ledger, were it made here
		// now, would know of no payment: when no instance ever set it up,
		// serve pays through another gateway, which must be asked.
		switch ok, err := be.gatewayExists(ctx); {
		case err != nil:
			return refuse("the payment gateway cannot be asked whether it paid: looking for the in-process gateway's ledger: %v", err)
		case !ok:
			return refuse("the in-process payment gateway was never used with this database, so serve pays through another one: give its --payments-url and --payments-key")
		}
	}
	p, _, err := newPayer(ctx, &c, be)
	if err != nil {
		return refuse("the payment gateway cannot be asked whether it paid: %v", err)
	}
	// Every payment of the operation, whatever its status: one that is
	// not final yet (processing, waiting for an action or a capture) may
	// still succeed, and after a purge the retry would pay again with a
	// new payment key.
	pays, err := p.paymentsOf(ctx, orderID)
	if err != nil {
		return refuse("the payment gateway cannot be asked whether it paid: %v", err)
	}
	for _, ch := range pays {
		if ch.Status == payments.StatusSucceeded {
			return refuse("its payment %s has no order: let the completer finish it (it makes the order with that payment) — orders keys redrive, for a given-up key", ch.ID)
		}
	}
	for _, ch := range pays {
		if !payments.Unpaid(ch.Status) {
			return refuse("its payment %s is %s at the gateway, not final: it may still succeed; wait until it succeeded (then let the completer make its order) or was canceled", ch.ID, ch.Status)
		}
	}
	rec, err := pu.Purge(ctx, info.User, info.Key, idemdriver.SeenOf(&info.Record))
	var np *idemdriver.NotPurgeableError
	switch {
	case errors.Is(err, idem.ErrNotFound):
		return noKey
	case errors.As(err, &np) && np.Changed:
		return refuse("it changed since it was looked at (a retry or the completer took it over; it is %s now); look again (orders keys show)", np.State)
	case errors.As(err, &np):
		return refuse("it is %s now", np.State)
	case err != nil:
		return err
	}
	fmt.Fprintf(a.Stdout, "purged: %s, operation %s (order %s, never created, no payment), %s (attempts: %d, re-drives by the completer: %d), created %s, last lease until %s; the next request with this key starts a new operation\n",
		who, op, orderID, info.State, rec.Attempts, rec.Redrives, stamp(rec.CreatedAt), stamp(rec.LeaseUntil))
	return nil
}

// findPurger returns st as an idemdriver.Purger, or else the first store under
// it, followed through Unwrap() idem.Store (a wrapper for metrics or
// traces), that is one.
func findPurger(st idem.Store) (idemdriver.Purger, bool) {
	for i := 0; st != nil && i < 16; i++ {
		if pu, ok := st.(idemdriver.Purger); ok {
			return pu, true
		}
		u, ok := st.(interface{ Unwrap() idem.Store })
		if !ok {
			break
		}
		st = u.Unwrap()
	}
	return nil, false
}
