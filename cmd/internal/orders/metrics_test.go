package orders

import (
	"strconv"
	"strings"
)

// promSample returns the value of the sample name{labels} in the
// Prometheus text exposition body: the sample whose labels are exactly
// labels, in any order.
func promSample(body, name string, labels map[string]string) (float64, bool) {
	for _, line := range strings.Split(body, "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		n, rest, _ := strings.Cut(line, " ")
		var ls map[string]string
		if i := strings.IndexByte(line, '{'); i >= 0 {
			j := strings.LastIndexByte(line, '}')
			if j < i {
				continue
			}
			n, rest = line[:i], strings.TrimSpace(line[j+1:])
			ls = promLabels(line[i+1 : j])
			if ls == nil {
				continue
			}
		}
		if n != name || len(ls) != len(labels) {
			continue
		}
		same := true
		for k, v := range labels {
			if ls[k] != v {
				same = false
			}
		}
		if !same {
			continue
		}
		f, err := strconv.ParseFloat(strings.Fields(rest)[0], 64)
		return f, err == nil
	}
	return 0, false
}

// promLabels parses `a="x",b="y"` (quoted values with Go escapes); nil if
// it is not that.
func promLabels(s string) map[string]string {
	ls := map[string]string{}
	for s != "" {
		k, rest, ok := strings.Cut(s, "=")
		if !ok {
			return nil
		}
		v, err := strconv.QuotedPrefix(rest)
		if err != nil {
			return nil
		}
		ls[strings.TrimSpace(k)], _ = strconv.Unquote(v)
		s = strings.TrimPrefix(rest[len(v):], ",")
	}
	return ls
}
