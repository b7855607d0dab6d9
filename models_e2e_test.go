package tokenbucket

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// Per-model limits (models <glob>) and {http.token_bucket.model}, end to
// end: a real Caddy, a real redis-server (a real Redis Cluster for the
// slot test), the request bodies an LLM client sends. Every limit refills
// at one token an hour, so no whole token comes back while a test runs and
// every count is exact.

// modelChat is a chat completion for model (no "model" member when model
// is "") whose estimate is exactly maxTokens: no prompt text, a completion
// budget of maxTokens.
func modelChat(model string, maxTokens int64) string {
	if model == "" {
		return fmt.Sprintf(`{"messages":[],"max_tokens":%d}`, maxTokens)
	}
	return fmt.Sprintf(`{"model":%q,"messages":[],"max_tokens":%d}`, model, maxTokens)
}

// modelLimiter is a token_bucket on the X-API-Key header, in tier free
// with limits, cost estimate and the extra subdirectives, followed by a
// later handler that shows {http.token_bucket.model} as X-Model.
func modelLimiter(limits, extra string) string {
	return `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension api_key {http.request.header.X-API-Key}
			tier free {
				` + limits + `
			}
			cost estimate
			` + extra + `
		}
		header >X-Model {http.token_bucket.model}`
}

// wantNoModel checks that a response's X-Model (header >X-Model
// {http.token_bucket.model}) shows no model: README says the placeholder
// is empty without a model. The handler leaves it unset, and Caddy's
// header directive leaves an unknown placeholder as it is; either is no
// model.
func wantNoModel(t *testing.T, what string, h http.Header) {
	t.Helper()
	if got := h.Values("X-Model"); len(got) != 1 || got[0] != "" && got[0] != "{http.token_bucket.model}" {
		t.Errorf("%s: X-Model %q, want no model (empty, or the placeholder unset)", what, got)
	}
}

// scopedKey is the key of identity's bucket of a limit scoped by models,
// for model, as README's Keys gives it: the unscoped key, then ":m:" (after
// the unit, for a tokens limit) and the hashed model.
func scopedKey(k bucket.Keyer, dimension, identity, unit, model string) string {
	scope := "m:"
	if unit != "" {
		scope = unit + ":m:"
	}
	return k.Key(dimension, identity, scope+k.ID(model))
}

// rlItem is one item of a RateLimit header: "<name>";r=<r>;t=<t>.
type rlItem struct {
	name string
	r, t int64
}

var rlItemRE = regexp.MustCompile(`^"([^"]+)";r=(\d+);t=(\d+)$`)

// rateLimitItems parses the response's one RateLimit header; none when
// it has none.
func rateLimitItems(t *testing.T, what string, h http.Header) []rlItem {
	t.Helper()
	vals := h.Values("RateLimit")
	if len(vals) == 0 {
		return nil
	}
	if len(vals) != 1 {
		t.Fatalf("%s: %d RateLimit headers %q, want one", what, len(vals), vals)
	}
	var items []rlItem
	for _, s := range strings.Split(vals[0], ", ") {
		m := rlItemRE.FindStringSubmatch(s)
		if m == nil {
			t.Fatalf("%s: RateLimit item %q in %q is not \"name\";r=N;t=N", what, s, vals[0])
		}
		r, _ := strconv.ParseInt(m[2], 10, 64)
		tt, _ := strconv.ParseInt(m[3], 10, 64)
		items = append(items, rlItem{m[1], r, tt})
	}
	return items
}

// wantItems checks that RateLimit has exactly the items named, in order,
// with the remaining tokens given: name, remaining pairs.
func wantItems(t *testing.T, what string, h http.Header, pairs ...any) {
	t.Helper()
	var want []string
	for i := 0; i+1 < len(pairs); i += 2 {
		want = append(want, fmt.Sprintf("%s r=%d", pairs[i], pairs[i+1]))
	}
	var got []string
	for _, it := range rateLimitItems(t, what, h) {
		got = append(got, fmt.Sprintf("%s r=%d", it.name, it.r))
	}
	if !slices.Equal(got, want) {
		t.Errorf("%s: RateLimit items %q (header %q), want %q", what, got, h.Get("RateLimit"), want)
	}
}

// wantKeys checks that the gateway's Redis holds exactly keys.
func wantKeys(t *testing.T, g *e2eGateway, keys ...string) {
	t.Helper()
	got := g.keys()
	slices.Sort(got)
	keys = slices.Clone(keys)
	slices.Sort(keys)
	if !slices.Equal(got, keys) {
		t.Errorf("Redis holds keys\n\t%s\nwant\n\t%s", strings.Join(got, "\n\t"), strings.Join(keys, "\n\t"))
	}
}

// wantStored checks the whole tokens stored at each key: key, tokens pairs.
func wantStored(t *testing.T, g *e2eGateway, pairs ...any) {
	t.Helper()
	for i := 0; i+1 < len(pairs); i += 2 {
		key, want := pairs[i].(string), int64(pairs[i+1].(int))
		if got := storedTokens(t, g.rdb, key); got != want {
			t.Errorf("%s holds %d whole tokens, want %d", key, got, want)
		}
	}
}

// wantDenied checks a 429 decided by Redis on one bucket, named item,
// that needs one more token than it has (refilled at 1 an hour since
// t0, a reading of the Redis clock before the bucket was first charged):
// Retry-After-Ms is 3600000 less at most the refill since t0, Retry-After
// and the item's t are it in whole seconds, the json body says so.
func wantDenied(t *testing.T, lg *llmGateway, what string, r e2eResponse, t0 int64, item, tier, dimension string) {
	t.Helper()
	t1 := lg.redisMicros()
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("%s: status %d, want 429: %s", what, r.status, r.body)
	}
	ms, err := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
	if err != nil || ms > 3_600_000 || ms < 3_600_000-(t1-t0)/1000-1 {
		t.Fatalf("%s: Retry-After-Ms %q, want 3600000 less at most the %d ms since the first charge",
			what, r.header.Get("Retry-After-Ms"), (t1-t0)/1000)
	}
	secs := strconv.FormatInt((ms+999)/1000, 10)
	wantHeaders(t, what, r.header,
		"Retry-After", secs,
		"RateLimit", `"`+item+`";r=0;t=`+secs,
		"X-RateLimit-Remaining", "0")
	body := fmt.Sprintf(`{"error":"rate_limit_exceeded","retry_after":%s,"retry_after_ms":%d,"tier":%q,"dimension":%q}`+"\n",
		secs, ms, tier, dimension)
	if r.body != body {
		t.Errorf("%s: body %q, want %q", what, r.body, body)
	}
}

// TestModelScopedLimitsEndToEnd is README's example: 100000 tokens per API
// key, of which gpt-4o may use 20000. A gpt-4o request is charged in both
// buckets in one decision, a gpt-4o-mini request and one without a model
// only in the first; when the gpt-4o bucket is empty gpt-4o is denied
// (429 naming "api_key-tokens@gpt-4o") and charges nothing, while gpt-4.1
// still passes. The scoped bucket is <tokens key>:m:<hashed model>;
// {http.token_bucket.model} reaches the later handler.
func TestModelScopedLimitsEndToEnd(t *testing.T) {
	lg := startLLMGateway(t, modelLimiter("api_key 100000 1/1h tokens\n\t\t\t\tapi_key 20000 1/1h tokens models gpt-4o", ""))
	keyer := bucket.NewKeyer("rl:", "")
	const apiKey = "sk-model-readme"
	all := keyer.Key("api_key", apiKey, "tokens")
	gpt4o := scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4o")
	if want := all + ":m:" + keyer.ID("gpt-4o"); gpt4o != want {
		t.Fatalf("scoped key %s, want %s", gpt4o, want)
	}
	const (
		policyAll   = `"api_key-tokens";q=100000;w=360000000`
		policyGPT4o = policyAll + `, "api_key-tokens@gpt-4o";q=20000;w=72000000`
	)
	post := func(what, model string, maxTokens int64) e2eResponse {
		t.Helper()
		r := lg.post("/v1/chat/completions", modelChat(model, maxTokens), "X-API-Key", apiKey)
		if r.status == http.StatusOK {
			if got := lg.up.last(t).Model; got != model {
				t.Errorf("%s: the upstream got model %q, want %q", what, got, model)
			}
		}
		return r
	}

	t0 := lg.redisMicros()
	r := post("gpt-4o", "gpt-4o", 5000)
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o: status %d: %s", r.status, r.body)
	}
	// Both buckets were full: t is the 5000 tokens' refill, 5000 hours.
	wantHeaders(t, "gpt-4o", r.header,
		"X-Model", "gpt-4o",
		"X-Estimated-Cost", "5000",
		"RateLimit-Policy", policyGPT4o,
		"RateLimit", `"api_key-tokens";r=95000;t=18000000, "api_key-tokens@gpt-4o";r=15000;t=18000000`,
		// The most constrained: 15000 of 20000 left, against 95000 of 100000.
		"X-RateLimit-Limit", "20000",
		"X-RateLimit-Remaining", "15000")
	wantStored(t, lg.e2eGateway, all, 95000, gpt4o, 15000)

	r = post("gpt-4o-mini", "gpt-4o-mini", 1000)
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o-mini: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "gpt-4o-mini", r.header,
		"X-Model", "gpt-4o-mini",
		"RateLimit-Policy", policyAll,
		"X-RateLimit-Limit", "100000",
		"X-RateLimit-Remaining", "94000")
	wantItems(t, "gpt-4o-mini", r.header, "api_key-tokens", 94000)
	wantStored(t, lg.e2eGateway, all, 94000, gpt4o, 15000)

	// The rest of gpt-4o's 20000.
	r = post("gpt-4o rest", "gpt-4o", 15000)
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o rest: status %d: %s", r.status, r.body)
	}
	wantItems(t, "gpt-4o rest", r.header, "api_key-tokens", 79000, "api_key-tokens@gpt-4o", 0)
	wantStored(t, lg.e2eGateway, all, 79000, gpt4o, 0)

	before, beforeScoped := lg.value(all), lg.value(gpt4o)
	r = post("gpt-4o over", "gpt-4o", 1)
	wantDenied(t, lg, "gpt-4o over", r, t0, "api_key-tokens@gpt-4o", "free", "api_key")
	wantHeaders(t, "gpt-4o over", r.header, "RateLimit-Policy", policyGPT4o, "X-RateLimit-Limit", "20000", "X-Model", "gpt-4o")
	if lg.value(all) != before || lg.value(gpt4o) != beforeScoped {
		t.Error("the denied gpt-4o request changed a bucket")
	}

	r = post("gpt-4.1", "gpt-4.1", 1000)
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4.1 with gpt-4o's bucket empty: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "gpt-4.1", r.header, "X-Model", "gpt-4.1", "RateLimit-Policy", policyAll)
	wantItems(t, "gpt-4.1", r.header, "api_key-tokens", 78000)

	// No model: the scoped limit does not apply, the model stays unset.
	r = post("no model", "", 100)
	if r.status != http.StatusOK {
		t.Fatalf("no model: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "no model", r.header, "RateLimit-Policy", policyAll)
	wantNoModel(t, "no model", r.header)
	wantItems(t, "no model", r.header, "api_key-tokens", 77900)

	wantStored(t, lg.e2eGateway, all, 77900, gpt4o, 0)
	// No bucket for any model but gpt-4o.
	wantKeys(t, lg.e2eGateway, all, gpt4o)
	if n := len(lg.up.requests()); n != 5 {
		t.Errorf("the upstream saw %d requests, want the 5 allowed", n)
	}
}

// TestModelScopedFirstMatchAndGlobs: several scoped lines of one dimension
// give models different capacities, the first line of a dimension and unit
// whose globs match a model wins (gpt-4.1-mini matches both its own line
// and gpt-4.1*, and gets its own 1000), and each model a glob matches has
// its own bucket (gpt-4.1 and gpt-4.1-nano separate keys). A scoped
// requests limit is a separate dimension-and-unit group with keys
// <requests key>:m:<hashed model>. Requests without a model, or with a
// model no glob matches, are charged in the unscoped limit alone.
func TestModelScopedFirstMatchAndGlobs(t *testing.T) {
	lg := startLLMGateway(t, modelLimiter(`api_key 100000 1/1h tokens
				api_key 1000 1/1h tokens models gpt-4.1-mini
				api_key 5000 1/1h tokens models gpt-4.1* o3
				api_key 2 1/1h models gpt-4.1*`, ""))
	keyer := bucket.NewKeyer("rl:", "")
	const apiKey = "sk-model-globs"
	tok := func(model string) string { return scopedKey(keyer, "api_key", apiKey, "tokens", model) }
	req := func(model string) string { return scopedKey(keyer, "api_key", apiKey, "", model) }
	all := keyer.Key("api_key", apiKey, "tokens")
	const (
		itemAll   = "api_key-tokens"
		itemMini  = "api_key-tokens@gpt-4.1-mini"
		itemGlob  = "api_key-tokens@gpt-4.1*|o3"
		itemCount = "api_key@gpt-4.1*"
	)

	t0 := lg.redisMicros() // before any bucket is charged
	for _, step := range []struct {
		model     string
		maxTokens int64
		items     []any // RateLimit: name, remaining pairs
		policy    string
	}{
		{"gpt-4.1-mini", 100, []any{itemAll, 99900, itemMini, 900, itemCount, 1},
			`"api_key-tokens";q=100000;w=360000000, "api_key-tokens@gpt-4.1-mini";q=1000;w=3600000, "api_key@gpt-4.1*";q=2;w=7200`},
		{"gpt-4.1", 200, []any{itemAll, 99700, itemGlob, 4800, itemCount, 1},
			`"api_key-tokens";q=100000;w=360000000, "api_key-tokens@gpt-4.1*|o3";q=5000;w=18000000, "api_key@gpt-4.1*";q=2;w=7200`},
		{"gpt-4.1", 300, []any{itemAll, 99400, itemGlob, 4500, itemCount, 0}, ""},
		// Its own buckets, not gpt-4.1's: 5000 − 400 and a fresh count.
		{"gpt-4.1-nano", 400, []any{itemAll, 99000, itemGlob, 4600, itemCount, 1}, ""},
		// o3 is in the second tokens line, not in the requests line.
		{"o3", 50, []any{itemAll, 98950, itemGlob, 4950},
			`"api_key-tokens";q=100000;w=360000000, "api_key-tokens@gpt-4.1*|o3";q=5000;w=18000000`},
		{"gpt-4o", 25, []any{itemAll, 98925}, `"api_key-tokens";q=100000;w=360000000`},
		{"", 75, []any{itemAll, 98850}, `"api_key-tokens";q=100000;w=360000000`},
	} {
		what := fmt.Sprintf("model %q, %d tokens", step.model, step.maxTokens)
		r := lg.post("/v1/chat/completions", modelChat(step.model, step.maxTokens), "X-API-Key", apiKey)
		if r.status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", what, r.status, r.body)
		}
		wantItems(t, what, r.header, step.items...)
		if step.policy != "" {
			wantHeaders(t, what, r.header, "RateLimit-Policy", step.policy)
		}
	}

	// gpt-4.1's requests bucket (2) is empty: denied by it alone, nothing
	// charged; gpt-4.1-nano's is not.
	before := []string{lg.value(all), lg.value(tok("gpt-4.1")), lg.value(req("gpt-4.1"))}
	r := lg.post("/v1/chat/completions", modelChat("gpt-4.1", 10), "X-API-Key", apiKey)
	wantDenied(t, lg, "gpt-4.1 third request", r, t0, itemCount, "free", "api_key")
	if after := []string{lg.value(all), lg.value(tok("gpt-4.1")), lg.value(req("gpt-4.1"))}; !slices.Equal(before, after) {
		t.Error("the denied request changed a bucket")
	}
	if r := lg.post("/v1/chat/completions", modelChat("gpt-4.1-nano", 10), "X-API-Key", apiKey); r.status != http.StatusOK {
		t.Fatalf("gpt-4.1-nano second request: status %d: %s", r.status, r.body)
	} else {
		wantItems(t, "gpt-4.1-nano second request", r.header, itemAll, 98840, itemGlob, 4590, itemCount, 0)
	}

	g := lg.e2eGateway
	wantStored(t, g,
		all, 98840,
		tok("gpt-4.1-mini"), 900,
		tok("gpt-4.1"), 4500,
		tok("gpt-4.1-nano"), 4590,
		tok("o3"), 4950,
		req("gpt-4.1-mini"), 1,
		req("gpt-4.1"), 0,
		req("gpt-4.1-nano"), 0)
	// Exactly these: no bucket for gpt-4o, none for o3's requests.
	wantKeys(t, g, all, tok("gpt-4.1-mini"), tok("gpt-4.1"), tok("gpt-4.1-nano"), tok("o3"),
		req("gpt-4.1-mini"), req("gpt-4.1"), req("gpt-4.1-nano"))
}

// TestModelPlaceholderEndToEnd: {http.token_bucket.model}, set from the
// body before the buckets are built, picks the tier (tier_from), makes an
// identity (a dimension template), feeds a map whose output makes
// another identity, and reaches a later handler. A request without a model
// leaves it unset: the tier is the default and both dimensions are skipped
// (no bucket, no rate-limit header).
func TestModelPlaceholderEndToEnd(t *testing.T) {
	lg := startLLMGateway(t, `map {http.token_bucket.model} {model_family} {
			~^gpt-     openai
			~^claude-  anthropic
		}
		token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension user_model {http.request.header.X-User}/{http.token_bucket.model}
			dimension family {http.request.header.X-User}/{model_family}
			tier_from {http.token_bucket.model}
			default_tier free
			tier free {
				user_model 2 1/1h
				family 10 1/1h
			}
			tier gpt-4o {
				user_model 1 1/1h
				family 10 1/1h
			}
			cost estimate
		}
		header >X-Model {http.token_bucket.model}
		header >X-Tier {http.token_bucket.tier}`)
	keyer := bucket.NewKeyer("rl:", "")
	post := func(model string) e2eResponse {
		t.Helper()
		return lg.post("/v1/chat/completions", modelChat(model, 10), "X-User", "alice")
	}

	r := post("gpt-4o")
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "gpt-4o", r.header, "X-Model", "gpt-4o", "X-Tier", "gpt-4o",
		"RateLimit-Policy", `"user_model";q=1;w=3600, "family";q=10;w=36000`)
	wantItems(t, "gpt-4o", r.header, "user_model", 0, "family", 9)

	r = post("gpt-4o")
	if r.status != http.StatusTooManyRequests || !strings.Contains(r.body, `"tier":"gpt-4o","dimension":"user_model"`) {
		t.Fatalf("gpt-4o again: %d %s, want 429 by user_model on tier gpt-4o", r.status, r.body)
	}
	wantHeaders(t, "gpt-4o again", r.header, "X-Tier", "gpt-4o")

	// Another model: the default tier (no tier is named gpt-4o-mini), its
	// own user_model identity, the same family as gpt-4o.
	r = post("gpt-4o-mini")
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o-mini: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "gpt-4o-mini", r.header, "X-Model", "gpt-4o-mini", "X-Tier", "free")
	wantItems(t, "gpt-4o-mini", r.header, "user_model", 1, "family", 8)

	r = post("claude-3-5-haiku")
	if r.status != http.StatusOK {
		t.Fatalf("claude: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "claude", r.header, "X-Model", "claude-3-5-haiku", "X-Tier", "free")
	wantItems(t, "claude", r.header, "user_model", 1, "family", 9)

	r = post("")
	if r.status != http.StatusOK {
		t.Fatalf("no model: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "no model", r.header, "X-Tier", "free")
	wantNoModel(t, "no model", r.header)
	wantNoRateLimitHeaders(t, "no model", r.header)

	g := lg.e2eGateway
	userModel := func(m string) string { return keyer.Key("user_model", "alice/"+m, "") }
	family := func(f string) string { return keyer.Key("family", "alice/"+f, "") }
	wantStored(t, g,
		userModel("gpt-4o"), 0,
		userModel("gpt-4o-mini"), 1,
		userModel("claude-3-5-haiku"), 1,
		family("openai"), 8,
		family("anthropic"), 9)
	wantKeys(t, g, userModel("gpt-4o"), userModel("gpt-4o-mini"), userModel("claude-3-5-haiku"),
		family("openai"), family("anthropic"))
}

// TestModelMapPicksTier: a map turns {http.token_bucket.model} into the
// tier name that tier_from reads. As README says, Caddy evaluates a map
// when its output is read, so the model must be known before the buckets
// are built: here because a limit is scoped by models (in another tier).
// A gpt-4o request is decided on tier pro (100000 tokens, and its scoped
// requests limit), any other model on free (1000 tokens).
func TestModelMapPicksTier(t *testing.T) {
	lg := startLLMGateway(t, `map {http.token_bucket.model} {model_tier} {
			gpt-4o  pro
		}
		token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			tier_from {model_tier}
			default_tier free
			tier free {
				user 1000 1/1h tokens
			}
			tier pro {
				user 100000 1/1h tokens
				user 10 1/1h models gpt-4o*
			}
			cost estimate
		}
		header >X-Model {http.token_bucket.model}
		header >X-Tier {http.token_bucket.tier}`)
	r := lg.post("/v1/chat/completions", modelChat("gpt-4o", 5000), "X-User", "alice")
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o: status %d, want 200 on tier pro: %s", r.status, r.body)
	}
	wantHeaders(t, "gpt-4o", r.header, "X-Model", "gpt-4o", "X-Tier", "pro",
		"RateLimit-Policy", `"user-tokens";q=100000;w=360000000, "user@gpt-4o*";q=10;w=36000`)
	wantItems(t, "gpt-4o", r.header, "user-tokens", 95000, "user@gpt-4o*", 9)

	// gpt-4o-mini matches the glob, but the map puts it on free, which
	// scopes nothing.
	r = lg.post("/v1/chat/completions", modelChat("gpt-4o-mini", 500), "X-User", "bob")
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o-mini: status %d: %s", r.status, r.body)
	}
	wantHeaders(t, "gpt-4o-mini", r.header, "X-Model", "gpt-4o-mini", "X-Tier", "free",
		"RateLimit-Policy", `"user-tokens";q=1000;w=3600000`)
	wantItems(t, "gpt-4o-mini", r.header, "user-tokens", 500)
}

// TestModelScopedSettlement: settle applies to the scoped tokens buckets
// as to the unscoped one: a gpt-test request estimated at 500 is charged
// 500 in both; its answer reports its usage and both are settled by the
// same difference, stored exactly as bucket.SettleState says, with one
// settlement marker (on the first tokens key). A request for another
// model is settled in the unscoped bucket alone.
func TestModelScopedSettlement(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 100000 1/1h tokens\n\t\t\t\tuser 10000 1/1h tokens models gpt-test",
		"cost estimate\n\t\t\tsettle"))
	keyer := bucket.NewKeyer("rl:", "")
	allSpec, scopedSpec := llmSpec(t, 100000, "1/1h"), llmSpec(t, 10000, "1/1h")
	for _, tc := range []struct {
		name, usage string
		used        int64
	}{
		{"refund", "100,220", 320},
		{"charge", "400,500", 900},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "settle-" + tc.name
			all := keyer.Key("user", user, "tokens")
			scoped := scopedKey(keyer, "user", user, "tokens", "gpt-test")
			lg.up.watchKeys(lg.rdb, all, scoped)
			r := lg.post("/v1/chat/completions", chat500, "X-User", user, "X-Test-Usage", tc.usage)
			if r.status != http.StatusOK {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			wantHeaders(t, "response", r.header, "X-Estimated-Cost", "500")
			wantItems(t, "response", r.header, "user-tokens", 99500, "user-tokens@gpt-test", 9500)
			lg.sync()
			seen := lg.up.last(t)
			if chargedFromFull(t, allSpec, seen, all) != 500 || chargedFromFull(t, scopedSpec, seen, scoped) != 500 {
				t.Fatal("the upstream did not see 500 charged in both buckets")
			}
			a := lg.settledExactly("unscoped", all, allSpec, seen, 500, tc.used)
			s := lg.settledExactly("scoped", scoped, scopedSpec, seen, 500, tc.used)
			if wholeTokens(a) != 100000-tc.used || wholeTokens(s) != 10000-tc.used {
				t.Errorf("after the settlement: %d and %d whole tokens, want %d and %d",
					wholeTokens(a), wholeTokens(s), 100000-tc.used, 10000-tc.used)
			}
			if m := lg.markers(all); len(m) != 1 {
				t.Errorf("markers %q, want one", m)
			}
			if m := lg.markers(scoped); len(m) != 0 {
				t.Errorf("markers on the scoped key %q, want none (one marker per request)", m)
			}

			// The next request is decided on the settled buckets.
			r = lg.post("/v1/chat/completions", chat500, "X-User", user)
			wantItems(t, "next request", r.header, "user-tokens", 100000-tc.used-500, "user-tokens@gpt-test", 10000-tc.used-500)
			lg.sync()
		})
	}

	t.Run("other model", func(t *testing.T) {
		lg.t = t
		const user = "settle-other"
		all := keyer.Key("user", user, "tokens")
		lg.up.watchKeys(lg.rdb, all)
		other := strings.Replace(chat500, `"gpt-test"`, `"gpt-other"`, 1)
		r := lg.post("/v1/chat/completions", other, "X-User", user, "X-Test-Usage", "100,220")
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		wantItems(t, "response", r.header, "user-tokens", 99500)
		lg.sync()
		lg.wantSettled("unscoped", all, allSpec, lg.up.last(t), 320-500, 100000-320)
		if v := lg.value(scopedKey(keyer, "user", user, "tokens", "gpt-test")); v != "" {
			t.Errorf("another model's request made a gpt-test bucket: %x", v)
		}
	})
}

// TestModelScopedOnRedisCluster runs the README example on a real
// three-master Redis Cluster: a scoped key carries its identity's hash
// tag, so it is on the slot (and node) of the identity's unscoped key, and
// every request, allowed or denied, is decided in one script call on that
// node alone (a request whose buckets fell on two slots would take a
// pipelined call per slot, and a refund on a denial).
func TestModelScopedOnRedisCluster(t *testing.T) {
	ensureCaddy(t)
	cluster := redistest.StartCluster(t, 3)
	g := startGateway(t, `respond "not yet"`)
	lg := &llmGateway{e2eGateway: g, client: g.client}
	g.load(`token_bucket {
		redis {
			address ` + strings.Join(cluster.Addrs(), " ") + `
			cluster
			timeout 10s
		}
		dimension api_key {http.request.header.X-API-Key}
		tier free {
			api_key 100000 1/1h tokens
			api_key 20000 1/1h tokens models gpt-4o
		}
		cost estimate
		deny_cache off
	}
	respond "ok"`)
	keyer := bucket.NewKeyer("rl:", "")
	const apiKey = "sk-model-cluster"
	all := keyer.Key("api_key", apiKey, "tokens")
	gpt4o := scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4o")
	ctx := context.Background()
	cc := cluster.Client(t)
	slotAll, err := cc.ClusterKeySlot(ctx, all).Result()
	if err != nil {
		t.Fatal(err)
	}
	if slotScoped, err := cc.ClusterKeySlot(ctx, gpt4o).Result(); err != nil || slotScoped != slotAll {
		t.Fatalf("slot of %s = %d (%v), want %d, the slot of %s", gpt4o, slotScoped, err, slotAll, all)
	}
	node := cluster.NodeOf(t, all)

	// A first request loads the script on the node; count from here.
	if r := lg.post("/v1/chat/completions", modelChat("gpt-4.1", 1000), "X-API-Key", apiKey); r.status != http.StatusOK {
		t.Fatalf("first request: status %d: %s", r.status, r.body)
	}
	for _, s := range cluster.Nodes {
		if err := s.Client(t).ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	r := lg.post("/v1/chat/completions", modelChat("gpt-4o", 20000), "X-API-Key", apiKey)
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4o: status %d: %s", r.status, r.body)
	}
	wantItems(t, "gpt-4o", r.header, "api_key-tokens", 79000, "api_key-tokens@gpt-4o", 0)
	r = lg.post("/v1/chat/completions", modelChat("gpt-4o", 1), "X-API-Key", apiKey)
	if r.status != http.StatusTooManyRequests || !strings.HasPrefix(r.header.Get("RateLimit"), `"api_key-tokens@gpt-4o";r=0;t=`) {
		t.Fatalf("gpt-4o over: %d, RateLimit %q: %s; want 429 by api_key-tokens@gpt-4o", r.status, r.header.Get("RateLimit"), r.body)
	}
	r = lg.post("/v1/chat/completions", modelChat("gpt-4.1", 500), "X-API-Key", apiKey)
	if r.status != http.StatusOK {
		t.Fatalf("gpt-4.1: status %d: %s", r.status, r.body)
	}
	wantItems(t, "gpt-4.1", r.header, "api_key-tokens", 78500)

	// Both buckets on the node of their slot, exact.
	nc := node.Client(t)
	if got := storedTokens(t, nc, all); got != 78500 {
		t.Errorf("%s on %s holds %d whole tokens, want 78500", all, node.Addr, got)
	}
	if got := storedTokens(t, nc, gpt4o); got != 0 {
		t.Errorf("%s on %s holds %d whole tokens, want 0", gpt4o, node.Addr, got)
	}
	// Three requests, three script calls, all on that node: nothing else
	// ran a script (no second slot, no refund).
	for _, s := range cluster.Nodes {
		want := int64(0)
		if s == node {
			want = 3
		}
		if got := redistest.Calls(t, s.Client(t), "evalsha") + redistest.Calls(t, s.Client(t), "eval"); got != want {
			t.Errorf("node %s ran %d scripts for the 3 requests, want %d", s.Addr, got, want)
		}
	}
}

// TestModelConfigErrors: a limit scoped by models needs cost estimate
// (which reads the model from the body), each glob is 1 to 128 of the
// characters of model names, and one dimension and unit may not have the
// same glob twice; each is refused by the parser, by `caddy adapt`, by a
// live /load and in JSON, naming the field and the value. The same glob
// on another unit, or on another dimension, is fine.
func TestModelConfigErrors(t *testing.T) {
	const dims = "dimension api_key {http.request.header.X-API-Key}\ndimension user {http.request.header.X-User}\n"
	tier := func(limits string) string { return dims + "tier free {\n" + limits + "\n}\n" }
	for _, tc := range []struct {
		name, block, want string
	}{
		{"models without cost estimate", tier("api_key 100 1/h tokens models gpt-4o"),
			`tiers[0].limits[0].models ["gpt-4o"]: needs estimate (cost estimate), which reads the request body's model`},
		{"models without cost estimate, with a static cost", tier("api_key 100 1/h tokens models gpt-4o") + "cost 5",
			`tiers[0].limits[0].models ["gpt-4o"]: needs estimate (cost estimate)`},
		{"models without a glob", tier("api_key 100 1/h tokens models") + "cost estimate",
			`models for dimension "api_key": at least one model glob`},
		{"glob with a space", tier(`api_key 100 1/h tokens models gpt-4o "gpt 4o"`) + "cost estimate",
			`tiers[0].limits[0].models[1] "gpt 4o": must be 1 to 128 letters, digits or ._:/@+-*`},
		{"glob with a quote", tier(`api_key 100 1/h tokens models "gpt\"4o"`) + "cost estimate",
			`tiers[0].limits[0].models[0] "gpt\"4o": must be 1 to 128 letters, digits or ._:/@+-*`},
		{"glob too long", tier("api_key 100 1/h tokens models "+strings.Repeat("g", 129)) + "cost estimate",
			`tiers[0].limits[0].models[0] "` + strings.Repeat("g", 129) + `": must be 1 to 128`},
		{"duplicate glob on two lines", tier("api_key 100 1/h tokens models gpt-4o o3\napi_key 50 1/h tokens models o1 gpt-4o") + "cost estimate",
			`tiers[0].limits[1].models[1] "gpt-4o": tier "free" has two tokens limits on dimension "api_key" for this model glob`},
		{"duplicate glob on one line", tier("api_key 100 1/h models gpt-4.1* gpt-4.1*") + "cost estimate",
			`tiers[0].limits[0].models[1] "gpt-4.1*": tier "free" has two requests limits on dimension "api_key" for this model glob`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := parseTokenBucket(tc.block); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("parse error = %v\nwant it to contain %s", err, tc.want)
			}
			if _, err := adaptCaddyfile(errorCaddyfile(tc.block)); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("adapt error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}

	// The same glob on another unit, another dimension, or beside an
	// unscoped limit of the same unit, loads.
	ok := tier("api_key 100 1/h tokens models gpt-4o\napi_key 10 1/h models gpt-4o\nuser 100 1/h tokens models gpt-4o\napi_key 1000 1/h tokens") + "cost estimate"
	if _, err := parseTokenBucket(ok); err != nil {
		t.Errorf("a glob on two units and two dimensions: %v", err)
	}

	// JSON, which skips the parser: compile names the JSON fields.
	jsonLimit := func(l string, estimate bool) string {
		h := jsonErrorLimit(l)
		if estimate {
			h = strings.Replace(h, `"handler": "token_bucket",`, `"handler": "token_bucket", "estimate": {},`, 1)
		}
		return h
	}
	for _, tc := range []struct{ name, handler, want string }{
		{"models without estimate", jsonLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 1, "unit": "tokens", "models": ["gpt-4o"]}`, false),
			`tiers[0].limits[0].models ["gpt-4o"]: needs estimate (cost estimate), which reads the request body's model`},
		{"glob with a quote", jsonLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 1, "models": ["gpt\"4o"]}`, true),
			`tiers[0].limits[0].models[0] "gpt\"4o": must be 1 to 128 letters, digits or ._:/@+-*`},
		{"empty glob", jsonLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 1, "models": [""]}`, true),
			`tiers[0].limits[0].models[0] "": must be 1 to 128`},
		{"duplicate glob", jsonLimit(`{"dimension": "user", "capacity": 10, "refill_rate": 1, "models": ["o3"]}, {"dimension": "user", "capacity": 5, "refill_rate": 1, "models": ["o3"]}`, true),
			`tiers[0].limits[1].models[0] "o3": tier "free" has two requests limits on dimension "user" for this model glob`},
	} {
		t.Run("json "+tc.name, func(t *testing.T) {
			if err := compileJSON(tc.handler); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("compile error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}

	// A live Caddy refuses it at load.
	t.Run("load", func(t *testing.T) {
		ensureCaddy(t)
		block := tier("api_key 100 1/h tokens models gpt-4o")
		want := `tiers[0].limits[0].models ["gpt-4o"]: needs estimate (cost estimate)`
		if err := postLoad(errorCaddyfile(block), "caddyfile"); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("/load error = %v\nwant it to contain %s", err, want)
		}
	})
}

// TestAdminBucketModel: the admin API's bucket endpoints take model: with
// it, the scoped limit whose globs match and that model's bucket (the
// tokens left after known traffic); without it, the unscoped limit's
// bucket; a model no scoped limit matches is 404. A reset with model
// empties that bucket alone.
func TestAdminBucketModel(t *testing.T) {
	lg := startLLMGateway(t, modelLimiter("api_key 100000 1/1h tokens\n\t\t\t\tapi_key 20000 1/1h tokens models gpt-4o gpt-4.1*", ""))
	keyer := bucket.NewKeyer("rl:", "")
	const apiKey = "sk-model-admin"
	for _, b := range []struct {
		model string
		n     int64
	}{{"gpt-4o", 5000}, {"gpt-4.1-mini", 700}, {"o3", 300}} {
		if r := lg.post("/v1/chat/completions", modelChat(b.model, b.n), "X-API-Key", apiKey); r.status != http.StatusOK {
			t.Fatalf("%s: status %d: %s", b.model, r.status, r.body)
		}
	}
	all := keyer.Key("api_key", apiKey, "tokens")
	for _, tc := range []struct {
		name, target, body string
		model, key         string
		tokens, capacity   int64
	}{
		{"gpt-4o", bucketQuery("dimension", "api_key", "unit", "tokens", "identity", apiKey, "model", "gpt-4o"), "",
			"gpt-4o", scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4o"), 15000, 20000},
		{"gpt-4.1-mini by glob", bucketQuery("dimension", "api_key", "unit", "tokens", "identity", apiKey, "model", "gpt-4.1-mini"), "",
			"gpt-4.1-mini", scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4.1-mini"), 19300, 20000},
		{"by hashed id", bucketQuery("dimension", "api_key", "unit", "tokens", "id", keyer.ID(apiKey), "model", "gpt-4o"), "",
			"gpt-4o", scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4o"), 15000, 20000},
		{"POST body", "/token_bucket/bucket", `{"dimension":"api_key","unit":"tokens","identity":"` + apiKey + `","model":"gpt-4o"}`,
			"gpt-4o", scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4o"), 15000, 20000},
		{"a matching model never used", bucketQuery("dimension", "api_key", "unit", "tokens", "identity", apiKey, "model", "gpt-4.1"), "",
			"gpt-4.1", scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4.1"), 20000, 20000},
		{"no model: unscoped", bucketQuery("dimension", "api_key", "unit", "tokens", "identity", apiKey), "",
			"", all, 100000 - 6000, 100000},
	} {
		method := http.MethodGet
		if tc.body != "" {
			method = http.MethodPost
		}
		st := adminBucket(t, method, tc.target, tc.body)
		if st.Key != tc.key || st.Model != tc.model || st.Tokens != tc.tokens || st.Capacity != tc.capacity ||
			st.Unit != "tokens" || st.Dimension != "api_key" || st.ID != keyer.ID(apiKey) {
			t.Errorf("%s: %+v\nwant key %s, model %q, %d of %d tokens", tc.name, st, tc.key, tc.model, tc.tokens, tc.capacity)
		}
	}
	status, body := adminDo(t, http.MethodGet, bucketQuery("dimension", "api_key", "unit", "tokens", "identity", apiKey, "model", "o3"), "")
	if want := `tier \"free\" has no tokens limit on dimension \"api_key\" for model \"o3\"`; status != http.StatusNotFound || !strings.Contains(body, want) {
		t.Errorf("a model no glob matches: %d %s, want 404 with %s", status, body, want)
	}
	if strings.Contains(body, apiKey) {
		t.Errorf("the error echoes the identity: %s", body)
	}

	// Reset gpt-4o's bucket: it alone is full again.
	st := adminBucket(t, http.MethodDelete, bucketQuery("dimension", "api_key", "unit", "tokens", "identity", apiKey, "model", "gpt-4o"), "")
	if st.Deleted == nil || !*st.Deleted || st.Tokens != 20000 || st.Model != "gpt-4o" {
		t.Errorf("reset: %+v, want deleted, 20000 tokens", st)
	}
	wantStored(t, lg.e2eGateway, all, 94000, scopedKey(keyer, "api_key", apiKey, "tokens", "gpt-4.1-mini"), 19300)
	r := lg.post("/v1/chat/completions", modelChat("gpt-4o", 1000), "X-API-Key", apiKey)
	wantItems(t, "after the reset", r.header, "api_key-tokens", 93000, "api_key-tokens@gpt-4o|gpt-4.1*", 19000)
}

// TestModelBucketsNeedAReadableBody: when the buckets depend on the model
// (a limit scoped by models, a dimension naming
// {http.token_bucket.model}), a body the estimate cannot read is answered
// 400 invalid_body before any bucket: built without its model the request
// would pass every scoped limit, while a lenient upstream reads the same
// body after all (pydantic reads "max_tokens":"50" as 50, and any
// upstream takes a body over max_body). Neither the upstream nor Redis
// sees such a request, and a readable one is still limited.
func TestModelBucketsNeedAReadableBody(t *testing.T) {
	invalid := []struct{ name, body string }{
		{"budget_string", `{"model":"gpt-4o","messages":[],"max_tokens":"50"}`},
		{"budget_float", `{"model":"gpt-4o","messages":[],"max_tokens":50.0}`},
		{"not_json", `hello`},
		{"over_max_body", `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("a", 2048) + `"}]}`},
		{"too_deep", `{"model":"gpt-4o","x":` + strings.Repeat("[", 130) + strings.Repeat("]", 130) + `}`},
	}
	for _, cfg := range []struct{ name, limiter string }{
		{"scoped_limit", `token_bucket {
			redis redis://REDIS_ADDR
			dimension api_key {http.request.header.X-API-Key}
			tier free {
				api_key 100 1/1h
				api_key 2 1/1h models gpt-4o
			}
			cost estimate {
				max_body 1KiB
			}
		}`},
		{"model_dimension", `token_bucket {
			redis redis://REDIS_ADDR
			dimension model {http.token_bucket.model}
			tier free {
				model 2 1/1h
			}
			cost estimate {
				max_body 1KiB
			}
		}`},
	} {
		t.Run(cfg.name, func(t *testing.T) {
			lg := startLLMGateway(t, cfg.limiter)
			for _, tc := range invalid {
				r := lg.post("/v1/chat/completions", tc.body, "X-API-Key", "sk-a")
				want := string(invalidBodyError.json)
				if r.status != http.StatusBadRequest || r.body != want {
					t.Errorf("%s: %d %q, want 400 %q", tc.name, r.status, r.body, want)
				}
			}
			if n := len(lg.up.requests()); n != 0 {
				t.Errorf("the upstream saw %d of the invalid bodies, want none", n)
			}
			wantKeys(t, lg.e2eGateway)
			// A form (an audio transcription, a file upload) has no model
			// the estimate reads: it passes as a body without "model"
			// does, whatever its size. A JSON body labelled a form is
			// still JSON.
			const mp = "multipart/form-data; boundary=XyZ"
			form := "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ\r\n" +
				"Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n" + strings.Repeat("\x00", 4096) + "\r\n--XyZ--\r\n"
			for _, body := range []string{form, form[:200] + "\r\n--XyZ--\r\n"} {
				if r := lg.post("/v1/audio/transcriptions", body, "X-API-Key", "sk-a", "Content-Type", mp); r.status == http.StatusBadRequest {
					t.Errorf("a form of %d bytes: 400 %q, want it passed on", len(body), r.body)
				}
			}
			if seen := lg.up.requests(); len(seen) != 2 || string(seen[0].Body) != form {
				t.Errorf("the upstream saw %d of the 2 forms (the first whole: %v)", len(seen), len(seen) > 0 && string(seen[0].Body) == form)
			}
			if r := lg.post("/v1/chat/completions", invalid[3].body, "X-API-Key", "sk-a", "Content-Type", mp); r.status != http.StatusBadRequest {
				t.Errorf("a JSON body over max_body labelled a form: %d %q, want 400", r.status, r.body)
			}
			for i, want := range []int{200, 200, 429} {
				if r := lg.post("/v1/chat/completions", modelChat("gpt-4o", 10), "X-API-Key", "sk-a"); r.status != want {
					t.Errorf("gpt-4o request %d: status %d, want %d: %s", i+1, r.status, want, r.body)
				}
			}
		})
	}
}

// TestModelScopedQuotaBesideBucket: a quota scoped by models is a scope of
// its own beside a bucket of the same dimension, unit and models (as
// validate counts them): both apply to a gpt-4o request, and the quota
// denies what the bucket would allow.
func TestModelScopedQuotaBesideBucket(t *testing.T) {
	lg := startLLMGateway(t, modelLimiter(`api_key 1000 1/1h tokens models gpt-4o
				api_key 300 per day tokens models gpt-4o`, ""))
	r := lg.post("/v1/chat/completions", modelChat("gpt-4o", 100), "X-API-Key", "sk-scoped-quota")
	if r.status != http.StatusOK {
		t.Fatalf("the first request: %d: %s", r.status, r.body)
	}
	wantItems(t, "the first request", r.header, "api_key-tokens@gpt-4o", 900, "api_key-tokens-per-day@gpt-4o", 200)
	r = lg.post("/v1/chat/completions", modelChat("gpt-4o", 250), "X-API-Key", "sk-scoped-quota")
	if r.status != http.StatusTooManyRequests || !strings.Contains(r.body, `"rate_limit_exceeded"`) {
		t.Fatalf("250 tokens with 200 left of the day's 300: %d: %s; want 429 rate_limit_exceeded", r.status, r.body)
	}
	wantItems(t, "the denial", r.header, "api_key-tokens-per-day@gpt-4o", 200)
}

// TestModelBucketsOfAMixedBatch: where the buckets depend on the model, a
// batch whose requests name several models (or name one and its top level
// another) is answered 400 mixed_models before any bucket: priced under
// one model, or none, a decoy request of another model would take a whole
// batch out of its model's limits. A batch of one model is charged to that
// model's buckets; without limits that depend on the model, a mixed batch
// passes and is charged to the tier's limits.
func TestModelBucketsOfAMixedBatch(t *testing.T) {
	// An opus request of no text and a budget of 100 tokens.
	req := func(id, model string) string {
		return `{"custom_id":"` + id + `","params":{"model":"` + model + `","max_tokens":100,"messages":[]}}`
	}
	opus3 := req("a", "claude-opus-4") + "," + req("b", "claude-opus-4") + "," + req("c", "claude-opus-4")
	batch := func(items string) string { return `{"requests":[` + items + `]}` }
	keyer := bucket.NewKeyer("rl:", "")
	const apiKey = "sk-batch"
	all := keyer.Key("api_key", apiKey, "tokens")
	opus := scopedKey(keyer, "api_key", apiKey, "tokens", "claude-opus-4")

	lg := startLLMGateway(t, modelLimiter("api_key 100000 1/1h tokens\n\t\t\t\tapi_key 500 1/1h tokens models claude-opus*", ""))
	r := lg.post("/v1/messages/batches", batch(opus3), "X-API-Key", apiKey, "Anthropic-Version", "2023-06-01")
	if r.status != http.StatusOK {
		t.Fatalf("a batch of one model: %d %s", r.status, r.body)
	}
	wantHeaders(t, "a batch of one model", r.header, "X-Model", "claude-opus-4", "X-Estimated-Cost", "300")
	wantStored(t, lg.e2eGateway, all, 100000-300, opus, 500-300)
	seen := len(lg.up.requests())
	for _, tc := range []struct{ name, body string }{
		{"decoy_model", batch(opus3 + "," + req("d", "nope"))},
		{"top_level_model", `{"model":"claude-haiku-4","requests":[` + opus3 + `]}`},
		{"duplicate_params", batch(`{"custom_id":"e","params":{"model":"claude-haiku-4","max_tokens":1,"messages":[]},` +
			`"params":{"model":"claude-opus-4","max_tokens":100,"messages":[]}}`)},
	} {
		r := lg.post("/v1/messages/batches", tc.body, "X-API-Key", apiKey, "Anthropic-Version", "2023-06-01")
		if want := string(mixedModelsError.json); r.status != http.StatusBadRequest || r.body != want {
			t.Errorf("%s: %d %q, want 400 %q", tc.name, r.status, r.body, want)
		}
	}
	if n := len(lg.up.requests()); n != seen {
		t.Errorf("the upstream saw %d of the mixed batches, want none", n-seen)
	}
	wantStored(t, lg.e2eGateway, all, 100000-300, opus, 500-300)

	// No limit depends on the model: the mixed batch is the tier's.
	lg = startLLMGateway(t, modelLimiter("api_key 100000 1/1h tokens", ""))
	r = lg.post("/v1/messages/batches", batch(opus3+","+req("d", "nope")), "X-API-Key", apiKey, "Anthropic-Version", "2023-06-01")
	if r.status != http.StatusOK {
		t.Fatalf("a mixed batch without scoped limits: %d %s", r.status, r.body)
	}
	wantHeaders(t, "a mixed batch without scoped limits", r.header, "X-Estimated-Cost", "400")
	wantNoModel(t, "a mixed batch without scoped limits", r.header)
	wantStored(t, lg.e2eGateway, all, 100000-400)
}
