// Package natsembed runs a NATS server with JetStream inside the process:
// the order service's default broker when no external NATS is configured,
// and the tests' throwaway server. It listens on a loopback address only,
// keeps its JetStream files in one directory (a restart on the same
// directory keeps streams, messages and consumers) and holds a lock on that
// directory so that a second server cannot use the same files at once.
// With Options.Token set it refuses every client that does not give that
// token (nats.Token); LoadOrCreateToken keeps one in a file of its owner's.
package natsembed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// DefaultReadyTimeout is how long Start waits for the server to accept
// connections when Options.ReadyTimeout is zero.
const DefaultReadyTimeout = 10 * time.Second

// ErrDirInUse is returned by Start when another server (in this process or
// another one) holds the lock on Options.Dir.
var ErrDirInUse = errors.New("natsembed: the JetStream directory is in use by another server")

// Options configure Start.
type Options struct {
	// Dir is the JetStream store directory (created with mode 0700 when
	// missing); required. A server started again on the same Dir finds the
	// streams, messages and consumers it had.
	Dir string
	// Host is the address to listen on; it must be a loopback address or
	// "localhost". Default "127.0.0.1".
	Host string
	// Port is the client port; 0 picks a free one at random.
	Port int
	// Logger receives the server's notices, warnings and errors (debug
	// lines too when the logger is enabled for slog.LevelDebug). Nil: the
	// server logs nothing; a failure to start is still returned by Start.
	Logger *slog.Logger
	// ReadyTimeout bounds the wait for the server to accept connections.
	// Zero: DefaultReadyTimeout.
	ReadyTimeout time.Duration
	// Token, when set, is the secret every client must give (nats.Token)
	// to connect: the server refuses any other client, before it may
	// publish, subscribe or reach the JetStream API. Empty: any process
	// that reaches the loopback address may connect.
	Token string
}

// Server is a running embedded NATS server.
type Server struct {
	ns       *server.Server
	unlock   func()
	shutdown sync.Once
}

// Start runs a NATS server with JetStream in this process and returns once
// it accepts connections, or an error (the server stopped again) when it
// does not within Options.ReadyTimeout, cannot lock or create Dir, or
// cannot enable JetStream.
func Start(o Options) (*Server, error) {
	if o.Dir == "" {
		return nil, errors.New("natsembed: Options.Dir is required")
	}
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if !isLoopback(o.Host) {
		return nil, fmt.Errorf("natsembed: host %q is not a loopback address", o.Host)
	}
	if o.Port < 0 || o.Port > 65535 {
		return nil, fmt.Errorf("natsembed: port %d out of range", o.Port)
	}
	if o.ReadyTimeout <= 0 {
		o.ReadyTimeout = DefaultReadyTimeout
	}
	dir, err := filepath.Abs(o.Dir)
	if err != nil {
		return nil, fmt.Errorf("natsembed: store dir %q: %w", o.Dir, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("natsembed: store dir: %w", err)
	}
	unlock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}

	port := o.Port
	if port == 0 {
		port = server.RANDOM_PORT
	}
	opts := &server.Options{
		Host:      o.Host,
		Port:      port,
		JetStream: true,
		StoreDir:  dir,
		NoSigs:    true,
		// No monitoring port, cluster, gateway or leaf node listener: the
		// client port on the loopback address is the only one.
		HTTPPort: 0,
	}
	if o.Token != "" {
		if err := checkToken(o.Token); err != nil {
			unlock()
			return nil, err
		}
		opts.Authorization = o.Token
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		unlock()
		return nil, fmt.Errorf("natsembed: %w", err)
	}
	lg := &logger{slog: o.Logger, fatal: make(chan string, 1)}
	debug := o.Logger != nil && o.Logger.Enabled(context.Background(), slog.LevelDebug)
	ns.SetLoggerV2(lg, debug, false, false)
	ns.Start()

	s := &Server{ns: ns, unlock: unlock}
	if err := s.waitReady(lg, o.ReadyTimeout); err != nil {
		s.Shutdown()
		return nil, err
	}
	return s, nil
}

// waitReady polls the server until it accepts connections with JetStream
// on, a fatal error is logged, or timeout passes.
func (s *Server) waitReady(lg *logger, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		select {
		case msg := <-lg.fatal:
			return fmt.Errorf("natsembed: server failed to start: %s", msg)
		default:
		}
		if s.ns.ReadyForConnections(50 * time.Millisecond) {
			if !s.ns.JetStreamEnabled() {
				select {
				case msg := <-lg.fatal:
					return fmt.Errorf("natsembed: server failed to start: %s", msg)
				default:
				}
				return errors.New("natsembed: server started without JetStream")
			}
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("natsembed: server not ready for connections after %v", timeout)
		}
	}
}

// URL is the client URL, nats://host:port.
func (s *Server) URL() string {
	return s.ns.ClientURL()
}

// Shutdown stops the server, waits until it has stopped (streams flushed to
// disk, listeners closed) and releases the directory's lock. It is safe to
// call more than once.
func (s *Server) Shutdown() {
	s.shutdown.Do(func() {
		s.ns.Shutdown()
		s.ns.WaitForShutdown()
		s.unlock()
	})
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// logger adapts the server's Logger to slog, and hands the first fatal
// message to Start (a nil slog: it is the only thing kept).
type logger struct {
	slog  *slog.Logger
	fatal chan string
}

func (l *logger) log(level slog.Level, format string, v []any) {
	if l.slog != nil {
		l.slog.Log(context.Background(), level, "nats-server: "+fmt.Sprintf(format, v...))
	}
}

func (l *logger) Noticef(format string, v ...any) { l.log(slog.LevelInfo, format, v) }
func (l *logger) Warnf(format string, v ...any)   { l.log(slog.LevelWarn, format, v) }
func (l *logger) Errorf(format string, v ...any)  { l.log(slog.LevelError, format, v) }
func (l *logger) Debugf(format string, v ...any)  { l.log(slog.LevelDebug, format, v) }
func (l *logger) Tracef(format string, v ...any)  { l.log(slog.LevelDebug, format, v) }

// Fatalf logs at error level and reports the message to Start; unlike the
// server's own loggers it never exits the process.
func (l *logger) Fatalf(format string, v ...any) {
	l.log(slog.LevelError, format, v)
	select {
	case l.fatal <- fmt.Sprintf(format, v...):
	default:
	}
}
