package ordersapp

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
)

// faultRestart is one restart of the cluster during a storm.
type faultRestart struct {
	mode           string
	answeredBefore int64 // final answers when the restart began
	answeredAfter  int64 // and when the cluster accepted connections again
	took           time.Duration
	before, after  time.Time // the postmaster's start time
	err            error
}

// faultPostmasterStart returns the server's start time (zero when it does
// not answer).
func faultPostmasterStart(db string) time.Time {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		return time.Time{}
	}
	defer conn.Close(ctx)
	var t time.Time
	if err := conn.QueryRow(ctx, `SELECT pg_postmaster_start_time()`).Scan(&t); err != nil {
		return time.Time{}
	}
	return t
}

// Case 4. PostgreSQL restarted during a storm, twice: `pg_ctlcluster
// restart -m fast` once an eighth of the answers came, then `-m
// immediate` (no shutdown checkpoint: the start is a crash recovery) at
// three eighths, or as soon as the first restart ended. A throwaway
// cluster of the test's own (pgtest.NewCluster), never the shared one.
// Two instances, 400 keys x 4 copies through the retrying client, lease
// 2s. Each restart must begin while answers are still due and must
// change the postmaster's start time, and the server's log must show the
// crash recovery; then faultCheck.
func TestFaultPostgresRestart(t *testing.T) {
	t0 := time.Now()
	cl := pgtest.NewCluster(t)
	made := time.Since(t0)
	c := faultNewChain(t, cl.URL)
	for i := 0; i < 2; i++ {
		faultAddInstance(t, c, cl.URL, c.payURL, "--key-lease", "2s")
	}
	t.Logf("cluster %s made in %v, services up in %v", cl.Name, made.Round(time.Millisecond), (time.Since(t0) - made).Round(time.Millisecond))
	s := faultNewStorm("restart", 400, 4, 5)
	total := int64(s.keys * s.copies)
	done := make(chan struct{})
	restarts := make(chan []faultRestart, 1)
	go func() {
		var rs []faultRestart
		defer func() { restarts <- rs }()
		for i, mode := range []string{"fast", "immediate"} {
			r := faultRestart{mode: mode}
			if !s.waitAnswered(total*int64(2*i+1)/8, done) {
				r.err = errors.New("the storm ended before the restart")
				rs = append(rs, r)
				return
			}
			r.before = faultPostmasterStart(cl.URL)
			r.answeredBefore = s.answered.Load()
			t0 := time.Now()
			r.err = cl.Restart(mode)
			r.took = time.Since(t0)
			r.answeredAfter = s.answered.Load()
			r.after = faultPostmasterStart(cl.URL)
			rs = append(rs, r)
		}
	}()
	s.run(c.bases, 60)
	close(done)
	rs := <-restarts

	for _, r := range rs {
		t.Logf("restart -m %s: began after %d of %d final answers, took %v, %d answers by its end; postmaster started %s, then %s",
			r.mode, r.answeredBefore, total, r.took.Round(time.Millisecond), r.answeredAfter,
			r.before.Format("15:04:05.000"), r.after.Format("15:04:05.000"))
		switch {
		case r.err != nil:
			t.Errorf("restart -m %s: %v", r.mode, r.err)
		case r.answeredBefore >= total:
			t.Errorf("restart -m %s began after the storm's last answer", r.mode)
		case r.before.IsZero() || !r.after.After(r.before):
			t.Errorf("restart -m %s: the postmaster's start time went from %v to %v: no restart", r.mode, r.before, r.after)
		}
	}
	if len(rs) != 2 {
		t.Errorf("%d restarts, want 2", len(rs))
	}
	res := faultCheck(t, c, s)
	serverLog := cl.Log()
	var errorLines, redriven int
	for _, o := range c.orders {
		logs := o.logs.String()
		errorLines += strings.Count(logs, "level=ERROR")
		redriven += strings.Count(logs, "completer re-drove a request")
	}
	t.Logf("server log: %d sessions terminated by the fast shutdown, immediate shutdown received %d, crash recoveries %d",
		strings.Count(serverLog, "terminating connection due to administrator command"),
		strings.Count(serverLog, "received immediate shutdown request"),
		strings.Count(serverLog, "automatic recovery in progress"))
	if strings.Count(serverLog, "terminating connection due to administrator command") == 0 {
		t.Errorf("the fast restart terminated no session of the service")
	}
	if !strings.Contains(serverLog, "automatic recovery in progress") {
		t.Errorf("no crash recovery in the server's log after restart -m immediate")
	}
	t.Logf("case 4 (PostgreSQL restarted): store errors seen by the service %d, fenced %d, error lines in its logs %d, requests re-driven by the completer %d; %d orders, %d payments",
		faultSum(t, c.bases, "idem_store_errors_total"), faultSum(t, c.bases, "idem_fenced_total"), errorLines, redriven, res.orders, res.payments)
}
