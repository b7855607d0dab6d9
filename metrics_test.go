package tokenbucket

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/providertest"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// ---------------------------------------------------------------------------
// Scraping Caddy's metrics.

// metricSet is one scrape of the admin endpoint's /metrics: each series,
// as name{label="value",...} with the labels sorted, and its value.
type metricSet map[string]float64

// series names a series of a metricSet: the metric name and label name,
// value pairs in any order.
func series(name string, labels ...string) string {
	if len(labels) == 0 {
		return name
	}
	pairs := make([]string, 0, len(labels)/2)
	for i := 0; i+1 < len(labels); i += 2 {
		pairs = append(pairs, labels[i]+"="+strconv.Quote(labels[i+1]))
	}
	sort.Strings(pairs)
	return name + "{" + strings.Join(pairs, ",") + "}"
}

// scrape reads Caddy's metrics from the admin endpoint. It fails the test
// on a metric family described twice or a series given twice: a duplicate
// registration would show as one or the other.
func scrape(t *testing.T) metricSet {
	t.Helper()
	status, body := adminDo(t, http.MethodGet, "/metrics", "")
	if status != http.StatusOK {
		t.Fatalf("scraping metrics: status %d", status)
	}
	return parseMetrics(t, strings.NewReader(body))
}

func parseMetrics(t *testing.T, r io.Reader) metricSet {
	t.Helper()
	set := metricSet{}
	types := map[string]bool{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "# TYPE ") {
			name := strings.Fields(line)[2]
			if types[name] {
				t.Errorf("metric family %s appears twice in the scrape", name)
			}
			types[name] = true
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s, v, err := parseSample(line)
		if err != nil {
			t.Fatalf("scrape line %q: %v", line, err)
		}
		if _, dup := set[s]; dup {
			t.Errorf("series %s appears twice in the scrape", s)
		}
		set[s] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return set
}

// parseSample reads one sample line of the Prometheus text format (as
// Caddy writes it: no timestamps) into a canonical series and its value.
func parseSample(line string) (string, float64, error) {
	sp := strings.LastIndexByte(line, ' ')
	if sp < 0 {
		return "", 0, errors.New("no value")
	}
	v, err := strconv.ParseFloat(line[sp+1:], 64)
	if err != nil {
		return "", 0, err
	}
	head := line[:sp]
	brace := strings.IndexByte(head, '{')
	if brace < 0 {
		return head, v, nil
	}
	var labels []string
	rest := head[brace+1:]
	for rest != "}" && rest != "" {
		eq := strings.Index(rest, `="`)
		if eq < 0 {
			return "", 0, errors.New("bad labels")
		}
		name := strings.TrimPrefix(rest[:eq], ",")
		value, err := strconv.QuotedPrefix(rest[eq+1:])
		if err != nil {
			return "", 0, err
		}
		unq, _ := strconv.Unquote(value)
		labels = append(labels, name, unq)
		rest = strings.TrimPrefix(rest[eq+1+len(value):], ",")
	}
	return series(head[:brace], labels...), v, nil
}

// want checks series' values in a scrape: name, labels..., value groups
// given as wantSeries values.
func (m metricSet) want(t *testing.T, what string, checks ...check) {
	t.Helper()
	for _, c := range checks {
		got, ok := m[c.series]
		switch {
		case !ok:
			t.Errorf("%s: series %s is missing from the scrape", what, c.series)
		case got != c.value:
			t.Errorf("%s: %s = %v, want %v", what, c.series, got, c.value)
		}
	}
}

// delta checks the change of series between two scrapes.
func (m metricSet) delta(t *testing.T, before metricSet, what string, checks ...check) {
	t.Helper()
	for _, c := range checks {
		got, ok := m[c.series]
		if !ok {
			t.Errorf("%s: series %s is missing from the scrape", what, c.series)
			continue
		}
		if d := got - before[c.series]; d != c.value {
			t.Errorf("%s: %s grew by %v, want %v", what, c.series, d, c.value)
		}
	}
}

type check struct {
	series string
	value  float64
}

func decisions(tier, outcome string) string {
	return series("caddy_token_bucket_decisions_total", "tier", tier, "outcome", outcome)
}

const redisCalls = "caddy_token_bucket_redis_call_duration_seconds_count"

// ---------------------------------------------------------------------------
// End to end.

// getPath GETs path on the gateway's site.
func getPath(g *e2eGateway, path string) e2eResponse {
	g.t.Helper()
	r, err := readResponse(g.client.Get(strings.TrimSuffix(g.url, "/") + path))
	if err != nil {
		g.t.Fatal(err)
	}
	return r
}

// uniqueTier returns a tier name no other test or run (go test -count) of
// this process uses, so that its series start at 0 though the collectors
// live as long as the process.
func uniqueTier(name string) string {
	return name + "_" + strconv.FormatInt(tierRuns.Add(1), 10)
}

var tierRuns atomic.Int64

// metricsSite returns a site that limits tier free (3 requests and 1000
// tokens per user, refilled 1 per hour, so no refill shows during the
// test) and tier pro, whose series must exist at 0 from the start, and
// answers "gen <gen>". /gen is not limited: it tells which config answers.
func metricsSite(free, pro string, gen int) string {
	return strings.NewReplacer("TIER_FREE", free, "TIER_PRO", pro, "GEN", strconv.Itoa(gen)).Replace(metricsSiteTemplate)
}

const metricsSiteTemplate = `
	@limited not path /gen
	token_bucket @limited {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		tier_from {http.request.header.X-Tier}
		tier TIER_FREE {
			user 3 1/1h
			user 1000 1/1h tokens
		}
		tier TIER_PRO {
			user 100 1/1h
		}
		cost {http.request.header.X-Cost}
	}
	respond "gen GEN"`

// TestMetricsExactAndAcrossReloads sends known traffic and checks every
// token_bucket counter exactly; then reloads the config 10 times (each a
// changed config, so a real reload) and checks that the scrape has no
// duplicate family or series and that the counters continue: they hold
// their values across reloads (the collectors live for the process; the
// registry is Caddy's new one per config) and keep counting after them.
func TestMetricsExactAndAcrossReloads(t *testing.T) {
	free, pro := uniqueTier("mtr_free"), uniqueTier("mtr_pro")
	g := startGateway(t, metricsSite(free, pro, 0))
	before := scrape(t)
	for _, tier := range []string{free, pro} {
		for _, o := range outcomeNames {
			before.want(t, "after provisioning", check{decisions(tier, o), 0})
		}
	}
	before.want(t, "after provisioning",
		check{series("caddy_token_bucket_denials_total", "tier", pro, "dimension", "user"), 0},
		check{series("caddy_token_bucket_tokens_charged_total", "tier", free, "dimension", "user", "unit", "tokens"), 0},
		check{"caddy_token_bucket_breaker_open", 0})

	asFree := []string{"X-Tier", free, "X-Cost", "10"}
	for i := 1; i <= 3; i++ {
		if r := g.get(append(asFree, "X-User", "alice")...); r.status != http.StatusOK {
			t.Fatalf("request %d: status %d, want 200", i, r.status)
		}
	}
	allowed := scrape(t)
	allowed.delta(t, before, "3 allowed", check{redisCalls, 3})
	for i := 1; i <= 2; i++ {
		if r := g.get(append(asFree, "X-User", "alice")...); r.status != http.StatusTooManyRequests {
			t.Fatalf("request %d over the limit: status %d, want 429", i, r.status)
		}
	}
	// bob: alice is denied by her requests limit, answered before her cost is read.
	if r := g.get("X-Tier", free, "X-Cost", "lots", "X-User", "bob"); r.status != http.StatusBadRequest {
		t.Fatalf("invalid cost: status %d, want 400", r.status)
	}
	if r := g.get(asFree...); r.status != http.StatusOK { // no X-User: no bucket applies
		t.Fatalf("no identity: status %d, want 200", r.status)
	}
	if r := g.get("X-Tier", pro, "X-User", "carol"); r.status != http.StatusOK {
		t.Fatalf("pro: status %d, want 200", r.status)
	}

	// exact are the values after the traffic above.
	exact := []check{
		{decisions(free, "allowed"), 3},
		{decisions(free, "denied"), 2},
		{decisions(free, "invalid_cost"), 1},
		{decisions(free, "invalid_body"), 0},
		{decisions(free, "skipped"), 1},
		{decisions(free, "unavailable"), 0},
		{decisions(pro, "allowed"), 1},
		{decisions(pro, "denied"), 0},
		{series("caddy_token_bucket_denials_total", "tier", free, "dimension", "user"), 2},
		{series("caddy_token_bucket_denials_total", "tier", pro, "dimension", "user"), 0},
		{series("caddy_token_bucket_tokens_charged_total", "tier", free, "dimension", "user", "unit", "requests"), 3},
		{series("caddy_token_bucket_tokens_charged_total", "tier", free, "dimension", "user", "unit", "tokens"), 30},
		{series("caddy_token_bucket_tokens_charged_total", "tier", pro, "dimension", "user", "unit", "requests"), 1},
		{"caddy_token_bucket_breaker_open", 0},
	}
	after := scrape(t)
	after.want(t, "after traffic", exact...)
	after.delta(t, before, "after traffic",
		check{series("caddy_token_bucket_redis_errors_total", "kind", "timeout"), 0},
		check{series("caddy_token_bucket_redis_errors_total", "kind", "connection"), 0},
		check{series("caddy_token_bucket_redis_errors_total", "kind", "breaker_open"), 0},
		check{series("caddy_token_bucket_local_decisions_total", "outcome", "allowed"), 0},
		check{series("caddy_token_bucket_local_decisions_total", "outcome", "denied"), 0})

	for gen := 1; gen <= 10; gen++ {
		g.load(metricsSite(free, pro, gen))
		if r := getPath(g, "/gen"); r.body != fmt.Sprintf("gen %d", gen) {
			t.Fatalf("reload %d: body %q: the config did not reload", gen, r.body)
		}
		if n := len(listHandlers()); n != 1 {
			t.Fatalf("reload %d: %d handlers registered for the admin API, want 1", gen, n)
		}
	}
	scrape(t).want(t, "after 10 reloads", exact...)

	if r := g.get(append(asFree, "X-User", "alice")...); r.status != http.StatusTooManyRequests {
		t.Fatalf("after reloads: status %d, want 429 (the bucket is in Redis)", r.status)
	}
	if r := g.get(append(asFree, "X-User", "bob")...); r.status != http.StatusOK {
		t.Fatalf("after reloads: bob: status %d, want 200", r.status)
	}
	scrape(t).want(t, "after reloads and traffic",
		check{decisions(free, "allowed"), 4},
		check{decisions(free, "denied"), 3},
		check{series("caddy_token_bucket_denials_total", "tier", free, "dimension", "user"), 3},
		check{series("caddy_token_bucket_tokens_charged_total", "tier", free, "dimension", "user", "unit", "tokens"), 40})
}

// TestMetricsRedisDown stops Redis under a handler whose breaker opens
// after 2 failures and stays open for an hour: the first 2 calls fail to
// connect, the next are refused by the breaker, and every request is
// decided by the local store (capacity 2).
func TestMetricsRedisDown(t *testing.T) {
	tier := uniqueTier("mdown")
	g := startGateway(t, strings.ReplaceAll(`
	token_bucket {
		redis {
			address REDIS_ADDR
			timeout 10s
			breaker_failures 2
			breaker_cooldown 1h
		}
		dimension user {http.request.header.X-User}
		tier TIER {
			user 2 1/1h
		}
	}
	respond "ok"`, "TIER", tier))
	g.redis.Stop()
	before := scrape(t)
	want := []int{200, 200, 429, 429}
	for i, status := range want {
		if r := g.get("X-User", "alice"); r.status != status {
			t.Fatalf("request %d: status %d, want %d", i+1, r.status, status)
		}
	}
	after := scrape(t)
	after.delta(t, before, "redis down",
		check{series("caddy_token_bucket_redis_errors_total", "kind", "connection"), 2},
		check{series("caddy_token_bucket_redis_errors_total", "kind", "breaker_open"), 2},
		check{series("caddy_token_bucket_redis_errors_total", "kind", "timeout"), 0},
		check{series("caddy_token_bucket_redis_errors_total", "kind", "other"), 0},
		check{series("caddy_token_bucket_local_decisions_total", "outcome", "allowed"), 2},
		check{series("caddy_token_bucket_local_decisions_total", "outcome", "denied"), 2},
		check{series("caddy_token_bucket_breaker_transitions_total", "to", "open"), 1},
		check{redisCalls, 2})
	after.want(t, "redis down",
		check{decisions(tier, "allowed"), 2},
		check{decisions(tier, "denied"), 2},
		check{series("caddy_token_bucket_denials_total", "tier", tier, "dimension", "user"), 2},
		check{series("caddy_token_bucket_tokens_charged_total", "tier", tier, "dimension", "user", "unit", "requests"), 2},
		check{"caddy_token_bucket_breaker_open", 1})
}

// TestMetricsClientGone closes a client's connection while its request
// waits, queued, behind a call to a Redis that does not answer (paused),
// under on_redis_error local: Go's server cancels the request, its call
// ends canceled before it was sent, and that is not Redis failing. No
// policy decides the request: no local decision, no decision counted for
// the tier; redis_errors_total{kind="canceled"} counts it once, and its
// bucket is never charged. The gateway reaches Redis through a proxy, which
// shows when the first call has been written.
func TestMetricsClientGone(t *testing.T) {
	tier := uniqueTier("mgone")
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t)
	proxy.SetTarget(srv.Addr)
	g := startGateway(t, strings.NewReplacer("TIER", tier, "PROXY_ADDR", proxy.Addr).Replace(`
	token_bucket {
		redis {
			address PROXY_ADDR
			timeout 1m
		}
		dimension user {http.request.header.X-User}
		tier TIER {
			user 10 1/1h
		}
	}
	respond "ok"`))
	b := batchedOf(t, tier)
	before := scrape(t)
	srv.Pause(t)
	// The first request's call is written (one batch at a time, the
	// default) and waits on the paused Redis; the second queues behind it.
	proxy.DelayReplyTo("evalsha", time.Nanosecond) // to see the call pass
	first := make(chan e2eResponse, 1)
	go func() {
		r, err := g.tryGet("X-User", "first")
		if err != nil {
			t.Error(err)
		}
		first <- r
	}()
	redistest.WaitFor(t, 10*time.Second, "the first call to be written", func() error {
		if proxy.Armed() {
			return errors.New("not yet")
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gone := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, g.url, nil)
		req.Header.Set("X-User", "alice")
		resp, err := g.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		gone <- err
	}()
	waitPending(t, b, 1, 1)
	cancel()
	if err := <-gone; !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v, want context.Canceled", err)
	}
	canceled := series("caddy_token_bucket_redis_errors_total", "kind", errCanceled)
	redistest.WaitFor(t, 10*time.Second, "the canceled call to be counted", func() error {
		if d := scrape(t)[canceled] - before[canceled]; d != 1 {
			return fmt.Errorf("%v canceled calls", d)
		}
		return nil
	})
	waitPending(t, b, 0, 1) // alice's call left the queue, unsent
	srv.Resume(t)
	if r := <-first; r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "9" {
		t.Fatalf("first request: status %d, X-RateLimit-Remaining %q; want 200 with 9", r.status, r.header.Get("X-RateLimit-Remaining"))
	}
	checks := []check{{canceled, 1}}
	for _, o := range outcomeNames {
		want := 0.0
		if o == "allowed" {
			want = 1 // the first request
		}
		checks = append(checks, check{decisions(tier, o), want})
	}
	for _, o := range []outcome{outcomeAllowed, outcomeDenied, outcomeUnavailable} {
		checks = append(checks, check{series("caddy_token_bucket_local_decisions_total", "outcome", outcomeNames[o]), 0})
	}
	for _, k := range []string{errTimeout, errConnection, errBreakerOpen, errOther} {
		checks = append(checks, check{series("caddy_token_bucket_redis_errors_total", "kind", k), 0})
	}
	scrape(t).delta(t, before, "client gone", checks...)
	if r := g.get("X-User", "alice"); r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "9" {
		t.Errorf("alice afterwards: status %d, X-RateLimit-Remaining %q; want 200 with 9 (the call of the request gone never sent)",
			r.status, r.header.Get("X-RateLimit-Remaining"))
	}
}

// waitPending waits until b has queued calls queued and running batches
// under way.
func waitPending(t *testing.T, b *bucket.Batched, queued, running int) {
	t.Helper()
	redistest.WaitFor(t, 10*time.Second, fmt.Sprintf("%d queued, %d under way", queued, running), func() error {
		if q, r := b.Pending(); q != queued || r != running {
			return fmt.Errorf("%d queued, %d under way", q, r)
		}
		return nil
	})
}

// batchedOf returns the batching Redis client of the running handler that
// has tier.
func batchedOf(t *testing.T, tier string) *bucket.Batched {
	t.Helper()
	handlers.RLock()
	defer handlers.RUnlock()
	for _, h := range handlers.list {
		if h.tiers[tier] == nil {
			continue
		}
		if s, ok := h.conn.store.(bucket.Redis); ok {
			if b, ok := s.Client.(*bucket.Batched); ok {
				return b
			}
		}
		t.Fatalf("the handler of tier %s does not batch: store %T", tier, h.conn.store)
	}
	t.Fatalf("no running handler has tier %s", tier)
	return nil
}

// ---------------------------------------------------------------------------
// Units.

// TestRedisErrorKind classifies made-up errors and real ones: a port with
// no server, a server that never answers, and an error reply.
func TestRedisErrorKind(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{gobreaker.ErrOpenState, errBreakerOpen},
		{gobreaker.ErrTooManyRequests, errBreakerOpen},
		{context.Canceled, errCanceled},
		{fmt.Errorf("running token bucket script: %w", context.DeadlineExceeded), errTimeout},
		{redis.ErrPoolTimeout, errTimeout},
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, errTimeout},
		{&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, errConnection},
		{fmt.Errorf("running token bucket script: %w", io.EOF), errConnection},
		{redis.ErrClosed, errConnection},
		{errors.New("ERR token_bucket: malformed bucket state at rl:{user:x}"), errOther},
	} {
		if got := redisErrorKind(tc.err); got != tc.want {
			t.Errorf("redisErrorKind(%v) = %s, want %s", tc.err, got, tc.want)
		}
	}

	take := func(addr string) error {
		r, err := (&RedisConfig{Address: []string{addr}, Timeout: caddy.Duration(200 * time.Millisecond)}).resolve()
		if err != nil {
			t.Fatal(err)
		}
		c := newConn(r)
		defer c.Destruct()
		_, err = c.take(context.Background(), []string{"rl:{user:x}"}, testTakes(t))
		return err
	}
	closed := redistest.FreePort(t)
	if got := redisErrorKind(take("127.0.0.1:" + strconv.Itoa(closed))); got != errConnection {
		t.Errorf("no server: kind %s, want connection", got)
	}
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	go func() { // accept and never answer
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	if got := redisErrorKind(take(silent.Addr().String())); got != errTimeout {
		t.Errorf("silent server: kind %s, want timeout", got)
	}
	srv := redistest.Start(t)
	srv.Client(t).Set(context.Background(), "rl:{user:x}", "garbage", 0)
	if got := redisErrorKind(take(srv.Addr)); got != errOther {
		t.Errorf("malformed state: kind %s, want other", got)
	}
}

// TestMetricsRegisterTwice registers the collectors in one registry twice,
// as two handlers of one config do, and in a fresh one, as a reload does;
// a nil registry (no metrics) is accepted; a foreign collector under one
// of the names is an error.
func TestMetricsRegisterTwice(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	for i := 0; i < 2; i++ {
		if err := tbMetrics.register(reg); err != nil {
			t.Fatalf("registration %d: %v", i+1, err)
		}
	}
	if err := tbMetrics.register(prometheus.NewPedanticRegistry()); err != nil {
		t.Fatalf("new registry: %v", err)
	}
	if err := tbMetrics.register(nil); err != nil {
		t.Fatalf("nil registry: %v", err)
	}
	foreign := prometheus.NewPedanticRegistry()
	foreign.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "caddy_token_bucket_local_decisions_total", Help: "x"}))
	if err := tbMetrics.register(foreign); err == nil {
		t.Error("a foreign collector with the same name: no error")
	}
	if _, err := reg.Gather(); err != nil {
		t.Fatalf("gather: %v", err)
	}
}

// TestMetricLabelsCarryNoIdentity gathers every token_bucket family and
// checks that its labels are among the fixed set: never an identity, id or
// key.
func TestMetricLabelsCarryNoIdentity(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	if err := tbMetrics.register(reg); err != nil {
		t.Fatal(err)
	}
	allowedLabels := []string{"tier", "outcome", "dimension", "unit", "kind", "to"}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(allowedLabels, l.GetName()) {
					t.Errorf("%s has label %s", f.GetName(), l.GetName())
				}
			}
		}
	}
}

// testTakes is one request on one bucket of 10 tokens refilled 1 per
// second.
func testTakes(t *testing.T) []bucket.Take {
	t.Helper()
	rate, err := bucket.RateFromFloat(1)
	if err != nil {
		t.Fatal(err)
	}
	spec, err := bucket.Limit{Capacity: 10, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	return []bucket.Take{{Spec: spec, Cost: 1}}
}

// TestProvisionWithoutMetricsRegistry provisions a handler in a context
// without a metrics registry and serves requests with it: nothing is
// registered and nothing fails. A handler that was never provisioned
// counts nothing without failing either.
func TestProvisionWithoutMetricsRegistry(t *testing.T) {
	srv := redistest.Start(t)
	h := &Handler{
		Redis:      &RedisConfig{Address: []string{srv.Addr}, Timeout: caddy.Duration(10 * time.Second)},
		Dimensions: []Dimension{{Name: "user", Identity: "{http.request.header.X-User}"}},
		Tiers:      []Tier{{Name: "nometrics", Limits: []Limit{{Dimension: "user", Capacity: 1, RefillRate: 1.0 / 3600}}}},
	}
	ctx := caddy.Context{Context: context.Background()}
	if ctx.GetMetricsRegistry() != nil {
		t.Fatal("the bare context has a registry")
	}
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer h.Cleanup()
	for i, want := range []int{200, 429} {
		r := serveUser(h, "alice")
		if r.err != nil {
			t.Fatal(r.err)
		}
		if r.status != want {
			t.Errorf("request %d: status %d, want %d", i+1, r.status, want)
		}
	}
	var none *handlerMetrics
	none.count(nil, outcomeAllowed, true)
	(&Handler{}).observe(nil, nil, nil, nil, false)
}

// TestDashboardQueriesExistingMetrics checks that the Grafana dashboard
// is valid JSON, that every token_bucket metric it names (in queries and
// template variables) is in a scrape of a Caddy with a token_bucket
// handler, and that it groups only by labels the metrics have.
func TestDashboardQueriesExistingMetrics(t *testing.T) {
	b, err := os.ReadFile("dashboards/token_bucket.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash map[string]any
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("dashboards/token_bucket.json is not valid JSON: %v", err)
	}
	var strs []string // every string in the dashboard
	exprs := 0
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				if _, ok := x.(string); ok && k == "expr" {
					exprs++
				}
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		case string:
			strs = append(strs, v)
		}
	}
	walk(dash)
	if exprs < 6 {
		t.Fatalf("the dashboard has %d queries, want at least 6", exprs)
	}
	byRE := regexp.MustCompile(`\bby \(([^)]*)\)`)
	labels := []string{"tier", "outcome", "dimension", "unit", "kind", "to", "le", "instance"}
	for _, e := range strs {
		for _, m := range byRE.FindAllStringSubmatch(e, -1) {
			for _, l := range strings.Split(m[1], ",") {
				if l = strings.TrimSpace(l); !slices.Contains(labels, l) {
					t.Errorf("the dashboard groups by %q, a label no token_bucket metric has (query %q)", l, e)
				}
			}
		}
	}

	// A concurrency and a shadow limit, so that their metrics have series.
	site := strings.Replace(metricsSite(uniqueTier("dash_free"), uniqueTier("dash_pro"), 0),
		"user 100 1/1h", "user 100 1/1h\n\t\t\tuser 5 concurrent\n\t\t\tuser 50 1/1h shadow", 1)
	startGateway(t, site)
	m := scrape(t)
	names := map[string]bool{}
	for s := range m {
		names[strings.SplitN(s, "{", 2)[0]] = true
	}
	metricRE := regexp.MustCompile(`\bcaddy_token_bucket_[a-z_]+`)
	seen := 0
	for _, e := range strs {
		for _, name := range metricRE.FindAllString(e, -1) {
			seen++
			if !names[name] {
				t.Errorf("the dashboard queries %s, which is not in a scrape (query %q)", name, e)
			}
		}
	}
	if seen == 0 {
		t.Error("the dashboard queries no token_bucket metric")
	}
}

// TestChargedOncePerSeries: a request of 11 limits on 10 series, the 11th
// sharing the 10th's series, as a model-scoped limit beside an unscoped
// one does: each series grows by the request's cost once.
func TestChargedOncePerSeries(t *testing.T) {
	m := &handlerMetrics{limits: map[*limit]limitMetrics{}}
	series := make([]prometheus.Counter, 10)
	req := &request{}
	var results []bucket.Result
	for i := range 11 {
		if i < len(series) {
			series[i] = prometheus.NewCounter(prometheus.CounterOpts{Name: "charged_" + strconv.Itoa(i)})
		}
		l := &limit{series: min(i, len(series)-1)}
		m.limits[l] = limitMetrics{charged: series[l.series]}
		req.limits = append(req.limits, l)
		req.takes = append(req.takes, bucket.Take{Cost: 7})
		results = append(results, bucket.Result{Reason: bucket.Allowed})
	}
	d := bucket.Summarize(results)
	h := &Handler{metrics: m}
	h.observe(httptest.NewRequest(http.MethodGet, "/", nil), &tier{}, req, &d, false)
	for i, c := range series {
		if got := testutil.ToFloat64(c); got != 7 {
			t.Errorf("series %d: %v, want 7", i, got)
		}
	}
}

// TestTokensMetricsFollowTheBuckets: tokens_charged_total less
// tokens_refunded_total is what the buckets in Redis lost, on every way a
// settlement ends: usage below and above the estimate, a call the provider
// refused (its estimate given back), a failure that may have run (kept)
// and an answer without usage (kept). A shadow limit of capacity 100,
// whose charge of a 500-token estimate is capped at 100, shares the
// enforced limit's series: the series counts the enforced charge.
func TestTokensMetricsFollowTheBuckets(t *testing.T) {
	tier := uniqueTier("settled")
	lg := startLLMGateway(t, strings.Replace(llmLimiter("user 100 1/1h tokens shadow\n\t\t\t\tuser 10000 1/1h tokens", "cost estimate\n\t\t\tsettle"),
		"tier free", "tier "+tier, 1))
	lg.up.SetReply(func(r *providertest.Request) providertest.Reply {
		rep := llmTestReply(r)
		rep.Status, _ = strconv.Atoi(r.Header.Get("X-Test-Status"))
		return rep
	})
	charged := series("caddy_token_bucket_tokens_charged_total", "tier", tier, "dimension", "user", "unit", "tokens")
	refunded := series("caddy_token_bucket_tokens_refunded_total", "tier", tier, "dimension", "user", "unit", "tokens")
	outcome := func(o string) string { return series("caddy_token_bucket_settlements_total", "outcome", o) }
	for _, tc := range []struct {
		name, usage, status string
		charged, refunded   float64
		outcome             string
		lost                int64 // what the enforced bucket lost
	}{
		{"below", "100,220", "", 500, 180, "settled", 320},
		{"above", "400,500", "", 900, 0, "settled", 900},
		{"refused_429", "", "429", 500, 500, "settled", 0},
		{"error_object_500", "", "500", 500, 500, "settled", 0},
		{"may_have_run_502", "", "502", 500, 0, "not_reported", 500},
		{"no_usage", "", "", 500, 0, "not_reported", 500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "metrics-" + tc.name
			before := scrape(t)
			r := lg.post("/v1/chat/completions", chat500, "X-User", user, "X-Test-Usage", tc.usage, "X-Test-Status", tc.status)
			if want := cmp.Or(tc.status, "200"); strconv.Itoa(r.status) != want {
				t.Fatalf("status %d, want %s: %s", r.status, want, r.body)
			}
			lg.sync()
			after := scrape(t)
			for _, c := range []check{{charged, tc.charged}, {refunded, tc.refunded}, {outcome(tc.outcome), 1}} {
				if got := after[c.series] - before[c.series]; got != c.value {
					t.Errorf("%s grew by %v, want %v", c.series, got, c.value)
				}
			}
			st, ok := lg.state(bucket.NewKeyer("rl:", "").Key("user", user, "tokens"))
			lost := int64(0)
			if ok {
				lost = 10000 - wholeTokens(st)
			}
			if lost != tc.lost || float64(lost) != tc.charged-tc.refunded {
				t.Errorf("the bucket lost %d tokens, want %d = charged %v - refunded %v", lost, tc.lost, tc.charged, tc.refunded)
			}
		})
	}
}
