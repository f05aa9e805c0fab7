package rpcidem

import (
	"context"

	"github.com/idem-go/idem"
	"google.golang.org/protobuf/proto"
)

// Redrive returns the function with which an idem.Completer
// (CompleterOptions.Funcs[method]) finishes an abandoned call of method:
// run decodes the stored input (the request's deterministic encoding)
// and calls the handler with it, and its answer becomes the output that
// Serve's run of the handler would have stored, through the same
// function (outcome): the same bytes, which a retry of the call then
// replays through either interceptor. A code that s.Stored leaves
// retryable, and an answer outcome cannot store, are the function's
// error: idem.Do rolls the handler's writes back and the key stays
// retryable, as after a call's run.
//
// Only s.Protocol, s.Stored and s.Logger are used: the completer's own
// options (CompleterOptions.Middleware) give the re-drive's lease and
// TTL, and the record gives its user and key.
func (s *Server) Redrive(method string, newResp func() proto.Message, run func(ctx context.Context, input []byte) (msg any, err error)) idem.DoFunc {
	return func(ctx context.Context, input []byte) ([]byte, error) {
		msg, herr := run(ctx, input)
		out, _, err := s.outcome(method, newResp, msg, herr)
		return out, err
	}
}
