package payments

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"unicode/utf8"
)

// Search: GET /v1/payment_intents/search, a subset of Stripe's Search API
// (https://docs.stripe.com/search) for PaymentIntents. The order service
// uses it to find the payment of an order whose earlier attempt may have
// paid after the gateway forgot that attempt's idempotency key.
//
// Parameters:
//
//	query    required, at most MaxSearchQueryLen characters, in the subset of
//	         Stripe's search query language below
//	limit    integer 1..MaxListLimit, default DefaultListLimit
//	page     optional: the next_page of the previous result. Stripe's page
//	         tokens are opaque; this gateway's is the id of the previous
//	         page's last PaymentIntent. One that names no PaymentIntent of
//	         the account is refused (400 parameter_invalid_string).
//	expand[] as for lists (accepted and ignored)
//
// The query language subset: one clause metadata['KEY']:'VALUE' (KEY a
// metadata key, at most MaxMetadataKeyLen characters without "[" or "]";
// VALUE at most MaxMetadataValueLen characters), and optionally one clause
// status:'STATUS' (STATUS one of the PaymentIntent statuses), in either
// order, separated by white space or by AND (any case), as at Stripe. A
// string is quoted with ' or "; inside it a backslash escapes the quote
// character or a backslash. Both clauses are exact matches, as Stripe's ":"
// operator is. Anything else (other fields, OR, negation "-", the "~", ">"
// or "<" operators, unquoted values, more than one clause of a kind) is
// refused with 400 invalid_request_error, code parameter_invalid_string,
// param "query", and nothing is searched.
//
// The answer is Stripe's search result object:
//
//	{"object":"search_result","data":[…],"has_more":…,"next_page":…,"url":"/v1/payment_intents/search"}
//
// data newest first (by the time each PaymentIntent was written, the id
// breaking ties), next_page null unless has_more. Unlike Stripe's, whose
// index lags its writes by up to about a minute, this gateway's search
// sees every committed PaymentIntent at once.

// MaxSearchQueryLen bounds the query parameter of a search: room for the
// longest metadata clause, every character of its value escaped, and a
// status clause.
const MaxSearchQueryLen = 2 * (MaxMetadataKeyLen + MaxMetadataValueLen + 64)

// PaymentIntentStatuses are the statuses of Stripe's PaymentIntent, which
// a search's status clause may name (this gateway only makes succeeded and
// requires_payment_method ones).
var PaymentIntentStatuses = []string{
	"requires_payment_method", "requires_confirmation", "requires_action",
	"processing", "requires_capture", "canceled", StatusSucceeded,
}

// SearchQuery selects a page of PaymentIntents that a search matches,
// newest first, by key set: StartingAfter names the PaymentIntent the page
// starts after (older ones), and one that does not exist in the account is
// ErrNotFound.
type SearchQuery struct {
	Account string
	// MetadataKey and MetadataValue: only PaymentIntents whose
	// metadata[MetadataKey] is MetadataValue. MetadataKey is required.
	MetadataKey, MetadataValue string
	// Status, when set, keeps only PaymentIntents with that status.
	Status        string
	Limit         int // 1..MaxListLimit; out of range means DefaultListLimit
	StartingAfter string
}

func (q SearchQuery) limit() int { return ListQuery{Limit: q.Limit}.limit() }

// matches reports whether pi of any account matches q's filter.
func (q SearchQuery) matches(pi *PaymentIntent) bool {
	v, ok := pi.Metadata[q.MetadataKey]
	return ok && v == q.MetadataValue && (q.Status == "" || pi.Status == q.Status)
}

// searchResult is Stripe's search result envelope, of PaymentIntents.
type searchResult struct {
	Object   string           `json:"object"`
	Data     []*PaymentIntent `json:"data"`
	HasMore  bool             `json:"has_more"`
	NextPage *string          `json:"next_page"`
	URL      string           `json:"url"`
}

// searchURL is the path of the PaymentIntents' search.
const searchURL = "/v1/payment_intents/search"

func (s *Server) searchIntents(w http.ResponseWriter, r *http.Request) {
	v, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		writeParamError(w, "", "", "Invalid request: the query string is not form-encoded.")
		return
	}
	ps := newParams(v)
	fail := func(err error) {
		var pe *paramError
		errors.As(err, &pe)
		writeParamError(w, pe.param, pe.code, pe.msg)
	}
	q := SearchQuery{Account: accountFrom(r.Context()), Limit: DefaultListLimit}
	text, err := ps.required("query", MaxSearchQueryLen)
	if err != nil {
		fail(err)
		return
	}
	if n, ok, err := ps.integer("limit", 1, MaxListLimit); err != nil {
		fail(err)
		return
	} else if ok {
		q.Limit = int(n)
	}
	page, pageGiven, err := ps.str("page", MaxStringLen)
	if err != nil {
		fail(err)
		return
	}
	if pageGiven && page == "" {
		writeParamError(w, "page", codeInvalidString, "Invalid page: give the next_page of the previous result, or no page.")
		return
	}
	q.StartingAfter = page
	if err := ps.expand(); err != nil {
		fail(err)
		return
	}
	if err := ps.unknown(); err != nil {
		fail(err)
		return
	}
	if err := parseSearchQuery(text, &q); err != nil {
		fail(err)
		return
	}
	p, err := s.ledger.Search(r.Context(), q)
	switch {
	case errors.Is(err, ErrNotFound):
		writeParamError(w, "page", codeInvalidString, "Invalid page: it is not the next_page of a result of this account.")
		return
	case err != nil:
		s.internalError(w, r, "search", err)
		return
	}
	res := searchResult{Object: "search_result", Data: p.Data, HasMore: p.HasMore, URL: searchURL}
	if res.Data == nil {
		res.Data = []*PaymentIntent{}
	}
	if p.HasMore && len(p.Data) > 0 {
		next := p.Data[len(p.Data)-1].ID
		res.NextPage = &next
	}
	writeJSON(w, http.StatusOK, res)
}

// parseSearchQuery reads text, a query in the subset of Stripe's search
// query language that the gateway supports (see searchIntents), into q.
func parseSearchQuery(text string, q *SearchQuery) error {
	bad := func(format string, args ...any) error {
		return &paramError{"query", codeInvalidString, "Invalid query: " + fmt.Sprintf(format, args...) +
			" This gateway's search supports metadata['KEY']:'VALUE', optionally with AND status:'STATUS'."}
	}
	sc := &queryScanner{s: text}
	var haveMeta, haveStatus bool
	for clauses := 0; ; clauses++ {
		sc.space()
		if sc.done() {
			if clauses == 0 {
				return bad("the query is empty.")
			}
			break
		}
		if clauses > 0 {
			// Clauses are joined by white space or AND, as at Stripe.
			if w := sc.word(); strings.EqualFold(w, "AND") {
				if !sc.space() || sc.done() {
					return bad("AND must be followed by white space and a clause, at position %d.", sc.i)
				}
			} else if w != "" {
				if strings.EqualFold(w, "OR") {
					return bad("OR is not supported.")
				}
				sc.i -= len(w)
			}
		}
		start := sc.i
		field := sc.word()
		switch {
		case field == "metadata":
			if haveMeta {
				return bad("only one metadata clause is supported.")
			}
			if !sc.take('[') {
				return bad("expected [ after metadata, at position %d.", sc.i)
			}
			key, err := sc.quoted()
			if err != nil {
				return bad("%s.", err)
			}
			if !sc.take(']') {
				return bad("expected ] after the metadata key, at position %d.", sc.i)
			}
			if key == "" || strings.ContainsAny(key, "[]") || !storable(key) || utf8.RuneCountInString(key) > MaxMetadataKeyLen {
				return bad("a metadata key is 1 to %d characters without [ or ].", MaxMetadataKeyLen)
			}
			if !sc.take(':') {
				return bad("only the exact match operator : is supported, at position %d.", sc.i)
			}
			val, err := sc.quoted()
			if err != nil {
				return bad("%s.", err)
			}
			if !storable(val) || utf8.RuneCountInString(val) > MaxMetadataValueLen {
				return bad("a metadata value is at most %d characters.", MaxMetadataValueLen)
			}
			haveMeta, q.MetadataKey, q.MetadataValue = true, key, val
		case field == "status":
			if haveStatus {
				return bad("only one status clause is supported.")
			}
			if !sc.take(':') {
				return bad("only the exact match operator : is supported, at position %d.", sc.i)
			}
			val, err := sc.quoted()
			if err != nil {
				return bad("%s.", err)
			}
			if !slices.Contains(PaymentIntentStatuses, val) {
				return bad("status must be one of %s.", strings.Join(PaymentIntentStatuses, ", "))
			}
			haveStatus, q.Status = true, val
		case field == "" && start < len(text) && text[start] == '-':
			return bad("negation is not supported.")
		case field == "":
			return bad("expected a field at position %d.", start)
		default:
			return bad("the field %q is not supported.", truncate(field, 40))
		}
		if !sc.done() && !sc.space() {
			return bad("expected white space or the end after a clause, at position %d.", sc.i)
		}
	}
	if !haveMeta {
		return bad("a metadata clause is required.")
	}
	return nil
}

// queryScanner reads a search query.
type queryScanner struct {
	s string
	i int
}

func (sc *queryScanner) done() bool { return sc.i >= len(sc.s) }

// space skips white space and reports whether there was any.
func (sc *queryScanner) space() bool {
	start := sc.i
	for sc.i < len(sc.s) && (sc.s[sc.i] == ' ' || sc.s[sc.i] == '\t' || sc.s[sc.i] == '\n' || sc.s[sc.i] == '\r') {
		sc.i++
	}
	return sc.i > start
}

// word reads a field name or keyword: letters, digits and underscores.
func (sc *queryScanner) word() string {
	start := sc.i
	for sc.i < len(sc.s) {
		c := sc.s[sc.i]
		if c != '_' && (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && (c < '0' || c > '9') {
			break
		}
		sc.i++
	}
	return sc.s[start:sc.i]
}

func (sc *queryScanner) take(c byte) bool {
	if sc.i < len(sc.s) && sc.s[sc.i] == c {
		sc.i++
		return true
	}
	return false
}

// quoted reads a string in ' or " quotes, in which a backslash escapes
// the quote character or a backslash.
func (sc *queryScanner) quoted() (string, error) {
	if sc.done() || (sc.s[sc.i] != '\'' && sc.s[sc.i] != '"') {
		return "", fmt.Errorf("expected a quoted string at position %d", sc.i)
	}
	quote := sc.s[sc.i]
	sc.i++
	var b strings.Builder
	for sc.i < len(sc.s) {
		c := sc.s[sc.i]
		switch {
		case c == quote:
			sc.i++
			return b.String(), nil
		case c == '\\':
			if sc.i+1 >= len(sc.s) || (sc.s[sc.i+1] != quote && sc.s[sc.i+1] != '\\') {
				return "", fmt.Errorf("a backslash only escapes the quote character or a backslash, at position %d", sc.i)
			}
			b.WriteByte(sc.s[sc.i+1])
			sc.i += 2
		default:
			b.WriteByte(c)
			sc.i++
		}
	}
	return "", errors.New("a quoted string is not closed")
}

// QuoteSearchString quotes s for a clause of a search query, as
// parseSearchQuery (and Stripe) reads it.
func QuoteSearchString(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `'`, `\'`)
	return "'" + r.Replace(s) + "'"
}
