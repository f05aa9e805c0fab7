package ordersapp

import (
	"math/rand/v2"
	"os"
	"slices"
	"testing"
)

// TestRecordSorterSortsByFields: records of random fields, zero bytes and
// prefixes of one another included, come out of many runs in the order of
// their fields, compared one after the other, each field whole.
func TestRecordSorterSortsByFields(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []byte{0, 1, 0xff, 'a', 'b'}
	field := func() string {
		b := make([]byte, rng.IntN(4))
		for i := range b {
			b[i] = alphabet[rng.IntN(len(alphabet))]
		}
		return string(b)
	}
	dir := t.TempDir()
	s := newRecordSorter(dir, "test", 4<<10) // a run every few dozen records
	var want [][]string
	for range 5000 {
		rec := make([]string, 1+rng.IntN(3))
		for i := range rec {
			rec[i] = field()
		}
		want = append(want, rec)
		if err := s.add(rec...); err != nil {
			t.Fatal(err)
		}
	}
	if s.added != 5000 || len(s.runs) < 2 || len(s.runs) >= maxRuns {
		t.Fatalf("%d records, %d runs: want 5000 records, more than one run and fewer than %d (the buffer fills every few dozen records, and runs are merged at %d)",
			s.added, len(s.runs), maxRuns, maxRuns)
	}
	slices.SortFunc(want, slices.Compare[[]string])
	r, err := s.sorted()
	if err != nil {
		t.Fatal(err)
	}
	var got [][]string
	for r.OK {
		got = append(got, slices.Clone(r.Fields))
		if err := r.advance(); err != nil {
			t.Fatal(err)
		}
	}
	r.Close()
	if len(got) != len(want) {
		t.Fatalf("%d records out, %d in", len(got), len(want))
	}
	for i := range want {
		if !slices.Equal(got[i], want[i]) {
			t.Fatalf("record %d: %q, want %q", i, got[i], want[i])
		}
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Fatalf("%d run files left after Close", len(left))
	}
}

// TestRecordSorterEmpty: a sorter given nothing reads nothing.
func TestRecordSorterEmpty(t *testing.T) {
	r, err := newRecordSorter(t.TempDir(), "empty", 1<<10).sorted()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.OK {
		t.Fatalf("a record out of an empty sorter: %q", r.Fields)
	}
}
