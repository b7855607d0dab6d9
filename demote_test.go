package tokenbucket

import (
	"context"
	"net/http"
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
