package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/memstore"
)

// lossyNetwork carries requests to the server, but loses the answer to
// the first one: the server did the work, the client sees an error.
type lossyNetwork struct {
	keys []string // the Idempotency-Key of every attempt
}

func (n *lossyNetwork) RoundTrip(req *http.Request) (*http.Response, error) {
	n.keys = append(n.keys, req.Header.Get("Idempotency-Key"))
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err == nil && len(n.keys) == 1 {
		resp.Body.Close()
		return nil, errors.New("connection reset by peer")
	}
	return resp, err
}

// ExampleTransport gives a POST an Idempotency-Key and retries it when its
// answer is lost on the way back: the retry carries the same key, so the
// server replays the order it made instead of making a second one.
func ExampleTransport() {
	var orders atomic.Int64
	api := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", orders.Add(1))
	}))
	srv := httptest.NewServer(api)
	defer srv.Close()

	network := &lossyNetwork{}
	hc := &http.Client{Transport: &client.Transport{Base: network}} // Base: http.DefaultTransport by default
	resp, err := hc.Post(srv.URL+"/v1/orders", "application/json", strings.NewReader(`{"item":"book"}`))
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Printf("answer: %d %s replayed=%q\n", resp.StatusCode, body, resp.Header.Get("Idempotent-Replayed"))
	fmt.Println("attempts:", len(network.keys), "same key:", network.keys[0] == network.keys[1])
	fmt.Println("orders made:", orders.Load())
	// Output:
	// answer: 201 order 1 replayed="true"
	// attempts: 2 same key: true
	// orders made: 1
}

// statusLog is a RoundTripper that notes the status of every attempt.
type statusLog struct {
	base     http.RoundTripper
	statuses []int
}

func (s *statusLog) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := s.base.RoundTrip(req)
	if err == nil {
		s.statuses = append(s.statuses, resp.StatusCode)
	}
	return resp, err
}

// ExampleTransport_inFlight retries with the key the caller chose
// (WithKey): its first attempt finds the key in flight (409, Retry-After),
// and its retry gets the first attempt's answer, replayed.
func ExampleTransport_inFlight() {
	release := make(chan struct{})
	started := make(chan struct{})
	runs := 0
	api := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		close(started)
		<-release // a slow first attempt
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "order 1")
	}))
	srv := httptest.NewServer(api)
	defer srv.Close()

	// Another copy of the request is running when our client sends.
	first := make(chan int)
	go func() {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	<-started

	attempts := &statusLog{base: http.DefaultTransport}
	hc := &http.Client{Transport: &client.Transport{
		Base:          attempts,
		MaxRetryAfter: 10 * time.Millisecond, // the server asks for 1s; keep the example quick
		OnRetry: func(attempt int, resp *http.Response, err error, pause time.Duration) {
			// Here the running copy finishes while our client waits.
			close(release)
			fmt.Println("first copy:", <-first)
		},
	}}
	ctx := client.WithKey(context.Background(), "order-1")
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/orders", strings.NewReader(`{"item":"book"}`))
	resp, err := hc.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println("attempts saw:", attempts.statuses)
	fmt.Printf("answer: %d %s replayed=%q\n", resp.StatusCode, body, resp.Header.Get("Idempotent-Replayed"))
	fmt.Println("handler runs:", runs)
	// Output:
	// first copy: 201
	// attempts saw: [409 201]
	// answer: 201 order 1 replayed="true"
	// handler runs: 1
}
