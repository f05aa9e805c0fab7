package ordersapp

import (
	"bufio"
	"container/heap"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// recordSorter sorts records (tuples of strings) by their fields, first
// field first, each compared bytewise, while it holds at most about
// bufBytes of them in memory: whenever its buffer fills, the buffer is
// sorted and written to a file of dir (a run), and reading merges the
// runs. The audit sorts what it reads this way, so that its memory does not
// grow with the number of orders.
//
// A record is kept as one string in which each field is followed by the
// separator 0x00 0x01 and every 0x00 within a field is written 0x00 0xff.
// Comparing two such strings bytewise compares their fields in order (the
// separator sorts before any byte that continues a field), so the sort
// never decodes.
type recordSorter struct {
	dir      string
	name     string // for errors and file names
	bufBytes int

	buf   []string
	held  int  // bytes in buf
	done  bool // no more records: finish (flush frees the buffer)
	runs  []string
	added int
}

// maxRuns is how many runs a recordSorter keeps before it merges them into
// one: reading merges every run at once, with a read buffer each, so that
// the number of runs, not only the buffer, bounds its memory.
const maxRuns = 32

// defaultSortBuffer is how many bytes of records one recordSorter holds
// before it writes them to a run. The audit's sorters fill one after the
// other, so about one buffer is in memory at a time.
const defaultSortBuffer = 24 << 20

func newRecordSorter(dir, name string, bufBytes int) *recordSorter {
	return &recordSorter{dir: dir, name: name, bufBytes: bufBytes}
}

// encodeRecord joins fields into the sortable form recordSorter keeps.
func encodeRecord(fields ...string) string {
	n := 0
	for _, f := range fields {
		n += len(f) + 2
	}
	var b strings.Builder
	b.Grow(n)
	for _, f := range fields {
		for {
			i := strings.IndexByte(f, 0)
			if i < 0 {
				break
			}
			b.WriteString(f[:i+1])
			b.WriteByte(0xff)
			f = f[i+1:]
		}
		b.WriteString(f)
		b.WriteByte(0)
		b.WriteByte(1)
	}
	return b.String()
}

// decodeRecord splits a record encodeRecord made into dst (reused) and
// returns it.
func decodeRecord(rec string, dst []string) ([]string, error) {
	dst = dst[:0]
	var field strings.Builder
	escaped := false
	for len(rec) > 0 {
		i := strings.IndexByte(rec, 0)
		if i < 0 || i+1 >= len(rec) {
			return nil, errors.New("audit: a sorted record is damaged")
		}
		switch rec[i+1] {
		case 1:
			if escaped {
				field.WriteString(rec[:i])
				dst = append(dst, field.String())
				field.Reset()
				escaped = false
			} else {
				dst = append(dst, rec[:i])
			}
		case 0xff:
			field.WriteString(rec[:i+1])
			escaped = true
		default:
			return nil, errors.New("audit: a sorted record is damaged")
		}
		rec = rec[i+2:]
	}
	return dst, nil
}

// add adds a record of fields.
func (s *recordSorter) add(fields ...string) error {
	rec := encodeRecord(fields...)
	s.buf = append(s.buf, rec)
	s.held += len(rec) + 16
	s.added++
	if s.held >= s.bufBytes {
		return s.flush()
	}
	return nil
}

// flush writes the buffer, sorted, to a new run.
func (s *recordSorter) flush() error {
	if len(s.buf) == 0 {
		return nil
	}
	slices.Sort(s.buf)
	f, err := os.CreateTemp(s.dir, s.name+"-*.run")
	if err != nil {
		return fmt.Errorf("audit: sorting %s: %w", s.name, err)
	}
	w := bufio.NewWriterSize(f, 256<<10)
	for _, rec := range s.buf {
		if err = writeRun(w, rec); err != nil {
			break
		}
	}
	if err == nil {
		err = w.Flush()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("audit: sorting %s: %w", s.name, err)
	}
	s.runs = append(s.runs, f.Name())
	clear(s.buf)
	s.buf, s.held = s.buf[:0], 0
	if s.done {
		s.buf = nil
	}
	if len(s.runs) >= maxRuns {
		return s.compact()
	}
	return nil
}

// writeRun writes one record of a run: its length, then its bytes.
func writeRun(w *bufio.Writer, rec string) error {
	var lenBuf [binary.MaxVarintLen64]byte
	if _, err := w.Write(lenBuf[:binary.PutUvarint(lenBuf[:], uint64(len(rec)))]); err != nil {
		return err
	}
	_, err := w.WriteString(rec)
	return err
}

// compact merges every run into one.
func (s *recordSorter) compact() error {
	r, err := s.openRuns()
	if err != nil {
		return err
	}
	defer r.Close()
	f, err := os.CreateTemp(s.dir, s.name+"-*.run")
	if err != nil {
		return fmt.Errorf("audit: sorting %s: %w", s.name, err)
	}
	w := bufio.NewWriterSize(f, 256<<10)
	for len(r.heap) > 0 {
		top := r.heap[0]
		if err = writeRun(w, top.cur); err != nil {
			break
		}
		if err = top.next(); err != nil {
			break
		}
		if top.ok {
			heap.Fix(&r.heap, 0)
		} else {
			heap.Pop(&r.heap)
		}
	}
	if err == nil {
		err = w.Flush()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("audit: sorting %s: %w", s.name, err)
	}
	s.runs = []string{f.Name()}
	return nil
}

// finish writes what is left in the buffer to a run and frees the buffer:
// nothing more is added. The audit finishes each source's sort once it has
// read the source, so that one sort buffer at a time is in memory.
func (s *recordSorter) finish() error {
	s.done = true
	if err := s.flush(); err != nil {
		return err
	}
	s.buf = nil
	return nil
}

// sorted finishes the sorter and returns a reader of every record added,
// in order. Close the reader.
func (s *recordSorter) sorted() (*sortedRecords, error) {
	if err := s.finish(); err != nil {
		return nil, err
	}
	r, err := s.openRuns()
	if err != nil {
		return nil, err
	}
	return r, r.advance()
}

// openRuns opens every run, each at its first record, and hands them to a
// reader that removes them when closed.
func (s *recordSorter) openRuns() (*sortedRecords, error) {
	r := &sortedRecords{name: s.name}
	for _, path := range s.runs {
		f, err := os.Open(path)
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("audit: sorting %s: %w", s.name, err)
		}
		run := &runReader{f: f, r: bufio.NewReaderSize(f, 64<<10)}
		r.files = append(r.files, f)
		if err := run.next(); err != nil {
			r.Close()
			return nil, fmt.Errorf("audit: sorting %s: %w", s.name, err)
		}
		if run.ok {
			r.heap = append(r.heap, run)
		}
	}
	heap.Init(&r.heap)
	return r, nil
}

// runReader reads one run.
type runReader struct {
	f   *os.File
	r   *bufio.Reader
	cur string
	ok  bool
	b   []byte
}

func (rr *runReader) next() error {
	n, err := binary.ReadUvarint(rr.r)
	if errors.Is(err, io.EOF) {
		rr.ok = false
		return nil
	}
	if err != nil {
		return err
	}
	if cap(rr.b) < int(n) {
		rr.b = make([]byte, n)
	}
	rr.b = rr.b[:n]
	if _, err := io.ReadFull(rr.r, rr.b); err != nil {
		return err
	}
	rr.cur, rr.ok = string(rr.b), true
	return nil
}

type runHeap []*runReader

func (h runHeap) Len() int           { return len(h) }
func (h runHeap) Less(i, j int) bool { return h[i].cur < h[j].cur }
func (h runHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *runHeap) Push(x any)        { *h = append(*h, x.(*runReader)) }
func (h *runHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// sortedRecords reads a recordSorter's records in order: Fields is the
// current record's (valid until the next advance), OK false once every
// record was read.
type sortedRecords struct {
	name   string
	heap   runHeap
	files  []*os.File
	Fields []string
	OK     bool
}

// Key is the current record's first field ("" once every record was
// read; check OK).
func (r *sortedRecords) Key() string {
	if !r.OK || len(r.Fields) == 0 {
		return ""
	}
	return r.Fields[0]
}

// advance moves to the next record.
func (r *sortedRecords) advance() error {
	if len(r.heap) == 0 {
		r.OK, r.Fields = false, r.Fields[:0]
		return nil
	}
	top := r.heap[0]
	var err error
	if r.Fields, err = decodeRecord(top.cur, r.Fields); err != nil {
		return fmt.Errorf("%s: %w", r.name, err)
	}
	r.OK = true
	if err := top.next(); err != nil {
		return fmt.Errorf("audit: sorting %s: %w", r.name, err)
	}
	if top.ok {
		heap.Fix(&r.heap, 0)
	} else {
		heap.Pop(&r.heap)
	}
	return nil
}

// Close closes and removes the runs.
func (r *sortedRecords) Close() {
	for _, f := range r.files {
		f.Close()
		os.Remove(f.Name())
	}
	r.files, r.heap = nil, nil
}
