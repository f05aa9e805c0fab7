package storetest

import (
	"context"
	"errors"
	"testing"

	"github.com/idem-go/idem"
)

func testRelease(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-release", "fp1"))
	if err := s.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if _, err := s.Get(ctx, "u1", "k-release"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get after Release: got %v, want ErrNotFound", err)
	}
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Release: got %v, want ErrFenced", err)
	}
	// A corrected request may reuse the key.
	l2 := mustLease(t, s, params("u1", "k-release", "fp2"))
	if l2.Attempt != 1 {
		t.Errorf("Attempt after release = %d, want 1", l2.Attempt)
	}
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("stale Release: got %v, want ErrFenced", err)
	}
}

func testFail(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-fail", "fp1")
	l := mustLease(t, s, p)
	tx := begin(t, h, s, l, "fail")
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := s.Fail(ctx, l); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k-fail", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("other body after a failure: got %v, want ErrFingerprintMismatch", err)
	}
	l2 := mustLease(t, s, p) // the lease ended: the same request runs again at once
	if l2.Attempt != 2 || l2.Owner == l.Owner {
		t.Errorf("retry after failure: Attempt %d owner %q, want 2 and a new owner", l2.Attempt, l2.Owner)
	}
	if err := s.Fail(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("stale Fail: got %v, want ErrFenced", err)
	}
	if err := run(ctx, h, s, l2, "fail", response("ok")); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if got := count(t, h, s, "fail"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

func testCompleteNil(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-nil", "fp1"))
	if err := run(ctx, h, s, l, "nil", nil); err != nil {
		t.Fatalf("run: %v", err)
	}
	if got := count(t, h, s, "nil"); got != 1 {
		t.Errorf("effects = %d, want 1: the work stands", got)
	}
	if _, err := s.Get(ctx, "u1", "k-nil"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get: got %v, want ErrNotFound: the key is free", err)
	}
	if l2 := mustLease(t, s, params("u1", "k-nil", "fp2")); l2.Attempt != 1 {
		t.Errorf("Attempt after a free = %d, want 1", l2.Attempt)
	}
}

func testRollback(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-rollback", "fp1"))
	tx := begin(t, h, s, l, "rollback")
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := s.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if got := count(t, h, s, "rollback"); got != 0 {
		t.Errorf("effects = %d, want 0", got)
	}
}

// testTxLifecycle checks Rollback and Complete in every order: a rolled
// back transaction commits nothing and cannot complete, Rollback after
// Complete is a no-op, and a completed lease is spent.
func testTxLifecycle(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-tx", "fp1")
	l := mustLease(t, s, p)

	tx := begin(t, h, s, l, "tx-rolled-back")
	for i := range 2 {
		if err := tx.Rollback(ctx); err != nil {
			t.Fatalf("Rollback %d: %v", i+1, err)
		}
	}
	if err := tx.Complete(ctx, response("x")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Complete after Rollback: got %v, want ErrFenced", err)
	}
	if got := count(t, h, s, "tx-rolled-back"); got != 0 {
		t.Errorf("rolled back effects = %d, want 0", got)
	}

	tx = begin(t, h, s, l, "tx-completed")
	want := response("done")
	if err := tx.Complete(ctx, want); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete: %v, want nil", err)
	}
	if err := tx.Complete(ctx, response("again")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Complete: got %v, want ErrFenced", err)
	}
	// A completed record is no longer the lease's: the fence holds.
	if err := run(ctx, h, s, l, "tx-again", response("again")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Complete in a new transaction after Complete: got %v, want ErrFenced", err)
	}
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Release after Complete: got %v, want ErrFenced", err)
	}
	if err := s.Fail(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Fail after Complete: got %v, want ErrFenced", err)
	}
	if got := count(t, h, s, "tx-completed") + count(t, h, s, "tx-again"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	c, err := s.Claim(ctx, p)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	sameResponse(t, c.Response, want)
}
