package tokenbucket

import (
	"encoding/json"
	"math/big"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
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
		tiers, deflt := compileTiers(back.Dimensions, back.Tiers, back.DefaultTier, back.LocalShare)
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
