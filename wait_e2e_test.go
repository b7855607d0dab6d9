package tokenbucket

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/internal/soak"
)

// on_limit wait, end to end: a real Caddy (in this process through
// caddytest, or Caddy processes built with the plugin) in front of a real
// Redis and of an upstream in this process that records when each request
// reaches it. Every timing assertion is on recorded timestamps: the Redis
// clock of each charge (the bucket's stored state time), the gateway's
// reservation wait ({http.token_bucket.wait_ms}, passed to the upstream
// as X-Wait-Ms) and the upstream's arrival times, all on this machine's
// one wall clock. A held request can never reach the upstream before the
// refill has paid for its token (exact, to the 1 ms clock slack below);
// how late it may arrive is a tolerance of one refill interval: it must
// reach the upstream within its own slot, before the next token is due,
// so that each refill interval releases exactly one held request, which
// is what "at the refill rate" means; scheduling jitter on a loaded
// machine (two cores, -race, other builds) stays well inside it.

// waitE2EClockSlack is what an arrival may precede its slot by: the
// script's waits are whole milliseconds rounded up and the gateway's timer
// never fires early, so only the two processes' readings of the one wall
// clock (Redis TIME, Go time.Now) can differ, by well under 1 ms.
const waitE2EClockSlack = time.Millisecond

// waitE2EArrival is one request as the upstream saw it.
type waitE2EArrival struct {
	id     string
	waitMS int64 // X-Wait-Ms: the reservation's wait; -1 when there was none
	at     time.Time
}

// waitE2EUpstream records the requests that reach it.
type waitE2EUpstream struct {
	*httptest.Server
	addr     string
	mu       sync.Mutex
	arrivals []waitE2EArrival
}

func startWaitE2EUpstream(t *testing.T) *waitE2EUpstream {
	t.Helper()
	u := &waitE2EUpstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := waitE2EArrival{id: r.Header.Get("X-Req"), waitMS: -1, at: time.Now()}
		// A request that was not held has no {http.token_bucket.wait_ms}:
		// header_up leaves an unknown placeholder as it is.
		if v := r.Header.Get("X-Wait-Ms"); v != "" && v != "{http.token_bucket.wait_ms}" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				n = -2 // not a number: fails every check on it
			}
			a.waitMS = n
		}
		u.mu.Lock()
		u.arrivals = append(u.arrivals, a)
		u.mu.Unlock()
		_, _ = io.WriteString(w, "up "+a.id)
	}))
	u.addr = strings.TrimPrefix(u.URL, "http://")
	t.Cleanup(u.Close)
	return u
}

// seen returns the arrivals so far, by id.
func (u *waitE2EUpstream) seen() map[string]waitE2EArrival {
	u.mu.Lock()
	defer u.mu.Unlock()
	m := make(map[string]waitE2EArrival, len(u.arrivals))
	for _, a := range u.arrivals {
		m[a.id] = a
	}
	return m
}

// sorted returns the arrivals so far in the order they arrived.
func (u *waitE2EUpstream) sorted() []waitE2EArrival {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := slices.Clone(u.arrivals)
	sort.SliceStable(out, func(i, j int) bool { return out[i].at.Before(out[j].at) })
	return out
}

// waitE2ESite is a site of the in-process Caddy: token_bucket with the
// tier's limits and extra subdirectives, on the X-User (and, for the
// control of TestWaitClientLeavesGetsReservationBack, X-Ctl) headers, then
// reverse_proxy to the upstream with the reservation's wait in X-Wait-Ms.
func waitE2ESite(upstream, limits, extra string) string {
	return `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		dimension ctl {http.request.header.X-Ctl}
		tier free {
			` + limits + `
		}
		` + extra + `
	}
	reverse_proxy ` + upstream + ` {
		header_up X-Wait-Ms {http.token_bucket.wait_ms}
	}`
}

// waitE2EHeldMS is the wait of the reservation whose charge left the
// bucket in st, as the script computes it: the deficit, in milliseconds
// of refill rounded up; 0 when st is not below zero (no reservation).
func waitE2EHeldMS(spec bucket.Spec, st bucket.State) int64 {
	if st.Units >= 0 {
		return 0
	}
	per := spec.Refill * 1000
	return (-st.Units + per - 1) / per
}

// waitE2EReadyUS is when the refill has paid for the reservation whose
// charge left the bucket in st (µs, Redis clock): its exact slot.
func waitE2EReadyUS(spec bucket.Spec, st bucket.State) int64 {
	return st.Last + max(0, -st.Units)/spec.Refill
}

// waitE2ENeedMS is the wait (ms, rounded up) that a request of one token
// has at time at (µs) on the bucket last written as st: 0 when it has the
// token.
func waitE2ENeedMS(spec bucket.Spec, st bucket.State, at int64) int64 {
	level := st.Units
	if at > st.Last {
		level = min(spec.CapacityUnits(), level+(at-st.Last)*spec.Refill)
	}
	d := spec.Scale - level
	if d <= 0 {
		return 0
	}
	per := spec.Refill * 1000
	return (d + per - 1) / per
}

// waitE2ECall is one request sent by waitE2EDispatch and what came of it.
type waitE2ECall struct {
	id         int
	send, recv time.Time // before the request was sent, after its answer was read
	res        e2eResponse
	err        error
	done       chan struct{}
	charged    bool         // Redis charged it: allowed, at once or with a reservation
	state      bucket.State // the bucket just after its charge
}

// waitE2EDispatch sends n GET requests with the headers (and X-Req: its
// index), each one as soon as the one before it has been decided: charged
// (the bucket at key changed) or answered (a denial writes nothing). So
// the burst takes a few milliseconds, and its order of arrival at the
// gateway, and in Redis, is the order sent. The requests run on; wait for
// each one's done.
func waitE2EDispatch(t *testing.T, g *e2eGateway, key string, spec bucket.Spec, n int, headers ...string) []*waitE2ECall {
	t.Helper()
	calls := make([]*waitE2ECall, n)
	for k := range calls {
		c := &waitE2ECall{id: k, done: make(chan struct{})}
		calls[k] = c
		prev := g.value(key)
		c.send = time.Now()
		go func() {
			defer close(c.done)
			c.res, c.err = g.tryGet(append(slices.Clone(headers), "X-Req", strconv.Itoa(c.id))...)
			c.recv = time.Now()
		}()
		deadline := time.Now().Add(30 * time.Second)
		for decided := false; !decided; {
			v := g.value(key)
			select {
			case <-c.done:
				v = g.value(key) // a charge is written before the answer
				decided = true
			default:
			}
			if v != prev {
				st, err := bucket.DecodeState(v)
				if err != nil {
					t.Fatalf("request %d: bucket %x: %v", k, v, err)
				}
				if st.Scale != spec.Scale {
					t.Fatalf("request %d: bucket scale %d, want %d", k, st.Scale, spec.Scale)
				}
				c.charged, c.state, decided = true, st, true
			}
			if !decided && time.Now().After(deadline) {
				t.Fatalf("request %d: neither charged nor answered in 30s", k)
			}
			if !decided {
				time.Sleep(100 * time.Microsecond) // polling for the decision; nothing is timed by it
			}
		}
	}
	return calls
}

// waitE2EWaitAll waits for the answers of calls, with a deadline.
func waitE2EWaitAll(t *testing.T, calls []*waitE2ECall, limit time.Duration) {
	t.Helper()
	deadline := time.After(limit)
	for _, c := range calls {
		select {
		case <-c.done:
		case <-deadline:
			t.Fatalf("request %d: no answer within %v", c.id, limit)
		}
	}
}

// waitE2ERetryAfter reads a denial's Retry-After-Ms and checks that
// Retry-After is it in whole seconds, rounded up.
func waitE2ERetryAfter(t *testing.T, what string, h http.Header) int64 {
	t.Helper()
	ms, err := strconv.ParseInt(h.Get("Retry-After-Ms"), 10, 64)
	if err != nil {
		t.Fatalf("%s: Retry-After-Ms %q: %v", what, h.Get("Retry-After-Ms"), err)
	}
	if s := strconv.FormatInt(max(1, (ms+999)/1000), 10); h.Get("Retry-After") != s {
		t.Errorf("%s: Retry-After %q with Retry-After-Ms %d, want %s", what, h.Get("Retry-After"), ms, s)
	}
	return ms
}

// TestWaitBurstServedInOrderAtRefillRate: one gateway, "user 5 10/s"
// (capacity 5, a token every 100 ms) with on_limit wait 3s. A burst of 15
// requests (3× capacity), sent in a few milliseconds, each as soon as the
// one before it was decided (so their order of arrival is known): the
// first 5 reach the upstream at once (before the first token refills);
// the other 10 are held with reservations and reach it in the order they
// arrived, each in its own 100 ms slot: never before the refill has paid
// for its token, and before the next token is due. Each one's X-Wait-Ms
// is exactly the wait its stored bucket implies, and consecutive slots
// are exactly one token (100,000 µs) apart. The burst goes on with 30
// more requests, past the 3 s bound: a request is held exactly when its
// wait is at most 3 s, and one whose wait is longer is 429 at once with
// Retry-After-Ms = its wait less 3 s (Retry-After in seconds, rounded
// up), charging nothing. Every request is accounted for: the 200s are the
// charged requests, which are the upstream's arrivals; the rest are 429s.
func TestWaitBurstServedInOrderAtRefillRate(t *testing.T) {
	const capacity, burst, total, maxWaitMS = 5, 15, 45, 3000
	interval := 100 * time.Millisecond // one token at 10/s
	tol := interval                    // how late a held request may reach the upstream: within its own slot
	up := startWaitE2EUpstream(t)
	g := startGateway(t, waitE2ESite(up.addr, "user 5 10/s", "on_limit wait 3s"))
	spec := llmSpec(t, capacity, "10/s")
	key := bucket.NewKeyer("rl:", "").Key("user", "burst", "")

	calls := waitE2EDispatch(t, g, key, spec, total, "X-User", "burst")
	waitE2EWaitAll(t, calls, time.Minute)
	arrivals := up.seen()

	if !calls[0].charged || calls[0].state.Units != (capacity-1)*spec.Scale {
		t.Fatalf("request 0: charged %v, bucket %+v; want the full bucket charged one token", calls[0].charged, calls[0].state)
	}
	t1 := calls[0].state.Last // the first charge, µs on the Redis clock
	var (
		last                    = calls[0]
		immediate, held, denied []*waitE2ECall
		lateness                []time.Duration
	)
	for _, c := range calls {
		what := fmt.Sprintf("request %d", c.id)
		if c.err != nil {
			t.Fatalf("%s: %v", what, c.err)
		}
		a, reached := arrivals[strconv.Itoa(c.id)]
		if !c.charged {
			// Denied: its wait, at any time it can have been decided
			// (between send and recv), was over max_wait.
			denied = append(denied, c)
			if c.res.status != http.StatusTooManyRequests {
				t.Errorf("%s: not charged, status %d %q; want 429", what, c.res.status, c.res.body)
				continue
			}
			if reached {
				t.Errorf("%s: 429, yet it reached the upstream", what)
			}
			hi := waitE2ENeedMS(spec, last.state, c.send.UnixMicro())
			lo := waitE2ENeedMS(spec, last.state, c.recv.UnixMicro())
			if hi <= maxWaitMS {
				t.Errorf("%s: 429, but its wait when sent was %d ms ≤ max_wait", what, hi)
			}
			// The deny cache answers repeats from the first denial's
			// deadline, which it counts from just before that Redis call:
			// earlier by that call's latency, well under a refill interval.
			ms := waitE2ERetryAfter(t, what, c.res.header)
			if ms < lo-maxWaitMS-tol.Milliseconds() || ms > hi-maxWaitMS {
				t.Errorf("%s: Retry-After-Ms %d, want its wait less max_wait: %d to %d", what, ms, lo-maxWaitMS, hi-maxWaitMS)
			}
			continue
		}
		last = c
		wait := waitE2EHeldMS(spec, c.state)
		if c.res.status != http.StatusOK || c.res.body != "up "+strconv.Itoa(c.id) {
			t.Errorf("%s: charged (wait %d ms), answered %d %q; want 200 from the upstream", what, wait, c.res.status, c.res.body)
		}
		if !reached {
			t.Errorf("%s: charged, but the upstream never saw it", what)
			continue
		}
		if wait == 0 {
			immediate = append(immediate, c)
			if a.waitMS != -1 {
				t.Errorf("%s: not held, yet X-Wait-Ms %d", what, a.waitMS)
			}
			if a.at.UnixMicro() >= t1+interval.Microseconds() {
				t.Errorf("%s: allowed at once, reached the upstream %v after the first charge", what, time.Duration(a.at.UnixMicro()-t1)*time.Microsecond)
			}
			continue
		}
		held = append(held, c)
		if wait > maxWaitMS {
			t.Errorf("%s: held for %d ms, over max_wait", what, wait)
		}
		if a.waitMS != wait {
			t.Errorf("%s: X-Wait-Ms %d, want %d (the deficit the charge left, in ms of refill)", what, a.waitMS, wait)
		}
		ready := waitE2EReadyUS(spec, c.state)
		late := time.Duration(a.at.UnixMicro()-ready) * time.Microsecond
		lateness = append(lateness, late)
		if late < -waitE2EClockSlack || late >= tol {
			t.Errorf("%s: reached the upstream %v from its slot (its token's refill), want 0 to %v", what, late, tol)
		}
	}

	// The burst of 15: 5 at once, 10 held.
	for k, c := range calls[:burst] {
		switch isHeld := waitE2EHeldMS(spec, c.state) > 0; {
		case !c.charged:
			t.Errorf("request %d of the burst: denied, want it served", k)
		case isHeld != (k >= capacity):
			t.Errorf("request %d of the burst: held %v, want %v (the first %d at once)", k, isHeld, k >= capacity, capacity)
		}
	}
	// Held requests are served in the order they arrived, one per
	// refill interval.
	var gaps []time.Duration
	for i := 1; i < len(held); i++ {
		prev, cur := arrivals[strconv.Itoa(held[i-1].id)], arrivals[strconv.Itoa(held[i].id)]
		gaps = append(gaps, cur.at.Sub(prev.at))
		if !cur.at.After(prev.at) {
			t.Errorf("request %d reached the upstream before request %d, which arrived first", held[i].id, held[i-1].id)
		}
		if slot := waitE2EReadyUS(spec, held[i].state) - waitE2EReadyUS(spec, held[i-1].state); slot != interval.Microseconds() {
			t.Errorf("requests %d and %d: slots %d µs apart, want one token's %v", held[i-1].id, held[i].id, slot, interval)
		}
	}
	if len(denied) == 0 {
		t.Errorf("no request was denied: the burst never needed more than max_wait")
	}
	// Every request is accounted for.
	if n := len(immediate) + len(held) + len(denied); n != total || len(arrivals) != len(immediate)+len(held) {
		t.Errorf("%d at once + %d held + %d denied = %d of %d requests; the upstream saw %d, want %d",
			len(immediate), len(held), len(denied), n, total, len(arrivals), len(immediate)+len(held))
	}
	if v, _ := bucket.DecodeState(g.value(key)); v != last.state {
		t.Errorf("bucket %+v after the burst, want the last charge's %+v: a denial or a release wrote it", v, last.state)
	}
	if len(gaps) == 0 || len(lateness) == 0 {
		t.FailNow()
	}
	minGap, maxGap := slices.Min(gaps), slices.Max(gaps)
	t.Logf("burst of %d sent in %v: %d at once, %d held (waits %d..%d ms), %d denied; gaps between held arrivals %v..%v (want %v ± %v), lateness from slot %v..%v",
		total, calls[total-1].send.Sub(calls[0].send).Round(time.Microsecond), len(immediate), len(held),
		waitE2EHeldMS(spec, held[0].state), waitE2EHeldMS(spec, held[len(held)-1].state), len(denied),
		minGap.Round(time.Microsecond), maxGap.Round(time.Microsecond), interval, tol,
		slices.Min(lateness).Round(time.Microsecond), slices.Max(lateness).Round(time.Microsecond))
}

// waitE2EGatewayRoutes are the routes of a gateway process (see gwSite):
// token_bucket on the Redis at %[1]s with the tier's limits (%[2]s) and
// extra subdirectives (%[3]s) in front of the upstream (%[4]s), passing the
// reservation's wait as X-Wait-Ms.
const waitE2EGatewayRoutes = `
		token_bucket {
			redis redis://%[1]s {
				timeout 10s
				pool_size 64
			}
			dimension user {http.request.header.X-User}
			tier free {
				%[2]s
			}
			%[3]s
			on_redis_error deny
		}
		reverse_proxy %[4]s {
			header_up X-Wait-Ms {http.token_bucket.wait_ms}
		}`

// waitE2EGateway is a running gateway process.
type waitE2EGateway struct {
	url, admin string // admin: "" when off
	port       int
	proc       *soak.Process
}

// waitE2EStartGateways starts n Caddy processes of bin sharing the Redis
// at redisAddr, each with waitE2EGatewayRoutes, and waits until they
// answer. withAdmin gives each an admin endpoint (for /metrics and
// /debug/pprof).
func waitE2EStartGateways(t *testing.T, bin, redisAddr, upstream, limits, extra string, n int, withAdmin bool) []*waitE2EGateway {
	t.Helper()
	dir := t.TempDir()
	gws := make([]*waitE2EGateway, n)
	t.Cleanup(func() {
		for i, g := range gws {
			if g == nil {
				continue
			}
			g.proc.Stop(10 * time.Second)
			if t.Failed() {
				b, _ := os.ReadFile(g.proc.Log)
				if lines := strings.Split(strings.TrimSpace(string(b)), "\n"); len(lines) > 20 {
					b = []byte(strings.Join(lines[len(lines)-20:], "\n"))
				}
				t.Logf("gateway %d's log ends:\n%s", i, b)
			}
		}
	})
	for i := range gws {
		g := &waitE2EGateway{port: redistest.FreePort(t)}
		admin := "admin off"
		if withAdmin {
			g.admin = "http://127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))
			admin = "admin " + strings.TrimPrefix(g.admin, "http://")
		}
		p, err := soak.StartCaddy(bin, dir, fmt.Sprintf("wait-gateway%d", i),
			gwSite(g.port, admin, fmt.Sprintf(waitE2EGatewayRoutes, redisAddr, limits, extra, upstream)))
		if err != nil {
			t.Fatal(err)
		}
		g.proc, g.url = p, "http://127.0.0.1:"+strconv.Itoa(g.port)
		gws[i] = g
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, g := range gws {
		if err := g.proc.WaitHTTP(ctx, g.url+"/healthz"); err != nil {
			b, _ := os.ReadFile(g.proc.Log)
			t.Fatalf("%v\n%s", err, b)
		}
	}
	return gws
}

// waitE2EResult is a request's answer, read by a concurrent client.
type waitE2EResult struct {
	gateway int
	status  int
	header  http.Header
	body    string
	err     error
}

// TestWaitAcrossGatewaysNeverOverAdmits: "user 5 2/s" (a token every
// 500 ms) with on_limit wait 5s, shared by 3 gateway processes on one
// Redis; 60 requests at once, 20 to each. The upstream sees them in the
// slots of the one shared bucket, whatever gateway held them: the k-th
// arrival (k > 5) never precedes t1 + (k-5)·500 ms, where t1 is the first
// charge (derived exactly from the stored bucket, which was full then and
// has been charged once per 200 since), so by any time t at most
// capacity + refill·(t - t1) requests have been admitted; and it arrives
// within its slot, before the next token is due. The slots are long
// enough for the three processes' holds and proxying on a loaded machine
// (a 100 ms slot was overrun by one arrival there). Every request that a
// wait of at most 5 s could serve was served (10 reservations at least,
// and no more than the burst's own spread allows), every other one is 429
// with a Retry-After-Ms from 1 to the next slot's wait less 5 s, and
// every request is answered.
func TestWaitAcrossGatewaysNeverOverAdmits(t *testing.T) {
	const capacity, gateways, perGateway, maxWaitMS = 5, 3, 20, 5000
	interval := 500 * time.Millisecond // one token at 2/s
	tol := interval                    // within its own slot
	bin := gwCaddy(t)
	srv := redistest.Start(t)
	up := startWaitE2EUpstream(t)
	gws := waitE2EStartGateways(t, bin, srv.Addr, up.addr, "user 5 2/s", "on_limit wait 5s", gateways, false)
	spec := llmSpec(t, capacity, "2/s")

	tr := &http.Transport{MaxIdleConnsPerHost: perGateway}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	results := make([]waitE2EResult, gateways*perGateway)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &results[i]
			r.gateway = i % gateways
			req, err := http.NewRequest(http.MethodGet, gws[r.gateway].url+"/", nil)
			if err != nil {
				r.err = err
				return
			}
			req.Header.Set("X-User", "shared")
			req.Header.Set("X-Req", strconv.Itoa(i))
			<-start
			res, err := readResponse(client.Do(req))
			r.status, r.header, r.body, r.err = res.status, res.header, res.body, err
		}()
	}
	burstStart := time.Now()
	close(start)
	wg.Wait()

	rdb := srv.Client(t)
	v, err := rdb.Get(context.Background(), bucket.NewKeyer("rl:", "").Key("user", "shared", "")).Result()
	if err != nil {
		t.Fatal(err)
	}
	st, err := bucket.DecodeState(v)
	if err != nil {
		t.Fatal(err)
	}
	var ok, denied int
	var retryMS []int64
	for i, r := range results {
		what := fmt.Sprintf("request %d (gateway %d)", i, r.gateway)
		switch {
		case r.err != nil:
			t.Fatalf("%s: %v", what, r.err)
		case r.status == http.StatusOK:
			ok++
			if r.body != "up "+strconv.Itoa(i) {
				t.Errorf("%s: body %q", what, r.body)
			}
		case r.status == http.StatusTooManyRequests:
			denied++
			retryMS = append(retryMS, waitE2ERetryAfter(t, what, r.header))
		default:
			t.Errorf("%s: status %d %q, want 200 or 429", what, r.status, r.body)
		}
	}
	// The bucket was full at the first charge and never refilled to full
	// since, so its units are capacity - ok tokens plus the refill since:
	// that gives the first charge's time exactly.
	t1 := st.Last - (st.Units-(capacity-int64(ok))*spec.Scale)/spec.Refill
	if t1 < burstStart.UnixMicro() || t1 > st.Last {
		t.Fatalf("first charge at %d µs, outside the burst [%d, %d]: the bucket %+v is not the %d charges' alone", t1, burstStart.UnixMicro(), st.Last, st, ok)
	}
	heldN := ok - capacity
	span := time.Duration(st.Last-t1) * time.Microsecond
	if denied > 0 && heldN < maxWaitMS/int(interval.Milliseconds()) {
		t.Errorf("%d held and %d denied: a denial while a reservation within %d ms was to be had", heldN, denied, maxWaitMS)
	}
	if most := maxWaitMS/int(interval.Milliseconds()) + int(span/interval); heldN > most {
		t.Errorf("%d held: more than the %d slots within %d ms of the burst (spread over %v)", heldN, most, maxWaitMS, span)
	}
	if denied == 0 {
		t.Errorf("no request was denied: the burst never needed more than max_wait")
	}
	lastSlotWait := int64(heldN+1)*interval.Milliseconds() - maxWaitMS // the wait for the next slot, less max_wait, at t1 at the latest
	for _, ms := range retryMS {
		if ms < 1 || ms > lastSlotWait {
			t.Errorf("429 with Retry-After-Ms %d, want 1 to %d", ms, lastSlotWait)
		}
	}

	arrivals := up.sorted()
	if len(arrivals) != ok {
		t.Errorf("the upstream saw %d requests, want the %d answered 200", len(arrivals), ok)
	}
	var gaps, lateness []time.Duration
	for k, a := range arrivals {
		if id, _ := strconv.Atoi(a.id); results[id].status != http.StatusOK {
			t.Errorf("request %s reached the upstream but was answered %d", a.id, results[id].status)
		}
		at := a.at.UnixMicro()
		if k < capacity {
			if at < t1 || at >= t1+interval.Microseconds() {
				t.Errorf("arrival %d at %v from the first charge, want within the first %v: served at once", k+1, time.Duration(at-t1)*time.Microsecond, interval)
			}
			continue
		}
		if a.waitMS < 1 || a.waitMS > maxWaitMS {
			t.Errorf("arrival %d (request %s): X-Wait-Ms %d, want 1 to %d", k+1, a.id, a.waitMS, maxWaitMS)
		}
		slot := t1 + int64(k+1-capacity)*interval.Microseconds()
		late := time.Duration(at-slot) * time.Microsecond
		lateness = append(lateness, late)
		if late < -waitE2EClockSlack {
			t.Errorf("arrival %d at %v from the first charge: %v before the refill allows %d requests: over-admitted",
				k+1, time.Duration(at-t1)*time.Microsecond, -late, k+1)
		} else if late >= tol {
			t.Errorf("arrival %d: %v after its slot, want at most %v", k+1, late, tol)
		}
		if k > capacity {
			gaps = append(gaps, a.at.Sub(arrivals[k-1].at))
		}
	}
	if len(gaps) == 0 || len(retryMS) == 0 {
		t.FailNow()
	}
	t.Logf("%d requests on %d gateways: %d at once, %d held, %d denied (Retry-After-Ms %d..%d); charges spread over %v; gaps between held arrivals %v..%v, lateness from slot %v..%v",
		len(results), gateways, capacity, heldN, denied, slices.Min(retryMS), slices.Max(retryMS), span,
		slices.Min(gaps).Round(time.Microsecond), slices.Max(gaps).Round(time.Microsecond),
		slices.Min(lateness).Round(time.Microsecond), slices.Max(lateness).Round(time.Microsecond))
}

// leavingRequest sends a request whose client will leave (when ctx is
// canceled) in a goroutine, and returns where its end is sent: the
// client's error, or "answered <status>" when it was answered after all.
func leavingRequest(ctx context.Context, g *e2eGateway, method, path, body string, headers ...string) <-chan error {
	done := make(chan error, 1)
	go func() {
		req, err := http.NewRequestWithContext(ctx, method, g.url+path, strings.NewReader(body))
		if err == nil {
			for i := 0; i+1 < len(headers); i += 2 {
				req.Header.Set(headers[i], headers[i+1])
			}
			var res *http.Response
			if res, err = g.client.Do(req); err == nil {
				res.Body.Close()
				err = fmt.Errorf("answered %d", res.StatusCode)
			}
		}
		done <- err
	}()
	return done
}

// TestWaitClientLeavesGetsReservationBack: "user 2 1/s" and, as the
// control, "ctl 2 1/s" on another header, with on_limit wait 3s. Two
// requests carry both headers and empty both buckets in the same script
// calls (so the two have one history, to the microsecond). R1 carries
// only X-User: it is held with a reservation of about 1 s on the user
// bucket. R2 carries both: it is held behind R1 (about 2 s). R1's client
// goes away: the gateway gives its reservation back, and the user bucket
// is then exactly the control bucket (refilled to the refund's time): as
// if R1 had never come, though R2's reservation stands on top of it. R1
// never reaches the upstream (R2, whose slot is after R1's, does), and the
// refund happens once: after R2 is served, the two buckets still match.
// The metrics count R1's token charged on the user bucket and given back.
func TestWaitClientLeavesGetsReservationBack(t *testing.T) {
	up := startWaitE2EUpstream(t)
	tier := uniqueTier("leaver")
	g := startGateway(t, strings.Replace(waitE2ESite(up.addr, "user 2 1/s\n\t\t\tctl 2 1/s", "on_limit wait 3s"), "tier free", "tier "+tier, 1))
	spec := llmSpec(t, 2, "1/s")
	keyer := bucket.NewKeyer("rl:", "")
	userKey, ctlKey := keyer.Key("user", "leaver", ""), keyer.Key("ctl", "control", "")
	state := func(key string) bucket.State {
		t.Helper()
		st, err := bucket.DecodeState(g.value(key))
		if err != nil {
			t.Fatalf("%s: %v", key, err)
		}
		return st
	}
	// changed polls key until its value is no longer prev.
	changed := func(what, key, prev string) bucket.State {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			switch v := g.value(key); {
			case v == "":
				t.Fatalf("%s: %s expired (the bucket refilled) without the write awaited", what, key)
			case v != prev:
				return state(key)
			case time.Now().After(deadline):
				t.Fatalf("%s: %s unchanged after 30s", what, key)
			}
			time.Sleep(200 * time.Microsecond) // polling; nothing is timed by it
		}
	}
	// The user bucket, refilled to at, is the control's.
	same := func(what string, user, ctl bucket.State) {
		t.Helper()
		at := max(user.Last, ctl.Last)
		refilled := func(st bucket.State) int64 {
			return min(spec.CapacityUnits(), st.Units+(at-st.Last)*spec.Refill)
		}
		if u, c := refilled(user), refilled(ctl); u != c || user.Scale != ctl.Scale {
			t.Errorf("%s: user bucket %+v holds %d units at %d µs, the control %+v %d: want them equal", what, user, u, at, ctl, c)
		}
	}
	both := []string{"X-User", "leaver", "X-Ctl", "control"}
	for k := 0; k < 2; k++ {
		if r := g.get(append(both, "X-Req", "p"+strconv.Itoa(k))...); r.status != http.StatusOK {
			t.Fatalf("request p%d: %d %q", k, r.status, r.body)
		}
	}
	if u, c := state(userKey), state(ctlKey); u != c || u.Units >= spec.Scale {
		t.Fatalf("after two requests on both: user %+v, control %+v; want one state, under a token", u, c)
	}

	// R1, on the user bucket alone, is held; its client will leave.
	controlRaw, userRaw := g.value(ctlKey), g.value(userKey)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r1done := leavingRequest(ctx, g, http.MethodGet, "", "", "X-User", "leaver", "X-Req", "r1")
	afterR1 := changed("R1", userKey, userRaw)
	r1Wait := waitE2EHeldMS(spec, afterR1)
	if r1Wait == 0 || g.value(ctlKey) != controlRaw {
		t.Fatalf("R1: user bucket %+v (wait %d ms), control changed %v; want R1 held on the user bucket alone", afterR1, r1Wait, g.value(ctlKey) != controlRaw)
	}

	// R2, on both, is held behind R1.
	type answer struct {
		res e2eResponse
		err error
	}
	r2done := make(chan answer, 1)
	go func() {
		res, err := g.tryGet(append(both, "X-Req", "r2")...)
		r2done <- answer{res, err}
	}()
	ctlAfterR2 := changed("R2", ctlKey, controlRaw)
	userAfterR2 := state(userKey)
	if userAfterR2.Last != ctlAfterR2.Last || waitE2EHeldMS(spec, userAfterR2) <= r1Wait {
		t.Fatalf("R2: user %+v, control %+v; want both charged in one call, R2 held after R1", userAfterR2, ctlAfterR2)
	}

	// R1's client leaves: its reservation comes back.
	userRaw = g.value(userKey)
	cancel()
	if err := <-r1done; err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Errorf("R1's client: %v, want its own cancellation", err)
	}
	refunded := changed("R1's refund", userKey, userRaw)
	same("after R1 left", refunded, ctlAfterR2)
	if refunded.Last < userAfterR2.Last {
		t.Errorf("refund at %d µs, before R2's charge at %d", refunded.Last, userAfterR2.Last)
	}

	// R2 is served at its own time; R1 never reaches the upstream, though
	// its slot came first.
	select {
	case a := <-r2done:
		if a.err != nil || a.res.status != http.StatusOK || a.res.body != "up r2" {
			t.Fatalf("R2: %v %d %q, want 200 from the upstream", a.err, a.res.status, a.res.body)
		}
	case <-time.After(time.Minute):
		t.Fatal("R2: no answer in a minute")
	}
	seen := up.seen()
	if _, ok := seen["r1"]; ok {
		t.Errorf("R1 reached the upstream after its client left")
	}
	if len(seen) != 3 {
		t.Errorf("the upstream saw %d requests, want p0, p1 and r2", len(seen))
	}
	// Given back once: nothing was written since.
	if u := state(userKey); u != refunded {
		t.Errorf("user bucket %+v after R2, want the refund's %+v unchanged", u, refunded)
	}
	same("after R2 was served", state(userKey), state(ctlKey))
	tokens := func(metric, dim string) string {
		return series("caddy_token_bucket_tokens_"+metric+"_total", "tier", tier, "dimension", dim, "unit", "requests")
	}
	// R1's handler counts the refund once Redis has answered it.
	var m metricSet
	redistest.WaitFor(t, time.Minute, "R1's refund in the metrics", func() error {
		if m = scrape(t); m[tokens("refunded", "user")] == 0 {
			return errors.New("not counted yet")
		}
		return nil
	})
	m.want(t, "after R2 was served", check{tokens("charged", "user"), 4}, check{tokens("refunded", "user"), 1},
		check{tokens("charged", "ctl"), 3}, check{tokens("refunded", "ctl"), 0})
	t.Logf("R1 held %d ms, R2 %d ms; refund %v after R2's charge; user bucket after it %+v, control %+v",
		r1Wait, waitE2EHeldMS(spec, userAfterR2), time.Duration(refunded.Last-userAfterR2.Last)*time.Microsecond, refunded, ctlAfterR2)
}

// TestWaitBeyondMaxWaitingDeniedAsReject: "user 1 1/s", on_limit wait 5s,
// max_waiting 1. The first request takes the token; the second is held
// (about 1 s) and fills the one place; the third, which a 5 s wait could
// serve (about 2 s), finds no place and is denied as on_limit reject
// denies: 429 at once, no charge, and Retry-After-Ms the time until the
// bucket has its token (its whole wait: nothing shortens it, as it was
// offered no reservation). Once the held request is served, a fourth finds
// the place free and is held, though the third's wait has not run out.
func TestWaitBeyondMaxWaitingDeniedAsReject(t *testing.T) {
	up := startWaitE2EUpstream(t)
	g := startGateway(t, waitE2ESite(up.addr, "user 1 1/s", "on_limit wait 5s\n\t\tmax_waiting 1"))
	spec := llmSpec(t, 1, "1/s")
	key := bucket.NewKeyer("rl:", "").Key("user", "placed", "")
	calls := waitE2EDispatch(t, g, key, spec, 2, "X-User", "placed")
	if !calls[1].charged || waitE2EHeldMS(spec, calls[1].state) == 0 {
		t.Fatalf("request 1: charged %v, bucket %+v; want it held", calls[1].charged, calls[1].state)
	}
	before := time.Now()
	r := g.get("X-User", "placed", "X-Req", "third")
	after := time.Now()
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("third request: %d %q, want 429 (max_waiting 1 is taken)", r.status, r.body)
	}
	held := calls[1].state
	hi, lo := waitE2ENeedMS(spec, held, before.UnixMicro()), waitE2ENeedMS(spec, held, after.UnixMicro())
	if hi > 5000 {
		t.Fatalf("the third request's wait is %d ms, over max_wait: the test needs one a reservation could serve", hi)
	}
	ms := waitE2ERetryAfter(t, "third request", r.header)
	if ms < lo || ms > hi {
		t.Errorf("third request: Retry-After %q, Retry-After-Ms %d; want as on_limit reject: its wait, %d to %d ms",
			r.header.Get("Retry-After"), ms, lo, hi)
	}
	if st, _ := bucket.DecodeState(g.value(key)); st != held {
		t.Errorf("the denial wrote the bucket: %+v, then %+v", held, st)
	}
	waitE2EWaitAll(t, calls, time.Minute)

	// The place is free again while the third request's wait still runs: a
	// fourth is held and served, not denied from the deny cache, which kept
	// the third's denial less max_wait (here, not at all).
	if time.Since(before) >= time.Duration(lo)*time.Millisecond {
		t.Fatalf("request 1 ended %v after the third request, past its wait of %d ms: the fourth would be allowed anyway", time.Since(before), lo)
	}
	if r := g.get("X-User", "placed", "X-Req", "fourth"); r.status != http.StatusOK || r.body != "up fourth" {
		t.Errorf("fourth request, with the place free: %d %q, want 200 from the upstream", r.status, r.body)
	}
	if n := len(up.seen()); n != 3 {
		t.Errorf("the upstream saw %d requests, want the 3 allowed", n)
	}
}

// ---------------------------------------------------------------------------
// A flood of clients, each on its own connection, from one goroutine.

// waitE2EFloodAnswer is what one flood client got.
type waitE2EFloodAnswer struct {
	status int
	header http.Header
	err    error
	done   time.Time
}

// waitE2EFlooder is n HTTP/1.1 clients to 127.0.0.1, each on its own
// keep-alive connection, run from the test's goroutine with epoll rather
// than a goroutine each (the race detector allows 8128 goroutines).
type waitE2EFlooder struct {
	t       *testing.T
	epfd    int
	fds     []int
	client  map[int]int // fd to client, while its answer is awaited
	bufs    [][]byte
	answers []waitE2EFloodAnswer
	waiting int
}

func newWaitE2EFlooder(t *testing.T, n int) *waitE2EFlooder {
	t.Helper()
	epfd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := &waitE2EFlooder{t: t, epfd: epfd, fds: make([]int, n), client: map[int]int{},
		bufs: make([][]byte, n), answers: make([]waitE2EFloodAnswer, n)}
	for i := range f.fds {
		f.fds[i] = -1
	}
	t.Cleanup(f.close)
	return f
}

// connect opens the connections to port in chunks of chunk, each chunk
// once every connection of the one before is established and accepted
// (accepted(opened) returns once the gateway has taken opened
// connections), so that the listen backlog never overflows.
func (f *waitE2EFlooder) connect(port, chunk int, accepted func(opened int) error) {
	t := f.t
	t.Helper()
	addr := &syscall.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}
	events := make([]syscall.EpollEvent, 1024)
	for from := 0; from < len(f.fds); from += chunk {
		to := min(from+chunk, len(f.fds))
		for i := from; i < to; i++ {
			fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatalf("socket %d: %v", i, err)
			}
			f.fds[i], f.client[fd] = fd, i
			if err := syscall.Connect(fd, addr); err != nil && err != syscall.EINPROGRESS {
				t.Fatalf("connect %d: %v", i, err)
			}
			ev := syscall.EpollEvent{Events: syscall.EPOLLOUT, Fd: int32(fd)}
			if err := syscall.EpollCtl(f.epfd, syscall.EPOLL_CTL_ADD, fd, &ev); err != nil {
				t.Fatalf("epoll_ctl %d: %v", i, err)
			}
		}
		deadline := time.Now().Add(30 * time.Second)
		for pending := to - from; pending > 0; {
			if time.Now().After(deadline) {
				t.Fatalf("%d connections of %d..%d not established in 30s", pending, from, to)
			}
			m, err := syscall.EpollWait(f.epfd, events, 100)
			if err != nil && err != syscall.EINTR {
				t.Fatalf("epoll_wait: %v", err)
			}
			for _, ev := range events[:max(m, 0)] {
				fd := int(ev.Fd)
				if i := f.client[fd]; i < from {
					t.Fatalf("connection %d: the gateway closed it while idle (events %#x)", i, ev.Events)
				}
				if soErr, err := syscall.GetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_ERROR); err != nil || soErr != 0 {
					t.Fatalf("connect %d: %v %v", f.client[fd], syscall.Errno(soErr), err)
				}
				// Established: from now on, wait for its answer.
				mod := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP, Fd: ev.Fd}
				if err := syscall.EpollCtl(f.epfd, syscall.EPOLL_CTL_MOD, fd, &mod); err != nil {
					t.Fatal(err)
				}
				pending--
			}
		}
		if err := accepted(to); err != nil {
			t.Fatal(err)
		}
	}
}

// send writes each client's request, req(i), as fast as it can: the
// requests of all clients are then in flight at once.
func (f *waitE2EFlooder) send(req func(i int) []byte) {
	f.t.Helper()
	for i, fd := range f.fds {
		b := req(i)
		if w, err := syscall.Write(fd, b); err != nil || w != len(b) {
			f.t.Fatalf("client %d: wrote %d of %d bytes: %v", i, w, len(b), err)
		}
	}
	f.waiting = len(f.fds)
}

// read reads every client's answer to its end (its Content-Length), and
// returns when all are answered or after limit. left is called each time
// the number of clients still waiting falls.
func (f *waitE2EFlooder) read(limit time.Duration, left func(int)) {
	events := make([]syscall.EpollEvent, 1024)
	chunk := make([]byte, 4096)
	answered := func(i int, err error) {
		delete(f.client, f.fds[i])
		// The connection stays open (keep-alive), but is no longer read.
		_ = syscall.EpollCtl(f.epfd, syscall.EPOLL_CTL_DEL, f.fds[i], nil)
		f.answers[i].done, f.answers[i].err = time.Now(), err
		f.bufs[i] = nil
		f.waiting--
		if left != nil {
			left(f.waiting)
		}
	}
	// complete parses the answer so far: ok when it is whole.
	complete := func(i int) bool {
		res, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(f.bufs[i])), nil)
		if err != nil {
			return false
		}
		defer res.Body.Close()
		if _, err := io.Copy(io.Discard, res.Body); err != nil {
			return false
		}
		f.answers[i].status, f.answers[i].header = res.StatusCode, res.Header
		return true
	}
	deadline := time.Now().Add(limit)
	for f.waiting > 0 && time.Now().Before(deadline) {
		m, err := syscall.EpollWait(f.epfd, events, 50)
		if err != nil && err != syscall.EINTR {
			f.t.Fatalf("epoll_wait: %v", err)
		}
		for _, ev := range events[:max(m, 0)] {
			i, open := f.client[int(ev.Fd)]
			if !open {
				continue
			}
			for {
				r, err := syscall.Read(f.fds[i], chunk)
				if r > 0 {
					f.bufs[i] = append(f.bufs[i], chunk[:r]...)
					if complete(i) {
						answered(i, nil)
						break
					}
					continue
				}
				switch {
				case err == syscall.EINTR:
					continue
				case err == syscall.EAGAIN:
				case err != nil:
					answered(i, fmt.Errorf("read: %v", err))
				default:
					answered(i, fmt.Errorf("connection closed after %d bytes, without a whole answer", len(f.bufs[i])))
				}
				break
			}
		}
	}
	for _, i := range f.client {
		answered(i, fmt.Errorf("no answer within %v", limit))
	}
}

// close closes every connection.
func (f *waitE2EFlooder) close() {
	for i, fd := range f.fds {
		if fd >= 0 {
			syscall.Close(fd)
			f.fds[i] = -1
		}
	}
	if f.epfd >= 0 {
		syscall.Close(f.epfd)
		f.epfd = -1
	}
}

// waitE2EMetrics reads unlabelled samples from a gateway's admin
// endpoint's /metrics, in the order of names.
func waitE2EMetrics(admin string, names ...string) ([]float64, error) {
	m, err := waitE2EAdminGet(admin, "/metrics")
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(names))
	for i, name := range names {
		found := false
		for _, line := range strings.Split(m, "\n") {
			if v, ok := strings.CutPrefix(line, name+" "); ok {
				if out[i], err = strconv.ParseFloat(strings.TrimSpace(v), 64); err != nil {
					return nil, err
				}
				found = true
				break
			}
		}
		if !found {
			return nil, fmt.Errorf("no %s in /metrics", name)
		}
	}
	return out, nil
}

// waitE2EGoroutines reads a gateway's goroutine count (go_goroutines:
// runtime.NumGoroutine, which, unlike a goroutine profile, does not stop
// the gateway to walk 10,000 stacks).
func waitE2EGoroutines(admin string) (int, error) {
	v, err := waitE2EMetrics(admin, "go_goroutines")
	if err != nil {
		return 0, err
	}
	return int(v[0]), nil
}

// waitE2EHeap reads a gateway's live heap (HeapAlloc) after two garbage
// collections (the second frees what the first left in sync.Pools'
// victim caches: net/http's bufio pools among them).
func waitE2EHeap(admin string) (int64, error) {
	var h string
	for range 2 {
		var err error
		if h, err = waitE2EAdminGet(admin, "/debug/pprof/heap?gc=1&debug=1"); err != nil {
			return 0, err
		}
	}
	for _, line := range strings.Split(h, "\n") {
		if v, ok := strings.CutPrefix(line, "# HeapAlloc = "); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("no HeapAlloc in the heap profile")
}

func waitE2EAdminGet(admin, path string) (string, error) {
	res, err := (&http.Client{Timeout: 30 * time.Second}).Get(admin + path)
	if err != nil {
		return "", err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: status %d", path, res.StatusCode)
	}
	return string(b), err
}

// TestWaitMaxWaitingBoundsAFlood: one gateway process, "user 1 20/s"
// (a token every 50 ms) with on_limit wait 5s, whose reservations alone
// would hold 100 requests at once, and max_waiting 50. 10,000 clients
// connect, each on its own keep-alive connection, and then all send their
// request at once, for the one identity. Every client is answered, 200 or
// 429, and the 200s are exactly the requests the upstream saw.
//
// Never more than 50 are held at once: a reservation's wait is its
// bucket's deficit, and the deficit is at most the reservations not yet
// due, each of which this gateway holds until its token is paid for; so
// with at most 50 places no wait exceeds 50 tokens at 20/s = 2500 ms,
// where the 100 reservations of max_wait alone would reach 5000 ms (and
// do, whatever the load, were max_waiting ignored). The gauge of places
// taken, caddy_token_bucket_waiting, sampled every 20 ms through the
// flood, peaks at exactly 50, and is 0 once every client is answered. (A
// place is taken before the Redis call, and under the flood every
// request queues for Redis: on a loaded machine some places are held by
// requests still waiting for their decision, and the reservations
// outstanding at once, which the waits measure, stay below 50.)
//
// The gateway's goroutines and heap do not grow with the clients beyond
// their connections. With the 10,000 connections open and idle it runs G
// goroutines (one per connection) with a live heap of H. Once at most 50
// clients wait for an answer: at most G + 4·50 + 100 goroutines (a held
// request's background read, and its upstream connection's two). Once
// all are answered: at most G + 2·50 + 100 (upstream connections may
// still be closing), and a live heap of at most H + 32 MiB (3.3 KB a
// client, less than one request's state: nothing of a request is kept;
// measured 13 to 26 MiB, of which about 5 are the Go runtime's
// descriptors of the requests' goroutines, 480 B each, kept for reuse,
// 3 the connections' contexts' child maps, left allocated by a request
// and freed with the connection, and 4 the 64 Redis connections'
// buffers). Once the clients have gone: within 100 goroutines and 24 MiB
// of the idle process's (measured 10 to 15 MiB: about 10 are goroutine
// descriptors, as the flood ran up to two goroutines per client, its
// connection's and its request's; a few the Redis connections').
func TestWaitMaxWaitingBoundsAFlood(t *testing.T) {
	const (
		clients    = 10_000
		maxWaiting = 50
		perSecond  = 20
		perPlace   = 4
		slack      = 100
		heapServed = 32 << 20 // over the connected process, once every client is answered
		heapGone   = 24 << 20 // over the idle process, once the clients have gone
	)
	bin := gwCaddy(t)
	srv := redistest.Start(t)
	up := startWaitE2EUpstream(t)
	gw := waitE2EStartGateways(t, bin, srv.Addr, up.addr, "user 1 20/s", "on_limit wait 5s\n\t\t\tmax_waiting 50", 1, true)[0]

	idleG, err := waitE2EGoroutines(gw.admin)
	if err != nil {
		t.Fatal(err)
	}
	idleHeap, err := waitE2EHeap(gw.admin)
	if err != nil {
		t.Fatal(err)
	}
	idleRSS := int64(soak.RSS(gw.proc.Pid()))

	f := newWaitE2EFlooder(t, clients)
	connectStart := time.Now()
	f.connect(gw.port, 1000, func(opened int) error {
		deadline := time.Now().Add(30 * time.Second)
		for {
			g, err := waitE2EGoroutines(gw.admin)
			// A few of the idle process's goroutines may have ended since:
			// close enough to all accepted (a chunk is far below the
			// listen backlog of 4096, so the next one cannot overflow it).
			if err != nil || g >= idleG+opened-32 {
				return err
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the gateway runs %d goroutines, not the %d + %d of the connections opened", g, idleG, opened)
			}
			time.Sleep(5 * time.Millisecond) // polling for the accepts; nothing is timed by it
		}
	})
	connected := time.Since(connectStart)
	connG, err := waitE2EGoroutines(gw.admin)
	if err != nil {
		t.Fatal(err)
	}
	connHeap, err := waitE2EHeap(gw.admin)
	if err != nil {
		t.Fatal(err)
	}

	// Sample the goroutines through the flood (the peak), and once at most
	// maxWaiting clients are left (the epoll loop waits for that sample).
	var (
		mu        sync.Mutex
		peakG     int
		peakHeld  float64 // caddy_token_bucket_waiting: the places taken
		samples   int
		sampleErr error
		tailG     = -1
		tailLeft  int
		floodDone = make(chan struct{})
	)
	var sampler sync.WaitGroup
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		for {
			select {
			case <-floodDone:
				return
			case <-time.After(20 * time.Millisecond): // sampling interval; nothing is timed by it
			}
			v, err := waitE2EMetrics(gw.admin, "go_goroutines", "caddy_token_bucket_waiting")
			mu.Lock()
			if err != nil {
				sampleErr = err
			} else {
				peakG, peakHeld, samples = max(peakG, int(v[0])), max(peakHeld, v[1]), samples+1
			}
			mu.Unlock()
		}
	}()
	start := time.Now()
	f.send(func(i int) []byte {
		return []byte("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-User: flood\r\nX-Req: " + strconv.Itoa(i) + "\r\n\r\n")
	})
	sent := time.Since(start)
	f.read(time.Minute, func(left int) {
		if left <= maxWaiting && tailG < 0 {
			g, err := waitE2EGoroutines(gw.admin)
			if err != nil {
				t.Fatalf("goroutines with %d clients left: %v", left, err)
			}
			tailG, tailLeft = g, left
		}
	})
	elapsed := time.Since(start)
	close(floodDone)
	sampler.Wait()
	answeredG, err := waitE2EGoroutines(gw.admin)
	if err != nil {
		t.Fatal(err)
	}
	answeredHeap, err := waitE2EHeap(gw.admin)
	if err != nil {
		t.Fatal(err)
	}
	answeredRSS := int64(soak.RSS(gw.proc.Pid()))
	v, err := waitE2EMetrics(gw.admin, "caddy_token_bucket_waiting")
	if err != nil {
		t.Fatal(err)
	}
	heldAfter := v[0]

	var ok, denied int
	for i, a := range f.answers {
		switch {
		case a.err != nil:
			t.Errorf("client %d: %v", i, a.err)
		case a.status == http.StatusOK:
			ok++
		case a.status == http.StatusTooManyRequests:
			denied++
			if ms, err := strconv.ParseInt(a.header.Get("Retry-After-Ms"), 10, 64); err != nil || ms < 1 || a.header.Get("Retry-After") == "" {
				t.Errorf("client %d: 429 with Retry-After %q, Retry-After-Ms %q", i, a.header.Get("Retry-After"), a.header.Get("Retry-After-Ms"))
			}
		default:
			t.Errorf("client %d: status %d, want 200 or 429", i, a.status)
		}
	}
	if t.Failed() {
		t.FailNow()
	}

	arrivals := up.sorted()
	if len(arrivals) != ok {
		t.Errorf("the upstream saw %d requests, want the %d answered 200", len(arrivals), ok)
	}
	boundMS := int64(maxWaiting * 1000 / perSecond)
	var maxWait int64
	for _, a := range arrivals {
		maxWait = max(maxWait, a.waitMS)
		if id, _ := strconv.Atoi(a.id); f.answers[id].status != http.StatusOK {
			t.Errorf("request %s reached the upstream but was answered %d", a.id, f.answers[id].status)
		}
	}
	if maxWait > boundMS {
		t.Errorf("a reservation waited %d ms: more than the %d ms of %d places at %d/s, so more than %d were held at once", maxWait, boundMS, maxWaiting, perSecond, maxWaiting)
	}
	mu.Lock()
	// Never more than max_waiting; the samples, taken between scrapes,
	// may miss the instant every place is taken, so the flood is only
	// required to have taken at least half of them.
	if peakHeld > maxWaiting || peakHeld < maxWaiting/2 {
		t.Errorf("caddy_token_bucket_waiting peaked at %v in %d samples, want at most %d and at least %d: never more, and the flood takes the places", peakHeld, samples, maxWaiting, maxWaiting/2)
	}
	mu.Unlock()
	if heldAfter != 0 {
		t.Errorf("caddy_token_bucket_waiting is %v once every client was answered, want 0", heldAfter)
	}
	// An estimate from the upstream's side: the most of the intervals
	// [arrival - wait, arrival], each a held request's hold shifted by
	// its proxying latency, that overlap.
	var overlap int
	for _, a := range arrivals {
		if a.waitMS <= 0 {
			continue
		}
		from, n := a.at.Add(-time.Duration(a.waitMS)*time.Millisecond), 0
		for _, b := range arrivals {
			if b.waitMS > 0 && !b.at.Add(-time.Duration(b.waitMS)*time.Millisecond).After(from) && b.at.After(from) {
				n++
			}
		}
		overlap = max(overlap, n)
	}

	// The clients leave; the gateway's goroutines go back to idle.
	f.close()
	deadline := time.Now().Add(30 * time.Second)
	goneG := -1
	for {
		if goneG, err = waitE2EGoroutines(gw.admin); err != nil {
			t.Fatal(err)
		}
		if goneG <= idleG+slack || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // polling for the connections to close; nothing is timed by it
	}
	goneHeap, err := waitE2EHeap(gw.admin)
	if err != nil {
		t.Fatal(err)
	}

	mu.Lock()
	defer mu.Unlock()
	if sampleErr != nil {
		t.Errorf("sampling the goroutines: %v", sampleErr)
	}
	if connG < idleG+clients-32 {
		t.Errorf("%d goroutines with the %d connections open, want about %d + %d", connG, clients, idleG, clients)
	}
	if tailG < 0 {
		t.Errorf("no goroutine sample was taken with at most %d clients left", maxWaiting)
	} else if tailG > connG+perPlace*maxWaiting+slack {
		t.Errorf("%d goroutines with %d clients left, want at most %d (connections) + %d·%d + %d", tailG, tailLeft, connG, perPlace, maxWaiting, slack)
	}
	if answeredG > connG+2*maxWaiting+slack {
		t.Errorf("%d goroutines once every client was answered, want at most %d (connections) + 2·%d + %d", answeredG, connG, maxWaiting, slack)
	}
	if answeredHeap > connHeap+heapServed {
		t.Errorf("live heap %.1f MiB once every client was answered, want at most %.1f (connections) + %d MiB", float64(answeredHeap)/(1<<20), float64(connHeap)/(1<<20), heapServed>>20)
	}
	if goneG > idleG+slack {
		t.Errorf("%d goroutines after the clients left, want at most %d idle + %d", goneG, idleG, slack)
	}
	if goneHeap > idleHeap+heapGone {
		t.Errorf("live heap %.1f MiB after the clients left, want at most %.1f idle + %d MiB", float64(goneHeap)/(1<<20), float64(idleHeap)/(1<<20), heapGone>>20)
	}
	mib := func(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
	t.Logf("%d connections in %v; requests written in %v, all answered %v after the first: %d × 200, %d × 429; longest reservation %d ms (bound %d); most overlapping holds seen upstream ≈ %d",
		clients, connected.Round(time.Millisecond), sent.Round(time.Millisecond), elapsed.Round(time.Millisecond), ok, denied, maxWait, boundMS, overlap)
	t.Logf("gateway goroutines: idle %d, connected %d, peak sampled %d, with %d clients left %d, all answered %d, clients gone %d; places taken (caddy_token_bucket_waiting): peak %v in %d samples, after %v",
		idleG, connG, peakG, tailLeft, tailG, answeredG, goneG, peakHeld, samples, heldAfter)
	t.Logf("gateway live heap: idle %s, connected %s, all answered %s, clients gone %s; RSS idle %s, all answered %s",
		mib(idleHeap), mib(connHeap), mib(answeredHeap), mib(goneHeap), mib(idleRSS), mib(answeredRSS))
}

// waitPlacesHandler is a handler in this process, deciding through proxy
// with pipeline off (each call on its own connection, so that one reply
// held by the proxy holds no other): "user 1 1/5s", on_limit wait 10s,
// max_waiting 1.
func waitPlacesHandler(t *testing.T, proxy *redistest.Proxy) *Handler {
	off := false
	h := foHandler(&RedisConfig{Address: []string{proxy.Addr}, Timeout: caddy.Duration(30 * time.Second), Pipeline: &off}, PolicyDeny, 1)
	h.Tiers[0].Limits[0].RefillRate = 0.2 // a token every 5 s
	h.OnLimit, h.MaxWait, h.MaxWaiting = LimitWait, caddy.Duration(10*time.Second), 1
	return provisionHandler(t, h)
}

// TestWaitDecidedAgainWhenAPlaceFrees: with max_waiting 1, another
// client's request, which will not be held, takes the one place while
// Redis decides it (its reply held up by the network for 1 s). A request
// that a hold would serve comes meanwhile: it is decided without a
// reservation and denied (its reply held up for 3 s); the place has freed
// by then, so it is decided again with one, held, and served. It used to
// be answered 429.
func TestWaitDecidedAgainWhenAPlaceFrees(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t)
	proxy.SetTarget(srv.Addr)
	h := waitPlacesHandler(t, proxy)
	if r := serveUser(h, "held"); r.status != http.StatusOK {
		t.Fatalf("first request: %d", r.status)
	}
	sent := func(what string) {
		t.Helper()
		redistest.WaitFor(t, 10*time.Second, what, func() error {
			if proxy.Armed() {
				return errors.New("not yet")
			}
			return nil
		})
	}
	proxy.DelayReplyTo("evalsha", time.Second)
	busy := make(chan served, 1)
	go func() { busy <- serveUser(h, "busy") }()
	sent("the other client's call to be sent")
	if n := h.waiting.Load(); n != 1 {
		t.Fatalf("%d places taken while the other request is decided, want 1", n)
	}
	proxy.DelayReplyTo("evalsha", 3*time.Second)
	held := make(chan served, 1)
	go func() { held <- serveUser(h, "held") }()
	sent("the first call of the request a hold serves")
	if r := <-busy; r.status != http.StatusOK || !r.passed {
		t.Fatalf("the other client's request: %d, want 200", r.status)
	}
	if r := <-held; r.status != http.StatusOK || !r.passed {
		t.Errorf("the request a hold serves: %d (passed on %v, Retry-After %q); want held, then served", r.status, r.passed, r.header.Get("Retry-After"))
	}
	if n := h.waiting.Load(); n != 0 {
		t.Errorf("%d places taken after every request ended, want 0", n)
	}
}

// TestWaitClientWithBodyLeaves: a POST held by a requests limit, whose
// body nothing has read, and whose client goes away while it is held: the
// gateway notices (net/http watches an HTTP/1.1 connection only once the
// request's body is read), gives the reservation back and never sends the
// request upstream. It used to hold it to the end, then send it.
func TestWaitClientWithBodyLeaves(t *testing.T) {
	up := startWaitE2EUpstream(t)
	g := startGateway(t, waitE2ESite(up.addr, "user 1 1/2s", "on_limit wait 5s"))
	spec := llmSpec(t, 1, "1/2s")
	key := bucket.NewKeyer("rl:", "").Key("user", "poster", "")
	if r := g.get("X-User", "poster", "X-Req", "p0"); r.status != http.StatusOK {
		t.Fatalf("first request: %d", r.status)
	}
	before := g.value(key)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := leavingRequest(ctx, g, http.MethodPost, "v1/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}]}`,
		"X-User", "poster", "X-Req", "r1")
	poll := func(what string, ok func(v string) bool) string {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			v := g.value(key)
			if ok(v) {
				return v
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the bucket is %x after 30s", what, v)
			}
			time.Sleep(200 * time.Microsecond) // polling; nothing is timed by it
		}
	}
	held := poll("the hold", func(v string) bool { return v != before })
	st, err := bucket.DecodeState(held)
	if err != nil || waitE2EHeldMS(spec, st) == 0 {
		t.Fatalf("R1: bucket %+v (%v), want it held", st, err)
	}
	cancel()
	if err := <-done; err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Errorf("R1's client: %v, want its own cancellation", err)
	}
	// Given back: the bucket is not below zero (or, on a machine slow
	// enough, refilled to full: no key). A request still held would keep
	// it below zero until its slot, then reach the upstream.
	poll("the refund", func(v string) bool {
		st, err := bucket.DecodeState(v)
		return v == "" || (v != held && err == nil && st.Units >= 0)
	})
	if _, ok := up.seen()["r1"]; ok {
		t.Errorf("R1 reached the upstream after its client left")
	}
}

// heldPartialPost empties user's one-token bucket (spec) with a GET, then
// opens a connection to g and sends a POST for user with 10 of the 100
// bytes of body its Content-Length promises, and waits until on_limit wait
// holds it with a reservation of at least minMS. It returns the connection
// (closed at the end of the test) and the bucket's value after the charge.
func heldPartialPost(t *testing.T, g *e2eGateway, spec bucket.Spec, user string, minMS int64) (net.Conn, string) {
	t.Helper()
	key := bucket.NewKeyer("rl:", "").Key("user", user, "")
	if r := g.get("X-User", user); r.status != http.StatusOK {
		t.Fatalf("%s's first request: %d", user, r.status)
	}
	before := g.value(key)
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", g.port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if _, err := io.WriteString(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-User: "+user+"\r\nX-Req: "+user+"\r\n"+
		"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":"); err != nil {
		t.Fatal(err)
	}
	var held string
	redistest.WaitFor(t, 30*time.Second, user+"'s POST to be held", func() error {
		held = g.value(key)
		if held == before {
			return errors.New("not charged yet")
		}
		if st, err := bucket.DecodeState(held); err != nil || waitE2EHeldMS(spec, st) < minMS {
			return fmt.Errorf("bucket %x: not a reservation of %d ms or more (%v)", held, minMS, err)
		}
		return nil
	})
	return conn, held
}

// TestWaitSlowBodyKeepsNoPlace: max_waiting 1, "user 1 1/s" and "ctl 1
// 1/5s", max_wait 6s. A held POST whose client sends 10 of the 100 bytes
// its Content-Length promises, and no more, keeps its place only while it
// is held (at most 1 s, its user bucket's refill): the body is read ahead
// beside the hold, not before it ends. Another client, whose ctl bucket
// needs 5 s to refill, is refused the one place until then, and then
// finds it free: its request is held and served. The place used to stay
// taken for as long as the slow body lasted.
func TestWaitSlowBodyKeepsNoPlace(t *testing.T) {
	up := startWaitE2EUpstream(t)
	g := startGateway(t, waitE2ESite(up.addr, "user 1 1/s\n\t\t\tctl 1 1/5s", "on_limit wait 6s\n\t\tmax_waiting 1"))
	heldPartialPost(t, g, llmSpec(t, 1, "1/s"), "slow", 1)
	// The other client empties its ctl bucket after the slow request's
	// reservation: each request of it needs a hold of up to 5 s, which
	// outlasts the slow request's.
	if r := g.get("X-User", "other", "X-Ctl", "other"); r.status != http.StatusOK {
		t.Fatalf("the other client's first request: %d", r.status)
	}
	refused := 0
	redistest.WaitFor(t, 30*time.Second, "the other client's request to be held and served", func() error {
		r, err := g.tryGet("X-User", "other", "X-Ctl", "other", "X-Req", "other")
		if err != nil {
			return err
		}
		if r.status != http.StatusOK {
			refused++
			return fmt.Errorf("%d", r.status)
		}
		return nil
	})
	if a, ok := up.seen()["other"]; !ok || a.waitMS <= 0 {
		t.Errorf("the other client's request reached the upstream %v, held %d ms; want held", ok, a.waitMS)
	}
	t.Logf("refused a place %d times while the slow request was held", refused)
}

// TestWaitClientLeavesMidBody: a held POST whose client sends part of its
// body and then closes the connection is given its reservation back at
// once (the body read ahead fails), not when its hold ends, and never
// reaches the upstream.
func TestWaitClientLeavesMidBody(t *testing.T) {
	up := startWaitE2EUpstream(t)
	g := startGateway(t, waitE2ESite(up.addr, "user 1 1/5s", "on_limit wait 10s"))
	spec := llmSpec(t, 1, "1/5s")
	key := bucket.NewKeyer("rl:", "").Key("user", "halfway", "")
	conn, held := heldPartialPost(t, g, spec, "halfway", 3000)
	conn.Close()
	// Given back: the bucket is no longer below zero, seconds before the
	// hold would end.
	redistest.WaitFor(t, 30*time.Second, "the refund", func() error {
		v := g.value(key)
		st, err := bucket.DecodeState(v)
		if v == "" || (v != held && err == nil && st.Units >= 0) {
			return nil
		}
		return fmt.Errorf("bucket %x", v)
	})
	if _, ok := up.seen()["halfway"]; ok {
		t.Errorf("the request reached the upstream after its client left")
	}
}

// TestWaitHTTP2HeldBodyLeavesTheConnectionFree: on one HTTP/2 connection
// (h2c), a POST of 1 MiB (maxHeldBody) held by a requests limit, whose
// body no estimate reads, and then another identity's POST, which its
// bucket allows at once. The client may send a stream's body only as the
// gateway reads it (flow control), and Go's HTTP/2 server buffers 1 MiB a
// connection: the held body, unread, stopped the second request's upload
// until the hold ended (30 s here). Read ahead while it waits, it leaves
// the connection free: the second request is answered while the first is
// still held. A body longer than maxHeldBody is not held on HTTP/2: it is
// denied at once, as with on_limit reject, with its full wait.
func TestWaitHTTP2HeldBodyLeavesTheConnectionFree(t *testing.T) {
	var heldArrived atomic.Bool // the held POST reached the upstream
	post := startH2CWaitGateway(t, "user 1 1/30s", "on_limit wait 50s", func(r *http.Request, n int64) {
		if r.Header.Get("X-User") == "held" && n == maxHeldBody {
			heldArrived.Store(true)
		}
	})
	if r, _, err := post(context.Background(), "held", zeros(10)); err != nil || r.status != http.StatusOK {
		t.Fatalf("first request: %v %d", err, r.status)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	heldDone := make(chan error, 1)
	go func() {
		r, _, err := post(ctx, "held", zeros(maxHeldBody))
		if err == nil {
			err = fmt.Errorf("answered %d %q", r.status, r.body)
		}
		heldDone <- err
	}()
	redistest.WaitFor(t, time.Minute, "the POST to be held", func() error {
		if testutil.ToFloat64(tbMetrics.waiting) != 1 {
			return errors.New("not held yet")
		}
		return nil
	})
	r, reused, err := post(context.Background(), "other", zeros(64<<10))
	if err != nil || r.status != http.StatusOK || r.body != fmt.Sprintf("read %d", 64<<10) {
		t.Fatalf("the other identity's POST: %v %d %q, want 200 and its whole body upstream", err, r.status, r.body)
	}
	if !reused {
		t.Error("the other identity's POST went on a connection of its own, not beside the held one")
	}
	if heldArrived.Load() {
		t.Fatal("the held POST was sent upstream before the other was answered: its hold held the connection")
	}

	// Longer than maxHeldBody, though its wait (about 30 s) is within
	// max_wait: not held, denied with that wait.
	if r, _, err := post(context.Background(), "big", zeros(10)); err != nil || r.status != http.StatusOK {
		t.Fatalf("big's first request: %v %d", err, r.status)
	}
	r, _, err = post(context.Background(), "big", zeros(maxHeldBody+1))
	if err != nil || r.status != http.StatusTooManyRequests {
		t.Fatalf("a POST of maxHeldBody+1 bytes: %v %d, want 429 at once", err, r.status)
	}
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); ra < 20 || ra > 30 {
		t.Errorf("its Retry-After %q, want its wait, at most 30 s", r.header.Get("Retry-After"))
	}
	cancel()
	if err := <-heldDone; err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Errorf("the held POST: %v, want its own cancellation", err)
	}
}

// h2cPost sends a POST of body to /v1/files for user, over the one HTTP/2
// connection of its client, and reports whether the connection was
// reused. A body of a bytes.Reader or strings.Reader is sent with its
// Content-Length, any other of unknown length.
type h2cPost func(ctx context.Context, user string, body io.Reader) (r e2eResponse, reused bool, err error)

// zeros is a body of n zero bytes, sent with its length.
func zeros(n int) io.Reader { return bytes.NewReader(make([]byte, n)) }

// startH2CWaitGateway starts a gateway that speaks HTTP/2 without TLS
// (h2c), limiting X-User with limits and the extra subdirectives, in
// front of an upstream that reads each body whole (and tells seen its
// length) and answers "read <n>". It returns a POST over one connection.
func startH2CWaitGateway(t *testing.T, limits, extra string, seen func(r *http.Request, n int64)) h2cPost {
	t.Helper()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		if seen != nil {
			seen(r, n)
		}
		fmt.Fprintf(w, "read %d", n)
	}))
	t.Cleanup(up.Close)
	site := userLimit(limits, extra) + "\n\treverse_proxy " + strings.TrimPrefix(up.URL, "http://")
	g := startGateway(t, site)
	g.globals = "\tservers {\n\t\tprotocols h1 h2c\n\t}\n"
	g.load(site)
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &protocols}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	return func(ctx context.Context, user string, body io.Reader) (e2eResponse, bool, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.url+"v1/files", body)
		if err != nil {
			return e2eResponse{}, false, err
		}
		req.Header.Set("X-User", user)
		reused := false
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			GotConn: func(info httptrace.GotConnInfo) { reused = info.Reused },
		}))
		res, err := client.Do(req)
		if err != nil {
			return e2eResponse{}, reused, err
		}
		if res.ProtoMajor != 2 {
			t.Errorf("answered over %s, want HTTP/2", res.Proto)
		}
		r, err := readResponse(res, nil)
		return r, reused, err
	}
}

// TestWaitHTTP2UnheldRequestToldItsWholeWait: "user 1 1/30s" with
// on_limit wait 10s, over HTTP/2. A POST longer than maxHeldBody, which
// cannot be held there, waits 30 s: it is denied with Retry-After 30, and
// the deny cache keeps 20 s (until a request could be held). Answered
// from the cache, the next such POST is told 30 s too, not the 20 after
// which it would still be denied; one of 10 bytes, which can be held, is
// told 20.
func TestWaitHTTP2UnheldRequestToldItsWholeWait(t *testing.T) {
	post := startH2CWaitGateway(t, "user 1 1/30s", "on_limit wait 10s", nil)
	if r, _, err := post(context.Background(), "big", zeros(10)); err != nil || r.status != http.StatusOK {
		t.Fatalf("the first request: %v %d", err, r.status)
	}
	for _, tc := range []struct {
		what     string
		size     int
		min, max int
	}{
		{"from Redis", maxHeldBody + 1, 29, 30},
		{"from the deny cache", maxHeldBody + 1, 29, 30},
		{"from the deny cache, one that can be held", 10, 19, 20},
	} {
		r, _, err := post(context.Background(), "big", zeros(tc.size))
		if err != nil || r.status != http.StatusTooManyRequests {
			t.Fatalf("%s: %v %d, want 429", tc.what, err, r.status)
		}
		if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); ra < tc.min || ra > tc.max {
			t.Errorf("%s: Retry-After %q, want %d to %d", tc.what, r.header.Get("Retry-After"), tc.min, tc.max)
		}
	}
}

// TestHoldable: which requests on_limit wait may hold. HTTP/1.x: all. On
// HTTP/2 and HTTP/3: one whose body the estimate read (an empty one of
// unknown length included), one whose body
// will be read ahead whole (at most maxHeldBody), and on HTTP/3 a GET,
// HEAD, OPTIONS or DELETE of unknown length (quic-go gives every request
// without Content-Length one); not a longer body, nor one of unknown
// length (on HTTP/2, a GET of unknown length is sending a body).
func TestHoldable(t *testing.T) {
	e := &Estimate{}
	if err := e.provision(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		proto    int
		method   string
		length   int64
		estimate bool // the estimate reads the body first
		want     bool
	}{
		{"HTTP/1.1 POST, long", 1, http.MethodPost, maxHeldBody + 1, false, true},
		{"HTTP/1.1 POST, unknown length", 1, http.MethodPost, -1, false, true},
		{"HTTP/2 POST of maxHeldBody", 2, http.MethodPost, maxHeldBody, false, true},
		{"HTTP/2 POST, longer", 2, http.MethodPost, maxHeldBody + 1, false, false},
		{"HTTP/2 POST, unknown length", 2, http.MethodPost, -1, false, false},
		{"HTTP/3 POST, unknown length", 3, http.MethodPost, -1, false, false},
		{"HTTP/3 GET, unknown length", 3, http.MethodGet, -1, false, true},
		{"HTTP/3 POST, unknown length, estimated empty", 3, http.MethodPost, -1, true, true},
		{"HTTP/3 HEAD", 3, http.MethodHead, -1, false, true},
		{"HTTP/3 OPTIONS", 3, http.MethodOptions, -1, false, true},
		{"HTTP/3 DELETE", 3, http.MethodDelete, -1, false, true},
		{"HTTP/2 GET", 2, http.MethodGet, 0, false, true},
		{"HTTP/2 GET, unknown length: sending a body", 2, http.MethodGet, -1, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest(tc.method, "/v1/responses", http.NoBody)
			r.ProtoMajor, r.ContentLength = tc.proto, tc.length
			if tc.length < 0 {
				r.Body = io.NopCloser(strings.NewReader(""))
			}
			x := &exchange{inputs: inputs{r: r}}
			if tc.estimate {
				est, err := e.estimate(httptest.NewRecorder(), r, false)
				if err != nil || !est.read || !est.noInference {
					t.Fatalf("the estimate of an empty body of unknown length: %+v, %v; want read, 0 tokens", est, err)
				}
				x.est = est
			}
			if got := (&Handler{}).holdable(x); got != tc.want {
				t.Errorf("holdable: %v, want %v", got, tc.want)
			}
		})
	}
}

// TestWaitHTTP2CachedDenialOfABodyTheEstimateReads: "user 1 1/10s" and a
// tokens limit priced by cost estimate, with on_limit wait 2s, over
// HTTP/2. A POST of unknown length can be held once the estimate has read
// its body: Redis's denial tells it Retry-After 8 (10 s, less max_wait).
// The deny cache answers the next one before the body is read, and tells
// it 8 too, not the 10 of a request that cannot be held.
func TestWaitHTTP2CachedDenialOfABodyTheEstimateReads(t *testing.T) {
	post := startH2CWaitGateway(t, "user 1 1/10s\n\t\t\tuser 1000000 1/1h tokens", "cost estimate\n\t\ton_limit wait 2s", nil)
	const chat = `{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`
	unknown := func() io.Reader { return io.MultiReader(strings.NewReader(chat)) } // no Content-Length
	if r, _, err := post(context.Background(), "reader", strings.NewReader(chat)); err != nil || r.status != http.StatusOK {
		t.Fatalf("the first request: %v %d %q", err, r.status, r.body)
	}
	for _, what := range []string{"from Redis", "from the deny cache"} {
		r, _, err := post(context.Background(), "reader", unknown())
		if err != nil || r.status != http.StatusTooManyRequests {
			t.Fatalf("%s: %v %d %q, want 429", what, err, r.status, r.body)
		}
		if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); ra < 7 || ra > 8 {
			t.Errorf("%s: Retry-After %q, want 7 to 8 (10 s less max_wait)", what, r.header.Get("Retry-After"))
		}
	}
}

// TestReadsBody: on the deny cache's first look, before the estimate has
// read a body, which bodies it will read whole (and so can be held): one
// within max_body; one of unknown length unless on_invalid <cost> would
// price it unread should it be longer. Not once the estimate has run
// (the cost is set: what it read is known), nor without an estimate or
// tokens limits, nor for an Ollama blob upload. And a body
// that on_invalid prices once read whole is read: holdable.
func TestReadsBody(t *testing.T) {
	priced, refused := int64(5), int64(-1)
	for _, tc := range []struct {
		name      string
		estimate  bool
		onInvalid *int64
		length    int64
		priced    bool // the estimate has run (the deny cache's second look)
		noTokens  bool // the request has no tokens limit
		want      bool
	}{
		{"within max_body", true, nil, 1000, false, false, true},
		{"max_body exactly", true, nil, DefaultEstimateMaxBody, false, false, true},
		{"over max_body", true, nil, DefaultEstimateMaxBody + 1, false, false, false},
		{"unknown length", true, nil, -1, false, false, true},
		{"unknown length, on_invalid 5", true, &priced, -1, false, false, false},
		{"unknown length, on_invalid -1", true, &refused, -1, false, false, true},
		{"the estimate has run", true, nil, 1000, true, false, false},
		{"no estimate", false, nil, 1000, false, false, false},
		{"no tokens limit", true, nil, 1000, false, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := &Handler{}
			if tc.estimate {
				h.Estimate = &Estimate{OnInvalid: tc.onInvalid}
				if err := h.Estimate.provision(); err != nil {
					t.Fatal(err)
				}
			}
			r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
			r.ProtoMajor, r.ContentLength = 2, tc.length
			req := &request{tokensCap: 1000}
			if tc.noTokens {
				req.tokensCap = -1
			}
			if got := h.readsBody(&exchange{inputs: inputs{r: r, costSet: tc.priced}, req: req}); got != tc.want {
				t.Errorf("readsBody: %v, want %v", got, tc.want)
			}
		})
	}
	e := &Estimate{OnInvalid: &priced}
	if err := e.provision(); err != nil {
		t.Fatal(err)
	}
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", io.MultiReader(strings.NewReader("not json")))
	r.ProtoMajor, r.ContentLength = 2, -1
	est, err := e.estimate(httptest.NewRecorder(), r, false)
	if err != nil || est.prompt != 5 || !est.read || !(&Handler{Estimate: e}).holdable(&exchange{inputs: inputs{r: r, est: est, costSet: true}}) {
		t.Errorf("an invalid body priced on_invalid 5: %+v, %v; want 5 tokens, read whole, holdable", est, err)
	}
	// An Ollama blob upload within max_body is not read (see uploadsBlob).
	blob := httptest.NewRequest(http.MethodPost, "/api/blobs/sha256:"+strings.Repeat("0", 64), nil)
	blob.ProtoMajor, blob.ContentLength = 2, 1000
	if (&Handler{Estimate: e}).readsBody(&exchange{inputs: inputs{r: blob}, req: &request{tokensCap: 1000}}) {
		t.Error("readsBody: true for an Ollama blob upload, whose body the estimate does not read")
	}
}
