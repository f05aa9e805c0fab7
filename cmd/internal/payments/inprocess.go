package payments

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// InProcessURL is a base URL for a Client whose HTTPClient is InProcess:
// any URL serves, as no request leaves the process.
const InProcessURL = "http://payments.in-process"

// ErrConnectionDropped is the transport error of an in-process request
// whose handler ended it without an answer (http.ErrAbortHandler), as a
// server closing the connection would.
var ErrConnectionDropped = errors.New("payments: in-process gateway dropped the connection without an answer")

// InProcess returns an HTTP client whose requests are served by h in this
// process, with no socket: the request is handed to h and its response
// recorded. Like a network, it answers the caller's context: a request
// whose context ends returns at once while h runs on (its request's
// context is canceled, as when a connection closes, but it carries none of
// the caller's context values), and a handler that panics with
// http.ErrAbortHandler becomes a transport error that stripe-go retries.
func InProcess(h http.Handler) *http.Client {
	return &http.Client{Transport: &inProcessTransport{h: h}}
}

type inProcessTransport struct {
	h http.Handler
}

func (t *inProcessTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	var body []byte
	if req.Body != nil {
		b, err := io.ReadAll(req.Body)
		req.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("payments: reading in-process request body: %w", err)
		}
		body = b
	}
	ctx := req.Context()
	// The handler gets a context of its own, as across a network: it ends
	// when the client's does (a closed connection), but carries none of
	// its values. An order service calls from inside its own idempotent
	// request, whose transaction the gateway must never join.
	sctx, cancel := context.WithCancel(context.Background())
	stop := context.AfterFunc(ctx, cancel)
	sr := req.Clone(sctx)
	sr.Body = http.NoBody
	if len(body) > 0 {
		sr.Body = io.NopCloser(bytes.NewReader(body))
	}
	sr.ContentLength = int64(len(body))
	sr.GetBody = nil
	sr.RequestURI = req.URL.RequestURI()
	sr.RemoteAddr = "127.0.0.1:0"
	sr.Proto, sr.ProtoMajor, sr.ProtoMinor = "HTTP/1.1", 1, 1
	if sr.Host == "" {
		sr.Host = req.URL.Host
	}

	buf := newResponseBuffer()
	done := make(chan any, 1)
	go func() {
		defer func() {
			stop()
			cancel()
			done <- recover()
		}()
		t.h.ServeHTTP(buf, sr)
	}()
	select {
	case p := <-done:
		switch {
		case p == nil:
			return buf.response(req), nil
		case p == http.ErrAbortHandler:
			return nil, ErrConnectionDropped
		default:
			return nil, fmt.Errorf("%w: handler panicked: %v", ErrConnectionDropped, p)
		}
	case <-ctx.Done():
		// The handler runs on, as a server does when its client leaves.
		return nil, ctx.Err()
	}
}
