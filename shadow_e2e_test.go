package tokenbucket

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/token-bucket/token_bucket/bucket"
)

// Shadow limits (a limit's shadow, and the handler-wide shadow), end to
// end through a real Caddy and redis-server: decided and charged as if
// enforced, never enforced, never shown to the client, counted, audited
// and set in {http.token_bucket.shadow_denied}.

// unsetShadow is what a header template shows for
// {http.token_bucket.shadow_denied} when the handler did not set it (no
// shadow limit would have denied): Caddy leaves an unknown placeholder as
// it is.
const unsetShadow = "{http.token_bucket.shadow_denied}"

// shadowSite is a site whose token_bucket has the dimensions user
// (X-User) and api_key (X-API-Key), one tier with limits, audit_window 1h
// (so a bucket has one audit entry in a test) and extra; later handlers
// show {http.token_bucket.shadow_denied} as X-Shadow and the decision as
// X-Decision, and it answers "ok".
func shadowSite(tier, limits, extra string) string {
	return `
	header >X-Shadow {http.token_bucket.shadow_denied}
	header >X-Decision {http.token_bucket.decision}
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		dimension api_key {http.request.header.X-API-Key}
		tier ` + tier + ` {
			` + limits + `
		}
		audit_window 1h
		` + extra + `
	}
	respond "ok"`
}

// auditEntries reads the JSON entries of an audit log file.
func auditEntries(t *testing.T, logFile string) []map[string]any {
	t.Helper()
	raw, err := os.ReadFile(logFile)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var entries []map[string]any
	sc := bufio.NewScanner(strings.NewReader(string(raw)))
	for sc.Scan() {
		var e map[string]any
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("audit line %q: %v", sc.Text(), err)
		}
		entries = append(entries, e)
	}
	return entries
}

// TestShadowLimitEndToEnd: a shadow limit of 2 requests per API key
// (refill 1 a minute) tried beside the enforced limit of 100 (refill 1 an
// hour) of the same dimension. Four requests of one key are all allowed;
// the 3rd and 4th, which the shadow limit would have denied, carry nothing
// of it (no RateLimit or RateLimit-Policy item, no Retry-After;
// X-RateLimit-* from the enforced bucket), set
// {http.token_bucket.shadow_denied} to "api_key", count 2 in
// shadow_denials_total{tier,dimension="api_key"} (and nothing in
// denials_total), and are audited once (the window) with "shadow":true.
// The shadow limit has its own bucket (<key>:shadow), charged exactly
// while it allows (1, then 0) and never written while it would deny; the
// enforced bucket is charged on all four. The admin API shows each, the
// shadow one with shadow=true.
func TestShadowLimitEndToEnd(t *testing.T) {
	tier := uniqueTier("shadow")
	g := startGateway(t, `respond "not yet"`)
	logFile := loadAudited(t, g, shadowSite(tier, "api_key 100 1/h\n\t\t\tapi_key 2 1/m shadow", ""))
	keyer := bucket.NewKeyer("rl:", "")
	const apiKey = "sk-shadow-live"
	enforcedKey, shadowKey := keyer.Key("api_key", apiKey, ""), keyer.Key("api_key", apiKey, "shadow")
	if shadowKey != enforcedKey+":shadow" {
		t.Fatalf("shadow key %s, want %s:shadow", shadowKey, enforcedKey)
	}
	denials := series("caddy_token_bucket_denials_total", "tier", tier, "dimension", "api_key")
	shadowDenials := series("caddy_token_bucket_shadow_denials_total", "tier", tier, "dimension", "api_key")
	before := scrape(t)
	before.want(t, "after provisioning", check{shadowDenials, 0}, check{denials, 0})

	var afterSecond string
	for i := 1; i <= 4; i++ {
		what := fmt.Sprintf("request %d", i)
		r := g.get("X-API-Key", apiKey)
		if r.status != http.StatusOK || r.body != "ok" {
			t.Fatalf("%s: status %d %q, want 200: a shadow limit never denies", what, r.status, r.body)
		}
		shadow := unsetShadow
		if i >= 3 {
			shadow = "api_key"
		}
		wantHeaders(t, what, r.header,
			"X-Shadow", shadow,
			"X-Decision", "allowed",
			"RateLimit-Policy", `"api_key";q=100;w=360000`,
			"X-RateLimit-Limit", "100",
			"X-RateLimit-Remaining", fmt.Sprint(100-i),
			"Retry-After", "",
			"Retry-After-Ms", "")
		wantItems(t, what, r.header, "api_key", 100-i)
		if got := storedTokens(t, g.rdb, enforcedKey); got != int64(100-i) {
			t.Errorf("%s: the enforced bucket holds %d, want %d", what, got, 100-i)
		}
		switch v := g.value(shadowKey); {
		case i <= 2:
			if got, ok := decodeTokens(t, v); !ok || got != int64(2-i) {
				t.Errorf("%s: the shadow bucket holds %d (stored: %v), want %d", what, got, ok, 2-i)
			}
			afterSecond = v
		case v != afterSecond:
			t.Errorf("%s: the shadow bucket that would deny was written: %x, then %x", what, afterSecond, v)
		}
	}

	scrape(t).delta(t, before, "after 4 requests",
		check{shadowDenials, 2},
		check{denials, 0},
		check{decisions(tier, "allowed"), 4},
		check{decisions(tier, "denied"), 0},
		// The shadow limit shares the enforced one's series: each request
		// counts once, as admitted.
		check{series("caddy_token_bucket_tokens_charged_total", "tier", tier, "dimension", "api_key", "unit", "requests"), 4})

	entries := auditEntries(t, logFile)
	if len(entries) != 1 {
		t.Fatalf("%d audit entries, want 1 (the 3rd request; the 4th in the window): %v", len(entries), entries)
	}
	e := entries[0]
	if ms, _ := e["retry_after_ms"].(float64); ms < 1 || ms > 60000 {
		t.Errorf("retry_after_ms %v, want 1 to 60000 (a token at 1 a minute)", e["retry_after_ms"])
	}
	want := map[string]any{
		"level": "info", "logger": AuditLogger, "msg": "request denied",
		"tier": tier, "dimension": "api_key", "unit": "requests",
		"id": keyer.ID(apiKey), "key": shadowKey,
		"reason": "rate_limit_exceeded", "cost": 1.0, "degraded": false, "shadow": true,
		"client_ip": "127.0.0.1", "suppressed": 0.0,
	}
	for k, v := range want {
		if e[k] != v {
			t.Errorf("audit entry: %s = %#v, want %#v", k, e[k], v)
		}
	}
	if len(e) != len(want)+2 { // and ts, retry_after_ms
		t.Errorf("audit entry has fields %v", e)
	}
	if strings.Contains(fmt.Sprint(e), apiKey) {
		t.Errorf("the audit entry holds the raw API key: %v", e)
	}

	// The admin API: the enforced bucket by default, the shadow one with
	// shadow=true (query or JSON body); a bad shadow value is 400.
	for _, tc := range []struct {
		name, method, target, body string
		key                        string
		tokens, capacity           int64
	}{
		{"enforced", http.MethodGet, bucketQuery("dimension", "api_key", "identity", apiKey), "", enforcedKey, 96, 100},
		{"shadow=false", http.MethodGet, bucketQuery("dimension", "api_key", "identity", apiKey, "shadow", "false"), "", enforcedKey, 96, 100},
		{"shadow=true", http.MethodGet, bucketQuery("dimension", "api_key", "identity", apiKey, "shadow", "true"), "", shadowKey, 0, 2},
		{"shadow in a POST body", http.MethodPost, "/token_bucket/bucket", `{"dimension":"api_key","id":"` + keyer.ID(apiKey) + `","shadow":true}`, shadowKey, 0, 2},
	} {
		st := adminBucket(t, tc.method, tc.target, tc.body)
		if st.Key != tc.key || st.Tokens != tc.tokens || st.Capacity != tc.capacity || st.Tier != tier {
			t.Errorf("admin %s: %+v, want %s with %d of %d tokens", tc.name, st, tc.key, tc.tokens, tc.capacity)
		}
	}
	if status, body := adminDo(t, http.MethodGet, bucketQuery("dimension", "api_key", "identity", apiKey, "shadow", "yes"), ""); status != http.StatusBadRequest ||
		!strings.Contains(body, `shadow \"yes\": must be true or false`) {
		t.Errorf("admin shadow=yes: %d %s, want 400", status, body)
	}
	if v := g.value(shadowKey); v != afterSecond {
		t.Error("the admin lookups changed the shadow bucket")
	}
}

// TestShadowScopedByModel: a shadow limit scoped by models (1000 tokens
// of gpt-4o per API key) tried beside an enforced one (100000 tokens over
// every model). Its bucket is <tokens key>:shadow:m:<hashed model>; it is
// charged while it allows and would deny the second gpt-4o request of 800
// (X-Shadow "api_key-tokens@gpt-4o"), which is allowed and charged in the
// enforced bucket; another model has no shadow bucket.
func TestShadowScopedByModel(t *testing.T) {
	lg := startLLMGateway(t, modelLimiter("api_key 100000 1/1h tokens\n\t\t\t\tapi_key 1000 1/1h tokens models gpt-4o shadow",
		"")+"\n\t\theader >X-Shadow {http.token_bucket.shadow_denied}")
	keyer := bucket.NewKeyer("rl:", "")
	const apiKey = "sk-shadow-model"
	all := keyer.Key("api_key", apiKey, "tokens")
	shadow := keyer.Key("api_key", apiKey, "tokens:shadow:m:"+keyer.ID("gpt-4o"))
	for i, step := range []struct {
		model                string
		shadowDenied         string
		enforced, shadowLeft int
	}{
		{"gpt-4o", unsetShadow, 99200, 200},
		{"gpt-4o", "api_key-tokens@gpt-4o", 98400, 200},
		{"gpt-4.1", unsetShadow, 97600, 200},
	} {
		what := fmt.Sprintf("request %d (%s)", i+1, step.model)
		r := lg.post("/v1/chat/completions", modelChat(step.model, 800), "X-API-Key", apiKey)
		if r.status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", what, r.status, r.body)
		}
		wantHeaders(t, what, r.header, "X-Shadow", step.shadowDenied, "X-Model", step.model,
			"RateLimit-Policy", `"api_key-tokens";q=100000;w=360000000`)
		wantItems(t, what, r.header, "api_key-tokens", step.enforced)
		wantStored(t, lg.e2eGateway, all, step.enforced, shadow, step.shadowLeft)
	}
	wantKeys(t, lg.e2eGateway, all, shadow)
	st := adminBucket(t, http.MethodGet, bucketQuery("dimension", "api_key", "unit", "tokens", "identity", apiKey, "model", "gpt-4o", "shadow", "true"), "")
	if st.Key != shadow || st.Tokens != 200 || st.Capacity != 1000 || st.Model != "gpt-4o" {
		t.Errorf("admin: %+v, want %s with 200 of 1000 tokens", st, shadow)
	}
}

// TestShadowHandlerWide: with the handler-wide shadow every limit is in
// shadow. Five requests of one user (2 requests, 1000 tokens, costs 400,
// 400, 100, 400 and one above the capacity) are all allowed with no
// rate-limit header of any kind (openai_headers included); each bucket is
// charged while it allows (the tokens bucket takes the 100 of the 3rd
// request that the requests bucket would have denied) and never below 0;
// every would-be denial, cost_exceeds_capacity included, is a shadow
// denial in the metrics and the placeholder, none a denial.
func TestShadowHandlerWide(t *testing.T) {
	tier := uniqueTier("shadow_all")
	g := startGateway(t, `respond "not yet"`)
	before := scrape(t)
	g.load(shadowSite(tier, "user 2 1/h\n\t\t\tuser 1000 1/h tokens", "shadow\n\t\tcost {http.request.header.X-Cost}\n\t\topenai_headers"))
	keyer := bucket.NewKeyer("rl:", "")
	// Every limit is in shadow, so every bucket is a shadow one.
	reqKey, tokKey := keyer.Key("user", "alice", "shadow"), keyer.Key("user", "alice", "tokens:shadow")
	for i, step := range []struct {
		cost           string
		shadow         string
		requests, toks int64 // stored whole tokens after
	}{
		{"400", unsetShadow, 1, 600},
		{"400", unsetShadow, 0, 200},
		{"100", "user", 0, 100},
		{"400", "user,user-tokens", 0, 100},
		{"1001", "user,user-tokens", 0, 100},
	} {
		what := fmt.Sprintf("request %d (cost %s)", i+1, step.cost)
		beforeReq, beforeTok := g.value(reqKey), g.value(tokKey)
		r := g.get("X-User", "alice", "X-Cost", step.cost)
		if r.status != http.StatusOK || r.body != "ok" {
			t.Fatalf("%s: status %d %q, want 200", what, r.status, r.body)
		}
		wantHeaders(t, what, r.header, "X-Shadow", step.shadow, "X-Decision", "allowed",
			"Retry-After", "", "Retry-After-Ms", "", "X-Should-Retry", "",
			"X-Ratelimit-Limit-Requests", "", "X-Ratelimit-Remaining-Requests", "", "X-Ratelimit-Reset-Requests", "",
			"X-Ratelimit-Limit-Tokens", "", "X-Ratelimit-Remaining-Tokens", "", "X-Ratelimit-Reset-Tokens", "")
		wantNoRateLimitHeaders(t, what, r.header)
		if got := storedTokens(t, g.rdb, reqKey); got != step.requests {
			t.Errorf("%s: the requests bucket holds %d, want %d", what, got, step.requests)
		}
		if got := storedTokens(t, g.rdb, tokKey); got != step.toks {
			t.Errorf("%s: the tokens bucket holds %d, want %d", what, got, step.toks)
		}
		if strings.Contains(step.shadow, "user,") && beforeReq != g.value(reqKey) {
			t.Errorf("%s: the requests bucket that would deny was written", what)
		}
		if strings.HasSuffix(step.shadow, "user-tokens") && beforeTok != g.value(tokKey) {
			t.Errorf("%s: the tokens bucket that would deny was written", what)
		}
	}
	after := scrape(t)
	after.delta(t, before, "after 5 requests",
		check{series("caddy_token_bucket_shadow_denials_total", "tier", tier, "dimension", "user"), 5},
		check{decisions(tier, "allowed"), 5},
		check{decisions(tier, "denied"), 0})
	if n := after[series("caddy_token_bucket_denials_total", "tier", tier, "dimension", "user")]; n != 0 {
		t.Errorf("denials_total = %v under the handler-wide shadow, want 0", n)
	}
	// The admin API finds the shadow buckets without shadow=true: every
	// limit is in shadow.
	for _, tc := range []struct {
		unit, key string
		tokens    int64
	}{{"requests", reqKey, 0}, {"tokens", tokKey, 100}} {
		st := adminBucket(t, http.MethodGet, bucketQuery("dimension", "user", "unit", tc.unit, "identity", "alice"), "")
		if st.Key != tc.key || st.Tokens != tc.tokens {
			t.Errorf("admin %s: %+v, want %s with %d tokens", tc.unit, st, tc.key, tc.tokens)
		}
	}
}

// TestShadowTokensSettlement: an enforced tokens limit per user and a
// shadow tokens limit of 600 per API key, with cost estimate and settle.
// The 1st request (estimated 500, used 320) is settled in both buckets,
// exactly as bucket.SettleState says. The 2nd (500 again) finds 280 in the
// shadow bucket: it would have denied (X-Shadow "api_key-tokens"), so it
// was not charged and its settlement leaves it exactly as it was, while
// the enforced bucket is charged and settled.
func TestShadowTokensSettlement(t *testing.T) {
	lg := startLLMGateway(t, `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			dimension api_key {http.request.header.X-API-Key}
			tier free {
				user 100000 1/1h tokens
				api_key 600 1/1h tokens shadow
			}
			cost estimate
			settle
		}
		header >X-Shadow {http.token_bucket.shadow_denied}`)
	keyer := bucket.NewKeyer("rl:", "")
	const user, apiKey = "alice", "sk-shadow-settle"
	userKey, shadowKey := keyer.Key("user", user, "tokens"), keyer.Key("api_key", apiKey, "tokens:shadow")
	userSpec, shadowSpec := llmSpec(t, 100000, "1/1h"), llmSpec(t, 600, "1/1h")
	lg.up.watchKeys(lg.rdb, userKey, shadowKey)

	r := lg.post("/v1/chat/completions", chat500, "X-User", user, "X-API-Key", apiKey, "X-Test-Usage", "100,220")
	if r.status != http.StatusOK {
		t.Fatalf("request 1: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "request 1", r.header, "X-Shadow", unsetShadow, "X-Estimated-Cost", "500",
		"RateLimit-Policy", `"user-tokens";q=100000;w=360000000`)
	wantItems(t, "request 1", r.header, "user-tokens", 99500)
	lg.sync()
	seen := lg.up.last(t)
	if chargedFromFull(t, shadowSpec, seen, shadowKey) != 500 {
		t.Fatal("the shadow bucket was not charged the estimate while it allowed")
	}
	lg.settledExactly("request 1, enforced", userKey, userSpec, seen, 500, 320)
	if st := lg.settledExactly("request 1, shadow", shadowKey, shadowSpec, seen, 500, 320); wholeTokens(st) != 280 {
		t.Errorf("request 1: the shadow bucket holds %d after the settlement, want 280", wholeTokens(st))
	}

	shadowBefore := lg.value(shadowKey)
	r = lg.post("/v1/chat/completions", chat500, "X-User", user, "X-API-Key", apiKey, "X-Test-Usage", "100,220")
	if r.status != http.StatusOK {
		t.Fatalf("request 2: status %d, want 200 (the shadow limit never denies): %s", r.status, r.body)
	}
	wantHeaders(t, "request 2", r.header, "X-Shadow", "api_key-tokens", "Retry-After", "",
		"RateLimit-Policy", `"user-tokens";q=100000;w=360000000`)
	wantItems(t, "request 2", r.header, "user-tokens", 100000-320-500)
	lg.sync()
	seen = lg.up.last(t)
	if seen.state[shadowKey] != shadowBefore {
		t.Errorf("the shadow bucket that would deny was charged: %x, then %x", shadowBefore, seen.state[shadowKey])
	}
	if v := lg.value(shadowKey); v != shadowBefore {
		t.Errorf("the settlement changed the shadow bucket that would have denied: %x, then %x", shadowBefore, v)
	}
	if st := lg.settledExactly("request 2, enforced", userKey, userSpec, seen, 500, 320); wholeTokens(st) != 100000-640 {
		t.Errorf("request 2: the enforced bucket holds %d, want %d", wholeTokens(st), 100000-640)
	}
	if m := lg.markers(userKey); len(m) != 2 {
		t.Errorf("markers %q, want one per settled request", m)
	}
}

// shadowCapLimiter is a token_bucket with an enforced limit of 100000
// tokens per user and a shadow limit of 1000 tokens per API key, with cost
// estimate; X-Shadow shows {http.token_bucket.shadow_denied}.
const shadowCapLimiter = `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			dimension api_key {http.request.header.X-API-Key}
			tier TIER {
				user 100000 1/1h tokens
				api_key 1000 1/1h tokens shadow
			}
			cost estimate
		}
		header >X-Shadow {http.token_bucket.shadow_denied}`

// TestShadowTokensLimitDoesNotCapEnforcedCost: cost estimate caps a
// request's charge at the smallest tokens capacity it is decided on, so
// that a budget alone never makes it cost_exceeds_capacity. A shadow
// limit must not change what the enforced limits charge (README: enforced
// limits of the same request are unaffected): with a shadow limit of 1000
// tokens beside an enforced 100000, a request estimated at 5000 is charged
// 5000 in the enforced bucket, as without the shadow limit.
func TestShadowTokensLimitDoesNotCapEnforcedCost(t *testing.T) {
	lg := startLLMGateway(t, strings.ReplaceAll(shadowCapLimiter, "TIER", "free"))
	r := lg.post("/v1/chat/completions", modelChat("gpt-4o", 5000), "X-User", "alice", "X-API-Key", "sk-shadow-cap")
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "response", r.header, "X-Estimated-Cost", "5000", "RateLimit-Policy", `"user-tokens";q=100000;w=360000000`)
	wantItems(t, "response", r.header, "user-tokens", 95000)
	wantStored(t, lg.e2eGateway, bucket.NewKeyer("rl:", "").Key("user", "alice", "tokens"), 95000)
}

// TestShadowTokensLimitCappedAsIfEnforced: a shadow limit is decided and
// charged exactly as if it were enforced (README). Were the 1000-token
// limit enforced, a request estimated at 5000 (no prompt, a budget of
// 5000) would be capped to 1000, allowed and charged 1000: so the shadow
// bucket is charged 1000 and records no would-be denial (no
// cost_exceeds_capacity that enforcing it would never give). A prompt
// above its capacity is a would-be denial.
func TestShadowTokensLimitCappedAsIfEnforced(t *testing.T) {
	tier := uniqueTier("shadow_cap")
	lg := startLLMGateway(t, strings.ReplaceAll(shadowCapLimiter, "TIER", tier))
	shadowKey := bucket.NewKeyer("rl:", "").Key("api_key", "sk-shadow-cap", "tokens:shadow")
	shadowDenials := series("caddy_token_bucket_shadow_denials_total", "tier", tier, "dimension", "api_key")
	before := scrape(t)
	r := lg.post("/v1/chat/completions", modelChat("gpt-4o", 5000), "X-User", "alice", "X-API-Key", "sk-shadow-cap")
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "budget above the shadow capacity", r.header, "X-Shadow", unsetShadow)
	wantStored(t, lg.e2eGateway, shadowKey, 0)
	scrape(t).delta(t, before, "budget above the shadow capacity", check{shadowDenials, 0})

	// A prompt of 1001 tokens (4004 characters) exceeds the capacity
	// whatever the cap: enforced, it would be cost_exceeds_capacity.
	huge := `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("abcd", 1001) + `"}],"max_tokens":1}`
	r = lg.post("/v1/chat/completions", huge, "X-User", "bob", "X-API-Key", "sk-shadow-cap-2")
	if r.status != http.StatusOK {
		t.Fatalf("prompt above the shadow capacity: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "prompt above the shadow capacity", r.header, "X-Shadow", "api_key-tokens", "X-Estimated-Cost", "1002")
	scrape(t).delta(t, before, "prompt above the shadow capacity", check{shadowDenials, 1})
}

// TestShadowDenialsDoNotDemote: demote after 1 denial. Shadow denials
// (api_key 1 1/h shadow, on the 2nd and 3rd request) are not counted: no
// denial counter, no demotion, the tier stays free. The first enforced
// denial (user 3 1/h, on the 4th request) is counted and demotes at once,
// so the rule is live.
func TestShadowDenialsDoNotDemote(t *testing.T) {
	g := startGateway(t, `
	header >X-Shadow {http.token_bucket.shadow_denied}
	header >X-Demoted {http.token_bucket.demoted}
	header >X-Tier {http.token_bucket.tier}
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		dimension api_key {http.request.header.X-API-Key}
		tier free {
			user 3 1/h
			api_key 1 1/h shadow
		}
		tier penalty {
			user 1 1/d
		}
		demote user after 1 denials within 1h to tier penalty for 1h
	}
	respond "ok"`)
	base := bucket.NewKeyer("rl:", "").Key("user", "alice", "")
	const unsetDemoted = "{http.token_bucket.demoted}"
	for i := 1; i <= 3; i++ {
		what := fmt.Sprintf("request %d", i)
		r := g.get("X-User", "alice", "X-API-Key", "sk-shadow-demote")
		if r.status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", what, r.status, r.body)
		}
		shadow := unsetShadow
		if i >= 2 {
			shadow = "api_key"
		}
		wantHeaders(t, what, r.header, "X-Shadow", shadow, "X-Demoted", unsetDemoted, "X-Tier", "free",
			"RateLimit-Policy", `"user";q=3;w=10800`)
		wantItems(t, what, r.header, "user", 3-i)
		if n := g.rdb.Exists(t.Context(), base+":denials", base+":demoted").Val(); n != 0 {
			t.Fatalf("%s: %d demotion keys after shadow denials alone, want none", what, n)
		}
	}
	r := g.get("X-User", "alice", "X-API-Key", "sk-shadow-demote")
	if r.status != http.StatusTooManyRequests || !strings.Contains(r.body, `"tier":"free","dimension":"user","demoted":true`) {
		t.Fatalf("request 4: %d %q, want 429 by user that demotes", r.status, r.body)
	}
	wantHeaders(t, "request 4", r.header, "X-Demoted", "true", "X-Shadow", "api_key")
	if n := g.rdb.Exists(t.Context(), base+":demoted").Val(); n != 1 {
		t.Errorf("no demotion marker after the enforced denial")
	}
}

// TestShadowDenialsOfAllowedRequestsOnly: an enforced limit of 2 and a
// shadow limit of 1 of one dimension. The 2nd request is allowed though
// the shadow limit would deny it: one shadow denial. The 3rd is denied by
// Redis and the 4th by the deny cache, both by the enforced limit: the
// shadow limit's verdict is not counted on either, so the count does not
// depend on which of the two answered. tokens_charged_total, which the two
// limits share, counts each allowed request once.
func TestShadowDenialsOfAllowedRequestsOnly(t *testing.T) {
	tier := uniqueTier("shadowdeny")
	g := startGateway(t, `respond "not yet"`)
	loadAudited(t, g, shadowSite(tier, "api_key 2 1/h\n\t\t\tapi_key 1 1/h shadow", ""))
	shadowDenials := series("caddy_token_bucket_shadow_denials_total", "tier", tier, "dimension", "api_key")
	before := scrape(t)
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusTooManyRequests, http.StatusTooManyRequests} {
		if r := g.get("X-API-Key", "sk-shadow-deny"); r.status != want {
			t.Fatalf("request %d: status %d, want %d", i+1, r.status, want)
		}
	}
	scrape(t).delta(t, before, "after 4 requests",
		check{shadowDenials, 1},
		check{series("caddy_token_bucket_denials_total", "tier", tier, "dimension", "api_key"), 2},
		check{series("caddy_token_bucket_tokens_charged_total", "tier", tier, "dimension", "api_key", "unit", "requests"), 2})
}

// TestShadowQuotasKeysOfTheirOwn: under the handler-wide shadow, a bucket
// and two calendar quotas of one dimension and unit each have a key of
// their own, <key>:shadow, <key>:day:shadow and <key>:month:shadow, and
// each would-be denial is reported. They used to share <key>:shadow, so
// the quotas and the bucket read each other's state and none ever
// reported a denial.
func TestShadowQuotasKeysOfTheirOwn(t *testing.T) {
	tier := uniqueTier("shadow_quotas")
	g := startGateway(t, shadowSite(tier, "user 2 1/h\n\t\t\tuser 3 per day\n\t\t\tuser 100 per month", "shadow"))
	for i, want := range []string{unsetShadow, unsetShadow, "user", "user,user-per-day"} {
		r := g.get("X-User", "alice")
		if r.status != http.StatusOK {
			t.Fatalf("request %d: status %d, want 200", i+1, r.status)
		}
		wantHeaders(t, fmt.Sprintf("request %d", i+1), r.header, "X-Shadow", want)
	}
	k := bucket.NewKeyer("rl:", "")
	want := []string{k.Key("user", "alice", "shadow"), k.Key("user", "alice", "day:shadow"), k.Key("user", "alice", "month:shadow")}
	got := g.keys()
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("Redis holds %q, want %q", got, want)
	}
}
