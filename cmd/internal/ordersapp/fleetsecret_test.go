package ordersapp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/pgtest"
)

// fleetConfig is one instance of a fleet on db: its own data dir, the
// fleet's NATS, and no --jwt-secret.
func fleetConfig(db, natsURL, dir string) *Config {
	return &Config{DatabaseURL: db, DataDir: dir, NATSURL: natsURL, PaymentsKey: "sk_test_local",
		KeyTTL: time.Hour, KeyLease: 30 * time.Second, RequireKey: true}
}

// postWithSecret sends one order to base with a token for user signed
// with secret and returns the status.
func postWithSecret(t *testing.T, base string, secret []byte, user, key string) int {
	t.Helper()
	tok, err := orders.IssueToken(secret, user, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return postBearer(t, base, tok, key)
}

// TestFleetTokenAcceptedByEveryInstance: two instances on one PostgreSQL
// database, each with a data dir of its own and no --jwt-secret, accept
// each other's tokens, as instances behind one load balancer must.
func TestFleetTokenAcceptedByEveryInstance(t *testing.T) {
	db := pgtest.Database(t)
	natsURL := testNATS(t)
	in1 := startInProcess(t, fleetConfig(db, natsURL, t.TempDir()))
	in2 := startInProcess(t, fleetConfig(db, natsURL, t.TempDir()))
	secret := in1.srv.ordersCfg.Secret
	if got := postWithSecret(t, in2.base, secret, "alice", "fleet-1"); got != http.StatusCreated {
		t.Errorf("token of instance 1 on instance 2: status %d, want 201", got)
	}
	if got := postWithSecret(t, in1.base, in2.srv.ordersCfg.Secret, "bob", "fleet-2"); got != http.StatusCreated {
		t.Errorf("token of instance 2 on instance 1: status %d, want 201", got)
	}
}

// keptSecret is the JWT secret the database db keeps, "" when none.
func keptSecret(t *testing.T, db string) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var s string
	if err := conn.QueryRow(ctx, `SELECT coalesce((SELECT secret FROM jwt_secret), '')`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestFleetFirstStartAgreesOnOneSecret: four instances starting at once
// on a fresh database, each with a data dir of its own and no secret in
// it, store one secret and all use it; it is 32 random bytes or more,
// appears in no log line, and no data dir gets one.
func TestFleetFirstStartAgreesOnOneSecret(t *testing.T) {
	db := pgtest.Database(t)
	natsURL := testNATS(t)
	const n = 4
	ins := make([]*inProcess, n)
	dirs := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		dirs[i] = t.TempDir()
		wg.Add(1)
		go func() {
			defer wg.Done()
			ins[i] = startInProcess(t, fleetConfig(db, natsURL, dirs[i]))
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	kept := keptSecret(t, db)
	if len(kept) < 64 { // hex of 32 random bytes
		t.Fatalf("the database keeps a secret of %d characters, want 64 or more", len(kept))
	}
	for i, in := range ins {
		if got := string(in.srv.ordersCfg.Secret); got != kept {
			t.Errorf("instance %d signs with another secret than the database's", i)
		}
		if _, err := os.Stat(filepath.Join(dirs[i], "jwt-secret")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("instance %d: data dir got a jwt-secret file (%v)", i, err)
		}
		if got := postWithSecret(t, in.base, []byte(kept), "carol", fmt.Sprintf("first-start-%d", i)); got != http.StatusCreated {
			t.Errorf("instance %d: status %d, want 201", i, got)
		}
		if strings.Contains(in.logs.String(), kept) {
			t.Errorf("instance %d logged the secret", i)
		}
	}
}

// TestFleetAdoptsDataDirSecretOnUpgrade: on a database that keeps no
// secret yet, the first instance to start stores the secret of its data
// dir there, so that tokens made before still work on every instance; an
// instance whose data dir holds another secret uses the database's and
// says, without the secret, that tokens of its own are refused now.
func TestFleetAdoptsDataDirSecretOnUpgrade(t *testing.T) {
	db := pgtest.Database(t)
	natsURL := testNATS(t)
	dir1, dir2 := t.TempDir(), t.TempDir()
	old1, old2 := "upgrade-secret-one-0123456789abcdef0123", "upgrade-secret-two-0123456789abcdef0123"
	for dir, s := range map[string]string{dir1: old1, dir2: old2} {
		if err := os.WriteFile(filepath.Join(dir, "jwt-secret"), []byte(s+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// The schema as it was before the database kept a secret: migrated,
	// no row.
	if code, _, errs := run(t, nil, "migrate", "--database-url", db, "--data-dir", dir1); code != 0 {
		t.Fatalf("migrate: exit %d: %s", code, errs)
	}
	if got := keptSecret(t, db); got != "" {
		t.Fatalf("migrate stored a secret; want none before the first instance")
	}
	in1 := startInProcess(t, fleetConfig(db, natsURL, dir1))
	if got := keptSecret(t, db); got != old1 {
		t.Fatalf("the database keeps another secret than the first instance's data dir's")
	}
	in2 := startInProcess(t, fleetConfig(db, natsURL, dir2))
	for i, in := range []*inProcess{in1, in2} {
		if got := postWithSecret(t, in.base, []byte(old1), "dave", fmt.Sprintf("upgrade-%d", i)); got != http.StatusCreated {
			t.Errorf("a token made before the upgrade on instance %d: status %d, want 201", i+1, got)
		}
	}
	if got := postWithSecret(t, in2.base, []byte(old2), "erin", "upgrade-other"); got != http.StatusUnauthorized {
		t.Errorf("a token of the second data dir's own secret: status %d, want 401", got)
	}
	logs1, logs2 := in1.logs.String(), in2.logs.String()
	if !strings.Contains(logs1, "now kept in the database") {
		t.Errorf("instance 1 does not say it stored its data dir's secret:\n%s", logs1)
	}
	if !strings.Contains(logs2, "level=WARN") || !strings.Contains(logs2, "refused with 401") || !strings.Contains(logs2, filepath.Join(dir2, "jwt-secret")) {
		t.Errorf("instance 2 does not warn that its data dir's tokens are refused:\n%s", logs2)
	}
	for _, s := range []string{old1, old2} {
		if strings.Contains(logs1+logs2, s) {
			t.Errorf("a secret appears in the logs")
		}
	}
}

// TestTokenUsesDatabaseSecret: `orders token` (and `orders bench --target
// serve`) with the database's URL signs with the secret the instances on
// it use, whatever its data dir; an explicit --jwt-secret wins over it, on
// serve as on token.
func TestTokenUsesDatabaseSecret(t *testing.T) {
	db := pgtest.Database(t)
	natsURL := testNATS(t)
	in := startInProcess(t, fleetConfig(db, natsURL, t.TempDir()))

	tokenDir := t.TempDir()
	code, out, errs := run(t, map[string]string{"DATABASE_URL": db}, "token", "--user", "frank", "--data-dir", tokenDir)
	if code != 0 {
		t.Fatalf("token: exit %d: %s", code, errs)
	}
	if got := postBearer(t, in.base, strings.TrimSpace(out), "token-db"); got != http.StatusCreated {
		t.Errorf("orders token with DATABASE_URL: status %d, want 201", got)
	}
	if _, err := os.Stat(filepath.Join(tokenDir, "jwt-secret")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("orders token with DATABASE_URL wrote a secret in its data dir (%v)", err)
	}
	if strings.Contains(errs, keptSecret(t, db)) {
		t.Errorf("orders token wrote the secret on stderr")
	}

	// orders bench --target serve signs with it too.
	code, out, errs = benchRunApp(t, "bench", "--target", "serve", "--url", in.base, "--database-url", db, "--data-dir", t.TempDir(),
		"--mode", "create", "--duration", "300ms", "--concurrency", "2", "--users", "1", "--json")
	if code != 0 {
		t.Fatalf("bench with the database's URL: exit %d: %s", code, errs)
	}
	var rep benchReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil || len(rep.Runs) != 1 {
		t.Fatalf("bench report %q: %v", out, err)
	}
	if r := rep.Runs[0]; r.Requests == 0 || r.Statuses["201"] != r.Requests {
		t.Errorf("bench with the database's URL: %d requests, statuses %v; want all 201", r.Requests, r.Statuses)
	}

	// --jwt-secret wins over the database's.
	code, out, errs = run(t, nil, "token", "--user", "frank", "--database-url", db, "--jwt-secret", testSecret)
	if code != 0 {
		t.Fatalf("token --jwt-secret: exit %d: %s", code, errs)
	}
	if got := postBearer(t, in.base, strings.TrimSpace(out), "token-explicit"); got != http.StatusUnauthorized {
		t.Errorf("a token of --jwt-secret on an instance using the database's: status %d, want 401", got)
	}
	c := fleetConfig(db, natsURL, t.TempDir())
	c.JWTSecret = testSecret
	explicit := startInProcess(t, c)
	if got := postBearer(t, explicit.base, strings.TrimSpace(out), "token-explicit-2"); got != http.StatusCreated {
		t.Errorf("a token of --jwt-secret on an instance with that --jwt-secret: status %d, want 201", got)
	}
	if got := postWithSecret(t, explicit.base, []byte(keptSecret(t, db)), "frank", "token-explicit-3"); got != http.StatusUnauthorized {
		t.Errorf("a token of the database's secret on an instance with --jwt-secret: status %d, want 401", got)
	}

	// A database without the schema: an error naming orders migrate.
	code, _, errs = run(t, nil, "token", "--user", "frank", "--database-url", pgtest.Database(t), "--data-dir", t.TempDir())
	if code == 0 || !strings.Contains(errs, "orders migrate") {
		t.Errorf("token on a database without the schema: exit %d, stderr %q; want an error naming orders migrate", code, errs)
	}
}

// postBearer sends one order to base with the bearer token tok and
// returns the status.
func postBearer(t *testing.T, base, tok, key string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/orders", strings.NewReader(orderBody(2)))
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}
