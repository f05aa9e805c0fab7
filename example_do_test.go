package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// ExampleDo applies a message once, however often it is delivered: the
// receipt is written in the operation's transaction, with its output, and
// a redelivery gets the stored output without running the function again.
// A function that fails leaves the key bound for a retry (or a
// Completer with the function in CompleterOptions.Funcs).
func ExampleDo() {
	store := memstore.New(memstore.Options{}) // or sqlitestore, pgstore, redisfront
	ctx := context.Background()

	var receipts []string // the consumer's data, written only when the outcome commits
	runs := 0
	fail := true
	applyOrder := func(ctx context.Context, order []byte) ([]byte, error) {
		runs++
		if fail {
			return nil, errors.New("ledger unavailable")
		}
		tx, err := memstore.FromContext(ctx) // sqlitestore/pgstore.FromContext give a *sqlitestore.HandlerTx / pgx.Tx
		if err != nil {
			return nil, err
		}
		receipt := fmt.Sprintf("receipt %d for %s", len(receipts)+1, order)
		tx.OnCommit(func() { receipts = append(receipts, receipt) })
		return []byte(receipt), nil
	}
	p := idem.DoParams{
		User:      "consumer:receipts", // the keys' namespace
		Key:       "evt_0001",          // the message's id
		Operation: "orders.receipt",    // the function's name, for a completer
		Input:     []byte(`{"order":"ord_1"}`),
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	for delivery := range 3 {
		res, err := idem.Do(ctx, store, p, applyOrder)
		if err != nil {
			fmt.Printf("delivery %d: %v\n", delivery+1, err)
			fail = false // the ledger is back for the redelivery
			continue
		}
		fmt.Printf("delivery %d: %s replayed=%v\n", delivery+1, res.Output, res.Replayed)
	}
	p.Input = []byte(`{"order":"ord_2"}`) // another message under the same id
	if _, err := idem.Do(ctx, store, p, applyOrder); errors.Is(err, idem.ErrFingerprintMismatch) {
		fmt.Println("another input under the same key: refused")
	} else if err != nil {
		log.Fatal(err)
	}
	fmt.Println("runs:", runs, "receipts:", receipts)
	// Output:
	// delivery 1: ledger unavailable
	// delivery 2: receipt 1 for {"order":"ord_1"} replayed=false
	// delivery 3: receipt 1 for {"order":"ord_1"} replayed=true
	// another input under the same key: refused
	// runs: 2 receipts: [receipt 1 for {"order":"ord_1"}]
}
