package ordersapp

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
)

// keyRow is what the audit reads of one idempotency record.
type keyRow struct {
	User       string
	Key        string
	Method     string // "" for an idem.Do operation (the receipts consumer's message ids)
	CreatedAt  time.Time
	Status     int // 0 until completed
	LeaseUntil time.Time
	ExpiresAt  time.Time
	Attempts   int
	Redrives   int // the completers' re-drives
}

// auditReport is what `orders audit` found.
type auditReport struct {
	Orders, Keys, KeysCompleted, KeysPending int
	// Operations counts the idem.Do records (the receipts consumer's
	// message ids), which make no order; OperationsPending those without
	// an outcome yet.
	Operations, OperationsPending int
	Charges, ChargesSucceeded     int
	// ChargesRefunded counts the succeeded payments without an order that
	// were refunded in full: orders the database refused for good.
	ChargesRefunded int
	Pending         []string // charges whose order the completer may still make
	GivenUp         []string // keys without an outcome the completers gave up on
	Violations      []string
	// Since is the start of the window audited (zero: everything);
	// OutsideWindow counts the order ids read with a payment, key, event,
	// message or receipt whose order exists but began before it.
	Since         time.Time
	OutsideWindow int
	// events: invariants 5 and 6.
	events eventAudit
}

// giveUpAfter is how long a key without an outcome may wait after its last
// attempt before the audit no longer counts on serve's completer to finish
// it: its payment, if any, is then a violation.
var giveUpAfter = idem.CompleterOptions{Interval: completerInterval}.GiveUpAfter()

func (a *App) audit(ctx context.Context, args []string) error {
	var c Config
	fs := cli.NewFlagSet("orders audit", "Checks the invariants against the database and the payment gateway: one order per (user, key), one succeeded and unrefunded PaymentIntent per paid order and no payment without its order unless it was refunded in full (an order the database refused for good), every stored response with its order and every order with its stored response; every order with exactly one orders.created event in the outbox and, once sent, one message in stream ORDERS with its id and body, no event or message without its order, and at most one receipt per order. Unsent events and messages not yet applied are reported as pending, not as violations; a message id repeated in the stream (published again past the duplicate window) is counted. Prints a report; exits 1 on any violation.", a.Getenv)
	c.storageFlags(fs)
	fs.String(&c.PaymentsURL, "payments-url", "PAYMENTS_URL", "", "payment gateway base URL (default: the in-process gateway's ledger in the same database)")
	fs.String(&c.PaymentsKey, "payments-key", "PAYMENTS_API_KEY", "sk_test_local", "secret key of the gateway account to audit")
	c.natsFlag(fs, "NATS server with JetStream whose stream ORDERS to read: nats://host:port or tls://host:port, several comma-separated for a cluster "+
		"(default: the embedded server of the orders serve running on --data-dir, found through <data-dir>/nats.url; when none runs, one started by this process on <data-dir>/nats for the audit)")
	opts := auditOptions{Progress: a.Stderr}
	fs.Func("since", "ORDERS_AUDIT_SINCE", "", "audit only the operations begun at or after this time: RFC 3339 (2026-12-01T00:00:00Z) or a duration back from now (24h); their keys, payments, events, messages and receipts are judged, and whatever belongs to an earlier order is counted as outside the window (default: every order)", func(v string) error {
		if v == "" {
			opts.Since = time.Time{}
			return nil
		}
		if d, err := time.ParseDuration(v); err == nil && d > 0 {
			opts.Since = time.Now().Add(-d)
			return nil
		}
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return fmt.Errorf("want an RFC 3339 time such as 2026-12-01T00:00:00Z or a positive duration such as 24h, got %q", v)
		}
		opts.Since = t
		return nil
	})
	fs.String(&opts.TempDir, "temp-dir", "ORDERS_AUDIT_TEMP_DIR", "", "directory where the audit sorts what it reads, about 600 bytes per order at its peak (3 GB at 5 million orders), removed at the end (default: the system's temporary directory, $TMPDIR or /tmp)")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	be, err := openExisting(ctx, &c) // read-only: it creates and migrates nothing
	if err != nil {
		return err
	}
	defer be.close()
	p, _, err := newPayer(ctx, &c, be)
	if err != nil {
		return err
	}
	b, err := openBroker(ctx, &c, brokerOptions{mode: brokerJoin, client: "orders audit", logger: slog.New(slog.NewTextHandler(a.Stderr, nil))})
	if err != nil {
		return err
	}
	defer b.close()
	if c.NATSURL == "" {
		if err := checkAuditStream(ctx, be, b); err != nil {
			return err
		}
	}
	rep, err := auditWith(ctx, be, p, b.js, opts)
	if err != nil {
		return err
	}
	// Orders, keys and payments are read one after the other, not in one
	// snapshot: under live traffic a request that commits between two reads
	// looks like a violation. A violation counts only if a second pass, a
	// second later, sees it again.
	if len(rep.Violations) > 0 {
		time.Sleep(time.Second)
		fmt.Fprintf(a.Stderr, "orders audit: %d violations; reading everything again to keep those seen twice\n", len(rep.Violations))
		again, err := auditWith(ctx, be, p, b.js, opts)
		if err != nil {
			return err
		}
		seen := map[string]bool{}
		for _, v := range again.Violations {
			seen[v] = true
		}
		var kept []string
		for _, v := range rep.Violations {
			if seen[v] {
				kept = append(kept, v)
			}
		}
		again.Violations = kept
		rep = again
	}
	rep.print(a.Stdout)
	if len(rep.Violations) > 0 {
		return fmt.Errorf("%d invariant violations", len(rep.Violations))
	}
	return nil
}

// runAudit compares orders, idempotency keys, the gateway's charges, and
// the orders' events in the outbox, stream ORDERS (read through js) and
// the receipts, over every order. While it reads, it writes what it has
// read so far to progress (nil: nowhere) every auditProgressEvery, and
// once at the end.
func runAudit(ctx context.Context, be *backend, p payer, js jetstream.JetStream, progress io.Writer) (*auditReport, error) {
	return auditWith(ctx, be, p, js, auditOptions{Progress: progress})
}

// auditOptions are the settings of one pass of the audit.
type auditOptions struct {
	// Since, when set, limits the audit to the operations that began at
	// or after it (an order's key's creation, or the order's own without
	// a key), and to the keys, payments, events, messages and receipts of
	// those; what belongs to an earlier operation is counted as outside
	// the window, not judged. Zero: every order.
	Since time.Time
	// TempDir is where the audit sorts what it read (default: the
	// system's temporary directory). It needs about 600 bytes per order.
	TempDir string
	// SortBuffer is how many bytes of records each sort holds in memory
	// before it writes them to disk (default defaultSortBuffer).
	SortBuffer int
	// Progress, when set, gets a progress line every auditProgressEvery.
	Progress io.Writer
}

// auditWith is one pass of the audit. It reads each source once, in the
// order that lets a live system look consistent (orders, keys, refunds and
// payments, the outbox, the stream, the receipts consumer's ack floor, the
// receipts), and writes what it needs of each record to an on-disk sort
// by order id; then it walks the sorted sources together, one order id at
// a time, and judges each order with everything that names it. Its memory
// is a sort buffer and one order's records, whatever the number of orders;
// only the refunds (by payment) and the keys of the report's lists
// (pending, given up, violations) are held whole.
func auditWith(ctx context.Context, be *backend, p payer, js jetstream.JetStream, opts auditOptions) (*auditReport, error) {
	// Leases are the database's times: judge them by its clock, read
	// before the keys, so that a key is never called given up early.
	now, err := be.now(ctx)
	if err != nil {
		return nil, fmt.Errorf("reading the database's clock: %w", err)
	}
	dir, err := os.MkdirTemp(opts.TempDir, "orders-audit-")
	if err != nil {
		return nil, fmt.Errorf("audit: a directory to sort in: %w", err)
	}
	defer os.RemoveAll(dir)
	if opts.SortBuffer <= 0 {
		opts.SortBuffer = defaultSortBuffer
	}
	a := &auditPass{rep: &auditReport{Since: opts.Since}, now: now, since: opts.Since, be: be}
	a.sorters = map[string]*recordSorter{}
	for _, name := range auditSources {
		a.sorters[name] = newRecordSorter(dir, name, opts.SortBuffer)
	}
	if opts.Progress != nil {
		defer a.read.report(opts.Progress, auditProgressEvery)()
	}
	// The stream is read from the start of the pass, beside the
	// database's reads (see startStream); a pass that fails stops it.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if err := a.startStream(ctx, js); err != nil {
		return nil, err
	}
	defer func() {
		cancel()
		_ = a.stream.wait() // stopped: the pass returns its own outcome
	}()
	steps := []struct {
		name  string
		read  func() error
		fills []string // the sorts it fills, finished after it
	}{
		{"orders", func() error { return a.readOrders(ctx, be) }, []string{srcOrders, srcOps, srcPayments}},
		// The outbox is read after the orders (an order read has its event
		// in it) and before the stream stops (an event marked sent is in
		// it); the keys and the payments, after the orders too (a key
		// read has its order), have nothing to do with it: they are read
		// beside it, on two cores.
		{"keys, payments and outbox", func() error {
			outbox := make(chan error, 1)
			go func() { outbox <- a.readOutbox(ctx, be) }()
			err := a.readKeys(ctx, be)
			if err == nil {
				err = a.readCharges(ctx, p)
			}
			if oerr := <-outbox; err == nil {
				err = oerr
			}
			return err
		}, []string{srcKeys, srcCharges, srcEvents}},
		{"stream and receipts", func() error { return a.readEvents(ctx, be, js) }, []string{srcMessages, srcReceipts}},
		{"judging", func() error {
			if err := a.checkPayments(); err != nil {
				return err
			}
			return a.merge(ctx)
		}, nil},
	}
	for _, step := range steps {
		start := time.Now()
		if err := step.read(); err != nil {
			return nil, err
		}
		for _, name := range step.fills {
			if err := a.sorters[name].finish(); err != nil {
				return nil, err
			}
		}
		a.read.took(step.name, time.Since(start))
	}
	sort.Strings(a.rep.Violations)
	sort.Strings(a.rep.Pending)
	sort.Strings(a.rep.GivenUp)
	return a.rep, nil
}

// The audit's sorted sources, by the name of their recordSorter, each
// keyed by order id (but srcPayments, by payment id), and the fields of
// their records.
const (
	// id, user, status, payment id, created at (unix µs), key, key
	// created at (unix µs), event added ("1" or ""), total, currency,
	// hash of the order's JSON
	srcOrders = "orders"
	// OrderID(user, key, key created at), id, user, key: the keyed
	// orders whose id is not the one their operation names
	srcOps = "operations"
	// payment id, order id
	srcPayments = "payments"
	// order id, user, key, status, lease until (unix µs), attempts, redrives
	srcKeys = "keys"
	// order ref, PaymentIntent, amount, refunded: succeeded payments
	srcCharges = "charges"
	// order id, event id, subject, sent ("1" or ""), hash of the body
	srcEvents = "events"
	// order id, message id, stream sequence (8 bytes, big-endian), hash of the body
	srcMessages = "messages"
	// order id, receipt id, event id, user, total, currency
	srcReceipts = "receipts"
)

// auditSources are the sources merge walks, in the order of auditGroup's
// fields.
var auditSources = []string{srcOrders, srcOps, srcKeys, srcCharges, srcEvents, srcMessages, srcReceipts, srcPayments}

// auditPass is one pass of the audit: its report so far and its sorts.
type auditPass struct {
	rep   *auditReport
	now   time.Time // the database's clock before the keys were read
	since time.Time // auditOptions.Since
	be    *backend
	read  auditProgress

	sorters  map[string]*recordSorter
	refunded map[string]int64 // refunded amounts by PaymentIntent (refundedAmounts)
	// streamExists: stream ORDERS exists; ackFloor: the receipts
	// consumer's ack floor (readEvents).
	streamExists bool
	ackFloor     uint64
	// stream is the read of stream ORDERS (startStream); noID the
	// sequences of its messages without a Nats-Msg-Id.
	stream *auditStream
	noID   []uint64
}

func (a *auditPass) violate(format string, args ...any) {
	a.rep.Violations = append(a.rep.Violations, fmt.Sprintf(format, args...))
}

// bodyHash is what the audit keeps of a body to compare it with another.
func bodyHash(b []byte) string {
	h := sha256.Sum256(b)
	return string(h[:16])
}

func micros(t time.Time) string { return strconv.FormatInt(t.UnixMicro(), 10) }

func fromMicros(s string) time.Time {
	n, _ := strconv.ParseInt(s, 10, 64)
	return time.UnixMicro(n).UTC()
}

func atoi64(s string) int64 {
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}

func flagOf(b bool) string {
	if b {
		return "1"
	}
	return ""
}

// readOrders reads every order (of the window).
func (a *auditPass) readOrders(ctx context.Context, be *backend) error {
	ords, ops, pays := a.sorters[srcOrders], a.sorters[srcOps], a.sorters[srcPayments]
	err := be.ordersByID(ctx, a.since, func(o orders.Order) error {
		a.read.orders.Add(1)
		a.rep.Orders++
		body, err := orders.OrderJSON(&o)
		if err != nil {
			return err
		}
		if err := ords.add(o.ID, o.UserID, o.Status, o.PaymentID, micros(o.CreatedAt), o.IdempotencyKey, micros(o.KeyCreatedAt),
			flagOf(o.EventAdded), strconv.FormatInt(o.Total, 10), o.Currency, bodyHash(body)); err != nil {
			return err
		}
		if o.IdempotencyKey != "" {
			if op := orders.OrderID(o.UserID, o.IdempotencyKey, o.KeyCreatedAt); op != o.ID {
				if err := ops.add(op, o.ID, o.UserID, o.IdempotencyKey); err != nil {
					return err
				}
			}
		}
		return pays.add(o.PaymentID, o.ID)
	})
	if err != nil {
		return fmt.Errorf("reading orders: %w", err)
	}
	return nil
}

// checkPayments: one order per payment.
func (a *auditPass) checkPayments() error {
	r, err := a.sorters[srcPayments].sorted()
	if err != nil {
		return err
	}
	defer r.Close()
	for r.OK {
		pid := r.Key()
		var ids []string
		for r.OK && r.Key() == pid {
			ids = append(ids, r.Fields[1])
			if err := r.advance(); err != nil {
				return err
			}
		}
		if len(ids) > 1 {
			a.violate("payment %s pays for %d orders: %v", pid, len(ids), ids)
		}
	}
	return nil
}

// readKeys reads every idempotency key (of the window, and every key
// without an outcome: one may still make an order of the window).
func (a *auditPass) readKeys(ctx context.Context, be *backend) error {
	keys := a.sorters[srcKeys]
	err := be.keysSince(ctx, a.since, func(k keyRow) error {
		a.read.keys.Add(1)
		if k.Method == "" {
			// An idem.Do operation: a message id of the receipts
			// consumer, whose receipt the events' checks judge.
			a.rep.Operations++
			if k.Status == 0 {
				a.rep.OperationsPending++
			}
			return nil
		}
		a.rep.Keys++
		id := orders.OrderID(k.User, k.Key, k.CreatedAt)
		if k.Status == 0 {
			a.rep.KeysPending++
			if k.Redrives >= idem.DefaultCompleterMaxAttempts {
				a.rep.GivenUp = append(a.rep.GivenUp, fmt.Sprintf("user %q operation %s (order %s): %d attempts, %d re-drives, last lease until %s",
					k.User, idemdriver.OperationID(k.User, k.Key, k.CreatedAt), id, k.Attempts, k.Redrives, k.LeaseUntil.UTC().Format(time.RFC3339)))
			}
		} else {
			a.rep.KeysCompleted++
		}
		return keys.add(id, k.User, k.Key, strconv.Itoa(k.Status), micros(k.LeaseUntil), strconv.Itoa(k.Attempts), strconv.Itoa(k.Redrives))
	})
	if err != nil {
		return fmt.Errorf("reading idempotency keys: %w", err)
	}
	return nil
}

// readCharges reads the gateway's refunds, then its payments (of the
// window: they are listed newest first, and the listing stops at the
// first one made before it).
func (a *auditPass) readCharges(ctx context.Context, p payer) error {
	refunded, err := a.refundedAmounts(ctx, p)
	if err != nil {
		return err
	}
	a.refunded = refunded
	charges := a.sorters[srcCharges]
	// add adds one payment; false: it was made before the window, and so
	// is every payment after it.
	add := func(id, status, orderRef string, amount int64, created time.Time) (bool, error) {
		if !a.since.IsZero() && created.Before(a.since.Add(-streamAgeMargin)) {
			return false, nil
		}
		a.read.payments.Add(1)
		a.rep.Charges++
		if status != "succeeded" {
			return true, nil
		}
		a.rep.ChargesSucceeded++
		return true, charges.add(orderRef, id, strconv.FormatInt(amount, 10), strconv.FormatInt(refunded[id], 10))
	}
	if p.ledger != nil {
		// The in-process gateway: its ledger, in pages of thousands,
		// without the API's JSON (which took half of the audit's time).
		errBefore := errors.New("before the window")
		err := payments.EachIntent(ctx, p.ledger, p.account, func(pi *payments.PaymentIntent) error {
			more, err := add(pi.ID, pi.Status, pi.Metadata["order_ref"], pi.Amount, time.Unix(pi.Created, 0))
			if err == nil && !more {
				err = errBefore
			}
			return err
		})
		if err != nil && !errors.Is(err, errBefore) {
			return fmt.Errorf("listing payments: %w", err)
		}
		return nil
	}
	for ch, err := range p.c.All(ctx) {
		if err != nil {
			return fmt.Errorf("listing payments: %w", err)
		}
		more, err := add(ch.ID, ch.Status, ch.Metadata["order_ref"], ch.Amount, ch.Created)
		if err != nil {
			return err
		}
		if !more {
			break
		}
	}
	return nil
}

// refundedAmounts returns how much the succeeded refunds gave back, by
// PaymentIntent, from one listing of every refund of the account (not one
// call per payment: refunds are few, payments many). It is read before the
// payments: a refund is made after its payment succeeded, so every payment
// listed next that a refund read here gave back is judged with it.
func (a *auditPass) refundedAmounts(ctx context.Context, p payer) (map[string]int64, error) {
	sum := map[string]int64{}
	for r, err := range p.c.AllRefunds(ctx) {
		if err != nil {
			return nil, fmt.Errorf("listing refunds: %w", err)
		}
		a.read.refunds.Add(1)
		if r.Status == payments.StatusRefundSucceeded {
			sum[r.PaymentIntent] += r.Amount
		}
	}
	return sum, nil
}

// auditProgressEvery is how often `orders audit` writes its progress line.
const auditProgressEvery = 5 * time.Second

// auditProgress counts what one pass of the audit has read.
type auditProgress struct {
	orders, keys, payments, refunds, events, messages, receipts atomic.Int64
	judged                                                      atomic.Int64 // order ids merged and judged
	start                                                       time.Time

	mu     sync.Mutex
	phases []string // "orders 1.2s", … of the steps done
}

// took records that the step name took d.
func (p *auditProgress) took(name string, d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.phases = append(p.phases, fmt.Sprintf("%s %.1fs", name, d.Seconds()))
}

func (p *auditProgress) line() string {
	p.mu.Lock()
	phases := strings.Join(p.phases, ", ")
	p.mu.Unlock()
	if phases != "" {
		phases = ": " + phases
	}
	return fmt.Sprintf("orders audit: read %d orders, %d idempotency keys, %d payments, %d refunds, %d events in the outbox, %d stream messages, %d receipts; judged %d order ids (%s%s)",
		p.orders.Load(), p.keys.Load(), p.payments.Load(), p.refunds.Load(), p.events.Load(), p.messages.Load(), p.receipts.Load(),
		p.judged.Load(), time.Since(p.start).Round(time.Second), phases)
}

// report writes p's line to w every period until the function it returns
// is called, which writes it once more and waits for the writer to stop.
func (p *auditProgress) report(w io.Writer, period time.Duration) (stop func()) {
	p.start = time.Now()
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-done:
				fmt.Fprintln(w, p.line())
				return
			case <-t.C:
				fmt.Fprintln(w, p.line())
			}
		}
	}()
	return func() {
		close(done)
		<-stopped
	}
}

func (r *auditReport) print(w io.Writer) {
	if !r.Since.IsZero() {
		fmt.Fprintf(w, "window:            operations begun at or after %s; %d order ids outside it (of an earlier operation) not judged\n",
			r.Since.UTC().Format(time.RFC3339Nano), r.OutsideWindow)
	}
	fmt.Fprintf(w, "orders:            %d\n", r.Orders)
	fmt.Fprintf(w, "idempotency keys:  %d (%d with a stored answer, %d without)\n", r.Keys, r.KeysCompleted, r.KeysPending)
	fmt.Fprintf(w, "operations:        %d (idem.Do keys of the receipts consumer; %d without an outcome yet)\n", r.Operations, r.OperationsPending)
	fmt.Fprintf(w, "payments:          %d (%d succeeded)\n", r.Charges, r.ChargesSucceeded)
	fmt.Fprintf(w, "refunded:          %d (succeeded payments without an order, refunded in full)\n", r.ChargesRefunded)
	fmt.Fprintf(w, "pending:           %d\n", len(r.Pending))
	for _, p := range r.Pending {
		fmt.Fprintf(w, "  %s\n", p)
	}
	fmt.Fprintf(w, "given up:          %d (keys without an outcome the completers gave up on; an operator's)\n", len(r.GivenUp))
	for _, g := range r.GivenUp {
		fmt.Fprintf(w, "  %s\n", g)
	}
	r.events.print(w)
	fmt.Fprintf(w, "violations:        %d\n", len(r.Violations))
	for _, v := range r.Violations {
		fmt.Fprintf(w, "  %s\n", v)
	}
	if len(r.Violations) == 0 {
		fmt.Fprintln(w, "OK: every invariant holds")
	}
}
