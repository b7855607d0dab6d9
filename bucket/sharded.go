package bucket

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/lua"
)

// ShardedClient is what Sharded needs of a Redis Cluster client.
type ShardedClient interface {
	redis.Scripter
	Pipeline() redis.Pipeliner
}

// Sharded is a store for Redis Cluster, where a request's buckets may live
// on several slots. Keys are grouped by their hash tag ({<dimension>:<id>},
// one slot each); each group is decided by the script, all groups in one
// pipeline that go-redis sends to their nodes in parallel. When every group
// allows, the request is allowed. When any group denies, the groups that
// allowed (and so were charged) are refunded by lua.Refund, so the net
// charge of a denied request is zero.
//
// Between a group's charge and its refund (one more round trip, about a
// millisecond), another request on the same bucket sees it charged and can
// be denied though it would not have been: a false denial bounded by that
// window, never an extra admission.
type Sharded struct {
	// Client must not retry: MaxRetries -1 and the NoRetry hook, without
	// which a ClusterClient runs a script again after a lost reply.
	Client ShardedClient
}

// Take decides a request like Redis.Take across slots. When a group fails
// (its node down or too slow), the request is not decided: the groups that
// allowed are refunded, and the error is returned. When the refund of a
// denial fails, the denial is returned with a *RefundError.
func (s Sharded) Take(ctx context.Context, keys []string, takes []Take) (Decision, error) {
	if err := checkTakes(keys, takes); err != nil {
		return Decision{}, err
	}
	groups := groupByTag(keys)
	if len(groups) == 1 {
		return Redis{Client: s.Client}.take(ctx, keys, takes) // checked above
	}
	budget := refundBudget(ctx)
	gkeys := make([][]string, len(groups))
	gtakes := make([][]Take, len(groups))
	for g, idx := range groups {
		for _, i := range idx {
			gkeys[g] = append(gkeys[g], keys[i])
			gtakes[g] = append(gtakes[g], takes[i])
		}
	}
	replies, err := s.runAll(ctx, lua.TokenBucket, gkeys, gtakes)
	d := Decision{Buckets: make([]Result, len(takes))}
	parts := make([]Decision, len(groups))
	for g, idx := range groups {
		if replies[g] == nil {
			continue // failed: parts[g] allows nothing, and is not refunded
		}
		var perr error
		if parts[g], perr = ParseReply(replies[g], gtakes[g]); perr != nil {
			err = errors.Join(err, perr)
			continue
		}
		for j, i := range idx {
			d.Buckets[i] = parts[g].Buckets[j]
		}
	}
	if err != nil {
		// The groups that answered were charged where they allowed, for a
		// request that is now not decided: give it back, as for a denial.
		if rerr := s.refund(ctx, budget, groups, parts, gkeys, gtakes, &d); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return Decision{}, err
	}
	d.summarize()
	if d.Allowed {
		return d, nil
	}
	if err := s.refund(ctx, budget, groups, parts, gkeys, gtakes, &d); err != nil {
		return d, &RefundError{Err: err}
	}
	return d, nil
}

// refundBudget is how long Take's refunds may take: as long as ctx has
// left when Take starts (0: no deadline). A slot that did not answer may
// spend ctx's whole time, and the slots that did are refunded all the
// same.
func refundBudget(ctx context.Context) time.Duration {
	deadline, ok := ctx.Deadline()
	if !ok {
		return 0
	}
	return max(time.Millisecond, time.Until(deadline))
}

// RefundError is returned by Sharded.Take with a denial whose refund of
// the slots that allowed failed: the denial stands (Redis made it), and
// those slots keep the charge until it refills, which can deny later
// requests that would have been allowed, never admit one.
type RefundError struct{ Err error }

func (e *RefundError) Error() string { return e.Err.Error() }
func (e *RefundError) Unwrap() error { return e.Err }

// refund gives back the charges of the groups that allowed a request that
// another group denied (or that failed), and reports their buckets as
// uncharged. It runs within budget from now, whether ctx has ended or not.
func (s Sharded) refund(ctx context.Context, budget time.Duration, groups [][]int, parts []Decision,
	gkeys [][]string, gtakes [][]Take, d *Decision) error {
	var rkeys [][]string
	var rtakes [][]Take
	for g, idx := range groups {
		if !parts[g].Allowed {
			continue
		}
		var ks []string
		var ts []Take
		for j, i := range idx {
			// Only a bucket that allowed was charged: a shadow bucket that
			// denied in an allowed group was not, and gets nothing back.
			if gtakes[g][j].Cost == 0 || parts[g].Buckets[j].Reason != Allowed {
				continue
			}
			d.Buckets[i].Remaining += gtakes[g][j].Cost
			ks, ts = append(ks, gkeys[g][j]), append(ts, gtakes[g][j])
		}
		if len(ks) > 0 {
			rkeys, rtakes = append(rkeys, ks), append(rtakes, ts)
		}
	}
	if len(rkeys) == 0 {
		return nil
	}
	ctx, cancel := context.WithoutCancel(ctx), context.CancelFunc(func() {})
	if budget > 0 {
		ctx, cancel = context.WithTimeout(ctx, budget)
	}
	defer cancel()
	if _, err := s.runAll(ctx, lua.Refund, rkeys, rtakes); err != nil {
		return fmt.Errorf("refunding a request denied on another slot: %w", err)
	}
	return nil
}

// runAll runs script once per group in one pipeline and returns the integer
// replies, nil for a group that failed, and the groups' errors joined. A group
// refused with NOSCRIPT (a node restarted or failed over) or TRYAGAIN (its
// slot is being migrated) did not run, and is run again as run does.
func (s Sharded) runAll(ctx context.Context, script *redis.Script, gkeys [][]string, gtakes [][]Take) ([][]int64, error) {
	pipe := s.Client.Pipeline()
	cmds := make([]*redis.Cmd, len(gkeys))
	for g := range gkeys {
		cmds[g] = script.EvalSha(ctx, pipe, gkeys[g], appendArgs(nil, gtakes[g])...)
	}
	_, _ = pipe.Exec(ctx) // each command's own error is read below
	out := make([][]int64, len(gkeys))
	var errs []error
	for g, cmd := range cmds {
		if err := cmd.Err(); redis.HasErrorPrefix(err, "NOSCRIPT") || redis.IsTryAgainError(err) {
			cmd = run(ctx, s.Client, script, gkeys[g], appendArgs(nil, gtakes[g])...)
		}
		vals, err := cmd.Int64Slice()
		if script == lua.Refund {
			vals, err = []int64{}, cmd.Err()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("running %s on a slot group: %w", scriptName(script), err))
			continue
		}
		out[g] = vals
	}
	return out, errors.Join(errs...)
}

func scriptName(s *redis.Script) string {
	if s == lua.Refund {
		return "refund script"
	}
	return "token bucket script"
}

// groupByTag groups key indexes by hash tag, in order of first appearance.
func groupByTag(keys []string) [][]int {
	var tags []string
	var groups [][]int
	for i, k := range keys {
		tag := hashTag(k)
		g := 0
		for g < len(tags) && tags[g] != tag {
			g++
		}
		if g == len(tags) {
			tags, groups = append(tags, tag), append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	return groups
}

// hashTag returns the part of key that Redis Cluster hashes: the text
// between the first '{' and the next '}', or the whole key.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}
