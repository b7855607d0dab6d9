package bucket

import (
	"context"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// TestDemotion: three denials within the window demote the identity; the
// next request is decided on the penalty tier's limit of the same bucket;
// the demotion lapses by itself and the own tier is back; allowed requests
// never count.
func TestDemotion(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	st := Redis{Client: rdb}
	spec := func(capacity int64, rate string) Spec {
		r, _ := ParseRate(rate)
		s, err := Limit{Capacity: capacity, Rate: r}.Spec()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	own, penalty := spec(2, "1/h"), spec(1, "1/d")
	rule := DemoteRule{Denials: 3, Window: time.Minute, Span: 300 * time.Millisecond}
	keys := []string{"rl:{user:a}"}
	take := func() (Decision, Demotion) {
		t.Helper()
		d, state, _, err := st.TakeDemote(ctx, "rl:{user:a}:demoted", "rl:{user:a}:denials", rule,
			keys, []Take{{Spec: own, Cost: 1}}, keys, []Take{{Spec: penalty, Cost: 1}})
		if err != nil {
			t.Fatal(err)
		}
		return d, state
	}
	// Two allowed requests: nothing counts.
	for i := 0; i < 2; i++ {
		if d, state := take(); !d.Allowed || state != NotDemoted {
			t.Fatalf("request %d: allowed %v, state %d", i, d.Allowed, state)
		}
	}
	if n := rdb.Exists(ctx, "rl:{user:a}:denials").Val(); n != 0 {
		t.Fatal("an allowed request was counted as a denial")
	}
	// Three denials: the third demotes.
	for i, want := range []Demotion{NotDemoted, NotDemoted, DemotedNow} {
		if d, state := take(); d.Allowed || state != want {
			t.Fatalf("denial %d: allowed %v, state %d, want %d", i, d.Allowed, state, want)
		}
	}
	// Demoted: decided on the penalty limit (capacity 1, 1/day): the wait is
	// a day's refill of the one token (less the milliseconds of refill since
	// the state was written, on the real Redis clock), not the own tier's
	// hour.
	d, state := take()
	if state != Demoted || d.Allowed || d.RetryAfterMS > 86_400_000 || d.RetryAfterMS < 86_400_000-5_000 {
		t.Fatalf("demoted request: state %d, allowed %v, retry_after_ms %d; want 1, false, 86400000 less a few ms", state, d.Allowed, d.RetryAfterMS)
	}
	// The demotion lapses by itself (PX); poll until it has.
	deadline := time.Now().Add(5 * time.Second)
	for rdb.Exists(ctx, "rl:{user:a}:demoted").Val() == 1 {
		if time.Now().After(deadline) {
			t.Fatal("demotion did not lapse")
		}
		time.Sleep(20 * time.Millisecond) // waiting for Redis to expire the key, not timing a result
	}
	if _, state := take(); state != NotDemoted {
		t.Fatalf("after the demotion: state %d, want own tier", state)
	}
}
