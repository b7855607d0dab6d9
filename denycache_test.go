package tokenbucket

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// TestDenyCacheSparesRedis: a client hammering a bucket that Redis denied
// with an hour's wait costs Redis one script call, not one per request. The
// cached denials keep the 429, a Retry-After that never exceeds Redis's,
// RateLimit-Policy for every applied bucket, and RateLimit for the denying
// one; another identity, and the same identity with another bucket that
// Redis has not seen deny, still go to Redis.
func TestDenyCacheSparesRedis(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		dimension site {http.request.host}
		tier free {
			user 2 1/1h
			site 1000 1/1h
		}
	}
	respond "ok"`)
	for i := 0; i < 2; i++ {
		if r := g.get("X-User", "alice"); r.status != http.StatusOK {
			t.Fatalf("request %d: status %d", i, r.status)
		}
	}
	g.rdb.ConfigResetStat(context.Background())
	first := g.get("X-User", "alice")
	if first.status != http.StatusTooManyRequests || redistest.Calls(t, g.rdb, "evalsha") != 1 {
		t.Fatalf("first denial: status %d after %d script calls, want 429 after 1", first.status, redistest.Calls(t, g.rdb, "evalsha"))
	}
	for i := 0; i < 500; i++ {
		r := g.get("X-User", "alice")
		if r.status != http.StatusTooManyRequests {
			t.Fatalf("cached denial %d: status %d", i, r.status)
		}
		if i > 0 {
			continue
		}
		wantHeaders(t, "cached denial", r.header,
			"Retry-After", "3600",
			"Cache-Control", "no-store",
			"RateLimit-Policy", `"user";q=2;w=7200, "site";q=1000;w=3600000`,
			"RateLimit", `"user";r=0;t=3600`,
			"X-RateLimit-Limit", "2",
			"X-RateLimit-Remaining", "0")
		ms, _ := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
		redisMS, _ := strconv.ParseInt(first.header.Get("Retry-After-Ms"), 10, 64)
		if ms <= 0 || ms > redisMS {
			t.Errorf("cached Retry-After-Ms %d, want in (0, %d] (Redis's own)", ms, redisMS)
		}
		if !strings.Contains(r.body, `"error":"rate_limit_exceeded"`) || !strings.Contains(r.body, `"dimension":"user"`) {
			t.Errorf("cached denial body %q", r.body)
		}
	}
	if n := redistest.Calls(t, g.rdb, "evalsha"); n != 1 {
		t.Fatalf("500 more denials cost Redis %d script calls, want none beyond the first", n)
	}
	// Another client is decided by Redis.
	if r := g.get("X-User", "bob"); r.status != http.StatusOK || redistest.Calls(t, g.rdb, "evalsha") != 2 {
		t.Fatalf("bob: status %d, %d script calls; want 200 and 2", r.status, redistest.Calls(t, g.rdb, "evalsha"))
	}
}

// TestDenyCacheOff: with deny_cache off every denial is a script call.
func TestDenyCacheOff(t *testing.T) {
	g := startGateway(t, userLimit("user 1 1/1h", "deny_cache off")+"\nrespond \"ok\"")
	g.get("X-User", "alice")
	g.rdb.ConfigResetStat(context.Background())
	for i := 0; i < 20; i++ {
		if r := g.get("X-User", "alice"); r.status != http.StatusTooManyRequests {
			t.Fatalf("denial %d: status %d", i, r.status)
		}
	}
	if n := redistest.Calls(t, g.rdb, "evalsha"); n != 20 {
		t.Fatalf("20 denials with deny_cache off: %d script calls, want 20", n)
	}
}

// TestDenyCacheTierChange: keys do not name the tier, so one identity's
// bucket is decided under another tier's limits once its tier changes
// (forward_auth or a JWT naming a new plan, without a reload). A denial
// cached under the old tier's limits must not answer for the new one: an
// account upgraded from 1 a day to 1000 a day is served at once, not
// refused for the rest of the day, and a client whose bucket the free tier
// emptied is decided by Redis under its own tier's faster refill. Nor may
// it answer for the old tier afterwards: the new tier's decision may have
// refilled the bucket (the second case, where the free tier is then
// allowed), so the old tier's next request goes to Redis too, and only
// Redis's next denial is cached again.
func TestDenyCacheTierChange(t *testing.T) {
	for _, tc := range []struct {
		name, free, pro string
		proRateLimit    string
		freeAgain       []int // the statuses of the free tier's requests after pro's, all decided by Redis
	}{
		{"quota", "user 1 per day", "user 1000 per day", `"user-per-day";r=998;t=`, []int{429}},
		// A token back every microsecond: any time since the free tier's
		// charge has refilled one, and more.
		{"bucket", "user 1 1/1h", "user 1000 1000000/s", `"user";r=`, []int{200, 429}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		tier_from {http.request.header.X-Plan}
		default_tier free
		tier free {
			`+tc.free+`
		}
		tier pro {
			`+tc.pro+`
		}
	}
	respond "ok"`)
			calls := func() int64 { return redistest.Calls(t, g.rdb, "evalsha") }
			if r := g.get("X-User", "alice"); r.status != http.StatusOK {
				t.Fatalf("free, first: status %d", r.status)
			}
			if r := g.get("X-User", "alice"); r.status != http.StatusTooManyRequests {
				t.Fatalf("free, second: status %d, want 429", r.status)
			}
			g.rdb.ConfigResetStat(context.Background())
			if r := g.get("X-User", "alice"); r.status != http.StatusTooManyRequests || calls() != 0 {
				t.Fatalf("free, third: status %d after %d script calls, want 429 from the deny cache", r.status, calls())
			}
			r := g.get("X-User", "alice", "X-Plan", "pro")
			if r.status != http.StatusOK || calls() != 1 {
				t.Fatalf("pro: status %d after %d script calls (%q), want 200 decided by Redis", r.status, calls(), r.body)
			}
			if got := r.header.Get("RateLimit"); !strings.HasPrefix(got, tc.proRateLimit) {
				t.Errorf("pro: RateLimit %q, want it to start with %q", got, tc.proRateLimit)
			}
			n := calls()
			for i, want := range tc.freeAgain {
				n++
				if r := g.get("X-User", "alice"); r.status != want || calls() != n {
					t.Fatalf("free after pro, request %d: status %d after %d script calls, want %d decided by Redis (call %d)", i, r.status, calls(), want, n)
				}
			}
			if r := g.get("X-User", "alice"); r.status != http.StatusTooManyRequests || calls() != n {
				t.Fatalf("free, last: status %d after %d script calls, want 429 from the deny cache (%d calls)", r.status, calls(), n)
			}
		})
	}
}
