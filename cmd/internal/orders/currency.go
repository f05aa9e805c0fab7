package orders

import "github.com/idem-go/idem/cmd/internal/iso4217"

// IsCurrency reports whether code is an active ISO 4217 currency code in
// capitals that orders accept (see Currencies).
func IsCurrency(code string) bool { return iso4217.Is(code) }

// Currencies returns, sorted, the ISO 4217 codes that orders accept: the
// active currencies of ISO 4217 List One, without its fund codes, precious
// metals, units of account, XTS and XXX. The payment gateway accepts the
// same list (package iso4217).
func Currencies() []string { return iso4217.Codes() }
