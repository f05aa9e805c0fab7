package sqlitestore_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/idem-go/idem/sqlitestore"
)

// TestOpenCreatesPrivateFiles: a database Open creates, and the -wal and
// -shm files SQLite makes beside it, are readable and writable by their
// owner only (they hold users' keys, stored answers and request bodies);
// before, they were 0644. An existing file keeps its mode.
func TestOpenCreatesPrivateFiles(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "keys.db")
	st, err := sqlitestore.Open(context.Background(), path, sqlitestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.DB().Exec(`CREATE TABLE t (x int); INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"keys.db", "keys.db-wal", "keys.db-shm"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if m := fi.Mode().Perm(); m != 0o600 {
			t.Errorf("%s has mode %o, want 600", name, m)
		}
	}

	shared := filepath.Join(dir, "shared.db")
	if err := os.WriteFile(shared, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	st2, err := sqlitestore.Open(context.Background(), shared, sqlitestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	if fi, err := os.Stat(shared); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("an existing file's mode: %v %v, want 640 kept", fi.Mode().Perm(), err)
	}
}
