// Package oascheck checks real HTTP exchanges against the OpenAPI
// description in package api (cmd/internal/api/openapi.yaml), for tests: a Checker's
// Transport validates every request it sends and every response it gets
// with kin-openapi's openapi3filter, and records what does not match.
//
// A request is expected to match the description unless it is marked with
// ExpectInvalid, in which case the description must refuse it (so a test
// that sends a request the service refuses also shows that the
// description says so). Every response is validated: its status must be
// documented for the operation (undocumented statuses fail), its headers
// and body must match, and every response header outside a short list of
// generic ones (Content-Length, Date, Cache-Control, ...) must be
// documented for that response. A request the description has no
// operation for (an unknown path or method) must be marked ExpectInvalid;
// its response is validated against the document's fallback responses:
// components.responses NotFound and MethodNotAllowed for the order
// service, GatewayNotFound and GatewayUnauthorized for the gateway.
package oascheck

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"

	"github.com/idem-go/idem/cmd/internal/api"
)

// The servers as the description names them; New replaces them by the
// addresses a test runs them on.
const (
	ordersServer  = "http://127.0.0.1:8080"
	gatewayServer = "http://127.0.0.1:8081"
)

// Load parses api.OpenAPI and validates it as an OpenAPI document.
func Load(ctx context.Context) (*openapi3.T, error) {
	loader := openapi3.NewLoader()
	loader.Context = ctx
	doc, err := loader.LoadFromData(api.OpenAPI)
	if err != nil {
		return nil, fmt.Errorf("oascheck: loading cmd/internal/api/openapi.yaml: %w", err)
	}
	if err := doc.Validate(ctx, openapi3.EnableExamplesValidation(), openapi3.EnableSchemaPatternValidation()); err != nil {
		return nil, fmt.Errorf("oascheck: cmd/internal/api/openapi.yaml is not valid: %w", err)
	}
	return doc, nil
}

// Checker validates exchanges with order services and gateways.
type Checker struct {
	doc      *openapi3.T
	router   routers.Router
	gateways map[string]bool // hosts of the gateways
	fallback map[bool]*routers.Route

	mu   sync.Mutex // guards errs and seen
	errs []string
	seen map[string]int
}

// Addrs are the base URLs (such as http://127.0.0.1:41234) of the
// services a test talks to.
type Addrs struct {
	Orders  []string // instances of orders serve
	Gateway []string // instances of payments serve
}

// New returns a Checker for the services at a. Requests are routed by
// host as well as path: the description's servers are replaced by a's.
func New(a Addrs) (*Checker, error) {
	doc, err := Load(context.Background())
	if err != nil {
		return nil, err
	}
	c := &Checker{doc: doc, gateways: map[string]bool{}, seen: map[string]int{}}
	servers := func(bases []string, gateway bool) (openapi3.Servers, error) {
		var ss openapi3.Servers
		for _, b := range bases {
			u, err := url.Parse(b)
			if err != nil || u.Host == "" {
				return nil, fmt.Errorf("oascheck: base URL %q: want http://host:port", b)
			}
			if gateway {
				c.gateways[u.Host] = true
			}
			ss = append(ss, &openapi3.Server{URL: strings.TrimRight(b, "/")})
		}
		if len(ss) == 0 {
			ss = openapi3.Servers{{URL: "http://unused.invalid"}}
		}
		return ss, nil
	}
	ordersServers, err := servers(a.Orders, false)
	if err != nil {
		return nil, err
	}
	gatewayServers, err := servers(a.Gateway, true)
	if err != nil {
		return nil, err
	}
	if len(doc.Servers) != 1 || doc.Servers[0].URL != ordersServer {
		return nil, fmt.Errorf("oascheck: the description's servers are %v, want only %s", doc.Servers, ordersServer)
	}
	doc.Servers = ordersServers
	for path, item := range doc.Paths.Map() {
		switch {
		case len(item.Servers) == 0:
		case len(item.Servers) == 1 && item.Servers[0].URL == gatewayServer:
			item.Servers = gatewayServers
		default:
			return nil, fmt.Errorf("oascheck: path %s lists servers %v, want none or only %s", path, item.Servers, gatewayServer)
		}
	}
	if c.router, err = gorillamux.NewRouter(doc); err != nil {
		return nil, fmt.Errorf("oascheck: router: %w", err)
	}
	// The answers to requests no operation describes.
	c.fallback = map[bool]*routers.Route{}
	for gw, names := range map[bool]map[int]string{
		false: {http.StatusNotFound: "NotFound", http.StatusMethodNotAllowed: "MethodNotAllowed"},
		true:  {http.StatusNotFound: "GatewayNotFound", http.StatusUnauthorized: "GatewayUnauthorized"},
	} {
		op := openapi3.NewOperation()
		op.Responses = openapi3.NewResponses()
		for status, name := range names {
			ref := doc.Components.Responses[name]
			if ref == nil {
				return nil, fmt.Errorf("oascheck: the description has no components.responses.%s", name)
			}
			op.Responses.Set(strconv.Itoa(status), ref)
		}
		c.fallback[gw] = &routers.Route{Spec: doc, Path: "(no route)", Operation: op}
	}
	return c, nil
}

// Doc returns the loaded description, its servers replaced (see New).
func (c *Checker) Doc() *openapi3.T { return c.doc }

type invalidKey struct{}

// ExpectInvalid marks r as a request that the description must refuse
// (an invalid body, header or parameter, a missing credential, an unknown
// route): the Checker records an error if it accepts it.
func ExpectInvalid(r *http.Request) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), invalidKey{}, true))
}

// Client returns an http.Client whose transport is c.Transport(nil).
func (c *Checker) Client() *http.Client { return &http.Client{Transport: c.Transport(nil)} }

// Transport returns a RoundTripper that sends requests through base
// (http.DefaultTransport if nil) and checks each exchange.
func (c *Checker) Transport(base http.RoundTripper) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	return roundTripper{c, base}
}

type roundTripper struct {
	c    *Checker
	base http.RoundTripper
}

func (rt roundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	var body []byte
	if req.Body != nil && req.Body != http.NoBody {
		b, err := io.ReadAll(req.Body)
		req.Body.Close()
		if err != nil {
			return nil, err
		}
		body = b
		req = req.Clone(req.Context())
		req.Body = io.NopCloser(bytes.NewReader(body))
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	}
	in := rt.c.checkRequest(req, body)
	resp, err := rt.base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	rb, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(rb))
	if err != nil {
		rt.c.errorf("%s %s: reading the response: %v", req.Method, req.URL.Path, err)
		return resp, nil
	}
	rt.c.checkResponse(in, resp, rb)
	return resp, nil
}

// exchange is what checkRequest found out about a request.
type exchange struct {
	method, path string // for messages
	gateway      bool   // sent to the gateway
	input        *openapi3filter.RequestValidationInput
	routed       bool // an operation describes it
}

func (c *Checker) isGateway(u *url.URL) bool { return c.gateways[u.Host] }

// checkRequest validates req (whose body is body) and returns what
// checkResponse needs.
func (c *Checker) checkRequest(req *http.Request, body []byte) *exchange {
	x := &exchange{method: req.Method, path: req.URL.Path, gateway: c.isGateway(req.URL)}
	wantInvalid, _ := req.Context().Value(invalidKey{}).(bool)
	// The validator gets a copy: it reads the body.
	vr := req.Clone(context.Background())
	vr.Body = io.NopCloser(bytes.NewReader(body))
	route, params, err := c.router.FindRoute(vr)
	if err != nil {
		x.input = &openapi3filter.RequestValidationInput{Request: vr, Route: c.fallback[x.gateway], Options: c.options()}
		if !wantInvalid {
			c.errorf("%s %s: the description has no operation for it: %v", req.Method, req.URL.Path, err)
		}
		return x
	}
	x.routed = true
	x.input = &openapi3filter.RequestValidationInput{Request: vr, PathParams: params, Route: route, Options: c.options()}
	err = openapi3filter.ValidateRequest(context.Background(), x.input)
	switch {
	case err != nil && !wantInvalid:
		c.errorf("%s %s: the request does not match the description: %v", req.Method, req.URL.Path, err)
	case err == nil && wantInvalid:
		c.errorf("%s %s: the request was expected to be outside the description, which accepts it (headers %v, body %.200q)",
			req.Method, req.URL.Path, redact(req.Header), body)
	}
	return x
}

func (c *Checker) options() *openapi3filter.Options {
	return &openapi3filter.Options{
		IncludeResponseStatus: true,
		MultiError:            true,
		AuthenticationFunc:    authenticate,
	}
}

// authenticate checks that a request carries a credential of the scheme's
// form (a signature or a key's validity is the server's to judge).
func authenticate(_ context.Context, in *openapi3filter.AuthenticationInput) error {
	h := in.RequestValidationInput.Request.Header.Values("Authorization")
	if len(h) != 1 {
		return in.NewError(fmt.Errorf("want one Authorization header, have %d", len(h)))
	}
	scheme, cred, _ := strings.Cut(h[0], " ")
	s := in.SecurityScheme
	if s == nil || s.Type != "http" || !strings.EqualFold(scheme, s.Scheme) || strings.TrimSpace(cred) == "" {
		return in.NewError(fmt.Errorf("the Authorization header is not of scheme %s", in.SecuritySchemeName))
	}
	if strings.EqualFold(s.Scheme, "basic") {
		b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
		if user, _, _ := strings.Cut(string(b), ":"); err != nil || user == "" {
			return in.NewError(errors.New("the Basic credentials hold no user name"))
		}
	}
	return nil
}

// genericHeaders are response headers the description need not document.
var genericHeaders = map[string]bool{
	"Content-Type": true, "Content-Length": true, "Date": true, "Cache-Control": true,
	"Vary": true, "Connection": true, "Keep-Alive": true, "Transfer-Encoding": true,
	"Trailer": true, "Content-Encoding": true, "Accept-Ranges": true, "Last-Modified": true,
	"Etag": true, "Expires": true, "X-Content-Type-Options": true, "Content-Security-Policy": true,
	"Referrer-Policy": true, "X-Frame-Options": true, "Cross-Origin-Opener-Policy": true,
	"Cross-Origin-Resource-Policy": true, "Permissions-Policy": true,
}

func (c *Checker) checkResponse(x *exchange, resp *http.Response, body []byte) {
	name := "(no route)"
	if x.routed {
		name = x.input.Route.Path
	}
	c.mu.Lock()
	c.seen[fmt.Sprintf("%s %s %d", x.method, name, resp.StatusCode)]++
	c.mu.Unlock()

	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: x.input,
		Status:                 resp.StatusCode,
		Header:                 resp.Header,
		Options:                c.options(),
	}
	in.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(context.Background(), in); err != nil {
		c.errorf("%s %s → %d: the response does not match the description: %v\nheaders %v\nbody %.600s",
			x.method, x.path, resp.StatusCode, err, redact(resp.Header), body)
		return
	}
	ref := x.input.Route.Operation.Responses.Status(resp.StatusCode)
	if ref == nil || ref.Value == nil {
		c.errorf("%s %s → %d: status not documented", x.method, x.path, resp.StatusCode)
		return
	}
	for h := range resp.Header {
		if genericHeaders[h] {
			continue
		}
		documented := false
		for d := range ref.Value.Headers {
			if http.CanonicalHeaderKey(d) == h {
				documented = true
			}
		}
		if !documented {
			c.errorf("%s %s → %d: header %s (%q) is not documented for this response", x.method, x.path, resp.StatusCode, h, resp.Header.Get(h))
		}
	}
}

func redact(h http.Header) http.Header {
	h = h.Clone()
	if h.Get("Authorization") != "" {
		h.Set("Authorization", "(redacted)")
	}
	return h
}

func (c *Checker) errorf(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errs = append(c.errs, fmt.Sprintf(format, args...))
}

// Errors returns the mismatches found so far.
func (c *Checker) Errors() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.errs)
}

// Report fails t with every mismatch found so far, and forgets them.
func (c *Checker) Report(t testing.TB) {
	t.Helper()
	c.mu.Lock()
	errs := c.errs
	c.errs = nil
	c.mu.Unlock()
	for _, e := range errs {
		t.Error("oascheck: " + e)
	}
}

// Seen returns how many exchanges had each "METHOD /path/template STATUS"
// ("(no route)" for requests no operation describes).
func (c *Checker) Seen() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := make(map[string]int, len(c.seen))
	for k, v := range c.seen {
		m[k] = v
	}
	return m
}

// RequireSeen fails t for each "METHOD /path STATUS" of want that no
// exchange had.
func (c *Checker) RequireSeen(t testing.TB, want ...string) {
	t.Helper()
	seen := c.Seen()
	for _, w := range want {
		if seen[w] == 0 {
			t.Errorf("oascheck: no exchange %q was seen; seen: %v", w, keys(seen))
		}
	}
}

// Operations returns "METHOD /path" of every operation of the order
// service (gateway false) or of the gateway (gateway true).
func (c *Checker) Operations(gateway bool) []string {
	var ops []string
	for path, item := range c.doc.Paths.Map() {
		if (len(item.Servers) > 0) != gateway {
			continue
		}
		for method := range item.Operations() {
			ops = append(ops, method+" "+path)
		}
	}
	sort.Strings(ops)
	return ops
}

// RequireAllOperations fails t for each operation of the order service
// (gateway false) or of the gateway that no exchange reached.
func (c *Checker) RequireAllOperations(t testing.TB, gateway bool) {
	t.Helper()
	seen := c.Seen()
	for _, op := range c.Operations(gateway) {
		found := false
		for k := range seen {
			if strings.HasPrefix(k, op+" ") {
				found = true
			}
		}
		if !found {
			t.Errorf("oascheck: the scenario never reached %s", op)
		}
	}
}

func keys(m map[string]int) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
