package payments

import (
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/iso4217"
)

// Limits of the gateway's API parameters, close to Stripe's. A request
// beyond one is refused with 400 invalid_request_error, code
// parameter_invalid_integer (an integer out of range or not an integer) or
// parameter_invalid_string (a string too long, empty where a value is
// needed, not UTF-8, with a NUL, or not one of the allowed values), and
// "param" naming the parameter; nothing is charged or refunded and the
// idempotency key stays free. A parameter the gateway does not know is
// refused with code parameter_unknown, and one given twice with
// parameter_invalid_string (or _integer).
//
// POST /v1/payment_intents:
//
//	amount                                  integer, MinAmount..MaxAmount (minor units)
//	currency                                one of the ISO 4217 codes in Currencies, any case (answered in lower case)
//	confirm                                 "true" (this gateway only confirms at once)
//	payment_method                          at most MaxStringLen characters, a test payment method
//	description                             optional, at most MaxDescriptionLen characters
//	metadata[KEY]                           at most MaxMetadataKeys keys, KEY at most MaxMetadataKeyLen characters
//	                                        without "[" or "]", value at most MaxMetadataValueLen characters
//	                                        (an empty value sets nothing); "metadata" alone must be empty
//	automatic_payment_methods[enabled]      "true" or "false" (accepted and ignored)
//	automatic_payment_methods[allow_redirects] "always" or "never" (accepted and ignored)
//	expand[] or expand[N]                   at most MaxExpand entries of at most MaxStringLen characters
//	                                        (accepted and ignored: nothing expands)
//
// POST /v1/refunds:
//
//	payment_intent   at most MaxStringLen characters
//	amount           optional, integer MinAmount..MaxAmount; absent: all that is not refunded yet
//	reason           optional, duplicate, fraudulent or requested_by_customer
//	metadata[KEY]    as above
//	expand[]         as above
//
// GET /v1/payment_intents and GET /v1/refunds:
//
//	limit                          integer 1..MaxListLimit, default DefaultListLimit
//	starting_after, ending_before  at most MaxStringLen characters, at most one of them
//	payment_intent (refunds only)  at most MaxStringLen characters
//	expand[]                       as above
//
// Characters are Unicode code points of valid UTF-8; NUL is refused
// everywhere, as PostgreSQL cannot keep it. With these limits the largest
// valid answer (see maxAnswerBytes) is far below MaxStoredAnswer, so every
// valid answer is stored and replayed, and the largest valid request below
// the middleware's request limit.
const (
	MinAmount           = 1
	MaxAmount           = 99_999_999
	MaxDescriptionLen   = 1000
	MaxMetadataKeys     = 50
	MaxMetadataKeyLen   = 40
	MaxMetadataValueLen = 500
	MaxStringLen        = 255
	MaxExpand           = 10

	// MaxStoredAnswer is the largest answer the gateway's idempotency
	// layer stores for replay (idem.Options.MaxStoredBody).
	MaxStoredAnswer = idem.DefaultMaxStoredBody
	// MaxRequestBody is the largest request body the gateway reads.
	MaxRequestBody = idem.DefaultMaxRequestBody
)

// Error codes of invalid parameters, as Stripe names them.
const (
	codeMissing        = "parameter_missing"
	codeUnknown        = "parameter_unknown"
	codeInvalidString  = "parameter_invalid_string"
	codeInvalidInteger = "parameter_invalid_integer"
)

// Currencies are the ISO 4217 codes the gateway accepts, in lower case as
// Stripe writes them: those of package iso4217, which the order service
// accepts too.
var Currencies = func() []string {
	cs := iso4217.Codes()
	for i, c := range cs {
		cs[i] = strings.ToLower(c)
	}
	return cs
}()

// IsCurrency reports whether c is an ISO 4217 code in Currencies, in any
// case.
func IsCurrency(c string) bool { return iso4217.Is(strings.ToUpper(c)) }

// paramError is a 400 invalid_request_error about one parameter.
type paramError struct {
	param, code, msg string
}

func (e *paramError) Error() string { return e.msg }

// params reads a request's form parameters, each at most once, and
// refuses those it was not asked about.
type params struct {
	v    url.Values
	seen map[string]bool
}

func newParams(v url.Values) *params { return &params{v: v, seen: map[string]bool{}} }

// one returns the only value of name, and whether it was given. A value
// given twice is an error.
func (p *params) one(name, code string) (string, bool, error) {
	p.seen[name] = true
	vs, ok := p.v[name]
	switch {
	case !ok:
		return "", false, nil
	case len(vs) > 1:
		return "", false, &paramError{name, code, fmt.Sprintf("Received more than one value for %s.", name)}
	}
	return vs[0], true, nil
}

// str returns name's value, refusing one of more than maxLen characters
// and one that no ledger can keep.
func (p *params) str(name string, maxLen int) (string, bool, error) {
	s, ok, err := p.one(name, codeInvalidString)
	if err != nil || !ok {
		return "", ok, err
	}
	if err := checkString(name, s, maxLen); err != nil {
		return "", false, err
	}
	return s, true, nil
}

// required is str for a parameter that must be given, and not empty.
func (p *params) required(name string, maxLen int) (string, error) {
	s, ok, err := p.str(name, maxLen)
	switch {
	case err != nil:
		return "", err
	case !ok:
		return "", &paramError{name, codeMissing, "Missing required param: " + name + "."}
	case s == "":
		return "", &paramError{name, codeInvalidString, "Invalid " + name + ": must not be empty."}
	}
	return s, nil
}

// oneOf returns name's value, which must be one of allowed.
func (p *params) oneOf(name string, allowed ...string) (string, bool, error) {
	s, ok, err := p.str(name, MaxStringLen)
	if err != nil || !ok {
		return "", ok, err
	}
	if !slices.Contains(allowed, s) {
		return "", false, &paramError{name, codeInvalidString, fmt.Sprintf("Invalid %s: must be one of %s.", name, strings.Join(allowed, ", "))}
	}
	return s, true, nil
}

// integer returns name's value as an integer within lo..hi.
func (p *params) integer(name string, lo, hi int64) (int64, bool, error) {
	s, ok, err := p.one(name, codeInvalidInteger)
	if err != nil || !ok {
		return 0, ok, err
	}
	n, err := strconv.ParseInt(s, 10, 64)
	switch {
	case err != nil:
		return 0, false, &paramError{name, codeInvalidInteger, "Invalid integer: " + truncate(s, 40)}
	case n < lo:
		return 0, false, &paramError{name, codeInvalidInteger, fmt.Sprintf("This value must be greater than or equal to %d.", lo)}
	case n > hi:
		return 0, false, &paramError{name, codeInvalidInteger, fmt.Sprintf("This value must be less than or equal to %d.", hi)}
	}
	return n, true, nil
}

// metadata reads the metadata[KEY] parameters: the entries with a value.
func (p *params) metadata() (map[string]string, error) {
	md := map[string]string{}
	keys := 0
	for _, name := range sortedNames(p.v) {
		if name == "metadata" {
			// metadata= (empty) clears metadata: nothing to clear on
			// create.
			if _, _, err := p.str(name, 0); err != nil {
				return nil, &paramError{name, codeInvalidString, "Invalid metadata: give metadata itself only an empty value; set keys as metadata[KEY]."}
			}
			continue
		}
		k, ok := strings.CutPrefix(name, "metadata[")
		if !ok {
			continue
		}
		k, ok = strings.CutSuffix(k, "]")
		if !ok || k == "" || strings.ContainsAny(k, "[]") {
			return nil, &paramError{name, codeUnknown, fmt.Sprintf("Invalid metadata key: %q; set keys as metadata[KEY], KEY without square brackets.", truncate(name, 60))}
		}
		if err := checkString(name, k, MaxMetadataKeyLen); err != nil {
			err.msg = fmt.Sprintf("Invalid metadata key: keys are UTF-8 text of at most %d characters without NUL.", MaxMetadataKeyLen)
			return nil, err
		}
		val, _, err := p.str(name, MaxMetadataValueLen)
		if err != nil {
			return nil, err
		}
		if keys++; keys > MaxMetadataKeys {
			return nil, &paramError{"metadata", codeInvalidString, fmt.Sprintf("Invalid metadata: at most %d keys.", MaxMetadataKeys)}
		}
		if val != "" {
			md[k] = val
		}
	}
	return md, nil
}

// expandParam is expand[] or expand[N], as Stripe's clients send the
// entries of the expand list.
var expandParam = regexp.MustCompile(`^expand\[[0-9]{0,3}\]$`)

// expand accepts the expand list: this gateway's objects have nothing to
// expand, so it is checked and ignored.
func (p *params) expand() error {
	n := 0
	for _, name := range sortedNames(p.v) {
		if !expandParam.MatchString(name) {
			continue
		}
		p.seen[name] = true
		for _, s := range p.v[name] {
			if n++; n > MaxExpand {
				return &paramError{"expand", codeInvalidString, fmt.Sprintf("Invalid expand: at most %d entries.", MaxExpand)}
			}
			if err := checkString(name, s, MaxStringLen); err != nil {
				return err
			}
		}
	}
	return nil
}

// unknown refuses the first parameter that was not read.
func (p *params) unknown() error {
	for _, name := range sortedNames(p.v) {
		if p.seen[name] {
			continue
		}
		return &paramError{truncate(name, MaxStringLen), codeUnknown, fmt.Sprintf("Received unknown parameter: %s", truncate(name, MaxStringLen))}
	}
	return nil
}

func sortedNames(v url.Values) []string {
	names := make([]string, 0, len(v))
	for k := range v {
		names = append(names, k)
	}
	slices.Sort(names)
	return names
}

// checkString refuses s unless it is storable text of at most maxLen
// characters.
func checkString(name, s string, maxLen int) *paramError {
	switch {
	case !storable(s):
		return &paramError{name, codeInvalidString, "Invalid string: " + name + " must be UTF-8 text without NUL characters."}
	case utf8.RuneCountInString(s) > maxLen:
		return &paramError{name, codeInvalidString, fmt.Sprintf("Invalid string: %s must be at most %d characters long.", name, maxLen)}
	}
	return nil
}

// storable reports whether s is text that every ledger keeps as it is:
// valid UTF-8 without NUL, which PostgreSQL's text and jsonb refuse.
func storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// truncate shortens s to at most n bytes, on a character boundary, for
// an error message.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}
