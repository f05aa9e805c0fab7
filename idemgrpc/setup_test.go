package idemgrpc_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/redistest"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// The test service: hand-written, without generated code, its messages
// well-known types. Create is opted in; Peek is not.
const (
	serviceName  = "idemgrpc.test.Orders"
	createMethod = "/" + serviceName + "/Create"
	peekMethod   = "/" + serviceName + "/Peek"
)

// service answers the test service's calls with handle, counting them.
type service struct {
	handle func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error)
	runs   atomic.Int64 // calls of handle
}

func (s *service) call(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
	s.runs.Add(1)
	return s.handle(ctx, req)
}

// unaryMethod is the grpc.MethodDesc of a method of service taking and
// answering a structpb.Struct.
func unaryMethod(name string) grpc.MethodDesc {
	full := "/" + serviceName + "/" + name
	return grpc.MethodDesc{
		MethodName: name,
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(structpb.Struct)
			if err := dec(in); err != nil {
				return nil, err
			}
			s := srv.(*service)
			if interceptor == nil {
				return s.call(ctx, in)
			}
			info := &grpc.UnaryServerInfo{Server: srv, FullMethod: full}
			return interceptor(ctx, in, info, func(ctx context.Context, req any) (any, error) {
				return s.call(ctx, req.(*structpb.Struct))
			})
		},
	}
}

var serviceDesc = grpc.ServiceDesc{
	ServiceName: serviceName,
	HandlerType: (*any)(nil),
	Methods:     []grpc.MethodDesc{unaryMethod("Create"), unaryMethod("Peek")},
	Metadata:    "setup_test.go",
}

// newStruct is Options.Methods' function for the test service.
func newStruct() proto.Message { return new(structpb.Struct) }

// testOptions are the interceptor's options of most tests: Create opted
// in, the user from the call's "x-user" metadata ("alice" without one).
func testOptions() idemgrpc.Options {
	return idemgrpc.Options{
		Methods: map[string]func() proto.Message{createMethod: newStruct},
		User: func(ctx context.Context) (string, error) {
			md, _ := metadata.FromIncomingContext(ctx)
			if u := md.Get("x-user"); len(u) == 1 {
				return u[0], nil
			}
			return "alice", nil
		},
	}
}

// serve starts a gRPC server of svc over a bufconn with interceptors
// (in order) and returns a client connection to it made with dialOpts;
// both stop when t ends.
func serve(t testing.TB, svc *service, interceptors []grpc.UnaryServerInterceptor, dialOpts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptors...))
	srv.RegisterService(&serviceDesc, svc)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	opts := append([]grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, dialOpts...)
	conn, err := grpc.NewClient("passthrough:///bufnet", opts...)
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		<-done
	})
	return conn
}

// result is what one Create call got.
type result struct {
	resp            *structpb.Struct
	header, trailer metadata.MD
	err             error
}

// replayed reports whether the answer carried idempotent-replayed: true.
func (r result) replayed() bool {
	v := r.header.Get(idemgrpc.ReplayedMetadata)
	return len(v) == 1 && v[0] == "true"
}

// create calls Create on conn with key (none if "") and req.
func create(ctx context.Context, conn *grpc.ClientConn, key string, req *structpb.Struct) result {
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.KeyMetadata, key)
	}
	var r result
	r.resp = new(structpb.Struct)
	r.err = conn.Invoke(ctx, createMethod, req, r.resp, grpc.Header(&r.header), grpc.Trailer(&r.trailer))
	if r.err != nil {
		r.resp = nil
	}
	return r
}

// mustStruct is structpb.NewStruct, which fails t on an error.
func mustStruct(t testing.TB, m map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// encode is m's deterministic encoding.
func encode(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// harness is a store with the handler's way to write through the call's
// transaction and the test's way to count what committed.
type harness struct {
	store idem.Store
	// write records name in the call's transaction (ctx the handler's).
	write func(ctx context.Context, name string) error
	// count returns how many writes of name committed.
	count func(t testing.TB, name string) int
}

// forEachStore runs f, as a subtest, on memstore, on pgstore
// (TEST_DATABASE_URL) and on redisfront in front of pgstore
// (TEST_DATABASE_URL and TEST_REDIS_URL). Without those variables the
// last two skip, except under CI=true, where they use the machine's
// servers and fail if those do not answer.
func forEachStore(t *testing.T, f func(t *testing.T, h harness)) {
	t.Run("memstore", func(t *testing.T) { f(t, memHarness(memstore.New(memstore.Options{}))) })
	t.Run("pgstore", func(t *testing.T) {
		pool := pgPool(t)
		f(t, pgHarness(pool, pgstore.New(pool, pgstore.Options{})))
	})
	t.Run("redisfront+pgstore", func(t *testing.T) {
		rdb := newRedis(t)
		pool := pgPool(t)
		s := redisfront.New(rdb, pgstore.New(pool, pgstore.Options{}), redisfront.Options{
			KeyPrefix: uniquePrefix(t, rdb),
			Timeout:   2 * time.Second, // a loaded CI machine
		})
		f(t, pgHarness(pool, s))
	})
}

// memHarness writes with memstore's OnCommit.
func memHarness(s idem.Store) harness {
	var mu sync.Mutex
	effects := map[string]int{}
	return harness{
		store: s,
		write: func(ctx context.Context, name string) error {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return err
			}
			tx.OnCommit(func() {
				mu.Lock()
				defer mu.Unlock()
				effects[name]++
			})
			return nil
		},
		count: func(_ testing.TB, name string) int {
			mu.Lock()
			defer mu.Unlock()
			return effects[name]
		},
	}
}

// pgPool returns a pool on a schema of t's own with pgstore's table and
// a table of the handler's writes, effects.
func pgPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.MaxConns(8))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("pgstore.Migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (name text NOT NULL)`); err != nil {
		t.Fatalf("creating effects: %v", err)
	}
	return pool
}

// pgHarness writes rows of effects through the call's pgx.Tx
// (pgstore.FromContext, which unwraps redisfront's transaction).
func pgHarness(pool *pgxpool.Pool, s idem.Store) harness {
	return harness{
		store: s,
		write: func(ctx context.Context, name string) error {
			tx, err := pgstore.FromContext(ctx)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name)
			return err
		},
		count: func(t testing.TB, name string) int {
			t.Helper()
			var n int
			if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM effects WHERE name = $1`, name).Scan(&n); err != nil {
				t.Fatalf("counting effects: %v", err)
			}
			return n
		},
	}
}

// newRedis returns a client of the tests' Redis (redistest.Client),
// closed when t ends.
func newRedis(t *testing.T) *redis.Client {
	t.Helper()
	return redistest.Client(t, "idemgrpc")
}

// uniquePrefix returns a key prefix of t's own (redistest.Prefix); its
// keys are deleted when t ends.
func uniquePrefix(t *testing.T, rdb *redis.Client) string {
	t.Helper()
	return redistest.Prefix(t, rdb, "idemgrpctest")
}

// downStore is a store whose claims fail, as a store that is down.
type downStore struct {
	idem.Store
}

var errDown = errors.New("connection refused")

func (downStore) Claim(context.Context, idemdriver.ClaimParams) (idemdriver.Claim, error) {
	return idemdriver.Claim{}, errDown
}
