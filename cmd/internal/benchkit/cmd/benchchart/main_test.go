package main

import (
	"bytes"
	"image"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// chartReport is a report as `orders bench --json` writes it (rows only
// matter), with two stores, two modes, bare and with the middleware, and
// a prefilled table.
const chartReport = `{
  "target": "library", "concurrency": 32, "duration": "5s", "users": 1, "rounds": 1,
  "rows": [
    {"target": "library", "store": "memory", "middleware": false, "mode": "create", "throughput": 4000, "p99_ms": 40, "statuses": {"201": 20000}},
    {"target": "library", "store": "memory", "middleware": true, "mode": "create", "throughput": 3400, "p99_ms": 60, "statuses": {"201": 17000}},
    {"target": "library", "store": "memory", "middleware": false, "mode": "replay", "throughput": 10000, "p99_ms": 13, "statuses": {"201": 50000}},
    {"target": "library", "store": "memory", "middleware": true, "mode": "replay", "throughput": 6000, "p99_ms": 25, "statuses": {"201": 30000}},
    {"target": "library", "store": "postgres", "middleware": false, "mode": "create", "throughput": 1800, "p99_ms": 83, "statuses": {"201": 9000}},
    {"target": "library", "store": "postgres", "middleware": true, "mode": "create", "throughput": 450, "p99_ms": 267, "statuses": {"201": 2250}},
    {"target": "library", "store": "postgres", "middleware": true, "mode": "create", "prefill": 5000000, "throughput": 400, "p99_ms": 300, "statuses": {"201": 2000}},
    {"target": "library", "store": "postgres", "middleware": false, "mode": "replay", "throughput": 2300, "p99_ms": 58, "statuses": {"201": 11500}},
    {"target": "library", "store": "postgres", "middleware": true, "mode": "replay", "throughput": 1700, "p99_ms": 82, "statuses": {"201": 8500}}
  ],
  "ratios": [], "runs": []
}`

// TestChartWritesPNG runs the command on a report file: it writes a PNG
// of the asked size, with bars of more than one colour on white.
func TestChartWritesPNG(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "report.json")
	if err := os.WriteFile(in, []byte(chartReport), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "chart.png")
	if err := run(in, out, 800, 600); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	cfg, format, err := image.DecodeConfig(bytes.NewReader(b))
	if err != nil || format != "png" {
		t.Fatalf("not a PNG (%q): %v", format, err)
	}
	if cfg.Width != 800 || cfg.Height != 600 {
		t.Fatalf("the PNG is %dx%d, want 800x600", cfg.Width, cfg.Height)
	}
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	// The series' colours: white background, black text, and the bars.
	colours := map[[3]uint32]int{}
	for y := 0; y < 600; y += 2 {
		for x := 0; x < 800; x += 2 {
			r, g, bl, _ := img.At(x, y).RGBA()
			colours[[3]uint32{r >> 8, g >> 8, bl >> 8}]++
		}
	}
	white := colours[[3]uint32{255, 255, 255}]
	if white < 800*600/4/2 {
		t.Errorf("%d of %d sampled pixels white: not a chart on white", white, 800*600/4)
	}
	want := map[string][3]uint32{}
	for _, s := range []series{{"create", false, 0}, {"create", true, 0}, {"create", true, 5000000}, {"replay", true, 0}} {
		c := s.color([]series{{"create", true, 0}, {"create", true, 5000000}})
		r, g, bl, _ := c.RGBA()
		want[s.label()] = [3]uint32{r >> 8, g >> 8, bl >> 8}
	}
	for label, c := range want {
		if colours[c] < 20 {
			t.Errorf("the bars of %q (colour %v) cover %d sampled pixels", label, c, colours[c])
		}
	}
	if want["create, idem"] == want["create, idem, 5M live keys"] || want["create, bare"] == want["create, idem"] {
		t.Errorf("series share a colour: %v", want)
	}
}

// TestChartRefuses checks the errors: a report without rows, one that
// is not JSON, a size too small; nothing is left at -out.
func TestChartRefuses(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "chart.png")
	for _, c := range []struct {
		report        string
		width, height int
		want          string
	}{
		{`{"rows": []}`, 800, 600, "no rows"},
		{`not json`, 800, 600, "reading the report"},
		{chartReport, 100, 600, "too small"},
	} {
		in := filepath.Join(dir, "r.json")
		if err := os.WriteFile(in, []byte(c.report), 0o644); err != nil {
			t.Fatal(err)
		}
		err := run(in, out, c.width, c.height)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("report %.20q %dx%d: error %v, want %q", c.report, c.width, c.height, err, c.want)
		}
		if _, err := os.Stat(out); !os.IsNotExist(err) {
			t.Errorf("report %.20q: %s left behind (%v)", c.report, out, err)
		}
	}
}
