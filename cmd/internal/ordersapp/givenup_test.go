package ordersapp

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	_ "modernc.org/sqlite"
)

// TestAuditListsGivenUpKeys: a key the completers gave up on is shown by
// `orders audit`, with its user and an operation id, not its key.
func TestAuditListsGivenUpKeys(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	c := Config{DataDir: dir}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	const key = "private-key-material"
	cl, err := be.store.Claim(ctx, idemdriver.ClaimParams{User: "alice", Key: key, Fingerprint: "f", Method: "POST", Path: "/v1/orders", Lease: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	be.close()
	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`UPDATE idempotency_keys SET redrives = ?, attempts = ?`, idem.DefaultCompleterMaxAttempts, idem.DefaultCompleterMaxAttempts+1); err != nil {
		t.Fatal(err)
	}
	db.Close()

	_, out, errs := run(t, nil, "audit", "--data-dir", dir)
	id := idemdriver.OperationID("alice", key, cl.Lease.CreatedAt)
	if !strings.Contains(out, "given up:          1") || !strings.Contains(out, id) || !strings.Contains(out, `user "alice"`) {
		t.Errorf("audit does not list the given-up key (user alice, operation %s):\n%s%s", id, out, errs)
	}
	if strings.Contains(out, key) {
		t.Errorf("audit shows the key itself:\n%s", out)
	}
}
