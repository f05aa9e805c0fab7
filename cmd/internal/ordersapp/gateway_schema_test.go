package ordersapp

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	neturl "net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestGatewayRecordsStayInGatewaySchema: with the order service on
// PostgreSQL and the in-process gateway, the gateway's idempotency
// records, PaymentIntents and refunds are all in its own schema
// (payments.DefaultSchema), none is in the orders' schema, and the orders'
// store never lists one of the gateway's abandoned records for its
// completer. So whatever the URL does with search_path: leaves it unset,
// names the orders' own schema, or goes through a pooler that drops it
// (PgBouncer with ignore_startup_parameters = search_path), and behind
// PgBouncer in transaction mode, which refuses it as a startup parameter.
func TestGatewayRecordsStayInGatewaySchema(t *testing.T) {
	const shop = "shop" // an orders' schema named by the URL's search_path
	cases := []struct {
		name string
		// url returns the URL the service is given for the database db,
		// and the schema the orders' tables then live in.
		url func(t *testing.T, db string) (url, ordersSchema string)
	}{
		{"search_path unset", func(t *testing.T, db string) (string, string) {
			return db, "public"
		}},
		{"search_path names the orders' schema", func(t *testing.T, db string) (string, string) {
			pgExec(t, db, "CREATE SCHEMA "+shop)
			return withURLQuery(t, db, "search_path", shop), shop
		}},
		{"search_path dropped by a pooler", func(t *testing.T, db string) (string, string) {
			return dropSearchPath(t, withURLQuery(t, db, "search_path", shop)), "public"
		}},
		{"pgbouncer in transaction mode", func(t *testing.T, db string) (string, string) {
			b := pgtest.NewBouncer(t)
			u, err := neturl.Parse(db)
			if err != nil {
				t.Fatal(err)
			}
			return b.URL(strings.TrimPrefix(u.Path, "/")), "public"
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			db := pgtest.Database(t)
			url, ordersSchema := tc.url(t, db)
			gatewayRecordsStayInGatewaySchema(t, db, url, ordersSchema)
		})
	}
}

// TestGatewayRefusesTheOrdersSchema: when the orders' tables are in the
// in-process gateway's schema (the URL's search_path names it), the
// gateway does not open, rather than mix its records with the orders'.
func TestGatewayRefusesTheOrdersSchema(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := pgtest.Database(t)
	pgExec(t, db, "CREATE SCHEMA "+payments.DefaultSchema)
	be, err := openPostgres(ctx, withURLQuery(t, db, "search_path", payments.DefaultSchema), 30*time.Second)
	if err != nil {
		t.Fatalf("opening the orders' database: %v", err)
	}
	defer be.close()
	_, _, err = newPayer(ctx, &Config{PaymentsKey: "sk_test_local", KeyTTL: time.Hour}, be)
	if err == nil || !strings.Contains(err.Error(), "--payments-url") {
		t.Fatalf("opening the in-process gateway in the orders' schema: %v; want an error that names --payments-url", err)
	}
}

// gatewayRecordsStayInGatewaySchema runs the service's backend and its
// in-process gateway on url, pays, replays and refunds, leaves a gateway
// request abandoned, and checks where everything landed on db (a direct
// URL of the same database).
func gatewayRecordsStayInGatewaySchema(t *testing.T, db, url, ordersSchema string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	be, err := openPostgres(ctx, url, 30*time.Second)
	if err != nil {
		t.Fatalf("opening the orders' database: %v", err)
	}
	defer be.close()
	p, _, err := newPayer(ctx, &Config{PaymentsKey: "sk_test_local", KeyTTL: time.Hour}, be)
	if err != nil {
		t.Fatalf("opening the in-process gateway: %v", err)
	}

	pay := orders.PaymentRequest{Amount: 1299, Currency: "EUR", IdempotencyKey: "gw-pay", OrderRef: "ord_gw"}
	paid, err := p.Pay(ctx, pay)
	if err != nil {
		t.Fatalf("paying: %v", err)
	}
	if again, err := p.Pay(ctx, pay); err != nil || again.ID != paid.ID {
		t.Fatalf("paying again with the same key: %+v, %v; want %s replayed", again, err, paid.ID)
	}
	if err := p.Refund(ctx, orders.RefundRequest{PaymentID: paid.ID, IdempotencyKey: "gw-refund"}); err != nil {
		t.Fatalf("refunding: %v", err)
	}

	// A gateway request that never finished: no answer, its lease over.
	gst, _, err := be.gateway(ctx)
	if err != nil {
		t.Fatalf("opening the gateway's store: %v", err)
	}
	if _, err := gst.Claim(ctx, idemdriver.ClaimParams{
		User: payments.AccountFor("sk_test_local"), Key: "gw-abandoned", Fingerprint: "gw-abandoned", Owner: idemdriver.NewOwner(),
		Method: "POST", Path: "/v1/payment_intents", Body: []byte("amount=1&currency=eur"),
		Lease: time.Millisecond, TTL: time.Hour,
	}); err != nil {
		t.Fatalf("claiming a gateway key: %v", err)
	}
	listed := func(sw idemdriver.Sweeper) []string {
		t.Helper()
		recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 100})
		if err != nil {
			t.Fatalf("listing abandoned records: %v", err)
		}
		var keys []string
		for _, r := range recs {
			keys = append(keys, r.User+"/"+r.Key)
		}
		return keys
	}
	gwSweeper, ok := gst.(idemdriver.Sweeper)
	if !ok {
		t.Fatalf("the gateway's store %T is not an idemdriver.Sweeper", gst)
	}
	var gwListed []string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		if gwListed = listed(gwSweeper); slices.Contains(gwListed, payments.AccountFor("sk_test_local")+"/gw-abandoned") {
			break
		}
		time.Sleep(10 * time.Millisecond) // a poll with a deadline: the lease is a millisecond
	}
	if !slices.Contains(gwListed, payments.AccountFor("sk_test_local")+"/gw-abandoned") {
		t.Fatalf("the gateway's store lists %q as abandoned; want its own abandoned key", gwListed)
	}
	if got := listed(be.sweeper); len(got) != 0 {
		t.Errorf("the orders' store lists %q as abandoned for its completer; want none (they are the gateway's)", got)
	}

	gw := payments.DefaultSchema
	for _, c := range []struct {
		what, query string
		want        int
	}{
		{"payment_intents or refunds tables outside the gateway's schema",
			`SELECT count(*) FROM pg_tables WHERE tablename IN ('payment_intents', 'refunds') AND schemaname <> '` + gw + `'`, 0},
		{"idempotency_keys tables outside the gateway's and the orders' schemas",
			`SELECT count(*) FROM pg_tables WHERE tablename = 'idempotency_keys' AND schemaname NOT IN ('` + gw + `', '` + ordersSchema + `')`, 0},
		{"idempotency records in the orders' schema", `SELECT count(*) FROM ` + ordersSchema + `.idempotency_keys`, 0},
		{"the gateway's PaymentIntents", `SELECT count(*) FROM ` + gw + `.payment_intents`, 1},
		{"the gateway's refunds", `SELECT count(*) FROM ` + gw + `.refunds`, 1},
		{"the gateway's idempotency records", `SELECT count(*) FROM ` + gw + `.idempotency_keys`, 3},
	} {
		if got := countRows(t, db, c.query); got != c.want {
			t.Errorf("%s: %d, want %d", c.what, got, c.want)
		}
	}
}

// dropSearchPath returns a URL of the server dbURL names, through a proxy
// that forwards each connection's startup message without its
// search_path, as PgBouncer does with ignore_startup_parameters =
// search_path: the session then has the server's default search_path,
// whatever the client asked for. The proxy stops when t ends.
func dropSearchPath(t *testing.T, dbURL string) string {
	t.Helper()
	u, err := neturl.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	server := u.Host
	if u.Port() == "" {
		server = net.JoinHostPort(u.Hostname(), "5432")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex // guards conns and closed
		conns  []net.Conn
		closed bool
		wg     sync.WaitGroup
	)
	// track keeps c to be closed when t ends; false once it ended (c closed).
	track := func(c net.Conn) bool {
		mu.Lock()
		defer mu.Unlock()
		if closed {
			c.Close()
			return false
		}
		conns = append(conns, c)
		return true
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil || !track(c) {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				proxyWithoutSearchPath(c, server, track)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		closed = true
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	u.Host = ln.Addr().String()
	q := u.Query()
	q.Set("sslmode", "disable") // the proxy reads the startup message in clear
	u.RawQuery = q.Encode()
	return u.String()
}

// Codes of the PostgreSQL protocol's messages that come before a startup
// message, or instead of one.
const (
	pgSSLRequest    = 80877103
	pgGSSENCRequest = 80877104
	pgCancelRequest = 80877102
)

// proxyWithoutSearchPath serves one client connection: it refuses
// encryption, forwards the startup message without search_path to server,
// then copies both ways until either side ends.
func proxyWithoutSearchPath(client net.Conn, server string, track func(net.Conn) bool) {
	defer client.Close()
	var first []byte
	for first == nil {
		var head [8]byte // length, then protocol version or request code
		if _, err := io.ReadFull(client, head[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(head[:4])
		if n < 8 || n > 1<<16 {
			return
		}
		body := make([]byte, n-8)
		if _, err := io.ReadFull(client, body); err != nil {
			return
		}
		switch binary.BigEndian.Uint32(head[4:]) {
		case pgSSLRequest, pgGSSENCRequest:
			if _, err := client.Write([]byte{'N'}); err != nil {
				return
			}
		case pgCancelRequest:
			first = append(head[:], body...)
		default:
			first = startupWithout(head[4:], body, "search_path")
		}
	}
	srv, err := net.Dial("tcp", server)
	if err != nil || !track(srv) {
		return
	}
	defer srv.Close()
	if _, err := srv.Write(first); err != nil {
		return
	}
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(srv, client); done <- struct{}{} }()
	go func() { _, _ = io.Copy(client, srv); done <- struct{}{} }()
	<-done
	client.Close()
	srv.Close()
	<-done
}

// startupWithout returns a startup message of protocol version and the
// parameters params (name, NUL, value, NUL, …, NUL) without drop.
func startupWithout(version, params []byte, drop string) []byte {
	msg := append([]byte{0, 0, 0, 0}, version...)
	fields := bytes.Split(params, []byte{0})
	for i := 0; i+1 < len(fields) && len(fields[i]) > 0; i += 2 {
		if string(fields[i]) == drop {
			continue
		}
		msg = append(msg, fields[i]...)
		msg = append(msg, 0)
		msg = append(msg, fields[i+1]...)
		msg = append(msg, 0)
	}
	msg = append(msg, 0)
	binary.BigEndian.PutUint32(msg, uint32(len(msg)))
	return msg
}
