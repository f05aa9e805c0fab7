package pgtest

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// SkipExamplesWithout is for a TestMain: when one of the environment
// variables vars is unset and CI is not "true", it adds the package's
// examples to -test.skip and writes one line to w saying so, so that
// go test on a machine without PostgreSQL or Redis skips them as it skips
// the tests that need them. Under CI=true the examples run, and fail if
// the servers do not answer.
func SkipExamplesWithout(w io.Writer, pkg string, vars ...string) {
	if os.Getenv("CI") == "true" {
		return
	}
	var missing []string
	for _, v := range vars {
		if os.Getenv(v) == "" {
			missing = append(missing, v)
		}
	}
	if len(missing) == 0 {
		return
	}
	if !flag.Parsed() {
		flag.Parse()
	}
	f := flag.Lookup("test.skip")
	if f == nil {
		return
	}
	skip := "^Example"
	if old := f.Value.String(); old != "" {
		skip = old + "|" + skip
	}
	if err := f.Value.Set(skip); err != nil {
		return
	}
	it := "it"
	if len(missing) > 1 {
		it = "them"
	}
	fmt.Fprintf(w, "%s: examples skipped: %s unset (set %s, or CI=true, to run the examples against the servers)\n", pkg, strings.Join(missing, ", "), it)
}
