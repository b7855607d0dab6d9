package soak

import (
	"regexp"
	"testing"
)

// TestMemstat reads the runtime.MemStats lines of a debug=1 heap profile.
func TestMemstat(t *testing.T) {
	profile := "heap profile: 1: 2 [3: 4] @ heap/1048576\n\n# runtime.MemStats\n# Alloc = 100\n# HeapAlloc = 4718592\n# HeapInuse = 7000000\n"
	if got := memstat(profile, "HeapAlloc"); got != 4718592 {
		t.Errorf("HeapAlloc = %d, want 4718592", got)
	}
	if got := memstat(profile, "HeapInuse"); got != 7000000 {
		t.Errorf("HeapInuse = %d, want 7000000", got)
	}
	if got := memstat(profile, "Sys"); got != 0 {
		t.Errorf("a missing figure = %d, want 0", got)
	}
}

// TestSourceHash: the cache key of the plugin's sources is 16 hex digits,
// the same on a second call, and covers the Lua script.
func TestSourceHash(t *testing.T) {
	a, err := SourceHash("../..")
	if err != nil {
		t.Fatal(err)
	}
	b, err := SourceHash("../..")
	if err != nil || a != b || !regexp.MustCompile(`^[0-9a-f]{16}$`).MatchString(a) {
		t.Errorf("SourceHash = %q then %q (%v), want the same 16 hex digits", a, b, err)
	}
	files, err := pluginFiles("../..")
	if err != nil {
		t.Fatal(err)
	}
	var lua, bucket bool
	for _, f := range files {
		lua = lua || regexp.MustCompile(`/lua/token_bucket\.lua$`).MatchString(f)
		bucket = bucket || regexp.MustCompile(`/bucket/bucket\.go$`).MatchString(f)
	}
	if !lua || !bucket {
		t.Errorf("the plugin's files %q lack lua/token_bucket.lua or bucket/bucket.go", files)
	}
}
