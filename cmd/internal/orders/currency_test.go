package orders

import (
	"slices"
	"strings"
	"testing"

	"github.com/idem-go/idem/cmd/internal/payments"
)

// The service refuses, before paying, every currency the gateway would
// refuse, and takes every one it takes: a currency only the gateway refused
// would be paid for by no one and answered 502 on every retry.
func TestCurrenciesMatchTheGateway(t *testing.T) {
	var gw []string
	for _, c := range payments.Currencies {
		gw = append(gw, strings.ToUpper(c))
	}
	slices.Sort(gw)
	if got := Currencies(); !slices.Equal(got, gw) {
		t.Errorf("orders accepts %v,\nthe gateway %v", got, gw)
	}
}
