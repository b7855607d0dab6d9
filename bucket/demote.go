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
	if len(vals) < 2 || vals[0] < 0 || vals[0] > 2 {
		return Decision{}, NotDemoted, 0, fmt.Errorf("demote reply has %d values", len(vals))
	}
	state, left := Demotion(vals[0]), time.Duration(vals[1])*time.Millisecond
	decided := takes
	if state == Demoted {
		decided = penaltyTakes
	}
	d, err := ParseReply(vals[2:], decided)
	return d, state, left, err
}
