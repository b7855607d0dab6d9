package bucket

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Batched is a redis.Scripter (and a ShardedClient) whose script calls
// from concurrent callers share writes to Redis: the calls that arrive
// while a batch is under way wait, and go as the next batch, one pipeline
// (one write, one read) for the lot. A caller that finds no batch under
// way leads the next one: it yields its processor once (runtime.Gosched),
// so that the goroutines already runnable on it (the gateway's other
// requests, each on its way to its own call) can queue behind it, then
// sends what has queued, on its own goroutine, as a plain client would.
// With nothing else runnable the yield returns at once: batching costs
// nothing at low load. Without it, a request whose Redis answers before
// the next request runs (a gateway and its Redis on one core, a fast
// network) would send every call alone. In make bench's pinned setup
// (configuration (b), a CPU profile of the gateway), 97% of the time spent
// sending went to batches of one call without the yield, 11% with it.
// The yield gathers only goroutines already runnable, not those whose
// requests wait in the netpoller, so with one processor beside its Redis
// a gateway still has runs where batches stay small (BENCHMARKS.md: 47–59
// µs of gateway CPU per allowed request where they form, 72–87 µs where
// they do not, as without the yield).
// There is no goroutine of its own: the first caller of each batch sends
// it (it leads), and hands the next batch to the first caller queued
// behind it.
//
// A script never runs twice. A batch is sent once, by Client.Process (one
// call) or Pipeline.Exec (several), with every command reporting NoRetry,
// so go-redis sends no command, and no batch, again: not after a lost
// reply, a timeout, nor a retryable error on a batch's first command
// (which would run its neighbours' scripts again). The client must still
// have retries off (MaxRetries -1); a ClusterClient still follows MOVED
// and ASK, whose script did not run, and sends a batch's commands to
// their nodes in parallel.
//
// The caller's context bounds its own wait. A batch runs until the
// earliest deadline of its callers that has not passed (a batch of one
// caller on its context, cancellation included). A caller whose context
// ends while it is queued leaves the queue, and its call is never sent;
// one whose batch is being sent gets the context's error and its call is
// dropped from the batch if not yet written (see NewBatched's hook), else
// it runs once and its reply is discarded, as a plain call's would be.
type Batched struct {
	client   redis.UniversalClient
	inFlight int
	maxBatch int

	mu      sync.Mutex
	queue   []*waiter
	running int // batches under way, ≤ inFlight
}

// BatchOptions tune Batched.
type BatchOptions struct {
	// InFlight is how many batches may be under way at once (default 1):
	// a call that finds fewer goes at once, else it waits for the next.
	InFlight int
	// MaxBatch is the most commands in one batch (default 256); a caller's
	// commands are never split.
	MaxBatch int
	// NoMerge sends each lua.TokenBucket call of a batch as a command of
	// its own in the pipeline, as on a Cluster, instead of merging them
	// into one call of lua.Batch (see NewBatched).
	NoMerge bool
}

// Defaults of BatchOptions.
const (
	DefaultBatchInFlight = 1
	DefaultBatchMax      = 256
)

// ErrAbandoned is the error of a call whose caller stopped waiting before
// its batch was written: it was never sent.
var ErrAbandoned = errors.New("redis batch: the caller stopped waiting before the call was sent")

// SharedError is the error of a call that failed with its batch (a lost
// connection, a timeout: not a Redis error reply), for every caller of the
// batch but the first one that failed. A batch is one round trip, and its
// failure one failure of Redis, however many callers shared it: a circuit
// breaker that counts failures in a row should not count a SharedError
// (see IsShared), or one lost connection would count as many failures as
// its batch had callers.
type SharedError struct{ Err error }

func (e *SharedError) Error() string { return e.Err.Error() }
func (e *SharedError) Unwrap() error { return e.Err }

// IsShared reports whether err is a SharedError.
func IsShared(err error) bool { return err != nil && isShared(err) }

func isShared(err error) bool {
	var s *SharedError
	return errors.As(err, &s)
}

// failedWithBatch reports whether err is the failure of a call's round
// trip rather than Redis's reply: no error reply, not a call left out.
func failedWithBatch(err error) bool { return err != nil && roundTripFailed(err) }

func roundTripFailed(err error) bool {
	var reply redis.Error
	return !errors.As(err, &reply) && !errors.Is(err, ErrAbandoned)
}

// NewBatched batches the script calls of client, which must have retries
// off (MaxRetries -1; a ClusterClient also needs the NoRetry hook for its
// other scripts). It adds a hook to client that leaves abandoned calls out
// of a batch about to be written and, on a client of one server (a
// *redis.Client: one Redis, or Sentinel's master) unless opt.NoMerge,
// merges a batch's EVALSHA calls of lua.TokenBucket into one EVALSHA of
// lua.Batch, which decides them in order and replies to each as
// lua.TokenBucket would: one script call, one clock read and one reply for
// the lot, and, when the calls share keys (one tenant's concurrent
// requests), one read and one write of each key. Each caller still gets
// its own reply or error reply. Redis executes 17.5% fewer instructions
// per decision than for the same calls pipelined, 50.7% fewer when the 50
// calls of a batch share their buckets (BENCHMARKS.md). A Cluster's keys
// lie on many slots, which one call cannot span, so its calls are
// pipelined.
func NewBatched(client redis.UniversalClient, opt BatchOptions) *Batched {
	if opt.InFlight <= 0 {
		opt.InFlight = DefaultBatchInFlight
	}
	if opt.MaxBatch <= 0 {
		opt.MaxBatch = DefaultBatchMax
	}
	_, single := client.(*redis.Client)
	client.AddHook(batchHook{merge: single && !opt.NoMerge})
	return &Batched{client: client, inFlight: opt.InFlight, maxBatch: opt.MaxBatch}
}

// Pending returns how many callers are queued for the next batch and how
// many batches are under way.
func (b *Batched) Pending() (queued, running int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, w := range b.queue {
		if w.state != gone {
			queued++
		}
	}
	return queued, b.running
}

// Eval runs EVAL in a batch.
func (b *Batched) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return b.run(ctx, "eval", script, keys, args)
}

// EvalSha runs EVALSHA in a batch.
func (b *Batched) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return b.run(ctx, "evalsha", sha1, keys, args)
}

// EvalRO runs EVAL_RO in a batch.
func (b *Batched) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return b.run(ctx, "eval_ro", script, keys, args)
}

// EvalShaRO runs EVALSHA_RO in a batch.
func (b *Batched) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return b.run(ctx, "evalsha_ro", sha1, keys, args)
}

// ScriptExists runs on the client, outside any batch.
func (b *Batched) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return b.client.ScriptExists(ctx, hashes...)
}

// ScriptLoad runs on the client, outside any batch.
func (b *Batched) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return b.client.ScriptLoad(ctx, script)
}

// Pipeline returns a pipeline whose script calls go, together, in a batch
// (Sharded sends a request's slot groups this way); any other command
// runs in a pipeline of the client.
func (b *Batched) Pipeline() redis.Pipeliner {
	return &batchPipe{Pipeliner: b.client.Pipeline(), b: b}
}

func (b *Batched) run(ctx context.Context, name, script string, keys []string, args []any) *redis.Cmd {
	w := &waiter{ctx: ctx}
	c := &w.cmd
	initBatchCmd(c, ctx, name, script, keys, args)
	w.one[0] = c
	w.cmds = w.one[:]
	if err := b.do(w); err != nil {
		out := redis.NewCmd(ctx, c.Args()...)
		out.SetErr(err)
		return out
	}
	if err := c.Err(); w.shared && failedWithBatch(err) {
		c.SetErr(&SharedError{err})
	}
	return c.Cmd
}

// waiter is one caller's commands on their way: queued, in a batch, or
// answered. Its state is guarded by Batched.mu.
type waiter struct {
	ctx  context.Context
	cmds []*batchCmd
	// cmd, one and self hold a single call and a batch of this waiter
	// alone, without allocations of their own.
	cmd   batchCmd
	one   [1]*batchCmd
	self  [1]*waiter
	state waiterState
	// shared is set when the waiter's calls failed with their batch after
	// another waiter's had: their errors become SharedErrors.
	shared bool
	// wake gets the batch the waiter is to lead, or nil once its batch is
	// answered. Made when the waiter queues; one send at most.
	wake chan []*waiter
}

type waiterState uint8

const (
	waiting   waiterState = iota // queued
	following                    // in a batch another waiter sends
	leading                      // to send its batch
	answered                     // its batch is sent and its replies read
	gone                         // left the queue: its context ended
)

// do sends w's commands in a batch and returns once they are answered
// (nil: each command holds its reply or error), or with the context's
// error once w's context ends; then w's commands must not be read.
func (b *Batched) do(w *waiter) error {
	if err := w.ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	if b.running < b.inFlight {
		b.running++
		b.mu.Unlock()
		runtime.Gosched() // let the calls about to be made join this batch
		b.mu.Lock()
		batch := b.takeLocked(w)
		b.mu.Unlock()
		b.lead(w, batch)
		return nil
	}
	w.wake = make(chan []*waiter, 1)
	b.queue = append(b.queue, w)
	b.mu.Unlock()
	select {
	case batch := <-w.wake:
		if batch != nil {
			b.lead(w, batch)
		}
		return nil
	case <-w.ctx.Done():
	}
	return b.leave(w)
}

// leave ends the wait of w, which queued, once its context has ended: it
// returns the context's error, or nil if w's batch was answered meanwhile.
func (b *Batched) leave(w *waiter) error {
	b.mu.Lock()
	state := w.state
	switch state {
	case waiting:
		w.state = gone // never sent; takeLocked skips it
	case following, leading:
		for _, c := range w.cmds {
			c.abandoned.Store(true)
		}
	}
	b.mu.Unlock()
	switch state {
	case answered:
		return nil
	case leading:
		// The batch is ours to send, with the others' calls in it (ours
		// now dropped); its deadline is theirs. No request is under way
		// to take a panic: lead has given each call its error.
		batch := <-w.wake
		go func() {
			defer func() { _ = recover() }()
			b.lead(w, batch)
		}()
	}
	return w.ctx.Err()
}

// takeLocked takes the next batch off the queue, after first (if not
// nil), up to maxBatch commands, skipping the waiters gone. Its first
// waiter leads it.
func (b *Batched) takeLocked(first *waiter) []*waiter {
	if first != nil && len(b.queue) == 0 {
		first.state = leading
		first.self[0] = first
		return first.self[:]
	}
	var batch []*waiter
	n := 0
	if first != nil {
		first.state = leading
		batch = append(make([]*waiter, 0, 1+len(b.queue)), first)
		n = len(first.cmds)
	}
	i := 0
	for ; i < len(b.queue); i++ {
		w := b.queue[i]
		if w.state == gone {
			continue
		}
		if n > 0 && n+len(w.cmds) > b.maxBatch {
			break
		}
		if batch == nil {
			w.state = leading
			batch = make([]*waiter, 0, len(b.queue)-i)
		} else {
			w.state = following
		}
		batch = append(batch, w)
		n += len(w.cmds)
	}
	rest := copy(b.queue, b.queue[i:])
	clear(b.queue[rest:])
	b.queue = b.queue[:rest]
	return batch
}

// lead sends the batch that self leads, then hands the next one, if any
// is queued, to its first waiter and wakes the others of this batch.
func (b *Batched) lead(self *waiter, batch []*waiter) {
	var cmds []redis.Cmder
	if len(batch) == 1 && len(batch[0].cmds) == 1 {
		cmds = []redis.Cmder{batch[0].cmds[0]} // one call alone: on the stack
	} else {
		for _, w := range batch {
			for _, c := range w.cmds {
				cmds = append(cmds, c)
			}
		}
	}
	defer func() {
		if r := recover(); r != nil { // a hook's panic: no caller waits forever
			for _, c := range cmds {
				if c.Err() == nil {
					c.SetErr(fmt.Errorf("redis batch: panic: %v", r))
				}
			}
			b.answer(self, batch)
			panic(r)
		}
	}()
	ctx, cancel := batchContext(self, batch)
	defer cancel()
	if len(cmds) == 1 {
		_ = b.client.Process(ctx, cmds[0])
	} else {
		pipe := b.client.Pipeline()
		for _, c := range cmds {
			_ = pipe.Process(ctx, c)
		}
		_, _ = pipe.Exec(ctx) // each command holds its own error
	}
	markShared(batch)
	b.answer(self, batch)
}

// markShared marks the waiters whose calls failed with the batch, after
// the first one. Their state is read by each waiter once answered.
func markShared(batch []*waiter) {
	first := true
	for _, w := range batch {
		for _, c := range w.cmds {
			if failedWithBatch(c.Err()) {
				w.shared = !first
				first = false
				break
			}
		}
	}
}

// answer marks batch answered, hands the next batch to its leader (or
// counts one batch fewer under way) and wakes the batch's waiters.
func (b *Batched) answer(self *waiter, batch []*waiter) {
	b.mu.Lock()
	for _, w := range batch {
		w.state = answered
	}
	next := b.takeLocked(nil)
	if len(next) == 0 {
		b.running--
	}
	b.mu.Unlock()
	if len(next) > 0 {
		next[0].wake <- next
	}
	for _, w := range batch {
		if w != self {
			w.wake <- nil
		}
	}
}

// batchContext is the context a batch is sent under: the leader's values
// without its cancellation, and the earliest deadline of the batch's
// waiters that has not passed. A batch of one waiter is sent under its
// own context.
func batchContext(self *waiter, batch []*waiter) (context.Context, context.CancelFunc) {
	if len(batch) == 1 {
		return batch[0].ctx, func() {}
	}
	now := time.Now()
	var deadline time.Time
	for _, w := range batch {
		if d, ok := w.ctx.Deadline(); ok && d.After(now) && (deadline.IsZero() || d.Before(deadline)) {
			deadline = d
		}
	}
	ctx := context.WithoutCancel(self.ctx)
	if deadline.IsZero() {
		return ctx, func() {}
	}
	return context.WithDeadline(ctx, deadline)
}

// batchCmd is a script call in a batch. It reports NoRetry itself,
// whatever the client's hooks, so that go-redis never sends it, or its
// batch, again.
type batchCmd struct {
	*redis.Cmd
	// abandoned is set when the caller stopped waiting; the hook then
	// leaves the call out of a batch not yet written.
	abandoned atomic.Bool
}

// NoRetry keeps go-redis from sending the command, or its batch, again.
func (*batchCmd) NoRetry() bool { return true }

// SetErr sets err, unless the command holds its reply already: see
// keepReply.
func (c *batchCmd) SetErr(err error) { keepReply(c.Cmd, err) }

// newBatchCmd returns a command with go-redis's arguments for name (EVAL,
// EVALSHA and their _RO forms): the script or its SHA1, the number of
// keys, the keys, then args (a single []string or []any argument is
// spread, as go-redis does).
func newBatchCmd(ctx context.Context, name, script string, keys []string, args []any) *batchCmd {
	c := new(batchCmd)
	initBatchCmd(c, ctx, name, script, keys, args)
	return c
}

// initBatchCmd sets up c as newBatchCmd's.
func initBatchCmd(c *batchCmd, ctx context.Context, name, script string, keys []string, args []any) {
	if len(args) == 1 {
		switch a := args[0].(type) {
		case []string:
			args = make([]any, len(a))
			for i, s := range a {
				args[i] = s
			}
		case []any:
			args = a
		}
	}
	all := make([]any, 3+len(keys), 3+len(keys)+len(args))
	all[0], all[1], all[2] = name, script, len(keys)
	for i, k := range keys {
		all[3+i] = k
	}
	all = append(all, args...)
	c.Cmd = redis.NewCmd(ctx, all...)
	if len(keys) > 0 {
		c.SetFirstKeyPos(3) // where a ClusterClient finds the slot
	}
}

// batchHook is the hook NewBatched adds to its client. It leaves the
// abandoned calls out of a batch about to be written (and fails them with
// ErrAbandoned), so that a call whose caller gave up meanwhile does not
// charge buckets for a request that on_redis_error decided; with merge, it
// sends the batch's lua.TokenBucket calls as one lua.Batch call.
type batchHook struct{ merge bool }

func (batchHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (batchHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if abandoned(cmd) {
			cmd.SetErr(ErrAbandoned)
			return ErrAbandoned
		}
		return next(ctx, cmd)
	}
}

func (h batchHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var kept []redis.Cmder // a copy, made at the first abandoned call
		for i, cmd := range cmds {
			if !abandoned(cmd) {
				if kept != nil {
					kept = append(kept, cmd)
				}
				continue
			}
			if kept == nil {
				kept = append(make([]redis.Cmder, 0, len(cmds)-1), cmds[:i]...)
			}
			cmd.SetErr(ErrAbandoned)
		}
		switch {
		case kept == nil:
			kept = cmds
		case len(kept) == 0:
			return nil // each call has its error
		}
		if h.merge {
			if m := mergeDecisions(ctx, kept); m != nil {
				m.send(ctx, next)
				return firstErr(kept)
			}
		}
		return next(ctx, kept)
	}
}

// firstErr returns the first error of cmds, as a pipeline's Exec does.
func firstErr(cmds []redis.Cmder) error {
	for _, c := range cmds {
		if err := c.Err(); err != nil {
			return err
		}
	}
	return nil
}

func abandoned(cmd redis.Cmder) bool {
	c, ok := cmd.(*batchCmd)
	return ok && c.abandoned.Load()
}

// batchPipe is Batched's pipeline: its script calls go together, as one
// caller's, in a batch on Exec; anything else goes to the client's
// pipeline it wraps.
type batchPipe struct {
	redis.Pipeliner
	b    *Batched
	out  []*redis.Cmd // what the caller holds
	cmds []*batchCmd  // what is sent, one per out
}

func (p *batchPipe) queue(ctx context.Context, name, script string, keys []string, args []any) *redis.Cmd {
	c := newBatchCmd(ctx, name, script, keys, args)
	out := redis.NewCmd(ctx, c.Args()...)
	p.out, p.cmds = append(p.out, out), append(p.cmds, c)
	return out
}

func (p *batchPipe) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return p.queue(ctx, "eval", script, keys, args)
}

func (p *batchPipe) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return p.queue(ctx, "evalsha", sha1, keys, args)
}

func (p *batchPipe) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return p.queue(ctx, "eval_ro", script, keys, args)
}

func (p *batchPipe) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return p.queue(ctx, "evalsha_ro", sha1, keys, args)
}

// Len counts the queued script calls and the wrapped pipeline's commands.
func (p *batchPipe) Len() int { return len(p.cmds) + p.Pipeliner.Len() }

// Discard drops everything queued.
func (p *batchPipe) Discard() {
	p.out, p.cmds = nil, nil
	p.Pipeliner.Discard()
}

// Pipelined runs fn on the pipeline, then Exec.
func (p *batchPipe) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	if err := fn(p); err != nil {
		return nil, err
	}
	return p.Exec(ctx)
}

// Exec sends the script calls in a batch and waits for them until ctx
// ends, then runs the wrapped pipeline's commands if any. It returns the
// commands, scripts first, and the first error.
func (p *batchPipe) Exec(ctx context.Context) ([]redis.Cmder, error) {
	out, cmds := p.out, p.cmds
	p.out, p.cmds = nil, nil
	all := make([]redis.Cmder, 0, len(out)+p.Pipeliner.Len())
	var first error
	if len(cmds) > 0 {
		w := &waiter{ctx: ctx, cmds: cmds}
		err := p.b.do(w)
		for i, o := range out {
			if err == nil {
				o.SetVal(cmds[i].Val())
				err := cmds[i].Err()
				if w.shared && failedWithBatch(err) {
					err = &SharedError{err}
				}
				o.SetErr(err)
				if err != nil && first == nil {
					first = err
				}
			} else {
				o.SetErr(err)
				first = err
			}
			all = append(all, o)
		}
	}
	if p.Pipeliner.Len() > 0 {
		more, err := p.Pipeliner.Exec(ctx)
		all = append(all, more...)
		if err != nil && first == nil {
			first = err
		}
	}
	return all, first
}

var (
	_ redis.Scripter = (*Batched)(nil)
	_ ShardedClient  = (*Batched)(nil)
	_ redis.Hook     = batchHook{}
)
