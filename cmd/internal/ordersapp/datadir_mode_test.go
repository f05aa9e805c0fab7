package ordersapp

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/testwait"
)

// TestDataDirIsPrivate: what serve keeps in its data dir is its user's
// alone: the directory 0700, the JWT secret, the URL of the embedded
// NATS and the SQLite databases (the orders' and the in-process
// gateway's) 0600.
func TestDataDirIsPrivate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	c := replicaConfig(t, "", 1)
	c.DataDir, c.JWTSecret = dir, ""
	srv := startInProcess(t, c)
	if st := call(t, "POST", srv.base+"/v1/orders", "", "mode-1", orderBody(1)); st.status != 401 {
		t.Fatalf("POST without a token: %d", st.status)
	}
	testwait.Until(t, 10*time.Second, "nats.url", func() bool {
		_, err := os.Stat(filepath.Join(dir, natsURLFile))
		return err == nil
	})
	want := map[string]os.FileMode{
		".": 0o700, "jwt-secret": 0o600, natsURLFile: 0o600, "orders.db": 0o600, "orders-payments.db": 0o600, "nats.token": 0o600,
	}
	for name, mode := range want {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if got := fi.Mode().Perm(); got != mode {
			t.Errorf("%s has mode %o, want %o", name, got, mode)
		}
	}
}
