package bucket

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/lua"
)

// Redis is a store that keeps buckets in Redis and decides each request in
// one EVALSHA of lua.TokenBucket. The client must have retries turned off
// (MaxRetries -1): a script replayed after a read timeout would charge twice.
// In Redis Cluster every key of one call must hash to one slot.
type Redis struct {
	Client redis.Scripter
	// Script is the script to run; nil means lua.TokenBucket. Tests set it
	// to a variant whose clock they drive.
	Script *redis.Script
}

// Take decides a request whose buckets are at keys (one per take) and
// charges them all if every one allows it. It is one round trip; NOSCRIPT is
// recovered by go-redis with one EVAL.
func (s Redis) Take(ctx context.Context, keys []string, takes []Take) (Decision, error) {
	if err := checkTakes(keys, takes); err != nil {
		return Decision{}, err
	}
	return s.take(ctx, keys, takes)
}

// take is Take of keys and takes that checkTakes has passed.
func (s Redis) take(ctx context.Context, keys []string, takes []Take) (Decision, error) {
	args := appendArgs(make([]any, 0, argsLen(takes)), takes)
	script := s.Script
	if script == nil {
		script = lua.TokenBucket
	}
	vals, err := run(ctx, s.Client, script, keys, args...).Int64Slice()
	if err != nil {
		return Decision{}, fmt.Errorf("running token bucket script: %w", err)
	}
	return ParseReply(vals, takes)
}

// run runs script as script.Run does (EVALSHA, then EVAL after NOSCRIPT),
// and runs it again, until ctx ends, while Redis refuses it with TRYAGAIN.
// A Redis Cluster node sends TRYAGAIN instead of running a command on
// several keys of a slot that is being migrated, some of whose keys have
// moved and some not (https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/#multi-keys-operations):
// the script did not run, so running it again cannot charge twice, and the
// refusal lasts only until the slot's keys have moved. The other commands'
// errors are returned at once, as NoRetry has go-redis do.
func run(ctx context.Context, c redis.Scripter, script *redis.Script, keys []string, args ...any) *redis.Cmd {
	wait := tryAgainFirst
	for {
		cmd := script.Run(ctx, c, keys, args...)
		if !redis.IsTryAgainError(cmd.Err()) {
			return cmd
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return cmd
		case <-t.C:
		}
		wait = min(2*wait, tryAgainMax)
	}
}

// The waits between tries of a script refused with TRYAGAIN: 5 ms, then
// twice as long each time up to 80 ms, about what MIGRATE takes to move a
// slot's keys.
const (
	tryAgainFirst = 5 * time.Millisecond
	tryAgainMax   = 80 * time.Millisecond
)

// checkTakes checks that keys and takes pair up, and that a concurrency
// take that takes a slot names its lease.
func checkTakes(keys []string, takes []Take) error {
	if len(keys) != len(takes) {
		return fmt.Errorf("%d keys for %d buckets", len(keys), len(takes))
	}
	for _, t := range takes {
		switch {
		case t.Lease > 0 && t.Cost > 0 && t.LeaseID == "":
			return errors.New("a concurrency take without a lease id")
		case t.Lease == 0 && t.Window == nil && t.Spec.Refill <= 0:
			return errors.New("a token bucket take without a refill (a quota needs its windows)")
		}
	}
	return nil
}

// appendArgs appends the script's ARGV for takes: per bucket, capacity,
// refill, scale, cost in units and flags, as five little-endian doubles
// (see lua/token_bucket.lua); a concurrency take sends its lease in
// milliseconds as the refill. When a take is a concurrency limit, the
// request's lease id follows the buckets. The values share one allocation,
// and as pointers they go into the []any without one each.
func appendArgs(args []any, takes []Take) []any {
	vals := make([]argv, len(takes))
	lease := ""
	for i, t := range takes {
		refill, flags := t.Spec.Refill, int64(0)
		if t.Shadow {
			flags |= flagShadow
		}
		switch {
		case t.Lease > 0:
			refill, flags, lease = t.Lease, flags|kindConcurrent, t.LeaseID
		case t.Window != nil:
			refill, flags = 0, flags|kindQuota
		}
		v := &vals[i]
		b := appendFloats(v.b[:0], t.Spec.CapacityUnits(), refill, t.Spec.Scale, t.costUnits(), flags) // fills v.b in place
		switch {
		case t.Window != nil:
			b = appendFloats(b, t.Window[0], t.Window[1], t.Window[2], t.Window[3])
		case t.MaxWaitMS > 0 && !t.Shadow && t.Lease == 0:
			b = appendFloats(b, t.MaxWaitMS)
		}
		v.n = uint8(len(b))
		args = append(args, v)
	}
	if lease != "" {
		args = append(args, lease)
	}
	return args
}

// argsLen is the length of takes' ARGV (see appendArgs): one value per
// bucket, and the lease id after them when a take is a concurrency limit.
func argsLen(takes []Take) int {
	for _, t := range takes {
		if t.Lease > 0 && t.LeaseID != "" {
			return len(takes) + 1
		}
	}
	return len(takes)
}

// ScriptArgs returns lua.TokenBucket's ARGV for takes, as Redis.Take sends
// them (see appendArgs), for a caller that sends the call itself: in a
// pipeline, say.
func ScriptArgs(takes []Take) []any { return appendArgs(make([]any, 0, len(takes)+1), takes) }

// Flags of a bucket's ARGV (lua/token_bucket.lua): shadow + 2 × kind.
const (
	flagShadow     = 1 // the bucket's denial does not deny the request
	kindConcurrent = 2 // a concurrency limit: a sorted set of leases
	kindQuota      = 4 // a calendar quota
)

// argv is one bucket's ARGV: capacity, refill, scale, cost in units and
// flags as five little-endian doubles, then a quota's four window starts
// or a reservation's max wait. go-redis sends it as a bulk string of its
// bytes, as it would the same bytes in a string.
type argv struct {
	b [9 * 8]byte
	n uint8
}

// MarshalBinary implements encoding.BinaryMarshaler for go-redis.
func (a *argv) MarshalBinary() ([]byte, error) { return a.b[:a.n], nil }

func appendFloats(b []byte, vals ...int64) []byte {
	for _, v := range vals {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(float64(v)))
	}
	return b
}

// EncodeState returns a bucket's stored value: struct.pack('<ddd', units,
// scale, last_us) as the script writes it.
func EncodeState(s State) string { return string(appendFloats(nil, s.Units, s.Scale, s.Last)) }

// DecodeState reads a bucket's stored value.
func DecodeState(v string) (State, error) {
	if len(v) != 24 {
		return State{}, fmt.Errorf("bucket state is %d bytes, want 24", len(v))
	}
	f := func(i int) int64 {
		return int64(math.Float64frombits(binary.LittleEndian.Uint64([]byte(v[8*i : 8*i+8]))))
	}
	return State{Units: f(0), Scale: f(1), Last: f(2)}, nil
}

// ParseReply turns the script's reply (3 integers per bucket: remaining,
// wait_ms, full_ms; see lua/token_bucket.lua) into a Decision. It rejects a
// reply of the wrong length or with values out of range.
func ParseReply(vals []int64, takes []Take) (Decision, error) {
	if len(vals) != 3*len(takes) {
		return Decision{}, fmt.Errorf("token bucket reply has %d values, want %d", len(vals), 3*len(takes))
	}
	d := Decision{Buckets: make([]Result, len(takes))}
	for i := range takes {
		remaining, wait, full := vals[3*i], vals[3*i+1], vals[3*i+2]
		// The script's values are within ±2^53 (see its header); anything
		// else would overflow the header arithmetic (⌈ms/1000⌉). Remaining
		// is negative while a bucket is in debt after a settlement.
		if remaining < -MaxExact || remaining > MaxExact || wait < -1 || wait > MaxExact || full < 0 || full > MaxExact {
			return Decision{}, errors.New("token bucket reply out of range: " + strconv.FormatInt(remaining, 10) + " " +
				strconv.FormatInt(wait, 10) + " " + strconv.FormatInt(full, 10))
		}
		r := &d.Buckets[i]
		r.Remaining, r.FullMS, r.Shadow = remaining, full, takes[i].Shadow
		switch {
		case wait == -1:
			r.Reason = CostExceedsCapacity
		case wait > 0 && takes[i].reserves(wait):
			r.RetryAfterMS = wait // allowed with a reservation
		case wait > 0:
			r.Reason, r.RetryAfterMS = RateLimited, wait
		}
	}
	d.summarize()
	return d, nil
}
