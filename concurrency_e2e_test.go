package tokenbucket

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/internal/soak"
	"github.com/token-bucket/token_bucket/lua"
)

// End-to-end tests of concurrency limits (unit "concurrent"): real Caddy
// processes (or the in-process Caddy of caddytest) in front of a streaming
// upstream that counts the requests it has in flight, on a real
// redis-server. Every wait is for an event (a channel, a response) or a
// polled condition with a deadline; nothing is timed by sleeping.

// ---------------------------------------------------------------------------
// The upstream.

// cceUpstream is a streaming upstream that counts the requests in flight
// and records the largest count it ever saw. A request's X-Mode header
// picks its answer:
//
//	""        a stream: 200 text/event-stream, "data: start", then held
//	          until released (release by X-Req, or releaseAll), then three
//	          more events and "data: [DONE]"; a request whose client is gone
//	          ends at once
//	"reset"   the same stream, but released it resets the connection (RST)
//	          without ending the response: an upstream that fails
//	"status"  503 with a JSON error body, after the hook ran
//	"quick"   200 "ok" at once
//
// A request leaves the count before its response ends (before the
// handler returns, which writes the last chunk), so a gateway cannot have
// seen the end of a response, and released its slot, while the upstream
// still counts it.
type cceUpstream struct {
	addr string

	mu       sync.Mutex
	inflight int
	max      int
	served   int
	gate     chan struct{}            // closed by releaseAll; replaced by a new one
	own      map[string]chan struct{} // by X-Req, closed by release
	hook     func(*http.Request)
}

func cceStartUpstream(t *testing.T) *cceUpstream {
	t.Helper()
	u := &cceUpstream{gate: make(chan struct{}), own: map[string]chan struct{}{}}
	u.addr = startRawUpstream(t, u.serve)
	t.Cleanup(u.releaseAll)
	return u
}

// streamGate returns the channels that end stream id: its own and the
// current gate.
func (u *cceUpstream) streamGate(id string) (own, gate chan struct{}) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.own[id] == nil {
		u.own[id] = make(chan struct{})
	}
	return u.own[id], u.gate
}

// release ends the held stream with X-Req id (also one that has not
// started yet).
func (u *cceUpstream) release(id string) {
	own, _ := u.streamGate(id)
	u.mu.Lock()
	defer u.mu.Unlock()
	select {
	case <-own:
	default:
		close(own)
	}
}

// releaseAll ends every stream held now; streams that start later are
// held again.
func (u *cceUpstream) releaseAll() {
	u.mu.Lock()
	defer u.mu.Unlock()
	close(u.gate)
	u.gate = make(chan struct{})
}

func (u *cceUpstream) setHook(f func(*http.Request)) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.hook = f
}

// counts returns the requests in flight now, the most ever in flight at
// once, and the requests served.
func (u *cceUpstream) counts() (now, max, served int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.inflight, u.max, u.served
}

func (u *cceUpstream) enter() func(*http.Request) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.inflight++
	u.served++
	u.max = max(u.max, u.inflight)
	return u.hook
}

func (u *cceUpstream) leave() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.inflight--
}

func (u *cceUpstream) serve(w http.ResponseWriter, r *http.Request) {
	hook := u.enter()
	mode, id := r.Header.Get("X-Mode"), r.Header.Get("X-Req")
	switch mode {
	case "quick":
		u.leave()
		io.WriteString(w, "ok")
		return
	case "status":
		if hook != nil {
			hook(r)
		}
		u.leave()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"error":{"message":"overloaded","type":"server_error"}}`)
		return
	}
	own, gate := u.streamGate(id)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	io.WriteString(w, "data: start\n\n")
	if rc.Flush() != nil {
		u.leave()
		return
	}
	select {
	case <-own:
	case <-gate:
	case <-r.Context().Done():
		u.leave()
		return
	}
	if mode == "reset" {
		u.leave()
		conn, _, err := rc.Hijack()
		if err != nil {
			panic(http.ErrAbortHandler)
		}
		if tc, ok := conn.(*net.TCPConn); ok {
			tc.SetLinger(0) // close with RST
		}
		conn.Close()
		return
	}
	for i := 1; i <= 3; i++ {
		fmt.Fprintf(w, "data: %d\n\n", i)
		if rc.Flush() != nil {
			break
		}
	}
	io.WriteString(w, "data: [DONE]\n\n")
	u.leave()
}

// ---------------------------------------------------------------------------
// The client.

// cceStream is one request through a gateway: a non-200 answer read
// whole, or a 200 stream of which the first event has been read (the
// upstream holds the rest).
type cceStream struct {
	id     string
	status int
	header http.Header
	body   string
	res    *http.Response
	br     *bufio.Reader
	cancel context.CancelFunc
}

var cceIDs struct {
	sync.Mutex
	n int
}

func cceNextID() string {
	cceIDs.Lock()
	defer cceIDs.Unlock()
	cceIDs.n++
	return "req-" + strconv.Itoa(cceIDs.n)
}

// cceClient is a client for streams: any number of connections per host.
func cceClient(t *testing.T) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 2 * time.Minute}
}

// cceOpen sends GET url as user with the upstream mode and more headers
// as name, value pairs. A 200 stream is returned once its first event
// arrived; any other answer (and "quick") is read whole.
func cceOpen(client *http.Client, url, user, mode string, headers ...string) (*cceStream, error) {
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &cceStream{id: cceNextID(), cancel: cancel}
	req.Header.Set("X-User", user)
	req.Header.Set("X-Req", s.id)
	if mode != "" {
		req.Header.Set("X-Mode", mode)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	res, err := client.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	s.status, s.header = res.StatusCode, res.Header
	if res.StatusCode != http.StatusOK || mode == "quick" {
		defer cancel()
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		s.body = string(b)
		return s, err
	}
	s.res, s.br = res, bufio.NewReader(res.Body)
	for {
		line, err := s.br.ReadString('\n')
		s.body += line
		if err != nil {
			s.close()
			return s, fmt.Errorf("reading the first event: %w (got %q)", err, s.body)
		}
		if line == "\n" {
			break
		}
	}
	if s.body != "data: start\n\n" {
		s.close()
		return s, fmt.Errorf("first event %q, want \"data: start\"", s.body)
	}
	return s, nil
}

// cceMustOpen is cceOpen for the test's goroutine.
func cceMustOpen(t *testing.T, client *http.Client, url, user, mode string, headers ...string) *cceStream {
	t.Helper()
	s, err := cceOpen(client, url, user, mode, headers...)
	if err != nil {
		t.Fatalf("request as %s: %v", user, err)
	}
	if s.res != nil {
		t.Cleanup(s.close)
	}
	return s
}

// finish reads the rest of a stream and returns all of its body.
func (s *cceStream) finish() (string, error) {
	if s.br == nil {
		return s.body, nil
	}
	b, err := io.ReadAll(s.br)
	s.body += string(b)
	s.close()
	return s.body, err
}

// close goes away: the connection is closed mid-stream.
func (s *cceStream) close() {
	s.cancel()
	if s.res != nil {
		s.res.Body.Close()
	}
}

// cceRemaining is r of the concurrency item of RateLimit: the free slots
// after the request's own; -1 when there is none.
func cceRemaining(h http.Header) int64 {
	m := cceRemainingRE.FindStringSubmatch(h.Get("RateLimit"))
	if m == nil {
		return -1
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	return n
}

var cceRemainingRE = regexp.MustCompile(`"user-concurrent";r=(\d+);t=\d+`)

// ccePolicy is RateLimit-Policy's item for "user <n> concurrent".
func ccePolicy(n int) string {
	return `"user-concurrent";q=` + strconv.Itoa(n) + `;qu="concurrent-requests"`
}

// cceWantConcurrencyDenial checks a 429 of a full concurrency limit (a
// Redis decision): Retry-After 1 and the limit's policy item.
func cceWantConcurrencyDenial(t *testing.T, what string, s *cceStream, policy string) {
	t.Helper()
	if s.status != http.StatusTooManyRequests {
		t.Errorf("%s: status %d %q, want 429", what, s.status, s.body)
		return
	}
	wantHeaders(t, what, s.header, "Retry-After", "1", "Retry-After-Ms", "1000")
	if got := s.header.Get("RateLimit-Policy"); !strings.Contains(got, policy) {
		t.Errorf("%s: RateLimit-Policy %q, want the item %s", what, got, policy)
	}
	if got := cceRemaining(s.header); got != 0 {
		t.Errorf("%s: RateLimit %q, want the concurrency item with r=0", what, s.header.Get("RateLimit"))
	}
}

// ---------------------------------------------------------------------------
// Redis.

// cceKey is the key of user's concurrency slots.
func cceKey(user string) string { return bucket.NewKeyer("rl:", "").Key("user", user, UnitConcurrent) }

func cceCard(t *testing.T, c redis.Cmdable, key string) int64 {
	t.Helper()
	n, err := c.ZCard(context.Background(), key).Result()
	if err != nil {
		t.Fatalf("ZCARD %s: %v", key, err)
	}
	return n
}

// cceWaitCard polls until the key holds want leases (0: the key is gone).
func cceWaitCard(t *testing.T, c redis.Cmdable, key string, want int64, what string) {
	t.Helper()
	redistest.WaitFor(t, 30*time.Second, what, func() error {
		n, err := c.ZCard(context.Background(), key).Result()
		if err != nil {
			return err
		}
		if n != want {
			return fmt.Errorf("ZCARD %d, want %d", n, want)
		}
		if want == 0 {
			if e, err := c.Exists(context.Background(), key).Result(); err != nil || e != 0 {
				return fmt.Errorf("EXISTS %d (%v), want the key gone", e, err)
			}
		}
		return nil
	})
}

// cceLeases returns the leases at key: member and expiry (ms, Redis clock).
func cceLeases(t *testing.T, c redis.Cmdable, key string) []redis.Z {
	t.Helper()
	z, err := c.ZRangeWithScores(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatalf("ZRANGE %s: %v", key, err)
	}
	return z
}

// cceRedisMS is the Redis clock in milliseconds.
func cceRedisMS(t *testing.T, c redis.Cmdable) int64 {
	t.Helper()
	tm, err := c.Time(context.Background()).Result()
	if err != nil {
		t.Fatalf("TIME: %v", err)
	}
	return tm.UnixMilli()
}

// cceMonitor reads a Redis server's MONITOR stream: every command a
// client sent, in the order the server ran them.
type cceMonitor struct {
	rdb   *redis.Client
	mu    sync.Mutex
	lines []string
	marks int
}

// cceStartMonitor loads the scripts (so that no call goes through
// NOSCRIPT and EVAL) and starts MONITOR on a connection of its own.
func cceStartMonitor(t *testing.T, addr string, rdb *redis.Client) *cceMonitor {
	t.Helper()
	ctx := context.Background()
	for _, s := range []*redis.Script{lua.TokenBucket, lua.Batch, lua.Lease, lua.Refund} {
		if err := s.Load(ctx, rdb).Err(); err != nil {
			t.Fatalf("SCRIPT LOAD: %v", err)
		}
	}
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(conn, "MONITOR\r\n"); err != nil {
		t.Fatal(err)
	}
	m := &cceMonitor{rdb: rdb}
	done := make(chan struct{})
	br := bufio.NewReaderSize(conn, 1<<16)
	// MONITOR answers +OK once it is on: every command after that is seen.
	conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	if ok, err := br.ReadString('\n'); err != nil || ok != "+OK\r\n" {
		t.Fatalf("MONITOR: %q, %v", ok, err)
	}
	conn.SetReadDeadline(time.Time{})
	go func() {
		defer close(done)
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			m.mu.Lock()
			m.lines = append(m.lines, strings.TrimRight(line, "\r\n"))
			m.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		conn.Close()
		<-done
	})
	m.sync(t)
	return m
}

// sync returns once the monitor has seen every command the server ran
// before: it sends a marker and waits for it.
func (m *cceMonitor) sync(t *testing.T) {
	t.Helper()
	m.mu.Lock()
	m.marks++
	mark := "cce-marker-" + strconv.Itoa(m.marks)
	m.mu.Unlock()
	if err := m.rdb.Echo(context.Background(), mark).Err(); err != nil {
		t.Fatalf("ECHO: %v", err)
	}
	redistest.WaitFor(t, 30*time.Second, "the monitor to see "+mark, func() error {
		m.mu.Lock()
		defer m.mu.Unlock()
		for i := len(m.lines) - 1; i >= 0; i-- {
			if strings.HasSuffix(m.lines[i], `"echo" "`+mark+`"`) || strings.HasSuffix(m.lines[i], `"ECHO" "`+mark+`"`) {
				return nil
			}
		}
		return errors.New("not yet")
	})
}

// cceLeaseCalls is what the monitor saw of the scripts: per lease id, the
// token_bucket.lua calls that carried it (one per request with a
// concurrency limit), and the lease.lua calls that renewed or released it.
// A batch.lua call counts as the token_bucket.lua calls it carries.
type cceLeaseCalls struct {
	takes, renewals, releases map[string]int
	scripts                   int // token_bucket.lua calls in all
}

// leaseCalls reads the monitor (call sync first).
func (m *cceMonitor) leaseCalls() cceLeaseCalls {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := cceLeaseCalls{takes: map[string]int{}, renewals: map[string]int{}, releases: map[string]int{}}
	tb, batch, lease := lua.TokenBucket.Hash(), lua.Batch.Hash(), lua.Lease.Hash()
	for _, line := range m.lines {
		if strings.Contains(line, " lua] ") {
			continue // run by a script
		}
		args := cceMonitorArgs(line)
		if len(args) < 3 || !strings.EqualFold(args[0], "evalsha") {
			continue
		}
		n, err := strconv.Atoi(args[2])
		if err != nil {
			continue
		}
		rest := args[3+n:] // ARGV
		switch args[1] {
		case tb:
			c.scripts++
			if len(rest) == n+1 {
				c.takes[rest[n]]++
			}
		case batch:
			// ARGV[1] holds a flags byte, then a byte per call: its
			// buckets, + 128 when its lease id follows its buckets'
			// parameters.
			at, hs := 1, []byte(cceUnquote(rest[0]))
			if len(hs) > 0 {
				hs = hs[1:]
			}
			for _, h := range hs {
				c.scripts++
				at += int(h % 128)
				if h >= 128 {
					c.takes[rest[at]]++
					at++
				}
			}
		case lease:
			if len(rest) != 2 {
				continue
			}
			if rest[1] == "0" {
				c.releases[rest[0]]++
			} else {
				c.renewals[rest[0]]++
			}
		}
	}
	return c
}

// cceMonitorArgs returns the quoted arguments of a MONITOR line, with
// their escapes as Redis wrote them.
func cceMonitorArgs(line string) []string {
	var args []string
	for i := strings.Index(line, `] "`); i >= 0 && i < len(line); i++ {
		if line[i] != '"' {
			continue
		}
		var b strings.Builder
		j := i + 1
		for ; j < len(line) && line[j] != '"'; j++ {
			if line[j] == '\\' && j+1 < len(line) {
				b.WriteByte(line[j])
				j++
			}
			b.WriteByte(line[j])
		}
		args = append(args, b.String())
		i = j
	}
	return args
}

// cceUnquote returns the bytes of a MONITOR argument. Redis escapes them
// as sdscatrepr does (\\, \", \n, \r, \t, \a, \b and \xHH), all of
// them Go escapes too.
func cceUnquote(s string) string {
	u, err := strconv.Unquote(`"` + s + `"`)
	if err != nil {
		return "" // not from Redis: no calls
	}
	return u
}

// wantReleasedOnce checks that each of the leases was released exactly
// once, and that no other lease was released.
func (c cceLeaseCalls) wantReleasedOnce(t *testing.T, what string, leases []string) {
	t.Helper()
	want := map[string]bool{}
	for _, id := range leases {
		want[id] = true
		if n := c.releases[id]; n != 1 {
			t.Errorf("%s: lease %s released %d times, want exactly once", what, id, n)
		}
		if c.takes[id] != 1 {
			t.Errorf("%s: lease %s in %d token_bucket.lua calls, want 1", what, id, c.takes[id])
		}
	}
	for id, n := range c.releases {
		if !want[id] {
			t.Errorf("%s: lease %s released %d times, want never (it took no slot)", what, id, n)
		}
	}
}

// released returns the lease ids released, sorted.
func (c cceLeaseCalls) released() []string {
	var ids []string
	for id := range c.releases {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// ---------------------------------------------------------------------------
// Gateways.

// cceGatewayRoutes are the routes of each out-of-process gateway (see
// gwSite): the user dimension from X-User, one concurrency limit, the
// lease, and the upstream behind it. %[1]s Redis, %[2]s upstream, %[3]d
// concurrency limit, %[4]s concurrency_lease, %[5]d gateway number.
const cceGatewayRoutes = `
		token_bucket {
			redis redis://%[1]s {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			tier free {
				user %[3]d concurrent
			}
			concurrency_lease %[4]s
			on_redis_error deny
		}
		header X-Gateway %[5]d
		reverse_proxy %[2]s {
			flush_interval -1
		}`

// cceStartGateways starts n Caddy processes (the binary of gwCaddy) with
// cceGatewayRoutes on one Redis and returns their base URLs and
// processes, stopped at the end of the test.
func cceStartGateways(t *testing.T, bin, redisAddr, upstream string, n, limit int, lease string) ([]string, []*soak.Process) {
	t.Helper()
	return gwStartWith(t, bin, "cce-gateway", n, func(port, i int) string {
		return gwSite(port, "admin off", fmt.Sprintf(cceGatewayRoutes, redisAddr, upstream, limit, lease, i))
	})
}

// cceSite is an in-process site: limiter, then /dead to an upstream that
// refuses connections (502) and everything else to upstream, streamed.
func cceSite(t *testing.T, upstream, limiter, extra string) string {
	return extra + `
	` + limiter + `
	handle /dead {
		reverse_proxy 127.0.0.1:` + strconv.Itoa(redistest.FreePort(t)) + `
	}
	handle {
		reverse_proxy ` + upstream + ` {
			flush_interval -1
		}
	}`
}

// cceLimiter is a token_bucket on X-User with tier's limits and extra
// subdirectives.
func cceLimiter(tier, limits, extra string) string {
	return `token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		tier ` + tier + ` {
			` + limits + `
		}
		` + extra + `
	}`
}

// cceGauge is the concurrent_requests series of tier's user dimension.
func cceGauge(tier string) string {
	return series("caddy_token_bucket_concurrent_requests", "tier", tier, "dimension", "user")
}

// cceBurst sends n requests as user at once, spread over the urls, and
// returns them when each has its status (a 200 with its first event).
func cceBurst(t *testing.T, client *http.Client, urls []string, n int, user string) []*cceStream {
	t.Helper()
	streams := make([]*cceStream, n)
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			streams[i], errs[i] = cceOpen(client, urls[i%len(urls)]+"/v1/stream", user, "")
		}()
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("request %d (gateway %d): %v", i, i%len(urls), err)
		}
	}
	for _, s := range streams {
		if s.res != nil {
			t.Cleanup(s.close)
		}
	}
	return streams
}

// ---------------------------------------------------------------------------
// The tests.

// TestConcurrencyE2EGatewaysShareSlots: three gateway processes on one
// Redis, user 4 concurrent. 50 streams of one identity at once, spread
// over the gateways, each held by the upstream: exactly 4 get 200 (their
// remaining slots 3, 2, 1, 0, once each), the other 46 get 429 with
// Retry-After: 1 and the concurrent policy item, the upstream never has
// more than 4 in flight, Redis holds 4 leases. When the streams end every
// slot is released (each lease exactly once, the key gone) and a second
// round of 20 admits exactly 4 again. Every request is one script call.
func TestConcurrencyE2EGatewaysShareSlots(t *testing.T) {
	redistest.SkipShort(t)
	bin := gwCaddy(t)
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	mon := cceStartMonitor(t, srv.Addr, rdb)
	up := cceStartUpstream(t)
	urls, _ := cceStartGateways(t, bin, srv.Addr, up.addr, 3, 4, "10m")
	t.Cleanup(up.releaseAll) // before the gateways stop
	client := cceClient(t)
	key := cceKey("alice")

	requests := 0
	for round, n := range []int{50, 20} {
		what := fmt.Sprintf("round %d", round+1)
		streams := cceBurst(t, client, urls, n, "alice")
		requests += n
		var admitted []*cceStream
		remaining := map[int64]int{}
		perGateway := make([]int, len(urls))
		for i, s := range streams {
			switch s.status {
			case http.StatusOK:
				admitted = append(admitted, s)
				remaining[cceRemaining(s.header)]++
				perGateway[i%len(urls)]++
				wantHeaders(t, what+": a 200", s.header, "RateLimit-Policy", ccePolicy(4))
			case http.StatusTooManyRequests:
				cceWantConcurrencyDenial(t, fmt.Sprintf("%s: request %d", what, i), s, ccePolicy(4))
				wantHeaders(t, what+": a 429", s.header, "RateLimit-Policy", ccePolicy(4))
			default:
				t.Fatalf("%s: request %d: status %d %q, want 200 or 429", what, i, s.status, s.body)
			}
		}
		now, most, _ := up.counts()
		t.Logf("%s: %d requests: %d × 200 (per gateway %v), %d × 429; upstream in flight %d, most ever %d",
			what, n, len(admitted), perGateway, n-len(admitted), now, most)
		if len(admitted) != 4 {
			t.Fatalf("%s: %d requests admitted, want exactly 4", what, len(admitted))
		}
		for r := int64(0); r < 4; r++ {
			if remaining[r] != 1 {
				t.Errorf("%s: the 200s reported remaining slots %v, want 0, 1, 2 and 3 once each", what, remaining)
				break
			}
		}
		if now != 4 || most != 4 {
			t.Errorf("%s: upstream has %d in flight, most ever %d; want 4 and 4", what, now, most)
		}
		if got := cceCard(t, rdb, key); got != 4 {
			t.Errorf("%s: ZCARD %d while the streams are held, want 4", what, got)
		}
		up.releaseAll()
		for _, s := range admitted {
			body, err := s.finish()
			if err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
				t.Errorf("%s: stream %s ended with %v, body %q; want it whole", what, s.id, err, body)
			}
		}
		cceWaitCard(t, rdb, key, 0, what+": every slot released")
		if now, _, _ := up.counts(); now != 0 {
			t.Errorf("%s: %d still in flight at the upstream after the streams ended", what, now)
		}
	}
	_, most, served := up.counts()
	t.Logf("upstream: most in flight at once %d, %d requests served", most, served)
	if most != 4 || served != 8 {
		t.Errorf("upstream saw at most %d in flight and served %d; want 4 and 8", most, served)
	}
	mon.sync(t)
	calls := mon.leaseCalls()
	rel := calls.released()
	if len(rel) != 8 {
		t.Errorf("%d leases released (%v), want the 8 admitted", len(rel), rel)
	}
	calls.wantReleasedOnce(t, "two rounds", rel)
	if calls.scripts != requests || len(calls.takes) != requests {
		t.Errorf("%d token_bucket.lua calls carrying %d lease ids for %d requests; want one call per request, each its own lease id",
			calls.scripts, len(calls.takes), requests)
	}
}

// TestConcurrencyE2EKilledGatewayLeasesLapse: a gateway process holding 2
// streams (user 2 concurrent, concurrency_lease 2s) is killed with
// SIGKILL. Right after, Redis still holds its 2 leases, both live, and the
// other gateway denies the identity; they lapse with the lease (the key
// expires, not before the leases' expiry) and then the other gateway
// admits 2 streams again, and no more.
func TestConcurrencyE2EKilledGatewayLeasesLapse(t *testing.T) {
	redistest.SkipShort(t)
	bin := gwCaddy(t)
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	up := cceStartUpstream(t)
	urls, procs := cceStartGateways(t, bin, srv.Addr, up.addr, 2, 2, "2s")
	t.Cleanup(up.releaseAll)
	client := cceClient(t)
	key := cceKey("victim")

	for i := range 2 {
		s := cceMustOpen(t, client, urls[0]+"/v1/stream", "victim", "")
		if s.status != http.StatusOK || s.header.Get("X-Gateway") != "0" {
			t.Fatalf("stream %d: status %d from gateway %q, want 200 from gateway 0", i+1, s.status, s.header.Get("X-Gateway"))
		}
	}
	procs[0].Kill()
	killedAt := cceRedisMS(t, rdb)
	leases := cceLeases(t, rdb, key)
	if len(leases) != 2 {
		t.Fatalf("right after the kill: %d leases %v, want the 2 the gateway held", len(leases), leases)
	}
	var first, last int64
	for i, z := range leases {
		exp := int64(z.Score)
		if exp <= killedAt || exp > killedAt+2000 {
			t.Errorf("lease %v expires at %d, Redis time %d: want live, at most 2s ahead", z.Member, exp, killedAt)
		}
		if i == 0 || exp < first {
			first = exp
		}
		last = max(last, exp)
	}
	// While both leases are live, the other gateway counts them.
	r := cceMustOpen(t, client, urls[1]+"/v1/stream", "victim", "quick")
	decidedBy := cceRedisMS(t, rdb)
	switch {
	case r.status == http.StatusTooManyRequests:
		cceWantConcurrencyDenial(t, "the other gateway while the leases live", r, ccePolicy(2))
	case decidedBy < first:
		t.Errorf("the other gateway answered %d at Redis time ≤ %d, before the first lease expired (%d); want 429", r.status, decidedBy, first)
	default:
		t.Logf("inconclusive: the other gateway answered %d after the first lease expired (the machine is slow)", r.status)
	}
	redistest.WaitFor(t, 20*time.Second, "the killed gateway's leases to lapse", func() error {
		if n := cceCard(t, rdb, key); n != 0 {
			return fmt.Errorf("ZCARD %d", n)
		}
		return nil
	})
	freed := cceRedisMS(t, rdb)
	t.Logf("killed at Redis time %d with leases expiring at %d and %d; slots free at %d (%d ms after the kill)",
		killedAt, first, last, freed, freed-killedAt)
	if freed < last-5 {
		t.Errorf("the slots were freed at %d, before the last lease expired (%d)", freed, last)
	}
	a := cceMustOpen(t, client, urls[1]+"/v1/stream", "victim", "")
	b := cceMustOpen(t, client, urls[1]+"/v1/stream", "victim", "")
	c := cceMustOpen(t, client, urls[1]+"/v1/stream", "victim", "")
	if a.status != http.StatusOK || b.status != http.StatusOK {
		t.Fatalf("after the lapse: %d, %d; want two 200s", a.status, b.status)
	}
	if got := []int64{cceRemaining(a.header), cceRemaining(b.header)}; got[0] != 1 || got[1] != 0 {
		t.Errorf("after the lapse: remaining %v, want [1 0]", got)
	}
	cceWantConcurrencyDenial(t, "a third stream after the lapse", c, ccePolicy(2))
	up.releaseAll()
	for _, s := range []*cceStream{a, b} {
		if body, err := s.finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Errorf("stream %s: %v, body %q", s.id, err, body)
		}
	}
	cceWaitCard(t, rdb, key, 0, "the survivor's slots released")
}

// TestConcurrencyE2EReleasedOnDisconnectAndUpstreamFailure (user 4
// concurrent, in-process Caddy): a client that goes away mid-stream frees
// its slot (2 leases become exactly 1, the other stream's); an upstream
// that resets the connection mid-stream, an upstream that refuses the
// connection (502), and an upstream that answers 503 each free theirs.
// Each of those requests took a slot (the upstream or the RateLimit header
// saw it held) and released it exactly once; 5 in a row never hit the
// limit of 4.
func TestConcurrencyE2EReleasedOnDisconnectAndUpstreamFailure(t *testing.T) {
	up := cceStartUpstream(t)
	g := startGateway(t, cceSite(t, up.addr, cceLimiter("free", "user 4 concurrent", ""), ""))
	t.Cleanup(up.releaseAll)
	mon := cceStartMonitor(t, g.redis.Addr, g.rdb)
	client := cceClient(t)
	url := g.url + "v1/stream"
	var leases []string

	// A client that goes away mid-stream.
	key := cceKey("leaver")
	a := cceMustOpen(t, client, url, "leaver", "")
	b := cceMustOpen(t, client, url, "leaver", "")
	if a.status != http.StatusOK || b.status != http.StatusOK {
		t.Fatalf("two streams: %d, %d; want 200s", a.status, b.status)
	}
	held := cceLeases(t, g.rdb, key)
	if len(held) != 2 {
		t.Fatalf("%d leases %v, want 2", len(held), held)
	}
	a.close()
	cceWaitCard(t, g.rdb, key, 1, "the gone client's slot released")
	redistest.WaitFor(t, 30*time.Second, "the upstream to see the client gone", func() error {
		if now, _, _ := up.counts(); now != 1 {
			return fmt.Errorf("%d in flight", now)
		}
		return nil
	})
	if got := cceCard(t, g.rdb, key); got != 1 {
		t.Errorf("ZCARD %d after one of two clients left, want exactly 1", got)
	}
	if kept := cceLeases(t, g.rdb, key); len(kept) != 1 || (kept[0].Member != held[0].Member && kept[0].Member != held[1].Member) {
		t.Errorf("leases after the client left: %v, want one of %v", kept, held)
	}
	for _, z := range held {
		leases = append(leases, z.Member.(string))
	}
	up.release(b.id)
	if body, err := b.finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Errorf("the stream that stayed: %v, body %q", err, body)
	}
	cceWaitCard(t, g.rdb, key, 0, "the stream that stayed released")

	// An upstream that resets the connection mid-stream.
	key = cceKey("reset")
	for i := range 5 {
		s := cceMustOpen(t, client, url, "reset", "reset")
		if s.status != http.StatusOK {
			t.Fatalf("reset %d: status %d %q, want 200 (the stream starts)", i+1, s.status, s.body)
		}
		z := cceLeases(t, g.rdb, key)
		if len(z) != 1 {
			t.Fatalf("reset %d: %d leases while streaming, want 1", i+1, len(z))
		}
		leases = append(leases, z[0].Member.(string))
		up.release(s.id)
		if body, err := s.finish(); err == nil {
			t.Errorf("reset %d: the stream ended cleanly (%q); want it cut", i+1, body)
		}
		cceWaitCard(t, g.rdb, key, 0, fmt.Sprintf("reset %d: the slot released", i+1))
	}

	// An upstream that refuses the connection: 502.
	key = cceKey("dead")
	for i := range 5 {
		s := cceMustOpen(t, client, g.url+"dead", "dead", "")
		if s.status != http.StatusBadGateway {
			t.Fatalf("dead %d: status %d %q, want 502", i+1, s.status, s.body)
		}
		if r := cceRemaining(s.header); r != 3 {
			t.Errorf("dead %d: RateLimit %q, want r=3: the request took one of 4 slots", i+1, s.header.Get("RateLimit"))
		}
		cceWaitCard(t, g.rdb, key, 0, fmt.Sprintf("dead %d: the slot released", i+1))
	}

	// An upstream that answers an error status.
	key = cceKey("failing")
	var sawHeld []int64
	var mu sync.Mutex
	up.setHook(func(r *http.Request) {
		z, _ := g.rdb.ZRangeWithScores(context.Background(), key, 0, -1).Result()
		mu.Lock()
		defer mu.Unlock()
		sawHeld = append(sawHeld, int64(len(z)))
		if len(z) == 1 {
			leases = append(leases, z[0].Member.(string))
		}
	})
	for i := range 5 {
		s := cceMustOpen(t, client, url, "failing", "status")
		if s.status != http.StatusServiceUnavailable || !strings.Contains(s.body, "overloaded") {
			t.Fatalf("status %d: %d %q, want the upstream's 503", i+1, s.status, s.body)
		}
		cceWaitCard(t, g.rdb, key, 0, fmt.Sprintf("status %d: the slot released", i+1))
	}
	up.setHook(nil)
	mu.Lock()
	if fmt.Sprint(sawHeld) != "[1 1 1 1 1]" {
		t.Errorf("the upstream saw %v leases while answering each 503, want 1 each time", sawHeld)
	}
	mu.Unlock()

	mon.sync(t)
	calls := mon.leaseCalls()
	// The 502s' leases are known from the releases: every release not of
	// a lease above is one of them.
	known := map[string]bool{}
	for _, id := range leases {
		known[id] = true
	}
	dead := 0
	for _, id := range calls.released() {
		if !known[id] {
			leases = append(leases, id)
			dead++
		}
	}
	if dead != 5 {
		t.Errorf("%d releases of leases other than the streams', want the 5 of the 502s", dead)
	}
	calls.wantReleasedOnce(t, "disconnect and upstream failures", leases)
	t.Logf("%d leases checked: 2 streams (one client gone), 5 resets, 5 × 502, 5 × 503", len(leases))
}

// TestConcurrencyE2ELongStreamRenewsLease: with concurrency_lease 1s, a
// stream held for more than 3 lease periods keeps its one lease the whole
// time (the same member, always live: its expiry moves forward with each
// renewal), a second request of the identity is denied meanwhile, and the
// slot is released once at the end.
func TestConcurrencyE2ELongStreamRenewsLease(t *testing.T) {
	up := cceStartUpstream(t)
	g := startGateway(t, cceSite(t, up.addr, cceLimiter("free", "user 1 concurrent", "concurrency_lease 1s"), ""))
	t.Cleanup(up.releaseAll)
	mon := cceStartMonitor(t, g.redis.Addr, g.rdb)
	client := cceClient(t)
	url := g.url + "v1/stream"
	key := cceKey("long")

	s := cceMustOpen(t, client, url, "long", "")
	if s.status != http.StatusOK {
		t.Fatalf("status %d, want 200", s.status)
	}
	z := cceLeases(t, g.rdb, key)
	if len(z) != 1 {
		t.Fatalf("leases %v, want 1", z)
	}
	member, first := z[0].Member.(string), int64(z[0].Score)
	start := cceRedisMS(t, g.rdb)
	last, polls := first, 0
	deadline := time.Now().Add(time.Minute)
	for now := start; now < start+3500; {
		z := cceLeases(t, g.rdb, key)
		now = cceRedisMS(t, g.rdb)
		if len(z) != 1 || z[0].Member.(string) != member {
			t.Fatalf("%d ms into the stream: leases %v, want only %s", now-start, z, member)
		}
		exp := int64(z[0].Score)
		if exp <= now {
			t.Fatalf("%d ms into the stream: the lease expires at %d, Redis time %d: it lapsed", now-start, exp, now)
		}
		if exp < last {
			t.Fatalf("%d ms into the stream: the lease's expiry went back from %d to %d", now-start, last, exp)
		}
		last = exp
		polls++
		if time.Now().After(deadline) {
			t.Fatal("3.5 s of Redis time did not pass within a minute")
		}
		time.Sleep(50 * time.Millisecond) // the poll interval; nothing is timed by it
	}
	t.Logf("lease expiry moved from %d to %d (+%d ms) over 3.5 lease periods, %d polls", first, last, last-first, polls)
	if last-first < 2000 {
		t.Errorf("the lease's expiry moved %d ms over 3.5 s, want ≥ 2000: renewed every half lease", last-first)
	}
	r := cceMustOpen(t, client, url, "long", "quick")
	cceWantConcurrencyDenial(t, "a second request during the long stream", r, ccePolicy(1))
	up.release(s.id)
	if body, err := s.finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Errorf("the long stream: %v, body %q", err, body)
	}
	cceWaitCard(t, g.rdb, key, 0, "the long stream's slot released")
	if r := cceMustOpen(t, client, url, "long", "quick"); r.status != http.StatusOK {
		t.Errorf("after the long stream: status %d, want 200", r.status)
	}
	mon.sync(t)
	calls := mon.leaseCalls()
	t.Logf("renewals of the long stream's lease: %d", calls.renewals[member])
	if calls.renewals[member] < 3 {
		t.Errorf("the lease was renewed %d times in 3.5 lease periods, want ≥ 3", calls.renewals[member])
	}
	if calls.releases[member] != 1 {
		t.Errorf("the lease was released %d times, want once", calls.releases[member])
	}
}

// TestConcurrencyE2EReloadMidStream: a stream taken under one config
// (user 2 concurrent) goes on through a reload to another (user 3
// concurrent, another Redis client): it finishes whole, its slot counts
// under the new config (the new config's requests see it: remaining 1,
// then 0, then 429), it is released exactly once (ZCARD drops by one, the
// gauge by one, never below 0), and then a new request is admitted with
// the right count.
func TestConcurrencyE2EReloadMidStream(t *testing.T) {
	up := cceStartUpstream(t)
	tier := uniqueTier("cce_reload")
	site := func(limit, timeout, gen string) string {
		limiter := strings.Replace(cceLimiter(tier, "user "+limit+" concurrent", ""), "timeout 10s", "timeout "+timeout, 1)
		return cceSite(t, up.addr, limiter, "header X-Gen "+gen)
	}
	g := startGateway(t, site("2", "10s", "1"))
	t.Cleanup(up.releaseAll)
	mon := cceStartMonitor(t, g.redis.Addr, g.rdb)
	client := cceClient(t)
	key := cceKey("reloader")

	old := cceMustOpen(t, client, g.url+"v1/stream", "reloader", "")
	if old.status != http.StatusOK || old.header.Get("X-Gen") != "1" || cceRemaining(old.header) != 1 {
		t.Fatalf("the first stream: %d, gen %q, RateLimit %q; want 200 from gen 1 with r=1",
			old.status, old.header.Get("X-Gen"), old.header.Get("RateLimit"))
	}
	z := cceLeases(t, g.rdb, key)
	if len(z) != 1 {
		t.Fatalf("leases %v, want 1", z)
	}
	oldLease := z[0].Member.(string)
	scrape(t).want(t, "one stream", check{cceGauge(tier), 1})

	g.load(site("3", "9s", "2"))
	url := g.url + "v1/stream"
	var streams []*cceStream
	for i, want := range []int64{1, 0} {
		s := cceMustOpen(t, client, url, "reloader", "")
		if s.status != http.StatusOK || s.header.Get("X-Gen") != "2" || cceRemaining(s.header) != want {
			t.Fatalf("new config, stream %d: %d, gen %q, RateLimit %q; want 200 from gen 2 with r=%d",
				i+1, s.status, s.header.Get("X-Gen"), s.header.Get("RateLimit"), want)
		}
		streams = append(streams, s)
	}
	full := cceMustOpen(t, client, url, "reloader", "quick")
	cceWantConcurrencyDenial(t, "new config, with the old stream's slot and 2 new ones", full, ccePolicy(3))
	scrape(t).want(t, "three streams across the reload", check{cceGauge(tier), 3})

	up.release(old.id)
	if body, err := old.finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") || old.header.Get("X-Gen") != "1" {
		t.Fatalf("the stream across the reload: %v, body %q", err, body)
	}
	cceWaitCard(t, g.rdb, key, 2, "the old stream's slot released")
	for _, z := range cceLeases(t, g.rdb, key) {
		if z.Member.(string) == oldLease {
			t.Errorf("the old stream's lease %s is still held", oldLease)
		}
	}
	scrape(t).want(t, "the old stream ended", check{cceGauge(tier), 2})

	s := cceMustOpen(t, client, url, "reloader", "")
	if s.status != http.StatusOK || cceRemaining(s.header) != 0 {
		t.Fatalf("after the old stream: %d, RateLimit %q; want 200 with r=0", s.status, s.header.Get("RateLimit"))
	}
	streams = append(streams, s)
	cceWantConcurrencyDenial(t, "full again", cceMustOpen(t, client, url, "reloader", "quick"), ccePolicy(3))
	up.releaseAll()
	for _, s := range streams {
		if body, err := s.finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Errorf("stream %s: %v, body %q", s.id, err, body)
		}
	}
	cceWaitCard(t, g.rdb, key, 0, "every slot released")
	scrape(t).want(t, "every stream ended", check{cceGauge(tier), 0})

	mon.sync(t)
	calls := mon.leaseCalls()
	rel := calls.released()
	if len(rel) != 4 {
		t.Errorf("leases released: %v, want the 4 streams'", rel)
	}
	calls.wantReleasedOnce(t, "across the reload", rel)
	if calls.releases[oldLease] != 1 {
		t.Errorf("the old stream's lease was released %d times, want once", calls.releases[oldLease])
	}
}

// TestConcurrencyE2EAllOrNothing: a request denied by one of its buckets
// takes nothing from the others. Tier a (user 1 1/h, user 4 concurrent):
// while the first request streams, the second is denied by the requests
// bucket (Retry-After of an hour, only the requests item in RateLimit) and
// takes no slot (ZCARD stays 1; its lease is never released, having none).
// Tier b (user 2 1/h, user 1 concurrent): the second request, denied by
// the full concurrency limit, is not charged a request: after the stream
// the identity still has its second request, then none.
func TestConcurrencyE2EAllOrNothing(t *testing.T) {
	up := cceStartUpstream(t)
	limiter := `token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		tier_from {http.request.header.X-Tier}
		default_tier a
		tier a {
			user 1 1/1h
			user 4 concurrent
		}
		tier b {
			user 2 1/1h
			user 1 concurrent
		}
	}`
	g := startGateway(t, cceSite(t, up.addr, limiter, ""))
	t.Cleanup(up.releaseAll)
	mon := cceStartMonitor(t, g.redis.Addr, g.rdb)
	client := cceClient(t)
	url := g.url + "v1/stream"
	keyer := bucket.NewKeyer("rl:", "")

	// Tier a: the requests bucket denies; no slot is taken.
	ckey, rkey := cceKey("anna"), keyer.Key("user", "anna", "")
	first := cceMustOpen(t, client, url, "anna", "")
	if first.status != http.StatusOK {
		t.Fatalf("tier a, first: %d", first.status)
	}
	if n := cceCard(t, g.rdb, ckey); n != 1 {
		t.Fatalf("tier a: ZCARD %d with one stream, want 1", n)
	}
	second := cceMustOpen(t, client, url, "anna", "")
	if second.status != http.StatusTooManyRequests {
		t.Fatalf("tier a, second: %d %q, want 429", second.status, second.body)
	}
	if ra, _ := strconv.Atoi(second.header.Get("Retry-After")); ra < 3000 {
		t.Errorf("tier a, second: Retry-After %q, want about an hour (the requests bucket denies)", second.header.Get("Retry-After"))
	}
	if rl := second.header.Get("RateLimit"); !strings.HasPrefix(rl, `"user";r=0;`) || strings.Contains(rl, "concurrent") {
		t.Errorf("tier a, second: RateLimit %q, want the requests item alone", rl)
	}
	if !strings.Contains(second.body, `"dimension":"user"`) {
		t.Errorf("tier a, second: body %q", second.body)
	}
	if n := cceCard(t, g.rdb, ckey); n != 1 {
		t.Errorf("tier a: ZCARD %d after the denied request, want 1: it must take no slot", n)
	}
	if n := storedTokens(t, g.rdb, rkey); n != 0 {
		t.Errorf("tier a: requests bucket %d, want 0", n)
	}
	up.release(first.id)
	if _, err := first.finish(); err != nil {
		t.Fatal(err)
	}
	cceWaitCard(t, g.rdb, ckey, 0, "tier a: the stream's slot released")

	// Tier b: the concurrency limit denies; no request is charged.
	ckey, rkey = cceKey("bert"), keyer.Key("user", "bert", "")
	b1 := cceMustOpen(t, client, url, "bert", "", "X-Tier", "b")
	if b1.status != http.StatusOK || cceRemaining(b1.header) != 0 {
		t.Fatalf("tier b, first: %d, RateLimit %q; want 200 with no slot left", b1.status, b1.header.Get("RateLimit"))
	}
	b2 := cceMustOpen(t, client, url, "bert", "quick", "X-Tier", "b")
	cceWantConcurrencyDenial(t, "tier b, second", b2, ccePolicy(1))
	if rl := b2.header.Get("RateLimit"); strings.Contains(rl, `"user";`) {
		t.Errorf("tier b, second: RateLimit %q, want the concurrency item alone", rl)
	}
	if n := storedTokens(t, g.rdb, rkey); n != 1 {
		t.Errorf("tier b: requests bucket %d after the denied request, want 1: it must not be charged", n)
	}
	if n := cceCard(t, g.rdb, ckey); n != 1 {
		t.Errorf("tier b: ZCARD %d, want 1", n)
	}
	up.release(b1.id)
	if _, err := b1.finish(); err != nil {
		t.Fatal(err)
	}
	cceWaitCard(t, g.rdb, ckey, 0, "tier b: the stream's slot released")
	if r := cceMustOpen(t, client, url, "bert", "quick", "X-Tier", "b"); r.status != http.StatusOK {
		t.Errorf("tier b, third: %d, want 200 (the second request was never charged)", r.status)
	}
	r := cceMustOpen(t, client, url, "bert", "quick", "X-Tier", "b")
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != http.StatusTooManyRequests || ra < 3000 {
		t.Errorf("tier b, fourth: %d, Retry-After %q; want 429 by the requests bucket", r.status, r.header.Get("Retry-After"))
	}
	cceWaitCard(t, g.rdb, ckey, 0, "tier b: every slot released")

	mon.sync(t)
	calls := mon.leaseCalls()
	rel := calls.released()
	if len(rel) != 3 {
		t.Errorf("leases released: %v, want the 3 admitted requests'", rel)
	}
	calls.wantReleasedOnce(t, "all or nothing", rel)
	if len(calls.takes) != 6 {
		t.Errorf("%d lease ids reached Redis, want the 6 requests'", len(calls.takes))
	}
}

// TestConcurrencyE2ECluster runs the handler on a real Redis Cluster of 3
// masters (user 5 1/h, user 2 concurrent, org 1 1/h): the identity's
// concurrency key and requests bucket share one slot (its hash tag), the
// org's bucket is on another. A stream holds its slot while it runs and
// releases it after. A request whose org bucket (another slot) denies has
// its slot, taken on the user's slot, given back by the refund: ZCARD
// stays 1, the user's requests bucket is refunded too.
func TestConcurrencyE2ECluster(t *testing.T) {
	redistest.SkipShort(t)
	cluster := redistest.StartCluster(t, 3)
	cc := cluster.Client(t)
	ctx := context.Background()
	up := cceStartUpstream(t)
	a := cluster.Addrs()
	limiter := `token_bucket {
		redis redis://` + a[0] + `?addr=` + a[1] + `&addr=` + a[2] + ` {
			cluster
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		dimension org {http.request.header.X-Org}
		tier free {
			user 5 1/1h
			user 2 concurrent
			org 1 1/1h
		}
	}`
	g := startGateway(t, cceSite(t, up.addr, limiter, ""))
	t.Cleanup(up.releaseAll)
	client := cceClient(t)
	url := g.url + "v1/stream"
	keyer := bucket.NewKeyer("rl:", "")
	ckey, rkey := cceKey("carol"), keyer.Key("user", "carol", "")
	okey := keyer.Key("org", "acme", "")
	slot := func(k string) int64 {
		s, err := cc.ClusterKeySlot(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	if slot(ckey) != slot(rkey) || slot(okey) == slot(ckey) {
		t.Fatalf("slots: concurrency %d, requests %d, org %d; want the first two equal, the org's another",
			slot(ckey), slot(rkey), slot(okey))
	}
	if cluster.NodeOf(t, ckey) != cluster.NodeOf(t, rkey) {
		t.Fatal("the identity's keys are on two nodes")
	}

	s := cceMustOpen(t, client, url, "carol", "", "X-Org", "acme")
	if s.status != http.StatusOK || cceRemaining(s.header) != 1 {
		t.Fatalf("stream: %d, RateLimit %q; want 200 with 1 slot left", s.status, s.header.Get("RateLimit"))
	}
	if n := cceCard(t, cc, ckey); n != 1 {
		t.Fatalf("ZCARD %d while streaming, want 1", n)
	}
	node := cluster.NodeOf(t, ckey).Client(t)
	if n, err := node.Exists(ctx, ckey, rkey).Result(); err != nil || n != 2 {
		t.Errorf("EXISTS of the identity's two keys on the node of their slot: %d, %v; want 2", n, err)
	}
	if n := storedTokens(t, cc, rkey); n != 4 {
		t.Errorf("user requests bucket %d, want 4", n)
	}

	// The org (another slot) denies: what the user's slot charged, its
	// request and its slot, is refunded.
	d := cceMustOpen(t, client, url, "carol", "quick", "X-Org", "acme")
	if d.status != http.StatusTooManyRequests || !strings.Contains(d.body, `"dimension":"org"`) {
		t.Fatalf("second request: %d %q, want 429 by the org bucket", d.status, d.body)
	}
	if n := cceCard(t, cc, ckey); n != 1 {
		t.Errorf("ZCARD %d after a request the org denied, want 1: its slot must be given back", n)
	}
	if n := storedTokens(t, cc, rkey); n != 4 {
		t.Errorf("user requests bucket %d after a request the org denied, want 4 (refunded)", n)
	}

	up.release(s.id)
	if body, err := s.finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Errorf("stream: %v, body %q", err, body)
	}
	cceWaitCard(t, cc, ckey, 0, "the stream's slot released")
	for i, org := range []string{"other1", "other2"} {
		r := cceMustOpen(t, client, url, "carol", "quick", "X-Org", org)
		if r.status != http.StatusOK || cceRemaining(r.header) != 1 {
			t.Errorf("after the stream, request %d: %d, RateLimit %q; want 200 with 1 slot left", i+1, r.status, r.header.Get("RateLimit"))
		}
		cceWaitCard(t, cc, ckey, 0, "a quick request's slot released")
	}
	if n := storedTokens(t, cc, rkey); n != 2 {
		t.Errorf("user requests bucket %d at the end, want 2", n)
	}
}

// TestConcurrencyE2ELocalWhenRedisDown: with on_redis_error local,
// local_share 1 and Redis stopped, user 2 concurrent is counted in
// process: 2 held streams are admitted, the 3rd is denied (429,
// Retry-After: 1), and when one stream ends a new one is admitted, and
// only one. The gauge follows the slots held.
func TestConcurrencyE2ELocalWhenRedisDown(t *testing.T) {
	up := cceStartUpstream(t)
	tier := uniqueTier("cce_local")
	limiter := strings.Replace(cceLimiter(tier, "user 2 concurrent", "on_redis_error local\n\t\tlocal_share 1"),
		"timeout 10s", "timeout 2s", 1)
	g := startGateway(t, cceSite(t, up.addr, limiter, ""))
	t.Cleanup(up.releaseAll)
	client := cceClient(t)
	url := g.url + "v1/stream"
	g.redis.Stop()

	var held []*cceStream
	for i := range 2 {
		s := cceMustOpen(t, client, url, "lou", "")
		if s.status != http.StatusOK {
			t.Fatalf("stream %d with Redis down: %d %q, want 200", i+1, s.status, s.body)
		}
		wantNoRateLimitHeaders(t, "a local decision", s.header)
		held = append(held, s)
	}
	scrape(t).want(t, "two local slots", check{cceGauge(tier), 2})
	d := cceMustOpen(t, client, url, "lou", "quick")
	if d.status != http.StatusTooManyRequests {
		t.Fatalf("third with Redis down: %d %q, want 429", d.status, d.body)
	}
	wantHeaders(t, "local denial", d.header, "Retry-After", "1")
	if now, _, _ := up.counts(); now != 2 {
		t.Errorf("upstream has %d in flight, want 2", now)
	}

	up.release(held[0].id)
	if body, err := held[0].finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("first stream: %v, body %q", err, body)
	}
	// The slot is released before the response's last chunk is written
	// (when the handler returns), so the client has seen the end after it.
	scrape(t).want(t, "one stream ended", check{cceGauge(tier), 1})
	s := cceMustOpen(t, client, url, "lou", "")
	if s.status != http.StatusOK {
		t.Fatalf("after one stream ended: %d %q, want 200", s.status, s.body)
	}
	held = append(held[1:], s)
	d = cceMustOpen(t, client, url, "lou", "quick")
	if d.status != http.StatusTooManyRequests {
		t.Errorf("full again: %d, want 429", d.status)
	}
	up.releaseAll()
	for _, s := range held {
		if body, err := s.finish(); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Errorf("stream %s: %v, body %q", s.id, err, body)
		}
	}
	scrape(t).want(t, "every stream ended", check{cceGauge(tier), 0})
	for i := range 2 {
		if r := cceMustOpen(t, client, url, "lou", "quick"); r.status != http.StatusOK {
			t.Errorf("quick request %d after every stream: %d, want 200", i+1, r.status)
		}
	}
}

// TestConcurrencyE2EGauge: concurrent_requests{tier,dimension} counts the
// requests holding slots through this process: 0, then 1, 2, 3 as streams
// start (a denied 4th adds nothing), 2 when one ends, 0 when all have,
// never below. Each request holds a slot of a shadow limit on the same
// dimension too, and counts once.
func TestConcurrencyE2EGauge(t *testing.T) {
	up := cceStartUpstream(t)
	tier := uniqueTier("cce_gauge")
	g := startGateway(t, cceSite(t, up.addr, cceLimiter(tier, "user 3 concurrent\n\t\t\tuser 10 concurrent shadow", ""), ""))
	t.Cleanup(up.releaseAll)
	client := cceClient(t)
	url := g.url + "v1/stream"
	scrape(t).want(t, "before", check{cceGauge(tier), 0})
	var held []*cceStream
	for i := range 3 {
		s := cceMustOpen(t, client, url, "gail", "")
		if s.status != http.StatusOK {
			t.Fatalf("stream %d: %d", i+1, s.status)
		}
		held = append(held, s)
		// The gauge counts the slot before the response starts.
		scrape(t).want(t, fmt.Sprintf("%d streams", i+1), check{cceGauge(tier), float64(i + 1)})
	}
	cceWantConcurrencyDenial(t, "a 4th", cceMustOpen(t, client, url, "gail", "quick"), ccePolicy(3))
	scrape(t).want(t, "after a denial", check{cceGauge(tier), 3})
	up.release(held[1].id)
	if _, err := held[1].finish(); err != nil {
		t.Fatal(err)
	}
	scrape(t).want(t, "one stream ended", check{cceGauge(tier), 2})
	if n := cceCard(t, g.rdb, cceKey("gail")); n != 2 {
		t.Errorf("ZCARD %d, want 2", n)
	}
	up.releaseAll()
	for _, s := range []*cceStream{held[0], held[2]} {
		if _, err := s.finish(); err != nil {
			t.Fatal(err)
		}
	}
	scrape(t).want(t, "every stream ended", check{cceGauge(tier), 0})
	cceWaitCard(t, g.rdb, cceKey("gail"), 0, "every slot released")
}

// TestConcurrencyE2ERenewTimerRace (under -race, as make test runs it):
// streams whose leases are renewed many times (concurrency_lease 2ms, so
// every millisecond) while the test waits, by the monitor, until each has
// been renewed 3 times. holdSlots sets the renewal timer under the slots'
// lock, which renew reads it under; set outside it, the race detector
// reported the two.
func TestConcurrencyE2ERenewTimerRace(t *testing.T) {
	up := cceStartUpstream(t)
	g := startGateway(t, cceSite(t, up.addr, cceLimiter("free", "user 100 concurrent", "concurrency_lease 2ms"), ""))
	t.Cleanup(up.releaseAll)
	mon := cceStartMonitor(t, g.redis.Addr, g.rdb)
	client := cceClient(t)
	var streams []*cceStream
	for range 20 {
		s := cceMustOpen(t, client, g.url+"v1/stream", "racer", "")
		if s.status != http.StatusOK {
			t.Fatalf("status %d", s.status)
		}
		streams = append(streams, s)
	}
	redistest.WaitFor(t, 30*time.Second, "every lease renewed 3 times", func() error {
		mon.sync(t)
		calls := mon.leaseCalls()
		if len(calls.renewals) < len(streams) {
			return fmt.Errorf("%d leases renewed", len(calls.renewals))
		}
		for id, n := range calls.renewals {
			if n < 3 {
				return fmt.Errorf("lease %s renewed %d times", id, n)
			}
		}
		return nil
	})
	up.releaseAll()
	for _, s := range streams {
		if _, err := s.finish(); err != nil {
			t.Error(err)
		}
	}
}

// TestConcurrencyE2ESubMillisecondLease: concurrency_lease 500us is
// refused at load, naming the field. Leases are counted in milliseconds:
// accepted, it made a lease of 0 ms, which is no concurrency take (the
// script failed, and on_redis_error local divided by a refill of 0).
func TestConcurrencyE2ESubMillisecondLease(t *testing.T) {
	up := cceStartUpstream(t)
	g := startGateway(t, cceSite(t, up.addr, cceLimiter("free", "user 2 concurrent", ""), ""))
	t.Cleanup(up.releaseAll)
	err := postLoad(g.caddyfile(cceSite(t, up.addr, cceLimiter("free", "user 2 concurrent", "concurrency_lease 500us"), "")), "caddyfile")
	if want := `invalid concurrency_lease "500us": must be a duration of at least 1ms`; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("loading concurrency_lease 500us: %v; want an error containing %q", err, want)
	}
}
