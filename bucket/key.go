package bucket

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"hash"
	"sync"
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
	macs   *sync.Pool // of hash.Hash keyed with the secret; nil without one
}

// NewKeyer returns a Keyer with the key prefix and the HMAC secret ("" for
// plain SHA-256). The prefix must not contain '{' or '}'.
func NewKeyer(prefix, secret string) Keyer {
	k := Keyer{prefix: prefix}
	if secret != "" {
		key := []byte(secret)
		k.macs = &sync.Pool{New: func() any { return hmac.New(sha256.New, key) }}
	}
	return k
}

// ID returns the hashed form of identity used in keys and logs.
func (k Keyer) ID(identity string) string {
	var buf [IDLength]byte
	return string(k.appendID(buf[:0], identity))
}

// Key returns the key of identity's bucket in dimension; unit is "" for a
// requests limit.
func (k Keyer) Key(dimension, identity, unit string) string {
	n := len(k.prefix) + len(dimension) + IDLength + 3
	if unit != "" {
		n += 1 + len(unit)
	}
	b := make([]byte, 0, n)
	b = append(b, k.prefix...)
	b = append(b, '{')
	b = append(b, dimension...)
	b = append(b, ':')
	b = k.appendID(b, identity)
	b = append(b, '}')
	if unit != "" {
		b = append(b, ':')
		b = append(b, unit...)
	}
	return string(b)
}

func (k Keyer) appendID(b []byte, identity string) []byte {
	var sum [sha256.Size]byte
	if k.macs == nil {
		sum = sha256.Sum256([]byte(identity))
	} else {
		mac := k.macs.Get().(hash.Hash)
		mac.Reset()
		mac.Write([]byte(identity))
		mac.Sum(sum[:0])
		k.macs.Put(mac)
	}
	return base64.RawURLEncoding.AppendEncode(b, sum[:16])
}
