package bucket

import (
	"encoding/binary"
	"math"
	"math/big"
	"regexp"
	"strings"
	"testing"
	"time"
)

// The fuzz targets of the bucket package. `go test` runs each over its
// seeds (f.Add and testdata/fuzz/<name>); scripts/fuzz.sh runs them with
// -fuzz for a while. A crasher found becomes a file in testdata/fuzz.

// FuzzParseRate: ParseRate never panics and answers a short error; a rate
// it accepts is a positive,
// finite, reduced fraction; its float form reads back through RateFromFloat
// to a rate of the same float (and to the very same rate when the fraction
// is small enough for that to be guaranteed); its Spec compiles or fails
// cleanly; and its String form parses back to it when the period fits a
// time.Duration.
func FuzzParseRate(f *testing.F) {
	for _, s := range []string{
		"10/1m", "25/s", "600/1h", "0.5/s", "3", "0.17", "1/1d", "1/d", "7d", "1/7d", "1/0.5d",
		"1000000/s", "2.5e3/1h30m", "1/500ms", "1/1ns", "1e-9/s", " 5 / 1m ", "", "/", "0", "-1/s",
		"1/0s", "1/-1s", "NaN", "Inf", "+Inf/s", "1/1x", "0x10/s", "1/2/3", "1e999/s", "1e-999/s",
		"9223372036854775807/1ns", "1/2562047h", "1/106751d", "3/7s", ".5/s", "5./s", "1_000/s",
		"1/1e3s", "1/1.5d", "٣/s", "1/m ", "1 /m",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRate(s)
		if err != nil {
			// A message bounded by the input (quoted, up to 4 bytes a
			// byte) means bounded work: "1E980880" once expanded to a
			// million digits (testdata/fuzz/FuzzParseRate).
			if len(err.Error()) > 4096+4*len(s) {
				t.Fatalf("ParseRate(%.40q): error of %d bytes", s, len(err.Error()))
			}
			if r != (Rate{}) {
				t.Fatalf("ParseRate(%q) failed (%v) but returned %v", s, err, r)
			}
			return
		}
		num, den := r.Fraction()
		if num <= 0 || den <= 0 || new(big.Int).GCD(nil, nil, big.NewInt(num), big.NewInt(den)).Int64() != 1 {
			t.Fatalf("ParseRate(%q) = %d/%d: want a reduced fraction of positive integers", s, num, den)
		}
		fl := r.Float64()
		if !(fl > 0) || math.IsInf(fl, 0) {
			t.Fatalf("ParseRate(%q) = %v: float %v, want finite and > 0", s, r, fl)
		}
		back, err := RateFromFloat(fl)
		if err != nil {
			// Only a float whose simplest fraction does not fit in 64
			// bits may fail, and then cleanly.
			if back != (Rate{}) {
				t.Fatalf("RateFromFloat(%v) failed (%v) but returned %v", fl, err, back)
			}
		} else {
			if back.Float64() != fl {
				t.Fatalf("RateFromFloat(%v) = %v, whose float is %v", fl, back, back.Float64())
			}
			// Two fractions p/q ≠ p'/q' with q' ≤ q differ by at least
			// 1/(q·q'), more than the float's rounding interval when
			// p·q < 2^50: then the round trip is exact.
			if prod := new(big.Int).Mul(big.NewInt(num), big.NewInt(den)); prod.Cmp(big.NewInt(1<<50)) < 0 && back != r {
				t.Fatalf("RateFromFloat(%v) = %v, want %v (from %q)", fl, back, r, s)
			}
		}
		for _, capacity := range []int64{1, 60, 1 << 40, MaxExact - 1} {
			spec, err := Limit{Capacity: capacity, Rate: r}.Spec()
			if err != nil {
				continue
			}
			if spec.Scale <= 0 || spec.Refill <= 0 || spec.CapacityUnits() > MaxExact || spec.Refill*1000 > MaxExact {
				t.Fatalf("%q, capacity %d: spec %+v out of bounds", s, capacity, spec)
			}
			// refill/scale units per µs is the rate, num/den per second:
			// refill·den·10^6 = num·scale.
			lhs := new(big.Int).Mul(big.NewInt(spec.Refill), big.NewInt(den))
			lhs.Mul(lhs, big.NewInt(1_000_000))
			rhs := new(big.Int).Mul(big.NewInt(num), big.NewInt(spec.Scale))
			if lhs.Cmp(rhs) != 0 {
				t.Fatalf("%q: spec %+v is not %d/%d tokens per second", s, spec, num, den)
			}
		}
		if den <= int64(math.MaxInt64/time.Second) {
			again, err := ParseRate(r.String())
			if err != nil || again != r {
				t.Fatalf("ParseRate(%q) = %v, %v; want %v back (from %q)", r.String(), again, err, r, s)
			}
		}
	})
}

// fuzzNameRE is the dimension-name rule that the handler validates.
var fuzzNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// FuzzKey: for prefixes, dimensions and units the handler accepts, and any
// identities, Keyer.Key has the documented form and bounded length, exactly
// one '{' and one '}' around the hash tag {<dimension>:<id>}, and two
// different (dimension, identity, unit) triples never share a key; with a
// secret, the keys differ from the plain ones.
func FuzzKey(f *testing.F) {
	f.Add("rl:", "", "user", "alice", false, "user", "bob", false)
	f.Add("rl:", "", "user", "alice", false, "user", "alice", true)
	f.Add("rl:", "s3cret", "user", "alice", false, "ip", "alice", false)
	f.Add("", "", "a", "{b}", false, "a", "{b}c", false)
	f.Add("x:", "", "user", "a:b", false, "user:a", "b", false)
	f.Add("rl:", "", "user", "", false, "user", "\x00", false)
	f.Add("rl:", "k", "api_key", strings.Repeat("{", 4096), true, "api_key", strings.Repeat("}", 4096), true)
	f.Add("rl:", "", "user", "alice}:{user:bob", false, "user", "bob", false)
	f.Add("p", "", "d", "é", false, "d", "e\u0301", false)
	f.Fuzz(func(t *testing.T, prefix, secret, dimA, idA string, tokA bool, dimB, idB string, tokB bool) {
		if strings.ContainsAny(prefix, "{}") || len(prefix) > 64 || !fuzzNameRE.MatchString(dimA) || !fuzzNameRE.MatchString(dimB) {
			return // the handler refuses such a configuration
		}
		unit := func(tokens bool) string {
			if tokens {
				return "tokens"
			}
			return ""
		}
		uA, uB := unit(tokA), unit(tokB)
		k := NewKeyer(prefix, secret)
		keyA, keyB := k.Key(dimA, idA, uA), k.Key(dimB, idB, uB)
		for _, c := range []struct{ key, dim, id, unit string }{{keyA, dimA, idA, uA}, {keyB, dimB, idB, uB}} {
			want := prefix + "{" + c.dim + ":" + k.ID(c.id) + "}"
			if c.unit != "" {
				want += ":" + c.unit
			}
			if c.key != want {
				t.Fatalf("Key(%q, %q, %q) = %q, want %q", c.dim, c.id, c.unit, c.key, want)
			}
			if len(c.key) > 64+64+IDLength+3+len(":tokens") {
				t.Fatalf("key %q: %d bytes, more than the bound", c.key, len(c.key))
			}
			if strings.Count(c.key, "{") != 1 || strings.Count(c.key, "}") != 1 {
				t.Fatalf("key %q: want exactly one '{' and one '}'", c.key)
			}
			if tag := hashTag(c.key); tag != c.dim+":"+k.ID(c.id) {
				t.Fatalf("key %q: hash tag %q, want %q", c.key, tag, c.dim+":"+k.ID(c.id))
			}
		}
		same := dimA == dimB && idA == idB && uA == uB
		if same != (keyA == keyB) {
			t.Fatalf("(%q, %q, %q) and (%q, %q, %q): keys %q and %q", dimA, idA, uA, dimB, idB, uB, keyA, keyB)
		}
		if secret != "" && NewKeyer(prefix, "").Key(dimA, idA, uA) == keyA {
			t.Fatalf("secret %q changes nothing in key %q", secret, keyA)
		}
	})
}

// FuzzParseReply: any reply (its bytes read as int64s) for any number of
// buckets never panics ParseReply; a reply it accepts has the shape and
// the ranges of the script's contract (lua/token_bucket.lua) and gives a
// consistent Decision: allowed exactly when no bucket denies, the reason
// the strongest of the buckets', the wait the longest rate-limited wait,
// Deciding pointing at a bucket with that reason and wait, and a
// Retry-After of ⌈wait/1000⌉ seconds, at least 1.
func FuzzParseReply(f *testing.F) {
	seed := func(n uint8, vals ...int64) {
		b := make([]byte, 0, 8*len(vals))
		for _, v := range vals {
			b = binary.LittleEndian.AppendUint64(b, uint64(v))
		}
		f.Add(n, b)
	}
	seed(1, 9, 0, 3600000)
	seed(1, 0, 3600000, 3600000)
	seed(1, 10, -1, 0)
	seed(2, 4, 0, 7200000, 0, 1500, 36000000)
	seed(2, 0, 250, 1000, 0, 999, 5000)
	seed(2, 0, -1, 0, 0, 1, 1)
	seed(3, 1, 0, 1, 2, 0, 2, 3, 0, 3)
	seed(1, 0, -2, 0)
	seed(1, 0, 0, -1)
	seed(1, -1, 0, 0)
	seed(1, 0, math.MaxInt64, 0)
	seed(1, math.MinInt64, math.MaxInt64, math.MaxInt64)
	seed(1, MaxExact, MaxExact, MaxExact)
	seed(1, 0, 1)
	seed(0)
	seed(0, 1, 2, 3)
	f.Fuzz(func(t *testing.T, n uint8, raw []byte) {
		vals := make([]int64, len(raw)/8)
		for i := range vals {
			vals[i] = int64(binary.LittleEndian.Uint64(raw[8*i:]))
		}
		takes := make([]Take, n%16)
		for i := range takes {
			takes[i] = Take{Spec: Spec{Capacity: 10, Scale: 1, Refill: 1}, Cost: 1}
		}
		d, err := ParseReply(vals, takes)
		if err != nil {
			return
		}
		if len(vals) != 3*len(takes) || len(d.Buckets) != len(takes) {
			t.Fatalf("accepted %d values for %d buckets", len(vals), len(takes))
		}
		fuzzCheckDecision(t, vals, &d)
	})
}

// fuzzCheckDecision checks an accepted reply's Decision against the reply.
func fuzzCheckDecision(t *testing.T, vals []int64, d *Decision) {
	t.Helper()
	want := Decision{Allowed: true, Reason: Allowed, Deciding: -1}
	for i, b := range d.Buckets {
		remaining, wait, full := vals[3*i], vals[3*i+1], vals[3*i+2]
		// remaining is negative while a bucket is in debt after a
		// settlement of actual usage.
		if remaining < -MaxExact || remaining > MaxExact || wait < -1 || wait > MaxExact || full < 0 || full > MaxExact {
			t.Fatalf("bucket %d: accepted (%d, %d, %d), outside the script's ranges", i, remaining, wait, full)
		}
		if b.Remaining != remaining || b.FullMS != full {
			t.Fatalf("bucket %d: %+v from (%d, %d, %d)", i, b, remaining, wait, full)
		}
		switch {
		case wait == -1 && (b.Reason != CostExceedsCapacity || b.RetryAfterMS != 0),
			wait == 0 && (b.Reason != Allowed || b.RetryAfterMS != 0),
			wait > 0 && (b.Reason != RateLimited || b.RetryAfterMS != wait):
			t.Fatalf("bucket %d: %+v from wait %d", i, b, wait)
		}
		if b.Reason != Allowed {
			want.Allowed = false
		}
		if b.Reason > want.Reason {
			want.Reason = b.Reason
		}
		if b.Reason == RateLimited && b.RetryAfterMS > want.RetryAfterMS {
			want.RetryAfterMS = b.RetryAfterMS
		}
	}
	if want.Reason != RateLimited {
		want.RetryAfterMS = 0
	}
	if d.Allowed != want.Allowed || d.Reason != want.Reason || d.RetryAfterMS != want.RetryAfterMS {
		t.Fatalf("decision %+v, want allowed %v, reason %v, wait %d", d, want.Allowed, want.Reason, want.RetryAfterMS)
	}
	if d.Allowed != (d.Deciding == -1) {
		t.Fatalf("decision %+v: allowed %v with deciding bucket %d", d, d.Allowed, d.Deciding)
	}
	if !d.Allowed {
		b := d.Buckets[d.Deciding]
		if b.Reason != d.Reason || (d.Reason == RateLimited && b.RetryAfterMS != d.RetryAfterMS) {
			t.Fatalf("decision %+v: deciding bucket %d is %+v", d, d.Deciding, b)
		}
	}
	sec := new(big.Int).Add(big.NewInt(d.RetryAfterMS), big.NewInt(999))
	sec.Div(sec, big.NewInt(1000))
	if !sec.IsInt64() {
		t.Fatalf("decision %+v: Retry-After does not fit in 64 bits", d)
	}
	if got := d.RetryAfterSeconds(); got != max(1, sec.Int64()) {
		t.Fatalf("decision %+v: Retry-After %d, want max(1, ⌈%d/1000⌉) = %d", d, got, d.RetryAfterMS, max(1, sec.Int64()))
	}
}
