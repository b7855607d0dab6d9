package tokenbucket

import (
	"encoding/json"
	"math/big"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/llm"
)

// The fuzz targets of the handler package. `go test` runs each over its
// seeds (f.Add and testdata/fuzz/<name>); scripts/fuzz.sh runs them with
// -fuzz for a while. A crasher found becomes a file in testdata/fuzz.

// fuzzCaddyfileSeeds are token_bucket blocks, valid and not, for
// FuzzCaddyfile to mutate.
var fuzzCaddyfileSeeds = []string{
	`token_bucket {
	redis redis://127.0.0.1:6379/1
	key_prefix rl:
	dimension user {http.auth.user.id}
	dimension ip {client_ip}
	ipv4_prefix 24
	ipv6_prefix 56
	tier_from {tier}
	default_tier free
	tier free {
		user 10 10/1m
		user 1000 1000/1h tokens
		ip 100 0.5/s
	}
	tier pro {
		user 60 1/s requests
	}
	cost {http.request.header.X-Estimated-Tokens}
	on_redis_error local
	local_buckets 1000
	local_share 0.5
	on_deny error
}`,
	`token_bucket {
	redis {
		address 10.0.0.1:26379 10.0.0.2:26379
		sentinel mymaster
		sentinel_password {env.SENTINEL_PASSWORD}
		username limiter
		password {env.REDIS_PASSWORD}
		db 2
		tls
		tls_server_name redis.internal
		timeout 150ms
		pool_size 32
		breaker_failures 3
		breaker_cooldown 5s
	}
	key_secret {env.TOKEN_BUCKET_KEY_SECRET}
	dimension api_key {http.request.header.X-API-Key}
	tier enterprise {
		api_key 1500 25/s
	}
	cost 7
	on_redis_error deny
}`,
	`token_bucket {
	redis {
		address 10.0.0.1:7000 10.0.0.2:7000
		cluster
	}
	dimension user {http.auth.user.id}
	tier free {
		user 9007199254740991 1000000/s tokens
	}
	cost 0
}`,
	`token_bucket {
	dimension user {http.auth.user.id}
	tier free {
		user 10 1/d
	}
}`,
	`token_bucket {
	dimension user {x}
	tier free {
		nobody 10 1/s
	}
}`,
	`token_bucket {
	dimension user {x}
	dimension user {y}
	tier a {
		user 0 1/s
	}
	tier a {
		user 1 NaN
	}
	default_tier b
	key_prefix {x}
	cost -1
	cost 1.5
}`,
	`token_bucket extra {
	unknown 1
}`,
	`token_bucket {
	tier free {
		user 10 1e999999/1e-999999d
	}
}`,
	`token_bucket {
	dimension u {x}
	tier t {
		u 10 1/3s
		u 10 1/7s tokens
		u 10 1/9s bananas
	}
	ipv4_prefix 33
	ipv6_prefix 0
	local_share 1.5
	local_buckets -1
}`,
	"token_bucket {\n\tredis\n\tredis redis://a redis://b\n}",
	"token_bucket {\n\tdimension\n\ttier\n\ttier x {\n\t\t{\n\t}\n}",
	"token_bucket",
	"",
	"{",
	"token_bucket {\n\ttier free {\n\t\tuser 10 10/1m {\n\t\t\tnested\n\t\t}\n\t}\n}",
}

// FuzzCaddyfile: UnmarshalCaddyfile never panics on any Caddyfile text,
// and when it accepts a config, validate() accepts it too, the JSON it
// becomes loads back valid with the same limits (as `caddy adapt` then
// `caddy run` would), and the tiers compile with a default tier.
func FuzzCaddyfile(f *testing.F) {
	for _, s := range fuzzCaddyfileSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		// NewTestDispenser exits the process on a tokenizer error, and
		// expands {$ENV} from this machine's environment: keep to text
		// that tokenizes, without environment variables.
		if strings.Contains(text, "{$") {
			return
		}
		if _, err := caddyfile.Tokenize([]byte(text), "Testfile"); err != nil {
			return
		}
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(text)); err != nil {
			return
		}
		if err := h.validate(); err != nil {
			t.Fatalf("UnmarshalCaddyfile accepted a config that validate() refuses: %v\n%s", err, text)
		}
		b, err := json.Marshal(&h)
		if err != nil {
			t.Fatalf("marshalling an accepted config: %v", err)
		}
		var back Handler
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatalf("the JSON of an accepted config does not load: %v\n%s", err, b)
		}
		if err := back.validate(); err != nil {
			t.Fatalf("the JSON of an accepted config is invalid: %v\n%s\nfrom\n%s", err, b, text)
		}
		fuzzSameSpecs(t, &h, &back)
		tiers, deflt := compileTiers(back.Dimensions, back.Tiers, back.DefaultTier, back.LocalShare, back.Shadow)
		if deflt == nil || len(tiers) != len(back.Tiers) {
			t.Fatalf("compiled %d tiers of %d, default %v", len(tiers), len(back.Tiers), deflt)
		}
	})
}

// fuzzSameSpecs checks that every limit compiles to the same integer spec
// from the Caddyfile config and from its JSON: the refill rate's float
// round trip loses nothing.
func fuzzSameSpecs(t *testing.T, a, b *Handler) {
	t.Helper()
	for i := range a.Tiers {
		for j, l := range a.Tiers[i].Limits {
			sa, errA := l.spec()
			sb, errB := b.Tiers[i].Limits[j].spec()
			if errA != nil || errB != nil || sa != sb {
				t.Fatalf("tier %q limit %d: spec %+v (%v) from the Caddyfile, %+v (%v) from JSON", a.Tiers[i].Name, j, sa, errA, sb, errB)
			}
		}
	}
}

// FuzzParseCost: parseCost accepts exactly the strings of ASCII decimal
// digits whose value is from 0 to 2^53-1 (MaxCost), leading zeros and all,
// and returns that value; it refuses everything else (signs, spaces,
// fractions, exponents, hex, other scripts' digits, overflow). The
// reference is math/big.
func FuzzParseCost(f *testing.F) {
	for _, s := range []string{
		"0", "1", "7", "10", "007", "9007199254740991", "9007199254740992", "09007199254740991",
		"00000000000000000000000001", "00000000000000000", "18446744073709551616", "99999999999999999999",
		"", "-1", "-0", "+1", "1.5", "0.0", "1e3", "0x10", "1_000", " 1", "1 ", "٣", "５", "NaN", "Inf",
		"abc", "1\x00", "\x001",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := parseCost(s)
		want, ok := fuzzRefCost(s)
		if ok != (err == nil) || (ok && got != want) {
			t.Fatalf("parseCost(%.60q) = %d, %v; want %d, accepted %v", s, got, err, want, ok)
		}
		if err == nil && (got < 0 || got > MaxCost) {
			t.Fatalf("parseCost(%.60q) = %d: out of 0..MaxCost", s, got)
		}
	})
}

// fuzzRefCost is the reference for parseCost.
func fuzzRefCost(s string) (int64, bool) {
	if s == "" {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	n, ok := new(big.Int).SetString(s, 10)
	if !ok || n.Cmp(big.NewInt(MaxCost)) > 0 {
		return 0, false
	}
	return n.Int64(), true
}

// FuzzSettle: whatever a response body holds, in whatever framing and
// encoding, the usage the recorder reads is 0 to 2^53-1 tokens, and the
// settlement it makes never gives a bucket back more than the request
// was charged.
func FuzzSettle(f *testing.F) {
	f.Add([]byte(`{"usage":{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21}}`), uint8(0), int64(100))
	f.Add([]byte(`{"usage":{"prompt_tokens":-500,"completion_tokens":1}}`), uint8(0), int64(100))
	f.Add([]byte(`{"usage":{"prompt_tokens":9223372036854775807,"completion_tokens":9223372036854775807}}`), uint8(1), int64(7))
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"total_tokens\":3}}\n\n"), uint8(2), int64(1000))
	f.Add([]byte("event: message_start\ndata: {\"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n"), uint8(3), int64(50))
	_, limits := answerTier(f, Limit{Dimension: "user", Capacity: MaxCost, RefillRate: 1, Unit: UnitTokens})
	f.Fuzz(func(t *testing.T, body []byte, shape uint8, cost int64) {
		if cost < 0 || cost > MaxCost {
			return
		}
		w := httptest.NewRecorder()
		if shape&2 != 0 {
			w.Header().Set("Content-Type", "text/event-stream")
		}
		if shape&1 != 0 {
			w.Header().Set("Content-Encoding", "gzip")
			body = gzipped(t, string(body))
		}
		rec := &usageRecorder{ResponseWriter: w, read: true, filterUsage: shape&4 != 0}
		for len(body) > 0 {
			n := min(len(body), int(shape>>3)+1)
			rec.Write(body[:n])
			body = body[n:]
		}
		used, status, partial := rec.finish(&Settle{})
		if status != llm.Found {
			if used != 0 {
				t.Fatalf("status %v with %d tokens", status, used)
			}
			return
		}
		if used < 0 || used > MaxCost {
			t.Fatalf("usage %d out of 0..2^53-1", used)
		}
		req := &request{keys: []string{"k"}, limits: limits, takes: []bucket.Take{{Spec: limits[0].spec, Cost: cost}}}
		st := req.adjustments(&bucket.Decision{Allowed: true, Deciding: -1, Buckets: make([]bucket.Result, 1)}, used, partial, false)
		for _, a := range st.adj {
			if a.Delta < -cost {
				t.Fatalf("used %d of %d charged: gives back %d", used, cost, -a.Delta)
			}
		}
	})
}
