package tokenbucket

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestExamplesAreSafe: the example Caddyfiles, the ones users copy, show
// safe settings: on_invalid reject (a number would let any client pick its
// own cost by padding its body past max_body), a body read_timeout, settle
// with include_usage, and error_format for the SDKs.
func TestExamplesAreSafe(t *testing.T) {
	onInvalid := regexp.MustCompile(`(?m)^\s*on_invalid\s+(\S+)`)
	for _, name := range []string{"Caddyfile.example", "Caddyfile.llm.example"} {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		for _, m := range onInvalid.FindAllStringSubmatch(text, -1) {
			if m[1] != "reject" {
				t.Errorf("%s: on_invalid %s, want reject", name, m[1])
			}
		}
		for _, want := range []string{"on_invalid reject", "read_timeout", "include_usage", "error_format openai"} {
			if !strings.Contains(text, want) {
				t.Errorf("%s: no %q", name, want)
			}
		}
	}
}
