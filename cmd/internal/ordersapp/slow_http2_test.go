package ordersapp

import (
	"bytes"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// The API's address speaks unencrypted HTTP/2 to a client that opens
// with its preface (gRPC clients without TLS do). These helpers are such a
// client, frame by frame, for TestSlowClients: the bounds that cut a slow
// HTTP/1.1 client must cut a slow HTTP/2 one too.

// h2Result is what one HTTP/2 exchange saw.
type h2Result struct {
	// status is the answer's :status, 0 when none came.
	status int
	// body is the answer's body, as far as it came.
	body string
	// sent and total count the request body's bytes: sent before the
	// server ended the exchange, out of all there were.
	sent, total int
	// cut reports whether the server ended the stream or the connection
	// (an answer, RST_STREAM, GOAWAY, a close) before the body was all
	// sent.
	cut bool
	// maxStreams is the server's SETTINGS_MAX_CONCURRENT_STREAMS, 0 when
	// it sent none (no bound).
	maxStreams uint32
	err        error
}

// h2Post sends POST path on stream 1 of a new unencrypted HTTP/2
// connection to addr: the headers, then body in parts with pause between
// them, stopping after stopAfter parts (the stream left open) when
// stopAfter >= 0. It reads the answer for at most 90 s.
func h2Post(addr, path string, headers [][2]string, parts []string, pause time.Duration, stopAfter int) (r h2Result) {
	for _, p := range parts {
		r.total += len(p)
	}
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		r.err = err
		return r
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(90 * time.Second)); err != nil {
		r.err = err
		return r
	}
	if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
		r.err = err
		return r
	}
	fr := http2.NewFramer(conn, conn)
	var wmu sync.Mutex // the reader acks the server's SETTINGS while the writer sends
	write := func(f func() error) error {
		wmu.Lock()
		defer wmu.Unlock()
		return f()
	}
	if err := fr.WriteSettings(); err != nil {
		r.err = err
		return r
	}

	// The reader: until the stream or the connection ends.
	type ending struct {
		status     int
		body       string
		maxStreams uint32
		err        error
	}
	ended := make(chan ending, 1)
	go func() {
		var e ending
		var body bytes.Buffer
		dec := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
			if f.Name == ":status" {
				e.status, _ = strconv.Atoi(f.Value)
			}
		})
		defer func() { e.body = body.String(); ended <- e }()
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				if !errors.Is(err, io.EOF) {
					e.err = err
				}
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if f.IsAck() {
					continue
				}
				if v, ok := f.Value(http2.SettingMaxConcurrentStreams); ok {
					e.maxStreams = v
				}
				if err := write(fr.WriteSettingsAck); err != nil {
					e.err = err
					return
				}
			case *http2.HeadersFrame:
				if f.StreamID != 1 {
					continue
				}
				if _, err := dec.Write(f.HeaderBlockFragment()); err != nil {
					e.err = err
					return
				}
				if f.StreamEnded() {
					return
				}
			case *http2.DataFrame:
				if f.StreamID != 1 {
					continue
				}
				body.Write(f.Data())
				if f.StreamEnded() {
					return
				}
			case *http2.RSTStreamFrame:
				if f.StreamID == 1 {
					return
				}
			case *http2.GoAwayFrame:
				return
			}
		}
	}()
	finish := func(cut bool) h2Result {
		e := <-ended
		r.status, r.body, r.maxStreams, r.cut = e.status, e.body, e.maxStreams, cut
		if r.err == nil {
			r.err = e.err
		}
		return r
	}

	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	fields := append([][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", addr}, {":path", path},
		{"content-length", strconv.Itoa(r.total)}}, headers...)
	for _, kv := range fields {
		if err := enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]}); err != nil {
			r.err = err
			return finish(false)
		}
	}
	if err := write(func() error {
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndHeaders: true, EndStream: r.total == 0})
	}); err != nil {
		return finish(true)
	}
	for i, p := range parts {
		if stopAfter >= 0 && i >= stopAfter {
			return finish(true) // the rest is never sent
		}
		if i > 0 {
			select {
			case e := <-ended:
				ended <- e
				return finish(true)
			case <-time.After(pause):
			}
		}
		if err := write(func() error { return fr.WriteData(1, i == len(parts)-1, []byte(p)) }); err != nil {
			return finish(true)
		}
		r.sent += len(p)
	}
	return finish(false)
}

// h2PartialPreface sends the first line of the HTTP/2 preface and nothing
// more, and reports whether the server closed the connection within 60 s.
func h2PartialPreface(addr string) (closed bool, err error) {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		return false, err
	}
	defer conn.Close()
	if err := conn.SetReadDeadline(time.Now().Add(60 * time.Second)); err != nil {
		return false, err
	}
	if _, err := io.WriteString(conn, http2.ClientPreface[:len("PRI * HTTP/2.0\r\n")]); err != nil {
		return false, err
	}
	// The read ends with EOF or a reset when the server closes, with a
	// timeout when it does not.
	_, err = io.Copy(io.Discard, conn)
	var ne net.Error
	return !errors.As(err, &ne) || !ne.Timeout(), nil
}
