// Package iso4217 is the one list of currency codes that the order service
// and the payment gateway accept, so that an order the service takes is
// never refused by the gateway for its currency.
package iso4217

import (
	"slices"
	"strings"
)

// codes are the active ISO 4217 alphabetic codes of money that a card can
// pay in: ISO 4217 List One as its maintenance agency publishes it,
// amendments to 2025 included (SLE, VED, VES, XCG, ZWG), less the codes
// that name no such money: the fund codes (BOV, CHE, CHW, CLF, COU, MXV,
// USN, UYI, UYW), the precious metals (XAG, XAU, XPD, XPT), the units of
// account (XBA, XBB, XBC, XBD, XDR, XSU, XUA), XTS (reserved for testing)
// and XXX (no currency). Withdrawn codes (ANG, CUC, HRK, SLL, ZWL, …) are
// not in it.
var codes = strings.Fields(`
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
	ZAR ZMW ZWG`)

var set = func() map[string]bool {
	m := make(map[string]bool, len(codes))
	for _, c := range codes {
		m[c] = true
	}
	return m
}()

// Is reports whether code is one of Codes, in capitals.
func Is(code string) bool { return set[code] }

// Codes returns the codes, in capitals, sorted.
func Codes() []string {
	out := slices.Clone(codes)
	slices.Sort(out)
	return out
}
