package tokenbucket

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/bucket"
)

// TestDemotionEndToEnd: three denials within the window demote the user to
// tier penalty; its next request is decided on penalty's limit and says so
// in the body and the tier header, and its Retry-After is the free tier's
// hour, not penalty's day: the demotion ends long before that day;
// the demotion lapses by itself and the free tier is back. An identity that
// is never denied is never counted.
func TestDemotionEndToEnd(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		tier free {
			user 1 1/h
		}
		tier penalty {
			user 1 1/d
		}
		demote user after 3 denials within 1m to tier penalty for 400ms
	}
	respond "{http.token_bucket.tier}"`)
	if r := g.get("X-User", "alice"); r.status != http.StatusOK || r.body != "free" {
		t.Fatalf("first request: %d", r.status)
	}
	for i := 1; i <= 3; i++ {
		r := g.get("X-User", "alice")
		if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") != "3600" {
			t.Fatalf("denial %d: %d, Retry-After %q; want 429, 3600", i, r.status, r.header.Get("Retry-After"))
		}
		if demoted := strings.Contains(r.body, `"demoted":true`); demoted != (i == 3) {
			t.Errorf("denial %d body %q: demoted %v, want %v", i, r.body, demoted, i == 3)
		}
	}
	r := g.get("X-User", "alice")
	if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") != "3600" ||
		!strings.Contains(r.body, `"tier":"penalty"`) || !strings.Contains(r.body, `"demoted":true`) {
		t.Fatalf("demoted request: %d, Retry-After %q, body %q; want 429 on tier penalty, 3600", r.status, r.header.Get("Retry-After"), r.body)
	}
	// The demotion lapses in Redis by itself.
	base := bucket.NewKeyer("rl:", "").Key("user", "alice", "")
	deadline := time.Now().Add(10 * time.Second)
	for g.rdb.Exists(context.Background(), base+":demoted").Val() == 1 {
		if time.Now().After(deadline) {
			t.Fatal("the demotion did not lapse")
		}
		time.Sleep(20 * time.Millisecond) // waiting for Redis to expire the key, not timing a result
	}
	r = g.get("X-User", "alice")
	if r.status != http.StatusTooManyRequests || !strings.Contains(r.body, `"tier":"free"`) || strings.Contains(r.body, "demoted") {
		t.Fatalf("after the demotion: %d %q, want a plain free-tier 429", r.status, r.body)
	}
	// Allowed requests never count towards a demotion.
	if r := g.get("X-User", "bob"); r.status != http.StatusOK || r.body != "free" {
		t.Fatalf("bob: %d tier %q", r.status, r.body)
	}
	bob := bucket.NewKeyer("rl:", "").Key("user", "bob", "")
	if n := g.rdb.Exists(context.Background(), bob+":denials", bob+":demoted").Val(); n != 0 {
		t.Fatalf("an allowed identity has %d demotion keys", n)
	}
}

// TestDemotionWaitWithOnLimitWait: with on_limit wait, a denial's
// Retry-After is shortened by max_wait, since a retry that soon is held
// and served; but not when the wait runs to the demotion's end, when the
// own tier serves the retry: one sooner would be decided on the penalty
// tier, which cannot hold it, and be told to come back within a
// millisecond, over and over. Default "user 2 1/5s", penalty "user 2 1/m",
// demoted for 5s after 2 denials, max_wait 1s: the denial that demotes,
// and the demoted request after it, are both told to wait for the
// demotion's end (the penalty tier would take a minute), not a second
// less.
func TestDemotionWaitWithOnLimitWait(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		tier default {
			user 2 1/5s
		}
		tier penalty {
			user 2 1/m
		}
		demote user after 2 denials within 10s to tier penalty for 5s
		on_limit wait 1s
	}
	respond "{http.token_bucket.tier}"`)
	start := time.Now() // before the first charge
	for i := range 2 {
		if r := g.get("X-User", "agent"); r.status != http.StatusOK {
			t.Fatalf("request %d: %d", i, r.status)
		}
	}
	retryMS := func(what string, r e2eResponse) int64 {
		t.Helper()
		ms, err := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
		if r.status != http.StatusTooManyRequests || err != nil {
			t.Fatalf("%s: %d, Retry-After-Ms %q; want 429", what, r.status, r.header.Get("Retry-After-Ms"))
		}
		return ms
	}
	// A wait of 5 s, past max_wait: denied, told 4 s (a retry then is held
	// its last second), less what refilled since the first charge: at
	// most the time since start.
	r := g.get("X-User", "agent")
	elapsed := time.Since(start).Milliseconds() + 1
	if ms := retryMS("the first denial", r); ms > 4000 || ms < 4000-elapsed {
		t.Errorf("the first denial: Retry-After-Ms %d, want its 5 s wait less max_wait, less at most the %d ms since the first charge", ms, elapsed)
	}
	demoting := time.Now()
	r = g.get("X-User", "agent")
	elapsed = time.Since(demoting).Milliseconds() + 1
	if ms := retryMS("the denial that demotes", r); !strings.Contains(r.body, `"demoted":true`) || ms > 5000 || ms < 5000-elapsed {
		t.Errorf("the denial that demotes: Retry-After-Ms %d, body %q; want the demotion's 5000 ms (less at most the %d ms of the request), not a second less", ms, r.body, elapsed)
	}
	r = g.get("X-User", "agent")
	elapsed = time.Since(demoting).Milliseconds() + 1
	if ms := retryMS("the demoted request", r); ms > 5000 || ms < 5000-elapsed || !strings.Contains(r.body, `"tier":"penalty"`) {
		t.Errorf("the demoted request: Retry-After-Ms %d, body %q; want what is left of the demotion (5000 ms less at most the %d ms since it began), on tier penalty", ms, r.body, elapsed)
	}
}

// TestDemotionCostPlaceholder: under demote a request is priced in its own
// tier and in the penalty tier (one round trip decides on either), and
// {http.token_bucket.cost} is the price in the tier that decided: the own
// tier's 500 while the user is not demoted, the penalty tier's 100 (its
// capacity caps the estimate) once demoted; none when the penalty tier
// has no tokens limit.
func TestDemotionCostPlaceholder(t *testing.T) {
	for _, tc := range []struct {
		name, penalty string
		demoted       []string // status and cost of the demoted request
	}{
		{"penalty_tokens", "user 100 1/1h tokens", []string{"200", "100"}},
		// Unset: Caddy's header directive leaves the placeholder as it is.
		{"penalty_requests", "user 100 1/1h", []string{"429", "{http.token_bucket.cost}"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg := startLLMGateway(t, `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			tier free {
				user 2 1/1h
				user 100000 1/1h tokens
			}
			tier penalty {
				`+tc.penalty+`
			}
			demote after 1 denials within 1m to tier penalty for 1m
			cost estimate
		}`)
			for i, want := range [][]string{{"200", "500"}, {"200", "500"}, {"429", "500"}, tc.demoted} {
				r := lg.post("/v1/chat/completions", chat500, "X-User", "priced", "Content-Type", "application/json")
				if cost := r.header.Get("X-Estimated-Cost"); strconv.Itoa(r.status) != want[0] || cost != want[1] {
					t.Errorf("request %d: %d with cost %q, want %s with %q: %s", i+1, r.status, cost, want[0], want[1], r.body)
				}
			}
		})
	}
}
