package client_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/memstore"
)

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

// ExampleTransport retries with the same key: its first attempt finds the
// key in flight (409, Retry-After), and its retry gets the first
// attempt's answer, replayed.
func ExampleTransport() {
	release := make(chan struct{})
	started := make(chan struct{})
	runs := 0
	api := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
