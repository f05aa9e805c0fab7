package sqlitestore

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
)

// TestAbandonedPlan: Abandoned reads the partial index in its order (no
// sort), so it stops at its limit however many keys wait.
func TestAbandonedPlan(t *testing.T) {
	ctx := context.Background()
	s, err := Open(ctx, filepath.Join(t.TempDir(), "idem.db"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rows, err := s.DB().QueryContext(ctx, "EXPLAIN QUERY PLAN "+selectAbandoned,
		sql.Named("now", int64(0)), sql.Named("max_redrives", int64(3)),
		sql.Named("backoff", int64(1)), sql.Named("max_backoff", int64(2)), sql.Named("limit", int64(10)),
		sql.Named("all_kinds", false), sql.Named("http", true), sql.Named("operations", `["orders.receipt"]`))
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, notused int
		var detail string
		if err := rows.Scan(&id, &parent, &notused, &detail); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, detail)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	all := strings.Join(plan, "; ")
	t.Logf("plan: %s", all)
	if !strings.Contains(all, "USING INDEX idempotency_keys_abandoned") || strings.Contains(all, "TEMP B-TREE FOR ORDER BY") {
		t.Errorf("plan of Abandoned = %q; want the index idempotency_keys_abandoned and no sort", all)
	}
}
