package tokenbucket

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"

	"github.com/token-bucket/token_bucket/bucket"
)

// TestHeaderValuesOwnedPerResponse: the header values of an answer share
// one backing array, but each header's slice has capacity 1 and the array
// is the response's own. Caddy's header replace rewrites values in place,
// and Header.Add appends: neither may reach another header or another
// response.
func TestHeaderValuesOwnedPerResponse(t *testing.T) {
	tiers, _ := compileTiers([]Dimension{{Name: "user"}, {Name: "ip"}}, []Tier{{Name: "free", Limits: []Limit{
		{Dimension: "user", Capacity: 10, RefillRate: 1}, {Dimension: "ip", Capacity: 100, RefillRate: 1}}}}, "", 1, false)
	tr := tiers["free"]
	limits := []*limit{&tr.limits[0], &tr.limits[1]}
	req := &request{keys: []string{"a", "b"}, takes: []bucket.Take{{Spec: limits[0].spec, Cost: 1}, {Spec: limits[1].spec, Cost: 1}}, limits: limits}
	h := &Handler{OpenAIHeaders: true}
	answer := func(allowed bool) http.Header {
		w := httptest.NewRecorder()
		if allowed {
			d := bucket.Summarize([]bucket.Result{{Remaining: 9, FullMS: 1000}, {Remaining: 99, FullMS: 1000}})
			h.writeHeaders(w.Header(), &inputs{}, tr, limits, &d)
			return w.Header()
		}
		d := bucket.Summarize([]bucket.Result{{Reason: bucket.RateLimited, RetryAfterMS: 1500}, {Remaining: 50, FullMS: 1000}})
		v := verdict{tier: tr, req: req, policy: limits, d: d, decided: true}
		h.denyHeaders(w, &inputs{}, &v, h.denialBody(&v))
		return w.Header()
	}
	for _, allowed := range []bool{true, false} {
		first, second := answer(allowed), answer(allowed)
		want := second.Clone()
		for name, vals := range first {
			if len(vals) != 1 || cap(vals) != 1 {
				t.Errorf("allowed %v: %s has len %d, cap %d; want 1, 1", allowed, name, len(vals), cap(vals))
			}
			vals[0] = "edited"
		}
		first.Add("Ratelimit", "appended")
		for name, vals := range first {
			if name != "Ratelimit" && (len(vals) != 1 || vals[0] != "edited") {
				t.Errorf("allowed %v: appending to Ratelimit changed %s to %q", allowed, name, vals)
			}
		}
		for name, vals := range second {
			if vals[0] != want.Get(name) {
				t.Errorf("allowed %v: editing one response changed %s of another to %q", allowed, name, vals[0])
			}
		}
	}
}

// answerTier compiles one tier of limits for the answer tests.
func answerTier(t testing.TB, limits ...Limit) (*tier, []*limit) {
	t.Helper()
	dims := []Dimension{{Name: "user", Identity: "{u}"}, {Name: "api_key", Identity: "{k}"}}
	tiers, _ := compileTiers(dims, []Tier{{Name: "free", Limits: limits}}, "", 1, false)
	tr := tiers["free"]
	ls := make([]*limit, len(tr.limits))
	for i := range tr.limits {
		ls[i] = &tr.limits[i]
	}
	return tr, ls
}

// TestQuotaPolicyWindowOfTheRequest: a quota's RateLimit-Policy w is the
// length of the window the request was charged in, by the request's one
// clock reading, also when the gateway's clock has passed the window's end
// by the time the headers are written: a request at the last millisecond
// of January gets w=2678400 (31 days), not February's 2419200.
func TestQuotaPolicyWindowOfTheRequest(t *testing.T) {
	tr, limits := answerTier(t, Limit{Dimension: "user", Capacity: 5, Period: "month"})
	jan := time.Date(2027, time.January, 31, 23, 59, 59, 999e6, time.UTC)
	h := &Handler{quotaLoc: time.UTC, windows: new([4]atomic.Pointer[bucket.Windows]), now: func() time.Time { return jan.Add(time.Millisecond) }}
	d := bucket.Summarize([]bucket.Result{{Remaining: 4, FullMS: 1}})
	w := httptest.NewRecorder()
	h.writeHeaders(w.Header(), &inputs{now: jan}, tr, limits, &d)
	if got, want := w.Header().Get("RateLimit-Policy"), `"user-per-month";q=5;w=2678400`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
}

// denyAnswer returns the 429 the handler h writes for d.
func denyAnswer(t *testing.T, h *Handler, tr *tier, limits []*limit, costs []int64, d *bucket.Decision) *httptest.ResponseRecorder {
	t.Helper()
	req := &request{limits: limits}
	for i, l := range limits {
		req.keys = append(req.keys, "k"+l.name)
		req.takes = append(req.takes, bucket.Take{Spec: l.spec, Cost: costs[i]})
	}
	w := httptest.NewRecorder()
	v := verdict{tier: tr, req: req, policy: limits, d: *d, decided: true}
	if err := h.respond(&exchange{inputs: inputs{w: w}}, &v, nil); err != nil {
		t.Fatal(err)
	}
	return w
}

// TestErrorFormats: the 429, 400, 408 and 503 bodies in each error_format,
// byte for byte: OpenAI's {"error":{message,type,param,code}} with the
// denying limit's unit as type, Anthropic's {"type":"error","error":{type,
// message}}, and this handler's own json. No message holds an identity.
func TestErrorFormats(t *testing.T) {
	tr, limits := answerTier(t,
		Limit{Dimension: "api_key", Capacity: 10, RefillRate: 1},
		Limit{Dimension: "api_key", Capacity: 1000, RefillRate: 100, Unit: UnitTokens})
	costs := []int64{1, 1200}
	requestsDenied := bucket.Summarize([]bucket.Result{{Reason: bucket.RateLimited, RetryAfterMS: 5400}, {Remaining: 900, FullMS: 1000}})
	tokensDenied := bucket.Summarize([]bucket.Result{{Remaining: 9, FullMS: 1000}, {Remaining: 200, Reason: bucket.RateLimited, RetryAfterMS: 10000}})
	tooLarge := bucket.Summarize([]bucket.Result{{Remaining: 9, FullMS: 1000}, {Remaining: 1000, Reason: bucket.CostExceedsCapacity}})
	for _, tc := range []struct {
		format string
		d      *bucket.Decision
		want   string
	}{
		{"", &requestsDenied, `{"error":"rate_limit_exceeded","retry_after":6,"retry_after_ms":5400,"tier":"free","dimension":"api_key"}`},
		{FormatJSON, &tooLarge, `{"error":"cost_exceeds_capacity","cost":1200,"capacity":1000,"tier":"free","dimension":"api_key"}`},
		{FormatOpenAI, &requestsDenied, `{"error":{"message":"Rate limit reached for the api_key requests limit of tier free: limit 10, try again in 6s.","type":"requests","param":null,"code":"rate_limit_exceeded"}}`},
		{FormatOpenAI, &tokensDenied, `{"error":{"message":"Rate limit reached for the api_key tokens limit of tier free: limit 1000, try again in 10s.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}`},
		{FormatOpenAI, &tooLarge, `{"error":{"message":"Request too large for the api_key tokens limit of tier free: it costs 1200 and the limit holds at most 1000; it can never be served, do not retry it unchanged.","type":"tokens","param":null,"code":"cost_exceeds_capacity"}}`},
		{FormatAnthropic, &requestsDenied, `{"type":"error","error":{"type":"rate_limit_error","message":"Rate limit reached for the api_key requests limit of tier free: limit 10, try again in 6s."}}`},
		{FormatAnthropic, &tooLarge, `{"type":"error","error":{"type":"rate_limit_error","message":"Request too large for the api_key tokens limit of tier free: it costs 1200 and the limit holds at most 1000; it can never be served, do not retry it unchanged."}}`},
	} {
		w := denyAnswer(t, &Handler{ErrorFormat: tc.format}, tr, limits, costs, tc.d)
		if got := w.Body.String(); w.Code != http.StatusTooManyRequests || got != tc.want+"\n" {
			t.Errorf("%s %v: %d %s, want 429 %s", tc.format, tc.d.Reason, w.Code, got, tc.want)
		}
		retry := ""
		if tc.d.Reason == bucket.CostExceedsCapacity {
			retry = "false" // whatever openai_headers says
		}
		if got := w.Header().Get("X-Should-Retry"); got != retry {
			t.Errorf("%s %v: x-should-retry %q, want %q", tc.format, tc.d.Reason, got, retry)
		}
		if !json.Valid(w.Body.Bytes()) {
			t.Errorf("%s: body is not JSON", tc.format)
		}
	}

	for _, tc := range []struct {
		format string
		err    error
		status int
		want   string
	}{
		{"", errInvalidBody, 400, `{"error":"invalid_body","message":"the request body must be a JSON chat or completion request within the size limit"}`},
		{FormatOpenAI, errInvalidBody, 400, `{"error":{"message":"The request body must be a JSON chat or completion request within the size limit.","type":"invalid_request_error","param":null,"code":"invalid_body"}}`},
		{FormatAnthropic, errInvalidCost, 400, `{"type":"error","error":{"type":"invalid_request_error","message":"The request's cost must be an integer from 0 to 9007199254740991."}}`},
		{FormatOpenAI, errBodyTimeout, 408, `{"error":{"message":"The request body did not arrive in time.","type":"invalid_request_error","param":null,"code":"request_timeout"}}`},
		{FormatJSON, errBodyTimeout, 408, `{"error":"request_timeout","message":"the request body did not arrive in time"}`},
	} {
		h := &Handler{ErrorFormat: tc.format}
		w := httptest.NewRecorder()
		if err := h.rejectInput(w, tc.err); err != nil {
			t.Fatal(err)
		}
		if got := w.Body.String(); w.Code != tc.status || got != tc.want+"\n" {
			t.Errorf("%s %v: %d %s, want %d %s", tc.format, tc.err, w.Code, got, tc.status, tc.want)
		}
	}
	for format, want := range map[string]string{
		FormatJSON:      `{"error":"rate_limiter_unavailable","message":"the rate limiter cannot reach its store; retry shortly"}`,
		FormatOpenAI:    `{"error":{"message":"The rate limiter cannot reach its store; retry shortly.","type":"server_error","param":null,"code":"rate_limiter_unavailable"}}`,
		FormatAnthropic: `{"type":"error","error":{"type":"api_error","message":"The rate limiter cannot reach its store; retry shortly."}}`,
	} {
		w := httptest.NewRecorder()
		if err := (&Handler{ErrorFormat: format}).unavailable(w); err != nil {
			t.Fatal(err)
		}
		if got := w.Body.String(); w.Code != 503 || got != want+"\n" {
			t.Errorf("%s: %d %s, want 503 %s", format, w.Code, got, want)
		}
	}
}

// TestRateLimitHeadersAreStructuredFields: RateLimit and RateLimit-Policy
// parse as RFC 9651 Lists, also for a capacity of 2^53 − 1 and a refill so
// slow that the window has more than 15 digits: their Integers are clamped
// to 999999999999999.
func TestRateLimitHeadersAreStructuredFields(t *testing.T) {
	tr, limits := answerTier(t,
		Limit{Dimension: "user", Capacity: 10, RefillRate: 1},
		Limit{Dimension: "api_key", Capacity: MaxCost, RefillRate: 1e-9, Unit: UnitTokens})
	allowed := bucket.Summarize([]bucket.Result{{Remaining: 9, FullMS: 1000}, {Remaining: MaxCost - 5, FullMS: 5e18}})
	w := httptest.NewRecorder()
	(&Handler{}).writeHeaders(w.Header(), &inputs{}, tr, limits, &allowed)
	for name, want := range map[string]string{
		"RateLimit-Policy": `"user";q=10;w=10, "api_key-tokens";q=999999999999999;w=999999999999999`,
		"RateLimit":        `"user";r=9;t=1, "api_key-tokens";r=999999999999999;t=999999999999999`,
	} {
		got := w.Header().Get(name)
		if got != want {
			t.Errorf("%s: %s, want %s", name, got, want)
		}
		list, err := httpsfv.UnmarshalList([]string{got})
		if err != nil {
			t.Errorf("%s %q is not an RFC 9651 List: %v", name, got, err)
		} else if len(list) != 2 {
			t.Errorf("%s: %d members, want 2", name, len(list))
		}
	}
}

// TestDenialItemsSameFromRedisAndCache: a denial's RateLimit lists the
// denying buckets only, so the 429 Redis decides and the one the deny
// cache answers for the same client carry the same items.
func TestDenialItemsSameFromRedisAndCache(t *testing.T) {
	tr, limits := answerTier(t,
		Limit{Dimension: "user", Capacity: 10, RefillRate: 1},
		Limit{Dimension: "api_key", Capacity: 100, RefillRate: 1})
	now := time.Unix(1000, 0)
	cache := bucket.NewDenyCache(10, func() time.Time { return now })
	h := &Handler{denials: cache}
	req := &request{keys: []string{"ku", "kk"}, limits: limits,
		takes: []bucket.Take{{Spec: limits[0].spec, Cost: 1}, {Spec: limits[1].spec, Cost: 1}}, tokensCap: -1}
	answer := func(v verdict) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		x := &exchange{inputs: inputs{w: w, r: httptest.NewRequest(http.MethodGet, "/", nil)}, tier: tr, req: req}
		if err := h.respond(x, &v, nil); err != nil {
			t.Fatal(err)
		}
		return w
	}
	redisDenial := bucket.Summarize([]bucket.Result{{Reason: bucket.RateLimited, RetryAfterMS: 2500}, {Remaining: 40, FullMS: 60000}})
	fromRedis := answer(decidedVerdict(tr, req, redisDenial, false))
	// The cache keeps a denial 1 ms short of the wait Redis gave: a wait
	// of 2501 ms is answered now as 2500.
	cache.Remember("ku", limits[0].spec, 1, now, 2501, 0)
	var v verdict
	if !h.cachedDenial(&v, &exchange{inputs: inputs{r: httptest.NewRequest(http.MethodGet, "/", nil)}, tier: tr, req: req}, false) {
		t.Fatal("the deny cache does not answer")
	}
	w := answer(v)
	for _, name := range []string{"RateLimit", "RateLimit-Policy", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "Retry-After", "Retry-After-Ms"} {
		if a, b := fromRedis.Header().Get(name), w.Header().Get(name); a != b {
			t.Errorf("%s: %q from Redis, %q from the deny cache", name, a, b)
		}
	}
	if got := fromRedis.Header().Get("RateLimit"); got != `"user";r=0;t=3` {
		t.Errorf("RateLimit %q, want the denying bucket alone", got)
	}
}

// TestCompletionBudgetCappedToCapacity: the charge of an estimate fits the
// smallest tokens capacity whenever the prompt does, whatever the
// completion budget; only a prompt larger than the capacity alone exceeds
// it.
func TestCompletionBudgetCappedToCapacity(t *testing.T) {
	for _, tc := range []struct {
		prompt, completion, capacity, want int64
	}{
		{12, 1024, 500, 500},  // default budget over a 500-token limit: capped
		{12, 100, 500, 112},   // fits: charged whole
		{499, 1024, 500, 500}, // the prompt fits, with room for 1
		{500, 1024, 500, 500}, // exactly the capacity
		{501, 1024, 500, 501}, // the prompt alone is over: cost_exceeds_capacity
		{0, MaxCost, MaxCost, MaxCost},
	} {
		if got := (tokenEstimate{prompt: tc.prompt, completion: tc.completion}).cost(tc.capacity); got != tc.want {
			t.Errorf("prompt %d + budget %d in %d: cost %d, want %d", tc.prompt, tc.completion, tc.capacity, got, tc.want)
		}
	}
}
