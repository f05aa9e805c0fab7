package api_test

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/oascheck"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/problem"
)

// TestOpenAPIDocumentValid: openapi.yaml is a valid OpenAPI 3.1.0 document
// (kin-openapi's loader and Validate), every operation has an id, a tag,
// a summary and responses.
func TestOpenAPIDocumentValid(t *testing.T) {
	doc, err := oascheck.Load(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if doc.OpenAPI != "3.1.0" {
		t.Errorf("openapi: %q, want 3.1.0", doc.OpenAPI)
	}
	ids := map[string]bool{}
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			switch {
			case op.OperationID == "" || ids[op.OperationID]:
				t.Errorf("%s %s: operationId %q missing or repeated", method, path, op.OperationID)
			case len(op.Tags) != 1 || op.Summary == "":
				t.Errorf("%s %s: tags %v, summary %q", method, path, op.Tags, op.Summary)
			case op.Responses.Len() == 0:
				t.Errorf("%s %s: no responses", method, path)
			}
			ids[op.OperationID] = true
		}
	}
}

// TestOpenAPIProblemTypes: every problem type the order service answers
// clients with (orders.ProblemTypes, the idempotency middleware's
// included) is in the description's table with its status, and is the
// type of a documented response with that status; and every problem type
// a response documents is one of them.
func TestOpenAPIProblemTypes(t *testing.T) {
	doc, err := oascheck.Load(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]map[int]bool{} // type URI → statuses of responses that answer it
	add := func(status int, typ any) {
		s, ok := typ.(string)
		if !ok {
			return
		}
		if documented[s] == nil {
			documented[s] = map[int]bool{}
		}
		documented[s][status] = true
	}
	var visit func(status int, s *openapi3.SchemaRef)
	visit = func(status int, s *openapi3.SchemaRef) {
		if s == nil || s.Value == nil {
			return
		}
		if p := s.Value.Properties["type"]; p != nil && p.Value != nil {
			add(status, p.Value.Const)
			for _, e := range p.Value.Enum {
				add(status, e)
			}
		}
		for _, sub := range append(append(append(openapi3.SchemaRefs{}, s.Value.AllOf...), s.Value.OneOf...), s.Value.AnyOf...) {
			visit(status, sub)
		}
	}
	responses := func(rs map[string]*openapi3.ResponseRef) {
		for code, r := range rs {
			status, err := strconv.Atoi(code)
			if err != nil || r.Value == nil {
				continue
			}
			if mt := r.Value.Content.Get("application/problem+json"); mt != nil {
				visit(status, mt.Schema)
			}
		}
	}
	for _, item := range doc.Paths.Map() {
		for _, op := range item.Operations() {
			responses(op.Responses.Map())
		}
	}
	// The answers to unknown routes and methods.
	responses(map[string]*openapi3.ResponseRef{
		"404": doc.Components.Responses["NotFound"],
		"405": doc.Components.Responses["MethodNotAllowed"],
	})

	known := map[string]bool{problem.ResponseNotStored: true}
	for _, pt := range orders.ProblemTypes {
		known[pt.Type] = true
		name := strings.TrimPrefix(pt.Type, problem.Base)
		row := "| `" + name + "` | " + strconv.Itoa(pt.Status) + " |"
		if !strings.Contains(doc.Info.Description, row) {
			t.Errorf("the description's table has no row %q", row)
		}
		if !documented[pt.Type][pt.Status] {
			t.Errorf("no response with status %d documents problem type %s (documented with %v)", pt.Status, pt.Type, documented[pt.Type])
		}
	}
	for _, typ := range []string{problem.BadBody, problem.BadTarget, problem.ResponseNotStored} {
		if !documented[typ][http.StatusBadRequest] && typ != problem.ResponseNotStored {
			t.Errorf("problem type %s is not documented with 400", typ)
		}
		known[typ] = true
		if !strings.Contains(doc.Info.Description, "`"+strings.TrimPrefix(typ, problem.Base)+"`") {
			t.Errorf("the description's table lacks %s", typ)
		}
	}
	for typ := range documented {
		if !known[typ] {
			t.Errorf("a response documents problem type %s, which the order service does not answer", typ)
		}
	}
}

// TestOpenAPIHeaders: the headers of the contract are documented where the
// services send them.
func TestOpenAPIHeaders(t *testing.T) {
	doc, err := oascheck.Load(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	header := func(path, method, status, name string, required bool) {
		t.Helper()
		op := doc.Paths.Find(path).GetOperation(method)
		if op == nil {
			t.Errorf("no operation %s %s", method, path)
			return
		}
		r := op.Responses.Value(status)
		if r == nil || r.Value == nil {
			t.Errorf("%s %s: no response %s", method, path, status)
			return
		}
		h := r.Value.Headers[name]
		if h == nil || h.Value == nil || h.Value.Required != required {
			t.Errorf("%s %s %s: header %s not documented (required %v)", method, path, status, name, required)
		}
	}
	header("/v1/orders", "POST", "201", "Location", true)
	header("/v1/orders", "POST", "201", "Idempotent-Replayed", false)
	header("/v1/orders", "POST", "402", "Idempotent-Replayed", false)
	header("/v1/orders", "POST", "409", "Retry-After", false)
	header("/v1/orders", "POST", "503", "Retry-After", true)
	header("/v1/orders", "GET", "503", "Retry-After", true)
	for _, status := range []string{"201", "400", "401", "402", "409", "413", "422", "500", "502", "503"} {
		header("/v1/orders", "POST", status, "Idempotency-Key", false)
	}
	header("/v1/orders", "POST", "401", "WWW-Authenticate", true)
	header("/v1/orders/{id}", "GET", "401", "WWW-Authenticate", true)
	if h := doc.Components.Responses["MethodNotAllowed"].Value.Headers["Allow"]; h == nil || !h.Value.Required {
		t.Errorf("components.responses.MethodNotAllowed: no required Allow header")
	}
	for _, p := range []string{"/v1/payment_intents", "/v1/refunds"} {
		header(p, "POST", "200", "Idempotent-Replayed", false)
		header(p, "POST", "200", "Idempotency-Key", false)
		header(p, "POST", "200", "Request-Id", true)
		header(p, "POST", "401", "WWW-Authenticate", true)
		header(p, "POST", "429", "Stripe-Should-Retry", true)
	}
	header("/v1/payment_intents", "POST", "402", "Idempotent-Replayed", false)
	for _, name := range []string{"bearerToken", "gatewayKey", "gatewayBasic"} {
		if doc.Components.SecuritySchemes[name] == nil {
			t.Errorf("no security scheme %s", name)
		}
	}
	param := doc.Paths.Find("/v1/orders").Post.Parameters.GetByInAndName("header", "Idempotency-Key")
	if param == nil || !param.Required || param.Schema.Value.Pattern == "" {
		t.Fatalf("POST /v1/orders: Idempotency-Key header parameter %+v", param)
	}
	// The pattern takes what idem.ParseKey takes, bare and as an
	// sf-string, and nothing else.
	for _, v := range []string{"abc-123", `"abc-123"`, `"a\"b"`, `"a\\b"`, "!", strings.Repeat("k", 255), `"` + strings.Repeat("k", 255) + `"`,
		"", " ", "a b", `"a b"`, `"abc`, `"a"b"`, `"a\nb"`, `""`, strings.Repeat("k", 256), "é", "a\tb", `"a\b"`} {
		_, perr := idem.ParseKey(v)
		serr := param.Schema.Value.VisitJSON(v, openapi3.EnableJSONSchema2020())
		if (perr == nil) != (serr == nil) {
			t.Errorf("key %q: idem.ParseKey error %v, description's error %v", v, perr, serr)
		}
	}
}
