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
)

// Calendar quotas (<dimension> <amount> per day|week|month), end to end:
// a real Caddy in front of a real Redis, with the windows, waits, TTLs and
// stored states checked against calendars computed here, independently of
// the handler, with time.LoadLocation.

// quotaE2EWindow is one calendar window, as the test computes it.
type quotaE2EWindow struct {
	start, end time.Time
}

// seconds is the window's length in seconds (a day of 23 to 25 hours, a
// month of 28 to 31 days): the w of its RateLimit-Policy item.
func (w quotaE2EWindow) seconds() int64 { return int64(w.end.Sub(w.start) / time.Second) }

// quotaE2EDay returns the calendar day of loc that holds now: from its
// midnight to the next, by the wall clock of loc (so 23 or 25 hours on the
// days the clocks change).
func quotaE2EDay(loc *time.Location, now time.Time) quotaE2EWindow {
	y, m, d := now.In(loc).Date()
	return quotaE2EWindow{time.Date(y, m, d, 0, 0, 0, 0, loc), time.Date(y, m, d+1, 0, 0, 0, 0, loc)}
}

// quotaE2EWeek returns the ISO week of loc that holds now: it walks back
// from today's midnight one calendar day at a time to the Monday.
func quotaE2EWeek(loc *time.Location, now time.Time) quotaE2EWindow {
	day := quotaE2EDay(loc, now).start
	for day.Weekday() != time.Monday {
		y, m, d := day.Date()
		day = time.Date(y, m, d-1, 0, 0, 0, 0, loc)
	}
	y, m, d := day.Date()
	return quotaE2EWindow{day, time.Date(y, m, d+7, 0, 0, 0, 0, loc)}
}

// quotaE2EMonth returns the calendar month of loc that holds now.
func quotaE2EMonth(loc *time.Location, now time.Time) quotaE2EWindow {
	y, m, _ := now.In(loc).Date()
	return quotaE2EWindow{time.Date(y, m, 1, 0, 0, 0, 0, loc), time.Date(y, m+1, 1, 0, 0, 0, 0, loc)}
}

// quotaE2EAwayFromBoundary returns once now is at least a minute away from
// the end of the window of each period function: a test that straddled a
// boundary would see two windows. Close to one, it waits the boundary out
// (this wait times nothing: it only moves the test off the boundary).
func quotaE2EAwayFromBoundary(t *testing.T, loc *time.Location, windows ...func(*time.Location, time.Time) quotaE2EWindow) {
	t.Helper()
	for _, window := range windows {
		if left := time.Until(window(loc, time.Now()).end); left < time.Minute {
			t.Logf("%v to a quota window's end: waiting for the next window", left.Round(time.Millisecond))
			time.Sleep(left + time.Second)
		}
	}
}

// quotaE2EState returns the quota stored at key: the units used, its
// scale (1) and its window's start (µs). A missing key fails the test.
func quotaE2EState(t *testing.T, g *e2eGateway, key string) bucket.State {
	t.Helper()
	v := g.value(key)
	if v == "" {
		t.Fatalf("no quota stored at %s", key)
	}
	st, err := bucket.DecodeState(v)
	if err != nil {
		t.Fatalf("%s: %v", key, err)
	}
	return st
}

// quotaE2EWantExpiry checks that the key at key expires at end, to the
// second: its PTTL, read now, ends within ±1 s of end.
func quotaE2EWantExpiry(t *testing.T, g *e2eGateway, key string, end time.Time) {
	t.Helper()
	before := time.Now()
	pttl, err := g.rdb.PTTL(context.Background(), key).Result()
	after := time.Now()
	if err != nil {
		t.Fatalf("PTTL %s: %v", key, err)
	}
	if pttl <= 0 {
		t.Fatalf("%s: PTTL %v, want the key to expire at %v", key, pttl, end)
	}
	// The PTTL was read between before and after: it ends in [before +
	// pttl, after + pttl].
	if lo, hi := before.Add(pttl), after.Add(pttl); lo.Before(end.Add(-time.Second)) || hi.After(end.Add(time.Second)) {
		t.Errorf("%s: expires between %v and %v (PTTL %v), want %v ± 1s", key, lo, hi, pttl, end)
	}
}

// quotaE2EWantRetryAfter checks a quota's denial, answered between before
// and after: Retry-After is the seconds until end (±1 s), Retry-After-Ms
// the milliseconds (within the request's own duration, rounded up), and
// the body says so.
func quotaE2EWantRetryAfter(t *testing.T, what string, r e2eResponse, before, after, end time.Time, dimension string) {
	t.Helper()
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("%s: status %d %q, want 429", what, r.status, r.body)
	}
	ra, err := strconv.ParseInt(r.header.Get("Retry-After"), 10, 64)
	if err != nil {
		t.Fatalf("%s: Retry-After %q: %v", what, r.header.Get("Retry-After"), err)
	}
	// The seconds until end, computed here, at the request's start and end.
	hiS := int64(end.Sub(before)+time.Second-1) / int64(time.Second)
	loS := int64(end.Sub(after)+time.Second-1) / int64(time.Second)
	if ra < loS-1 || ra > hiS+1 {
		t.Errorf("%s: Retry-After %d, want %d to %d (±1): the seconds until %v", what, ra, loS, hiS, end)
	}
	ms, err := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
	if err != nil {
		t.Fatalf("%s: Retry-After-Ms %q: %v", what, r.header.Get("Retry-After-Ms"), err)
	}
	if lo, hi := end.Sub(after).Milliseconds(), end.Sub(before).Milliseconds()+1; ms < lo || ms > hi {
		t.Errorf("%s: Retry-After-Ms %d, want %d to %d: the milliseconds until %v", what, ms, lo, hi, end)
	}
	if want := (ms + 999) / 1000; ra != want {
		t.Errorf("%s: Retry-After %d, want ⌈%d ms⌉ = %d s", what, ra, ms, want)
	}
	want := fmt.Sprintf(`{"error":"rate_limit_exceeded","retry_after":%d,"retry_after_ms":%d,"tier":"free","dimension":"%s"}`+"\n", ra, ms, dimension)
	if r.body != want {
		t.Errorf("%s: body %q, want %q", what, r.body, want)
	}
}

// TestQuotaDayInTimezoneE2E: a quota of 3 requests per day in
// Europe/Berlin. Three requests pass with the policy item
// "user-per-day";q=3;w=<the Berlin day's length> and the remaining count
// going 2, 1, 0; the fourth is 429 with a Retry-After of the seconds to
// the next Berlin midnight (±1 s), and writes nothing. The key
// rl:{user:<id>}:day holds used = 3 in the window that starts at this
// Berlin day's midnight (µs), and expires at the next one.
func TestQuotaDayInTimezoneE2E(t *testing.T) {
	loc, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Fatal(err)
	}
	quotaE2EAwayFromBoundary(t, loc, quotaE2EDay)
	g := startGateway(t, userLimit("user 3 per day", "quota_timezone Europe/Berlin")+"\nrespond \"ok\"")
	day := quotaE2EDay(loc, time.Now())
	w := day.seconds()
	if w != 86400 && w != 82800 && w != 90000 {
		t.Fatalf("a Berlin day of %d s: the test's calendar is wrong", w)
	}
	policy := fmt.Sprintf(`"user-per-day";q=3;w=%d`, w)
	t.Logf("Berlin day %v to %v: w=%d", day.start, day.end, w)

	for k := int64(1); k <= 3; k++ {
		before := time.Now()
		r := g.get("X-User", "alice")
		what := fmt.Sprintf("request %d", k)
		if r.status != http.StatusOK || r.body != "ok" {
			t.Fatalf("%s: %d %q, want 200 ok", what, r.status, r.body)
		}
		wantHeaders(t, what, r.header,
			"RateLimit-Policy", policy,
			"X-RateLimit-Limit", "3",
			"X-RateLimit-Remaining", strconv.FormatInt(3-k, 10),
			"Retry-After", "")
		// RateLimit's t is the seconds until the quota is whole again: the
		// next Berlin midnight.
		var rem, reset int64
		if _, err := fmt.Sscanf(r.header.Get("RateLimit"), `"user-per-day";r=%d;t=%d`, &rem, &reset); err != nil {
			t.Fatalf("%s: RateLimit %q: %v", what, r.header.Get("RateLimit"), err)
		}
		if until := int64(day.end.Sub(before) / time.Second); rem != 3-k || reset < until-1 || reset > until+2 {
			t.Errorf("%s: RateLimit %q, want r=%d and t ≈ %d (the seconds to the next Berlin midnight)", what, r.header.Get("RateLimit"), 3-k, until)
		}
	}

	key := bucket.NewKeyer("rl:", "").Key("user", "alice", "day")
	stored := g.value(key)
	before := time.Now()
	r := g.get("X-User", "alice")
	after := time.Now()
	quotaE2EWantRetryAfter(t, "request 4", r, before, after, day.end, "user")
	wantHeaders(t, "request 4", r.header,
		"RateLimit-Policy", policy,
		"X-RateLimit-Limit", "3",
		"X-RateLimit-Remaining", "0")
	if got := g.value(key); got != stored {
		t.Errorf("the denial wrote the quota: %x, then %x", stored, got)
	}

	st := quotaE2EState(t, g, key)
	if want := (bucket.State{Units: 3, Scale: 1, Last: day.start.UnixMicro()}); st != want {
		t.Errorf("stored quota %+v, want used 3, scale 1, window start %d (%v, Berlin midnight)", st, want.Last, day.start)
	}
	quotaE2EWantExpiry(t, g, key, day.end)
	if keys := g.keys(); len(keys) != 1 || keys[0] != key {
		t.Errorf("keys %q, want only %s", keys, key)
	}
}

// TestQuotaWeekAndMonthWindowsE2E: in America/New_York, a week quota of 2
// and a month quota of 5 on the same identity. Two requests charge both:
// the week's key holds used = 2 in the window that starts on this week's
// Monday at 00:00 New York time (found here by walking back day by day),
// the month's key used = 2 from the 1st; each expires at its window's
// end; the policy items carry each window's length (a week or month with
// a daylight-saving change is an hour shorter or longer). The third
// request is denied by the week quota until next Monday, and the month
// quota it would also have charged stays at 2 (all or nothing).
func TestQuotaWeekAndMonthWindowsE2E(t *testing.T) {
	loc, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Fatal(err)
	}
	quotaE2EAwayFromBoundary(t, loc, quotaE2EWeek, quotaE2EMonth)
	g := startGateway(t, userLimit("user 2 per week\n\t\t\tuser 5 per month", "quota_timezone America/New_York")+"\nrespond \"ok\"")
	now := time.Now()
	week, month := quotaE2EWeek(loc, now), quotaE2EMonth(loc, now)
	if week.start.Weekday() != time.Monday || week.start.In(loc).Hour() != 0 {
		t.Fatalf("week start %v: the test's calendar is wrong", week.start)
	}
	policy := fmt.Sprintf(`"user-per-week";q=2;w=%d, "user-per-month";q=5;w=%d`, week.seconds(), month.seconds())
	t.Logf("week %v to %v, month %v to %v; policy %s", week.start, week.end, month.start, month.end, policy)

	for k := 1; k <= 2; k++ {
		r := g.get("X-User", "carol")
		if r.status != http.StatusOK {
			t.Fatalf("request %d: %d %q, want 200", k, r.status, r.body)
		}
		wantHeaders(t, fmt.Sprintf("request %d", k), r.header, "RateLimit-Policy", policy)
	}
	keyer := bucket.NewKeyer("rl:", "")
	weekKey, monthKey := keyer.Key("user", "carol", "week"), keyer.Key("user", "carol", "month")
	if st, want := quotaE2EState(t, g, weekKey), (bucket.State{Units: 2, Scale: 1, Last: week.start.UnixMicro()}); st != want {
		t.Errorf("week quota %+v, want %+v (used 2 since Monday %v)", st, want, week.start)
	}
	monthBefore := quotaE2EState(t, g, monthKey)
	if want := (bucket.State{Units: 2, Scale: 1, Last: month.start.UnixMicro()}); monthBefore != want {
		t.Errorf("month quota %+v, want %+v (used 2 since %v)", monthBefore, want, month.start)
	}
	quotaE2EWantExpiry(t, g, weekKey, week.end)
	quotaE2EWantExpiry(t, g, monthKey, month.end)

	before := time.Now()
	r := g.get("X-User", "carol")
	after := time.Now()
	quotaE2EWantRetryAfter(t, "request 3", r, before, after, week.end, "user")
	wantHeaders(t, "request 3", r.header, "RateLimit-Policy", policy)
	if !strings.HasPrefix(r.header.Get("RateLimit"), `"user-per-week";r=0;t=`) {
		t.Errorf("request 3: RateLimit %q, want the week quota's item alone", r.header.Get("RateLimit"))
	}
	if st := quotaE2EState(t, g, monthKey); st != monthBefore {
		t.Errorf("the week quota denied, yet the month quota changed: %+v, then %+v", monthBefore, st)
	}
}

// quotaE2ELimiter is a token_bucket for the LLM gateway: a user bucket of
// 2 requests refilled 1 an hour, and an org quota of 1000 tokens a month
// (UTC), priced by estimate and settled from the response.
const quotaE2ELimiter = `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			dimension org {http.request.header.X-Org}
			tier free {
				user 2 1/1h
				org 1000 per month tokens
			}
			cost estimate
			settle
		}`

// TestQuotaTokensSettleE2E: a tokens quota of 1000 a month with cost
// estimate and settle, in front of the provider stand-in. A request
// estimated at 500 tokens is charged 500 in the decision (what the
// upstream sees in Redis), and the settlement brings used to exactly the
// 320 tokens the response reports, in the same window, without touching
// the key's expiry (the month's end). A second request (estimate 500,
// usage 900) leaves used = 1220: a settlement may overrun the quota.
// All or nothing: a request that the user bucket denies leaves the org's
// quota bit for bit as it was; a request that the (overrun) quota denies
// is 429 until the month's end and charges no user bucket. Neither denial
// reaches the upstream.
func TestQuotaTokensSettleE2E(t *testing.T) {
	quotaE2EAwayFromBoundary(t, time.UTC, quotaE2EMonth)
	lg := startLLMGateway(t, quotaE2ELimiter)
	month := quotaE2EMonth(time.UTC, time.Now())
	keyer := bucket.NewKeyer("rl:", "")
	acme, beta := keyer.Key("org", "acme", "tokens:month"), keyer.Key("org", "beta", "tokens:month")
	lg.up.watchKeys(lg.rdb, acme, beta)
	policy := fmt.Sprintf(`"user";q=2;w=7200, "org-tokens-per-month";q=1000;w=%d`, month.seconds())
	windowStart := month.start.UnixMicro()

	// settled posts a chat request estimated at 500 tokens whose response
	// reports usage, and returns the quota at key as the upstream saw it
	// (after the decision's charge) and after the settlement.
	settled := func(what, user, org, usage, key string) (charged, after bucket.State) {
		t.Helper()
		r := lg.post("/v1/chat/completions", chat500, "X-User", user, "X-Org", org, "X-Test-Usage", usage)
		if r.status != http.StatusOK {
			t.Fatalf("%s: status %d %q, want 200", what, r.status, r.body)
		}
		wantHeaders(t, what, r.header, "X-Estimated-Cost", "500", "RateLimit-Policy", policy)
		lg.sync()
		seen := lg.up.last(t)
		var err error
		if charged, err = bucket.DecodeState(seen.state[key]); err != nil {
			t.Fatalf("%s: the quota the upstream saw: %v", what, err)
		}
		return charged, quotaE2EState(t, lg.e2eGateway, key)
	}

	charged, after := settled("acme 1", "u1", "acme", "100,220", acme)
	if want := (bucket.State{Units: 500, Scale: 1, Last: windowStart}); charged != want {
		t.Errorf("acme 1: the upstream saw the quota %+v, want the estimate charged: %+v", charged, want)
	}
	if want := (bucket.State{Units: 320, Scale: 1, Last: windowStart}); after != want {
		t.Errorf("acme 1: settled quota %+v, want used = the 320 tokens reported: %+v", after, want)
	}
	quotaE2EWantExpiry(t, lg.e2eGateway, acme, month.end)

	charged, after = settled("acme 2", "u1", "acme", "400,500", acme)
	if charged.Units != 820 || after != (bucket.State{Units: 1220, Scale: 1, Last: windowStart}) {
		t.Errorf("acme 2: quota %+v when charged, %+v settled; want used 820 (320 + the estimate 500), then 1220 (320 + 900)", charged, after)
	}
	quotaE2EWantExpiry(t, lg.e2eGateway, acme, month.end)

	_, betaQuota := settled("beta 1", "u2", "beta", "100,100", beta)
	if betaQuota != (bucket.State{Units: 200, Scale: 1, Last: windowStart}) {
		t.Errorf("beta 1: settled quota %+v, want used 200", betaQuota)
	}
	upstreamSeen := len(lg.up.requests())

	// u1's bucket is empty (2 requests, 1 token an hour): it denies, and
	// beta's quota, which had the tokens, is not charged.
	betaRaw := lg.value(beta)
	r := lg.post("/v1/chat/completions", chat500, "X-User", "u1", "X-Org", "beta")
	if r.status != http.StatusTooManyRequests || !strings.HasSuffix(r.body, `"dimension":"user"}`+"\n") {
		t.Fatalf("u1 with beta: %d %q, want 429 by the user bucket", r.status, r.body)
	}
	lg.sync()
	if got := lg.value(beta); got != betaRaw {
		t.Errorf("the user bucket denied, yet beta's quota changed: %x, then %x", betaRaw, got)
	}

	// acme is over its quota: a fresh user is denied until the month's
	// end, and its bucket is not charged.
	u3 := keyer.Key("user", "u3", "")
	acmeRaw := lg.value(acme)
	before := time.Now()
	r = lg.post("/v1/chat/completions", chat500, "X-User", "u3", "X-Org", "acme")
	after2 := time.Now()
	quotaE2EWantRetryAfter(t, "u3 with acme", r, before, after2, month.end, "org")
	wantHeaders(t, "u3 with acme", r.header, "RateLimit-Policy", policy)
	lg.sync()
	if v := lg.value(u3); v != "" {
		t.Errorf("the quota denied, yet u3's bucket was charged: %x", v)
	}
	if got := lg.value(acme); got != acmeRaw {
		t.Errorf("the denial wrote acme's quota: %x, then %x", acmeRaw, got)
	}
	if n := len(lg.up.requests()); n != upstreamSeen {
		t.Errorf("the upstream saw %d requests after the two denials, want %d: a denial reached it", n, upstreamSeen)
	}
}

// TestQuotaAndWaitConfigErrors: bad quota and on_limit configurations are
// refused by the Caddyfile parser, the adapter, a JSON load's compile step
// and a live /load, each naming the field and the value.
func TestQuotaAndWaitConfigErrors(t *testing.T) {
	caddyfileCases := []struct{ name, block, want string }{
		{"per year", limitCase("user 3 per year"), `invalid quota for dimension "user": period "year": must be day, week or month`},
		{"quota amount zero", limitCase("user 0 per day"), `invalid quota amount "0" for dimension "user"`},
		{"quota with a refill", limitCase("user 3 per day 1/s"), `limit user ["3" "per" "day" "1/s"]: wrong argument count`},
		{"bad quota_timezone", "quota_timezone Mars/Olympus_Mons\n" + limitCase("user 3 per day"),
			`invalid quota_timezone "Mars/Olympus_Mons": not an IANA time zone name`},
		{"quota_timezone Local", "quota_timezone Local\n" + limitCase("user 3 per day"),
			`invalid quota_timezone "Local": the host's own zone; name an IANA time zone, the same on every gateway`},
		{"on_limit wait 2m", "on_limit wait 2m\n" + limitCase("user 5 10/s"), `invalid on_limit wait "2m": must be a duration from 1ms to 1m0s`},
		{"on_limit wait without max_wait", "on_limit wait\n" + limitCase("user 5 10/s"), `on_limit ["wait"]: wrong argument count, want reject, or wait <max_wait>`},
		{"max_wait with reject", "on_limit reject 5s\n" + limitCase("user 5 10/s"), `on_limit ["reject" "5s"]: wrong argument count, want reject, or wait <max_wait>`},
		{"on_limit unknown", "on_limit queue 5s\n" + limitCase("user 5 10/s"), `on_limit ["queue" "5s"]: wrong argument count`},
		{"max_waiting zero", "on_limit wait 1s\nmax_waiting 0\n" + limitCase("user 5 10/s"), `invalid max_waiting "0": must be a whole number > 0`},
	}
	for _, tc := range caddyfileCases {
		t.Run("caddyfile/"+tc.name, func(t *testing.T) {
			if _, err := parseTokenBucket(tc.block); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("parse error = %v\nwant it to contain %s", err, tc.want)
			}
			if _, err := adaptCaddyfile(errorCaddyfile(tc.block)); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("adapt error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}

	jsonCases := []struct{ name, handler, want string }{
		{"per year", jsonErrorLimit(`{"dimension": "user", "capacity": 3, "period": "year"}`),
			`tiers[0].limits[0]: tier "free", dimension "user": period "year": must be day, week or month`},
		{"quota with refill", jsonErrorLimit(`{"dimension": "user", "capacity": 3, "period": "day", "refill_rate": 1}`),
			`tiers[0].limits[0]: tier "free", dimension "user": refill_rate 1: a quota (period day) has no refill (0)`},
		{"concurrent quota", jsonErrorLimit(`{"dimension": "user", "capacity": 3, "period": "day", "unit": "concurrent"}`),
			`period "day": a concurrent limit is not a quota`},
		{"bad quota_timezone", jsonErrorField(`"quota_timezone": "Mars/Olympus_Mons"`),
			`quota_timezone "Mars/Olympus_Mons": not an IANA time zone name`},
		{"quota_timezone Local", jsonErrorField(`"quota_timezone": "Local"`),
			`quota_timezone "Local": the host's own zone; name an IANA time zone, the same on every gateway`},
		{"on_limit wait 2m", jsonErrorField(`"on_limit": "wait", "max_wait": 120000000000`), `max_wait 2m0s: must be a duration from 1ms to 1m0s`},
		{"on_limit wait without max_wait", jsonErrorField(`"on_limit": "wait"`), `max_wait 0s: must be a duration from 1ms to 1m0s`},
		{"max_wait without wait", jsonErrorField(`"max_wait": 5000000000`), `max_wait 5s: only with on_limit wait`},
		{"max_wait with reject", jsonErrorField(`"on_limit": "reject", "max_wait": "5s"`), `max_wait 5s: only with on_limit wait`},
		{"on_limit unknown", jsonErrorField(`"on_limit": "queue"`), `on_limit "queue": must be reject or wait`},
		{"max_waiting negative", jsonErrorField(`"on_limit": "wait", "max_wait": "1s", "max_waiting": -1`), `max_waiting -1: must be a whole number > 0`},
		{"lease shorter than two waits", jsonErrorField(`"on_limit": "wait", "max_wait": "5s", "concurrency_lease": "8s"`),
			`concurrency_lease 8s: at least twice max_wait (5s) with on_limit wait, so that a held request's slots outlast its wait`},
	}
	for _, tc := range jsonCases {
		t.Run("json/"+tc.name, func(t *testing.T) {
			if err := compileJSON(tc.handler); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("compile error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}

	// A live Caddy refuses them too, with the same words.
	ensureCaddy(t)
	for _, name := range []string{"per year", "bad quota_timezone", "on_limit wait 2m"} {
		for _, tc := range caddyfileCases {
			if tc.name != name {
				continue
			}
			t.Run("load/caddyfile/"+name, func(t *testing.T) {
				if err := postLoad(errorCaddyfile(tc.block), "caddyfile"); err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("/load error = %v\nwant it to contain %s", err, tc.want)
				}
			})
		}
	}
	for _, name := range []string{"quota with refill", "max_wait without wait"} {
		for _, tc := range jsonCases {
			if tc.name != name {
				continue
			}
			t.Run("load/json/"+name, func(t *testing.T) {
				config := fmt.Sprintf(`{
					"admin": {"listen": "localhost:%d", "config": {"persist": false}},
					"apps": {"http": {"servers": {"srv0": {
						"listen": ["127.0.0.1:9"],
						"routes": [{"handle": [%s]}]
					}}}}
				}`, adminPort, tc.handler)
				if err := postLoad(config, "json"); err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("/load error = %v\nwant it to contain %s", err, tc.want)
				}
			})
		}
	}
}

// TestQuotaSettledWhenChargedNothing: a request charged 0 tokens (a cost
// template the client sets) writes no quota count, and its settlement
// used to find no count of its window and drop the usage: any number of
// such requests used tokens that the quota never counted. The settlement
// now starts the window's count, with the window's expiry, and the quota
// denies once it is used up.
func TestQuotaSettledWhenChargedNothing(t *testing.T) {
	quotaE2EAwayFromBoundary(t, time.UTC, quotaE2EDay)
	lg := startLLMGateway(t, `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension org {http.request.header.X-Org}
			tier free {
				org 1000 per day tokens
			}
			cost {http.request.header.X-Estimated-Tokens}
			settle
		}`)
	day := quotaE2EDay(time.UTC, time.Now())
	key := bucket.NewKeyer("rl:", "").Key("org", "acme", "tokens:day")
	for i, used := range []int64{400, 800, 1200} {
		r := lg.post("/v1/chat/completions", chat500, "X-Org", "acme", "X-Estimated-Tokens", "0", "X-Test-Usage", "100,300")
		if r.status != http.StatusOK {
			t.Fatalf("request %d: status %d %q, want 200", i+1, r.status, r.body)
		}
		lg.sync()
		if st := quotaE2EState(t, lg.e2eGateway, key); st != (bucket.State{Units: used, Scale: 1, Last: day.start.UnixMicro()}) {
			t.Fatalf("request %d: quota %+v, want %d used in today's window", i+1, st, used)
		}
		quotaE2EWantExpiry(t, lg.e2eGateway, key, day.end)
	}
	r := lg.post("/v1/chat/completions", chat500, "X-Org", "acme", "X-Estimated-Tokens", "0", "X-Test-Usage", "100,300")
	if r.status != http.StatusTooManyRequests {
		t.Errorf("request 4, the quota used 1200 of 1000: status %d %q, want 429", r.status, r.body)
	}
}
