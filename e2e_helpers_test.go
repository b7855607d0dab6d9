package tokenbucket

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/certmagic"
	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// adminPort is the admin endpoint of the one Caddy that caddytest runs in
// this test process, on a free port so that the tests never meet a Caddy
// already running on the machine (caddytest's default is 2999).
var adminPort int

func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	tmp, err := os.MkdirTemp("", "token_bucket_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(tmp)
	// Keep Caddy's autosave, storage and instance id out of $HOME.
	os.Setenv("XDG_DATA_HOME", filepath.Join(tmp, "data"))
	os.Setenv("XDG_CONFIG_HOME", filepath.Join(tmp, "config"))
	caddy.ConfigAutosavePath = filepath.Join(tmp, "autosave.json")
	caddy.DefaultStorage = &certmagic.FileStorage{Path: filepath.Join(tmp, "storage")}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	adminPort = l.Addr().(*net.TCPAddr).Port
	l.Close()
	// AssertLoadError builds its own Tester from the defaults.
	caddytest.Default.AdminPort = adminPort
	// Each config load restarts Caddy's admin server and closes the old
	// one's connections; caddytest posts /load with http.DefaultTransport,
	// which may reuse such a connection for the POST and fail with EOF.
	http.DefaultTransport.(*http.Transport).DisableKeepAlives = true
	return m.Run()
}

// testerConfig points caddytest at adminPort, with timeouts long enough
// for a loaded machine.
func testerConfig() caddytest.Config {
	return caddytest.Config{AdminPort: adminPort, TestRequestTimeout: time.Minute, LoadRequestTimeout: time.Minute}
}

// globalOptions is the Caddyfile global block of every test config: the
// admin endpoint on adminPort, every listener on 127.0.0.1, nothing saved.
func globalOptions(httpPort int) string {
	return fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	persist_config off
	http_port %d
	default_bind 127.0.0.1
	auto_https off
	grace_period 1ns
	log {
		level ERROR
	}
}
`, adminPort, httpPort)
}

// e2eGateway is a Caddy (through caddytest) in front of a Redis of its own.
type e2eGateway struct {
	t      *testing.T
	tester *caddytest.Tester
	redis  *redistest.Server
	rdb    *redis.Client
	port   int
	url    string
	client *http.Client
	// globals are global options added to the site's Caddyfile by load
	// (e.g. servers { protocols h1 h2c }).
	globals string
}

// startGateway starts a Redis and loads a site whose handlers are body into
// Caddy, on a free port (g.port, g.url); REDIS_ADDR in body becomes the
// Redis address. The site is unloaded at the end of the test, before Redis
// stops.
func startGateway(t *testing.T, body string) *e2eGateway {
	t.Helper()
	ensureCaddy(t)
	g := &e2eGateway{t: t, redis: redistest.Start(t)}
	g.rdb = g.redis.Client(t)
	g.tester = caddytest.NewTester(t).WithDefaultOverrides(testerConfig())
	tr := &http.Transport{MaxIdleConnsPerHost: 256}
	// Generous: a loaded CI machine running -race must not turn a slow
	// answer into a failure; no test measures time.
	g.client = &http.Client{Transport: tr, Timeout: time.Minute}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		// Unload the site so the handlers release their Redis client.
		if err := postLoad(globalOptions(g.port), "caddyfile"); err != nil {
			t.Errorf("unloading the test site: %v", err)
		}
	})
	g.load(body)
	return g
}

// load replaces the running config with a site of body, on a new port.
//
// Caddy stops the old servers in the background after /load answers, and
// old and new listen with SO_REUSEPORT: on the same port, a connection made
// right after a reload can land in the old socket's backlog and be reset
// when it closes. A fresh port per load makes every request reach the site
// just loaded.
func (g *e2eGateway) load(body string) {
	g.t.Helper()
	g.port = redistest.FreePort(g.t)
	g.url = "http://127.0.0.1:" + strconv.Itoa(g.port) + "/"
	if err := postLoad(g.caddyfile(body), "caddyfile"); err != nil {
		g.t.Fatalf("loading the test site: %v", err)
	}
}

func (g *e2eGateway) caddyfile(body string) string {
	body = strings.ReplaceAll(body, "REDIS_ADDR", g.redis.Addr)
	opts := strings.Replace(globalOptions(g.port), "\tauto_https off\n", "\tauto_https off\n"+g.globals, 1)
	return opts + fmt.Sprintf(":%d {\n%s\n}\n", g.port, body)
}

// e2eResponse is what a test reads of an HTTP response.
type e2eResponse struct {
	status int
	header http.Header
	body   string
}

// get sends GET / with the headers given as name, value pairs.
func (g *e2eGateway) get(headers ...string) e2eResponse {
	g.t.Helper()
	r, err := g.tryGet(headers...)
	if err != nil {
		g.t.Fatal(err)
	}
	return r
}

// send sends method to path (under the site's root) with body (nil for
// none) and the headers given as name, value pairs.
func (g *e2eGateway) send(method, path string, body io.Reader, headers ...string) e2eResponse {
	g.t.Helper()
	req, err := http.NewRequest(method, g.url+path, body)
	if err != nil {
		g.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	r, err := readResponse(g.client.Do(req))
	if err != nil {
		g.t.Fatal(err)
	}
	return r
}

// tryGet is get for other goroutines than the test's.
func (g *e2eGateway) tryGet(headers ...string) (e2eResponse, error) {
	req, err := http.NewRequest(http.MethodGet, g.url, nil)
	if err != nil {
		return e2eResponse{}, err
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	return readResponse(g.client.Do(req))
}

// readResponse reads and closes the response of a client call.
func readResponse(res *http.Response, err error) (e2eResponse, error) {
	if err != nil {
		return e2eResponse{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return e2eResponse{}, err
	}
	return e2eResponse{status: res.StatusCode, header: res.Header, body: string(b)}, nil
}

// keys returns every key in the gateway's Redis, by SCAN.
func (g *e2eGateway) keys() []string {
	g.t.Helper()
	var all []string
	iter := g.rdb.Scan(context.Background(), 0, "*", 100).Iterator()
	for iter.Next(context.Background()) {
		all = append(all, iter.Val())
	}
	if err := iter.Err(); err != nil {
		g.t.Fatalf("SCAN: %v", err)
	}
	return all
}

// value returns the value at key, "" when there is none.
func (g *e2eGateway) value(key string) string {
	g.t.Helper()
	v, err := g.rdb.Get(context.Background(), key).Result()
	if err == redis.Nil {
		return ""
	}
	if err != nil {
		g.t.Fatalf("GET %s: %v", key, err)
	}
	return v
}

// wantHeaders checks that each name, value pair is the response's only
// value of that header; a value of "" means the header must be absent.
func wantHeaders(t *testing.T, what string, h http.Header, pairs ...string) {
	t.Helper()
	for i := 0; i+1 < len(pairs); i += 2 {
		name, want := pairs[i], pairs[i+1]
		got := h.Values(name)
		switch {
		case want == "" && len(got) != 0:
			t.Errorf("%s: header %s = %q, want none", what, name, got)
		case want != "" && (len(got) != 1 || got[0] != want):
			t.Errorf("%s: header %s = %q, want %q", what, name, got, want)
		}
	}
}

// rateLimitHeaders are the headers a decision by Redis sets and a degraded
// one omits.
var rateLimitHeaders = []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}

func wantNoRateLimitHeaders(t *testing.T, what string, h http.Header) {
	t.Helper()
	for _, name := range rateLimitHeaders {
		wantHeaders(t, what, h, name, "")
	}
}

// postLoad posts a config to the admin endpoint's /load and returns the
// error it answers with, nil for 200.
//
// Every load replaces Caddy's admin server, and the old one stops in the
// background. Both listen with SO_REUSEPORT, so a new connection can land
// in the old socket's backlog just before it closes and get EOF or a reset.
// Such a request never reached Caddy, and posting a config again is
// idempotent, so a transport error is retried.
func postLoad(config, configType string) error {
	var err error
	for attempt := 1; attempt <= 5; attempt++ {
		var answered bool
		if answered, err = postLoadOnce(config, configType); answered {
			return err
		}
		time.Sleep(time.Duration(attempt) * 20 * time.Millisecond) // backoff, not timing a result
	}
	return err
}

// postLoadOnce posts the config once; answered is false when no HTTP answer
// came back.
func postLoadOnce(config, configType string) (answered bool, err error) {
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", adminPort), strings.NewReader(config))
	if err != nil {
		return true, err
	}
	req.Close = true // never reuse a connection to an admin server a load replaced
	if configType == "json" {
		req.Header.Set("Content-Type", "application/json")
	} else {
		req.Header.Set("Content-Type", "text/"+configType)
	}
	res, err := (&http.Client{Timeout: time.Minute}).Do(req)
	if err != nil {
		return false, err
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode == http.StatusOK {
		return true, nil
	}
	// The admin API answers {"error": "..."}.
	var apiErr struct{ Error string }
	if err := json.Unmarshal(b, &apiErr); err != nil || apiErr.Error == "" {
		return true, fmt.Errorf("status %d: %s", res.StatusCode, b)
	}
	return true, fmt.Errorf("%s", apiErr.Error)
}

// ensureCaddy has caddytest start the in-process Caddy, with only the
// admin endpoint, the first time a test needs it.
func ensureCaddy(t *testing.T) {
	t.Helper()
	redistest.SkipShort(t)
	caddyMu.Lock()
	defer caddyMu.Unlock()
	if caddyStarted {
		return
	}
	tester := caddytest.NewTester(t).WithDefaultOverrides(testerConfig())
	tester.InitServer(fmt.Sprintf("{\n\tadmin localhost:%d\n\tpersist_config off\n}\n", adminPort), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	caddyStarted = true
}

var (
	caddyMu      sync.Mutex
	caddyStarted bool // caddytest's Caddy runs; it lives as long as the process
)

// adaptCaddyfile runs the Caddyfile adapter, as `caddy adapt` does.
func adaptCaddyfile(caddyfile string) ([]byte, error) {
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	return out, err
}

// provisionHandler provisions h as Caddy would and cleans it up at the end of
// the test (before the Redis servers started earlier stop).
func provisionHandler(t testing.TB, h *Handler) *Handler {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := h.Provision(ctx); err != nil {
		cancel()
		t.Fatalf("provision: %v", err)
	}
	t.Cleanup(func() {
		if err := h.Cleanup(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		cancel()
	})
	return h
}

// served is what a test reads of one request served in process.
type served struct {
	status   int
	header   http.Header
	body     string
	err      error         // what ServeHTTP returned; status is its status code
	degraded bool          // {http.token_bucket.degraded} is "true"
	passed   bool          // the next handler ran
	latency  time.Duration // of ServeHTTP
}

// serve sends GET / through h, from httptest's peer 192.0.2.1:1234, with
// the headers given as name, value pairs; see serveFrom.
func serve(h caddyhttp.MiddlewareHandler, headers ...string) served {
	return serveFrom(h, "192.0.2.1:1234", headers...)
}

// serveUser is serve with the X-User header.
func serveUser(h caddyhttp.MiddlewareHandler, user string) served { return serve(h, "X-User", user) }

// serveFrom sends GET / through h from remoteAddr with the headers given as
// name, value pairs, as Caddy's server would: a Replacer and the HTTP vars
// in the context (a zero Server trusts no proxy: {http.vars.client_ip} is
// the peer), and the next handler answering 200 with no body.
func serveFrom(h caddyhttp.MiddlewareHandler, remoteAddr string, headers ...string) served {
	return serveCtx(context.Background(), h, remoteAddr, headers...)
}

// serveCtx is serveFrom with the request's context.
func serveCtx(ctx context.Context, h caddyhttp.MiddlewareHandler, remoteAddr string, headers ...string) served {
	req := httptest.NewRequestWithContext(ctx, http.MethodGet, "http://gateway.test/", nil)
	req.RemoteAddr = remoteAddr
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	rec := httptest.NewRecorder()
	repl := caddy.NewReplacer()
	req = caddyhttp.PrepareRequest(req, repl, rec, &caddyhttp.Server{})
	var res served
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		res.passed = true
		w.WriteHeader(http.StatusOK)
		return nil
	})
	start := time.Now()
	res.err = h.ServeHTTP(rec, req, next)
	res.latency = time.Since(start)
	res.status, res.header, res.body = rec.Code, rec.Header(), rec.Body.String()
	if res.err != nil {
		res.status = http.StatusInternalServerError
		var he caddyhttp.HandlerError
		if errors.As(res.err, &he) {
			res.status = he.StatusCode
		}
	}
	res.degraded = repl.ReplaceAll("{http.token_bucket.degraded}", "") == "true"
	return res
}

// wholeTokens is ⌊units/scale⌋ (units may be negative: a debt).
func wholeTokens(st bucket.State) int64 {
	q := st.Units / st.Scale
	if st.Units%st.Scale != 0 && st.Units < 0 {
		q--
	}
	return q
}

// decodeTokens returns the whole tokens of a bucket's stored value v, as
// last written (without the refill since); ok is false when v is empty (no
// key: a full bucket). A value that is not three exact integers of at most
// 2^53 in magnitude, as the script writes them, fails the test.
func decodeTokens(t testing.TB, v string) (tokens int64, ok bool) {
	t.Helper()
	if v == "" {
		return 0, false
	}
	st, err := bucket.DecodeState(v)
	if err != nil {
		t.Fatalf("bucket value %q: %v", v, err)
	}
	for _, n := range []int64{st.Units, st.Scale, st.Last} {
		if n > 1<<53 || n < -(1<<53) {
			t.Fatalf("bucket value %q: %d is beyond 2^53", v, n)
		}
	}
	if bucket.EncodeState(st) != v {
		t.Fatalf("bucket value %q: not three exact integers", v)
	}
	if st.Scale <= 0 {
		t.Fatalf("bucket value %q: scale %d", v, st.Scale)
	}
	return wholeTokens(st), true
}

// storedTokens returns the whole tokens of the bucket at key in c; a
// missing key fails the test.
func storedTokens(t testing.TB, c redis.Cmdable, key string) int64 {
	t.Helper()
	v, err := c.Get(context.Background(), key).Result()
	if err != nil {
		t.Fatalf("GET %s: %v", key, err)
	}
	n, _ := decodeTokens(t, v)
	return n
}
