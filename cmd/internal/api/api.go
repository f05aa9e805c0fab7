// Package api holds the OpenAPI 3.1 description of the order API (orders
// serve) and of the payment gateway's API (payments serve), as one YAML
// document. The order service serves it at GET /openapi.yaml.
package api

import _ "embed"

// OpenAPI is the YAML text of openapi.yaml.
//
//go:embed openapi.yaml
var OpenAPI []byte

//go:generate protoc --proto_path=proto --go_out=. --go_opt=module=github.com/idem-go/idem/cmd/internal/api --connect-go_out=. --connect-go_opt=module=github.com/idem-go/idem/cmd/internal/api orders/v1/orders.proto
