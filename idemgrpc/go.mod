module github.com/idem-go/idem/idemgrpc

go 1.26.0

toolchain go1.26.8

require (
	connectrpc.com/connect v1.21.1
	github.com/idem-go/idem v0.0.0-00010101000000-000000000000
	github.com/idem-go/idem/internal/pgtest v0.0.0-00010101000000-000000000000
	github.com/idem-go/idem/pgstore v0.0.0-00010101000000-000000000000
	github.com/idem-go/idem/redisfront v0.0.0-00010101000000-000000000000
	github.com/jackc/pgx/v5 v5.12.0
	github.com/redis/go-redis/v9 v9.23.0
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260928230214-8a89bd6388cc
	google.golang.org/grpc v1.83.2
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/idem-go/idem/internal/redistest v0.0.0-00010101000000-000000000000
	github.com/jackc/pgpassfile v1.0.0 // indirect
	github.com/jackc/pgservicefile v0.0.0-20240606120523-5a60cdf6a761 // indirect
	github.com/jackc/puddle/v2 v2.2.3 // indirect
	go.uber.org/atomic v1.12.0 // indirect
	golang.org/x/net v0.58.0 // indirect
	golang.org/x/sync v0.22.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.41.0 // indirect
)
