package tokenbucket

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/lua"
)

// ---------------------------------------------------------------------------
// C. End to end: a real Caddy in front of a real Redis.

// userLimit is a token_bucket on the X-User header with the given tier
// limits and extra subdirectives, against the gateway's Redis with a timeout
// long enough that a slow test machine never falls back to on_redis_error.
func userLimit(limits, extra string) string {
	return `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		tier free {
			` + limits + `
		}
		` + extra + `
	}`
}

// TestBurstThenRetryAfter sends a burst at a bucket of 5 refilled at 1 per
// hour: exactly 5 × 200 with the remaining count going 4..0, then 429s with
// the exact Retry-After and body. With an empty bucket refilling 1 token per
// 3600 s, the wait is 3600 s less the few ms the test took.
func TestBurstThenRetryAfter(t *testing.T) {
	g := startGateway(t, userLimit("user 5 1/1h", "")+"\nrespond \"ok\"")
	start := time.Now()
	for k := int64(1); k <= 5; k++ {
		r := g.get("X-User", "alice")
		what := fmt.Sprintf("request %d", k)
		if r.status != http.StatusOK || r.body != "ok" {
			t.Fatalf("%s: %d %q, want 200 ok", what, r.status, r.body)
		}
		// After k requests the bucket is k tokens short: full again in k hours.
		wantHeaders(t, what, r.header,
			"RateLimit-Policy", `"user";q=5;w=18000`,
			"RateLimit", fmt.Sprintf(`"user";r=%d;t=%d`, 5-k, 3600*k),
			"X-RateLimit-Limit", "5",
			"X-RateLimit-Remaining", strconv.FormatInt(5-k, 10),
			"X-RateLimit-Reset", strconv.FormatInt(3600*k, 10),
			"Retry-After", "",
			"Retry-After-Ms", "")
	}
	key := bucket.NewKeyer("rl:", "").Key("user", "alice", "")
	stored := g.value(key)
	for k := 6; k <= 8; k++ {
		r := g.get("X-User", "alice")
		elapsedMS := time.Since(start).Milliseconds() + 1
		what := fmt.Sprintf("request %d", k)
		if r.status != http.StatusTooManyRequests {
			t.Fatalf("%s: status %d, want 429", what, r.status)
		}
		ms, err := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
		if err != nil || ms > 3_600_000 || ms < 3_600_000-elapsedMS {
			t.Errorf("%s: Retry-After-Ms %q, want 3600000 less at most the %d ms elapsed", what, r.header.Get("Retry-After-Ms"), elapsedMS)
		}
		wantHeaders(t, what, r.header,
			"Retry-After", "3600",
			"Cache-Control", "no-store",
			"Content-Type", "application/json",
			"RateLimit-Policy", `"user";q=5;w=18000`,
			"RateLimit", `"user";r=0;t=3600`,
			"X-RateLimit-Limit", "5",
			"X-RateLimit-Remaining", "0",
			"X-RateLimit-Reset", "3600")
		want := fmt.Sprintf(`{"error":"rate_limit_exceeded","retry_after":3600,"retry_after_ms":%d,"tier":"free","dimension":"user"}`+"\n", ms)
		if r.body != want {
			t.Errorf("%s: body %q, want %q", what, r.body, want)
		}
	}
	if got := g.value(key); got != stored {
		t.Errorf("denials wrote the bucket: %q, then %q", stored, got)
	}
	// Another identity has its own bucket.
	if r := g.get("X-User", "bob"); r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "4" {
		t.Errorf("bob: %d, remaining %q; want 200, 4", r.status, r.header.Get("X-RateLimit-Remaining"))
	}
}

// TestDeniedRequestChargesNoBucket: a request that its user bucket denies
// leaves its IP bucket exactly as it was (all-or-nothing).
func TestDeniedRequestChargesNoBucket(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		dimension ip {client_ip}
		tier free {
			user 2 1/1h
			ip 100 1/1h
		}
	}
	respond "ok"`)
	for i := 0; i < 2; i++ {
		if r := g.get("X-User", "alice"); r.status != http.StatusOK {
			t.Fatalf("request %d: status %d", i+1, r.status)
		}
	}
	// {client_ip} is 127.0.0.1, masked to the default ipv4_prefix 32.
	ipKey := bucket.NewKeyer("rl:", "").Key("ip", "127.0.0.1/32", "")
	before := g.value(ipKey)
	// 1 token an hour is 3.6e9 units per token at 1 unit per microsecond.
	if st, err := bucket.DecodeState(before); err != nil || st.Scale != 3_600_000_000 || st.Units/st.Scale != 98 {
		t.Fatalf("ip bucket %+v (%v): want 98 whole tokens at scale 3600000000", st, err)
	}

	r := g.get("X-User", "alice")
	if r.status != http.StatusTooManyRequests || !strings.Contains(r.body, `"dimension":"user"`) {
		t.Fatalf("third request: %d %s, want 429 by user", r.status, r.body)
	}
	wantHeaders(t, "denial", r.header,
		"RateLimit-Policy", `"user";q=2;w=7200, "ip";q=100;w=360000`,
		// A denial's RateLimit speaks of the denying buckets, as the deny
		// cache's does; the policy lists every applied bucket.
		"RateLimit", `"user";r=0;t=3600`,
		"X-RateLimit-Limit", "2",
		"X-RateLimit-Remaining", "0",
		"X-RateLimit-Reset", "3600")
	if after := g.value(ipKey); after != before {
		t.Errorf("denied request charged the ip bucket: %q, then %q", before, after)
	}
}

// TestCostAboveCapacity: a cost above a tokens limit's capacity can never
// succeed: 429 cost_exceeds_capacity without Retry-After, nothing charged.
func TestCostAboveCapacity(t *testing.T) {
	g := startGateway(t, userLimit("user 100 1/1h\n\t\t\tuser 10 1/1h tokens", "cost {http.request.header.X-Cost}")+"\nrespond \"ok\"")
	for _, cost := range []string{"11", "9007199254740991"} {
		r := g.get("X-User", "alice", "X-Cost", cost)
		if r.status != http.StatusTooManyRequests {
			t.Fatalf("cost %s: status %d, want 429", cost, r.status)
		}
		want := `{"error":"cost_exceeds_capacity","cost":` + cost + `,"capacity":10,"tier":"free","dimension":"user"}` + "\n"
		if r.body != want {
			t.Errorf("cost %s: body %q, want %q", cost, r.body, want)
		}
		wantHeaders(t, "cost "+cost, r.header,
			"Retry-After", "",
			"Retry-After-Ms", "",
			"Cache-Control", "no-store",
			"RateLimit", `"user-tokens";r=10;t=0`,
			"X-Should-Retry", "false",
			"X-RateLimit-Limit", "10",
			"X-RateLimit-Remaining", "10")
	}
	if keys := g.keys(); len(keys) != 0 {
		t.Errorf("a denied request wrote %q", keys)
	}
	// A cost equal to the capacity is allowed.
	r := g.get("X-User", "alice", "X-Cost", "10")
	if r.status != http.StatusOK {
		t.Fatalf("cost 10: status %d", r.status)
	}
	wantHeaders(t, "cost 10", r.header, "RateLimit", `"user";r=99;t=3600, "user-tokens";r=0;t=36000`)
}

// TestInvalidCostIs400: a cost that is not an integer from 0 to 2^53-1 is
// answered 400 invalid_cost before Redis is asked, so nothing is charged.
func TestInvalidCostIs400(t *testing.T) {
	g := startGateway(t, userLimit("user 100 1/1h\n\t\t\tuser 1000 1/1h tokens", "cost {http.request.header.X-Cost}")+"\nrespond \"ok\"")
	const want = `{"error":"invalid_cost","message":"the request's cost must be an integer from 0 to 9007199254740991"}` + "\n"
	for _, cost := range []string{"abc", "-1", "1.5", "", "99999999999999999999", "9007199254740992", "1e3", "0x10", "+1", "٣"} {
		r := g.get("X-User", "alice", "X-Cost", cost)
		if r.status != http.StatusBadRequest || r.body != want {
			t.Errorf("cost %q: %d %q, want 400 %q", cost, r.status, r.body, want)
		}
		wantNoRateLimitHeaders(t, fmt.Sprintf("cost %q", cost), r.header)
	}
	// No X-Cost header at all is an empty cost too.
	if r := g.get("X-User", "alice"); r.status != http.StatusBadRequest {
		t.Errorf("no cost header: status %d, want 400", r.status)
	}
	if keys := g.keys(); len(keys) != 0 {
		t.Errorf("invalid costs wrote %q", keys)
	}
}

// TestZeroCostPeeks: cost 0 on a tokens limit is a peek: allowed, the
// remaining tokens reported, nothing written.
func TestZeroCostPeeks(t *testing.T) {
	g := startGateway(t, userLimit("user 10 1/1h tokens", "cost {http.request.header.X-Cost}")+"\nrespond \"ok\"")
	r := g.get("X-User", "alice", "X-Cost", "0")
	if r.status != http.StatusOK {
		t.Fatalf("peek on a fresh bucket: status %d", r.status)
	}
	wantHeaders(t, "peek on a fresh bucket", r.header, "RateLimit", `"user-tokens";r=10;t=0`)
	if keys := g.keys(); len(keys) != 0 {
		t.Fatalf("a peek wrote %q", keys)
	}
	if r := g.get("X-User", "alice", "X-Cost", "3"); r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "7" {
		t.Fatalf("cost 3: %d, remaining %q", r.status, r.header.Get("X-RateLimit-Remaining"))
	}
	key := bucket.NewKeyer("rl:", "").Key("user", "alice", "tokens")
	stored := g.value(key)
	r = g.get("X-User", "alice", "X-Cost", "0")
	if r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "7" {
		t.Errorf("peek: %d, remaining %q; want 200, 7", r.status, r.header.Get("X-RateLimit-Remaining"))
	}
	if got := g.value(key); got != stored {
		t.Errorf("a peek wrote the bucket: %q, then %q", stored, got)
	}
}

// TestEmptyIdentitySkipsDimension: a dimension whose identity is empty or
// missing is skipped for the request, never lumped into one shared bucket.
func TestEmptyIdentitySkipsDimension(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		dimension ip {client_ip}
		tier free {
			user 5 1/1h
			ip 50 1/1h
		}
	}
	respond "ok"`)
	ipKey := bucket.NewKeyer("rl:", "").Key("ip", "127.0.0.1/32", "")
	for _, headers := range [][]string{nil, {"X-User", ""}} {
		r := g.get(headers...)
		what := fmt.Sprintf("headers %q", headers)
		if r.status != http.StatusOK {
			t.Fatalf("%s: status %d", what, r.status)
		}
		wantHeaders(t, what, r.header, "RateLimit-Policy", `"ip";q=50;w=180000`)
		if keys := g.keys(); len(keys) != 1 || keys[0] != ipKey {
			t.Errorf("%s: keys %q, want only %q", what, keys, ipKey)
		}
	}

	// With no dimension resolved, nothing is asked of Redis: the request
	// passes without rate-limit headers.
	g.load(userLimit("user 5 1/1h", "") + "\nrespond \"{http.token_bucket.decision}\"")
	if err := g.rdb.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	r := g.get()
	if r.status != http.StatusOK || r.body != "allowed" {
		t.Errorf("no identity: %d %q, want 200 allowed", r.status, r.body)
	}
	wantNoRateLimitHeaders(t, "no identity", r.header)
	if keys := g.keys(); len(keys) != 0 {
		t.Errorf("no identity wrote %q", keys)
	}
}

// TestRawIdentityNeverInRedis sends traffic with a distinctive API key and
// user id, then scans the whole keyspace: every key is the documented
// hashed form (HMAC with key_secret), no key or value holds the raw
// identities, and every key has a TTL.
func TestRawIdentityNeverInRedis(t *testing.T) {
	const (
		apiKey = "sk-live-TOPSECRET-0123456789abcdef"
		user   = "alice@example.com"
		secret = "test-key-secret"
	)
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		key_secret `+secret+`
		dimension api_key {http.request.header.X-Api-Key}
		dimension user {http.request.header.X-User}
		dimension ip {client_ip}
		tier free {
			api_key 100 1/1h
			api_key 10000 1/1h tokens
			user 100 1/1h
			ip 100 1/1h
		}
		cost 7
	}
	respond "ok"`)
	for i := 0; i < 3; i++ {
		if r := g.get("X-Api-Key", apiKey, "X-User", user); r.status != http.StatusOK {
			t.Fatalf("request %d: status %d", i, r.status)
		}
	}
	k := bucket.NewKeyer("rl:", secret)
	want := map[string]bool{
		k.Key("api_key", apiKey, ""):       true,
		k.Key("api_key", apiKey, "tokens"): true,
		k.Key("user", user, ""):            true,
		k.Key("ip", "127.0.0.1/32", ""):    true,
	}
	keys := g.keys()
	if len(keys) != len(want) {
		t.Errorf("keys %q, want %d keys", keys, len(want))
	}
	plain := bucket.NewKeyer("rl:", "")
	for _, key := range keys {
		if !want[key] {
			t.Errorf("unexpected key %q", key)
		}
		if key == plain.Key("user", user, "") {
			t.Errorf("key %q ignores key_secret", key)
		}
		value := g.value(key)
		for _, raw := range []string{apiKey, "TOPSECRET", "sk-live", user, "alice"} {
			if strings.Contains(key, raw) || strings.Contains(value, raw) {
				t.Errorf("key %q = %q holds %q", key, value, raw)
			}
		}
		ttl, err := g.rdb.PTTL(context.Background(), key).Result()
		// The most drained bucket, api_key tokens, is 3 × 7 tokens short
		// at 1 token an hour.
		if err != nil || ttl <= 0 || ttl > 21*time.Hour {
			t.Errorf("key %q: PTTL %v (%v), want from 1 ms to 21 h", key, ttl, err)
		}
	}
}

// TestHostileIdentitiesGiveBoundedKeys: identities with '{', '}', ':' or 10
// KB of text give keys of one fixed length whose only braces are the hash
// tag the keyer puts there, all distinct.
func TestHostileIdentitiesGiveBoundedKeys(t *testing.T) {
	g := startGateway(t, userLimit("user 10 1/1h", "")+"\nrespond \"ok\"")
	ids := []string{
		"alice", "{alice}", "a{b}c", "}{", "{", "}", "user:alice", "alice:", ":alice",
		"x}:{y", "{user:alice}", "rl:{user:alice}", strings.Repeat("z", 10240), strings.Repeat("{:}", 3400),
	}
	k := bucket.NewKeyer("rl:", "")
	const keyLen = len("rl:{user:") + bucket.IDLength + len("}")
	for _, id := range ids {
		if r := g.get("X-User", id); r.status != http.StatusOK {
			t.Fatalf("identity %.40q: status %d", id, r.status)
		}
	}
	keys := g.keys()
	if len(keys) != len(ids) {
		t.Errorf("%d keys for %d distinct identities", len(keys), len(ids))
	}
	got := map[string]bool{}
	for _, key := range keys {
		got[key] = true
		if len(key) != keyLen || !strings.HasPrefix(key, "rl:{user:") || !strings.HasSuffix(key, "}") ||
			strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 {
			t.Errorf("key %q: want rl:{user:<%d characters>}", key, bucket.IDLength)
		}
	}
	for _, id := range ids {
		if !got[k.Key("user", id, "")] {
			t.Errorf("no key %q for identity %.40q", k.Key("user", id, ""), id)
		}
	}
}

// TestScriptFlushChangesNoDecision: after SCRIPT FLUSH (as after a Redis
// restart or failover) the script is loaded again and the decisions go on
// exactly as the model says.
func TestScriptFlushChangesNoDecision(t *testing.T) {
	g := startGateway(t, userLimit("user 3 1/1h", "")+"\nrespond \"ok\"")
	ctx := context.Background()
	flush := func() {
		t.Helper()
		if err := g.rdb.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if ok, err := g.rdb.ScriptExists(ctx, lua.TokenBucket.Hash()).Result(); err != nil || ok[0] {
			t.Fatalf("SCRIPT EXISTS after SCRIPT FLUSH: %v %v", ok, err)
		}
	}
	for i, want := range []struct {
		flush     bool
		status    int
		remaining string
	}{
		{false, 200, "2"},
		{true, 200, "1"},
		{true, 200, "0"},
		{true, 429, "0"},
		{false, 429, "0"},
	} {
		if want.flush {
			flush()
		}
		r := g.get("X-User", "alice")
		if r.status != want.status || r.header.Get("X-RateLimit-Remaining") != want.remaining {
			t.Errorf("request %d: %d, remaining %q; want %d, %s", i+1, r.status, r.header.Get("X-RateLimit-Remaining"), want.status, want.remaining)
		}
	}
	if ok, err := g.rdb.ScriptExists(ctx, lua.TokenBucket.Hash()).Result(); err != nil || !ok[0] {
		t.Errorf("script not loaded again: %v %v", ok, err)
	}
}

// TestOnDenyErrorUsesHandleErrors: with on_deny error, a denial (and an
// invalid cost) is a Caddy error that handle_errors renders, and the
// rate-limit headers and placeholders are still set.
func TestOnDenyErrorUsesHandleErrors(t *testing.T) {
	g := startGateway(t, userLimit("user 1 1/1h\n\t\t\tuser 100 1/1h tokens", "on_deny error\n\t\tcost {http.request.header.X-Cost}")+`
	respond "ok"
	handle_errors {
		respond "{err.status_code} {http.token_bucket.tier} {http.token_bucket.decision}" {err.status_code}
		header >X-Denied-By {http.token_bucket.dimension}
		header >X-Retry-After-Placeholder {http.token_bucket.retry_after}
	}`)
	if r := g.get("X-User", "alice", "X-Cost", "1"); r.status != http.StatusOK || r.body != "ok" {
		t.Fatalf("first request: %d %q", r.status, r.body)
	}
	r := g.get("X-User", "alice", "X-Cost", "1")
	if r.status != http.StatusTooManyRequests || r.body != "429 free denied" {
		t.Errorf("denial: %d %q, want 429 \"429 free denied\"", r.status, r.body)
	}
	wantHeaders(t, "denial", r.header,
		"X-Denied-By", "user",
		"X-Retry-After-Placeholder", "3600",
		"Retry-After", "3600",
		"Cache-Control", "no-store",
		"X-RateLimit-Limit", "1",
		"X-RateLimit-Remaining", "0",
		"X-RateLimit-Reset", "3600")
	// A client already denied by its requests limit is answered 429 before
	// its cost is read; a fresh one gets the 400.
	r = g.get("X-User", "alice", "X-Cost", "abc")
	if r.status != http.StatusTooManyRequests || r.body != "429 free denied" {
		t.Errorf("invalid cost while denied: %d %q, want 429 \"429 free denied\"", r.status, r.body)
	}
	r = g.get("X-User", "bob", "X-Cost", "abc")
	if r.status != http.StatusBadRequest || r.body != "400 free invalid_cost" {
		t.Errorf("invalid cost: %d %q, want 400 \"400 free invalid_cost\"", r.status, r.body)
	}
}

// TestReloadsDoNotGrowRedisConnections reloads the config 50 times: the
// handlers share one pooled client per Redis config across reloads and
// release it on cleanup, so Redis sees no more connections than before.
func TestReloadsDoNotGrowRedisConnections(t *testing.T) {
	site := func(i int) string {
		return userLimit("user 1000 1/1h", "") + fmt.Sprintf("\nrespond \"ok %d\"", i)
	}
	g := startGateway(t, site(0))
	clients := func() int {
		t.Helper()
		list, err := g.rdb.ClientList(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(strings.TrimSpace(list), "\n") + 1
	}
	if r := g.get("X-User", "alice"); r.status != http.StatusOK {
		t.Fatalf("status %d", r.status)
	}
	before := clients()
	for i := 1; i <= 50; i++ {
		g.load(site(i))
	}
	r := g.get("X-User", "alice")
	if r.status != http.StatusOK || r.body != "ok 50" || r.header.Get("X-RateLimit-Remaining") != "998" {
		t.Fatalf("after reloads: %d %q, remaining %q", r.status, r.body, r.header.Get("X-RateLimit-Remaining"))
	}
	if after := clients(); after > before+2 {
		t.Errorf("Redis connections grew from %d to %d over 50 reloads", before, after)
	} else {
		t.Logf("Redis connections: %d before, %d after 50 reloads", before, after)
	}
}

// TestPlaceholders: later handlers see {http.token_bucket.*}: the respond
// body, and header fields set at write time (so also on a denial).
func TestPlaceholders(t *testing.T) {
	g := startGateway(t, `
	header >X-TB-Tier {http.token_bucket.tier}
	header >X-TB-Decision {http.token_bucket.decision}
	header >X-TB-Remaining {http.token_bucket.remaining}
	header >X-TB-Dimension {http.token_bucket.dimension}
	header >X-TB-Retry-After {http.token_bucket.retry_after}
	`+userLimit("user 2 1/1h", "")+`
	respond "{http.token_bucket.tier} {http.token_bucket.decision} {http.token_bucket.remaining}"`)
	for _, want := range []struct {
		status                                        int
		body, decision, remaining, dimension, waitSec string
	}{
		{200, "free allowed 1", "allowed", "1", "", ""},
		{200, "free allowed 0", "allowed", "0", "", ""},
		{429, `"dimension":"user"}`, "denied", "0", "user", "3600"},
	} {
		r := g.get("X-User", "alice")
		if r.status != want.status || !strings.HasSuffix(strings.TrimSpace(r.body), want.body) {
			t.Errorf("%d %q, want %d …%q", r.status, r.body, want.status, want.body)
		}
		wantHeaders(t, want.decision, r.header,
			"X-TB-Tier", "free",
			"X-TB-Decision", want.decision,
			"X-TB-Remaining", want.remaining)
		// dimension and retry_after are set on a denial only.
		if want.status == http.StatusTooManyRequests {
			wantHeaders(t, want.decision, r.header,
				"X-TB-Dimension", want.dimension,
				"X-TB-Retry-After", want.waitSec)
		}
	}
}

// TestOnRedisError stops Redis and checks each on_redis_error policy:
// allow passes without rate-limit headers, deny answers 503 (never 429),
// local enforces the same limits from process memory. All set
// {http.token_bucket.degraded}.
func TestOnRedisError(t *testing.T) {
	site := func(policy string) string {
		return `
	token_bucket {
		redis redis://REDIS_ADDR
		dimension user {http.request.header.X-User}
		tier free {
			user 3 1/1h
		}
		on_redis_error ` + policy + `
	}
	respond "{http.token_bucket.decision} degraded={http.token_bucket.degraded}"`
	}
	g := startGateway(t, site("allow"))
	g.redis.Stop()

	t.Run("allow", func(t *testing.T) {
		for i := 0; i < 5; i++ {
			r := g.get("X-User", "alice")
			if r.status != http.StatusOK || r.body != "allowed degraded=true" {
				t.Fatalf("request %d: %d %q, want 200 \"allowed degraded=true\"", i+1, r.status, r.body)
			}
			wantNoRateLimitHeaders(t, "allow", r.header)
			wantHeaders(t, "allow", r.header, "Retry-After", "")
		}
	})
	t.Run("deny", func(t *testing.T) {
		g.load(site("deny"))
		r := g.get("X-User", "alice")
		const want = `{"error":"rate_limiter_unavailable","message":"the rate limiter cannot reach its store; retry shortly"}` + "\n"
		if r.status != http.StatusServiceUnavailable || r.body != want {
			t.Errorf("%d %q, want 503 %q", r.status, r.body, want)
		}
		wantHeaders(t, "deny", r.header, "Content-Type", "application/json", "Retry-After", "1")
		wantNoRateLimitHeaders(t, "deny", r.header)
	})
	t.Run("local", func(t *testing.T) {
		g.load(site("local"))
		for i := 0; i < 3; i++ {
			r := g.get("X-User", "alice")
			if r.status != http.StatusOK || r.body != "allowed degraded=true" {
				t.Fatalf("request %d: %d %q, want 200 \"allowed degraded=true\"", i+1, r.status, r.body)
			}
			wantNoRateLimitHeaders(t, "local", r.header)
		}
		r := g.get("X-User", "alice")
		if r.status != http.StatusTooManyRequests || !strings.HasPrefix(r.body, `{"error":"rate_limit_exceeded","retry_after":3600,`) ||
			!strings.HasSuffix(r.body, `,"tier":"free","dimension":"user"}`+"\n") {
			t.Errorf("fourth request: %d %q, want 429 rate_limit_exceeded", r.status, r.body)
		}
		wantHeaders(t, "local denial", r.header, "Retry-After", "3600", "Cache-Control", "no-store")
		wantNoRateLimitHeaders(t, "local denial", r.header)
		if r := g.get("X-User", "bob"); r.status != http.StatusOK {
			t.Errorf("bob: status %d, want 200", r.status)
		}
	})
}
