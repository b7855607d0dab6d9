package bucket

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// These tests run Batched against a real redis-server behind a proxy that
// injects the faults: a reply lost after Redis ran the batch, a reply held
// past the caller's timeout. Every bucket has a capacity of 100 and gets
// one token back per hour, so a bucket's charges are exact. Those about
// what a batch sends run twice: with the calls merged into one lua.Batch
// call (a client of one server, the default) and pipelined (NoMerge, as on
// a Cluster).

// btCapacity is the capacity of every bucket of these tests.
const btCapacity = 100

// btEnv is a redis-server, a proxy in front of it, and a Batched store on
// a client of the proxy set up as the handler sets it up.
type btEnv struct {
	srv    *redistest.Server
	proxy  *redistest.Proxy
	admin  *redis.Client // straight to the server
	client *redis.Client
	b      *Batched
	store  Redis
	sent   *btSent
	spec   Spec
	merge  bool // a batch's calls go as one lua.Batch call
}

// btModes are the two ways a batch is sent.
var btModes = []struct {
	name string
	opt  BatchOptions
}{
	{"merged", BatchOptions{}},
	{"pipelined", BatchOptions{NoMerge: true}},
}

// forBTModes runs test in each of btModes, on an environment of its own.
func forBTModes(t *testing.T, timeout time.Duration, test func(t *testing.T, e *btEnv)) {
	for _, m := range btModes {
		t.Run(m.name, func(t *testing.T) { test(t, newBTEnv(t, timeout, m.opt)) })
	}
}

// runs is how many scripts Redis runs for batches of these numbers of
// calls: one per batch when merged (a batch of one call is sent as it
// is), else one per call.
func (e *btEnv) runs(batches ...int) int64 {
	n := 0
	for _, b := range batches {
		if e.merge {
			b = min(b, 1)
		}
		n += b
	}
	return int64(n)
}

func newBTEnv(t *testing.T, timeout time.Duration, opt BatchOptions) *btEnv {
	t.Helper()
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t)
	proxy.SetTarget(srv.Addr)
	client := redis.NewClient(&redis.Options{Addr: proxy.Addr, MaxRetries: -1, DialerRetries: 1,
		DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout, ContextTimeoutEnabled: true})
	t.Cleanup(func() { client.Close() })
	e := &btEnv{srv: srv, proxy: proxy, admin: srv.Client(t), client: client, sent: &btSent{}, spec: shSpec(t, btCapacity),
		merge: !opt.NoMerge}
	e.b = NewBatched(client, opt)
	client.AddHook(e.sent)
	e.store = Redis{Client: e.b}
	for _, s := range []*redis.Script{lua.TokenBucket, lua.Batch} {
		if err := s.Load(context.Background(), client).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

// key is the bucket of a name.
func (e *btEnv) key(name string) string { return "bt:{" + name + "}" }

// take charges one token of the bucket of name, under a context with
// timeout.
func (e *btEnv) take(name string, timeout time.Duration) (Decision, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return e.store.Take(ctx, []string{e.key(name)}, []Take{{Spec: e.spec, Cost: 1}})
}

// charges returns the tokens taken from the bucket of name: 0 when it has
// no state (never charged).
func (e *btEnv) charges(t *testing.T, name string) int64 {
	t.Helper()
	return btCharges(t, e.admin, e.key(name))
}

func btCharges(t *testing.T, c redis.Cmdable, key string) int64 {
	t.Helper()
	v, err := c.Get(context.Background(), key).Result()
	if errors.Is(err, redis.Nil) {
		return 0
	}
	if err != nil {
		t.Fatalf("GET %s: %v", key, err)
	}
	st, err := DecodeState(v)
	if err != nil {
		t.Fatalf("%s: %v", key, err)
	}
	return btCapacity - st.Units/st.Scale
}

// waitQueued waits until n callers are queued behind the batch under way.
func (e *btEnv) waitQueued(t *testing.T, n int) {
	t.Helper()
	redistest.WaitFor(t, 10*time.Second, fmt.Sprintf("%d callers queued", n), func() error {
		if q, r := e.b.Pending(); q != n || r != 1 {
			return fmt.Errorf("%d queued, %d batches under way", q, r)
		}
		return nil
	})
}

// waitIdle waits until no caller is queued and no batch is under way.
func (e *btEnv) waitIdle(t *testing.T) {
	t.Helper()
	redistest.WaitFor(t, 10*time.Second, "the batcher to be idle", func() error {
		if q, r := e.b.Pending(); q != 0 || r != 0 {
			return fmt.Errorf("%d queued, %d batches under way", q, r)
		}
		return nil
	})
}

// hold sends a call on the bucket of name whose reply the proxy holds for
// d, and returns once it is written (so that the calls made next queue
// behind it); its outcome comes on the channel.
func (e *btEnv) hold(t *testing.T, name string, d, timeout time.Duration) <-chan error {
	t.Helper()
	e.proxy.DelayReplyTo("evalsha", d)
	done := make(chan error, 1)
	go func() {
		_, err := e.take(name, timeout)
		done <- err
	}()
	redistest.WaitFor(t, 10*time.Second, "the held call to pass the proxy", func() error {
		if e.proxy.Armed() {
			return errors.New("not yet")
		}
		return nil
	})
	return done
}

// btResult is one caller's outcome.
type btResult struct {
	name string
	d    Decision
	err  error
}

// takeAll takes one token from each bucket of names at once, each under
// timeout, after the callers are queued (queued true) or not.
func (e *btEnv) takeAll(t *testing.T, names []string, timeout time.Duration, queued bool) []btResult {
	t.Helper()
	out := make([]btResult, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := e.take(name, timeout)
			out[i] = btResult{name, d, err}
		}()
	}
	if queued {
		e.waitQueued(t, len(names))
	}
	wg.Wait()
	return out
}

func btNames(prefix string, n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = prefix + strconv.Itoa(i)
	}
	return names
}

// btSent records what the client sends: the script calls sent alone and
// the sizes of the pipelines of script calls, counting the calls a
// lua.Batch call carries (then also counted in merged).
type btSent struct {
	mu        sync.Mutex
	alone     int
	pipelines []int
	merged    int
}

// carried is the number of script calls that cmd makes: those a lua.Batch
// call carries, else 1 for a script, 0 for another command.
func carried(cmd redis.Cmder) int {
	if !strings.HasPrefix(cmd.Name(), "eval") {
		return 0
	}
	args := cmd.Args()
	if args[1] != lua.Batch.Hash() && args[1] != lua.BatchSource {
		return 1
	}
	return len(args[3+args[2].(int)].([]byte)) - 1 // a flags byte, a byte per call
}

func (s *btSent) DialHook(next redis.DialHook) redis.DialHook { return next }

func (s *btSent) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := carried(cmd); n > 0 {
			s.mu.Lock()
			s.alone += n
			s.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (s *btSent) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n, merged := 0, 0
		for _, c := range cmds {
			k := carried(c)
			n += k
			if k > 1 || (k == 1 && c.Args()[1] == lua.Batch.Hash()) {
				merged++
			}
		}
		if n > 0 {
			s.mu.Lock()
			s.pipelines = append(s.pipelines, n)
			s.merged += merged
			s.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

func (s *btSent) reset() (alone int, pipelines []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	alone, pipelines = s.alone, s.pipelines
	s.alone, s.pipelines, s.merged = 0, nil, 0
	return alone, pipelines
}

// mergedCalls returns the lua.Batch calls sent since the last reset.
func (s *btSent) mergedCalls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.merged
}

// TestBatchedAloneAtLowLoad: one caller at a time sends each call at once,
// alone (Client.Process, no pipeline), and gets its own decision.
func TestBatchedAloneAtLowLoad(t *testing.T) {
	e := newBTEnv(t, 2*time.Second, BatchOptions{})
	e.sent.reset()
	for i := int64(1); i <= 5; i++ {
		d, err := e.take("alone", time.Second)
		if err != nil || !d.Allowed || d.Buckets[0].Remaining != btCapacity-i {
			t.Fatalf("take %d: %+v, %v; want allowed with %d left", i, d, err, btCapacity-i)
		}
	}
	if alone, pipelines := e.sent.reset(); alone != 5 || len(pipelines) != 0 {
		t.Errorf("sent %d calls alone and pipelines %v; want 5 alone, no pipeline", alone, pipelines)
	}
	if q, r := e.b.Pending(); q != 0 || r != 0 {
		t.Errorf("%d queued, %d under way after the calls returned", q, r)
	}
}

// TestBatchedSharesOneWrite: the calls that arrive while a call is under
// way go together as the next batch, one pipeline (merged: one lua.Batch
// call), and each gets its own decision; each bucket is charged once.
func TestBatchedSharesOneWrite(t *testing.T) {
	forBTModes(t, 5*time.Second, testBatchedSharesOneWrite)
}

func testBatchedSharesOneWrite(t *testing.T, e *btEnv) {
	before := redistest.ScriptRuns(t, e.admin)
	e.sent.reset()
	held := e.hold(t, "held", 300*time.Millisecond, 5*time.Second)
	names := btNames("share", 20)
	results := e.takeAll(t, names, 5*time.Second, true)
	if err := <-held; err != nil {
		t.Fatalf("held call: %v", err)
	}
	for _, r := range results {
		if r.err != nil || !r.d.Allowed || r.d.Buckets[0].Remaining != btCapacity-1 {
			t.Errorf("%s: %+v, %v; want allowed with %d left", r.name, r.d, r.err, btCapacity-1)
		}
		if n := e.charges(t, r.name); n != 1 {
			t.Errorf("%s charged %d times, want 1", r.name, n)
		}
	}
	if m, want := e.sent.mergedCalls(), int(e.runs(len(names))); e.merge && m != want {
		t.Errorf("sent %d lua.Batch calls, want %d", m, want)
	}
	if alone, pipelines := e.sent.reset(); alone != 1 || len(pipelines) != 1 || pipelines[0] != len(names) {
		t.Errorf("sent %d calls alone and pipelines of %v calls; want the held call alone, then one pipeline of %d",
			alone, pipelines, len(names))
	}
	if n, want := redistest.ScriptRuns(t, e.admin)-before, e.runs(1, len(names)); n != want {
		t.Errorf("redis ran %d scripts, want %d", n, want)
	}
}

// TestBatchedYieldGathersRunnable: on one processor, callers that are
// runnable when a caller finds no batch under way join its batch: the
// leader yields before it sends. Each round starts 10 callers at once;
// without the yield the first would send alone and the 9 others after it
// (2 sends a round, 40 in all); with it a round is one pipeline, or two
// when the scheduler happens to resume the leader first (it polls its
// global queue, where the yield puts the leader, every 61st schedule).
func TestBatchedYieldGathersRunnable(t *testing.T) {
	e := newBTEnv(t, 5*time.Second, BatchOptions{})
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	const rounds, callers = 20, 10
	e.sent.reset()
	for r := range rounds {
		names := btNames("yield-"+strconv.Itoa(r)+"-", callers)
		var wg sync.WaitGroup
		errs := make([]error, callers)
		for i, name := range names {
			wg.Go(func() { _, errs[i] = e.take(name, 5*time.Second) })
		}
		wg.Wait()
		for i, name := range names {
			if errs[i] != nil {
				t.Fatalf("%s: %v", name, errs[i])
			}
			if n := e.charges(t, name); n != 1 {
				t.Fatalf("%s charged %d times, want 1", name, n)
			}
		}
	}
	alone, pipelines := e.sent.reset()
	calls := alone
	for _, n := range pipelines {
		calls += n
	}
	if calls != rounds*callers {
		t.Fatalf("sent %d calls, want %d", calls, rounds*callers)
	}
	if sends := alone + len(pipelines); sends > rounds+rounds/2 {
		t.Errorf("%d sends for %d rounds of %d callers (%d alone, pipelines %v); want at most %d: the callers did not join the leader's batch",
			sends, rounds, callers, alone, pipelines, rounds+rounds/2)
	}
}

// TestBatchedLostReply loses the reply to a batch after Redis ran it:
// every caller of the batch gets an error (not a timeout: at once), no
// script runs twice, and each bucket holds exactly the charges of the
// scripts Redis ran, one per caller at most; the calls after it succeed.
func TestBatchedLostReply(t *testing.T) {
	forBTModes(t, 5*time.Second, testBatchedLostReply)
}

func testBatchedLostReply(t *testing.T, e *btEnv) {
	before := redistest.ScriptRuns(t, e.admin)
	held := e.hold(t, "held", 300*time.Millisecond, 5*time.Second)
	names := btNames("lost", 20)
	out := make(chan []btResult, 1)
	go func() { out <- e.takeAll(t, names, 5*time.Second, false) }()
	e.waitQueued(t, len(names))
	e.proxy.LoseReplyTo("evalsha") // the next write of a script: the batch
	results := <-out
	if err := <-held; err != nil {
		t.Fatalf("held call: %v", err)
	}
	if e.proxy.Lost() != 1 {
		t.Fatalf("the proxy lost %d replies, want 1", e.proxy.Lost())
	}
	e.waitIdle(t)
	ran := redistest.ScriptRuns(t, e.admin) - before
	var charged int64
	shared := 0
	for _, r := range results {
		if r.err == nil {
			t.Errorf("%s: allowed (%+v) though its batch's reply was lost", r.name, r.d)
		} else if errors.Is(r.err, context.DeadlineExceeded) {
			t.Errorf("%s: %v; want the lost connection's error, not a timeout", r.name, r.err)
		} else if IsShared(r.err) {
			shared++
		}
		n := e.charges(t, r.name)
		if n > 1 {
			t.Errorf("%s charged %d times, want at most 1", r.name, n)
		}
		charged += n
	}
	if shared != len(names)-1 {
		t.Errorf("%d of the batch's %d errors are SharedErrors, want all but the first", shared, len(names))
	}
	t.Logf("redis ran %d scripts: the held call and %d of the lost batch's %d", ran, ran-1, len(names))
	perRun := int64(1) // the calls a script run charged
	if e.merge {
		perRun = int64(len(names)) // the batch is one script: it ran whole, or not at all
	}
	if e.charges(t, "held") != 1 || charged != (ran-1)*perRun || ran < 2 {
		t.Errorf("held charged %d, the batch's buckets %d; redis ran %d scripts: want the held call charged once, "+
			"the batch ran (≥ 1 script) and every script run charged once", e.charges(t, "held"), charged, ran)
	}
	for _, r := range e.takeAll(t, names, 5*time.Second, false) {
		if r.err != nil || !r.d.Allowed || r.d.Buckets[0].Remaining != btCapacity-e.charges(t, r.name) {
			t.Errorf("%s after the loss: %+v, %v", r.name, r.d, r.err)
		}
	}
}

// TestBatchedDelayedReply holds a reply past the caller's timeout: the
// call fails with the timeout, its script ran once and is never sent
// again, even after the held reply comes; and callers whose timeout ends
// while they are queued behind a held call are never sent at all.
func TestBatchedDelayedReply(t *testing.T) {
	e := newBTEnv(t, 5*time.Second, BatchOptions{})

	t.Run("past_the_timeout", func(t *testing.T) {
		before := redistest.ScriptRuns(t, e.admin)
		delayed := e.proxy.Delayed()
		held := e.hold(t, "late", 600*time.Millisecond, 200*time.Millisecond)
		if err := <-held; !errors.Is(err, context.DeadlineExceeded) && !isTimeout(err) {
			t.Fatalf("held call: %v; want its timeout", err)
		}
		redistest.WaitFor(t, 10*time.Second, "the held reply to come", func() error {
			if e.proxy.Delayed() == delayed {
				return errors.New("not yet")
			}
			return nil
		})
		e.waitIdle(t)
		if n := redistest.ScriptRuns(t, e.admin) - before; n != 1 {
			t.Errorf("redis ran %d scripts for one call that timed out, want 1", n)
		}
		if n := e.charges(t, "late"); n != 1 {
			t.Errorf("late charged %d times, want 1", n)
		}
		if d, err := e.take("late", time.Second); err != nil || d.Buckets[0].Remaining != btCapacity-2 {
			t.Errorf("next call: %+v, %v; want %d left", d, err, btCapacity-2)
		}
	})

	t.Run("queued_past_the_timeout", func(t *testing.T) {
		before := redistest.ScriptRuns(t, e.admin)
		held := e.hold(t, "slow", time.Second, 5*time.Second)
		names := btNames("gave-up", 10)
		out := make(chan []btResult, 1)
		go func() { out <- e.takeAll(t, names, 150*time.Millisecond, false) }()
		results := <-out
		if err := <-held; err != nil {
			t.Fatalf("held call: %v", err)
		}
		e.waitIdle(t)
		for _, r := range results {
			if !errors.Is(r.err, context.DeadlineExceeded) {
				t.Errorf("%s: %+v, %v; want its timeout", r.name, r.d, r.err)
			}
			if n := e.charges(t, r.name); n != 0 {
				t.Errorf("%s charged %d times, want 0: it gave up before it was sent", r.name, n)
			}
		}
		if n := redistest.ScriptRuns(t, e.admin) - before; n != 1 {
			t.Errorf("redis ran %d scripts, want 1 (the held call)", n)
		}
	})
}

func isTimeout(err error) bool {
	var ne interface{ Timeout() bool }
	return errors.As(err, &ne) && ne.Timeout()
}

// TestBatchedDropsAbandoned: a call marked abandoned before its batch is
// written is left out of it (and of a call alone, and of a merged call),
// never sent.
func TestBatchedDropsAbandoned(t *testing.T) {
	forBTModes(t, 5*time.Second, testBatchedDropsAbandoned)
}

func testBatchedDropsAbandoned(t *testing.T, e *btEnv) {
	ctx := context.Background()
	before := redistest.ScriptRuns(t, e.admin)
	args := appendArgs(nil, []Take{{Spec: e.spec, Cost: 1}})
	kept := newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), []string{e.key("kept")}, args)
	kept2 := newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), []string{e.key("kept2")}, args)
	dropped := newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), []string{e.key("dropped")}, args)
	alone := newBatchCmd(ctx, "evalsha", lua.TokenBucket.Hash(), []string{e.key("alone")}, args)
	dropped.abandoned.Store(true)
	alone.abandoned.Store(true)
	pipe := e.client.Pipeline()
	_ = pipe.Process(ctx, kept)
	_ = pipe.Process(ctx, dropped)
	_ = pipe.Process(ctx, kept2)
	_, _ = pipe.Exec(ctx)
	if err := e.client.Process(ctx, alone); !errors.Is(err, ErrAbandoned) {
		t.Errorf("abandoned call alone: %v; want ErrAbandoned", err)
	}
	if kept.Err() != nil || kept2.Err() != nil || !errors.Is(dropped.Err(), ErrAbandoned) || !errors.Is(alone.Err(), ErrAbandoned) {
		t.Errorf("kept %v and %v, dropped %v, alone %v; want nil, nil, ErrAbandoned, ErrAbandoned",
			kept.Err(), kept2.Err(), dropped.Err(), alone.Err())
	}
	for _, c := range []*batchCmd{kept, kept2} {
		if vals, err := c.Int64Slice(); err != nil || len(vals) != 3 || vals[0] != btCapacity-1 {
			t.Errorf("%v: %v, %v; want %d left", c.Args()[3], vals, err, btCapacity-1)
		}
	}
	if e.charges(t, "kept") != 1 || e.charges(t, "kept2") != 1 || e.charges(t, "dropped") != 0 || e.charges(t, "alone") != 0 {
		t.Errorf("charges: kept %d and %d, dropped %d, alone %d; want 1, 1, 0, 0",
			e.charges(t, "kept"), e.charges(t, "kept2"), e.charges(t, "dropped"), e.charges(t, "alone"))
	}
	if n, want := redistest.ScriptRuns(t, e.admin)-before, e.runs(2); n != want {
		t.Errorf("redis ran %d scripts, want %d", n, want)
	}
}

// TestBatchedPipeline: Batched's pipeline sends its script calls in a
// batch and any other command in the client's pipeline; each command
// holds its reply after Exec.
func TestBatchedPipeline(t *testing.T) {
	forBTModes(t, 5*time.Second, testBatchedPipeline)
}

func testBatchedPipeline(t *testing.T, e *btEnv) {
	ctx := context.Background()
	e.sent.reset()
	p := e.b.Pipeline()
	args := appendArgs(nil, []Take{{Spec: e.spec, Cost: 3}})
	a := p.EvalSha(ctx, lua.TokenBucket.Hash(), []string{e.key("pa")}, args...)
	b := p.EvalSha(ctx, lua.TokenBucket.Hash(), []string{e.key("pb")}, args...)
	ping := p.Ping(ctx)
	if n := p.Len(); n != 3 {
		t.Errorf("Len %d before Exec, want 3", n)
	}
	cmds, err := p.Exec(ctx)
	if err != nil || len(cmds) != 3 {
		t.Fatalf("Exec: %d commands, %v", len(cmds), err)
	}
	for _, c := range []*redis.Cmd{a, b} {
		if vals, err := c.Int64Slice(); err != nil || len(vals) != 3 || vals[0] != btCapacity-3 {
			t.Errorf("%v: %v, %v; want %d left", c.Args()[3], vals, err, btCapacity-3)
		}
	}
	if ping.Val() != "PONG" {
		t.Errorf("PING in the pipeline: %q, %v", ping.Val(), ping.Err())
	}
	if alone, pipelines := e.sent.reset(); alone != 0 || len(pipelines) != 1 || pipelines[0] != 2 {
		t.Errorf("sent %d calls alone and pipelines %v; want one pipeline of the 2 scripts", alone, pipelines)
	}
	if p.Len() != 0 {
		t.Errorf("Len %d after Exec", p.Len())
	}
	p.EvalSha(ctx, lua.TokenBucket.Hash(), []string{e.key("pc")}, args...)
	p.Discard()
	if _, err := p.Exec(ctx); err != nil || e.charges(t, "pc") != 0 {
		t.Errorf("a discarded call: Exec %v, charged %d", err, e.charges(t, "pc"))
	}
}

// TestBatchedNoScript: after SCRIPT FLUSH (a restart, a failover) every
// caller of a batch gets NOSCRIPT and recovers with EVAL (merged: the
// batch's lua.Batch call is sent again as EVAL), each charged once.
func TestBatchedNoScript(t *testing.T) {
	forBTModes(t, 5*time.Second, testBatchedNoScript)
}

func testBatchedNoScript(t *testing.T, e *btEnv) {
	if err := e.admin.ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	before := redistest.ScriptRuns(t, e.admin)
	held := e.hold(t, "held", 300*time.Millisecond, 5*time.Second)
	names := btNames("noscript", 10)
	for _, r := range e.takeAll(t, names, 5*time.Second, true) {
		if r.err != nil || !r.d.Allowed || e.charges(t, r.name) != 1 {
			t.Errorf("%s: %+v, %v, charged %d; want allowed, charged once", r.name, r.d, r.err, e.charges(t, r.name))
		}
	}
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	if n, want := redistest.ScriptRuns(t, e.admin)-before, e.runs(1, len(names)); n != want {
		t.Errorf("redis ran %d scripts, want %d", n, want)
	}
	// Loaded again: the next batch goes as EVALSHA, and runs once.
	before = redistest.ScriptRuns(t, e.admin)
	held = e.hold(t, "held", 300*time.Millisecond, 5*time.Second)
	evals := redistest.Calls(t, e.admin, "eval")
	for _, r := range e.takeAll(t, names, 5*time.Second, true) {
		if r.err != nil || !r.d.Allowed || e.charges(t, r.name) != 2 {
			t.Errorf("%s again: %+v, %v, charged %d; want allowed, charged twice in all", r.name, r.d, r.err, e.charges(t, r.name))
		}
	}
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	if n, want := redistest.ScriptRuns(t, e.admin)-before, e.runs(1, len(names)); n != want || redistest.Calls(t, e.admin, "eval") != evals {
		t.Errorf("redis ran %d scripts, %d of them EVAL; want %d, none EVAL", n, redistest.Calls(t, e.admin, "eval")-evals, want)
	}
}

// TestBatchedContextDone: a call whose context has ended is not sent.
func TestBatchedContextDone(t *testing.T) {
	e := newBTEnv(t, 5*time.Second, BatchOptions{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	before := redistest.ScriptRuns(t, e.admin)
	if _, err := e.store.Take(ctx, []string{e.key("done")}, []Take{{Spec: e.spec, Cost: 1}}); !errors.Is(err, context.Canceled) {
		t.Errorf("Take with a cancelled context: %v", err)
	}
	if _, err := e.b.Pipeline().Pipelined(ctx, func(p redis.Pipeliner) error {
		p.EvalSha(ctx, lua.TokenBucket.Hash(), []string{e.key("done")}, appendArgs(nil, []Take{{Spec: e.spec, Cost: 1}})...)
		return nil
	}); !errors.Is(err, context.Canceled) {
		t.Errorf("pipeline with a cancelled context: %v", err)
	}
	if n := redistest.ScriptRuns(t, e.admin) - before; n != 0 || e.charges(t, "done") != 0 {
		t.Errorf("redis ran %d scripts, done charged %d; want none", n, e.charges(t, "done"))
	}
}

// TestBatchedOnCluster runs Sharded over Batched on a real three-master
// Redis Cluster: concurrent requests whose buckets are on two nodes share
// pipelines (go-redis sends each node its part), then a bucket's slot
// moves to another node whose script cache is empty, and the batches meet
// MOVED and NOSCRIPT, follow and recover; every bucket holds exactly the
// charges of the requests, none twice.
func TestBatchedOnCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	client := cluster.Client(t)
	client.AddHook(NoRetry{})
	errs := &shErrors{counts: map[string]int{}}
	client.OnNewNode(func(node *redis.Client) { node.AddHook(errs) })
	c := &shCluster{Cluster: cluster, client: client, store: Sharded{Client: NewBatched(client, BatchOptions{})},
		keyer: NewKeyer("rl:", ""), errs: errs}
	ctx := context.Background()
	spec := shSpec(t, 1000)
	kM := c.keyer.Key("user", "migrating", "")
	from := c.NodeOf(t, kM)
	kO := c.keyOn(t, "ip", "other", from)
	var to *redistest.Server
	for _, n := range c.Nodes {
		if n != from {
			to = n
			break
		}
	}
	// burst sends clients × n requests on kM and kO at once, and checks
	// that each was allowed.
	burst := func(clients, n int) {
		t.Helper()
		var wg sync.WaitGroup
		for g := 0; g < clients; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < n; i++ {
					tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
					d, err := c.store.Take(tctx, []string{kM, kO}, []Take{{Spec: spec, Cost: 1}, {Spec: spec, Cost: 1}})
					cancel()
					if err != nil || !d.Allowed {
						t.Errorf("Take: %+v, %v", d, err)
						return
					}
				}
			}()
		}
		wg.Wait()
	}
	tokens := func(key string) int64 { st := c.state(t, key); return st.Units / st.Scale }

	burst(20, 10)
	if a, b := tokens(kM), tokens(kO); a != 800 || b != 800 {
		t.Fatalf("after 200 requests: %s holds %d, %s holds %d; want 800 each", kM, a, kO, b)
	}
	slot, _ := client.ClusterKeySlot(ctx, kM).Result()
	c.MigrateSlot(t, slot, from, to)
	for _, n := range c.Nodes {
		if err := n.Client(t).ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	moved, noscript := errs.count("MOVED"), errs.count("NOSCRIPT")
	burst(20, 10)
	if a, b := tokens(kM), tokens(kO); a != 600 || b != 600 {
		t.Errorf("after 200 more requests across the migration: %s holds %d, %s holds %d; want 600 each", kM, a, kO, b)
	}
	if errs.count("MOVED") == moved || errs.count("NOSCRIPT") == noscript {
		t.Errorf("the requests after the migration met %d MOVED and %d NOSCRIPT, want at least one of each",
			errs.count("MOVED")-moved, errs.count("NOSCRIPT")-noscript)
	}
	if n := c.NodeOf(t, kM); n != to {
		t.Errorf("%s is served by %s, want %s", kM, n.Addr, to.Addr)
	}
}

// TestBatchedLeaderGivesUp: a caller handed the next batch to send just
// as its context ends still sends it, in the background, for the others
// in it, without its own call; it returns its context's error at once.
func TestBatchedLeaderGivesUp(t *testing.T) {
	e := newBTEnv(t, 5*time.Second, BatchOptions{})
	before := redistest.ScriptRuns(t, e.admin)
	args := appendArgs(nil, []Take{{Spec: e.spec, Cost: 1}})
	queued := func(ctx context.Context, name string) *waiter {
		w := &waiter{ctx: ctx, wake: make(chan []*waiter, 1)}
		initBatchCmd(&w.cmd, ctx, "evalsha", lua.TokenBucket.Hash(), []string{e.key(name)}, args)
		w.one[0] = &w.cmd
		w.cmds = w.one[:]
		return w
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	alive, stop := context.WithTimeout(context.Background(), 5*time.Second)
	defer stop()
	quitter, follower := queued(ended, "quitter"), queued(alive, "follower")
	// Both queued behind a batch under way, which is answered now.
	e.b.mu.Lock()
	e.b.running = 1
	e.b.queue = append(e.b.queue, quitter, follower)
	e.b.mu.Unlock()
	e.b.answer(nil, nil)
	if quitter.state != leading || follower.state != following {
		t.Fatalf("states %d, %d; want the first queued leading, the second following", quitter.state, follower.state)
	}
	if err := e.b.leave(quitter); !errors.Is(err, context.Canceled) {
		t.Errorf("the leader whose context ended: %v, want context.Canceled", err)
	}
	select {
	case batch := <-follower.wake:
		if batch != nil {
			t.Fatalf("the follower was handed a batch of %d", len(batch))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the follower's batch was never sent")
	}
	if vals, err := follower.cmd.Int64Slice(); err != nil || vals[0] != btCapacity-1 {
		t.Errorf("follower: %v, %v; want %d left", vals, err, btCapacity-1)
	}
	if err := quitter.cmd.Err(); !errors.Is(err, ErrAbandoned) {
		t.Errorf("the leader's own call: %v, want ErrAbandoned (left out)", err)
	}
	e.waitIdle(t)
	if n := redistest.ScriptRuns(t, e.admin) - before; n != 1 || e.charges(t, "quitter") != 0 || e.charges(t, "follower") != 1 {
		t.Errorf("redis ran %d scripts, quitter charged %d, follower %d; want 1, 0, 1",
			n, e.charges(t, "quitter"), e.charges(t, "follower"))
	}
}

// TestBatchedMaxBatch: the callers queued behind a batch go in batches of
// at most MaxBatch calls, in the order they came.
func TestBatchedMaxBatch(t *testing.T) {
	forBTModes(t, 5*time.Second, testBatchedMaxBatch)
}

func testBatchedMaxBatch(t *testing.T, e *btEnv) {
	e.b = NewBatched(e.client, BatchOptions{MaxBatch: 5, NoMerge: !e.merge})
	e.store = Redis{Client: e.b}
	e.sent.reset()
	held := e.hold(t, "held", 300*time.Millisecond, 5*time.Second)
	names := btNames("max", 12)
	for _, r := range e.takeAll(t, names, 5*time.Second, true) {
		if r.err != nil || !r.d.Allowed || e.charges(t, r.name) != 1 {
			t.Errorf("%s: %+v, %v, charged %d", r.name, r.d, r.err, e.charges(t, r.name))
		}
	}
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	if alone, pipelines := e.sent.reset(); alone != 1 || fmt.Sprint(pipelines) != "[5 5 2]" {
		t.Errorf("sent %d calls alone and pipelines %v; want the held call alone, then pipelines of [5 5 2]", alone, pipelines)
	}
}

// TestBatchedInFlight: with InFlight 2, a call that finds one batch under
// way goes at once, beside it; the next waits.
func TestBatchedInFlight(t *testing.T) {
	e := newBTEnv(t, 5*time.Second, BatchOptions{})
	e.b = NewBatched(e.client, BatchOptions{InFlight: 2})
	e.store = Redis{Client: e.b}
	held := e.hold(t, "held", 500*time.Millisecond, 5*time.Second)
	if d, err := e.take("beside", 5*time.Second); err != nil || !d.Allowed {
		t.Fatalf("a call beside the held one: %+v, %v", d, err)
	}
	select {
	case err := <-held:
		t.Fatalf("the held call returned (%v) before the call beside it", err)
	default:
	}
	e.proxy.DelayReplyTo("evalsha", 500*time.Millisecond)
	second := make(chan error, 1)
	go func() { _, err := e.take("second", 5*time.Second); second <- err }()
	redistest.WaitFor(t, 10*time.Second, "two batches under way", func() error {
		if q, r := e.b.Pending(); q != 0 || r != 2 {
			return fmt.Errorf("%d queued, %d under way", q, r)
		}
		return nil
	})
	third := make(chan error, 1)
	go func() { _, err := e.take("third", 5*time.Second); third <- err }()
	redistest.WaitFor(t, 10*time.Second, "a caller queued", func() error {
		if q, r := e.b.Pending(); q != 1 || r != 2 {
			return fmt.Errorf("%d queued, %d under way", q, r)
		}
		return nil
	})
	for _, ch := range []<-chan error{held, second, third} {
		if err := <-ch; err != nil {
			t.Error(err)
		}
	}
	e.waitIdle(t)
	for _, name := range []string{"held", "beside", "second", "third"} {
		if n := e.charges(t, name); n != 1 {
			t.Errorf("%s charged %d times, want 1", name, n)
		}
	}
}
