package bucket

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/lua"
)

// SHA1 digests of the scripts a batch merges, computed once.
var (
	tokenBucketSHA = lua.TokenBucket.Hash()
	batchSHA       = lua.Batch.Hash()
)

// maxMergedBuckets is the most buckets of one call that lua.Batch carries:
// its byte per request holds the count in 7 bits.
const maxMergedBuckets = 127

// merged is a batch's lua.TokenBucket calls, sent as one lua.Batch call.
type merged struct {
	calls []*batchCmd   // the calls merged, in the batch's order
	call  *batchCmd     // the lua.Batch call that carries them
	cmds  []redis.Cmder // the batch as sent: call in place of the first of calls
}

// mergeable returns cmd as a call that lua.Batch can carry, with its
// number of keys: an EVALSHA of lua.TokenBucket with 1 to 127 keys, one
// parameter per key and at most a lease id after them.
func mergeable(cmd redis.Cmder) (*batchCmd, int, bool) {
	c, ok := cmd.(*batchCmd)
	if !ok {
		return nil, 0, false
	}
	args := c.Args()
	if len(args) < 5 || args[0] != "evalsha" || args[1] != tokenBucketSHA {
		return nil, 0, false
	}
	n, ok := args[2].(int)
	if !ok || n < 1 || n > maxMergedBuckets {
		return nil, 0, false
	}
	if params := len(args) - 3 - n; params != n && params != n+1 {
		return nil, 0, false
	}
	return c, n, true
}

// mergeDecisions returns cmds with their lua.TokenBucket calls merged into
// one lua.Batch call, or nil when fewer than two can be.
func mergeDecisions(ctx context.Context, cmds []redis.Cmder) *merged {
	var m merged
	keys, params, first := 0, 0, -1
	for i, cmd := range cmds {
		if c, n, ok := mergeable(cmd); ok {
			if first < 0 {
				first = i
			}
			m.calls = append(m.calls, c)
			keys += n
			params += len(c.Args()) - 3 - n
		}
	}
	if len(m.calls) < 2 {
		return nil
	}
	// EVALSHA batchSHA numkeys KEYS... heads ARGV...: the keys of every
	// call in order; a flags byte (1: a key repeats, so the script keeps
	// the state of the keys it read) and a byte per call; the calls'
	// parameters in order.
	args := make([]any, 3, 4+keys+params)
	args[0], args[1], args[2] = "evalsha", batchSHA, keys
	heads := make([]byte, 1+len(m.calls))
	for i, c := range m.calls {
		a := c.Args()
		n := a[2].(int)
		args = append(args, a[3:3+n]...)
		heads[1+i] = byte(n)
		if len(a)-3-n > n {
			heads[1+i] |= 128 // a lease id follows its parameters
		}
	}
	if repeats(args[3:]) {
		heads[0] = 1
	}
	args = append(args, heads)
	for _, c := range m.calls {
		a := c.Args()
		args = append(args, a[3+a[2].(int):]...)
	}
	m.call = &batchCmd{Cmd: redis.NewCmd(ctx, args...)}
	m.call.SetFirstKeyPos(3)
	m.cmds = make([]redis.Cmder, 0, len(cmds)-len(m.calls)+1)
	for i, cmd := range cmds {
		if i == first {
			m.cmds = append(m.cmds, m.call)
		} else if _, _, ok := mergeable(cmd); !ok {
			m.cmds = append(m.cmds, cmd)
		}
	}
	return &m
}

// repeats reports whether a key of keys (strings) occurs more than once:
// the requests of one client, whose buckets they share.
func repeats(keys []any) bool {
	seen := make(map[any]struct{}, len(keys))
	for _, k := range keys {
		if _, ok := seen[k]; ok {
			return true
		}
		seen[k] = struct{}{}
	}
	return false
}

// send sends the batch with next and gives each merged call its reply.
// When Redis does not have lua.Batch in its script cache (after a restart,
// a failover or SCRIPT FLUSH), the call ran nothing; it is sent once more
// as EVAL of the script's source, which loads it, as go-redis's Script.Run
// does for a single call.
func (m *merged) send(ctx context.Context, next redis.ProcessPipelineHook) {
	_ = next(ctx, m.cmds) // each command holds its own error
	if redis.HasErrorPrefix(m.call.Err(), "NOSCRIPT") {
		args := append([]any{"eval", lua.BatchSource}, m.call.Args()[2:]...)
		m.call = &batchCmd{Cmd: redis.NewCmd(ctx, args...)}
		m.call.SetFirstKeyPos(3)
		_ = next(ctx, []redis.Cmder{m.call})
	}
	m.answer()
}

// answer gives each merged call its element of the lua.Batch reply: its
// reply, or its error reply; when the call failed as a whole (a lost
// connection, a timeout), each gets that error.
func (m *merged) answer() {
	vals, err := m.call.Slice()
	if err == nil && len(vals) != len(m.calls) {
		err = fmt.Errorf("redis batch: %d replies for %d merged calls", len(vals), len(m.calls))
	}
	for i, c := range m.calls {
		switch {
		case err != nil:
			c.SetErr(err)
		default:
			if e, ok := vals[i].(error); ok {
				c.SetErr(e)
			} else {
				c.SetVal(vals[i])
			}
		}
	}
}
