package payments

import (
	"context"
	"embed"
	"encoding/json"
	"fmt"
	"io/fs"
	"slices"
)

// Component is the name under which the ledger's migrations are recorded
// in schema_migrations, beside the idempotency store's ("idem").
const Component = "payments"

//go:embed migrations/postgres/*.sql migrations/sqlite/*.sql
var migrationFiles embed.FS

func migrationsFor(dialect string) fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations/"+dialect)
	if err != nil {
		panic(err) // the embedded tree is fixed at build time
	}
	return sub
}

// Counter is implemented by ledgers that count an account's succeeded
// PaymentIntents without reading them all: MemLedger, PGLedger and
// SQLiteLedger.
type Counter interface {
	// Count reports how many PaymentIntents of account succeeded.
	Count(ctx context.Context, account string) (succeeded int, err error)
}

var (
	_ Counter = (*MemLedger)(nil)
	_ Counter = (*PGLedger)(nil)
	_ Counter = (*SQLiteLedger)(nil)
)

// CountSucceeded reports how many PaymentIntents of account in l
// succeeded: with l's Count when it is a Counter, else by paging through
// ListAll. It is meant for audits.
func CountSucceeded(ctx context.Context, l Ledger, account string) (int, error) {
	if c, ok := l.(Counter); ok {
		return c.Count(ctx, account)
	}
	all, err := ListAll(ctx, l, account)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, pi := range all {
		if pi.Status == StatusSucceeded {
			n++
		}
	}
	return n, nil
}

// piColumns are the columns of payment_intents that make a PaymentIntent,
// in the order of piValues and scanPI.
const piColumns = `id, account, amount, amount_capturable, amount_received, currency, status,
	capture_method, confirmation_method, description, livemode, metadata, payment_method,
	payment_method_types, last_payment_error, created, amount_refunded`

// piValues returns the values of piColumns for pi. The JSON columns are
// strings of JSON (nil for a NULL last_payment_error); metadata and
// payment_method_types are never NULL: absent, they are {} and [].
func piValues(pi *PaymentIntent) ([]any, error) {
	md := pi.Metadata
	if md == nil {
		md = map[string]string{}
	}
	mdJSON, err := json.Marshal(md)
	if err != nil {
		return nil, fmt.Errorf("payments: encoding metadata of %s: %w", pi.ID, err)
	}
	types := pi.PaymentMethodTypes
	if types == nil {
		types = []string{}
	}
	typesJSON, err := json.Marshal(types)
	if err != nil {
		return nil, fmt.Errorf("payments: encoding payment_method_types of %s: %w", pi.ID, err)
	}
	var lpe any // NULL
	if pi.LastPaymentError != nil {
		b, err := json.Marshal(pi.LastPaymentError)
		if err != nil {
			return nil, fmt.Errorf("payments: encoding last_payment_error of %s: %w", pi.ID, err)
		}
		lpe = string(b)
	}
	var desc any // NULL
	if pi.Description != nil {
		desc = *pi.Description
	}
	return []any{
		pi.ID, pi.Account, pi.Amount, pi.AmountCapturable, pi.AmountReceived, pi.Currency, pi.Status,
		pi.CaptureMethod, pi.ConfirmationMethod, desc, pi.Livemode, string(mdJSON), pi.PaymentMethod,
		string(typesJSON), lpe, pi.Created, pi.AmountRefunded,
	}, nil
}

// scanPI reads a row of piColumns, from pgx or database/sql.
func scanPI(row interface{ Scan(...any) error }) (*PaymentIntent, error) {
	pi := &PaymentIntent{Object: "payment_intent"}
	var md, types, lpe []byte
	err := row.Scan(&pi.ID, &pi.Account, &pi.Amount, &pi.AmountCapturable, &pi.AmountReceived, &pi.Currency, &pi.Status,
		&pi.CaptureMethod, &pi.ConfirmationMethod, &pi.Description, &pi.Livemode, &md, &pi.PaymentMethod,
		&types, &lpe, &pi.Created, &pi.AmountRefunded)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(md, &pi.Metadata); err != nil {
		return nil, fmt.Errorf("payments: decoding metadata of %s: %w", pi.ID, err)
	}
	if pi.Metadata == nil {
		pi.Metadata = map[string]string{}
	}
	if err := json.Unmarshal(types, &pi.PaymentMethodTypes); err != nil {
		return nil, fmt.Errorf("payments: decoding payment_method_types of %s: %w", pi.ID, err)
	}
	if pi.PaymentMethodTypes == nil {
		pi.PaymentMethodTypes = []string{}
	}
	if lpe != nil {
		pi.LastPaymentError = new(PaymentError)
		if err := json.Unmarshal(lpe, pi.LastPaymentError); err != nil {
			return nil, fmt.Errorf("payments: decoding last_payment_error of %s: %w", pi.ID, err)
		}
	}
	return pi, nil
}

// page makes a Page of rows read with limit+1: the extra row only tells
// that there is more. Rows of an ending_before query come oldest first and
// are turned newest first.
func page(rows []*PaymentIntent, limit int, endingBefore bool) Page {
	data, more := trimPage(rows, limit, endingBefore)
	return Page{Data: data, HasMore: more}
}

// trimPage cuts the one row read past limit, reporting that more follow,
// and puts a page read backwards (ending_before) newest first again.
func trimPage[T any](rows []T, limit int, endingBefore bool) ([]T, bool) {
	more := len(rows) > limit
	if more {
		rows = rows[:limit]
	}
	if endingBefore {
		slices.Reverse(rows)
	}
	return rows, more
}

// refundColumns are the columns of refunds that make a RefundRecord, in
// the order of refundValues and scanRefund.
const refundColumns = `id, account, payment_intent, amount, currency, status, reason, metadata, created`

// refundValues returns the values of refundColumns for r; metadata is a
// string of JSON, never NULL.
func refundValues(r *RefundRecord) ([]any, error) {
	md := r.Metadata
	if md == nil {
		md = map[string]string{}
	}
	mdJSON, err := json.Marshal(md)
	if err != nil {
		return nil, fmt.Errorf("payments: encoding metadata of %s: %w", r.ID, err)
	}
	var reason any // NULL
	if r.Reason != nil {
		reason = *r.Reason
	}
	return []any{r.ID, r.Account, r.PaymentIntent, r.Amount, r.Currency, r.Status, reason, string(mdJSON), r.Created}, nil
}

// scanRefund reads a row of refundColumns, from pgx or database/sql.
func scanRefund(row interface{ Scan(...any) error }) (*RefundRecord, error) {
	r := &RefundRecord{Object: "refund"}
	var md []byte
	if err := row.Scan(&r.ID, &r.Account, &r.PaymentIntent, &r.Amount, &r.Currency, &r.Status, &r.Reason, &md, &r.Created); err != nil {
		return nil, err
	}
	if err := json.Unmarshal(md, &r.Metadata); err != nil {
		return nil, fmt.Errorf("payments: decoding metadata of %s: %w", r.ID, err)
	}
	if r.Metadata == nil {
		r.Metadata = map[string]string{}
	}
	return r, nil
}

// refundPage makes a RefundPage of rows read with limit+1, as page does.
func refundPage(rows []*RefundRecord, limit int, endingBefore bool) RefundPage {
	data, more := trimPage(rows, limit, endingBefore)
	return RefundPage{Data: data, HasMore: more}
}
