package bucket

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// refundClock is refund.lua with its clock driven by the test (the last
// two ARGV); otherwise the production text.
var refundClock = redis.NewScript(drive(lua.RefundSource))

// drive returns a script's source with its clock line reading the last
// two ARGV.
func drive(src string) string { return strings.Replace(src, lua.ClockLine, clockFromArgv, 1) }

// persisting returns script src, which ends in ret, changed to PERSIST
// every key before it returns: a TTL it set (on the driven clock) cannot
// lapse in real time before the test reads the state.
func persisting(src, ret string) *redis.Script {
	if !strings.HasSuffix(src, ret) {
		panic("persisting: the script does not end in " + ret)
	}
	return redis.NewScript(strings.TrimSuffix(src, ret) + "\nfor i = 1, #KEYS do redis.call('PERSIST', KEYS[i]) end" + ret)
}

// drivenScripts maps the SHA1 of each production script to its variants
// whose clock the test drives: as is, and (for refund and settle)
// persisting their keys.
var drivenScripts = map[string][2]*redis.Script{
	lua.TokenBucket.Hash(): {takeClock, nil},
	lua.Refund.Hash():      {refundClock, persisting(drive(lua.RefundSource), "\nreturn refunded\n")},
	lua.Settle.Hash():      {settleClock, persisting(drive(lua.SettleSource), "\nreturn 1\n")},
	lua.Lease.Hash():       {leaseClock, nil},
}

// drivenClock is a redis.Scripter that runs the production scripts with
// Redis's clock set to now (µs): Redis.Take, Redis.Settle and
// Redis.Refund on it send their own KEYS and ARGV, and the call runs the
// production text but for its clock line, which reads two more ARGV
// (seconds, microseconds) appended here. With persist, refund and settle
// PERSIST their keys.
type drivenClock struct {
	rdb     *redis.Client
	now     int64
	persist bool
}

func (c *drivenClock) run(ctx context.Context, sha string, keys []string, args []any) *redis.Cmd {
	v, ok := drivenScripts[sha]
	if !ok {
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(errors.New("drivenClock: not a production script: " + sha))
		return cmd
	}
	s := v[0]
	if c.persist && v[1] != nil {
		s = v[1]
	}
	all := append(append(make([]any, 0, len(args)+2), args...), c.now/1_000_000, c.now%1_000_000)
	return s.Run(ctx, c.rdb, keys, all...)
}

func sha1Hex(src string) string {
	h := sha1.Sum([]byte(src))
	return hex.EncodeToString(h[:])
}

func (c *drivenClock) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return c.run(ctx, sha1Hex(script), keys, args)
}

func (c *drivenClock) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	return c.run(ctx, sha, keys, args)
}

func (c *drivenClock) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return c.run(ctx, sha1Hex(script), keys, args)
}

func (c *drivenClock) EvalShaRO(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	return c.run(ctx, sha, keys, args)
}

func (c *drivenClock) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return c.rdb.ScriptExists(ctx, hashes...)
}

func (c *drivenClock) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return c.rdb.ScriptLoad(ctx, script)
}

// pxProbe is token_bucket.lua with three test-only changes: its clock
// line reads the last two ARGV; its redis.call alias records the PX of
// each SET by key; and before returning it appends each key's value and
// that PX (-1: the key was not written) and PERSISTs the key. The TTL a
// charge sets is so checked exactly, whatever time passes meanwhile, and
// no key expires in real time while the test drives the clock.
var pxProbe = redis.NewScript(strings.NewReplacer(
	lua.ClockLine, clockFromArgv,
	"\nlocal floor, pack, unpack, call = math.floor, struct.pack, struct.unpack, redis.call\n", `
local floor, pack, unpack = math.floor, struct.pack, struct.unpack
local px = {}
local function call(cmd, key, ...)
  if cmd == 'SET' then
    local a = {...}
    px[key] = a[3] -- SET key value PX ms
  end
  return redis.call(cmd, key, ...)
end
`,
	"\nreturn reply\n", `
if type(reply) ~= 'table' then return reply end
for i = 1, #KEYS do
  reply[#reply + 1] = redis.call('GET', KEYS[i]) or ''
  reply[#reply + 1] = px[KEYS[i]] or -1
  redis.call('PERSIST', KEYS[i])
end
return reply
`).Replace(lua.Source))

// stepPX runs pxProbe at now (µs) and returns the decision with each
// key's value ("" when absent) and the PX it was written with (-1: not
// written).
func stepPX(ctx context.Context, c *redis.Client, now int64, keys []string, takes []Take) (d Decision, vals []string, px []int64, err error) {
	return runProbe(ctx, c, pxProbe, now, keys, takes)
}

// checkPX requires a charged key to have been written with a TTL of its
// FullMS, and an uncharged one not written.
func checkPX(t *testing.T, where, key string, charged bool, px, fullMS int64) {
	t.Helper()
	switch {
	case charged && px != fullMS:
		t.Fatalf("%s: %s written with PX %d, want its FullMS %d", where, key, px, fullMS)
	case !charged && px != -1:
		t.Fatalf("%s: %s not charged but written (PX %d)", where, key, px)
	}
}

// exactRig runs requests through pxProbe (Redis.Take's KEYS and ARGV,
// Redis's clock driven) and through the model, and requires, at every
// step, the same decision, the same stored value of every key of the
// request, and a charged key written with a TTL of exactly the
// decision's FullMS (an uncharged one not written).
type exactRig struct {
	t     *testing.T
	rdb   *redis.Client
	model map[string]State
}

func newExactRig(t *testing.T) *exactRig {
	srv := redistest.Start(t)
	return &exactRig{t: t, rdb: srv.Client(t), model: map[string]State{}}
}

func (g *exactRig) step(where string, now int64, keys []string, takes []Take) Decision {
	g.t.Helper()
	got, vals, px, err := stepPX(context.Background(), g.rdb, now, keys, takes)
	if err != nil {
		g.t.Fatalf("%s: %v", where, err)
	}
	states := make([]State, len(keys))
	for i, k := range keys {
		st, ok := g.model[k]
		if !ok {
			st = takes[i].Spec.Full()
		}
		states[i] = st
	}
	charged := make([]bool, len(keys))
	want := Decide(now, takes, states, charged)
	for i, k := range keys {
		if charged[i] {
			g.model[k] = states[i]
		}
	}
	if !reflect.DeepEqual(got, want) {
		g.t.Fatalf("%s: lua %+v\nmodel %+v", where, got, want)
	}
	for i, k := range keys {
		wantVal := ""
		if st, ok := g.model[k]; ok {
			wantVal = EncodeState(st)
		}
		if vals[i] != wantVal {
			st, _ := DecodeState(vals[i])
			g.t.Fatalf("%s: %s holds %+v, model %+v", where, k, st, g.model[k])
		}
		checkPX(g.t, where, k, charged[i], px[i], got.Buckets[i].FullMS)
	}
	return got
}

// stored returns the state at key in Redis; ok is false for no key.
func (g *exactRig) stored(key string) (State, bool) {
	g.t.Helper()
	v, err := g.rdb.Get(context.Background(), key).Result()
	if err == redis.Nil {
		return State{}, false
	}
	if err != nil {
		g.t.Fatalf("GET %s: %v", key, err)
	}
	st, err := DecodeState(v)
	if err != nil {
		g.t.Fatalf("%s: %v", key, err)
	}
	return st, true
}

// expect requires key to hold want (ok: a key at all) in Redis, and makes
// it the model's state: the step after a settlement or a refund.
func (g *exactRig) expect(where, key string, want State, ok bool) {
	g.t.Helper()
	got, there := g.stored(key)
	if there != ok || got != want {
		g.t.Fatalf("%s: %s holds %+v (key: %v), want %+v (key: %v)", where, key, got, there, want, ok)
	}
	if ok {
		g.model[key] = want
	} else {
		delete(g.model, key)
	}
}

// setTTL gives key a TTL of ms milliseconds and returns its expiry
// (PEXPIRETIME, Unix ms), so that a settlement or refund can be seen to
// keep it exactly.
func (g *exactRig) setTTL(key string, ms int64) int64 {
	g.t.Helper()
	if err := g.rdb.PExpire(context.Background(), key, time.Duration(ms)*time.Millisecond).Err(); err != nil {
		g.t.Fatal(err)
	}
	return g.expiry(key)
}

// expiry returns key's PEXPIRETIME: its expiry in Unix ms, -1 for none,
// -2 for no key.
func (g *exactRig) expiry(key string) int64 {
	g.t.Helper()
	at, err := g.rdb.Do(context.Background(), "PEXPIRETIME", key).Int64()
	if err != nil {
		g.t.Fatalf("PEXPIRETIME %s: %v", key, err)
	}
	return at
}

// keptTTL requires key to expire exactly when it did (at, Unix ms).
func (g *exactRig) keptTTL(where, key string, at int64) {
	g.t.Helper()
	if got := g.expiry(key); got != at || at < 0 {
		g.t.Errorf("%s: %s expires at %d, want %d kept", where, key, got, at)
	}
}

// quotaTake is a take of cost from a quota of amount units in windows w.
func quotaTake(amount, cost int64, w Windows) Take {
	return Take{Spec: QuotaSpec(amount), Cost: cost, Window: &w}
}

// us returns an RFC 3339 instant in microseconds.
func us(t *testing.T, s string) int64 { return instant(t, s).UnixMicro() }

// allowedQuota is the decision of a request on one quota that allows it.
func allowedQuota(remaining, fullMS int64) Decision {
	return Decision{Allowed: true, Deciding: -1, Buckets: []Result{{Remaining: remaining, FullMS: fullMS}}}
}

// deniedQuota is the decision of a request on one full quota.
func deniedQuota(remaining, waitMS int64) Decision {
	return Decision{Reason: RateLimited, RetryAfterMS: waitMS, Deciding: 0,
		Buckets: []Result{{Remaining: remaining, Reason: RateLimited, RetryAfterMS: waitMS, FullMS: waitMS}}}
}

// TestQuotaMonthBoundary: a monthly quota of 100 in UTC, Redis's clock
// driven. A charge in the last microsecond of January counts in January
// (its key's TTL is the 1 ms rounded up to the end); at 00:00:00 on 1
// February the quota starts at 0 used, whether the gateway's windows were
// computed in January or February; a full quota's Retry-After is exactly
// the milliseconds until the window ends (rounded up), which is also its
// FullMS and the key's TTL; a cost above the amount is
// cost_exceeds_capacity and writes nothing. A Redis clock outside the
// gateway's windows uses the nearest, and one past them all waits 1 ms.
func TestQuotaMonthBoundary(t *testing.T) {
	g := newExactRig(t)
	const key = "quota:{m}"
	jan1, feb1, mar1 := us(t, "2026-01-01T00:00:00Z"), us(t, "2026-02-01T00:00:00Z"), us(t, "2026-03-01T00:00:00Z")
	lastJan := feb1 - 1
	wJan := WindowsAt(Month, time.UTC, time.UnixMicro(lastJan))
	q := func(cost int64, w Windows) []Take { return []Take{quotaTake(100, cost, w)} }
	k := []string{key}

	sameDecision(t, "30 in January's last µs", g.step("jan 30", lastJan, k, q(30, wJan)), allowedQuota(70, 1))
	g.expect("after 30", key, State{Units: 30, Scale: 1, Last: jan1}, true)
	sameDecision(t, "70 more", g.step("jan 70", lastJan, k, q(70, wJan)), allowedQuota(0, 1))
	g.expect("after 100", key, State{Units: 100, Scale: 1, Last: jan1}, true)
	d := g.step("jan full", lastJan, k, q(1, wJan))
	sameDecision(t, "January full", d, deniedQuota(0, 1))
	if s := d.RetryAfterSeconds(); s != 1 {
		t.Errorf("Retry-After %d s, want 1", s)
	}

	// 1 February, 00:00:00: February, at 0 used. The January key is
	// there (the probe keeps keys) but holds another window.
	const feb = 28 * 86_400_000 // ms in February 2026
	sameDecision(t, "peek at February's start", g.step("feb peek", feb1, k, q(0, wJan)), allowedQuota(100, feb))
	g.expect("a peek writes nothing", key, State{Units: 100, Scale: 1, Last: jan1}, true)
	sameDecision(t, "40 at February's start", g.step("feb 40", feb1, k, q(40, wJan)), allowedQuota(60, feb))
	g.expect("after February's 40", key, State{Units: 40, Scale: 1, Last: feb1}, true)

	// The gateway's own clock in February: the same window.
	wFeb := WindowsAt(Month, time.UTC, time.UnixMicro(feb1))
	if wFeb[1] != feb1 || wJan[2] != feb1 {
		t.Fatalf("windows %s and %s", fmtWindows(wJan), fmtWindows(wFeb))
	}
	mid := us(t, "2026-02-10T12:00:00.000400Z")
	untilMar := ceilDiv(mar1-mid, 1000) // 18.5 days less 400 µs, rounded up
	if untilMar != 1_598_400_000 {
		t.Fatalf("ms until March: %d", untilMar)
	}
	sameDecision(t, "20 on 10 February", g.step("feb 20", mid, k, q(20, wFeb)), allowedQuota(40, untilMar))
	d = g.step("feb 41", mid, k, q(41, wFeb))
	sameDecision(t, "41 of 40 left", d, deniedQuota(40, untilMar))
	if s := d.RetryAfterSeconds(); s != 1_598_400 {
		t.Errorf("Retry-After %d s, want 1598400", s)
	}
	g.expect("a denial writes nothing", key, State{Units: 60, Scale: 1, Last: feb1}, true)
	sameDecision(t, "the last 40", g.step("feb 40 more", mid, k, q(40, wFeb)), allowedQuota(0, untilMar))
	sameDecision(t, "full, a µs before March", g.step("feb end", mar1-1, k, q(1, wFeb)), deniedQuota(0, 1))

	// A cost above the amount: no wait helps, nothing written.
	d = g.step("101 in March", mar1, k, q(101, wFeb))
	sameDecision(t, "101 of 100", d, Decision{Reason: CostExceedsCapacity, Deciding: 0,
		Buckets: []Result{{Remaining: 100, Reason: CostExceedsCapacity, FullMS: 31 * 86_400_000}}})
	g.expect("cost_exceeds_capacity writes nothing", key, State{Units: 100, Scale: 1, Last: feb1}, true)
	sameDecision(t, "exactly 100 in March", g.step("100 in March", mar1, k, q(100, wFeb)), allowedQuota(0, 31*86_400_000))
	g.expect("March charged", key, State{Units: 100, Scale: 1, Last: mar1}, true)

	// Redis's clock five days past the gateway's last window (its clock a
	// month behind): the nearest window, February, which has ended. Its
	// FullMS and its wait are the least, 1 ms; full, it denies.
	const late = "quota:{m}:late"
	later := mar1 + 5*86_400_000_000
	sameDecision(t, "past the windows", g.step("late 100", later, []string{late}, q(100, wJan)), allowedQuota(0, 1))
	g.expect("charged in February", late, State{Units: 100, Scale: 1, Last: feb1}, true)
	sameDecision(t, "past the windows, full", g.step("late 1", later, []string{late}, q(1, wJan)), deniedQuota(0, 1))
	// And before them (its clock a month ahead): the first, December.
	dec1 := us(t, "2025-12-01T00:00:00Z")
	early := dec1 - 86_400_000_000
	sameDecision(t, "before the windows", g.step("early 60", early, []string{late}, q(60, wJan)), allowedQuota(40, (jan1-early)/1000))
	g.expect("charged in December", late, State{Units: 60, Scale: 1, Last: dec1}, true)
}

// TestQuotaDSTDays: a daily quota of 10 in New York across the 23-hour
// day (2026-03-08) and the 25-hour day (2026-11-01): each day's window,
// FullMS, PTTL and Retry-After are its own length, to the millisecond.
func TestQuotaDSTDays(t *testing.T) {
	g := newExactRig(t)
	ny := zone(t, "America/New_York")
	const h = 3_600_000 // ms
	q := func(cost int64, w Windows) []Take { return []Take{quotaTake(10, cost, w)} }

	t.Run("23h", func(t *testing.T) {
		k := []string{"quota:{ny}:mar"}
		start, next := us(t, "2026-03-08T05:00:00Z"), us(t, "2026-03-09T04:00:00Z")
		w := WindowsAt(Day, ny, time.UnixMicro(start))
		sameDecision(t, "4 at midnight EST", g.step("4", start, k, q(4, w)), allowedQuota(6, 23*h))
		g.expect("4 used", k[0], State{Units: 4, Scale: 1, Last: start}, true)
		noon := us(t, "2026-03-08T12:00:00-04:00")
		sameDecision(t, "6 at noon EDT", g.step("6", noon, k, q(6, w)), allowedQuota(0, 12*h))
		sameDecision(t, "1 more at noon", g.step("1", noon, k, q(1, w)), deniedQuota(0, 12*h))
		sameDecision(t, "the day's last µs", g.step("last", next-1, k, q(1, w)), deniedQuota(0, 1))
		sameDecision(t, "the next midnight (EDT)", g.step("next", next, k, q(3, w)), allowedQuota(7, 24*h))
		g.expect("the next day", k[0], State{Units: 3, Scale: 1, Last: next}, true)
	})

	t.Run("25h", func(t *testing.T) {
		k := []string{"quota:{ny}:nov"}
		start, next := us(t, "2026-11-01T04:00:00Z"), us(t, "2026-11-02T05:00:00Z")
		w := WindowsAt(Day, ny, time.UnixMicro(start))
		sameDecision(t, "10 at midnight EDT", g.step("10", start, k, q(10, w)), allowedQuota(0, 25*h))
		// 24 hours on: a 24-hour day would have ended; this one has an hour left.
		sameDecision(t, "24 h later", g.step("24h", start+24*h*1000, k, q(1, w)), deniedQuota(0, h))
		sameDecision(t, "23:30 EST", g.step("23:30", us(t, "2026-11-01T23:30:00-05:00"), k, q(1, w)), deniedQuota(0, h/2))
		sameDecision(t, "the next midnight (EST)", g.step("next", next, k, q(1, w)), allowedQuota(9, 24*h))
		g.expect("the next day", k[0], State{Units: 1, Scale: 1, Last: next}, true)
	})

	// A weekly quota across the 167-hour week in Berlin.
	t.Run("berlin_167h_week", func(t *testing.T) {
		berlin := zone(t, "Europe/Berlin")
		k := []string{"quota:{berlin}:week"}
		start, next := us(t, "2026-03-22T23:00:00Z"), us(t, "2026-03-29T22:00:00Z")
		w := WindowsAt(Week, berlin, time.UnixMicro(start))
		sameDecision(t, "10 on Monday", g.step("10", start, k, q(10, w)), allowedQuota(0, 167*h))
		sameDecision(t, "the week's last µs", g.step("last", next-1, k, q(1, w)), deniedQuota(0, 1))
		sameDecision(t, "the next Monday, 167 h on", g.step("next", next, k, q(1, w)), allowedQuota(9, 168*h))
		g.expect("the next week", k[0], State{Units: 1, Scale: 1, Last: next}, true)
	})
}

// TestQuotaKeyExpires: a charged quota key expires when its window ends:
// its TTL is the milliseconds left, rounded up. Through Redis.Take (the
// production script, clock driven, keys not persisted), a charge in a
// window's last 0.4 ms sets a TTL of 1 ms and Redis drops the key; a
// charge with 10 s left sets a PTTL of 10 s.
func TestQuotaKeyExpires(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	clock := &drivenClock{rdb: rdb}
	store := Redis{Client: clock}
	end := us(t, "2026-07-01T00:00:00Z")
	w := WindowsAt(Month, time.UTC, time.UnixMicro(end-1))

	clock.now = end - 10_000_000
	d, err := store.Take(ctx, []string{"quota:{e}:10s"}, []Take{quotaTake(5, 2, w)})
	if err != nil {
		t.Fatal(err)
	}
	sameDecision(t, "10 s before the end", d, allowedQuota(3, 10_000))
	if p := rdb.PTTL(ctx, "quota:{e}:10s").Val().Milliseconds(); p > 10_000 || p < 10_000-ttlSlackMS {
		t.Errorf("PTTL %d ms, want 10000", p)
	}

	clock.now = end - 400
	d, err = store.Take(ctx, []string{"quota:{e}:last"}, []Take{quotaTake(5, 5, w)})
	if err != nil {
		t.Fatal(err)
	}
	sameDecision(t, "400 µs before the end", d, allowedQuota(0, 1))
	// Waiting on Redis's own expiry of a 1 ms TTL, not timing a result.
	redistest.WaitFor(t, 2*time.Second, "the quota key to expire", func() error {
		if n := rdb.Exists(ctx, "quota:{e}:last").Val(); n != 0 {
			return fmt.Errorf("%d keys", n)
		}
		return nil
	})
}

// TestQuotaAllOrNothing: a quota and a token bucket in one request are
// charged together or not at all: a full quota denies and leaves the
// bucket uncharged; a bucket that denies leaves the quota uncharged; a
// cost above the quota's amount denies with cost_exceeds_capacity and no
// wait; a shadow quota that denies neither denies nor is charged.
func TestQuotaAllOrNothing(t *testing.T) {
	g := newExactRig(t)
	now := us(t, "2026-05-20T10:00:00Z")
	w := WindowsAt(Day, time.UTC, time.UnixMicro(now))
	const left = 14 * 3_600_000 // ms until 2026-05-21T00:00Z
	day := w[1]
	b := shSpec(t, 2) // 1/h

	// A full quota denies: the bucket is not charged.
	g.step("fill q1", now, []string{"aon:{1}:q"}, []Take{quotaTake(5, 5, w)})
	d := g.step("quota full", now, []string{"aon:{1}:b", "aon:{1}:q"}, []Take{{Spec: b, Cost: 1}, quotaTake(5, 1, w)})
	sameDecision(t, "denied by the quota", d, Decision{Reason: RateLimited, RetryAfterMS: left, Deciding: 1, Buckets: []Result{
		{Remaining: 2},
		{Remaining: 0, Reason: RateLimited, RetryAfterMS: left, FullMS: left},
	}})
	g.expect("bucket", "aon:{1}:b", State{}, false)

	// A bucket that denies: the quota is not charged.
	g.step("drain b2", now, []string{"aon:{2}:b"}, []Take{{Spec: b, Cost: 2}})
	d = g.step("bucket empty", now, []string{"aon:{2}:b", "aon:{2}:q"}, []Take{{Spec: b, Cost: 1}, quotaTake(5, 3, w)})
	sameDecision(t, "denied by the bucket", d, Decision{Reason: RateLimited, RetryAfterMS: 3_600_000, Deciding: 0, Buckets: []Result{
		{Remaining: 0, Reason: RateLimited, RetryAfterMS: 3_600_000, FullMS: 7_200_000},
		{Remaining: 5, FullMS: left},
	}})
	g.expect("quota", "aon:{2}:q", State{}, false)

	// Both allow: both charged.
	d = g.step("both", now, []string{"aon:{3}:b", "aon:{3}:q"}, []Take{{Spec: b, Cost: 1}, quotaTake(5, 3, w)})
	sameDecision(t, "both allow", d, Decision{Allowed: true, Deciding: -1, Buckets: []Result{
		{Remaining: 1, FullMS: 3_600_000},
		{Remaining: 2, FullMS: left},
	}})
	g.expect("quota charged", "aon:{3}:q", State{Units: 3, Scale: 1, Last: day}, true)
	g.expect("bucket charged", "aon:{3}:b", State{Units: hourTokens, Scale: hourTokens, Last: now}, true)

	// The quota's cost above its amount: no wait, nothing charged.
	d = g.step("6 of 5", now, []string{"aon:{3}:b", "aon:{3}:q"}, []Take{{Spec: b, Cost: 1}, quotaTake(5, 6, w)})
	sameDecision(t, "cost_exceeds_capacity", d, Decision{Reason: CostExceedsCapacity, Deciding: 1, Buckets: []Result{
		{Remaining: 1, FullMS: 3_600_000},
		{Remaining: 2, Reason: CostExceedsCapacity, FullMS: left},
	}})
	g.expect("bucket uncharged", "aon:{3}:b", State{Units: hourTokens, Scale: hourTokens, Last: now}, true)
	g.expect("quota uncharged", "aon:{3}:q", State{Units: 3, Scale: 1, Last: day}, true)
	// The bucket denies too: cost_exceeds_capacity still decides, with no wait.
	d = g.step("6 of 5, 2 of 1", now, []string{"aon:{3}:b", "aon:{3}:q"}, []Take{{Spec: b, Cost: 2}, quotaTake(5, 6, w)})
	if d.Allowed || d.Reason != CostExceedsCapacity || d.RetryAfterMS != 0 || d.Deciding != 1 {
		t.Errorf("cost_exceeds_capacity over rate_limit_exceeded: %+v", d)
	}

	// A full shadow quota: the request is allowed, the quota not charged.
	d = g.step("shadow", now, []string{"aon:{1}:b", "aon:{1}:q"}, []Take{{Spec: b, Cost: 1}, {Spec: QuotaSpec(5), Cost: 1, Window: &w, Shadow: true}})
	sameDecision(t, "shadow quota denies", d, Decision{Allowed: true, Deciding: -1, ShadowDenied: true, Buckets: []Result{
		{Remaining: 1, FullMS: 3_600_000},
		{Remaining: 0, Reason: RateLimited, RetryAfterMS: left, FullMS: left, Shadow: true},
	}})
	g.expect("shadow quota uncharged", "aon:{1}:q", State{Units: 5, Scale: 1, Last: day}, true)
}

// TestQuotaSettle: Redis.Settle on a monthly quota changes its units used
// by the delta, between 0 and two amounts, only while the key holds the
// window the request was charged in (found by Windows.ChargedIn from the
// decision), and keeps the key's TTL; once the quota has reset, or its key
// is gone, a settlement changes nothing. A settlement is applied once per
// request id. Redis's clock is driven (the quota path does not read it;
// the token bucket settled with a quota does).
func TestQuotaSettle(t *testing.T) {
	g := newExactRig(t)
	ctx := context.Background()
	const key = "settle:{q}"
	q := QuotaSpec(100)
	feb1, mar1, apr1 := us(t, "2026-02-01T00:00:00Z"), us(t, "2026-03-01T00:00:00Z"), us(t, "2026-04-01T00:00:00Z")
	gw := us(t, "2026-02-10T00:00:00Z")
	w := WindowsAt(Month, time.UTC, time.UnixMicro(gw))
	redisNow := gw + 1_234_567 // Redis's clock a little ahead of the gateway's
	d := g.step("charge 40", redisNow, []string{key}, []Take{{Spec: q, Cost: 40, Window: &w}})
	if !d.Allowed || d.Buckets[0].Remaining != 60 {
		t.Fatalf("charge: %+v", d)
	}
	charged, chargedEnd := w.ChargedIn(gw, d.Buckets[0].FullMS)
	if charged != feb1 || chargedEnd != mar1 {
		t.Fatalf("ChargedIn = %d, %d; want February (%d, %d)", charged, chargedEnd, feb1, mar1)
	}
	expires := g.setTTL(key, 123_456_789)
	store := Redis{Client: &drivenClock{rdb: g.rdb, now: redisNow}}

	settle := func(id string, delta, window int64) bool {
		t.Helper()
		end := w[slices.Index(w[:], window)+1]
		ok, err := store.Settle(ctx, id, []string{key}, []Adjust{{Spec: q, Delta: delta, Window: window, WindowEnd: end}})
		if err != nil {
			t.Fatalf("settle %s: %v", id, err)
		}
		return ok
	}
	used := func(where string, n, window int64) {
		t.Helper()
		g.expect(where, key, State{Units: n, Scale: 1, Last: window}, true)
	}
	for i, c := range []struct {
		delta, want int64
	}{
		{25, 65},     // more used than estimated
		{-30, 35},    // less
		{-1000, 0},   // never below 0
		{1000, 200},  // the delta is bounded to two amounts, and so is the use
		{-150, 50},   // back from the bound exactly
		{150, 200},   // to the bound again
		{-200, 0},    // two amounts down
		{0, 0},       // nothing
		{100, 100},   // exactly the amount
		{-60, 40},    // and back to what was charged
		{1_000, 200}, // the bound again
	} {
		if !settle(fmt.Sprint("r", i), c.delta, charged) {
			t.Fatalf("settlement %d not applied", i)
		}
		used(fmt.Sprintf("settle %+d", c.delta), c.want, feb1)
		g.keptTTL(fmt.Sprintf("settle %+d", c.delta), key, expires)
	}
	// Over the amount: the quota reports the overdraft and denies until
	// the window ends.
	sameDecision(t, "200 used of 100", g.step("peek", redisNow, []string{key}, []Take{{Spec: q, Window: &w}}),
		deniedQuota(-100, ceilDiv(mar1-redisNow, 1000)))
	expires = g.setTTL(key, 123_456_789) // the probe persisted the key

	// The same request id again: nothing.
	if settle("r0", -100, charged) {
		t.Error("a second settlement of r0 was applied")
	}
	used("repeated id", 200, feb1)
	settle("r-back", -200, charged)
	used("back to 0", 0, feb1)

	// Another window than the key's: nothing, though the id is new.
	if !settle("jan", 50, w[0]) {
		t.Error("settlement for January not run")
	}
	used("January's settlement", 0, feb1)
	g.keptTTL("January's settlement", key, expires)

	// The quota reset: March's key. February's settlement changes nothing.
	sameDecision(t, "March", g.step("march", mar1, []string{key}, []Take{{Spec: q, Cost: 5, Window: &w}}), allowedQuota(95, 31*86_400_000))
	settle("after reset", 30, charged)
	used("after the reset", 5, mar1)
	// March's own settlement applies.
	settle("march", 30, mar1)
	used("March settled", 35, mar1)

	// The key gone: a refund creates nothing; a charge made before the
	// window ends starts the window's count, with the window's TTL (a
	// request charged nothing wrote no key, and its usage counts).
	if err := g.rdb.Del(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	settle("gone", -30, mar1)
	g.expect("refund to a gone key", key, State{}, false)
	settle("gone-charge", 30, mar1)
	used("charge to a gone key", 30, mar1)
	// Set to the rest of March on the driven clock; read a moment later.
	if ttl, want := g.rdb.PTTL(ctx, key).Val(), time.Duration(ceilDiv(apr1-redisNow, 1000))*time.Millisecond; ttl > want || ttl < want-time.Second {
		t.Errorf("charge to a gone key: TTL %v, want the rest of March, %v", ttl, want)
	}
	// Once the window has ended, a charge to a gone key creates nothing.
	if err := g.rdb.Del(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	late := Redis{Client: &drivenClock{rdb: g.rdb, now: mar1}}
	if ok, err := late.Settle(ctx, "late", []string{key}, []Adjust{{Spec: q, Delta: 30, Window: feb1, WindowEnd: mar1}}); err != nil || !ok {
		t.Fatalf("late settlement: %v %v", ok, err)
	}
	g.expect("charge after the window ended", key, State{}, false)

	// A quota and a token bucket settled in one call.
	b := shSpec(t, 10)
	kb, kq := "settle:{q}:b", "settle:{q}:q"
	g.step("both", redisNow, []string{kb, kq}, []Take{{Spec: b, Cost: 1}, {Spec: q, Cost: 10, Window: &w}})
	if ok, err := store.Settle(ctx, "both", []string{kb, kq}, []Adjust{{Spec: b, Delta: 3}, {Spec: q, Delta: 7, Window: feb1, WindowEnd: mar1}}); err != nil || !ok {
		t.Fatalf("settle both: %v %v", ok, err)
	}
	g.expect("quota settled with a bucket", kq, State{Units: 17, Scale: 1, Last: feb1}, true)
	g.expect("bucket settled with a quota", kb, State{Units: 6 * hourTokens, Scale: hourTokens, Last: redisNow}, true)
}

// TestQuotaRefund: Redis.Refund (Redis's clock driven) gives a quota's
// cost back in the window that holds Redis's clock, when its key holds
// that window, never below 0 used, keeping the TTL; in another window, or
// with no key, it gives nothing and writes nothing. It picks the window
// by Redis's clock whatever the gateway's windows. A token bucket in the
// same call is refunded too.
func TestQuotaRefund(t *testing.T) {
	g := newExactRig(t)
	ctx := context.Background()
	clock := &drivenClock{rdb: g.rdb}
	store := Redis{Client: clock}
	const key = "refund:{q}"
	feb1, mar1 := us(t, "2026-02-01T00:00:00Z"), us(t, "2026-03-01T00:00:00Z")
	now := us(t, "2026-02-10T12:00:00Z")
	w := WindowsAt(Month, time.UTC, time.UnixMicro(now))
	take := func(cost int64, w Windows) []Take { return []Take{quotaTake(100, cost, w)} }
	g.step("charge 40", now, []string{key}, take(40, w))
	expires := g.setTTL(key, 987_654_321)

	refund := func(at int64, keys []string, takes []Take) int64 {
		t.Helper()
		clock.now = at
		n, err := store.Refund(ctx, keys, takes)
		if err != nil {
			t.Fatalf("refund at %d: %v", at, err)
		}
		return n
	}
	if n := refund(now, []string{key}, take(15, w)); n != 1 {
		t.Errorf("refund of 15: %d refunded, want 1", n)
	}
	g.expect("15 back", key, State{Units: 25, Scale: 1, Last: feb1}, true)
	g.keptTTL("15 back", key, expires)
	if n := refund(now, []string{key}, take(100, w)); n != 1 {
		t.Errorf("refund of 100: %d refunded, want 1", n)
	}
	g.expect("never below 0", key, State{Units: 0, Scale: 1, Last: feb1}, true)
	g.keptTTL("never below 0", key, expires)

	g.step("charge 30", now, []string{key}, take(30, w))
	// March: the key holds February; nothing to give back.
	if n := refund(mar1, []string{key}, take(10, w)); n != 0 {
		t.Errorf("refund in March: %d refunded, want 0", n)
	}
	g.expect("a refund in another window", key, State{Units: 30, Scale: 1, Last: feb1}, true)
	// February's last microsecond, with the gateway's windows from January
	// (its clock behind): Redis's clock picks February.
	wJan := WindowsAt(Month, time.UTC, time.UnixMicro(feb1-1))
	if n := refund(mar1-1, []string{key}, take(5, wJan)); n != 1 {
		t.Errorf("refund at February's end: %d refunded, want 1", n)
	}
	g.expect("refund at February's end", key, State{Units: 25, Scale: 1, Last: feb1}, true)
	// Before February (Redis behind the gateway): January, not this key's.
	if n := refund(feb1-1, []string{key}, take(5, w)); n != 0 {
		t.Errorf("refund in January: %d refunded, want 0", n)
	}
	g.expect("refund in January", key, State{Units: 25, Scale: 1, Last: feb1}, true)
	// A cost of 0: nothing.
	if n := refund(now, []string{key}, take(0, w)); n != 0 {
		t.Errorf("refund of 0: %d refunded, want 0", n)
	}

	// No key: nothing created.
	if n := refund(now, []string{"refund:{q}:none"}, take(5, w)); n != 0 {
		t.Errorf("refund of no key: %d refunded, want 0", n)
	}
	g.expect("no key", "refund:{q}:none", State{}, false)

	// A quota and a token bucket charged together, refunded together: the
	// bucket back to full is deleted.
	b := shSpec(t, 10)
	keys := []string{"refund:{q}:b", key}
	takes := []Take{{Spec: b, Cost: 4}, quotaTake(100, 20, w)}
	g.step("both", now, keys, takes)
	g.expect("quota charged", key, State{Units: 45, Scale: 1, Last: feb1}, true)
	if n := refund(now+5_000_000, keys, takes); n != 2 {
		t.Errorf("refund of both: %d refunded, want 2", n)
	}
	g.expect("quota back", key, State{Units: 25, Scale: 1, Last: feb1}, true)
	g.expect("bucket back to full", keys[0], State{}, false)
}

// fiveAt is the Spec of a bucket of 5 tokens refilled at rate.
func fiveAt(t *testing.T, rate string) Spec {
	t.Helper()
	r, err := ParseRate(rate)
	if err != nil {
		t.Fatal(err)
	}
	s, err := Limit{Capacity: 5, Rate: r}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestUnchargedKeyLivesUntilFull: a bucket written under a fast limit (5
// tokens, 5 a second: full again within a second, so its key lives a
// second) and then read under a slower one (5 tokens, 1 every 10 minutes:
// a demotion's penalty tier, a tier change, a reload) that denies keeps
// its key until it is full under the slower limit. It used to expire
// after the fast limit's second, into a full bucket the slow limit would
// not have refilled for 50 minutes.
func TestUnchargedKeyLivesUntilFull(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	fast, slow := fiveAt(t, "5/s"), fiveAt(t, "1/10m")
	for _, store := range []struct {
		name string
		s    Redis
	}{{"script", Redis{Client: rdb}}, {"batched", Redis{Client: NewBatched(rdb, BatchOptions{})}}} {
		t.Run(store.name, func(t *testing.T) {
			key := "ttl:{" + store.name + "}"
			if d, err := store.s.Take(ctx, []string{key}, []Take{{Spec: fast, Cost: 5}}); err != nil || !d.Allowed {
				t.Fatalf("fast take: %+v, %v", d, err)
			}
			if ms := pttl(t, rdb, key); ms > 1000 {
				t.Fatalf("after the fast take the key lives %d ms, want at most 1000", ms)
			}
			d, err := store.s.Take(ctx, []string{key}, []Take{{Spec: slow, Cost: 1}})
			if err != nil || d.Allowed {
				t.Fatalf("slow take: %+v, %v; want denied", d, err)
			}
			// Full under the slow limit in 50 minutes, less the little
			// the fast take's few milliseconds left refilled.
			if ms, full := pttl(t, rdb, key), d.Buckets[0].FullMS; ms < full-100 || ms > full || full < 2_999_000 {
				t.Errorf("after the slow denial the key lives %d ms, want its FullMS %d (about 3000000)", ms, full)
			}
		})
	}
}

// TestDemotionKeepsPenaltyBucketsUntilFull: the denial that demotes an
// identity raises the TTL of its penalty tier's buckets (the same key) to
// their time until full under the penalty limit, so that a client that
// waits out the own tier's Retry-After does not come back to an expired,
// full bucket. It used to keep the own tier's TTL, a second at 5 a second.
func TestDemotionKeepsPenaltyBucketsUntilFull(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	own, penalty := fiveAt(t, "5/s"), fiveAt(t, "1/10m")
	st := Redis{Client: rdb}
	const marker, counter, key = "dt:{u}:demoted", "dt:{u}:denials", "dt:{u}"
	rule := DemoteRule{Denials: 1, Window: time.Minute, Span: time.Minute}
	keys := []string{key}
	take := func(cost int64) (Decision, Demotion) {
		t.Helper()
		d, state, _, err := st.TakeDemote(ctx, marker, counter, rule, keys, []Take{{Spec: own, Cost: cost}}, keys, []Take{{Spec: penalty, Cost: cost}})
		if err != nil {
			t.Fatal(err)
		}
		return d, state
	}
	if d, state := take(5); !d.Allowed || state != NotDemoted {
		t.Fatalf("first request: %+v, state %d", d, state)
	}
	if ms := pttl(t, rdb, key); ms > 1000 {
		t.Fatalf("after the own tier's charge the key lives %d ms, want at most 1000", ms)
	}
	if d, state := take(1); d.Allowed || state != DemotedNow {
		t.Fatalf("second request: %+v, state %d; want denied and demoted", d, state)
	}
	// 5 tokens at 1 every 10 minutes: full in 50 minutes, less the little
	// that refilled since the first request.
	if ms := pttl(t, rdb, key); ms < 2_990_000 || ms > 3_000_000 {
		t.Errorf("after the demotion the key lives %d ms, want the penalty limit's time until full, about 3000000", ms)
	}

	// A key only the penalty tier reads, holding what no bucket holds,
	// does not undo the demotion: it is skipped when the TTLs are raised.
	const bad, marker2, counter2, key2 = "dt:{v}:bad", "dt:{v}:demoted", "dt:{v}:denials", "dt:{v}"
	if err := rdb.Set(ctx, bad, "garbage", 0).Err(); err != nil {
		t.Fatal(err)
	}
	take2 := func(cost int64) (Demotion, error) {
		_, state, _, err := st.TakeDemote(ctx, marker2, counter2, rule, []string{key2}, []Take{{Spec: own, Cost: cost}},
			[]string{key2, bad}, []Take{{Spec: penalty, Cost: cost}, {Spec: penalty, Cost: cost}})
		return state, err
	}
	if state, err := take2(5); err != nil || state != NotDemoted {
		t.Fatalf("first request: state %d, %v", state, err)
	}
	if state, err := take2(1); err != nil || state != DemotedNow {
		t.Fatalf("second request with a malformed penalty key: state %d, %v; want demoted, no error", state, err)
	}
	if ms := pttl(t, rdb, key2); ms < 2_990_000 {
		t.Errorf("the readable penalty bucket lives %d ms, want about 3000000", ms)
	}
}
