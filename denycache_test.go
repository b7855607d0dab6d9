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
