package ordersapp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	vegeta "github.com/tsenart/vegeta/v12/lib"

	"github.com/idem-go/idem/cmd/internal/benchkit"
)

// benchOne warms up (replay mode) or holds requests in the handler
// (inflight mode) and then loads ep for o.duration.
func benchOne(ctx context.Context, o *benchOptions, ep benchEndpoint, mode benchkit.Mode, tokens map[string]string, label string, stderr io.Writer) (_ *benchRun, err error) {
	w := benchkit.NewWorkload(mode, o.users)
	w.Keys, w.Copies, w.Body, w.Tokens = o.keys, o.copies, ep.body, tokens
	if err := benchWarmup(ctx, w, ep.url, o.concurrency); err != nil {
		return nil, fmt.Errorf("%s: warm-up: %w", ep.name(), err)
	}
	var held *benchHeld
	if reqs := w.Held(); len(reqs) > 0 {
		if ep.tgt == nil {
			return nil, fmt.Errorf("%s: mode %s holds requests in the handler: library target only", ep.name(), mode)
		}
		if held, err = benchHold(ctx, o, ep, w, reqs); err != nil {
			return nil, fmt.Errorf("%s: holding %d requests in the handler: %w", ep.name(), len(reqs), err)
		}
		defer func() {
			if held != nil { // not yet released: an error on the way
				_, _ = held.release() // the error on the way is the one returned
			}
		}()
	}
	atk := vegeta.NewAttacker(
		vegeta.Workers(uint64(o.concurrency)),
		vegeta.MaxWorkers(uint64(o.concurrency)), // a fixed number of clients
		vegeta.Connections(o.concurrency),
		vegeta.KeepAlive(true),
		vegeta.Timeout(30*time.Second),
		vegeta.Redirects(vegeta.NoFollow),
	)
	targeter := vegeta.Targeter(func(t *vegeta.Target) error {
		r := w.Next()
		t.Method, t.URL, t.Body, t.Header = http.MethodPost, ep.url, r.Body, w.Header(r)
		return nil
	})
	run := &benchRun{Store: ep.store, Middleware: ep.middleware, Mode: string(mode), Statuses: map[string]int{}}
	var count atomic.Int64
	stopProgress := func() {}
	start := time.Now()
	if o.progress {
		stopProgress = benchProgress(stderr, label, start, o.duration, &count)
	}
	stopped := context.AfterFunc(ctx, func() { atk.Stop() })
	// A zero ConstantPacer is an unbounded rate: each client sends its
	// next request as soon as it has its answer.
	for res := range atk.Attack(targeter, vegeta.ConstantPacer{}, o.duration, label) {
		run.Requests++
		count.Add(1)
		run.latencies = append(run.latencies, res.Latency)
		if res.Code == 0 {
			run.Statuses["error"]++
			run.codes = append(run.codes, "error")
			if run.FirstError == "" {
				run.FirstError = res.Error
			}
			continue
		}
		code := strconv.Itoa(int(res.Code))
		run.Statuses[code]++
		run.codes = append(run.codes, code)
		if benchkit.Replayed(res.Headers) {
			run.Replayed++
		}
		if res.Code >= 500 && run.FirstError == "" {
			run.FirstError = strings.TrimSpace(string(res.Body))
		}
	}
	el := time.Since(start)
	stopped()
	stopProgress()
	run.Seconds = el.Seconds()
	run.Throughput = float64(run.Requests) / max(el.Seconds(), 1e-9)
	run.ByStatus = benchByStatus(run.latencies, run.codes)
	if held != nil {
		h := held
		held = nil
		if run.Held, err = h.release(); err != nil {
			return nil, fmt.Errorf("%s: the held requests: %w", ep.name(), err)
		}
	}
	return run, nil
}

// benchHeld is the requests of one run held in the library target's
// handler: each sent by a goroutine of its own, which waits for its
// answer.
type benchHeld struct {
	gate     *benchkit.Gate
	wg       sync.WaitGroup
	mu       sync.Mutex
	statuses map[string]int
	first    error
}

// benchHold opens a gate on ep's target, sends reqs and waits until the
// handler holds every one of them. The gate lets them go at the latest
// o.duration + 30s later; release lets them go at once.
func benchHold(ctx context.Context, o *benchOptions, ep benchEndpoint, w *benchkit.Workload, reqs []benchkit.Request) (*benchHeld, error) {
	bound := o.duration + 30*time.Second
	h := &benchHeld{gate: ep.tgt.Hold(bound), statuses: map[string]int{}}
	client := &http.Client{Timeout: bound + 30*time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: len(reqs)}}
	for _, r := range reqs {
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			status, err := benchSendStatus(ctx, client, w, ep.url, r)
			h.mu.Lock()
			defer h.mu.Unlock()
			if err != nil {
				status = "error"
				if h.first == nil {
					h.first = err
				}
			}
			h.statuses[status]++
		}()
	}
	go func() {
		h.wg.Wait()
		client.CloseIdleConnections()
	}()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := h.gate.WaitEntered(wctx, int64(len(reqs))); err != nil {
		_, _ = h.release() // the wait's error is the one returned
		return nil, fmt.Errorf("%d of %d held after 30s: %w", h.gate.Entered(), len(reqs), err)
	}
	return h, nil
}

// release lets the held requests go and waits for their answers and for
// the handler to let go of each (bounded: the client's timeout).
func (h *benchHeld) release() (map[string]int, error) {
	h.gate.Release()
	h.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.gate.WaitEmpty(ctx); err != nil {
		return h.statuses, fmt.Errorf("%d still in the handler: %w", h.gate.Inside(), err)
	}
	return h.statuses, h.first
}

// benchSendStatus sends r and returns the status of its answer.
func benchSendStatus(ctx context.Context, client *http.Client, w *benchkit.Workload, url string, r benchkit.Request) (string, error) {
	req, err := w.HTTP(url, r)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	return strconv.Itoa(resp.StatusCode), nil
}

// benchByStatus returns the latency percentiles of each status.
func benchByStatus(lat []time.Duration, codes []string) map[string]benchLatency {
	by := map[string][]time.Duration{}
	for i, c := range codes {
		by[c] = append(by[c], lat[i])
	}
	out := make(map[string]benchLatency, len(by))
	for c, l := range by {
		slices.Sort(l)
		out[c] = benchLatency{
			Requests: len(l),
			P50:      benchMS(benchPercentile(l, 0.50)),
			P90:      benchMS(benchPercentile(l, 0.90)),
			P99:      benchMS(benchPercentile(l, 0.99)),
			Max:      benchMS(l[len(l)-1]),
		}
	}
	return out
}

// benchWarmup sends w's warm-up requests, concurrency at a time, and
// wants each to succeed.
func benchWarmup(ctx context.Context, w *benchkit.Workload, url string, concurrency int) error {
	reqs := w.Warmup()
	if len(reqs) == 0 {
		return nil
	}
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: concurrency}}
	defer client.CloseIdleConnections()
	var next atomic.Int64
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	for range min(concurrency, len(reqs)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(reqs) || ctx.Err() != nil {
					return
				}
				err := benchSend(ctx, client, w, url, reqs[i])
				if err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

func benchSend(ctx context.Context, client *http.Client, w *benchkit.Workload, url string, r benchkit.Request) error {
	req, err := w.HTTP(url, r)
	if err != nil {
		return err
	}
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("key %s: %s: %s", r.Key, resp.Status, strings.TrimSpace(string(b)))
	}
	return nil
}

type benchKey struct {
	store   string
	mw      bool
	mode    string
	prefill int64
}
