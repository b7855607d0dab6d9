package bucket

import (
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/lua"
)

// vectorsPath is the repository's copy of the shared test vectors. When
// TOKEN_BUCKET_VECTORS names another file (a newer shared copy), that one is
// run instead.
const vectorsPath = "testdata/bucket_vectors.json"

type vectorFile struct {
	Cases []vectorCase `json:"cases"`
}

type vectorCase struct {
	Name    string `json:"name"`
	Buckets []struct {
		Capacity      int64  `json:"capacity"`
		RefillAmount  string `json:"refill_amount"`
		RefillPeriodS string `json:"refill_period_s"`
	} `json:"buckets"`
	Steps []struct {
		T      string  `json:"t"`
		Costs  []int64 `json:"costs"`
		Expect struct {
			Allowed      bool   `json:"allowed"`
			Reason       string `json:"reason"`
			RetryAfterMS *int64 `json:"retry_after_ms"`
			RetryAfterS  *int64 `json:"retry_after_s"`
			Buckets      []struct {
				Remaining    int64  `json:"remaining"`
				Denies       bool   `json:"denies"`
				Reason       string `json:"reason"`
				RetryAfterMS *int64 `json:"retry_after_ms"`
				TTLMS        *int64 `json:"ttl_ms"`
			} `json:"buckets"`
		} `json:"expect"`
	} `json:"steps"`
}

func loadVectors(t *testing.T) []vectorCase {
	t.Helper()
	path := filepath.FromSlash(vectorsPath)
	if p := os.Getenv("TOKEN_BUCKET_VECTORS"); p != "" {
		path = p
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading test vectors: %v", err)
	}
	// The repository's copy must be the shared file, where that is present
	// (it is beside the repository in CI).
	if shared, err := os.ReadFile(filepath.FromSlash("../../shared/testdata/bucket_vectors.json")); err == nil && path == vectorsPath && string(shared) != string(raw) {
		t.Fatalf("%s differs from ../shared/testdata/bucket_vectors.json: copy the shared file", vectorsPath)
	}
	var f vectorFile
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatalf("parsing test vectors: %v", err)
	}
	if len(f.Cases) == 0 {
		t.Fatal("no test vectors")
	}
	return f.Cases
}

// baseTime is the Redis clock at a case's t = 0, in microseconds: a date in
// 2024, so the times are of the size the real clock gives.
const baseTime int64 = 1_717_000_000_000_000

// micros converts a decimal number of seconds to microseconds, exactly.
func micros(t *testing.T, s string) int64 {
	r, ok := new(big.Rat).SetString(s)
	if !ok {
		t.Fatalf("bad time %q", s)
	}
	r.Mul(r, big.NewRat(1_000_000, 1))
	if !r.IsInt() {
		t.Fatalf("time %q is not a whole number of microseconds", s)
	}
	return r.Num().Int64()
}

func (c vectorCase) specs(t *testing.T) []Spec {
	specs := make([]Spec, len(c.Buckets))
	for i, b := range c.Buckets {
		rate, err := ParseRate(b.RefillAmount + "/" + b.RefillPeriodS + "s")
		if err != nil {
			t.Fatalf("%s: bucket %d: %v", c.Name, i, err)
		}
		if specs[i], err = (Limit{Capacity: b.Capacity, Rate: rate}).Spec(); err != nil {
			t.Fatalf("%s: bucket %d: %v", c.Name, i, err)
		}
	}
	return specs
}

// checkStep compares a decision with a step's expectation; charged says
// which buckets were written.
func checkStep(t *testing.T, where string, c vectorCase, step int, d Decision, charged []bool) {
	t.Helper()
	e := c.Steps[step].Expect
	if d.Allowed != e.Allowed {
		t.Errorf("%s: allowed = %v, want %v", where, d.Allowed, e.Allowed)
	}
	if !e.Allowed {
		if got := d.Reason.String(); got != e.Reason {
			t.Errorf("%s: reason = %q, want %q", where, got, e.Reason)
		}
		if e.RetryAfterMS == nil {
			if d.RetryAfterMS != 0 {
				t.Errorf("%s: retry_after_ms = %d, want none", where, d.RetryAfterMS)
			}
		} else if d.RetryAfterMS != *e.RetryAfterMS {
			t.Errorf("%s: retry_after_ms = %d, want %d", where, d.RetryAfterMS, *e.RetryAfterMS)
		}
		// Retry-After, in whole seconds: only a denial that a wait
		// serves (rate_limited) has one; cost_exceeds_capacity has none.
		var gotS *int64
		if d.Reason == RateLimited {
			s := d.RetryAfterSeconds()
			gotS = &s
		}
		if (gotS == nil) != (e.RetryAfterS == nil) || gotS != nil && *gotS != *e.RetryAfterS {
			t.Errorf("%s: retry_after_s = %v, want %v", where, fmtPtr(gotS), fmtPtr(e.RetryAfterS))
		}
	}
	for i, eb := range e.Buckets {
		b := d.Buckets[i]
		if b.Remaining != eb.Remaining {
			t.Errorf("%s: bucket %d: remaining = %d, want %d", where, i, b.Remaining, eb.Remaining)
		}
		if denies := b.Reason != Allowed; denies != eb.Denies {
			t.Errorf("%s: bucket %d: denies = %v, want %v", where, i, denies, eb.Denies)
		}
		if eb.Denies {
			if b.Reason.String() != eb.Reason {
				t.Errorf("%s: bucket %d: reason = %q, want %q", where, i, b.Reason, eb.Reason)
			}
			want := int64(0)
			if eb.RetryAfterMS != nil {
				want = *eb.RetryAfterMS
			}
			if b.RetryAfterMS != want {
				t.Errorf("%s: bucket %d: retry_after_ms = %d, want %d", where, i, b.RetryAfterMS, want)
			}
		}
		if e.Allowed {
			if eb.TTLMS == nil {
				if charged[i] {
					t.Errorf("%s: bucket %d: written, want nothing written", where, i)
				}
			} else if !charged[i] || b.FullMS != *eb.TTLMS {
				t.Errorf("%s: bucket %d: written %v with ttl_ms %d, want ttl_ms %d", where, i, charged[i], b.FullMS, *eb.TTLMS)
			}
		} else if charged[i] {
			t.Errorf("%s: bucket %d: written on a denial", where, i)
		}
	}
}

func fmtPtr(p *int64) string {
	if p == nil {
		return "none"
	}
	return strconv.FormatInt(*p, 10)
}

// TestVectorsModel runs every shared vector against the Go model.
func TestVectorsModel(t *testing.T) {
	for _, c := range loadVectors(t) {
		t.Run(c.Name, func(t *testing.T) {
			specs := c.specs(t)
			states := make([]State, len(specs))
			for i, s := range specs {
				states[i] = s.Full()
			}
			for k, step := range c.Steps {
				takes := make([]Take, len(specs))
				for i := range specs {
					takes[i] = Take{Spec: specs[i], Cost: step.Costs[i]}
				}
				scratch := append([]State(nil), states...)
				charged := make([]bool, len(specs))
				d := Decide(baseTime+micros(t, step.T), takes, scratch, charged)
				checkStep(t, fmt.Sprintf("step %d (t=%s)", k, step.T), c, k, d, charged)
				for i := range states {
					if charged[i] {
						states[i] = scratch[i]
					}
				}
			}
		})
	}
}

// probeScript is the production script with two test-only changes: its one
// clock line reads the last two ARGV (seconds, microseconds), so the test
// drives Redis time; and before returning it appends each key's value and
// PTTL and PERSISTs the key. Keys expire in real time while the test drives
// the script's clock, so without PERSIST a short TTL could lapse between
// steps; inside one script Redis's clock stands still, so nothing expires
// between the decision and the reads.
var probeScript = redis.NewScript(strings.Replace(strings.Replace(lua.Source, lua.ClockLine,
	"local clock = {ARGV[#ARGV - 1], ARGV[#ARGV]}", 1),
	"\nreturn reply\n", `
if type(reply) ~= 'table' then return reply end
for i = 1, #KEYS do
  reply[#reply + 1] = redis.call('GET', KEYS[i]) or ''
  reply[#reply + 1] = redis.call('PTTL', KEYS[i])
  redis.call('PERSIST', KEYS[i])
end
return reply
`, 1))

// ttlSlackMS is how far PTTL may trail the TTL set: PTTL reads Redis's live
// clock, which ticks while the script runs and until PTTL arrives (on a
// 2-core machine running the other packages' tests, tens of
// milliseconds).
const ttlSlackMS = 250

// stepAt runs the probe script at now (microseconds) and returns the
// decision with each key's value ("" when absent) and PTTL in ms.
func stepAt(ctx context.Context, c *redis.Client, now int64, keys []string, takes []Take) (d Decision, vals []string, pttls []int64, err error) {
	return runProbe(ctx, c, probeScript, now, keys, takes)
}

// runProbe runs probe, a copy of the decision script with its clock at
// now (microseconds) that replies the decision followed by two values per
// key: the key's value and a figure of its TTL. It returns the decision,
// each key's value ("" when absent) and each figure.
func runProbe(ctx context.Context, c *redis.Client, probe *redis.Script, now int64, keys []string, takes []Take) (d Decision, vals []string, figs []int64, err error) {
	args := append(appendArgs(nil, takes), now/1_000_000, now%1_000_000)
	raw, err := probe.Run(ctx, c, keys, args...).Slice()
	if err != nil {
		return d, nil, nil, err
	}
	n := 3 * len(takes)
	if len(raw) != n+2*len(keys) {
		return d, nil, nil, fmt.Errorf("probe reply has %d values", len(raw))
	}
	reply := make([]int64, n)
	for i := range reply {
		reply[i], _ = raw[i].(int64)
	}
	if d, err = ParseReply(reply, takes); err != nil {
		return d, nil, nil, err
	}
	for i := range keys {
		v, _ := raw[n+2*i].(string)
		fig, _ := raw[n+2*i+1].(int64)
		vals, figs = append(vals, v), append(figs, fig)
	}
	return d, vals, figs, nil
}

// TestVectorsLua runs every shared vector against the Lua script in a real
// Redis, with the script's clock driven by the test, and checks the stored
// state and its TTL after every step.
func TestVectorsLua(t *testing.T) {
	if !strings.Contains(lua.Source, lua.ClockLine) {
		t.Fatal("lua.ClockLine is not in the script")
	}
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	for n, c := range loadVectors(t) {
		t.Run(c.Name, func(t *testing.T) {
			specs := c.specs(t)
			keys := make([]string, len(specs))
			for i := range keys {
				keys[i] = fmt.Sprintf("vec:{%d}:%d", n, i)
			}
			before := make([]string, len(keys))
			for k, step := range c.Steps {
				where := fmt.Sprintf("step %d (t=%s)", k, step.T)
				takes := make([]Take, len(specs))
				for i := range specs {
					takes[i] = Take{Spec: specs[i], Cost: step.Costs[i]}
				}
				d, after, pttls, err := stepAt(ctx, rdb, baseTime+micros(t, step.T), keys, takes)
				if err != nil {
					t.Fatalf("%s: %v", where, err)
				}
				charged := make([]bool, len(keys))
				for i := range keys {
					charged[i] = after[i] != before[i]
					// A charged key's TTL is the time until full (PTTL reads
					// the live clock, which may have ticked since the SET).
					if charged[i] && (pttls[i] > d.Buckets[i].FullMS || pttls[i] < d.Buckets[i].FullMS-ttlSlackMS) {
						t.Errorf("%s: bucket %d: PTTL %d ms, want %d", where, i, pttls[i], d.Buckets[i].FullMS)
					}
				}
				checkStep(t, where, c, k, d, charged)
				before = after
			}
		})
	}
}
