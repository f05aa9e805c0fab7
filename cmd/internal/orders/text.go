package orders

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxOrderID is the longest order id that the API looks up, in bytes: a
// longer one (in a path or a starting_after cursor) names no order. The
// service's own ids are "ord_" and 24 hex characters.
const MaxOrderID = 255

// plainText reports whether s is valid UTF-8 without control characters
// (NUL included): text that every database keeps and compares as it is.
// PostgreSQL refuses NUL and bytes that are not UTF-8 (SQLSTATE 22021).
func plainText(s string) bool {
	return utf8.ValidString(s) && strings.IndexFunc(s, unicode.IsControl) < 0
}

// lookupID reports whether id can name an order: 1..MaxOrderID bytes of
// plain text. Any other id names none, and never reaches the database.
func lookupID(id string) bool {
	return id != "" && len(id) <= MaxOrderID && plainText(id)
}

// CheckUser reports why user cannot be a user id (a bearer token's sub),
// or nil: a user id is 1..MaxUser bytes of UTF-8 text without control
// characters, since it is stored with every order and every key.
func CheckUser(user string) error {
	switch {
	case user == "":
		return errors.New("the user id is empty")
	case len(user) > MaxUser:
		return fmt.Errorf("the user id is over %d bytes", MaxUser)
	case !plainText(user):
		return errors.New("the user id is not UTF-8 text without control characters")
	}
	return nil
}

// ReservedUserPrefix begins the idem users the service keeps for its own
// consumers, which claim message ids in their own namespace (the receipts
// consumer's is "$consumer:receipts"). No bearer token's sub may begin
// with it: a client whose sub were the consumer's user could claim an
// event's id first, and the consumer would then terminate that message
// (another fingerprint) and write no receipt.
const ReservedUserPrefix = "$"

// CheckTokenUser reports why user cannot be a bearer token's sub, or nil:
// CheckUser's rules, and not beginning with ReservedUserPrefix.
func CheckTokenUser(user string) error {
	if err := CheckUser(user); err != nil {
		return err
	}
	if strings.HasPrefix(user, ReservedUserPrefix) {
		return fmt.Errorf("the user id begins with %q, which is reserved for the service's own consumers", ReservedUserPrefix)
	}
	return nil
}
