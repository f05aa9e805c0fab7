package ordersapp

import (
	"cmp"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/idem-go/idem/cmd/internal/benchkit"
)

// benchProgress rewrites one line on w every 200ms until stopped.
func benchProgress(w io.Writer, label string, start time.Time, d time.Duration, count *atomic.Int64) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				fmt.Fprintf(w, "\r\033[K")
				return
			case <-t.C:
				el := time.Since(start)
				n := count.Load()
				frac := min(el.Seconds()/d.Seconds(), 1)
				const width = 20
				bar := strings.Repeat("#", int(frac*width)) + strings.Repeat(".", width-int(frac*width))
				fmt.Fprintf(w, "\r\033[K%s [%s] %4.1fs/%s %d requests, %.0f req/s", label, bar, el.Seconds(), d, n, float64(n)/max(el.Seconds(), 1e-9))
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

func benchMedian(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// benchPercentile returns the q-quantile (nearest rank) of sorted.
func benchPercentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func benchMS(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// benchSummarize builds the rows (in the order the runs first appear) and
// the ratios.
func benchSummarize(runs []benchRun, o *benchOptions) ([]benchRow, []benchRatio) {
	var keys []benchKey
	by := map[benchKey][]*benchRun{}
	for i := range runs {
		r := &runs[i]
		k := benchKey{r.Store, r.Middleware, r.Mode, r.Prefill}
		if _, ok := by[k]; !ok {
			keys = append(keys, k)
		}
		by[k] = append(by[k], r)
	}
	slices.SortStableFunc(keys, func(x, y benchKey) int {
		if c := slices.Index(benchkit.Stores, x.store) - slices.Index(benchkit.Stores, y.store); c != 0 {
			return c
		}
		if c := slices.Index(benchkit.Modes, benchkit.Mode(x.mode)) - slices.Index(benchkit.Modes, benchkit.Mode(y.mode)); c != 0 {
			return c
		}
		if x.mw != y.mw {
			if !x.mw {
				return -1
			}
			return 1
		}
		return cmp.Compare(x.prefill, y.prefill)
	})
	var rows []benchRow
	for _, k := range keys {
		rs := by[k]
		row := benchRow{Target: rs[0].Target, Store: k.store, Middleware: k.mw, Mode: k.mode, Prefill: k.prefill, Rounds: len(rs), Statuses: map[string]int{}}
		var lat []time.Duration
		var codes []string
		var tput []float64
		for _, r := range rs {
			row.Requests += r.Requests
			row.Replayed += r.Replayed
			for s, n := range r.Statuses {
				row.Statuses[s] += n
			}
			if row.FirstError == "" {
				row.FirstError = r.FirstError
			}
			lat = append(lat, r.latencies...)
			codes = append(codes, r.codes...)
			tput = append(tput, r.Throughput)
		}
		row.ByStatus = benchByStatus(lat, codes)
		slices.Sort(lat)
		row.Throughput = benchMedian(tput)
		row.P50 = benchMS(benchPercentile(lat, 0.50))
		row.P90 = benchMS(benchPercentile(lat, 0.90))
		row.P99 = benchMS(benchPercentile(lat, 0.99))
		if len(lat) > 0 {
			row.Max = benchMS(lat[len(lat)-1])
		}
		rows = append(rows, row)
	}
	// tput returns the throughput of each round of one target and mode.
	tput := func(k benchKey) map[int]float64 {
		m := map[int]float64{}
		for _, r := range by[k] {
			m[r.Round] = r.Throughput
		}
		return m
	}
	ratio := func(name, store, mode string, prefill int64, num, den map[int]float64) (benchRatio, bool) {
		br := benchRatio{Name: name, Store: store, Mode: mode, Prefill: prefill}
		for round := 1; round <= o.rounds; round++ {
			n, ok1 := num[round]
			d, ok2 := den[round]
			if ok1 && ok2 && d > 0 {
				br.Rounds = append(br.Rounds, n/d)
			}
		}
		br.Median = benchMedian(br.Rounds)
		return br, len(br.Rounds) > 0
	}
	var ratios []benchRatio
	add := func(r benchRatio, ok bool) {
		if ok {
			ratios = append(ratios, r)
		}
	}
	for _, s := range o.stores {
		for _, m := range o.modes {
			mode := string(m)
			for _, p := range o.prefills {
				add(ratio("with middleware ÷ without", s, mode, p, tput(benchKey{s, true, mode, p}), tput(benchKey{s, false, mode, 0})))
			}
			if slices.Contains(o.prefills, 0) {
				for _, p := range o.prefills {
					if p > 0 {
						add(ratio(fmt.Sprintf("%d live keys ÷ empty table, with middleware", p), s, mode, p, tput(benchKey{s, true, mode, p}), tput(benchKey{s, true, mode, 0})))
					}
				}
			}
		}
	}
	if slices.Contains(o.stores, benchkit.Redis) && slices.Contains(o.stores, benchkit.Postgres) {
		for _, m := range o.modes {
			for _, p := range o.prefills {
				add(ratio("redis ÷ postgres, with middleware", "redis/postgres", string(m), p, tput(benchKey{benchkit.Redis, true, string(m), p}), tput(benchKey{benchkit.Postgres, true, string(m), p})))
			}
		}
	}
	return rows, ratios
}

// benchStatusText renders statuses as "201:123 409:4 error:1", by code.
func benchStatusText(st map[string]int) string {
	ks := make([]string, 0, len(st))
	for k := range st {
		ks = append(ks, k)
	}
	sort.Strings(ks) // "error" sorts after the codes
	parts := make([]string, len(ks))
	for i, k := range ks {
		parts[i] = fmt.Sprintf("%s:%d", k, st[k])
	}
	return strings.Join(parts, " ")
}

func benchPrintTables(w io.Writer, rep *benchReport) {
	fmt.Fprintf(w, "orders bench: target %s, %d clients, %s per run, %d user(s), %d round(s)\n\n", rep.Target, rep.Concurrency, rep.Duration, rep.Users, rep.Rounds)
	if len(rep.Prefills) > 0 {
		fmt.Fprintln(w, "prefilled before the first round (live keys of other users; each run first deleted the keys of earlier runs):")
		for _, p := range rep.Prefills {
			fmt.Fprintf(w, "  %s with middleware: %d keys in %.1fs, table and indexes %.2f GB\n", p.Store, p.Keys, p.Seconds, float64(p.TableBytes)/1e9)
		}
		fmt.Fprintln(w)
	}
	// The column of live keys only where there is a --prefill.
	prefilled := false
	for _, r := range rep.Runs {
		prefilled = prefilled || r.Prefill > 0
	}
	live := func(r benchRow) string {
		if !prefilled {
			return ""
		}
		if !r.Middleware {
			return "-\t"
		}
		return strconv.FormatInt(r.Prefill, 10) + "\t"
	}
	liveHead := ""
	if prefilled {
		liveHead = "live keys\t"
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "target\tstore\tmiddleware\t"+liveHead+"mode\trequests\treq/s\tp50 ms\tp90 ms\tp99 ms\tmax ms\treplayed\t")
	for _, r := range rep.Rows {
		mw := "no"
		if r.Middleware {
			mw = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s%s\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t\n", r.Target, r.Store, mw, live(r), r.Mode, r.Requests, r.Throughput, r.P50, r.P90, r.P99, r.Max, r.Replayed)
	}
	tw.Flush()
	// Latency by status, for the rows whose answers are not all 201.
	var mixed []benchRow
	for _, r := range rep.Rows {
		if _, ok := r.Statuses["201"]; !ok || len(r.Statuses) > 1 {
			mixed = append(mixed, r)
		}
	}
	if len(mixed) > 0 {
		fmt.Fprintln(w, "\nlatency by status (rows whose answers are not all 201):")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "store\tmiddleware\t"+liveHead+"mode\tstatus\trequests\tp50 ms\tp90 ms\tp99 ms\tmax ms\t")
		for _, r := range mixed {
			mw := "no"
			if r.Middleware {
				mw = "yes"
			}
			codes := slices.Sorted(maps.Keys(r.ByStatus))
			for _, c := range codes {
				l := r.ByStatus[c]
				fmt.Fprintf(tw, "%s\t%s\t%s%s\t%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t\n", r.Store, mw, live(r), r.Mode, c, l.Requests, l.P50, l.P90, l.P99, l.Max)
			}
		}
		tw.Flush()
	}
	fmt.Fprintln(w, "\nstatuses:")
	for _, r := range rep.Rows {
		mw := "bare"
		if r.Middleware {
			mw = "with middleware"
		}
		if r.Prefill > 0 {
			mw += fmt.Sprintf(" (%d live keys)", r.Prefill)
		}
		fmt.Fprintf(w, "  %s %s %s: %s\n", r.Store, mw, r.Mode, benchStatusText(r.Statuses))
		if r.FirstError != "" {
			fmt.Fprintf(w, "    first error: %.200s\n", r.FirstError)
		}
	}
	if len(rep.Ratios) > 0 {
		fmt.Fprintln(w, "\nratios of throughput (median of the rounds; each round's in brackets):")
		for _, r := range rep.Ratios {
			rs := make([]string, len(r.Rounds))
			for i, v := range r.Rounds {
				rs[i] = fmt.Sprintf("%.2f", v)
			}
			name := r.Name
			if r.Prefill > 0 && !strings.HasPrefix(name, strconv.FormatInt(r.Prefill, 10)+" ") {
				name += fmt.Sprintf(" (%d live keys)", r.Prefill)
			}
			fmt.Fprintf(w, "  %s %s: %s: %.2f [%s]\n", r.Store, r.Mode, name, r.Median, strings.Join(rs, " "))
		}
	}
}
