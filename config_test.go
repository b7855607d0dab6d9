package tokenbucket

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseBlock parses a token_bucket block: one dimension "user" and a tier
// "free" with one limit, plus extra.
func parseBlock(extra string) (*Handler, error) {
	h := new(Handler)
	d := caddyfile.NewTestDispenser("token_bucket {\n\tdimension user {http.request.header.X-User}\n" + extra + "\n}")
	return h, h.UnmarshalCaddyfile(d)
}

const freeTier = "\ttier free {\n\t\tuser 10 1/s\n\t}\n"

// TestConfigMessages: each configuration error names the field and states
// the true range; the Caddyfile and the JSON forms accept the same values.
func TestConfigMessages(t *testing.T) {
	for _, tc := range []struct {
		name, block, want string
	}{
		{"default_max_tokens_0", freeTier + "cost estimate {\n\tdefault_max_tokens 0\n}",
			`invalid estimate default_max_tokens "0": must be an integer from 1 to 9007199254740991`},
		{"refill_1e400", "tier free {\n\tuser 10 1e400\n}",
			`invalid refill "1e400" for dimension "user": refill rate too large: at most 9223372036854775807 tokens per second`},
		{"refill_tiny", "tier free {\n\tuser 10 1e-30/s\n}",
			`invalid refill "1e-30/s" for dimension "user": refill rate too small: at least 1/9223372036854775807 token per second`},
		{"max_body_2GiB", freeTier + "cost estimate {\n\tmax_body 2GiB\n}",
			`invalid estimate max_body "2GiB": must be a size from 1B to 1GiB`},
		{"tokenizer", freeTier + "cost estimate {\n\ttokenizer gpt2\n}",
			`estimate.tokenizer "gpt2": must be approx, o200k_base or cl100k_base`},
		{"read_timeout", freeTier + "cost estimate {\n\tread_timeout 0s\n}",
			`invalid estimate read_timeout "0s": must be a duration > 0`},
		{"read_timeout_unknown_unit", freeTier + "cost estimate {\n\tread_timeout 1y\n}",
			`invalid estimate read_timeout "1y": time: unknown unit "y" in duration "1y"`},
		{"max_body_unknown_unit", freeTier + "cost estimate {\n\tmax_body 2XB\n}",
			`invalid estimate max_body "2XB": unhandled size name: xb`},
		{"error_format", freeTier + "error_format xml",
			`error_format "xml": must be json, openai or anthropic`},
		{"include_usage_without_estimate", freeTier + "settle {\n\tinclude_usage\n}",
			`settle.include_usage needs estimate (cost estimate)`},
		{"settle_unknown", freeTier + "cost estimate\nsettle {\n\tusage\n}", `unknown settle option "usage"`},
		{"settle_header_twice", freeTier + "cost estimate\nsettle header X-A {\n\theader X-B\n}", `duplicate settle option "header"`},
		{"pool_size_negative", freeTier + "redis {\n\tpool_size -1\n}", `invalid redis pool_size "-1": must be a whole number ≥ 0 (0: the default)`},
		{"pool_size_too_large", freeTier + "redis {\n\tpool_size 1000000000000\n}", `invalid redis pool_size "1000000000000": must be a whole number from 0 (the default) to 10000`},
		{"demote_window_under_1ms", "tier free {\n\tuser 1 1/h\n}\ntier pen {\n\tuser 1 1/h\n}\ndemote after 2 denials within 999us to tier pen for 1m",
			`invalid demote window "999us": must be a duration of at least 1ms`},
		{"demote_for_under_1ms", "tier free {\n\tuser 1 1/h\n}\ntier pen {\n\tuser 1 1/h\n}\ndemote after 2 denials within 1m to tier pen for 999us",
			`invalid demote duration "999us": must be a duration of at least 1ms`},
		{"demote_window_unknown_unit", "tier free {\n\tuser 1 1/h\n}\ntier pen {\n\tuser 1 1/h\n}\ndemote after 2 denials within 1y to tier pen for 1m",
			`invalid demote window "1y": time: unknown unit "y" in duration "1y"`},
		{"demote_for_too_large_to_parse", "tier free {\n\tuser 1 1/h\n}\ntier pen {\n\tuser 1 1/h\n}\ndemote after 2 denials within 1m to tier pen for 100000000h",
			`invalid demote duration "100000000h": time: invalid duration "100000000h"`},
		{"demote_denials_not_a_number", "tier free {\n\tuser 1 1/h\n}\ntier pen {\n\tuser 1 1/h\n}\ndemote after 1e3 denials within 1m to tier pen for 1m",
			`invalid demote denials "1e3": strconv.ParseInt: parsing "1e3": invalid syntax`},
		{"max_waiting_without_wait", freeTier + "max_waiting 5", "max_waiting 5: only with on_limit wait"},
		{"demote_denials_beyond_2^53", "tier free {\n\tuser 1 1/h\n}\ntier pen {\n\tuser 1 1/h\n}\ndemote after 9007199254740993 denials within 1m to tier pen for 1m",
			`invalid demote denials "9007199254740993": must be an integer from 1 to 9007199254740991`},
		{"cost_brace_without_placeholder", freeTier + `cost "5{"`, `cost "5{": must be an integer`},
		{"empty_on_redis_error", freeTier + `on_redis_error ""`, "on_redis_error: an empty value; leave the subdirective out for its default"},
		{"empty_key_secret", freeTier + `key_secret ""`, "key_secret: an empty value"},
		{"empty_cost", freeTier + `cost ""`, "cost: an empty value"},
		{"empty_settle_header", freeTier + "cost estimate\nsettle header \"\"", "settle header: an empty value"},
		{"settle_header_not_a_token", freeTier + "cost estimate\nsettle header X(Y)", `settle.header "X(Y)": not a header name`},
		{"settle_header_non_ascii", freeTier + "cost estimate\nsettle header X-Ü", `settle.header "X-Ü": not a header name`},
		{"empty_redis_url", freeTier + `redis ""`, "redis: an empty value"},
		{"empty_redis_address", freeTier + "redis {\n\taddress \"\"\n}", "address: an empty value"},
		{"empty_tokenizer", freeTier + "cost estimate {\n\ttokenizer \"\"\n}", "tokenizer: an empty value"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseBlock(tc.block)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v\nwant it to contain %s", err, tc.want)
			}
			if err != nil && len(err.Error()) > 300 {
				t.Errorf("error of %d bytes: %.300s…", len(err.Error()), err)
			}
		})
	}
}

// TestConfigAcceptedAlike: values the JSON form takes, the Caddyfile takes
// too, with the same meaning.
func TestConfigAcceptedAlike(t *testing.T) {
	h, err := parseBlock(freeTier + "redis {\n\tpool_size 0\n\tbreaker_failures 0\n}\ncost estimate {\n\ttokenizer o200k_base\n\tread_timeout 2s\n}\nsettle {\n\tinclude_usage\n\tkeep_failed\n\theader X-Used\n}\nerror_format openai")
	if err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(struct {
		R *RedisConfig
		E *Estimate
		S *Settle
		F string
	}{h.Redis, h.Estimate, h.Settle, h.ErrorFormat})
	const want = `{"R":{},"E":{"tokenizer":"o200k_base","read_timeout":2000000000},"S":{"header":"X-Used","include_usage":true,"keep_failed":true},"F":"openai"}`
	if string(got) != want {
		t.Errorf("parsed %s\nwant %s", got, want)
	}
	if _, err := parseBlock(freeTier + "settle header X-Used"); err != nil {
		t.Errorf("settle header <name>: %v", err)
	}
	// local_share as the docs write it for N gateways, 1/N, or a decimal.
	for v, want := range map[string]float64{"1/3": 1.0 / 3, "2/4": 0.5, "0.25": 0.25, "1": 1} {
		h, err := parseBlock(freeTier + "local_share " + v)
		if err != nil || h.LocalShare != want {
			t.Errorf("local_share %s: %v, %v; want %v", v, h.LocalShare, err, want)
		}
	}
}

// TestJSONConfigMessages: the JSON form's errors state the same ranges.
func TestJSONConfigMessages(t *testing.T) {
	base := `"dimensions":[{"name":"user","identity":"{u}"}],"tiers":[{"name":"free","limits":[{"dimension":"user","capacity":10,"refill_rate":1}]}]`
	for _, tc := range []struct {
		name, json, want string
	}{
		{"max_body_4GiB", `"estimate":{"max_body":4294967296}`,
			"estimate.max_body 4294967296: must be a size from 1B to 1GiB (1073741824 bytes)"},
		{"default_max_tokens", `"estimate":{"default_max_tokens":-1}`,
			"estimate.default_max_tokens -1: must be an integer from 1 to 9007199254740991"},
		{"pool_size", `"redis":{"pool_size":-1}`, "redis.pool_size -1: must be a whole number from 0 (the default) to 10000; the default is go-redis's, 10 per CPU"},
		{"pool_size_too_large", `"redis":{"pool_size":1000000000000}`, "redis.pool_size 1000000000000: must be a whole number from 0 (the default) to 10000"},
		{"breaker_failures", `"redis":{"breaker_failures":-2}`, "redis.breaker_failures -2: must be a whole number ≥ 0 (0: the default); the default is 5"},
		{"error_format", `"error_format":"OpenAI"`, `error_format "OpenAI": must be json, openai or anthropic`},
		{"include_usage", `"settle":{"include_usage":true}`, "settle.include_usage needs estimate"},
		{"demote_for_under_1ms", `"tiers":[{"name":"free","limits":[{"dimension":"user","capacity":1,"refill_rate":1}]},{"name":"pen","limits":[{"dimension":"user","capacity":1,"refill_rate":1}]}],"demote":{"denials":2,"within":60000000000,"tier":"pen","for":1}`,
			"demote.for 1ns: must be a duration of at least 1ms"},
		{"empty_address", `"redis":{"address":[""]}`, `redis.address [""]: an address is empty`},
		{"max_waiting_without_wait", `"max_waiting":5`, "max_waiting 5: only with on_limit wait"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h Handler
			if err := json.Unmarshal([]byte("{"+base+","+tc.json+"}"), &h); err != nil {
				t.Fatal(err)
			}
			err := h.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v\nwant it to contain %s", err, tc.want)
			}
		})
	}
}

// TestCompile: the pure step from the configuration to its request-path
// form, without Redis or a Caddy context: defaults, tiers with their
// RateLimit-Policy, the lone-placeholder identities, the static cost, the
// deny cache and the demotion rule. (The local store comes with Provision:
// see TestLocalStateAcrossReloads.)
func TestCompile(t *testing.T) {
	var h Handler
	if err := json.Unmarshal([]byte(`{
		"dimensions":[{"name":"user","identity":"{http.request.header.X-User}"},{"name":"ip","identity":"ip:{client_ip}"}],
		"tiers":[{"name":"free","limits":[{"dimension":"user","capacity":10,"refill_rate":0.16666666666666666},
			{"dimension":"user","capacity":1000,"refill_rate":100,"unit":"tokens"}]},
			{"name":"pro","limits":[{"dimension":"ip","capacity":60,"refill_rate":1}]}],
		"default_tier":"pro","cost":"7","deny_cache":-1}`), &h); err != nil {
		t.Fatal(err)
	}
	if err := h.compile(); err != nil {
		t.Fatal(err)
	}
	if h.KeyPrefix != "rl:" || h.IPv4Prefix != 32 || h.IPv6Prefix != 64 {
		t.Errorf("defaults: %q %d %d", h.KeyPrefix, h.IPv4Prefix, h.IPv6Prefix)
	}
	if h.deflt != h.tiers["pro"] || len(h.tiers) != 2 {
		t.Errorf("default tier %v of %d", h.deflt, len(h.tiers))
	}
	if got := h.tiers["free"].policy; got != `"user";q=10;w=60, "user-tokens";q=1000;w=10` {
		t.Errorf("free policy %s", got)
	}
	if h.idSources[0] != (idSource{key: "http.request.header.X-User", header: "X-User"}) || h.idSources[1] != (idSource{}) {
		t.Errorf("identity sources %+v", h.idSources)
	}
	if h.cost != 7 || h.denials != nil || h.demote != nil {
		t.Errorf("cost %d, deny cache %v, demotion %v", h.cost, h.denials, h.demote)
	}
	if key := h.keyer.Key("user", "alice", ""); !strings.HasPrefix(key, "rl:{user:") {
		t.Errorf("key %q", key)
	}
}

// TestReadyCaddyfileErrors: token_bucket_ready rejects what token_bucket
// rejects: a repeated subdirective, an unknown one.
func TestReadyCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ name, block, want string }{
		{"allow_degraded_twice", "allow_degraded\nallow_degraded", `duplicate subdirective "allow_degraded"`},
		{"redis_twice", "redis redis://127.0.0.1:1\nredis redis://127.0.0.1:2", `duplicate subdirective "redis"`},
		{"unknown", "degraded_ok", `unknown subdirective "degraded_ok"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rd Ready
			err := rd.UnmarshalCaddyfile(caddyfile.NewTestDispenser("token_bucket_ready {\n" + tc.block + "\n}"))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v\nwant it to contain %s", err, tc.want)
			}
		})
	}
}
