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
	"encoding/binary"
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

// pgToxic reads one direction of a PostgreSQL connection: side "client"
// the client's messages, side "server" the server's answers. The two
// halves of one connection share a pgPair.
type pgToxic struct {
	Session string `json:"session"`
	Side    string `json:"side"`
}

// pgPair is what the two halves of one connection share.
type pgPair struct {
	mu     sync.Mutex
	opaque bool
	syncs  int      // sync points the client sent (simple queries and Syncs)
	target int      // the sync point whose answer is to be cut, when armed
	armed  bool     // a chosen COMMIT was sent and its answer not yet seen
	params []string // the marked statement's recorded parameters
}

// NewState pairs the halves: toxiproxy starts a connection's upstream
// link, then its downstream link, one connection after the other, in
// the proxy's accepting goroutine, creating the states as it starts each.
func (t *pgToxic) NewState() interface{} {
	s := lookup(t.Session)
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if t.Side == "client" {
		p := new(pgPair)
		s.pending = append(s.pending, p)
		return &pgClient{s: s, pair: p, stmts: map[string]stmtKind{}}
	}
	if len(s.pending) == 0 {
		s.pairingErrors.Add(1)
		return nil
	}
	p := s.pending[0]
	s.pending = s.pending[1:]
	return &pgServer{s: s, pair: p}
}

func (t *pgToxic) Pipe(stub *toxics.ToxicStub) {
	switch st := stub.State.(type) {
	case *pgClient:
		st.pipe(stub)
	case *pgServer:
		st.pipe(stub)
	default:
		passThrough(stub)
	}
}

// maxMessage bounds a message's length: past it the stream is not read
// as PostgreSQL's.
const maxMessage = 1 << 30

// pgClient reads the client's messages.
type pgClient struct {
	s       *session
	pair    *pgPair
	buf     []byte // an incomplete message
	started bool   // the startup message was read
	opaque  bool
	stmts   map[string]stmtKind // prepared statement name → what it is
	inTx    bool                // a marked statement ran since the last COMMIT or ROLLBACK
	params  []string
	pending *stream.StreamChunk // held since an armed partition began in it
}

func (c *pgClient) pipe(stub *toxics.ToxicStub) {
	for {
		if c.pending != nil { // held by a partition that began at its first message
			if healed := c.s.partitioned(); healed != nil {
				select {
				case <-healed:
				case <-stub.Interrupt:
					return
				}
				continue
			}
			select {
			case stub.Output <- c.pending:
				c.pending = nil
			case <-stub.Interrupt:
				return
			}
			continue
		}
		select {
		case <-stub.Interrupt:
			return
		case ch := <-stub.Input:
			if ch == nil {
				stub.Close()
				return
			}
			// Read before the bytes go on: the server answers only what
			// it received.
			at := c.feed(ch.Data)
			if at < 0 {
				stub.Output <- ch
				continue
			}
			if at > 0 {
				stub.Output <- &stream.StreamChunk{Data: ch.Data[:at], Timestamp: ch.Timestamp}
			}
			c.s.held.Add(1)
			c.pending = &stream.StreamChunk{Data: ch.Data[at:], Timestamp: ch.Timestamp}
		}
	}
}

func (c *pgClient) setOpaque() {
	c.opaque, c.buf = true, nil
	c.pair.mu.Lock()
	c.pair.opaque = true
	c.pair.mu.Unlock()
}

// feed reads b. When a message in it began an armed partition
// (PartitionAt), it returns the offset in b from which to hold the
// bytes, else -1.
func (c *pgClient) feed(b []byte) (holdAt int) {
	holdAt = -1
	if c.opaque {
		return
	}
	lead := len(c.buf)
	c.buf = append(c.buf, b...)
	consumed := 0
	for {
		if !c.started {
			if len(c.buf) < 8 {
				break
			}
			n := int(binary.BigEndian.Uint32(c.buf))
			if n < 8 || n > maxMessage {
				c.s.opaque.Add(1)
				c.setOpaque()
				return
			}
			if len(c.buf) < n {
				break
			}
			switch code := binary.BigEndian.Uint32(c.buf[4:8]); code {
			case 3 << 16: // StartupMessage, protocol 3.0
			case 80877102: // CancelRequest, on a connection of its own
				c.s.cancels.Add(1)
				c.setOpaque()
				return
			default: // SSLRequest, GSSENCRequest, another protocol
				c.s.opaque.Add(1)
				c.setOpaque()
				return
			}
			c.buf = c.buf[n:]
			consumed += n
			c.started = true
			c.s.conns.Add(1)
			continue
		}
		if len(c.buf) < 5 {
			break
		}
		n := int(binary.BigEndian.Uint32(c.buf[1:5]))
		if n < 4 || n > maxMessage {
			c.s.opaque.Add(1)
			c.setOpaque()
			return
		}
		if len(c.buf) < 1+n {
			break
		}
		if c.message(c.buf[0], c.buf[5:1+n]) && holdAt < 0 {
			// A message that began in an earlier chunk was not whole
			// there, so the server could not act on it: hold from the
			// start of this chunk.
			holdAt = max(consumed-lead, 0)
		}
		c.buf = c.buf[1+n:]
		consumed += 1 + n
	}
	c.buf = append([]byte(nil), c.buf...)
	return holdAt
}

// cstring splits a NUL-terminated string off b.
func cstring(b []byte) (string, []byte) {
	for i, x := range b {
		if x == 0 {
			return string(b[:i]), b[i+1:]
		}
	}
	return string(b), nil
}

// stmtKind is what a prepared statement is, for the commit cut.
type stmtKind uint8

const (
	stmtOther    stmtKind = iota
	stmtMarked            // it contains the marker
	stmtCommit            // COMMIT
	stmtRollback          // ROLLBACK
)

// kindOf says what the statement sql is.
func (c *pgClient) kindOf(sql string) stmtKind {
	if c.s.marker != "" && strings.Contains(sql, c.s.marker) {
		return stmtMarked
	}
	switch strings.ToLower(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(sql), ";"))) {
	case "commit", "end", "commit transaction", "commit work":
		return stmtCommit
	case "rollback", "abort", "rollback transaction", "rollback work":
		return stmtRollback
	}
	return stmtOther
}

// message reads one message of the client; it reports whether the
// message begins an armed partition. A COMMIT is seen in a simple query,
// or as the Bind of a statement prepared from COMMIT (sent in a pipeline
// after other statements, the answer to cut is the one of the Sync that
// follows it).
func (c *pgClient) message(typ byte, body []byte) (hold bool) {
	switch typ {
	case 'Q': // simple query
		sql, _ := cstring(body)
		c.pair.mu.Lock()
		index := c.pair.syncs
		c.pair.syncs++
		c.pair.mu.Unlock()
		// Its statements in order; a semicolon in a string literal only
		// makes an extra piece that is neither marked nor a COMMIT.
		for _, part := range strings.Split(sql, ";") {
			switch c.kindOf(part) {
			case stmtMarked:
				c.inTx, c.params = true, nil
				if c.s.queryParams != nil {
					c.params = c.s.queryParams(sql)
				}
				hold = c.s.trigger(BeforeMarked) || hold
			case stmtCommit:
				hold = c.commit(index) || hold
			case stmtRollback:
				c.inTx, c.params = false, nil
			}
		}
	case 'S': // Sync
		c.pair.mu.Lock()
		c.pair.syncs++
		c.pair.mu.Unlock()
	case 'P': // Parse: name, query, …
		name, rest := cstring(body)
		sql, _ := cstring(rest)
		c.stmts[name] = c.kindOf(sql)
	case 'B': // Bind: portal, statement, format codes, parameters, …
		_, rest := cstring(body)
		stmt, rest := cstring(rest)
		switch c.stmts[stmt] {
		case stmtMarked:
			c.inTx = true
			c.params = c.recordParams(rest)
			hold = c.s.trigger(BeforeMarked)
		case stmtCommit:
			c.pair.mu.Lock()
			index := c.pair.syncs // the Sync that ends this pipeline
			c.pair.mu.Unlock()
			hold = c.commit(index)
		case stmtRollback:
			c.inTx, c.params = false, nil
		}
	}
	return hold
}

// commit handles the COMMIT whose answer is the one of sync point index:
// when a marked statement ran since the last COMMIT or ROLLBACK, it is
// held (a partition before commit) or, drawn, armed to be cut.
func (c *pgClient) commit(index int) (hold bool) {
	if c.inTx {
		c.s.marked.Add(1)
		if hold = c.s.trigger(BeforeCommit); !hold && c.s.draw() {
			c.s.armed.Add(1)
			c.pair.mu.Lock()
			c.pair.armed, c.pair.target, c.pair.params = true, index, c.params
			c.pair.mu.Unlock()
		}
	}
	c.inTx, c.params = false, nil
	return hold
}

// recordParams reads the parameters of a Bind message (after its two
// names) and keeps the recorded ones.
func (c *pgClient) recordParams(b []byte) []string {
	if len(c.s.record) == 0 || len(b) < 2 {
		return nil
	}
	nf := int(binary.BigEndian.Uint16(b))
	b = b[2:]
	if len(b) < 2*nf+2 {
		return nil
	}
	b = b[2*nf:]
	np := int(binary.BigEndian.Uint16(b))
	b = b[2:]
	var vals []string
	for i := 0; i < np; i++ {
		if len(b) < 4 {
			return nil
		}
		n := int(int32(binary.BigEndian.Uint32(b)))
		b = b[4:]
		v := "<NULL>"
		if n >= 0 {
			if len(b) < n {
				return nil
			}
			v, b = string(b[:n]), b[n:]
		}
		vals = append(vals, v)
	}
	var out []string
	for _, i := range c.s.record {
		if i < len(vals) {
			out = append(out, vals[i])
		}
	}
	return out
}

// pgServer reads the server's answers.
type pgServer struct {
	s       *session
	pair    *pgPair
	buf     []byte
	readys  int  // ReadyForQuery messages: the first ends the startup, each later one a sync point's answer
	checked bool // the message that starts at the head of buf was checked for a cut
	opaque  bool
}

func (sv *pgServer) pipe(stub *toxics.ToxicStub) {
	for {
		select {
		case <-stub.Interrupt:
			return
		case ch := <-stub.Input:
			if ch == nil {
				stub.Close()
				return
			}
			cut, off, rest := sv.feed(ch.Data)
			if !cut {
				stub.Output <- ch
				continue
			}
			// The answer to the chosen COMMIT begins at off: the server
			// has executed the COMMIT. Let the bytes before it through,
			// then end the connection without that answer.
			if off > 0 {
				stub.Output <- &stream.StreamChunk{Data: ch.Data[:off], Timestamp: ch.Timestamp}
			}
			stub.Close()
			sv.s.cut.Add(1)
			sv.pair.mu.Lock()
			params := sv.pair.params
			sv.pair.mu.Unlock()
			outcome, done := classify(rest)
			for !done {
				ch := <-stub.Input
				if ch == nil {
					outcome = "unseen"
					break
				}
				rest = append(rest, ch.Data...)
				outcome, done = classify(rest)
			}
			if outcome == "COMMIT" {
				sv.s.cutCommitted.Add(1)
			}
			sv.s.mu.Lock()
			sv.s.cuts = append(sv.s.cuts, Cut{Params: params, Outcome: outcome})
			sv.s.mu.Unlock()
			for range stub.Input { // until the link's reader ends
			}
			return
		}
	}
}

// feed reads b; when a chosen COMMIT's answer begins in it, it returns
// cut, the offset in b where the answer begins and the bytes from there.
func (sv *pgServer) feed(b []byte) (cut bool, off int, rest []byte) {
	sv.pair.mu.Lock()
	opaque := sv.pair.opaque
	sv.pair.mu.Unlock()
	if sv.opaque || opaque {
		return false, 0, nil
	}
	lead := len(sv.buf)
	data := append(sv.buf, b...)
	p := 0
	for p < len(data) {
		if !sv.checked {
			sv.checked = true
			if sv.readys >= 1 {
				sv.pair.mu.Lock()
				hit := sv.pair.armed && sv.pair.target == sv.readys-1
				if hit {
					sv.pair.armed = false
				}
				sv.pair.mu.Unlock()
				if hit {
					return true, max(p-lead, 0), append([]byte(nil), data[p:]...)
				}
			}
		}
		if len(data)-p < 5 {
			break
		}
		n := int(binary.BigEndian.Uint32(data[p+1:]))
		if n < 4 || n > maxMessage {
			sv.opaque, sv.buf = true, nil
			return false, 0, nil
		}
		if len(data)-p < 1+n {
			break
		}
		if data[p] == 'Z' {
			sv.readys++
			if sv.readys > 1 {
				sv.pair.mu.Lock()
				if sv.readys-1 > sv.pair.syncs {
					sv.s.pairingErrors.Add(1)
				}
				sv.pair.mu.Unlock()
			}
		}
		p += 1 + n
		sv.checked = false
	}
	sv.buf = append([]byte(nil), data[p:]...)
	return false, 0, nil
}

// classify reads the answer to a sync point that ends with a COMMIT: the
// last CommandComplete tag before its ReadyForQuery (the COMMIT's, after
// the answers of the statements sent before it in the same pipeline), or
// the SQLSTATE of the error that ended it. done is false while b is
// incomplete.
func classify(b []byte) (outcome string, done bool) {
	for len(b) >= 5 {
		n := int(binary.BigEndian.Uint32(b[1:]))
		if n < 4 {
			return "unreadable", true
		}
		if len(b) < 1+n {
			return "", false
		}
		body := b[5 : 1+n]
		switch b[0] {
		case 'C':
			outcome, _ = cstring(body)
		case 'E':
			outcome = "error"
			for len(body) > 0 && body[0] != 0 {
				field := body[0]
				var v string
				v, body = cstring(body[1:])
				if field == 'C' {
					outcome = "error: " + v
					break
				}
			}
		case 'Z':
			if outcome == "" {
				outcome = "no tag"
			}
			return outcome, true
		}
		b = b[1+n:]
	}
	return "", false
}
