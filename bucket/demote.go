package bucket

import (
	"context"
	"fmt"
	"time"

	"github.com/token-bucket/token_bucket/lua"
)

// DemoteRule moves an identity that keeps hammering while limited to a
// stricter tier for a while: Denials denials within Window demote it for
// Span.
type DemoteRule struct {
	Denials int64
	Window  time.Duration
	Span    time.Duration
}

// Demotion says how a request was decided under a DemoteRule.
type Demotion uint8

// Demotion states.
const (
	NotDemoted Demotion = iota // decided on the request's own tier
	Demoted                    // demoted before: decided on the penalty tier
	DemotedNow                 // this denial demoted the identity
)

// TakeDemote decides a request like Take, under rule: when the identity
// (whose marker and counter keys are given) is demoted, the decision is made
// on penaltyKeys/penaltyTakes (the same buckets on the penalty tier),
// else on keys/takes, and a denial counts towards demotion. It is one
// round trip. It returns the decision, how it was decided, and what is left
// of the demotion.
//
// A denial's wait is the time until the request can be served, across the
// change of tier that a demotion makes (see demotionWait): a demoted
// request is not told to wait past the demotion's end for the penalty
// tier when its own tier serves it sooner, and the denial that demotes
// tells the penalty tier's wait, which decides the retry.
func (s Redis) TakeDemote(ctx context.Context, marker, counter string, rule DemoteRule,
	keys []string, takes []Take, penaltyKeys []string, penaltyTakes []Take) (Decision, Demotion, time.Duration, error) {
	all := make([]string, 0, 2+len(keys)+len(penaltyKeys))
	all = append(append(append(all, marker, counter), keys...), penaltyKeys...)
	head := string(appendFloats(nil, int64(len(keys)), rule.Denials, rule.Window.Milliseconds(), rule.Span.Milliseconds()))
	args := appendArgs(append(make([]any, 0, 1+len(takes)+len(penaltyTakes)), head), append(append([]Take(nil), takes...), penaltyTakes...))
	vals, err := run(ctx, s.Client, lua.Demote, all, args...).Int64Slice()
	if err != nil {
		return Decision{}, NotDemoted, 0, fmt.Errorf("running demote script: %w", err)
	}
	if len(vals) < 3 || vals[0] < 0 || vals[0] > 2 {
		return Decision{}, NotDemoted, 0, fmt.Errorf("demote reply has %d values", len(vals))
	}
	state, leftMS, otherMS := Demotion(vals[0]), vals[1], vals[2]
	decided := takes
	if state == Demoted {
		decided = penaltyTakes
	}
	d, err := ParseReply(vals[3:], decided)
	if err != nil {
		return d, state, 0, err
	}
	return demotionWait(d, state, leftMS, otherMS), state, time.Duration(leftMS) * time.Millisecond, nil
}

// demotionWait returns denial d with its wait, in milliseconds, set to when
// the request can be served when the tier that decides it changes first,
// given leftMS, what is left of the demotion, and otherMS, the wait of the
// tier that decides after that change (demote.lua's other_ms: -1 when it can
// never serve the cost or could not be read):
//
//   - Demoted, and denied for longer than leftMS: the own tier decides after
//     leftMS, so the wait is the longer of leftMS and the own tier's wait.
//     A penalty tier that refills in a day does not tell a client demoted
//     for a minute to wait a day.
//   - DemotedNow: the penalty tier decides for leftMS, so the wait is its
//     wait when that is within leftMS, else the longer of leftMS and the own
//     tier's wait. The denial that demotes does not tell the client to
//     retry when only the penalty tier will decide, and deny it again.
//
// An allowed request, a denial of a cost above a capacity and otherMS -1 (on
// the Demoted path) keep their decision. The deciding bucket takes the
// wait; the others that are rate-limited wait at most that long.
func demotionWait(d Decision, state Demotion, leftMS, otherMS int64) Decision {
	if d.Reason != RateLimited {
		return d
	}
	wait := d.RetryAfterMS
	switch {
	case state == Demoted && wait > leftMS && otherMS >= 0:
		wait = max(leftMS, otherMS)
	case state == DemotedNow && otherMS >= 0 && otherMS <= leftMS:
		wait = max(1, otherMS)
	case state == DemotedNow:
		wait = max(leftMS, wait)
	default:
		return d
	}
	for i := range d.Buckets {
		r := &d.Buckets[i]
		switch {
		case i == d.Deciding:
			r.RetryAfterMS = wait
		case r.Reason == RateLimited:
			r.RetryAfterMS = min(r.RetryAfterMS, wait)
		}
	}
	return Summarize(d.Buckets)
}
