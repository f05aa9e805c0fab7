package ordersapp

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
)

// The operator commands that must not create or migrate a database: the
// read-only ones (audit, keys list and show) and those that only change
// rows of an existing schema (gc, keys redrive and purge).
var existingSchemaCommands = [][]string{
	{"audit"},
	{"keys", "list", "--state", "in-flight"},
	{"keys", "show", "--user", "alice", "--key", "k-1"},
	{"gc"},
	{"keys", "redrive", "--user", "alice", "--key", "k-1"},
	{"keys", "purge", "--user", "alice", "--key", "k-1"},
}

// sqliteTables counts the tables of the SQLite file at path, opened
// read-only (so that the count changes nothing).
func sqliteTables(t *testing.T, path string) int {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE type = 'table'`).Scan(&n); err != nil {
		t.Fatalf("counting the tables of %s: %v", path, err)
	}
	return n
}

// pgTables lists the tables of the database at url outside the system
// schemas, and whether the in-process gateway's schema exists.
func pgTables(t *testing.T, url string) (tables []string, gatewaySchema bool) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT table_schema || '.' || table_name FROM information_schema.tables
WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	if tables, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'payments')`).Scan(&gatewaySchema); err != nil {
		t.Fatal(err)
	}
	return tables, gatewaySchema
}

// runEach runs every command of existingSchemaCommands with storage and
// fails t unless each exits non-zero with a line that holds want.
func runEach(t *testing.T, storage []string, want string) {
	t.Helper()
	for _, cmd := range existingSchemaCommands {
		code, stdout, stderr := run(t, nil, append(append([]string{}, cmd...), storage...)...)
		if code == 0 || !strings.Contains(stderr, want) {
			t.Errorf("orders %s: exit %d, stderr %q, stdout %q; want non-zero and %q", strings.Join(cmd, " "), code, stderr, stdout, want)
		}
		if strings.Contains(stdout, "OK") {
			t.Errorf("orders %s printed %q", strings.Join(cmd, " "), stdout)
		}
	}
}

// runMigrated runs every command of existingSchemaCommands with storage
// on a migrated database: none is refused for its schema, and audit,
// keys list and gc succeed.
func runMigrated(t *testing.T, storage []string) {
	t.Helper()
	for _, cmd := range existingSchemaCommands {
		code, stdout, stderr := run(t, nil, append(append([]string{}, cmd...), storage...)...)
		if strings.Contains(stderr, "schema") || strings.Contains(stderr, "no database") {
			t.Errorf("orders %s on a migrated database: %q", strings.Join(cmd, " "), stderr)
		}
		switch cmd[0] + " " + cmd[len(cmd)-1] {
		case "audit audit", "keys in-flight", "gc gc":
			if code != 0 {
				t.Errorf("orders %s on a migrated database: exit %d, stderr %q, stdout %q", strings.Join(cmd, " "), code, stderr, stdout)
			}
		}
	}
}

// TestReadOnlyCommandsSQLite: on a data dir without a database, or with
// an empty SQLite file, the audit, keys and gc commands exit non-zero
// with a message that says so, and create no file and no table (before,
// audit made an empty database and printed "OK: every invariant holds");
// on a database migrated by an older binary they say to run orders
// migrate; on a migrated one they work, and create no gateway file.
func TestReadOnlyCommandsSQLite(t *testing.T) {
	dir := t.TempDir()
	storage := []string{"--data-dir", dir}
	runEach(t, storage, "no database at")
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("the data dir holds %d entries after the commands (%s, …), want none", len(entries), entries[0].Name())
	}

	path := filepath.Join(dir, "orders.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	runEach(t, storage, "no order service schema in this database: run `orders migrate` (or start `orders serve`) first")
	if n := sqliteTables(t, path); n != 0 {
		t.Errorf("the empty database has %d tables after the commands, want none", n)
	}
	gwPath := filepath.Join(dir, "orders-payments.db")
	if _, err := os.Stat(gwPath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the in-process gateway's database was created: %v", err)
	}

	if code, _, stderr := run(t, nil, "migrate", "--data-dir", dir); code != 0 {
		t.Fatalf("migrate: %s", stderr)
	}
	tables := sqliteTables(t, path)
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	// As an older binary left it: its last migration not recorded (its
	// table is there, which the command does not look at).
	var version int64
	var name string
	var at int64
	if err := db.QueryRow(`SELECT version, name, applied_at FROM schema_migrations WHERE component = 'orders' ORDER BY version DESC LIMIT 1`).Scan(&version, &name, &at); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`DELETE FROM schema_migrations WHERE component = 'orders' AND version = ?`, version); err != nil {
		t.Fatal(err)
	}
	runEach(t, storage, "older than this binary: run `orders migrate` first")
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM schema_migrations WHERE component = 'orders' AND version = ?`, version).Scan(&n); err != nil || n != 0 {
		t.Fatalf("the commands migrated the older database (%d, %v)", n, err)
	}
	if _, err := db.Exec(`INSERT INTO schema_migrations (component, version, name, applied_at) VALUES ('orders', ?, ?, ?)`, version, name, at); err != nil {
		t.Fatal(err)
	}
	runMigrated(t, storage)
	if n := sqliteTables(t, path); n != tables {
		t.Errorf("%d tables after the commands, %d before", n, tables)
	}
	if _, err := os.Stat(gwPath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the in-process gateway's database was created: %v", err)
	}
}

// TestReadOnlyCommandsPostgres: on an empty PostgreSQL database the audit,
// keys and gc commands exit non-zero saying there is no schema, and the
// database still has no table (before, they made six); on one migrated by
// an older binary they say to run orders migrate; on a migrated one they
// work, and create no gateway schema.
func TestReadOnlyCommandsPostgres(t *testing.T) {
	db := pgtest.Database(t)
	storage := []string{"--data-dir", t.TempDir(), "--database-url", db}
	runEach(t, storage, "no order service schema in this database: run `orders migrate` (or start `orders serve`) first")
	if tables, gw := pgTables(t, db); len(tables) != 0 || gw {
		t.Errorf("after the commands on an empty database: tables %v, gateway schema %v; want none", tables, gw)
	}

	if code, _, stderr := run(t, nil, append([]string{"migrate"}, storage...)...); code != 0 {
		t.Fatalf("migrate: %s", stderr)
	}
	migrated, _ := pgTables(t, db)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// As an older binary left it: the outbox's last migration not
	// recorded.
	var version int
	if err := conn.QueryRow(ctx, `DELETE FROM schema_migrations WHERE component = 'outbox' AND version = (SELECT max(version) FROM schema_migrations WHERE component = 'outbox') RETURNING version`).Scan(&version); err != nil {
		t.Fatal(err)
	}
	runEach(t, storage, "older than this binary: run `orders migrate` first")
	if _, err := conn.Exec(ctx, `INSERT INTO schema_migrations (component, version) VALUES ('outbox', $1)`, version); err != nil {
		t.Fatalf("the commands migrated the older database: %v", err)
	}
	runMigrated(t, storage)
	if tables, gw := pgTables(t, db); len(tables) != len(migrated) || gw {
		t.Errorf("after the commands on a migrated database: tables %v (before: %v), gateway schema %v", tables, migrated, gw)
	}
}
