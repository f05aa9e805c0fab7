package ordersapp

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem/client"
)

// retryCounts is what a counting retrying client saw on the way to its
// final answers: attempts sent, retries after a 409, after a 5xx, and
// after a failure in transit.
type retryCounts struct {
	sent, retried409, retried5xx, transit atomic.Int64
}

// String reads the counts for a test's log line.
func (c *retryCounts) String() string {
	return fmt.Sprintf("%d attempts sent (%d retries of 409, %d of 5xx, %d after a failure in transit)",
		c.sent.Load(), c.retried409.Load(), c.retried5xx.Load(), c.transit.Load())
}

// countingRetryClient is the retrying client of the storms: it retries
// every key until retryFor has passed (the deadline bounds the retries,
// not their count), backing off from 20 ms to 500 ms, over a transport
// that keeps maxIdle connections, and counts what it sees.
func countingRetryClient(t *testing.T, maxIdle int, retryFor time.Duration) (*http.Client, *retryCounts) {
	c := &retryCounts{}
	tr := &http.Transport{MaxIdleConnsPerHost: maxIdle}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: &client.Transport{
		Base:           &countingRoundTripper{n: &c.sent, base: tr},
		MaxAttempts:    1000,
		InitialBackoff: 20 * time.Millisecond,
		MaxBackoff:     500 * time.Millisecond,
		MaxElapsed:     retryFor,
		OnRetry: func(_ int, resp *http.Response, err error, _ time.Duration) {
			switch {
			case err != nil:
				c.transit.Add(1)
			case resp.StatusCode == http.StatusConflict:
				c.retried409.Add(1)
			case resp.StatusCode >= 500:
				c.retried5xx.Add(1)
			}
		},
	}}, c
}
