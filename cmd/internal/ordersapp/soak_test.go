package ordersapp

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// soakFlag runs TestSoak for longer than the CI minute:
//
//	go test -run TestSoak -count=1 ./cmd/internal/ordersapp -args -soak=10m
//
// or IDEM_SOAK=10m in the environment (the flag wins).
var soakFlag = flag.Duration("soak", 0, "run TestSoak for this long, with an instance killed every minute (0: the 60-second CI run, a kill every 15s); IDEM_SOAK sets it too")

// Shape of the soak's load.
const (
	soakClients  = 12                    // goroutines, each sending one order after another
	soakUsers    = 4                     // bearer-token users the clients share
	soakInstance = 3                     // `orders serve` processes
	soakThink    = 20 * time.Millisecond // mean pause between two orders of a client
	soakLease    = "3s"                  // --key-lease: a killed attempt's key is free again after it
	// soakGatewayLatency is the gateway's --latency: each order holds its
	// claimed key that long, so that a kill finds keys claimed and charges
	// under way.
	soakGatewayLatency = "50ms"
	// soakKillInFlight: a kill waits (at most 2s) until this many
	// attempts are in flight to its victim.
	soakKillInFlight = 2
	// soakDuplicateEvery-th order of a client is sent twice at once, to two
	// instances; after every soakReuseEvery-th a key of the client's past
	// is sent again with its body (a replay); after every
	// soakMismatchEvery-th, with another body (a 422).
	soakDuplicateEvery = 10
	soakReuseEvery     = 10
	soakMismatchEvery  = 50
)

// soakDuration is the run's length and how often an instance is killed.
func soakDuration(t *testing.T) (run, killEvery time.Duration) {
	run = 60 * time.Second
	if *soakFlag > 0 {
		run = *soakFlag
	} else if v := os.Getenv("IDEM_SOAK"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("IDEM_SOAK=%q: not a positive duration such as 10m", v)
		}
		run = d
	}
	return run, min(time.Minute, run/4)
}

// soakRoute steers the attempts of one request: the first goes to
// instance first, and each failure in transit (the instance died or is
// restarting) moves the next attempt to the next instance.
type soakRoute struct {
	first    int
	switches atomic.Int64
}

type soakRouteKey struct{}

// soakRouter is the Base of the clients' retrying transport: it sends each
// attempt to the instance its soakRoute names and counts the attempts.
type soakRouter struct {
	base     http.RoundTripper
	hosts    []string       // host:port of each instance
	inFlight []atomic.Int64 // attempts sent to each instance and not answered
	attempts atomic.Int64
	transit  atomic.Int64 // attempts that failed in transit
	mu       sync.Mutex   // guards byStatus
	byStatus map[int]int  // answered attempts by status
}

func (r *soakRouter) RoundTrip(req *http.Request) (*http.Response, error) {
	rt, _ := req.Context().Value(soakRouteKey{}).(*soakRoute)
	i := 0
	if rt != nil {
		i = (rt.first + int(rt.switches.Load())) % len(r.hosts)
	}
	out := req.Clone(req.Context())
	out.URL.Host = r.hosts[i]
	out.Host = r.hosts[i]
	r.attempts.Add(1)
	r.inFlight[i].Add(1)
	resp, err := r.base.RoundTrip(out)
	r.inFlight[i].Add(-1)
	if err != nil {
		r.transit.Add(1)
		if rt != nil {
			rt.switches.Add(1)
		}
		return nil, err
	}
	r.mu.Lock()
	r.byStatus[resp.StatusCode]++
	r.mu.Unlock()
	return resp, nil
}

func (r *soakRouter) statuses() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return soakCounts(r.byStatus)
}

// soakCounts prints a map of counts in key order.
func soakCounts[K int | string](m map[K]int) string {
	keys := make([]K, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	var b []string
	for _, k := range keys {
		b = append(b, fmt.Sprintf("%v: %d", k, m[k]))
	}
	return "{" + strings.Join(b, ", ") + "}"
}

// soakSend is the final answer one client got for one send of a key.
type soakSend struct {
	user, key string
	kind      string // "new", "duplicate", "reuse", "mismatch"
	status    int
	err       string // the exchange failed in transit, or its body
	replayed  bool
	orderID   string
	body      [32]byte // SHA-256 of the answer's body
}

// soakLife is one process lifetime and the resident memory sampled in it.
type soakLife struct {
	name     string
	pid      int
	from, to time.Duration // since the run began
	rss      []int64       // kB, from /proc/<pid>/status
}

// soakRSS reads VmRSS of pid, in kB.
func soakRSS(pid int) (int64, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				return 0, false
			}
			n, err := strconv.ParseInt(f[0], 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// soakMedian returns the median of xs (not empty).
func soakMedian(xs []int64) int64 {
	s := append([]int64(nil), xs...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Flatness of resident memory, judged per process lifetime: the largest
// sample of its last third may exceed the median of its middle third by at
// most soakRSSFactor plus soakRSSSlack. See TestSoak.
const (
	soakRSSFactor     = 1.25
	soakRSSSlack      = 4 << 10 // kB
	soakRSSMinSamples = 9
)

// soakFlat judges one lifetime; ok is false when it has too few samples.
func soakFlat(l *soakLife) (mid, lastMax int64, flat, ok bool) {
	n := len(l.rss)
	if n < soakRSSMinSamples {
		return 0, 0, true, false
	}
	mid = soakMedian(l.rss[n/3 : 2*n/3])
	for _, v := range l.rss[2*n/3:] {
		lastMax = max(lastMax, v)
	}
	return mid, lastMax, float64(lastMax) <= soakRSSFactor*float64(mid)+soakRSSSlack, true
}

// TestSoak (issue 10, point 7): three `orders serve` processes on one
// PostgreSQL database, a standalone gateway (`payments serve`, its own
// database) that drops 10% of its answers after charging, soakClients
// goroutines sending orders through the retrying client (each request
// starting at one instance and moving to the next after a failure in
// transit), some keys sent twice at once and some sent again later, and
// every killEvery one instance killed with SIGKILL while requests are in
// flight to it and restarted with the same arguments on the same port.
// Instances 0 and 1 take turns being killed; instance 2 lives the whole
// run, so that one `orders serve` lifetime is as long as the soak.
//
// At the end: every send ended with 201 and every send of a key got the
// same body; one order per key, with the id its clients got; exactly one
// succeeded payment per order and none without an order; no key without
// an outcome once the completers caught up (bounded wait); `orders audit`
// clean with 0 pending. Resident memory (VmRSS) of each process is sampled
// every second (two in runs over five minutes) and judged per lifetime, a
// restarted instance being a new one: the largest sample of its last third
// must not exceed 1.25 × the median of its middle third + 4 MiB. The
// middle third is the baseline because the first holds the warm-up
// (connection pool, buffers, the heap finding its size: 17 → 24 MiB in
// the first seconds); its median, so that one GC peak does not move it;
// the last third's maximum, so that growth cannot hide between samples.
// At steady load a Go process's RSS moves with the GC's cycle and the
// lazy return of freed pages, a few per cent here (at most 1.07× in the
// runs that set these bounds), and a burst after a kill (the victim's
// clients moving to the others) adds a few MiB; 1.25× + 4 MiB leaves
// room for both, while a leak that grows a process by more than 27 MiB over
// one lifetime (from ~24 MiB) fails (TestSoakFlatJudge). It is a
// statement about memory, not time: the machine's speed changes the
// number of requests, not what a flat process looks like; a lifetime with
// fewer than 9 samples is reported, not judged. Small leaks below that
// show in the logged first/peak/last figures, not in a failure.
func TestSoak(t *testing.T) {
	// Runs for a fixed time and judges memory, not speed: it runs beside
	// the package's long waiters (t.Parallel).
	t.Parallel()
	runFor, killEvery := soakDuration(t)
	sampleEvery := time.Second
	if runFor > 5*time.Minute {
		sampleEvery = 2 * time.Second
	}
	payDB := pgtest.Database(t)
	c := newChain(t, soakInstance, []string{"--fail-after-charge", "0.1", "--latency", soakGatewayLatency, "--database-url", payDB}, "--key-lease", soakLease)
	ordersBin, _ := binaries(t)
	argsOf := func(i int) []string {
		return []string{"serve", "--addr", strings.TrimPrefix(c.bases[i], "http://"), "--data-dir", c.dir, "--database-url", c.db,
			"--jwt-secret", testSecret, "--payments-url", c.payURL, "--key-lease", soakLease, "--nats-url", c.natsURL}
	}

	// Resident memory, per lifetime.
	var (
		lifeMu sync.Mutex // guards lives, current
		lives  []*soakLife
	)
	current := make([]*soakLife, soakInstance+1) // the orders instances, then the gateway
	lifetimes := make([]int, soakInstance+1)     // lifetimes so far, per slot
	began := time.Now()
	newLife := func(slot int, name string, pid int) {
		lifetimes[slot]++
		if slot < soakInstance {
			name = fmt.Sprintf("%s #%d", name, lifetimes[slot])
		}
		l := &soakLife{name: name, pid: pid, from: time.Since(began)}
		lives = append(lives, l)
		current[slot] = l
	}
	lifeMu.Lock()
	for i, p := range c.orders {
		newLife(i, fmt.Sprintf("orders-%d", i), p.cmd.Process.Pid)
	}
	newLife(soakInstance, "payments", c.payments.cmd.Process.Pid)
	lifeMu.Unlock()
	sample := func() {
		lifeMu.Lock()
		defer lifeMu.Unlock()
		for _, l := range current {
			if v, ok := soakRSS(l.pid); ok {
				l.rss = append(l.rss, v)
			}
		}
	}
	lastRSS := func() string {
		lifeMu.Lock()
		defer lifeMu.Unlock()
		var b []string
		for _, l := range current {
			if n := len(l.rss); n > 0 {
				b = append(b, fmt.Sprintf("%s %.1f", l.name, float64(l.rss[n-1])/1024))
			}
		}
		return strings.Join(b, ", ")
	}
	samplerDone := make(chan struct{})
	stopSampler := make(chan struct{})
	sample()
	go func() {
		defer close(samplerDone)
		tick := time.NewTicker(sampleEvery)
		defer tick.Stop()
		for {
			select {
			case <-stopSampler:
				return
			case <-tick.C:
				sample()
			}
		}
	}()

	// The clients.
	hosts := make([]string, soakInstance)
	for i, b := range c.bases {
		hosts[i] = strings.TrimPrefix(b, "http://")
	}
	base := &http.Transport{MaxIdleConnsPerHost: 2 * soakClients, IdleConnTimeout: 30 * time.Second}
	t.Cleanup(base.CloseIdleConnections)
	router := &soakRouter{base: base, hosts: hosts, inFlight: make([]atomic.Int64, soakInstance), byStatus: map[int]int{}}
	var retries atomic.Int64
	hc := &http.Client{Transport: &client.Transport{
		Base:           router,
		MaxAttempts:    10000, // the deadline bounds the retries
		InitialBackoff: 20 * time.Millisecond,
		MaxBackoff:     500 * time.Millisecond,
		MaxElapsed:     2 * time.Minute,
		AttemptTimeout: 30 * time.Second,
		OnRetry:        func(int, *http.Response, error, time.Duration) { retries.Add(1) },
	}}
	tokens := make([]string, soakUsers)
	for i := range tokens {
		tokens[i] = token(t, fmt.Sprintf("soak-user-%d", i))
	}
	ctx, cancel := context.WithCancel(context.Background())
	send := func(user int, key, body, kind string, first int) soakSend {
		s := soakSend{user: fmt.Sprintf("soak-user-%d", user), key: key, kind: kind}
		rctx := context.WithValue(ctx, soakRouteKey{}, &soakRoute{first: first})
		req, err := http.NewRequestWithContext(rctx, http.MethodPost, c.bases[first]+"/v1/orders", strings.NewReader(body))
		if err != nil {
			s.err = err.Error()
			return s
		}
		req.Header.Set("Authorization", "Bearer "+tokens[user])
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := hc.Do(req)
		if err != nil {
			s.err = err.Error()
			return s
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			s.err = "reading the answer: " + err.Error()
			return s
		}
		s.status = resp.StatusCode
		s.replayed = resp.Header.Get("Idempotent-Replayed") == "true"
		s.body = sha256.Sum256(b)
		var o struct {
			ID string `json:"id"`
		}
		if s.status == http.StatusCreated && json.Unmarshal(b, &o) == nil {
			s.orderID = o.ID
		}
		return s
	}
	var (
		stop    = make(chan struct{})
		clients sync.WaitGroup
		results = make([][]soakSend, soakClients)
		sends   atomic.Int64
		created atomic.Int64 // sends answered 201
	)
	stopOnce := sync.OnceFunc(func() { close(stop) })
	t.Cleanup(func() { stopOnce(); cancel(); clients.Wait() }) // before the processes stop, on any exit
	record := func(g int, s soakSend) {
		results[g] = append(results[g], s)
		sends.Add(1)
		if s.status == http.StatusCreated {
			created.Add(1)
		}
	}
	for g := 0; g < soakClients; g++ {
		clients.Add(1)
		go func(g int) {
			defer clients.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			user, home := g%soakUsers, g%soakInstance
			type past struct {
				key  string
				body string
			}
			var done []past
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				case <-time.After(time.Duration(rng.Int64N(int64(2 * soakThink)))):
				}
				key := fmt.Sprintf("soak-%d-%d", g, n)
				body := orderBody(g*100000 + n)
				if n%soakDuplicateEvery == soakDuplicateEvery/2 {
					var other soakSend
					var wg sync.WaitGroup
					wg.Add(1)
					go func() { defer wg.Done(); other = send(user, key, body, "duplicate", (home+1)%soakInstance) }()
					s := send(user, key, body, "duplicate", home)
					wg.Wait()
					record(g, s)
					record(g, other)
				} else {
					record(g, send(user, key, body, "new", home))
				}
				done = append(done, past{key, body})
				if n%soakReuseEvery == soakReuseEvery-1 {
					p := done[rng.IntN(len(done))]
					record(g, send(user, p.key, p.body, "reuse", rng.IntN(soakInstance)))
				}
				if n%soakMismatchEvery == soakMismatchEvery-1 {
					p := done[rng.IntN(len(done))]
					record(g, send(user, p.key, orderBody(g*100000+n+1), "mismatch", rng.IntN(soakInstance)))
				}
			}
		}(g)
	}

	// The run: progress every 10s, a kill every killEvery.
	var (
		kills, restarts int
		inFlightAtKill  []int64
	)
	progress := time.NewTicker(10 * time.Second)
	defer progress.Stop()
	end := time.NewTimer(runFor)
	defer end.Stop()
	nextKill := killEvery
	kill := time.NewTimer(killEvery)
	defer kill.Stop()
	logProgress := func() {
		t.Logf("soak %v: %d sends ended (%d 201), %d attempts %s, %d in transit failures, %d retries; kills %d, restarts %d; RSS MiB: %s",
			time.Since(began).Round(time.Second), sends.Load(), created.Load(), router.attempts.Load(), router.statuses(),
			router.transit.Load(), retries.Load(), kills, restarts, lastRSS())
	}
run:
	for {
		select {
		case <-progress.C:
			logProgress()
		case <-end.C:
			break run
		case <-kill.C:
			victim := kills % 2 // instances 0 and 1 by turns; 2 lives throughout
			// Kill while requests are in flight to the victim (wait for
			// soakKillInFlight at most 2 s; the count is reported).
			for wait := time.Now().Add(2 * time.Second); router.inFlight[victim].Load() < soakKillInFlight && time.Now().Before(wait); {
				time.Sleep(time.Millisecond) // a poll with a deadline (2s)
			}
			lifeMu.Lock()
			inFlightAtKill = append(inFlightAtKill, router.inFlight[victim].Load())
			c.orders[victim].kill() // SIGKILL, reaped
			current[victim].to = time.Since(began)
			lifeMu.Unlock()
			kills++
			p := start(t, c.bases[victim]+"/healthz", ordersBin, argsOf(victim)...)
			lifeMu.Lock()
			c.orders[victim] = p
			newLife(victim, fmt.Sprintf("orders-%d", victim), p.cmd.Process.Pid)
			lifeMu.Unlock()
			restarts++
			nextKill += killEvery
			if nextKill < runFor {
				kill.Reset(time.Until(began.Add(nextKill)))
			}
		}
	}
	loadTook := time.Since(began)
	stopOnce()
	close(stopSampler)
	<-samplerDone
	lifeMu.Lock()
	for _, l := range current {
		l.to = loadTook
	}
	lifeMu.Unlock()
	clients.Wait() // each send ends within the client's deadline (2 min)
	drained := time.Since(began)
	logProgress()

	// The completers catch up: no key without an outcome (bounded wait).
	pending := -1
	for wait := time.Now().Add(60 * time.Second); time.Now().Before(wait); time.Sleep(500 * time.Millisecond) { // a poll with a deadline
		if pending = countRows(t, c.db, `SELECT count(*) FROM idempotency_keys WHERE response_status IS NULL`); pending == 0 {
			break
		}
	}
	if pending != 0 {
		t.Errorf("%d keys still without an outcome 60s after the load ended", pending)
	}

	// What the clients got.
	type keyOf struct{ user, key string }
	byKey := map[keyOf][]soakSend{}
	kinds := map[string]int{}
	finals := map[string]int{}
	replays := 0
	var all []soakSend
	for _, rs := range results {
		all = append(all, rs...)
	}
	for _, s := range all {
		kinds[s.kind]++
		label := strconv.Itoa(s.status)
		if s.err != "" {
			label = "no answer"
		}
		finals[label]++
		if s.replayed {
			replays++
		}
		k := keyOf{s.user, s.key}
		byKey[k] = append(byKey[k], s)
	}
	var bad []string
	for k, ss := range byKey {
		var want *soakSend
		for i := range ss {
			s := &ss[i]
			switch {
			case s.kind == "mismatch":
				if s.status != http.StatusUnprocessableEntity {
					bad = append(bad, fmt.Sprintf("%s/%s sent again with another body: %d %s, want 422", k.user, k.key, s.status, s.err))
				}
			case s.status != http.StatusCreated:
				bad = append(bad, fmt.Sprintf("%s/%s (%s): %d %s, want 201", k.user, k.key, s.kind, s.status, s.err))
			case want == nil:
				want = s
			case s.body != want.body || s.orderID != want.orderID:
				bad = append(bad, fmt.Sprintf("%s/%s (%s): order %s, another send got order %s (or another body)", k.user, k.key, s.kind, s.orderID, want.orderID))
			}
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		t.Errorf("%d sends did not get the key's one answer: %s", len(bad), strings.Join(bad[:min(len(bad), 20)], "; "))
	}

	// One order per key, with the id its clients got.
	dbctx, dbcancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer dbcancel()
	conn, err := pgx.Connect(dbctx, c.db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(dbctx, `SELECT id, user_id, coalesce(idempotency_key, '') FROM orders`)
	if err != nil {
		t.Fatal(err)
	}
	orderOf := map[keyOf][]string{}
	orderIDs := map[string]bool{}
	nOrders := 0
	for rows.Next() {
		var id, user, key string
		if err := rows.Scan(&id, &user, &key); err != nil {
			t.Fatal(err)
		}
		nOrders++
		orderIDs[id] = true
		orderOf[keyOf{user, key}] = append(orderOf[keyOf{user, key}], id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var orderBad []string
	for k, ids := range orderOf {
		if _, sent := byKey[k]; !sent {
			orderBad = append(orderBad, fmt.Sprintf("order %v for %s/%s, a key no client sent", ids, k.user, k.key))
		} else if len(ids) != 1 {
			orderBad = append(orderBad, fmt.Sprintf("%s/%s has %d orders %v", k.user, k.key, len(ids), ids))
		}
	}
	for k, ss := range byKey {
		ids := orderOf[k]
		if len(ids) == 0 {
			orderBad = append(orderBad, fmt.Sprintf("%s/%s has no order", k.user, k.key))
			continue
		}
		for _, s := range ss {
			if s.orderID != "" && s.orderID != ids[0] {
				orderBad = append(orderBad, fmt.Sprintf("%s/%s: a client got order %s, the database holds %s", k.user, k.key, s.orderID, ids[0]))
				break
			}
		}
	}
	sort.Strings(orderBad)
	if len(orderBad) > 0 || nOrders != len(byKey) {
		t.Errorf("%d orders for %d keys sent; %d problems: %s", nOrders, len(byKey), len(orderBad), strings.Join(orderBad[:min(len(orderBad), 20)], "; "))
	}

	// Exactly one succeeded payment per order, none without an order.
	pc := payments.NewClient(payments.ClientConfig{BaseURL: c.payURL, APIKey: "sk_test_local", HTTPClient: &http.Client{Timeout: time.Minute}})
	perOrder := map[string]int{}
	byPIStatus := map[string]int{}
	var orphans []string
	succeeded := 0
	for ch, err := range pc.All(dbctx) {
		if err != nil {
			t.Fatal(err)
		}
		byPIStatus[ch.Status]++
		if ch.Status != "succeeded" {
			continue
		}
		succeeded++
		ref := ch.Metadata["order_ref"]
		perOrder[ref]++
		if !orderIDs[ref] {
			orphans = append(orphans, ch.ID)
		}
	}
	var twice, unpaid []string
	for ref, n := range perOrder {
		if n > 1 {
			twice = append(twice, fmt.Sprintf("%s (%d)", ref, n))
		}
	}
	for id := range orderIDs {
		if perOrder[id] == 0 {
			unpaid = append(unpaid, id)
		}
	}
	if len(orphans) > 0 || len(twice) > 0 || len(unpaid) > 0 || succeeded != nOrders {
		t.Errorf("%d succeeded payments for %d orders: %d without an order %v, %d orders paid more than once %v, %d orders unpaid %v",
			succeeded, nOrders, len(orphans), orphans[:min(len(orphans), 10)], len(twice), twice[:min(len(twice), 10)], len(unpaid), unpaid[:min(len(unpaid), 10)])
	}
	dropped := strings.Count(c.payments.logs.String(), "connection dropped after charge")

	audit := c.audit(t)

	// The figures.
	var killedInFlight int64
	for _, n := range inFlightAtKill {
		killedInFlight += n
	}
	t.Logf("soak: %v of load (%d clients, %d users, %d instances, mean pause %v), drained at %v; kill every %v",
		loadTook.Round(time.Millisecond), soakClients, soakUsers, soakInstance, soakThink, drained.Round(time.Millisecond), killEvery)
	t.Logf("sends: %d ended %s, by kind %s; %d answered as replays; %d distinct keys",
		len(all), soakCounts(finals), soakCounts(kinds), replays, len(byKey))
	t.Logf("attempts: %d, answered %s, %d failed in transit, %d retries; throughput %.1f orders/s, %.1f attempts/s",
		router.attempts.Load(), router.statuses(), router.transit.Load(), retries.Load(),
		float64(nOrders)/loadTook.Seconds(), float64(router.attempts.Load())/loadTook.Seconds())
	t.Logf("kills %d (SIGKILL), restarts %d; attempts in flight to the victim at each kill %v", kills, restarts, inFlightAtKill)
	t.Logf("orders %d, succeeded payments %d, PaymentIntents by status %s; gateway answers dropped after charging %d",
		nOrders, succeeded, soakCounts(byPIStatus), dropped)
	t.Logf("audit:\n%s", audit)
	var notFlat []string
	for _, l := range lives {
		if len(l.rss) == 0 {
			t.Logf("RSS %-12s pid %d, %v-%v: no sample", l.name, l.pid, l.from.Round(time.Second), l.to.Round(time.Second))
			continue
		}
		peak := int64(0)
		for _, v := range l.rss {
			peak = max(peak, v)
		}
		mid, lastMax, flat, judged := soakFlat(l)
		verdict := "too few samples to judge"
		if judged {
			verdict = fmt.Sprintf("middle-third median %.1f, last-third max %.1f (%.2fx)", float64(mid)/1024, float64(lastMax)/1024, float64(lastMax)/float64(mid))
			if !flat {
				notFlat = append(notFlat, l.name)
			}
		}
		t.Logf("RSS %-12s pid %d, %v-%v, %d samples: first %.1f MiB, peak %.1f, last %.1f; %s", l.name, l.pid,
			l.from.Round(time.Second), l.to.Round(time.Second), len(l.rss), float64(l.rss[0])/1024, float64(peak)/1024, float64(l.rss[len(l.rss)-1])/1024, verdict)
	}

	// The run did what it says.
	if len(notFlat) > 0 {
		t.Errorf("resident memory grew in %v: last third over %.1f x the middle third's median + %d MiB", notFlat, soakRSSFactor, soakRSSSlack>>10)
	}
	if wantKills := int((runFor - 1) / killEvery); kills != wantKills || restarts != kills {
		t.Errorf("%d kills, %d restarts; want %d each", kills, restarts, wantKills)
	}
	if killedInFlight == 0 {
		t.Errorf("no request was in flight to a killed instance: the kills missed the load")
	}
	if dropped == 0 {
		t.Errorf("the gateway dropped no answer after charging: the fault was not exercised")
	}
	if kinds["duplicate"] == 0 || kinds["reuse"] == 0 || kinds["mismatch"] == 0 {
		t.Errorf("sends by kind %s: some kind never ran", soakCounts(kinds))
	}
}

// TestSoakFlatJudge checks TestSoak's judgement of resident memory on
// made-up series: a flat one, a GC sawtooth and a warm-up pass; a steady
// leak and a late jump fail; a short lifetime is not judged.
func TestSoakFlatJudge(t *testing.T) {
	series := func(n int, f func(i int) int64) []int64 {
		xs := make([]int64, n)
		for i := range xs {
			xs[i] = f(i)
		}
		return xs
	}
	const mib = 1 << 10 // kB
	for _, tt := range []struct {
		name       string
		rss        []int64
		flat, judg bool
	}{
		{"flat", series(60, func(int) int64 { return 25 * mib }), true, true},
		{"GC sawtooth", series(60, func(i int) int64 { return int64(22+2*(i%3)) * mib }), true, true},
		{"a burst of 6 MiB late", series(60, func(i int) int64 { return int64(24+6*(i/50)*((59-i)/5)) * mib }), true, true},
		{"warm-up then flat", series(60, func(i int) int64 { return int64(min(10+i, 25)) * mib }), true, true},
		{"leak of 1 MiB per sample", series(60, func(i int) int64 { return int64(20+i) * mib }), false, true},
		{"leak of 1 MiB per 2 samples", series(60, func(i int) int64 { return int64(20+i/2) * mib }), false, true},
		{"jump at the end", series(60, func(i int) int64 { return int64(25+100*(i/59)) * mib }), false, true},
		{"too short", series(soakRSSMinSamples-1, func(i int) int64 { return int64(20 + 100*i) }), true, false},
	} {
		_, _, flat, judged := soakFlat(&soakLife{name: tt.name, rss: tt.rss})
		if flat != tt.flat || judged != tt.judg {
			t.Errorf("%s: flat %v judged %v, want %v %v", tt.name, flat, judged, tt.flat, tt.judg)
		}
	}
}
