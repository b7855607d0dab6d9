package bucket

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"strings"
	"testing"
)

// TestKeyFormula pins the documented formula: SHA-256, first 16 bytes,
// unpadded base64url, as
// printf %s alice | openssl dgst -sha256 -binary | head -c16 | basenc --base64url | tr -d =
func TestKeyFormula(t *testing.T) {
	k := NewKeyer("rl:", "")
	if got, want := k.Key("user", "alice", ""), "rl:{user:K9gGyX8OAK8aH8Myj6djqQ}"; got != want {
		t.Errorf("Key = %q, want %q", got, want)
	}
	if got, want := k.Key("user", "alice", "tokens"), "rl:{user:K9gGyX8OAK8aH8Myj6djqQ}:tokens"; got != want {
		t.Errorf("Key = %q, want %q", got, want)
	}
	if got := NewKeyer("rl:", "s3cret").ID("alice"); got == k.ID("alice") || len(got) != IDLength {
		t.Errorf("HMAC id %q: must differ from the plain hash and be %d long", got, IDLength)
	}
}

// TestKeyHostileIdentities: braces, separators, NUL, CR/LF and 10 KB of
// text give bounded keys with no brace from the input, all distinct.
func TestKeyHostileIdentities(t *testing.T) {
	k := NewKeyer("rl:", "")
	ids := []string{"{a}", "}", "{", "a:b", "a}:{b", "\x00", "\r\n", "ключ", strings.Repeat("x", 10240), strings.Repeat("x", 10241), ""}
	seen := map[string]string{}
	for _, id := range ids {
		key := k.Key("user", id, "")
		if len(key) != len("rl:{user:}")+IDLength {
			t.Errorf("key of %.20q has length %d", id, len(key))
		}
		if strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 {
			t.Errorf("key %q carries a brace from the identity", key)
		}
		if prev, dup := seen[key]; dup {
			t.Errorf("identities %.20q and %.20q share key %q", prev, id, key)
		}
		seen[key] = id
	}
}

// TestKeyIDLengths: identities of every length around SHA-256's 64-byte
// block, hashed where they are, give the documented SHA-256 and
// HMAC-SHA-256 ids.
func TestKeyIDLengths(t *testing.T) {
	plain, keyed := NewKeyer("rl:", ""), NewKeyer("rl:", "s3cret")
	for _, n := range []int{0, 1, 32, 33, 55, 56, 63, 64, 65, 255, 256, 257, 1024} {
		id := strings.Repeat("k", n)
		sum := sha256.Sum256([]byte(id))
		if got, want := plain.ID(id), base64.RawURLEncoding.EncodeToString(sum[:16]); got != want {
			t.Errorf("SHA-256 id of %d bytes = %q, want %q", n, got, want)
		}
		mac := hmac.New(sha256.New, []byte("s3cret"))
		mac.Write([]byte(id))
		if got, want := keyed.ID(id), base64.RawURLEncoding.EncodeToString(mac.Sum(nil)[:16]); got != want {
			t.Errorf("HMAC id of %d bytes = %q, want %q", n, got, want)
		}
	}
}

// TestKeyAllocatesTheKeyOnly: Key allocates the key string and nothing
// else, for a short and a long identity. (With a secret the HMAC comes from
// a sync.Pool, which the race detector empties at random.)
func TestKeyAllocatesTheKeyOnly(t *testing.T) {
	k := NewKeyer("rl:", "")
	for _, id := range []string{"alice", strings.Repeat("k", 4096)} {
		if n := testing.AllocsPerRun(100, func() { k.Key("user", id, "tokens") }); n != 1 {
			t.Errorf("Key of a %d-byte identity: %v allocations, want 1", len(id), n)
		}
	}
}

// TestKeyOfIsKey: a key built from an identity hashed once (Hash, KeyOf)
// is the key Key builds, with or without a secret, for every unit, and
// for a model scope given in two parts.
func TestKeyOfIsKey(t *testing.T) {
	for _, secret := range []string{"", "s3cret"} {
		k := NewKeyer("rl:", secret)
		for _, identity := range []string{"", "alice", "sk-live-0123456789", "203.0.113.7/32", "{x}:y"} {
			id := k.Hash(identity)
			if got := string(id[:]); got != k.ID(identity) {
				t.Errorf("secret %q, %q: Hash %q, ID %q", secret, identity, got, k.ID(identity))
			}
			for _, unit := range []string{"", "tokens", "tokens:day", "concurrent"} {
				if got, want := k.KeyOf("user", &id, unit, ""), k.Key("user", identity, unit); got != want {
					t.Errorf("secret %q, %q, unit %q: KeyOf %q, Key %q", secret, identity, unit, got, want)
				}
			}
			model := k.ID("gpt-4o")
			if got, want := k.KeyOf("user", &id, "tokens:m:", model), k.Key("user", identity, "tokens:m:"+model); got != want {
				t.Errorf("secret %q, %q, scoped: KeyOf %q, Key %q", secret, identity, got, want)
			}
			if got, want := k.KeyOf("user", &id, "", "m:"+model), k.Key("user", identity, "m:"+model); got != want {
				t.Errorf("secret %q, %q, scoped requests: KeyOf %q, Key %q", secret, identity, got, want)
			}
		}
	}
}
