package orders

import (
	"slices"
	"strings"
)

// currencies holds the active ISO 4217 alphabetic codes of money that an
// order can be paid in: ISO 4217 List One (the SIX maintenance agency's
// current list, amendments to 2025 included: XCG for the Caribbean guilder,
// ZWG for Zimbabwe Gold, SLE, VED, VES), less the codes that name no money
// a card pays: the fund codes (BOV, CHE, CHW, CLF, COU, MXV, USN, UYI, UYW),
// the precious metals (XAG, XAU, XPD, XPT), the units of account (XBA, XBB,
// XBC, XBD, XDR, XSU, XUA), XTS (reserved for testing) and XXX (no
// currency). Withdrawn codes (ANG, CUC, HRK, SLL, ZWL, …) are not in it.
var currencies = func() map[string]bool {
	m := make(map[string]bool)
	for _, c := range strings.Fields(`
		AED AFN ALL AMD AOA ARS AUD AWG AZN
		BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN BWP BYN BZD
		CAD CDF CHF CLP CNY COP CRC CUP CVE CZK
		DJF DKK DOP DZD
		EGP ERN ETB EUR
		FJD FKP
		GBP GEL GHS GIP GMD GNF GTQ GYD
		HKD HNL HTG HUF
		IDR ILS INR IQD IRR ISK
		JMD JOD JPY
		KES KGS KHR KMF KPW KRW KWD KYD KZT
		LAK LBP LKR LRD LSL LYD
		MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MYR MZN
		NAD NGN NIO NOK NPR NZD
		OMR
		PAB PEN PGK PHP PKR PLN PYG
		QAR
		RON RSD RUB RWF
		SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL
		THB TJS TMT TND TOP TRY TTD TWD TZS
		UAH UGX USD UYU UZS
		VED VES VND VUV
		WST
		XAF XCD XCG XOF XPF
		YER
		ZAR ZMW ZWG`) {
		m[c] = true
	}
	return m
}()

// IsCurrency reports whether code is an active ISO 4217 currency code in
// capitals that orders accept (see Currencies).
func IsCurrency(code string) bool { return currencies[code] }

// Currencies returns, sorted, the ISO 4217 codes that orders accept: the
// active currencies of ISO 4217 List One, without its fund codes, precious
// metals, units of account, XTS and XXX.
func Currencies() []string {
	out := make([]string, 0, len(currencies))
	for c := range currencies {
		out = append(out, c)
	}
	slices.Sort(out)
	return out
}
