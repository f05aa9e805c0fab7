package pgconfig_test

import (
	"context"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/pgconfig"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// latin1 is pgtest.DatabaseWith's options for a database whose encoding
// is LATIN1, as initdb makes it under a Latin-1 locale (de_DE, say): a
// database "whose encoding is not UTF8", which the README lists as
// supported.
const latin1 = "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"

// FINDING (adversarial review): Apply sets client_encoding=UTF8 on a
// pool that did not set it. On a LATIN1 database, the order service
// before that change (and any pool that leaves client_encoding to the
// database) wrote a user id's UTF-8 bytes as they are, read as LATIN1;
// a pool configured by Apply sends the same id converted to LATIN1,
// which is other bytes. The same user and key then name another row:
// a key completed before a rolling upgrade is claimed afresh after it
// (the handler runs again: a second order for one key, and the user's
// earlier orders, kept under the old bytes, are no longer theirs), and a
// user id with a character LATIN1 lacks, which claimed before, is
// refused at every claim (22P05). What Apply configures must keep
// naming the rows that the pools before it wrote.
func TestApplyKeepsKeysOfNonUTF8Database(t *testing.T) {
	ctx := context.Background()
	url := pgtest.DatabaseWith(t, latin1)
	before := pgtest.PoolOn(t, url) // client_encoding left to the database, as before Apply
	if err := pgstore.Migrate(ctx, before); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = before.Config().ConnConfig.RuntimeParams["search_path"]
	pgconfig.Apply(cfg, url)
	after, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(after.Close)
	old, upgraded := pgstore.New(before, pgstore.Options{}), pgstore.New(after, pgstore.Options{})

	claim := func(user, key string) idemdriver.ClaimParams {
		return idemdriver.ClaimParams{User: user, Key: key, Fingerprint: "fp", Method: "POST", Path: "/v1/orders", Lease: time.Minute, TTL: time.Hour}
	}

	t.Run("KeyCompletedBeforeIsReplayed", func(t *testing.T) {
		p := claim("josé", "k-before-upgrade")
		c, err := old.Claim(ctx, p)
		if err != nil || c.Lease == nil {
			t.Fatalf("Claim before: %+v, %v", c, err)
		}
		tx, err := old.Begin(ctx, c.Lease)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(`{"id":"o1"}`)}); err != nil {
			t.Fatalf("Complete before: %v", err)
		}
		c, err = upgraded.Claim(ctx, p)
		if err != nil {
			t.Fatalf("Claim after: %v", err)
		}
		if c.Response == nil {
			t.Fatalf("the key completed before the upgrade was claimed afresh after it (attempt %d): the handler runs again", c.Lease.Attempt)
		}
	})

	t.Run("UserClaimingBeforeClaimsAfter", func(t *testing.T) {
		const user = "山田"
		if c, err := old.Claim(ctx, claim(user, "k-1")); err != nil || c.Lease == nil {
			t.Fatalf("Claim before: %+v, %v", c, err)
		}
		if c, err := upgraded.Claim(ctx, claim(user, "k-2")); err != nil || c.Lease == nil {
			t.Fatalf("Claim after = %+v, %v; the same user claimed before", c, err)
		}
	})
}

// Apply's sessions: UTF8 on a SQL_ASCII database (no conversion either
// way, and the stores' one-round-trip completion needs it), the
// database's own on a LATIN1 one, and a URL's client_encoding kept.
func TestApplyClientEncoding(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name, options, param, want string
	}{
		{"sql_ascii", pgtest.SQLASCII, "", "UTF8"},
		{"latin1", latin1, "", "LATIN1"},
		{"utf8", "", "", "UTF8"},
		{"sql_ascii, URL's own", pgtest.SQLASCII, "SQL_ASCII", "SQL_ASCII"},
	} {
		t.Run(c.name, func(t *testing.T) {
			url := pgtest.DatabaseWith(t, c.options)
			if c.param != "" {
				url += "?client_encoding=" + c.param
			}
			cfg, err := pgxpool.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			pgconfig.Apply(cfg, url)
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			for range 3 { // every connection, not only the first
				var got string
				if err := pool.QueryRow(ctx, `SHOW client_encoding`).Scan(&got); err != nil {
					t.Fatal(err)
				}
				if got != c.want {
					t.Errorf("client_encoding %s, want %s", got, c.want)
				}
			}
		})
	}
}
