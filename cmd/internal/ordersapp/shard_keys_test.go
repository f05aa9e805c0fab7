package ordersapp

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// shardColumns names, for each table of the service's and the library's
// PostgreSQL schema that would be distributed across several servers, the
// column it would be distributed by (docs/SCALING.md, "Beyond one
// primary"). Each of its primary keys, unique indexes and exclusion
// constraints must include that column: a shard can enforce only a key
// whose rows all live on it.
var shardColumns = map[string]string{
	"idempotency_keys":   "user_id",
	"orders":             "user_id",
	"receipts":           "user_id",
	"receipt_duplicates": "user_id",
}

// wholeTables are the tables of that schema that stay whole, with why.
var wholeTables = map[string]string{
	"deployment":        "one row per database: a reference table, copied to every node",
	"jwt_secret":        "one row per database: a reference table, copied to every node",
	"event_stream":      "one row per database: a reference table, copied to every node",
	"schema_migrations": "the migrations' own record, written only by migrations: a reference table",
	"idem_outbox": "its id is the broker's deduplication id (Nats-Msg-Id), unique across ordering keys, " +
		"and its key keeps it so; distributed by ordering_key it needs the key (id, ordering_key), " +
		"safe only when every id embeds its ordering key, as the order service's do (SCALING.md)",
}

// shardKeyViolations reads the tables of schema from PostgreSQL's catalog
// and returns one line per table that breaks the rule of shardColumns and
// wholeTables: a key leaving out the table's distribution column, a table
// named in neither, or a name in shardColumns with no such table.
func shardKeyViolations(ctx context.Context, conn *pgx.Conn, schema string, shard map[string]string, whole map[string]string) ([]string, error) {
	rows, err := conn.Query(ctx, `
		SELECT c.relname, coalesce(i.relname, ''),
			coalesce((SELECT array_agg(coalesce(a.attname, '(expression)') ORDER BY k.ord)
				FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord)
				LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum AND k.attnum > 0),
				'{}')
		FROM pg_class c
		JOIN pg_namespace n ON n.oid = c.relnamespace
		LEFT JOIN pg_index x ON x.indrelid = c.oid AND (x.indisunique OR x.indisexclusion)
		LEFT JOIN pg_class i ON i.oid = x.indexrelid
		WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')
		ORDER BY 1, 2`, schema)
	if err != nil {
		return nil, err
	}
	type key struct {
		table, index string
		columns      []string
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (key, error) {
		var k key
		err := r.Scan(&k.table, &k.index, &k.columns)
		return k, err
	})
	if err != nil {
		return nil, err
	}
	var bad []string
	seen := map[string]bool{}
	for _, k := range keys {
		if !seen[k.table] {
			seen[k.table] = true
			_, sharded := shard[k.table]
			if _, kept := whole[k.table]; !sharded && !kept {
				bad = append(bad, fmt.Sprintf("table %s.%s: neither distributed nor kept whole: name the column it is distributed by, or why it stays whole", schema, k.table))
			}
		}
		col, sharded := shard[k.table]
		if sharded && k.index != "" && !slices.Contains(k.columns, col) {
			bad = append(bad, fmt.Sprintf("table %s.%s: key %s on (%s) leaves out %s", schema, k.table, k.index, strings.Join(k.columns, ", "), col))
		}
	}
	for t := range shard {
		if !seen[t] {
			bad = append(bad, fmt.Sprintf("table %s.%s: named as distributed, but the schema has no such table", schema, t))
		}
	}
	slices.Sort(bad)
	return bad, nil
}

// TestSchemaKeysIncludeUser migrates an empty database as `orders migrate`
// does (the library's keys and outbox, the orders', and the in-process
// gateway's schema) and reads every key of the orders' schema from the
// catalog: each includes the user, the column the tables would be
// distributed by, except in the tables kept whole, each with its reason.
// The gateway's schema is a stand-in for an external gateway and is left
// out. The check itself is shown to name a table that breaks the rule.
func TestSchemaKeysIncludeUser(t *testing.T) {
	db := pgtest.Database(t)
	if code, out, errs := run(t, nil, "migrate", "--database-url", db, "--data-dir", t.TempDir()); code != 0 {
		t.Fatalf("orders migrate = exit %d:\n%s%s", code, out, errs)
	}
	ctx := context.Background()
	// The in-process gateway's schema, as serve makes it.
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = payments.OpenPostgres(ctx, pool, payments.DefaultSchema)
	pool.Close()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	bad, err := shardKeyViolations(ctx, conn, "public", shardColumns, wholeTables)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range bad {
		t.Error(b)
	}

	var schemas []string
	if err := conn.QueryRow(ctx, `SELECT coalesce(array_agg(nspname::text ORDER BY nspname), '{}') FROM pg_namespace
		WHERE nspname NOT IN ('public', 'information_schema') AND nspname NOT LIKE 'pg\_%'`).Scan(&schemas); err != nil {
		t.Fatal(err)
	}
	if want := []string{payments.DefaultSchema}; !slices.Equal(schemas, want) {
		t.Errorf("schemas besides public = %v, want %v: a new schema must be checked here", schemas, want)
	}

	// The check names what breaks the rule.
	for _, s := range []string{
		`CREATE SCHEMA sharding_rule_check`,
		`CREATE TABLE sharding_rule_check.orders (id text PRIMARY KEY, user_id text NOT NULL)`,
		`CREATE TABLE sharding_rule_check.receipts (id text, user_id text, event_id text, PRIMARY KEY (id, user_id))`,
		`CREATE UNIQUE INDEX receipts_event ON sharding_rule_check.receipts (event_id)`,
		`CREATE TABLE sharding_rule_check.idempotency_keys (user_id text, key text, PRIMARY KEY (user_id, key))`,
		`CREATE TABLE sharding_rule_check.gadgets (id text)`,
	} {
		if _, err := conn.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	shard := map[string]string{"orders": "user_id", "receipts": "user_id", "idempotency_keys": "user_id", "missing": "user_id"}
	got, err := shardKeyViolations(ctx, conn, "sharding_rule_check", shard, map[string]string{})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"table sharding_rule_check.gadgets: neither distributed nor kept whole: name the column it is distributed by, or why it stays whole",
		"table sharding_rule_check.missing: named as distributed, but the schema has no such table",
		"table sharding_rule_check.orders: key orders_pkey on (id) leaves out user_id",
		"table sharding_rule_check.receipts: key receipts_event on (event_id) leaves out user_id",
	}
	if !slices.Equal(got, want) {
		t.Errorf("the check on a schema that breaks the rule found:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
