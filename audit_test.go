package tokenbucket

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// ---------------------------------------------------------------------------
// The audit limiter, with an observed logger and a clock the test sets.

// auditFixture is a handler's auditor with everything a denial needs.
type auditFixture struct {
	logs  *observer.ObservedLogs
	now   time.Time
	a     *auditor
	keyer bucket.Keyer
	tier  *tier
	r     *http.Request
}

// rawKey is an API key that must never reach a log.
const rawKey = "sk-live-9f8e7d6c5b4a39281706f5e4d3c2b1a0"

func newAuditFixture(t *testing.T, opts AuditOptions) *auditFixture {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	f := &auditFixture{logs: logs, now: time.Unix(1_800_000_000, 0), keyer: bucket.NewKeyer("rl:", "")}
	h := &Handler{logger: zap.New(core).Named("http.handlers.token_bucket"), AuditOptions: opts}
	h.now = func() time.Time { return f.now }
	f.a = h.newAuditor()
	spec := testTakes(t)[0].Spec
	f.tier = &tier{name: "free", limits: []limit{{dimension: "apikey", spec: spec}, {dimension: "apikey", unit: UnitTokens, tokens: true, spec: spec}}}
	f.r = httptest.NewRequest(http.MethodGet, "/v1/chat", nil)
	f.r.RemoteAddr = "203.0.113.9:41000"
	return f
}

// deny audits a denial of identity's bucket (the tokens bucket when
// tokens is set) that waits 1500 ms.
func (f *auditFixture) deny(identity string, tokens bool) {
	i, unit := 0, ""
	if tokens {
		i, unit = 1, UnitTokens
	}
	l := &f.tier.limits[i]
	req := &request{keys: []string{f.keyer.Key("apikey", identity, unit)},
		takes: []bucket.Take{{Spec: l.spec, Cost: 7}}, limits: []*limit{l}}
	d := &bucket.Decision{Reason: bucket.RateLimited, RetryAfterMS: 1500, Deciding: 0,
		Buckets: []bucket.Result{{Reason: bucket.RateLimited, RetryAfterMS: 1500}}}
	f.a.denied(f.r, f.tier, req, d, 0, false)
}

// wantEntry checks an audit entry's logger, message and every field.
func (f *auditFixture) wantEntry(t *testing.T, e observer.LoggedEntry, identity, unit string, suppressed int64) {
	t.Helper()
	if e.LoggerName != AuditLogger || e.Message != "request denied" || e.Level != zap.InfoLevel {
		t.Errorf("entry %s %q at %s, want %s \"request denied\" at info", e.LoggerName, e.Message, e.Level, AuditLogger)
	}
	keyUnit := unit
	if unit == UnitRequests {
		keyUnit = ""
	}
	want := map[string]any{
		"tier": "free", "dimension": "apikey", "unit": unit,
		"id": f.keyer.ID(identity), "key": f.keyer.Key("apikey", identity, keyUnit),
		"reason": "rate_limit_exceeded", "cost": int64(7), "retry_after_ms": int64(1500),
		"degraded": false, "client_ip": "203.0.113.9", "suppressed": suppressed,
	}
	got := e.ContextMap()
	if len(got) != len(want) {
		t.Errorf("entry fields %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("entry field %s = %#v, want %#v", k, got[k], v)
		}
	}
	if strings.Contains(fmt.Sprint(got), identity) {
		t.Errorf("entry holds the raw identity: %v", got)
	}
}

// TestAuditQuotaPeriod: a calendar quota's entry names its period beside
// its unit, as the admin API does: a day's quota is told apart from the
// bucket of the same dimension and unit.
func TestAuditQuotaPeriod(t *testing.T) {
	f := newAuditFixture(t, AuditOptions{})
	l := &limit{dimension: "apikey", unit: UnitTokens, tokens: true, spec: bucket.QuotaSpec(1000), period: bucket.Day}
	key := f.keyer.Key("apikey", rawKey, "tokens:day")
	req := &request{keys: []string{key}, takes: []bucket.Take{{Spec: l.spec, Cost: 7}}, limits: []*limit{l}}
	d := &bucket.Decision{Reason: bucket.RateLimited, RetryAfterMS: 1500,
		Buckets: []bucket.Result{{Reason: bucket.RateLimited, RetryAfterMS: 1500}}}
	f.a.denied(f.r, f.tier, req, d, 0, false)
	entries := f.logs.All()
	if len(entries) != 1 {
		t.Fatalf("%d entries, want 1", len(entries))
	}
	if got := entries[0].ContextMap(); got["unit"] != UnitTokens || got["period"] != "day" || got["key"] != key {
		t.Errorf("entry %v, want unit tokens, period day, key %s", got, key)
	}
}

// TestAuditOneEntryPerBucketPerWindow denies one bucket 10,000 times in
// one instant: one entry. Its denials until the window (10s) ends are
// counted, not logged; the first after it is logged with that count.
// Another bucket of the same identity (the tokens limit) has its own
// window.
func TestAuditOneEntryPerBucketPerWindow(t *testing.T) {
	f := newAuditFixture(t, AuditOptions{})
	t0 := f.now
	for i := 0; i < 10_000; i++ {
		f.deny(rawKey, false)
	}
	if n := f.logs.Len(); n != 1 {
		t.Fatalf("10,000 denials in one instant: %d entries, want 1", n)
	}
	f.wantEntry(t, f.logs.TakeAll()[0], rawKey, UnitRequests, 0)

	f.now = t0.Add(DefaultAuditWindow - time.Nanosecond)
	f.deny(rawKey, false)
	f.deny(rawKey, true) // another bucket: logged
	entries := f.logs.TakeAll()
	if len(entries) != 1 {
		t.Fatalf("at the end of the window: %d entries, want 1 (the tokens bucket)", len(entries))
	}
	f.wantEntry(t, entries[0], rawKey, UnitTokens, 0)

	f.now = t0.Add(DefaultAuditWindow)
	for i := 0; i < 5; i++ {
		f.deny(rawKey, false)
	}
	entries = f.logs.TakeAll()
	if len(entries) != 1 {
		t.Fatalf("after the window: %d entries, want 1", len(entries))
	}
	f.wantEntry(t, entries[0], rawKey, UnitRequests, 10_000) // 9,999 + 1 since the first entry

	f.now = t0.Add(2 * DefaultAuditWindow)
	f.deny(rawKey, false)
	entries = f.logs.TakeAll()
	if len(entries) != 1 {
		t.Fatalf("after the second window: %d entries, want 1", len(entries))
	}
	f.wantEntry(t, entries[0], rawKey, UnitRequests, 4)
}

// TestAuditWindowOption: audit_window 1m holds a bucket's next entry for
// a minute, not the default 10s.
func TestAuditWindowOption(t *testing.T) {
	f := newAuditFixture(t, AuditOptions{AuditWindow: caddy.Duration(time.Minute)})
	t0 := f.now
	f.deny(rawKey, false)
	f.now = t0.Add(59 * time.Second)
	f.deny(rawKey, false)
	if n := f.logs.Len(); n != 1 {
		t.Fatalf("within a minute: %d entries, want 1", n)
	}
	f.now = t0.Add(time.Minute)
	f.deny(rawKey, false)
	entries := f.logs.TakeAll()
	if len(entries) != 2 {
		t.Fatalf("after a minute: %d entries, want 2", len(entries))
	}
	f.wantEntry(t, entries[1], rawKey, UnitRequests, 1)
}

// TestAuditBucketsBounded: with audit_buckets 2, the limiter remembers two
// buckets; the least recently denied is forgotten, and its next denial is
// logged at once.
func TestAuditBucketsBounded(t *testing.T) {
	f := newAuditFixture(t, AuditOptions{AuditBuckets: 2})
	for _, id := range []string{"k1", "k2", "k3"} {
		f.deny(id, false)
	}
	f.deny("k3", false) // remembered: not logged
	f.deny("k1", false) // forgotten: logged
	if n := f.logs.Len(); n != 4 {
		t.Errorf("%d entries, want 4", n)
	}
	if n := f.a.windows.Len(); n != 2 {
		t.Errorf("%d buckets remembered, want 2", n)
	}
}

// TestAuditOff: audit off writes nothing (and a nil auditor is safe);
// audit_client_ip off leaves the client IP out; the IP is the one Caddy
// determined (trusted_proxies applied), not the connection's.
func TestAuditOff(t *testing.T) {
	off, on := false, true
	f := newAuditFixture(t, AuditOptions{Audit: &off})
	if f.a != nil {
		t.Fatal("audit off: an auditor was made")
	}
	f.deny(rawKey, false)
	if n := f.logs.Len(); n != 0 {
		t.Errorf("audit off: %d entries", n)
	}

	f = newAuditFixture(t, AuditOptions{Audit: &on, AuditClientIP: &off})
	f.deny(rawKey, false)
	if e := f.logs.TakeAll(); len(e) != 1 || e[0].ContextMap()["client_ip"] != nil {
		t.Errorf("audit_client_ip off: entries %v, want one without client_ip", e)
	}

	f = newAuditFixture(t, AuditOptions{})
	vars := map[string]any{caddyhttp.ClientIPVarKey: "198.51.100.7"}
	f.r = f.r.WithContext(context.WithValue(f.r.Context(), caddyhttp.VarsCtxKey, vars))
	f.deny(rawKey, false)
	if e := f.logs.TakeAll(); len(e) != 1 || e[0].ContextMap()["client_ip"] != "198.51.100.7" {
		t.Errorf("client_ip from Caddy: entries %v, want client_ip 198.51.100.7", e)
	}
}

// TestKeyID reads the hashed identity back out of keys of both units and
// any prefix.
func TestKeyID(t *testing.T) {
	for _, prefix := range []string{"rl:", "", "gw:eu:"} {
		k := bucket.NewKeyer(prefix, "s3cret")
		for _, unit := range []string{"", UnitTokens} {
			if got, want := keyID(k.Key("user", "alice", unit)), k.ID("alice"); got != want {
				t.Errorf("keyID(%q) = %q, want %q", k.Key("user", "alice", unit), got, want)
			}
		}
	}
	if got := keyID("short}"); got != "" {
		t.Errorf("keyID of a malformed key = %q, want empty", got)
	}
}

// ---------------------------------------------------------------------------
// Caddyfile.

func TestCaddyfileAuditErrors(t *testing.T) {
	const tier = "\ndimension user {http.auth.user.id}\ntier free {\nuser 10 1/s\n}\n"
	for _, tc := range []struct{ name, block, want string }{
		{"audit maybe", "audit maybe", `invalid audit "maybe": must be on or off`},
		{"audit without value", "audit", `audit []: wrong argument count`},
		{"audit twice", "audit on\naudit off", `duplicate subdirective "audit"`},
		{"audit_client_ip yes", "audit_client_ip yes", `invalid audit_client_ip "yes": must be on or off`},
		{"audit_window zero", "audit_window 0s", `invalid audit_window "0s": must be a duration > 0`},
		{"audit_window not a duration", "audit_window soon", `invalid audit_window "soon": time: invalid duration "soon"`},
		{"audit_window unknown unit", "audit_window 1y", `invalid audit_window "1y": time: unknown unit "y" in duration "1y"`},
		{"audit_buckets zero", "audit_buckets 0", `invalid audit_buckets "0": must be a whole number > 0`},
		{"audit_buckets not a number", "audit_buckets many", `invalid audit_buckets "many": strconv.Atoi: parsing "many": invalid syntax`},
		{"audit_buckets two values", "audit_buckets 1 2", `audit_buckets ["1" "2"]: wrong argument count`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adaptCaddyfile(":8080 {\ntoken_bucket {\n" + tc.block + tier + "}\n}\n")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("adapt error = %v\nwant it to contain %s", err, tc.want)
			}
		})
	}
}

// ---------------------------------------------------------------------------
// End to end.

// TestAudit10000DeniedRequests sends 10,000 denied requests for one API
// key, concurrently, through a Caddy whose logging writes the audit logger
// to a JSON file, with audit_window 1h: the file has exactly one entry for
// that key (and one for another key denied once), with every field, the
// hashed key and never the raw one. The denials counter agrees exactly.
func TestAudit10000DeniedRequests(t *testing.T) {
	tier := uniqueTier("aud_free")
	site := strings.ReplaceAll(`
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension apikey {http.request.header.X-API-Key}
		tier TIER {
			apikey 1 1/1h
		}
		audit_window 1h
	}
	respond "ok"`, "TIER", tier)
	g := startGateway(t, `respond "not yet"`)
	logFile := loadAudited(t, g, site)

	const other = "sk-live-0000000000000000000000000000other"
	for _, key := range []string{rawKey, other} {
		if r := g.get("X-API-Key", key); r.status != http.StatusOK {
			t.Fatalf("first request: status %d, want 200", r.status)
		}
	}
	const n, workers = 10_000, 32
	var next, denied atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= n {
				r, err := g.tryGet("X-API-Key", rawKey)
				if err != nil {
					errs <- err
					return
				}
				if r.status == http.StatusTooManyRequests {
					denied.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if denied.Load() != n {
		t.Fatalf("%d of %d requests denied", denied.Load(), n)
	}
	if r := g.get("X-API-Key", other); r.status != http.StatusTooManyRequests {
		t.Fatalf("other key: status %d, want 429", r.status)
	}

	raw, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(raw), rawKey) || strings.Contains(string(raw), other) {
		t.Fatal("the audit log holds a raw API key")
	}
	keyer := bucket.NewKeyer("rl:", "")
	var entries []map[string]any
	sc := bufio.NewScanner(strings.NewReader(string(raw)))
	for sc.Scan() {
		var e map[string]any
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("audit line %q: %v", sc.Text(), err)
		}
		entries = append(entries, e)
	}
	if len(entries) != 2 {
		t.Fatalf("%d audit entries for 10,001 denials of 2 keys, want 2:\n%s", len(entries), raw)
	}
	for i, key := range []string{rawKey, other} {
		e := entries[i]
		ms, _ := e["retry_after_ms"].(float64)
		if ms < 1 || ms > 3_600_000 {
			t.Errorf("entry %d: retry_after_ms %v, want 1 to 3600000", i, e["retry_after_ms"])
		}
		want := map[string]any{
			"level": "info", "logger": AuditLogger, "msg": "request denied",
			"tier": tier, "dimension": "apikey", "unit": "requests",
			"id": keyer.ID(key), "key": keyer.Key("apikey", key, ""),
			"reason": "rate_limit_exceeded", "cost": 1.0, "degraded": false,
			"client_ip": "127.0.0.1", "suppressed": 0.0,
		}
		for k, v := range want {
			if e[k] != v {
				t.Errorf("entry %d: %s = %#v, want %#v", i, k, e[k], v)
			}
		}
		if len(e) != len(want)+2 { // and ts, retry_after_ms
			t.Errorf("entry %d has fields %v", i, e)
		}
	}
	scrape(t).want(t, "after the denials",
		check{series("caddy_token_bucket_denials_total", "tier", tier, "dimension", "apikey"), n + 1},
		check{decisions(tier, "allowed"), 2})
}

// loadAudited loads site (REDIS_ADDR replaced) into g with Caddy's
// logging writing the audit logger as JSON to a file, whose path it
// returns. The site gets a new port, as gateway.load does, so that no
// request reaches the server of the config before, whose logging has no
// audit file.
func loadAudited(t *testing.T, g *e2eGateway, site string) string {
	t.Helper()
	logFile := filepath.Join(t.TempDir(), "audit.log")
	global := fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	persist_config off
	default_bind 127.0.0.1
	auto_https off
	grace_period 1ns
	log {
		level ERROR
	}
	log token_bucket_audit {
		output file %s
		format json
		include %s
	}
}
`, adminPort, logFile, AuditLogger)
	g.port = redistest.FreePort(t)
	g.url = fmt.Sprintf("http://127.0.0.1:%d/", g.port)
	config := global + fmt.Sprintf(":%d {\n%s\n}\n", g.port, strings.ReplaceAll(site, "REDIS_ADDR", g.redis.Addr))
	if err := postLoad(config, "caddyfile"); err != nil {
		t.Fatalf("loading the audited site: %v", err)
	}
	return logFile
}
