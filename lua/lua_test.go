package lua

import (
	"slices"
	"strings"
	"testing"
)

// TestScriptsShareBlocks checks that token_bucket.lua's blocks are found
// and that every other script pastes exactly the blocks it asks for, so a
// state read or refill is the same text in every script.
func TestScriptsShareBlocks(t *testing.T) {
	var names []string
	for name := range blocks {
		names = append(names, name)
	}
	slices.Sort(names)
	if want := []string{"decide", "full", "load", "peek"}; !slices.Equal(names, want) {
		t.Fatalf("blocks %q, want %q", names, want)
	}
	for name, b := range blocks {
		if !strings.Contains(Source, b) || strings.TrimSpace(b) == "" {
			t.Errorf("block %s is not a part of token_bucket.lua", name)
		}
	}
	if !strings.Contains(blocks["decide"], blocks["peek"]) || !strings.Contains(blocks["peek"], blocks["load"]) ||
		!strings.Contains(blocks["decide"], blocks["full"]) {
		t.Error("decide does not hold peek (holding load) and full")
	}
	for _, c := range []struct {
		name, source string
		uses         map[string]int // block: times, counting those inside another
	}{
		{"demote", DemoteSource, map[string]int{"decide": 1, "peek": 2, "full": 2}},
		{"batch", BatchSource, map[string]int{"decide": 1}},
		{"settle", SettleSource, map[string]int{"load": 1, "full": 1}},
		{"refund", RefundSource, map[string]int{"load": 1, "full": 1}},
	} {
		if !strings.HasPrefix(c.source, prelude) || !strings.Contains(prelude, ClockLine) {
			t.Errorf("%s does not start with token_bucket.lua's prelude and clock", c.name)
		}
		rest := strings.TrimPrefix(c.source, prelude)
		if strings.Contains(rest, "--[[use ") {
			t.Errorf("%s keeps a use line", c.name)
		}
		for u, want := range c.uses {
			if n := strings.Count(rest, blocks[u]); n != want {
				t.Errorf("%s holds block %s %d times, want %d", c.name, u, n, want)
			}
		}
	}
}

// TestUseUnknownBlockPanics checks that a misspelt block name fails at
// once rather than leaving the line as a comment.
func TestUseUnknownBlockPanics(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "no block lod") {
			t.Fatalf("recover() = %v, want a panic naming block lod", r)
		}
	}()
	use("  --[[use lod]]\n")
}

// TestUseLeftoverLinePanics checks that a use line the pattern does not
// match (here, CRLF line endings) fails at once instead of staying a
// comment that would leave the script without its block.
func TestUseLeftoverLinePanics(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "not on a line of its own") {
			t.Fatalf("recover() = %v, want a panic about the use line", r)
		}
	}()
	use("x = 1\r\n  --[[use load]]\r\n")
}
