package payments

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/sqlitestore"
)

// OpenExistingSQLite and OpenExistingPostgres open a gateway that
// OpenSQLite or OpenPostgres set up, and refuse, creating nothing, a
// missing file, an empty database or an empty schema.
func TestOpenExisting(t *testing.T) {
	ctx := context.Background()
	t.Run("SQLite", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "gw.db")
		if _, _, err := OpenExistingSQLite(ctx, path); !errors.Is(err, sqlitestore.ErrNoDatabase) {
			t.Fatalf("no file: %v, want ErrNoDatabase", err)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("the file was created: %v", err)
		}
		if err := os.WriteFile(path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if _, _, err := OpenExistingSQLite(ctx, path); !errors.Is(err, ErrSchemaNotCurrent) {
			t.Fatalf("an empty database: %v, want ErrSchemaNotCurrent", err)
		}
		st, _, err := OpenSQLite(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		st.Close()
		st, ledger, err := OpenExistingSQLite(ctx, path)
		if err != nil {
			t.Fatalf("after OpenSQLite: %v", err)
		}
		defer st.Close()
		if _, err := ledger.Count(ctx, "acct"); err != nil {
			t.Errorf("the ledger: %v", err)
		}
	})
	t.Run("PostgreSQL", func(t *testing.T) {
		pool := pgtest.Pool(t)
		_, schema := pgtest.SchemaName(t)
		if _, _, err := OpenExistingPostgres(ctx, pool, schema); !errors.Is(err, ErrSchemaNotCurrent) {
			t.Fatalf("no schema: %v, want ErrSchemaNotCurrent", err)
		}
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists); err != nil || exists {
			t.Fatalf("schema %s was created (%v)", schema, err)
		}
		if _, _, err := OpenPostgres(ctx, pool, schema); err != nil {
			t.Fatal(err)
		}
		_, ledger, err := OpenExistingPostgres(ctx, pool, schema)
		if err != nil {
			t.Fatalf("after OpenPostgres: %v", err)
		}
		if _, err := ledger.Count(ctx, "acct"); err != nil {
			t.Errorf("the ledger: %v", err)
		}
	})
}
