// Command benchchart draws the rows of an `orders bench --json` report as
// a PNG: throughput (requests per second) and p99 latency per store, one
// bar per mode and target (bare handler, with the middleware, and with
// the middleware on a prefilled table), side by side.
//
//	go run ./cmd/orders bench … --json > docs/benchmarks.json
//	go run ./cmd/internal/benchkit/cmd/benchchart -in docs/benchmarks.json -out docs/benchmarks.png
//
// It is a command of its own, not a flag of `orders bench`, so that the
// orders binary does not carry the plotting library.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"image"
	"image/color"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// report is the part of `orders bench --json` the chart reads.
type report struct {
	Target      string `json:"target"`
	Concurrency int    `json:"concurrency"`
	Duration    string `json:"duration"`
	Rounds      int    `json:"rounds"`
	Rows        []row  `json:"rows"`
}

type row struct {
	Store      string  `json:"store"`
	Middleware bool    `json:"middleware"`
	Mode       string  `json:"mode"`
	Prefill    int64   `json:"prefill"`
	Throughput float64 `json:"throughput"`
	P99        float64 `json:"p99_ms"`
}

// series is one kind of bar: a mode on one target kind, over the stores.
type series struct {
	mode       string
	middleware bool
	prefill    int64
}

func (s series) label() string {
	l := s.mode + ", bare"
	if s.middleware {
		l = s.mode + ", idem"
	}
	if s.prefill > 0 {
		l += ", " + humanKeys(s.prefill) + " live keys"
	}
	return l
}

// modeColors gives each mode a hue, in the order of `orders bench --mode`.
var modeColors = map[string]color.RGBA{
	"nokey":      {0x7f, 0x7f, 0x7f, 0xff},
	"create":     {0x1f, 0x77, 0xb4, 0xff},
	"replay":     {0x2c, 0xa0, 0x2c, 0xff},
	"duplicates": {0xff, 0x7f, 0x0e, 0xff},
	"inflight":   {0xd6, 0x27, 0x28, 0xff},
}

// color is the series' bar colour: its mode's hue, light for the bare
// handler, full with the middleware, darker for each larger prefill.
func (s series) color(all []series) color.Color {
	base, ok := modeColors[s.mode]
	if !ok {
		base = color.RGBA{0x94, 0x67, 0xbd, 0xff}
	}
	mix := func(to uint8, f float64) color.RGBA {
		m := func(c uint8) uint8 { return uint8(float64(c) + (float64(to)-float64(c))*f) }
		return color.RGBA{m(base.R), m(base.G), m(base.B), 0xff}
	}
	if !s.middleware {
		return mix(0xff, 0.55)
	}
	// Rank of this prefill among the mode's with-middleware series.
	rank := 0
	for _, o := range all {
		if o.mode == s.mode && o.middleware && o.prefill < s.prefill {
			rank++
		}
	}
	return mix(0, min(0.25*float64(rank), 0.75))
}

func humanKeys(n int64) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return strconv.FormatInt(n/1_000_000, 10) + "M"
	case n >= 1000 && n%1000 == 0:
		return strconv.FormatInt(n/1000, 10) + "k"
	}
	return strconv.FormatInt(n, 10)
}

// DPI is the resolution the chart is drawn at.
const DPI = 96

// Chart reads a report from r and writes its chart to w as a PNG of
// width × height pixels.
func Chart(r io.Reader, w io.Writer, width, height int) error {
	if width < 200 || height < 150 {
		return fmt.Errorf("benchchart: %dx%d pixels is too small (at least 200x150)", width, height)
	}
	var rep report
	if err := json.NewDecoder(r).Decode(&rep); err != nil {
		return fmt.Errorf("benchchart: reading the report: %w", err)
	}
	if len(rep.Rows) == 0 {
		return errors.New("benchchart: the report has no rows")
	}
	var stores []string
	var ss []series
	val := map[series]map[string]row{}
	for _, r := range rep.Rows {
		if !slices.Contains(stores, r.Store) {
			stores = append(stores, r.Store)
		}
		s := series{r.Mode, r.Middleware, r.Prefill}
		if _, ok := val[s]; !ok {
			ss = append(ss, s)
			val[s] = map[string]row{}
		}
		val[s][r.Store] = r
	}
	title := fmt.Sprintf("orders bench, target %s: %d clients, %s per run, %d round(s)", rep.Target, rep.Concurrency, rep.Duration, rep.Rounds)
	tput, err := barPlot(title+"\nthroughput (median of the rounds)", "requests per second", stores, ss, val, func(r row) float64 { return r.Throughput })
	if err != nil {
		return err
	}
	p99, err := barPlot("p99 latency (all rounds)", "milliseconds", stores, ss, val, func(r row) float64 { return r.P99 })
	if err != nil {
		return err
	}
	img := image.NewRGBA(image.Rect(0, 0, width, height))
	c := vgimg.NewWith(vgimg.UseImage(img), vgimg.UseDPI(DPI)) // white background
	dc := draw.New(c)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Millimeter * 2, PadY: vg.Millimeter * 4, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	canvases := plot.Align([][]*plot.Plot{{tput}, {p99}}, tiles, dc)
	tput.Draw(canvases[0][0])
	p99.Draw(canvases[1][0])
	_, err = vgimg.PngCanvas{Canvas: c}.WriteTo(w)
	return err
}

// barPlot draws one bar per series and store, grouped by store.
func barPlot(title, ylabel string, stores []string, ss []series, val map[series]map[string]row, value func(row) float64) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = ylabel
	p.Y.Min = 0
	p.Legend.Top = true
	width := vg.Points(min(max(600/float64(len(ss)*len(stores)), 6), 40))
	top := 0.0
	for i, s := range ss {
		vs := make(plotter.Values, len(stores))
		for j, st := range stores {
			if r, ok := val[s][st]; ok {
				vs[j] = value(r) // a store without this series: no bar
				top = max(top, vs[j])
			}
		}
		b, err := plotter.NewBarChart(vs, width)
		if err != nil {
			return nil, fmt.Errorf("benchchart: %w", err)
		}
		b.LineStyle.Width = 0
		b.Color = s.color(ss)
		b.Offset = width * vg.Length(float64(i)-float64(len(ss)-1)/2)
		p.Add(b)
		p.Legend.Add(s.label(), b)
	}
	p.NominalX(stores...)
	// Room above the highest bar for the legend, one line per series.
	p.Y.Max = max(top, 1) * (1.15 + 0.1*float64(len(ss)))
	return p, nil
}

func main() {
	in := flag.String("in", "-", "the `orders bench --json` report to read (- for standard input)")
	out := flag.String("out", "benchmarks.png", "the PNG to write")
	width := flag.Int("width", 1200, "width of the PNG in pixels")
	height := flag.Int("height", 900, "height of the PNG in pixels")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: benchchart [-in report.json] [-out chart.png] [-width 1200] [-height 900]\n\nDraws throughput and p99 per store, mode and target from `orders bench --json`.\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "benchchart: unexpected argument %q\n", strings.Join(flag.Args(), " "))
		os.Exit(2)
	}
	if err := run(*in, *out, *width, *height); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run(in, out string, width, height int) error {
	r := io.Reader(os.Stdin)
	if in != "-" {
		f, err := os.Open(in)
		if err != nil {
			return err
		}
		defer f.Close()
		r = f
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	if err := Chart(r, f, width, height); err != nil {
		f.Close()
		os.Remove(out)
		return err
	}
	return f.Close()
}
