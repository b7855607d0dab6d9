package bucket

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"hash"
	"strings"
	"sync"
	"unsafe"
)

// IDLength is the length of a hashed identity in a key: 16 bytes of
// SHA-256 (or HMAC-SHA-256) in unpadded base64url.
const IDLength = 22

// Keyer builds bucket keys. A key is
//
//	<prefix>{<dimension>:<id>}        for a requests limit
//	<prefix>{<dimension>:<id>}:<unit> for a limit in another unit ("tokens")
//
// where <id> is the first 16 bytes of SHA-256(identity), or of
// HMAC-SHA-256(secret, identity) when a secret is set, in unpadded base64url.
// Raw identities (API keys, user ids) never reach Redis; any identity, of any
// length and with any bytes, gives a key of bounded length that no other
// identity shares (short of a 128-bit hash collision); and the braces make
// {<dimension>:<id>} the Redis Cluster hash tag, so one identity's buckets
// share a slot and no identity can choose its slot.
type Keyer struct {
	prefix string
	macs   *sync.Pool // of *macState keyed with the secret; nil without one
}

// NewKeyer returns a Keyer with the key prefix and the HMAC secret ("" for
// plain SHA-256). The prefix must not contain '{' or '}'.
func NewKeyer(prefix, secret string) Keyer {
	k := Keyer{prefix: prefix}
	if secret != "" {
		key := []byte(secret)
		k.macs = &sync.Pool{New: func() any {
			return &macState{mac: hmac.New(sha256.New, key), sum: make([]byte, 0, sha256.Size)}
		}}
	}
	return k
}

// Keyed reports whether k hashes with HMAC-SHA-256 under a secret.
func (k Keyer) Keyed() bool { return k.macs != nil }

// ID returns the hashed form of identity used in keys and logs.
func (k Keyer) ID(identity string) string {
	var buf [IDLength]byte
	return string(k.appendID(buf[:0], identity))
}

// Key returns the key of identity's bucket in dimension; unit is "" for a
// requests limit. It allocates the key and nothing else, for an identity of
// any length.
func (k Keyer) Key(dimension, identity, unit string) string {
	id := k.Hash(identity)
	return k.KeyOf(dimension, &id, unit, "")
}

// Hash is an identity's <id> in keys: see Keyer.
type Hash [IDLength]byte

// Hash returns identity's <id>, for KeyOf: an identity with several
// buckets is hashed once.
func (k Keyer) Hash(identity string) Hash {
	var id Hash
	k.appendID(id[:0], identity)
	return id
}

// KeyOf returns the key of the bucket in dimension of the identity whose
// <id> is id (see Hash), as Key does, with unit+more after it (both ""
// for a requests limit): a model scope's key without joining its parts
// first. It allocates the key and nothing else.
func (k Keyer) KeyOf(dimension string, id *Hash, unit, more string) string {
	n := len(k.prefix) + len(dimension) + IDLength + 3
	if unit != "" || more != "" {
		n += 1 + len(unit) + len(more)
	}
	var b strings.Builder
	b.Grow(n)
	b.WriteString(k.prefix)
	b.WriteByte('{')
	b.WriteString(dimension)
	b.WriteByte(':')
	b.Write(id[:])
	b.WriteByte('}')
	if unit != "" || more != "" {
		b.WriteByte(':')
		b.WriteString(unit)
		b.WriteString(more)
	}
	return b.String()
}

// appendID appends identity's id. The identity is hashed where it is,
// without a copy: SHA-256 and HMAC only read their input.
func (k Keyer) appendID(b []byte, identity string) []byte {
	in := unsafe.Slice(unsafe.StringData(identity), len(identity)) // read-only
	if k.macs != nil {
		return k.appendMAC(b, in)
	}
	sum := sha256.Sum256(in)
	return base64.RawURLEncoding.AppendEncode(b, sum[:16])
}

// macState is a keyed HMAC and a buffer for its sum, pooled together.
type macState struct {
	mac hash.Hash
	sum []byte
}

func (k Keyer) appendMAC(b, identity []byte) []byte {
	st := k.macs.Get().(*macState)
	st.mac.Reset()
	_, _ = st.mac.Write(identity)
	st.sum = st.mac.Sum(st.sum[:0])
	b = base64.RawURLEncoding.AppendEncode(b, st.sum[:16])
	k.macs.Put(st)
	return b
}
