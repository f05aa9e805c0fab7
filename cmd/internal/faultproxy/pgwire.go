package faultproxy

import (
	"encoding/binary"
	"strings"
	"sync"

	"github.com/Shopify/toxiproxy/v2/stream"
	"github.com/Shopify/toxiproxy/v2/toxics"
)

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
