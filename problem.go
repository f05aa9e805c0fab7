package idem

import (
	"errors"
	"net/http"

	"github.com/idem-go/idem/problem"
)

// ProblemFor maps the middleware's errors to problem details (package
// problem names their types). An error of none of its kinds is
// problem.Internal (500).
func ProblemFor(err error) problem.Details {
	switch {
	case errors.Is(err, ErrKeyMissing):
		return problem.Details{Type: problem.KeyMissing, Title: "Idempotency-Key required", Status: http.StatusBadRequest, Detail: "This request must carry an Idempotency-Key header."}
	case errors.Is(err, ErrKeyInvalid):
		return problem.Details{Type: problem.KeyInvalid, Title: "Invalid Idempotency-Key", Status: http.StatusBadRequest, Detail: err.Error()}
	case errors.Is(err, ErrFingerprintMismatch):
		return problem.Details{Type: problem.KeyMismatch, Title: "Idempotency-Key reused with a different request", Status: http.StatusUnprocessableEntity, Detail: "This key was first used with another method, path, query or body; use a new key for a new request."}
	case errors.Is(err, ErrInFlight), errors.Is(err, ErrFenced):
		return problem.Details{Type: problem.InFlight, Title: "Request with this Idempotency-Key in flight", Status: http.StatusConflict, Detail: "Another request with this key is still being processed; retry later with the same key."}
	case errors.Is(err, ErrBadTarget):
		return problem.Details{Type: problem.BadTarget, Title: "Request target invalid", Status: http.StatusBadRequest, Detail: "The path or query holds bytes that are not UTF-8; percent-encode them."}
	case errors.Is(err, ErrBadBody):
		return problem.Details{Type: problem.BadBody, Title: "Request body unreadable", Status: http.StatusBadRequest, Detail: err.Error()}
	case errors.Is(err, ErrRequestTooLarge):
		return problem.Details{Type: problem.RequestTooLarge, Title: "Request body too large", Status: http.StatusRequestEntityTooLarge, Detail: err.Error()}
	case errors.Is(err, ErrNotDue):
		return problem.Details{Type: problem.NotDue, Title: "Re-drive not due", Status: http.StatusPreconditionFailed, Detail: "The completer's re-drive found its operation answered, replaced, gone, or not due yet; nothing was run."}
	case errors.Is(err, ErrStoreUnavailable):
		return problem.Details{Type: problem.StoreUnavailable, Title: "Idempotency store unavailable", Status: http.StatusServiceUnavailable, Detail: "The request was not run; retry with the same key."}
	default:
		return problem.Details{Type: problem.Internal, Title: "Internal Server Error", Status: http.StatusInternalServerError, Detail: "The request failed; nothing was stored, and the same request may be retried with the same key."}
	}
}
