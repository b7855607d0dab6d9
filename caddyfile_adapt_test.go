package tokenbucket

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// updateGolden rewrites the JSON half of each testdata/caddyfile_adapt file
// with what the adapter gives today (go test -run TestCaddyfileAdapt -update).
// Without it the files are only read.
var updateGolden = flag.Bool("update", false, "rewrite the adapted JSON of testdata/caddyfile_adapt/*.txt")

// adaptSeparator divides a golden file's Caddyfile from its adapted JSON,
// as in Caddy's own caddyfile_adapt tests.
const adaptSeparator = "----------"

// TestCaddyfileAdapt adapts each testdata/caddyfile_adapt/*.txt Caddyfile, as
// `caddy adapt` does, and compares the config with the file's JSON exactly
// (indented with tabs, keys in the order Caddy prints them: sorted). One
// file per syntax form of token_bucket and token_bucket_ready.
func TestCaddyfileAdapt(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "caddyfile_adapt", "*.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no testdata/caddyfile_adapt/*.txt")
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".txt"), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			parts := strings.Split(string(data), "\n"+adaptSeparator+"\n")
			if len(parts) != 2 {
				t.Fatalf("want a Caddyfile, a line %s and the adapted JSON", adaptSeparator)
			}
			caddyfile, want := strings.TrimSpace(parts[0])+"\n", strings.TrimSpace(parts[1])
			out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			for _, w := range warnings {
				t.Logf("warning: %s:%d: %s: %s", file, w.Line, w.Directive, w.Message)
			}
			var got bytes.Buffer
			if err := json.Indent(&got, out, "", "\t"); err != nil {
				t.Fatal(err)
			}
			if got.String() == want {
				return
			}
			if *updateGolden {
				if err := os.WriteFile(file, []byte(caddyfile+adaptSeparator+"\n"+got.String()+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				t.Logf("rewrote %s", file)
				return
			}
			t.Errorf("adapted JSON differs from %s (go test -run TestCaddyfileAdapt -update rewrites it)\n%s",
				file, lineDiff(want, got.String()))
		})
	}
}

// lineDiff shows the first line where want and got part, with a few lines
// of context.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	i := 0
	for i < len(w) && i < len(g) && w[i] == g[i] {
		i++
	}
	from := max(0, i-3)
	var b strings.Builder
	for _, l := range w[from:i] {
		b.WriteString("  " + l + "\n")
	}
	for _, l := range w[i:min(len(w), i+5)] {
		b.WriteString("- " + l + "\n")
	}
	for _, l := range g[i:min(len(g), i+5)] {
		b.WriteString("+ " + l + "\n")
	}
	return b.String()
}
