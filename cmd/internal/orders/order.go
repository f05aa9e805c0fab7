package orders

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idem-go/idem"
)

// Limits on a new order. Everything the database or the gateway would
// refuse is refused first, with 400, before anyone is charged.
const (
	// MaxBody is the largest request body accepted, in bytes.
	MaxBody = 1 << 20
	// MaxItems is the largest number of items in one order.
	MaxItems = 100
	// MaxSKU is the longest sku, in characters (Unicode code points). A
	// sku holds no control character (unicode.IsControl: NUL, the C0 and
	// C1 controls and DEL).
	MaxSKU = 64
	// MaxQuantity is the largest quantity of one item.
	MaxQuantity = 1000
	// MaxTotal is the largest order total, in minor units: the largest
	// amount the payment gateway takes, as Stripe's.
	MaxTotal = 99_999_999
)

// StatusPaid is the status of an order whose payment succeeded; orders are
// created only once paid.
const StatusPaid = "paid"

// Order is a paid order.
type Order struct {
	ID        string    `json:"id"`
	UserID    string    `json:"user_id"`
	Status    string    `json:"status"`
	Items     []Item    `json:"items"`
	Total     int64     `json:"total"`
	Currency  string    `json:"currency"`
	PaymentID string    `json:"payment_id"`
	CreatedAt time.Time `json:"created_at"`

	// IdempotencyKey is the key of the request that created the order,
	// empty for an unprotected request. Repositories keep it so that one
	// key can never make two orders; it is not shown to clients.
	IdempotencyKey string `json:"-"`
	// KeyCreatedAt is when the idempotency record behind IdempotencyKey was
	// created. A key that expired starts a new operation, so (user, key,
	// KeyCreatedAt) is what names one operation.
	KeyCreatedAt time.Time `json:"-"`
	// EventAdded is true for an order whose orders.created event was added
	// to the outbox: with the order (every order Create writes), or later
	// by BackfillEvents. An order an older binary wrote has none yet; an
	// audit that finds no event of a marked order in the outbox knows it
	// was sent, then deleted (outbox.Sweeper). It is not shown to clients.
	EventAdded bool `json:"-"`
}

// Item is one line of an order. UnitPrice is in minor units.
type Item struct {
	SKU       string `json:"sku"`
	Quantity  int64  `json:"quantity"`
	UnitPrice int64  `json:"unit_price"`
}

// CreateRequest is the body of POST /v1/orders.
type CreateRequest struct {
	Items    []Item `json:"items"`
	Currency string `json:"currency"`
}

// FieldError is one invalid member of a request body. Pointer is an RFC 6901
// JSON Pointer to it.
type FieldError struct {
	Pointer string `json:"pointer"`
	Detail  string `json:"detail"`
}

// ValidationError lists what is wrong with a request body.
type ValidationError struct {
	Fields []FieldError
}

func (e *ValidationError) Error() string {
	if len(e.Fields) == 0 {
		return "invalid request"
	}
	msg := e.Fields[0].Detail
	if n := len(e.Fields) - 1; n > 0 {
		msg += fmt.Sprintf(" (and %d more)", n)
	}
	return msg
}

// errBodyTooLarge reports a body over MaxBody.
var errBodyTooLarge = errors.New("request body too large")

// decodeCreate reads and validates a CreateRequest. It returns
// errBodyTooLarge, a *ValidationError, or another error whose text is a
// useful detail for a 400.
func decodeCreate(body io.Reader) (CreateRequest, int64, error) {
	var req CreateRequest
	raw, err := io.ReadAll(body)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return req, 0, errBodyTooLarge
		}
		return req, 0, fmt.Errorf("the request body could not be read: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, 0, decodeError(err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return req, 0, errors.New("the request body must hold one JSON object and nothing after it")
	}
	// encoding/json reads invalid UTF-8 as U+FFFD and lets the last of two
	// members whose names differ only in case win: refuse both, so that
	// what is paid for is what the client sent, read one way only.
	if !utf8.Valid(raw) {
		return req, 0, errors.New("the request body is not valid UTF-8")
	}
	if err := idem.CheckMemberNames(raw); err != nil {
		return req, 0, err
	}
	total, err := req.Validate()
	return req, total, err
}

func decodeError(err error) error {
	var (
		mbe *http.MaxBytesError
		se  *json.SyntaxError
		te  *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &mbe):
		return errBodyTooLarge
	case errors.Is(err, io.EOF):
		return errors.New("the request body is empty; it must be a JSON object")
	case errors.Is(err, io.ErrUnexpectedEOF):
		return errors.New("the request body is not valid JSON: it ends too early")
	case errors.As(err, &se):
		return fmt.Errorf("the request body is not valid JSON: %v (at byte %d)", se, se.Offset)
	case errors.As(err, &te):
		if te.Field == "" {
			return fmt.Errorf("the request body must be a JSON object, not %s", te.Value)
		}
		return fmt.Errorf("%s must be %s, not %s", te.Field, jsonKind(te.Type.Kind().String()), te.Value)
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return fmt.Errorf("unknown field %s", strings.TrimPrefix(err.Error(), "json: unknown field "))
	default:
		return fmt.Errorf("the request body is not valid: %v", err)
	}
}

func jsonKind(goKind string) string {
	switch goKind {
	case "int64", "int":
		return "an integer"
	case "string":
		return "a string"
	case "slice":
		return "an array"
	case "struct":
		return "an object"
	default:
		return "a " + goKind
	}
}

// Validate checks r against the limits above and returns the order total.
func (r CreateRequest) Validate() (int64, error) {
	var errs []FieldError
	add := func(ptr, format string, args ...any) {
		errs = append(errs, FieldError{Pointer: ptr, Detail: fmt.Sprintf(format, args...)})
	}
	switch n := len(r.Items); {
	case n == 0:
		add("/items", "items must hold at least one item")
	case n > MaxItems:
		add("/items", "items must hold at most %d items, not %d", MaxItems, n)
	}
	var total int64
	overflow := false
	for i, it := range r.Items {
		if i >= MaxItems {
			break // refused above; one error is enough
		}
		p := fmt.Sprintf("/items/%d", i)
		ok := true
		if d := skuProblem(it.SKU); d != "" {
			add(p+"/sku", "items[%d].sku %s", i, d)
		}
		if it.Quantity < 1 || it.Quantity > MaxQuantity {
			add(p+"/quantity", "items[%d].quantity must be between 1 and %d, not %d", i, MaxQuantity, it.Quantity)
			ok = false
		}
		if it.UnitPrice <= 0 {
			add(p+"/unit_price", "items[%d].unit_price must be greater than 0 (minor units), not %d", i, it.UnitPrice)
			ok = false
		}
		if !ok || overflow {
			continue
		}
		// Quantity <= 1000 and UnitPrice <= MaxTotal keep the product and
		// the running sum far below 2^63.
		if it.UnitPrice > MaxTotal {
			overflow = true
			continue
		}
		total += it.Quantity * it.UnitPrice
		if total > MaxTotal {
			overflow = true
		}
	}
	if overflow {
		add("/items", "the order total must not exceed %d (minor units)", MaxTotal)
	}
	if !IsCurrency(r.Currency) {
		add("/currency", "currency must be an active ISO 4217 code in capitals (three capital letters, such as EUR), not %q", r.Currency)
	}
	if len(errs) > 0 {
		return 0, &ValidationError{Fields: errs}
	}
	return total, nil
}

// skuProblem returns what is wrong with sku ("must …"), or "".
func skuProblem(sku string) string {
	if !utf8.ValidString(sku) {
		return "must be valid UTF-8"
	}
	n := 0
	for _, r := range sku {
		if unicode.IsControl(r) {
			return fmt.Sprintf("must not hold a control character (it holds %U)", r)
		}
		n++
	}
	switch {
	case n == 0:
		return "must not be empty"
	case n > MaxSKU:
		return fmt.Sprintf("must be at most %d characters, not %d", MaxSKU, n)
	case strings.TrimSpace(sku) == "":
		return "must not be blank"
	}
	return ""
}

// marshalJSON encodes v followed by a newline.
func marshalJSON(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}
