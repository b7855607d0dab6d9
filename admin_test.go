package tokenbucket

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/bucket"
)

// adminDo sends a request to the admin endpoint and returns the status and
// body. Every config load replaces the admin server, and the old one stops
// in the background (see postLoad): each request has its own connection,
// and one that got no answer at all is sent again (every admin request
// here is idempotent).
func adminDo(t *testing.T, method, target, body string) (int, string) {
	t.Helper()
	var err error
	for attempt := 1; attempt <= 5; attempt++ {
		var status int
		var b string
		if status, b, err = adminDoOnce(method, target, body); err == nil {
			return status, b
		}
		time.Sleep(time.Duration(attempt) * 20 * time.Millisecond) // backoff, not timing a result
	}
	t.Fatalf("%s %s: %v", method, target, err)
	return 0, ""
}

func adminDoOnce(method, target, body string) (int, string, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", adminPort, target), rd)
	if err != nil {
		return 0, "", err
	}
	req.Close = true
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	res, err := (&http.Client{Timeout: time.Minute}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return 0, "", err
	}
	return res.StatusCode, string(b), nil
}

// padBody pads a JSON body with trailing spaces to n bytes.
func padBody(body string, n int) string {
	return body + strings.Repeat(" ", n-len(body))
}

// adminBucket runs a bucket endpoint that must answer 200 and decodes it.
func adminBucket(t *testing.T, method, target, body string) bucketState {
	t.Helper()
	status, b := adminDo(t, method, target, body)
	if status != http.StatusOK {
		t.Fatalf("%s %s: %d %s", method, target, status, b)
	}
	var st bucketState
	dec := json.NewDecoder(strings.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&st); err != nil {
		t.Fatalf("%s %s: %v in %s", method, target, err, b)
	}
	return st
}

func bucketQuery(pairs ...string) string {
	q := url.Values{}
	for i := 0; i+1 < len(pairs); i += 2 {
		q.Set(pairs[i], pairs[i+1])
	}
	return "/token_bucket/bucket?" + q.Encode()
}

// adminSite has one handler: per user 10 requests and 1000 tokens, per
// client IP 20 requests, each refilled 1 per hour in tier adm_free; tier
// adm_pro has only a user limit.
const adminSite = `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		key_prefix adm:
		dimension user {http.request.header.X-User}
		dimension ip {client_ip}
		tier_from {http.request.header.X-Tier}
		tier adm_free {
			user 10 1/1h
			user 1000 1/1h tokens
			ip 20 1/1h
		}
		tier adm_pro {
			user 100 1/1h
		}
		cost {http.request.header.X-Cost}
	}
	respond "site"`

// TestAdminListsHandlers: GET /token_bucket/handlers lists every handler
// of the config, with its id, in config order.
func TestAdminListsHandlers(t *testing.T) {
	startGateway(t, `
	route /a* {
		token_bucket {
			redis redis://REDIS_ADDR
			key_prefix a:
			dimension user {http.request.header.X-User}
			tier free {
				user 5 1/s
			}
		}
		respond "a"
	}
	route /b* {
		token_bucket {
			redis redis://REDIS_ADDR
			key_prefix b:
			dimension key {http.request.header.X-API-Key}
			dimension ip {client_ip}
			tier_from {http.request.header.X-Tier}
			default_tier pro
			tier free {
				key 10 10/1m
			}
			tier pro {
				key 60 1/s
				key 100000 1000/s tokens
				ip 100 25/s
			}
			on_redis_error deny
		}
		respond "b"
	}`)
	status, body := adminDo(t, http.MethodGet, "/token_bucket/handlers", "")
	want := `{"handlers":[` +
		`{"id":0,"key_prefix":"a:","dimensions":[{"name":"user","identity":"{http.request.header.X-User}"}],` +
		`"default_tier":"free","on_redis_error":"local",` +
		`"tiers":[{"name":"free","limits":[{"dimension":"user","capacity":5,"refill_rate":1,"unit":"requests"}]}]},` +
		`{"id":1,"key_prefix":"b:","dimensions":[{"name":"key","identity":"{http.request.header.X-API-Key}"},{"name":"ip","identity":"{http.vars.client_ip}"}],` +
		`"tier_from":"{http.request.header.X-Tier}","default_tier":"pro","on_redis_error":"deny",` +
		`"tiers":[{"name":"free","limits":[{"dimension":"key","capacity":10,"refill_rate":0.16666666666666666,"unit":"requests"}]},` +
		`{"name":"pro","limits":[{"dimension":"key","capacity":60,"refill_rate":1,"unit":"requests"},` +
		`{"dimension":"key","capacity":100000,"refill_rate":1000,"unit":"tokens"},` +
		`{"dimension":"ip","capacity":100,"refill_rate":25,"unit":"requests"}]}]}` +
		`]}` + "\n"
	if status != http.StatusOK || body != want {
		t.Errorf("GET /token_bucket/handlers: %d\n%s\nwant 200\n%s", status, body, want)
	}
	if status, body := adminDo(t, http.MethodPost, "/token_bucket/handlers", ""); status != http.StatusMethodNotAllowed {
		t.Errorf("POST /token_bucket/handlers: %d %s, want 405", status, body)
	}
}

// TestAdminBucketLookupExact looks up buckets after known traffic: the
// exact whole tokens left in each (requests, tokens, and a masked IP),
// found by raw identity, by hashed id, by a POST body, with the handler
// and the tier left to their defaults; and lookups charge nothing.
func TestAdminBucketLookupExact(t *testing.T) {
	g := startGateway(t, adminSite)
	start := time.Now()
	for i := 0; i < 3; i++ {
		if r := g.get("X-User", "alice", "X-Cost", "50"); r.status != http.StatusOK {
			t.Fatalf("request %d: status %d", i+1, r.status)
		}
	}
	keyer := bucket.NewKeyer("adm:", "")
	userKey := keyer.Key("user", "alice", "")
	stored := g.value(userKey)

	byIdentity := bucketQuery("handler", "0", "tier", "adm_free", "dimension", "user", "identity", "alice")
	st := adminBucket(t, http.MethodGet, byIdentity, "")
	elapsed := time.Since(start).Milliseconds() + 1
	if st.Handler != 0 || st.Tier != "adm_free" || st.Dimension != "user" || st.Unit != "requests" ||
		st.ID != keyer.ID("alice") || st.Key != userKey || st.Tokens != 7 || st.Capacity != 10 ||
		st.RefillRate != 1.0/3600 || !st.Exists || st.Deleted != nil {
		t.Errorf("user bucket: %+v, want 7 of 10 tokens at %s", st, userKey)
	}
	// 3 tokens short at 1 per hour: full in 3 h, less the time since.
	if st.MSUntilFull > 3*3_600_000 || st.MSUntilFull < 3*3_600_000-elapsed {
		t.Errorf("ms_until_full %d, want 10800000 less at most %d ms", st.MSUntilFull, elapsed)
	}
	// The TTL is read just after: at most the time since, and 1 ms of
	// rounding, apart.
	if d := st.MSUntilFull - st.TTLMS; d < -1 || d > elapsed {
		t.Errorf("ttl_ms %d, ms_until_full %d: want them equal within %d ms", st.TTLMS, st.MSUntilFull, elapsed)
	}

	for _, tc := range []struct {
		name, method, target, body string
		key                        string
		tokens, capacity           int64
	}{
		{"tokens unit", http.MethodGet, bucketQuery("handler", "0", "tier", "adm_free", "dimension", "user", "unit", "tokens", "identity", "alice"), "",
			keyer.Key("user", "alice", "tokens"), 850, 1000},
		{"ip", http.MethodGet, bucketQuery("handler", "0", "dimension", "ip", "identity", "127.0.0.1"), "",
			keyer.Key("ip", "127.0.0.1/32", ""), 17, 20},
		{"ip as IPv4-mapped IPv6", http.MethodGet, bucketQuery("dimension", "ip", "identity", "::ffff:127.0.0.1"), "",
			keyer.Key("ip", "127.0.0.1/32", ""), 17, 20},
		{"hashed id", http.MethodGet, bucketQuery("handler", "0", "tier", "adm_free", "dimension", "user", "id", keyer.ID("alice")), "",
			userKey, 7, 10},
		{"POST body", http.MethodPost, "/token_bucket/bucket", `{"handler":0,"tier":"adm_free","dimension":"user","identity":"alice"}`,
			userKey, 7, 10},
		{"POST body of exactly 64 KiB", http.MethodPost, "/token_bucket/bucket", padBody(`{"handler":0,"tier":"adm_free","dimension":"user","identity":"alice"}`, 64<<10),
			userKey, 7, 10},
		{"default handler and tier", http.MethodGet, bucketQuery("dimension", "user", "identity", "alice"), "",
			userKey, 7, 10},
		{"another tier's limit on the same bucket", http.MethodGet, bucketQuery("tier", "adm_pro", "dimension", "user", "identity", "alice"), "",
			userKey, 7, 100},
		{"a bucket never used", http.MethodGet, bucketQuery("dimension", "user", "identity", "bob"), "",
			keyer.Key("user", "bob", ""), 10, 10},
	} {
		st := adminBucket(t, tc.method, tc.target, tc.body)
		if st.Key != tc.key || st.Tokens != tc.tokens || st.Capacity != tc.capacity {
			t.Errorf("%s: key %s, %d of %d tokens; want %s, %d of %d", tc.name, st.Key, st.Tokens, st.Capacity, tc.key, tc.tokens, tc.capacity)
		}
		if tc.name == "a bucket never used" && (st.Exists || st.TTLMS != 0 || st.MSUntilFull != 0) {
			t.Errorf("%s: %+v, want no key, ttl_ms 0, ms_until_full 0", tc.name, st)
		}
	}

	if got := g.value(userKey); got != stored {
		t.Errorf("lookups changed the bucket: %q, then %q", stored, got)
	}
	r := g.get("X-User", "alice", "X-Cost", "50")
	if r.status != http.StatusOK || !strings.HasPrefix(r.header.Get("RateLimit"), `"user";r=6;`) {
		t.Errorf("the request after the lookups: %d, RateLimit %q, want 200 with user r=6", r.status, r.header.Get("RateLimit"))
	}
}

// TestAdminBucketReset empties a bucket, resets it through DELETE, and the
// client is allowed again with the full capacity; POST .../reset with a
// JSON body resets the tokens bucket; resetting a bucket with no key says
// so.
func TestAdminBucketReset(t *testing.T) {
	g := startGateway(t, adminSite)
	for i := 0; i < 10; i++ {
		if r := g.get("X-User", "alice", "X-Cost", "50"); r.status != http.StatusOK {
			t.Fatalf("request %d: status %d", i+1, r.status)
		}
	}
	if r := g.get("X-User", "alice", "X-Cost", "50"); r.status != http.StatusTooManyRequests {
		t.Fatalf("request 11: status %d, want 429", r.status)
	}
	keyer := bucket.NewKeyer("adm:", "")
	st := adminBucket(t, http.MethodDelete, bucketQuery("handler", "0", "tier", "adm_free", "dimension", "user", "identity", "alice"), "")
	if st.Tokens != 10 || st.Capacity != 10 || st.Exists || st.TTLMS != 0 || st.MSUntilFull != 0 || st.Deleted == nil || !*st.Deleted {
		t.Errorf("reset: %+v, want 10 of 10 tokens, deleted, no key", st)
	}
	if v := g.value(keyer.Key("user", "alice", "")); v != "" {
		t.Errorf("after the reset the key holds %q", v)
	}
	r := g.get("X-User", "alice", "X-Cost", "50")
	if r.status != http.StatusOK || !strings.HasPrefix(r.header.Get("RateLimit"), `"user";r=9;`) {
		t.Errorf("after the reset: %d, RateLimit %q, want 200 with user r=9", r.status, r.header.Get("RateLimit"))
	}

	st = adminBucket(t, http.MethodPost, "/token_bucket/bucket/reset",
		`{"handler":0,"tier":"adm_free","dimension":"user","unit":"tokens","identity":"alice"}`)
	if st.Tokens != 1000 || st.Unit != "tokens" || st.Deleted == nil || !*st.Deleted {
		t.Errorf("POST reset of the tokens bucket: %+v, want 1000 tokens, deleted", st)
	}
	st = adminBucket(t, http.MethodPost, "/token_bucket/bucket/reset?"+
		url.Values{"dimension": {"user"}, "id": {keyer.ID("nobody")}}.Encode(), "")
	if st.Tokens != 10 || st.Deleted == nil || *st.Deleted {
		t.Errorf("reset of a bucket with no key: %+v, want 10 tokens, deleted false", st)
	}
}

// TestAdminBucketErrors: every bad request gets its status and a JSON
// message that names what is wrong and never echoes the raw identity.
func TestAdminBucketErrors(t *testing.T) {
	startGateway(t, adminSite)
	const secret = "sk-live-must-not-be-echoed"
	for _, tc := range []struct {
		name, method, target, body string
		status                     int
		msg                        string
	}{
		{"unknown handler", "GET", bucketQuery("handler", "9", "dimension", "user", "identity", secret), "",
			404, `handler 9: no such token_bucket handler (1 configured); see /token_bucket/handlers`},
		{"handler not a number", "GET", bucketQuery("handler", "x", "dimension", "user", "identity", secret), "",
			400, `handler "x": must be a handler id from /token_bucket/handlers`},
		{"unknown tier", "GET", bucketQuery("tier", "gold", "dimension", "user", "identity", secret), "",
			404, `tier "gold": handler 0 has no such tier`},
		{"unknown dimension", "GET", bucketQuery("tier", "adm_free", "dimension", "org", "identity", secret), "",
			404, `dimension "org": handler 0 has no such dimension`},
		{"dimension without a limit in the tier", "GET", bucketQuery("tier", "adm_pro", "dimension", "ip", "identity", secret), "",
			404, `tier "adm_pro" has no requests limit on dimension "ip"`},
		{"unit without a limit", "GET", bucketQuery("dimension", "ip", "unit", "tokens", "identity", secret), "",
			404, `tier "adm_free" has no tokens limit on dimension "ip"`},
		{"reset of an unknown tier", "DELETE", bucketQuery("tier", "gold", "dimension", "user", "identity", secret), "",
			404, `tier "gold": handler 0 has no such tier`},
		{"bad unit", "GET", bucketQuery("dimension", "user", "unit", "bytes", "identity", secret), "",
			400, `unit "bytes": must be requests, tokens or concurrent`},
		{"no dimension", "GET", bucketQuery("identity", secret), "",
			400, `dimension: required`},
		{"no identity", "GET", bucketQuery("dimension", "user"), "",
			400, `identity or id: give exactly one`},
		{"identity and id", "GET", bucketQuery("dimension", "user", "identity", secret, "id", "AAAAAAAAAAAAAAAAAAAAAA"), "",
			400, `identity or id: give exactly one`},
		{"bad id", "GET", bucketQuery("dimension", "user", "id", "abc{"), "",
			400, `id: must be a hashed identity of 22 base64url characters, as in a bucket key (a raw identity goes in identity)`},
		{"raw identity as id", "POST", "/token_bucket/bucket", `{"dimension":"user","id":"` + secret + `"}`,
			400, `id: must be a hashed identity of 22 base64url characters, as in a bucket key (a raw identity goes in identity)`},
		{"misspelt parameter", "DELETE", bucketQuery("dimension", "user", "identity", secret, "peroid", "day"), "",
			400, `query parameter "peroid": unknown; the parameters are handler, tier, dimension, unit, model, period, shadow, identity, id`},
		{"parameter twice", "DELETE", bucketQuery("dimension", "user", "identity", secret) + "&period=day&period=month", "",
			400, `query parameter "period": given 2 times`},
		{"member twice in the body", "POST", "/token_bucket/bucket", `{"dimension":"user","identity":"` + secret + `","period":"day","period":"month"}`,
			400, `reading the JSON body: member "period" given twice (names match in any case)`},
		{"member twice in the body, in another case", "POST", "/token_bucket/bucket", `{"dimension":"user","identity":"` + secret + `","Identity":"bob"}`,
			400, `reading the JSON body: member "Identity" given twice (names match in any case)`},
		{"query and body", "POST", bucketQuery("dimension", "ip"), `{"dimension":"user","identity":"` + secret + `"}`,
			400, `parameters: in the query string or in the JSON body, not both`},
		{"body with DELETE", "DELETE", "/token_bucket/bucket", `{"dimension":"user","identity":"` + secret + `"}`,
			400, `parameters: a JSON body only with POST; a DELETE takes them in the query string (POST /token_bucket/bucket/reset resets with a body)`},
		{"query and body with DELETE", "DELETE", bucketQuery("dimension", "ip", "identity", "127.0.0.1"), `{"dimension":"user","identity":"` + secret + `"}`,
			400, `parameters: a JSON body only with POST; a DELETE takes them in the query string (POST /token_bucket/bucket/reset resets with a body)`},
		{"query and body with GET", "GET", bucketQuery("dimension", "ip", "identity", "127.0.0.1"), `{"dimension":"user","identity":"` + secret + `"}`,
			400, `parameters: a JSON body only with POST; a GET takes them in the query string (POST /token_bucket/bucket/reset resets with a body)`},
		{"unknown field in the body", "POST", "/token_bucket/bucket", `{"dimension":"user","identity":"` + secret + `","user":"x"}`,
			400, `reading the JSON body: json: unknown field "user"`},
		{"data after the object", "POST", "/token_bucket/bucket", `{"dimension":"user","identity":"` + secret + `"} trailing`,
			400, `reading the JSON body: one object, and nothing after it`},
		{"two objects", "POST", "/token_bucket/bucket", `{"dimension":"user","identity":"` + secret + `"}{"dimension":"ip"}`,
			400, `reading the JSON body: one object, and nothing after it`},
		{"body over 64 KiB", "POST", "/token_bucket/bucket", padBody(`{"dimension":"user","identity":"`+secret+`"}`, 64<<10+1),
			413, `reading the JSON body: larger than 65536 bytes (64 KiB)`},
		{"body over 64 KiB, cut in a string", "POST", "/token_bucket/bucket", `{"dimension":"user","identity":"` + strings.Repeat("x", 64<<10) + `"}`,
			413, `reading the JSON body: larger than 65536 bytes (64 KiB)`},
		{"method", "PUT", bucketQuery("dimension", "user", "identity", secret), "",
			405, `method PUT not allowed; use GET, POST, DELETE`},
		{"reset by GET", "GET", "/token_bucket/bucket/reset", "",
			405, `method GET not allowed; use POST`},
		{"unknown endpoint", "GET", "/token_bucket/buckets", "",
			404, `no such token_bucket endpoint: see /token_bucket/handlers and /token_bucket/bucket`},
	} {
		status, body := adminDo(t, tc.method, tc.target, tc.body)
		want, _ := json.Marshal(map[string]string{"error": tc.msg})
		if status != tc.status || body != string(want)+"\n" {
			t.Errorf("%s: %d %s, want %d %s", tc.name, status, body, tc.status, want)
		}
		if strings.Contains(body, secret) {
			t.Errorf("%s: the answer echoes the raw identity: %s", tc.name, body)
		}
	}
}

// TestAdminOnlyOnAdminEndpoint: the site's own port does not serve the
// admin API: /token_bucket/... there reaches the site's handlers, and a
// DELETE there resets nothing.
func TestAdminOnlyOnAdminEndpoint(t *testing.T) {
	g := startGateway(t, adminSite)
	if r := g.get("X-User", "alice", "X-Cost", "50"); r.status != http.StatusOK {
		t.Fatalf("status %d", r.status)
	}
	key := bucket.NewKeyer("adm:", "").Key("user", "alice", "")
	stored := g.value(key)
	if stored == "" {
		t.Fatal("no bucket after a request")
	}
	site := strings.TrimSuffix(g.url, "/")
	for _, method := range []string{http.MethodGet, http.MethodDelete} {
		for _, target := range []string{"/token_bucket/handlers", bucketQuery("dimension", "user", "identity", "alice")} {
			req, err := http.NewRequest(method, site+target, nil)
			if err != nil {
				t.Fatal(err)
			}
			res, err := g.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusOK || string(b) != "site" {
				t.Errorf("%s %s on the site's port: %d %q, want the site's 200 \"site\"", method, target, res.StatusCode, b)
			}
		}
	}
	if got := g.value(key); got != stored {
		t.Errorf("a DELETE on the site's port changed the bucket: %q, then %q", stored, got)
	}
	if status, _ := adminDo(t, http.MethodGet, "/token_bucket/handlers", ""); status != http.StatusOK {
		t.Errorf("the admin endpoint: status %d, want 200", status)
	}
}

// TestAdminQuotaAndSlots: the bucket endpoint shows a calendar quota's use
// and the end of its window (period=month), and a concurrency limit's free
// slots (unit=concurrent).
func TestAdminQuotaAndSlots(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		key_prefix admq:
		dimension user {http.request.header.X-User}
		tier t {
			user 100 1/1h
			user 5 per month
			user 3 concurrent
		}
		quota_timezone America/New_York
	}
	respond "site"`)
	charging := time.Now()
	for i := 0; i < 2; i++ {
		if r := g.get("X-User", "alice"); r.status != http.StatusOK {
			t.Fatalf("request %d: status %d", i+1, r.status)
		}
	}
	// The script sets the key's PX from its clock read (TIME), and Redis
	// counts it from the SET, later by however long the script ran (under
	// load, descheduled): the key may outlive the window's end by as much
	// as the charging requests took.
	late := time.Since(charging).Milliseconds() + 1
	loc, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().In(loc)
	end := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, loc)
	keyer := bucket.NewKeyer("admq:", "")

	msBefore := time.Until(end).Milliseconds()
	st := adminBucket(t, http.MethodGet, bucketQuery("dimension", "user", "period", "month", "identity", "alice"), "")
	msAfter := time.Until(end).Milliseconds()
	if st.Period != "month" || st.Used == nil || *st.Used != 2 || st.Tokens != 3 || st.Capacity != 5 ||
		st.Key != keyer.Key("user", "alice", "month") || !st.Exists {
		t.Errorf("quota: %+v, want used 2, 3 of 5 left at %s", st, keyer.Key("user", "alice", "month"))
	}
	if want := end.Format(time.RFC3339); st.ResetsAt != want {
		t.Errorf("resets_at %q, want %q (the 1st of next month, New York time)", st.ResetsAt, want)
	}
	// The key expires at the window's end (see late): its TTL, read during
	// the call, is the time until then (1 ms of rounding either way).
	if st.TTLMS > msBefore+late || st.TTLMS < msAfter-1 {
		t.Errorf("ttl_ms %d, want the time until %v (%d to %d ms)", st.TTLMS, end, msAfter-1, msBefore+late)
	}

	st = adminBucket(t, http.MethodGet, bucketQuery("dimension", "user", "unit", "concurrent", "identity", "alice"), "")
	if st.Unit != "concurrent" || st.Tokens != 3 || st.Capacity != 3 || st.Used != nil || st.Exists {
		t.Errorf("slots: %+v, want 3 of 3 free, no key (no request in flight)", st)
	}
	if status, b := adminDo(t, http.MethodGet, bucketQuery("dimension", "user", "period", "week", "identity", "alice"), ""); status != http.StatusNotFound ||
		!strings.Contains(b, `tier \"t\" has no requests quota per week on dimension \"user\"`) {
		t.Errorf("a period with no quota: %d %s, want 404", status, b)
	}
}

// TestAdminIDsFollowConfiguration: a handler's id does not depend on the
// order Caddy provisions the handlers in (its servers' map order): the
// list is ordered by key_prefix, then by the rest of the configuration,
// and handlers alike keep their provisioning order among themselves.
func TestAdminIDsFollowConfiguration(t *testing.T) {
	mk := func(prefix string, capacity int64) *Handler {
		return &Handler{KeyPrefix: prefix, Tiers: []Tier{{Name: "t", Limits: []Limit{{Dimension: "user", Capacity: capacity, RefillRate: 1}}}}}
	}
	ids := func(hs []*Handler) []int {
		handlers.RLock()
		defer handlers.RUnlock()
		out := make([]int, len(hs))
		for i, h := range hs {
			out[i] = slices.Index(handlers.list, h)
		}
		return out
	}
	before := len(listHandlers())
	if before != 0 {
		t.Fatalf("%d handlers listed before the test: a test before it left its Caddy running", before)
	}
	for _, order := range [][]int{{0, 1, 2, 3}, {3, 2, 1, 0}, {2, 0, 3, 1}} {
		hs := []*Handler{mk("a:", 10), mk("b:", 5), mk("b:", 7), mk("c:", 1)}
		twin := mk("b:", 5) // b:'s configuration again, provisioned after it
		for _, i := range order {
			registerHandler(hs[i])
		}
		registerHandler(twin)
		got := ids(append(hs, twin))
		for _, h := range append(hs, twin) {
			unregisterHandler(h)
		}
		if want := []int{0, 1, 3, 4, 2}; !slices.Equal(got, want) {
			t.Errorf("provisioned in the order %v: ids %v, want %v", order, got, want)
		}
	}
	if n := len(listHandlers()); n != before {
		t.Errorf("%d handlers listed after the test, want %d", n, before)
	}
}
