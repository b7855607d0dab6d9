package bucket

import (
	"context"
	"strings"

	"github.com/redis/go-redis/v9"
)

// NoRetry is a go-redis hook that marks every script call (EVAL, EVALSHA
// and their _RO forms) as a command go-redis must not send again after a
// failure. A script whose reply was lost may have run, and running it again
// would charge its buckets twice.
//
// MaxRetries -1 turns retries off in redis.Client and the Sentinel client,
// but redis.ClusterClient still sends a command again (up to MaxRedirects
// times, on the same node or another) when it fails with EOF, a dial error,
// a timeout or a transient server error, unless the command reports
// NoRetry. Add this hook to every ClusterClient that runs the scripts.
// MOVED and ASK redirects are still followed: a redirected script did not
// run.
type NoRetry struct{}

// DialHook is unchanged.
func (NoRetry) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook marks a script call as not to be retried.
func (NoRetry) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		return next(ctx, noRetry(cmd))
	}
}

// ProcessPipelineHook marks the script calls of a pipeline as not to be
// retried, which keeps go-redis from sending the pipeline again.
func (NoRetry) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var marked []redis.Cmder // a copy: the caller's slice stays as it was
		for i, cmd := range cmds {
			if m := noRetry(cmd); m != cmd {
				if marked == nil {
					marked = append([]redis.Cmder(nil), cmds...)
				}
				marked[i] = m
			}
		}
		if marked == nil {
			return next(ctx, cmds)
		}
		return next(ctx, marked)
	}
}

// noRetryCmd is a script call that reports NoRetry; its reply and error
// land in the *redis.Cmd it wraps, which the caller holds.
type noRetryCmd struct{ *redis.Cmd }

func (noRetryCmd) NoRetry() bool { return true }

// SetErr sets err, unless the command holds its reply already: see
// keepReply.
func (c noRetryCmd) SetErr(err error) { keepReply(c.Cmd, err) }

// keepReply sets err on c unless c holds a reply already. When a Redis
// Cluster pipeline's retry outlives its context (a node stalled, so no
// connection to it could be had in time), go-redis v9 sets the context's
// error on every command of the pipeline, also on those another node had
// answered: their scripts ran, and their callers must read what they
// charged (to refund it), not a failure.
func keepReply(c *redis.Cmd, err error) {
	if err != nil && c.Err() == nil && c.Val() != nil {
		return
	}
	c.SetErr(err)
}

func noRetry(cmd redis.Cmder) redis.Cmder {
	c, ok := cmd.(*redis.Cmd)
	if !ok || !strings.HasPrefix(cmd.Name(), "eval") {
		return cmd
	}
	return noRetryCmd{c}
}

var (
	_ redis.Hook  = NoRetry{}
	_ redis.Cmder = noRetryCmd{}
)
