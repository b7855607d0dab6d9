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
	// Demoted: decided on the penalty limit (capacity 1, 1/day), which would
	// wait a day; but the demotion ends within 300ms, and then the own tier
	// serves the request after its hour's refill (less the milliseconds of
	// refill since the state was written, on the real Redis clock).
	d, state := take()
	if state != Demoted || d.Allowed || d.RetryAfterMS > 3_600_000 || d.RetryAfterMS < 3_600_000-5_000 {
		t.Fatalf("demoted request: state %d, allowed %v, retry_after_ms %d; want 1, false, 3600000 less a few ms", state, d.Allowed, d.RetryAfterMS)
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

// TestDemotionWaitAcrossTiers: a denial's wait is when the request can be
// served, across the change of tier that a demotion makes. One identity
// per case, demoted at its first denial: an allowed request empties the
// one-token bucket, the next is denied and demotes (DemotedNow), the third
// is decided on the penalty tier (Demoted). Waits are on the real Redis
// clock, so a few milliseconds of refill may have passed since the bucket
// was written.
func TestDemotionWaitAcrossTiers(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	st := Redis{Client: rdb}
	spec := func(rate string) Spec {
		r, _ := ParseRate(rate)
		s, err := Limit{Capacity: 1, Rate: r}.Spec()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	const hour = 3_600_000
	for _, c := range []struct {
		name                    string
		own, penalty            string
		span                    time.Duration
		demotingMS, demotedMS   int64 // the waits, at most a few ms less
		demotingWhy, demotedWhy string
	}{
		{"penalty within the demotion", "1/m", "1/h", 24 * time.Hour, hour, hour,
			"the penalty tier decides the retry: its hour, not the own minute",
			"the penalty tier's hour, within the day's demotion"},
		{"demotion ends first", "1/m", "1/d", 2 * time.Hour, 2 * hour, 2 * hour,
			"the penalty tier's day outlasts the two hours' demotion; the own tier serves after it",
			"what is left of the demotion, not the penalty tier's day"},
		{"own tier slower than the demotion", "1/h", "1/d", time.Minute, hour, hour,
			"the own tier's hour, past the minute's demotion",
			"the own tier's hour, not the penalty tier's day"},
	} {
		t.Run(c.name, func(t *testing.T) {
			key := "rl:{user:" + c.name + "}"
			keys := []string{key}
			rule := DemoteRule{Denials: 1, Window: time.Minute, Span: c.span}
			take := func() (Decision, Demotion) {
				t.Helper()
				d, state, _, err := st.TakeDemote(ctx, key+":demoted", key+":denials", rule,
					keys, []Take{{Spec: spec(c.own), Cost: 1}}, keys, []Take{{Spec: spec(c.penalty), Cost: 1}})
				if err != nil {
					t.Fatal(err)
				}
				return d, state
			}
			if d, state := take(); !d.Allowed || state != NotDemoted {
				t.Fatalf("first request: allowed %v, state %d", d.Allowed, state)
			}
			for _, step := range []struct {
				state  Demotion
				wantMS int64
				why    string
			}{{DemotedNow, c.demotingMS, c.demotingWhy}, {Demoted, c.demotedMS, c.demotedWhy}} {
				d, state := take()
				if state != step.state || d.Allowed || d.Reason != RateLimited || d.Deciding != 0 ||
					d.RetryAfterMS > step.wantMS || d.RetryAfterMS < step.wantMS-5_000 ||
					d.Buckets[0].RetryAfterMS != d.RetryAfterMS {
					t.Errorf("state %d: %d, allowed %v, reason %d, retry_after_ms %d (bucket %d); want a denial waiting %d less a few ms: %s",
						step.state, state, d.Allowed, d.Reason, d.RetryAfterMS, d.Buckets[0].RetryAfterMS, step.wantMS, step.why)
				}
			}
		})
	}
}
