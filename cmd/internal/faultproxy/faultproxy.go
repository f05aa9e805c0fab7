// Package faultproxy puts a fault proxy between a test's processes and
// one of their dependencies (PostgreSQL, Redis, an HTTP service), on
// 127.0.0.1, with toxiproxy used as a library in the test process. A
// Proxy adds latency (toxiproxy's own toxic), partitions that hold the
// traffic in both directions until healed (as TCP does while a link is
// down: nothing is lost, everything arrives late), and, for PostgreSQL,
// cuts connections at the one moment where the client cannot know the
// outcome: after the server executed the COMMIT of a marked transaction
// and before its answer reaches the client (see WithCommitCut).
//
// Clients must talk to PostgreSQL without TLS through a Proxy
// (sslmode=disable) for the commit cut to see the protocol; a connection
// that starts otherwise is passed through untouched and counted as opaque.
package faultproxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/stream"
	"github.com/Shopify/toxiproxy/v2/toxics"
	"github.com/rs/zerolog"
)

// The toxic types this package registers with toxiproxy.
const (
	holdType = "idem_faultproxy_hold"
	pgType   = "idem_faultproxy_pg"
)

func init() {
	toxics.Register(holdType, new(holdToxic))
	toxics.Register(pgType, new(pgToxic))
}

// sessions maps a session id (a toxic's "session" attribute) to the state
// that the Proxy and its toxics share: toxiproxy builds each toxic from
// its JSON attributes, so a toxic finds its Proxy through this map.
var sessions sync.Map // string → *session

func lookup(id string) *session {
	if s, ok := sessions.Load(id); ok {
		return s.(*session)
	}
	return nil
}

// Direction names one direction of a proxied connection.
type Direction string

const (
	// Upstream is client → server.
	Upstream Direction = "upstream"
	// Downstream is server → client.
	Downstream Direction = "downstream"
)

// Proxy is a toxiproxy proxy listening on a free port of 127.0.0.1.
type Proxy struct {
	// Addr is the proxy's host:port, to give the client instead of the
	// upstream's.
	Addr string

	px *toxiproxy.Proxy
	s  *session

	mu       sync.Mutex // guards toxicSeq
	toxicSeq int
}

// Option configures New.
type Option func(*session)

// WithCommitCut makes the proxy read the PostgreSQL protocol in both
// directions and, in a marked transaction, cut the connection once the
// server has answered its COMMIT, dropping that answer: the client sees
// the connection end, the transaction is committed. A transaction is
// marked when it executes a statement whose text contains marker (sent
// with the extended protocol, Parse then Bind, as pgx does, or as a
// simple query). The marked statement's parameters at the indexes in
// record (0-based, text as sent) are kept with each cut, to name what was
// cut. Which marked commits are cut is drawn at random with the fraction
// set by SetCutFraction (0 until then).
//
// A simple query may hold several statements: the marked one and the
// COMMIT, say, sent together. Its parameters are in its text, written
// there by the client; WithQueryParams says how to read the ones to keep.
func WithCommitCut(marker string, record ...int) Option {
	return func(s *session) {
		s.marker = marker
		s.record = record
	}
}

// WithQueryParams sets how the commit cut reads, from the text of a
// marked simple query, the parameters it keeps with each cut (record's
// indexes apply to the extended protocol's).
func WithQueryParams(extract func(sql string) []string) Option {
	return func(s *session) { s.queryParams = extract }
}

// New starts a proxy to upstream (host:port) and stops it, closing every
// connection, when t ends.
func New(t testing.TB, name, upstream string, opts ...Option) *Proxy {
	t.Helper()
	var b [6]byte
	rand.Read(b[:])
	s := &session{id: name + "-" + hex.EncodeToString(b[:]), rnd: mrand.New(mrand.NewPCG(mrand.Uint64(), mrand.Uint64()))}
	for _, o := range opts {
		o(s)
	}
	sessions.Store(s.id, s)

	server := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	px := toxiproxy.NewProxy(server, name, "127.0.0.1:0", upstream)
	p := &Proxy{px: px, s: s}
	// The toxics that keep state per connection are in the chain before
	// the first connection: toxiproxy then creates their states, for each
	// connection, upstream link first, in its one accepting goroutine,
	// which is how the two halves of a connection find each other (see
	// pgToxic.NewState).
	for _, dir := range []Direction{Upstream, Downstream} {
		if err := p.addToxic(holdType, dir, map[string]any{"session": s.id}); err != nil {
			t.Fatal(err)
		}
	}
	if s.marker != "" {
		if err := p.addToxic(pgType, Upstream, map[string]any{"session": s.id, "side": "client"}); err != nil {
			t.Fatal(err)
		}
		if err := p.addToxic(pgType, Downstream, map[string]any{"session": s.id, "side": "server"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := px.Start(); err != nil {
		sessions.Delete(s.id)
		t.Fatalf("faultproxy %s: %v", name, err)
	}
	p.Addr = px.Listen
	t.Cleanup(func() {
		s.heal() // let held chunks go, so that the links can end
		px.Stop()
		sessions.Delete(s.id)
	})
	return p
}

func (p *Proxy) addToxic(typ string, dir Direction, attrs map[string]any) error {
	p.mu.Lock()
	p.toxicSeq++
	name := fmt.Sprintf("%s_%s_%d", typ, dir, p.toxicSeq)
	p.mu.Unlock()
	b, err := json.Marshal(map[string]any{"name": name, "type": typ, "stream": string(dir), "toxicity": 1.0, "attributes": attrs})
	if err != nil {
		return err
	}
	if _, err := p.px.Toxics.AddToxicJson(strings.NewReader(string(b))); err != nil {
		return fmt.Errorf("faultproxy: adding toxic %s: %w", name, err)
	}
	return nil
}

// URL returns u with its host:port replaced by the proxy's.
func (p *Proxy) URL(u string) string {
	pu, err := url.Parse(u)
	if err != nil {
		panic(fmt.Sprintf("faultproxy: %q: %v", u, err))
	}
	pu.Host = p.Addr
	return pu.String()
}

// PostgresURL returns the PostgreSQL URL u pointed at the proxy, with TLS
// off so that the proxy can read the protocol.
func (p *Proxy) PostgresURL(u string) string {
	pu, err := url.Parse(p.URL(u))
	if err != nil {
		panic(err)
	}
	q := pu.Query()
	q.Set("sslmode", "disable")
	pu.RawQuery = q.Encode()
	return pu.String()
}

// Latency delays every chunk in direction dir by latency ± jitter
// (toxiproxy's latency toxic) until the returned function removes it.
func (p *Proxy) Latency(dir Direction, latency, jitter time.Duration) (remove func(), err error) {
	p.mu.Lock()
	p.toxicSeq++
	name := fmt.Sprintf("latency_%s_%d", dir, p.toxicSeq)
	p.mu.Unlock()
	b, _ := json.Marshal(map[string]any{"name": name, "type": "latency", "stream": string(dir), "toxicity": 1.0,
		"attributes": map[string]any{"latency": latency.Milliseconds(), "jitter": jitter.Milliseconds()}})
	if _, err := p.px.Toxics.AddToxicJson(strings.NewReader(string(b))); err != nil {
		return nil, fmt.Errorf("faultproxy: adding latency: %w", err)
	}
	var once sync.Once
	return func() { once.Do(func() { _ = p.px.Toxics.RemoveToxic(context.Background(), name) }) }, nil // gone with the proxy too
}

// Partition holds every chunk in both directions, of the connections
// open now and of new ones, until Heal. Connections stay open; the
// proxy keeps accepting.
func (p *Proxy) Partition() { p.s.partition() }

// Heal ends a partition: the held chunks go on in order.
func (p *Proxy) Heal() { p.s.heal() }

// Held is the number of chunks that a partition held so far.
func (p *Proxy) Held() int64 { return p.s.held.Load() }

// PartitionPoint is a point in a marked transaction (see WithCommitCut)
// where PartitionAt begins a partition.
type PartitionPoint string

const (
	// BeforeMarked: the client sends the marked statement; it is held.
	BeforeMarked PartitionPoint = "before marked statement"
	// BeforeCommit: the marked statement was executed and the client
	// sends the transaction's COMMIT; the COMMIT is held.
	BeforeCommit PartitionPoint = "before commit"
)

// PartitionAt arms a partition (see Partition) that begins when a client
// of a WithCommitCut proxy reaches point, before the message that reaches
// it goes to the server; it lasts until Heal. It fires once. Triggered
// reports whether it began.
func (p *Proxy) PartitionAt(point PartitionPoint) {
	p.s.mu.Lock()
	p.s.partitionAt = point
	p.s.mu.Unlock()
}

// Triggered reports how many partitions armed by PartitionAt began.
func (p *Proxy) Triggered() int64 { return p.s.triggered.Load() }

// SetCutFraction sets the share of marked commits that are cut (0 to 1).
func (p *Proxy) SetCutFraction(f float64) {
	p.s.rndMu.Lock()
	p.s.fraction = f
	p.s.rndMu.Unlock()
}

// CommitStats counts what a WithCommitCut proxy saw and did.
type CommitStats struct {
	Connections   int64 // connections whose protocol was read
	Opaque        int64 // connections passed through unread (TLS, another protocol)
	Cancels       int64 // CancelRequests (each on a connection of its own, passed through)
	Marked        int64 // marked transactions whose COMMIT the client sent
	Armed         int64 // of those, chosen to be cut
	Cut           int64 // connections cut at the start of a chosen COMMIT's answer
	CutCommitted  int64 // of those, the answer dropped was CommandComplete "COMMIT"
	PairingErrors int64 // a server half without its client half, or answers the client did not ask for
}

// Cut is one connection cut at a COMMIT's answer.
type Cut struct {
	Params  []string // the marked statement's recorded parameters
	Outcome string   // the dropped answer: "COMMIT", "ROLLBACK", "error: <SQLSTATE>", or "unseen"
}

// CommitStats returns the counters of a WithCommitCut proxy.
func (p *Proxy) CommitStats() CommitStats {
	s := p.s
	return CommitStats{
		Connections: s.conns.Load(), Opaque: s.opaque.Load(), Cancels: s.cancels.Load(), Marked: s.marked.Load(), Armed: s.armed.Load(),
		Cut: s.cut.Load(), CutCommitted: s.cutCommitted.Load(), PairingErrors: s.pairingErrors.Load(),
	}
}

// Cuts returns the cuts whose dropped answer was read (or whose
// connection ended before it could be), in order.
func (p *Proxy) Cuts() []Cut {
	p.s.mu.Lock()
	defer p.s.mu.Unlock()
	return append([]Cut(nil), p.s.cuts...)
}

// session is the state a Proxy shares with its toxics.
type session struct {
	id string

	mu            sync.Mutex // guards healCh, pending, cuts, partitionAt
	partitionAt   PartitionPoint
	triggered     atomic.Int64
	healCh        chan struct{} // non-nil during a partition; closed by heal
	pending       []*pgPair     // client halves waiting for their server half
	cuts          []Cut
	held          atomic.Int64
	marker        string
	record        []int
	queryParams   func(sql string) []string // WithQueryParams
	rndMu         sync.Mutex                // guards rnd, fraction
	rnd           *mrand.Rand
	fraction      float64
	conns         atomic.Int64
	opaque        atomic.Int64
	cancels       atomic.Int64
	marked        atomic.Int64
	armed         atomic.Int64
	cut           atomic.Int64
	cutCommitted  atomic.Int64
	pairingErrors atomic.Int64
}

func (s *session) partition() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.healCh == nil {
		s.healCh = make(chan struct{})
	}
}

func (s *session) heal() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.healCh != nil {
		close(s.healCh)
		s.healCh = nil
	}
}

// trigger begins the partition armed at point, if any.
func (s *session) trigger(point PartitionPoint) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.partitionAt != point {
		return false
	}
	s.partitionAt = ""
	if s.healCh == nil {
		s.healCh = make(chan struct{})
	}
	s.triggered.Add(1)
	return true
}

// partitioned returns the channel closed at the next heal, or nil when
// there is no partition.
func (s *session) partitioned() chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.healCh
}

func (s *session) draw() bool {
	s.rndMu.Lock()
	defer s.rndMu.Unlock()
	return s.fraction > 0 && s.rnd.Float64() < s.fraction
}

// holdToxic holds chunks during a partition.
type holdToxic struct {
	Session string `json:"session"`
}

type holdState struct {
	pending *stream.StreamChunk // read, not yet written: kept across interrupts
	counted bool
}

func (t *holdToxic) NewState() interface{} { return new(holdState) }

func (t *holdToxic) Pipe(stub *toxics.ToxicStub) {
	s := lookup(t.Session)
	st, ok := stub.State.(*holdState)
	if !ok || s == nil {
		passThrough(stub)
		return
	}
	for {
		if st.pending == nil {
			select {
			case <-stub.Interrupt:
				return
			case c := <-stub.Input:
				if c == nil {
					stub.Close()
					return
				}
				st.pending, st.counted = c, false
			}
		}
		if healed := s.partitioned(); healed != nil {
			if !st.counted {
				st.counted = true
				s.held.Add(1)
			}
			select {
			case <-healed:
			case <-stub.Interrupt:
				return
			}
			continue // another partition may have begun
		}
		select {
		case stub.Output <- st.pending:
			st.pending = nil
		case <-stub.Interrupt:
			return
		}
	}
}

func passThrough(stub *toxics.ToxicStub) {
	for {
		select {
		case <-stub.Interrupt:
			return
		case c := <-stub.Input:
			if c == nil {
				stub.Close()
				return
			}
			stub.Output <- c
		}
	}
}

const (
	stmtOther    stmtKind = iota
	stmtMarked            // it contains the marker
	stmtCommit            // COMMIT
	stmtRollback          // ROLLBACK
)
