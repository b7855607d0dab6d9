package tokenbucket

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// Configuration errors, each naming the field and the bad value: the
// parser and the compile step in tables, a few through a live load.

// limitCase is a handler with one dimension "user" and a tier "free" whose
// limit lines are limits.
func limitCase(limits string) string {
	return "dimension user {http.auth.user.id}\ntier free {\n" + limits + "\n}"
}

var caddyfileErrorCases = []struct {
	name  string
	block string // the body of token_bucket { }
	want  string
}{
	{"capacity zero", limitCase("user 0 1/s"), `invalid capacity "0" for dimension "user": must be an integer from 1 to 9007199254740991`},
	{"capacity negative", limitCase("user -5 1/s"), `invalid capacity "-5" for dimension "user"`},
	{"capacity fraction", limitCase("user 1.5 1/s"), `invalid capacity "1.5" for dimension "user": strconv.ParseInt: parsing "1.5": invalid syntax`},
	{"capacity beyond int64", limitCase("user 99999999999999999999 1/s"),
		`invalid capacity "99999999999999999999" for dimension "user": strconv.ParseInt: parsing "99999999999999999999": value out of range`},
	{"concurrent not a number", limitCase("user two concurrent"), `invalid concurrent "two" for dimension "user": strconv.ParseInt: parsing "two": invalid syntax`},
	{"quota amount not a number", limitCase("user ten per day"), `invalid quota amount "ten" for dimension "user": strconv.ParseInt: parsing "ten": invalid syntax`},
	{"capacity NaN", limitCase("user NaN 1/s"), `invalid capacity "NaN" for dimension "user"`},
	{"capacity above 2^53-1", limitCase("user 9007199254740992 1/s"), `invalid capacity "9007199254740992" for dimension "user"`},
	{"refill zero", limitCase("user 10 0"), `invalid refill "0" for dimension "user": refill amount "0" must be > 0`},
	{"refill negative", limitCase("user 10 -1/s"), `invalid refill "-1/s" for dimension "user": refill amount "-1" must be > 0`},
	{"refill NaN", limitCase("user 10 NaN"), `invalid refill "NaN" for dimension "user": refill amount "NaN" is not a number`},
	{"refill Inf", limitCase("user 10 Inf"), `invalid refill "Inf" for dimension "user": refill amount "Inf" is not a number`},
	{"refill missing period", limitCase("user 10 10/"), `invalid refill "10/" for dimension "user": refill period "" is not a duration`},
	{"refill bad period", limitCase("user 10 10/xyz"), `invalid refill "10/xyz" for dimension "user": refill period "xyz" is not a duration`},
	{"refill zero period", limitCase("user 10 10/0s"), `invalid refill "10/0s" for dimension "user": refill period "0s" must be > 0`},
	{"refill missing amount", limitCase("user 10 /s"), `invalid refill "/s" for dimension "user": missing refill amount`},
	{"capacity too large to be exact at this refill", limitCase("user 9007199254740991 1/d"),
		`tiers[0].limits[0]: tier "free", dimension "user": capacity 9007199254740991 with refill rate 1/86400s cannot be computed exactly`},
	{"bad unit", limitCase("user 10 1/s bytes"), `invalid unit "bytes" for dimension "user": must be requests or tokens (a concurrency limit is <n> concurrent, without a refill)`},
	{"undeclared dimension", limitCase("org 10 1/s"), `tiers[0].limits[0].dimension "org": tier "free" limits an undeclared dimension`},
	{"duplicate requests limit", limitCase("user 10 1/s\nuser 20 1/s requests"), `tiers[0].limits[1]: tier "free" has two requests limits on dimension "user"`},
	{"duplicate tokens limit", limitCase("user 10 1/s tokens\nuser 20 1/s tokens"), `tiers[0].limits[1]: tier "free" has two tokens limits on dimension "user"`},
	{"default_tier names no tier", limitCase("user 10 1/s") + "\ndefault_tier gold", `default_tier "gold": no tier has that name`},
	{"no tiers", "dimension user {http.auth.user.id}", `tiers: at least one tier is required`},
	{"tier without limits", "dimension user {http.auth.user.id}\ntier free {\n}", `tiers[0].limits: tier "free" has no limits`},
	{"duplicate tier", limitCase("user 10 1/s") + "\ntier free {\nuser 5 1/s\n}", `tiers[1].name "free": duplicate tier`},
	{"duplicate dimension", "dimension user {http.auth.user.id}\n" + limitCase("user 10 1/s"), `dimensions[1].name "user": duplicate dimension`},
	{"bad dimension name", "dimension user.id {http.auth.user.id}\ntier free {\nuser.id 10 1/s\n}", `dimensions[0].name "user.id": must be 1 to 64 letters, digits, '_' or '-'`},
	{"bad tier name", "dimension user {http.auth.user.id}\ntier fr/ee {\nuser 10 1/s\n}", `tiers[0].name "fr/ee": must be 1 to 64 letters, digits, '_' or '-'`},
	{"duplicate subdirective", "key_prefix a:\nkey_prefix b:\n" + limitCase("user 10 1/s"), `duplicate subdirective "key_prefix"`},
	{"unknown subdirective", limitCase("user 10 1/s") + "\nburst 5", `unknown subdirective "burst"`},
	{"unknown redis option", "redis {\nhostname cache\n}\n" + limitCase("user 10 1/s"), `unknown redis option "hostname"`},
	{"duplicate redis option", "redis {\ntimeout 1s\ntimeout 2s\n}\n" + limitCase("user 10 1/s"), `duplicate redis option "timeout"`},
	{"dimension with one argument", "dimension user\n" + limitCase("user 10 1/s"), `dimension ["user"]: wrong argument count, want <name> <placeholder template>`},
	{"dimension with three arguments", "dimension user {a} {b}\n" + limitCase("user 10 1/s"), `dimension ["user" "{a}" "{b}"]: wrong argument count`},
	{"limit with one argument", limitCase("user 5"), `limit user ["5"]: wrong argument count, want <capacity> <refill> [requests|tokens], <amount> per day|week|month [requests|tokens] or <n> concurrent, then [models <glob>...] [shadow]`},
	{"limit with four arguments", limitCase("user 5 1/s tokens extra"), `limit user ["5" "1/s" "tokens" "extra"]: wrong argument count`},
	{"key_prefix without argument", "key_prefix\n" + limitCase("user 10 1/s"), `key_prefix []: wrong argument count, want one value`},
	{"key_prefix with two arguments", "key_prefix a: b:\n" + limitCase("user 10 1/s"), `key_prefix ["a:" "b:"]: wrong argument count`},
	{"key_prefix with a brace", `key_prefix "rl:{x}:"` + "\n" + limitCase("user 10 1/s"), `key_prefix "rl:{x}:": must not contain '{' or '}'`},
	{"ipv4_prefix zero", "ipv4_prefix 0\n" + limitCase("user 10 1/s"), `invalid ipv4_prefix "0": must be from 1 to 32`},
	{"ipv4_prefix too long", "ipv4_prefix 33\n" + limitCase("user 10 1/s"), `invalid ipv4_prefix "33": must be from 1 to 32`},
	{"ipv6_prefix too long", "ipv6_prefix 129\n" + limitCase("user 10 1/s"), `invalid ipv6_prefix "129": must be from 1 to 128`},
	{"ipv4_prefix not a number", "ipv4_prefix /24\n" + limitCase("user 10 1/s"), `invalid ipv4_prefix "/24": strconv.Atoi: parsing "/24": invalid syntax`},
	{"cost negative", "cost -3\n" + limitCase("user 10 1/s tokens"), `cost "-3": must be an integer from 0 to 9007199254740991`},
	{"cost fraction", "cost 1.5\n" + limitCase("user 10 1/s tokens"), `cost "1.5": must be an integer from 0 to 9007199254740991`},
	{"on_redis_error invalid", "on_redis_error retry\n" + limitCase("user 10 1/s"), `on_redis_error "retry": must be local, allow or deny`},
	{"on_deny invalid", "on_deny drop\n" + limitCase("user 10 1/s"), `on_deny "drop": must be respond or error`},
	{"local_buckets zero", "local_buckets 0\n" + limitCase("user 10 1/s"), `invalid local_buckets "0": must be a whole number > 0`},
	{"deny_cache not a number", "deny_cache of\n" + limitCase("user 10 1/s"), `invalid deny_cache "of": strconv.Atoi: parsing "of": invalid syntax; it must be a whole number > 0, or off`},
	{"deny_cache zero", "deny_cache 0\n" + limitCase("user 10 1/s"), `invalid deny_cache "0": must be a whole number > 0, or off`},
	{"concurrency_lease unknown unit", "concurrency_lease 1y\n" + limitCase("user 10 1/s"), `invalid concurrency_lease "1y": time: unknown unit "y" in duration "1y"`},
	{"concurrency_lease too large to parse", "concurrency_lease 100000000h\n" + limitCase("user 10 1/s"), `invalid concurrency_lease "100000000h": time: invalid duration "100000000h"`},
	{"concurrency_lease under 1ms", "concurrency_lease 500us\n" + limitCase("user 10 1/s"), `invalid concurrency_lease "500us": must be a duration of at least 1ms`},
	{"on_limit wait unknown unit", "on_limit wait 1y\n" + limitCase("user 10 1/s"), `invalid on_limit wait "1y": time: unknown unit "y" in duration "1y"`},
	{"on_limit wait above 1m", "on_limit wait 2m\n" + limitCase("user 10 1/s"), `invalid on_limit wait "2m": must be a duration from 1ms to 1m0s`},
	{"max_waiting beyond int", "on_limit wait 1s\nmax_waiting 99999999999999999999\n" + limitCase("user 10 1/s"),
		`invalid max_waiting "99999999999999999999": strconv.Atoi: parsing "99999999999999999999": value out of range`},
	{"redis timeout not a duration", "redis {\ntimeout soon\n}\n" + limitCase("user 10 1/s"), `invalid redis timeout "soon": time: invalid duration "soon"`},
	{"redis breaker_cooldown unknown unit", "redis {\nbreaker_cooldown 1y\n}\n" + limitCase("user 10 1/s"), `invalid redis breaker_cooldown "1y": time: unknown unit "y" in duration "1y"`},
	{"redis timeout zero", "redis {\ntimeout 0s\n}\n" + limitCase("user 10 1/s"), `invalid redis timeout "0s": must be a duration > 0`},
	{"redis db negative", "redis {\ndb -1\n}\n" + limitCase("user 10 1/s"), `invalid redis db "-1": must be a whole number`},
	{"redis db beyond int", "redis {\ndb 99999999999999999999\n}\n" + limitCase("user 10 1/s"),
		`invalid redis db "99999999999999999999": strconv.Atoi: parsing "99999999999999999999": value out of range`},
	{"redis url and address", "redis redis://127.0.0.1:6379 {\naddress 127.0.0.1:6380\n}\n" + limitCase("user 10 1/s"),
		`redis: url "redis://127.0.0.1:6379" and address ["127.0.0.1:6380"]: set one, not both`},
	{"redis with two urls", "redis redis://a:1 redis://b:2\n" + limitCase("user 10 1/s"), `redis: wrong argument count 2, want at most one URL`},
	{"redis password with two arguments", "redis {\npassword hunter2 extra\n}\n" + limitCase("user 10 1/s"), `password: wrong argument count 2, want one value`},
	{"redis tls with an argument", "redis {\ntls yes\n}\n" + limitCase("user 10 1/s"), `tls ["yes"]: wrong argument count, want no arguments`},
	{"redis address without argument", "redis {\naddress\n}\n" + limitCase("user 10 1/s"), `address []: wrong argument count`},
	{"redis pool_size negative", "redis {\npool_size -1\n}\n" + limitCase("user 10 1/s"), `invalid redis pool_size "-1": must be a whole number ≥ 0 (0: the default)`},
	{"redis two addresses without cluster", "redis {\naddress 127.0.0.1:1 127.0.0.1:2\n}\n" + limitCase("user 10 1/s"),
		`redis.address ["127.0.0.1:1" "127.0.0.1:2"]: one address for a single server (or set cluster or sentinel)`},
	{"redis cluster and sentinel", "redis {\naddress 127.0.0.1:1\ncluster\nsentinel mymaster\n}\n" + limitCase("user 10 1/s"),
		`redis: cluster and sentinel "mymaster": choose one`},
	{"redis breaker_cooldown zero", "redis {\nbreaker_cooldown 0s\n}\n" + limitCase("user 10 1/s"), `invalid redis breaker_cooldown "0s": must be a duration > 0`},
	{"local_share zero", "local_share 0\n" + limitCase("user 10 1/s"), `invalid local_share "0": must be a fraction > 0 and ≤ 1`},
	{"local_share not a number", "local_share third\n" + limitCase("user 10 1/s"), `invalid local_share "third": strconv.ParseFloat: parsing "third": invalid syntax`},
	{"local_share fraction not a number", "local_share 1/x\n" + limitCase("user 10 1/s"), `invalid local_share "1/x": strconv.ParseFloat: parsing "x": invalid syntax`},
	{"local_share fraction over zero", "local_share 1/0\n" + limitCase("user 10 1/s"), `invalid local_share "1/0": division by zero`},
	{"local_share fraction above one", "local_share 3/2\n" + limitCase("user 10 1/s"), `invalid local_share "3/2": must be a fraction > 0 and ≤ 1`},
	{"local_share above one", "local_share 1.5\n" + limitCase("user 10 1/s"), `invalid local_share "1.5": must be a fraction > 0 and ≤ 1`},
	{"local_share too small for the refill", "local_share 1e-12\n" + limitCase("user 10 1/s"),
		`tiers[0].limits[0]: tier "free", dimension "user": local_share 1e-12 cannot scale refill_rate 1: capacity 1 refilled at 1/s × 1e-12 cannot be held: under one unit a microsecond at the finest scale it leaves room for; raise local_share`},
	{"local_share too small to read", "local_share 1e-19\n" + limitCase("user 10 concurrent"),
		`local_share 1e-19: too small to scale the limits by: must be at least 1/9223372036854775807`},
	{"tier without name", "dimension user {http.auth.user.id}\ntier {\nuser 10 1/s\n}", `tier []: wrong argument count, want one value`},
	{"redis cluster url with a database", "redis redis://127.0.0.1:1/2 {\ncluster\n}\n" + limitCase("user 10 1/s"), `redis.url: database "2": Redis Cluster has only db 0, at `},
	{"redis second address without cluster", "redis redis://127.0.0.1:1?addr=127.0.0.1:2\n" + limitCase("user 10 1/s"), `redis.url: addr names more nodes: set cluster for Cluster seeds, or add master_name for Sentinels, at `},
	{"redis sentinel_password without sentinels", "redis redis://127.0.0.1:1 {\nsentinel_password x\n}\n" + limitCase("user 10 1/s"), `redis.sentinel_password: only with Sentinels (sentinel, or a url with master_name), at `},
	{"deny_cache with demote",
		"dimension user {http.auth.user.id}\ntier free {\nuser 1 1/h\n}\ntier penalty {\nuser 1 1/d\n}\n" +
			"deny_cache 100\ndemote after 1 denials within 1m to tier penalty for 1m",
		`deny_cache 100: there is no deny cache with demote, whose denials must all reach Redis to be counted; leave deny_cache out`},
	{"demote to a tier that does not limit the dimension",
		"dimension user {http.auth.user.id}\ndimension key {http.request.header.X-Key}\n" +
			"tier free {\nuser 1 1/h\n}\ntier penalty {\nkey 1 1/d\n}\ndemote user after 1 denials within 1m to tier penalty for 1m",
		`demote.tier "penalty": has no limit on the demoted dimension "user"`},
	{"demote to a tier whose limit on the dimension is scoped by models",
		"dimension user {http.auth.user.id}\ntier free {\nuser 1 1/h\n}\ntier penalty {\nuser 1 1/h models gpt-4*\n}\n" +
			"cost estimate\ndemote after 1 denials within 1m to tier penalty for 1m",
		`demote.tier "penalty": its limits on the demoted dimension "user" are all scoped by models or in shadow; it needs one that applies to every request`},
	{"demote to a tier whose limit on the dimension is in shadow",
		"dimension user {http.auth.user.id}\ntier free {\nuser 1 1/h\n}\ntier penalty {\nuser 1 1/h shadow\n}\n" +
			"demote after 1 denials within 1m to tier penalty for 1m",
		`demote.tier "penalty": its limits on the demoted dimension "user" are all scoped by models or in shadow; it needs one that applies to every request`},
	{"demote by default on the first dimension, which the tier does not limit",
		"dimension user {http.auth.user.id}\ndimension key {http.request.header.X-Key}\n" +
			"tier free {\nuser 1 1/h\n}\ntier penalty {\nkey 1 1/d\n}\ndemote after 1 denials within 1m to tier penalty for 1m",
		`demote.tier "penalty": has no limit on the demoted dimension "user"`},
}

// parseTokenBucket parses a token_bucket block whose body is block, as the
// Caddyfile adapter does for the directive.
func parseTokenBucket(block string) (*Handler, error) {
	h := new(Handler)
	return h, h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("token_bucket {\n" + block + "\n}"))
}

// errorCaddyfile is a whole Caddyfile whose one site (on port 9, never
// listened on: a load of it fails first) runs token_bucket with block.
func errorCaddyfile(block string) string {
	const port = 9
	return globalOptions(port) + fmt.Sprintf(":%d {\n\ttoken_bucket {\n%s\n\t}\n}\n", port, block)
}

// TestCaddyfileErrors checks each bad token_bucket block with the parser
// and with the whole Caddyfile adapter (as `caddy adapt` runs it): both fail
// with an error that names the field and the value, and never echo a
// password.
func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range caddyfileErrorCases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseTokenBucket(tc.block)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("parse error = %v\nwant it to contain %s", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "hunter2") {
				t.Errorf("parse error echoes a password: %v", err)
			}
			_, err = adaptCaddyfile(errorCaddyfile(tc.block))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("adapt error = %v\nwant it to contain %s", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "hunter2") {
				t.Errorf("adapt error echoes a password: %v", err)
			}
		})
	}
}

// loadedCaddyfileErrors are the cases of caddyfileErrorCases that also go
// through a live Caddy's /load: an error of the parser, one of validation,
// and one whose value is a password that must not be shown.
var loadedCaddyfileErrors = []string{"capacity zero", "default_tier names no tier", "redis password with two arguments"}

// TestCaddyfileErrorsThroughLoad: a bad Caddyfile is refused by `caddy
// adapt` and by the admin API's /load with the error the parser gives.
func TestCaddyfileErrorsThroughLoad(t *testing.T) {
	ensureCaddy(t)
	for _, name := range loadedCaddyfileErrors {
		t.Run(name, func(t *testing.T) {
			i := 0
			for i < len(caddyfileErrorCases) && caddyfileErrorCases[i].name != name {
				i++
			}
			if i == len(caddyfileErrorCases) {
				t.Fatalf("no case %q", name)
			}
			tc := caddyfileErrorCases[i]
			config := errorCaddyfile(tc.block)
			_, err := adaptCaddyfile(config)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("adapt error = %v\nwant it to contain %s", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "hunter2") {
				t.Errorf("adapt error echoes a password: %v", err)
			}
			err = postLoad(config, "caddyfile")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("/load error = %v\nwant it to contain %s", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "hunter2") {
				t.Errorf("/load error echoes a password: %v", err)
			}
		})
	}
}

// TestCaddyfileErrorWithAssertLoadError runs one case through caddytest's
// own load-error assertion, the path Caddy's integration tests use. It
// matches the raw JSON answer of /load, hence a message without quotes.
func TestCaddyfileErrorWithAssertLoadError(t *testing.T) {
	ensureCaddy(t)
	caddytest.AssertLoadError(t, globalOptions(9)+`:9 {
	token_bucket {
		dimension user {http.auth.user.id}
	}
}
`, "caddyfile", `token_bucket: tiers: at least one tier is required`)
}

// validHandlerJSON is a handler that loads; cases replace parts of it.
const validHandlerJSON = `{
	"handler": "token_bucket",
	"redis": {"address": ["127.0.0.1:1"]},
	"dimensions": [{"name": "user", "identity": "{http.auth.user.id}"}],
	"tiers": [{"name": "free", "limits": [{"dimension": "user", "capacity": 10, "refill_rate": 1}]}]
}`

// jsonErrorLimit returns validHandlerJSON with its one limit replaced by l.
func jsonErrorLimit(l string) string {
	return strings.Replace(validHandlerJSON, `{"dimension": "user", "capacity": 10, "refill_rate": 1}`, l, 1)
}

// jsonErrorField returns validHandlerJSON with the field f added.
func jsonErrorField(f string) string {
	return strings.Replace(validHandlerJSON, `"handler": "token_bucket",`, `"handler": "token_bucket", `+f+`,`, 1)
}

// jsonErrorCases are JSON handlers (which skip the Caddyfile parser) that
// a load refuses, with the JSON field names and the value.
var jsonErrorCases = []struct {
	name, handler, want string
}{
	{"capacity zero", jsonErrorLimit(`{"dimension": "user", "capacity": 0, "refill_rate": 1}`),
		`tiers[0].limits[0]: tier "free", dimension "user": capacity 0: must be an integer from 1 to 9007199254740991`},
	{"capacity negative", jsonErrorLimit(`{"dimension": "user", "capacity": -1, "refill_rate": 1}`), `capacity -1: must be an integer from 1`},
	{"capacity missing", jsonErrorLimit(`{"dimension": "user", "refill_rate": 1}`), `capacity 0: must be an integer from 1`},
	{"capacity fraction", jsonErrorLimit(`{"dimension": "user", "capacity": 1.5, "refill_rate": 1}`), `cannot unmarshal number 1.5 into Go struct field Limit.tiers.limits.capacity of type int64`},
	{"refill_rate zero", jsonErrorLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 0}`),
		`tiers[0].limits[0]: tier "free", dimension "user": refill_rate 0: must be a finite number > 0`},
	{"refill_rate missing", jsonErrorLimit(`{"dimension": "user", "capacity": 10}`), `refill_rate 0: must be a finite number > 0`},
	{"refill_rate negative", jsonErrorLimit(`{"dimension": "user", "capacity": 10, "refill_rate": -0.5}`), `refill_rate -0.5: must be a finite number > 0`},
	{"refill_rate too fine", jsonErrorLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 1e-300}`), `refill_rate 1e-300: refill rate`},
	{"unit unknown", jsonErrorLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 1, "unit": "bytes"}`), `unit "bytes": must be requests, tokens or concurrent`},
	{"undeclared dimension", jsonErrorLimit(`{"dimension": "org", "capacity": 10, "refill_rate": 1}`), `tiers[0].limits[0].dimension "org": tier "free" limits an undeclared dimension`},
	{"unknown field", jsonErrorLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 1, "burst": 5}`), `unknown field "burst"`},
	{"no tiers", `{"handler": "token_bucket", "dimensions": [{"name": "user", "identity": "{http.auth.user.id}"}]}`, `tiers: at least one tier is required`},
	{"empty tiers", strings.Replace(validHandlerJSON, `[{"name": "free", "limits": [{"dimension": "user", "capacity": 10, "refill_rate": 1}]}]`, `[]`, 1), `tiers: at least one tier is required`},
	{"default_tier unknown", jsonErrorField(`"default_tier": "gold"`), `default_tier "gold": no tier has that name`},
	{"key_prefix brace", jsonErrorField(`"key_prefix": "rl:{x}"`), `key_prefix "rl:{x}": must not contain '{' or '}'`},
	{"ipv4_prefix negative", jsonErrorField(`"ipv4_prefix": -1`), `ipv4_prefix -1: must be from 1 to 32`},
	{"ipv6_prefix too long", jsonErrorField(`"ipv6_prefix": 129`), `ipv6_prefix 129: must be from 1 to 128`},
	{"cost invalid", jsonErrorField(`"cost": "1e3"`), `cost "1e3": must be an integer from 0 to 9007199254740991`},
	{"on_redis_error invalid", jsonErrorField(`"on_redis_error": "retry"`), `on_redis_error "retry": must be local, allow or deny`},
	{"on_deny invalid", jsonErrorField(`"on_deny": "drop"`), `on_deny "drop": must be respond or error`},
	{"local_buckets negative", jsonErrorField(`"local_buckets": -1`), `local_buckets -1: must be a whole number > 0`},
	{"redis url and address", strings.Replace(validHandlerJSON, `"address": ["127.0.0.1:1"]`, `"url": "redis://127.0.0.1:1", "address": ["127.0.0.1:2"]`, 1),
		`redis: url "redis://127.0.0.1:1" and address ["127.0.0.1:2"]: set one, not both`},
	{"redis two addresses", strings.Replace(validHandlerJSON, `["127.0.0.1:1"]`, `["127.0.0.1:1", "127.0.0.1:2"]`, 1),
		`redis.address ["127.0.0.1:1" "127.0.0.1:2"]: one address for a single server (or set cluster or sentinel)`},
	{"redis cluster without address", strings.Replace(validHandlerJSON, `"address": ["127.0.0.1:1"]`, `"cluster": true`, 1),
		`redis.address: cluster and sentinel need at least one address`},
	{"redis cluster db", strings.Replace(validHandlerJSON, `"address": ["127.0.0.1:1"]`, `"address": ["127.0.0.1:1"], "cluster": true, "db": 2`, 1),
		`redis.db 2: Redis Cluster has only db 0`},
	{"local_share above one", jsonErrorField(`"local_share": 1.5`), `local_share 1.5: must be a fraction > 0 and ≤ 1`},
	{"local_share too small for the refill", jsonErrorField(`"local_share": 1e-12`),
		`tiers[0].limits[0]: tier "free", dimension "user": local_share 1e-12 cannot scale refill_rate 1: capacity 1 refilled at 1/s × 1e-12 cannot be held: under one unit a microsecond at the finest scale it leaves room for; raise local_share`},
	{"local_share too small to read", jsonErrorField(`"local_share": 1e-19`),
		`local_share 1e-19: too small to scale the limits by: must be at least 1/9223372036854775807`},
	{"redis db negative", strings.Replace(validHandlerJSON, `"address": ["127.0.0.1:1"]`, `"address": ["127.0.0.1:1"], "db": -1`, 1), `redis.db -1: must be a whole number ≥ 0 (0: the default)`},
	{"redis timeout negative", strings.Replace(validHandlerJSON, `"address": ["127.0.0.1:1"]`, `"address": ["127.0.0.1:1"], "timeout": "-1s"`, 1), `redis.timeout -1s: must be a duration > 0`},
	{"key_secret unknown placeholder", jsonErrorField(`"key_secret": "{secret.key}"`), `key_secret: an unknown placeholder (a literal "{" or "}" in the secret is written \{ or \})`},
	{"redis url scheme", strings.Replace(validHandlerJSON, `"address": ["127.0.0.1:1"]`, `"url": "http://127.0.0.1:1"`, 1), `redis.url: `},
}

// jsonAuditErrorCases are JSON handlers with bad audit options.
var jsonAuditErrorCases = []struct{ name, fields, want string }{
	{"negative window", `"audit_window": -1000000000`, `audit_window -1s: must be a duration > 0`},
	{"negative buckets", `"audit_buckets": -1`, `audit_buckets -1: must be a whole number > 0`},
	{"audit not a bool", `"audit": "off"`, `audit`},
}

// auditErrorHandler is a valid handler with the audit fields added.
func auditErrorHandler(fields string) string {
	return `{"handler": "token_bucket", "redis": {"address": ["127.0.0.1:1"]},
				"dimensions": [{"name": "user", "identity": "{http.auth.user.id}"}],
				"tiers": [{"name": "free", "limits": [{"dimension": "user", "capacity": 10, "refill_rate": 1}]}],
				` + fields + `}`
}

// compileJSON does to a handler's JSON what a load does before it connects
// to Redis: the strict decoding of the module (without its "handler" name),
// compile, and the resolution of the Redis config.
func compileJSON(handler string) error {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal([]byte(handler), &fields); err != nil {
		return err
	}
	delete(fields, "handler")
	raw, err := json.Marshal(fields)
	if err != nil {
		return err
	}
	var h Handler
	if err := caddy.StrictUnmarshalJSON(raw, &h); err != nil {
		return err
	}
	if err := h.compile(); err != nil {
		return err
	}
	_, err = h.Redis.resolve()
	return err
}

// TestJSONConfigErrors checks that a JSON config is refused by the steps a
// load runs before Redis (decoding, compile, the Redis URL), with the JSON
// field names and the value.
func TestJSONConfigErrors(t *testing.T) {
	for _, tc := range jsonErrorCases {
		t.Run(tc.name, func(t *testing.T) {
			err := compileJSON(tc.handler)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("compile error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}
	for _, tc := range jsonAuditErrorCases {
		t.Run("audit "+tc.name, func(t *testing.T) {
			err := compileJSON(auditErrorHandler(tc.fields))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("compile error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}
}

// TestJSONConfigErrorsThroughLoad: a few of the JSON cases go through a
// live Caddy's /load, which refuses them with the same error.
func TestJSONConfigErrorsThroughLoad(t *testing.T) {
	ensureCaddy(t)
	for _, tc := range []struct{ name, handler, want string }{
		{"default_tier unknown", jsonErrorField(`"default_tier": "gold"`), `default_tier "gold": no tier has that name`},
		{"audit negative window", auditErrorHandler(jsonAuditErrorCases[0].fields), jsonAuditErrorCases[0].want},
	} {
		t.Run(tc.name, func(t *testing.T) {
			config := fmt.Sprintf(`{
				"admin": {"listen": "localhost:%d", "config": {"persist": false}},
				"apps": {"http": {"servers": {"srv0": {
					"listen": ["127.0.0.1:9"],
					"routes": [{"handle": [%s]}]
				}}}}
			}`, adminPort, tc.handler)
			err := postLoad(config, "json")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("/load error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}
}

// TestKeySecretUnsetVariable: a key_secret placeholder that evaluates
// empty (an unset variable) leaves the identities hashed with plain
// SHA-256, as the README says, and says so in the log at load; a set one
// keys the hash.
func TestKeySecretUnsetVariable(t *testing.T) {
	handler := func(secret string) *Handler {
		return &Handler{
			Redis:      &RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}},
			Dimensions: []Dimension{{Name: "user", Identity: "{http.request.header.X-User}"}},
			Tiers:      []Tier{{Name: "free", Limits: []Limit{{Dimension: "user", Capacity: 10, RefillRate: 1}}}},
			KeySecret:  secret,
		}
	}
	logs := foCaptureLogs(t, t.TempDir(), handler("{env.TOKEN_BUCKET_TEST_UNSET_SECRET}"))
	const warning = `key_secret evaluated empty: identities are hashed with plain SHA-256, so a reader of Redis can test guesses of them`
	if got := logs(); !strings.Contains(got, warning) || !strings.Contains(got, `"key_secret": "{env.TOKEN_BUCKET_TEST_UNSET_SECRET}"`) {
		t.Errorf("the load's log does not warn of the empty key_secret:\n%s", got)
	}
	t.Setenv("TOKEN_BUCKET_TEST_SECRET", "s3cret")
	h := handler("{env.TOKEN_BUCKET_TEST_SECRET}")
	logs = foCaptureLogs(t, t.TempDir(), h)
	if got := logs(); strings.Contains(got, "key_secret") {
		t.Errorf("a set key_secret is logged:\n%s", got)
	}
	if want := bucket.NewKeyer("rl:", "s3cret").Key("user", "alice", ""); h.keyer.Key("user", "alice", "") != want || !h.keyer.Keyed() {
		t.Errorf("the key of alice is %q, want %q (HMAC under the variable's value)", h.keyer.Key("user", "alice", ""), want)
	}
	// Literal braces, escaped as the error says.
	h = handler(`s3\{cret\}`)
	if err := h.compile(); err != nil {
		t.Fatal(err)
	}
	if want := bucket.NewKeyer("rl:", "s3{cret}").Key("user", "alice", ""); h.keyer.Key("user", "alice", "") != want {
		t.Errorf("with an escaped literal secret, the key of alice is %q, want %q", h.keyer.Key("user", "alice", ""), want)
	}
}

// TestRedisBlockAdaptReadsNoSecret: the redis block's check at adapt time
// does not read the files its credentials name ({file.*}): a secret of
// the host that runs the config, not of the one that adapts it. The file
// here is a FIFO, whose open blocks until a writer comes.
func TestRedisBlockAdaptReadsNoSecret(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "secret")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skip(err)
	}
	for _, opt := range []string{"password", "username", "sentinel_password"} {
		block := "redis redis://127.0.0.1:1?master_name=m {\n" + opt + " {file." + fifo + "}\n}\n" + limitCase("user 10 1/s")
		done := make(chan error, 1)
		go func() { _, err := parseTokenBucket(block); done <- err }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s: %v", opt, err)
			}
		case <-time.After(2 * time.Second):
			t.Errorf("%s {file.*}: the Caddyfile's adaptation opened the file", opt)
			if w, err := os.OpenFile(fifo, os.O_WRONLY, 0); err == nil {
				w.Close()
			}
			<-done
		}
	}
}
