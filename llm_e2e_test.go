package tokenbucket

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/providertest"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// ---------------------------------------------------------------------------
// The LLM API behind the gateway: providertest's stand-in for OpenAI's chat
// completions and Anthropic's messages, JSON and server-sent events, with
// the usage a test asks for.

// llmUpstream is a providertest server whose answers are controlled by
// headers that reverse_proxy passes through:
//
//	X-Test-Usage: <a>,<b>      usage to report: prompt_tokens,completion_tokens
//	                           (OpenAI) or input_tokens,output_tokens
//	                           (Anthropic); absent: no usage object
//	X-Test-Tokens-Used: <n>    echoed as the response header X-Tokens-Used
//
// "stream": true in the body makes it stream (one flush per event); OpenAI
// streams end with a usage chunk only when stream_options.include_usage is
// true. Every answer carries X-Body-Sha256 and X-Body-Length of the body
// it received; a body that is not JSON is answered as an empty request.
// When keys are watched, it reads them from Redis as it answers: the
// buckets after the limiter's charge and before its settlement.
type llmUpstream struct {
	*providertest.Server

	mu    sync.Mutex
	rdb   *redis.Client
	watch []string
}

// llmSeen is what the upstream saw of one request.
type llmSeen struct {
	providertest.Request
	state map[string]string // watched keys: raw values ("" for none)
}

func startLLMUpstream(t *testing.T) *llmUpstream {
	t.Helper()
	u := &llmUpstream{Server: providertest.Start(t)}
	u.AcceptInvalidJSON()
	u.SetReply(llmTestReply)
	u.SetHook(u.readWatched)
	return u
}

// llmTestReply answers as the request's X-Test-* headers ask.
func llmTestReply(r *providertest.Request) providertest.Reply {
	sum := sha256.Sum256(r.Body)
	rep := providertest.Reply{Header: http.Header{}}
	rep.Header.Set("X-Body-Sha256", hex.EncodeToString(sum[:]))
	rep.Header.Set("X-Body-Length", strconv.Itoa(len(r.Body)))
	if v := r.Header.Get("X-Test-Tokens-Used"); v != "" {
		rep.Header.Set("X-Tokens-Used", v)
	}
	if a, b, ok := llmTestUsage(r.Header.Get("X-Test-Usage")); ok {
		rep.Usage = &providertest.Usage{Input: a, Output: b}
	}
	return rep
}

// readWatched records the watched keys' values in the request's notes.
func (u *llmUpstream) readWatched(r *providertest.Request) error {
	u.mu.Lock()
	rdb, watch := u.rdb, u.watch
	u.mu.Unlock()
	if len(watch) == 0 {
		return nil
	}
	r.Notes = make(map[string]string, len(watch))
	for _, k := range watch {
		v, err := rdb.Get(context.Background(), k).Result()
		if err != nil && err != redis.Nil {
			return err
		}
		r.Notes[k] = v
	}
	return nil
}

// watchKeys makes the upstream read keys from rdb on every request.
func (u *llmUpstream) watchKeys(rdb *redis.Client, keys ...string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.rdb, u.watch = rdb, keys
}

// hold makes streams wait after their first event until release.
func (u *llmUpstream) hold() { u.Hold() }

func (u *llmUpstream) release() { u.Release() }

// requests returns what the upstream has seen so far.
func (u *llmUpstream) requests() []llmSeen {
	var out []llmSeen
	for _, r := range u.Requests() {
		out = append(out, llmSeen{Request: r, state: r.Notes})
	}
	return out
}

// last returns the last request the upstream saw.
func (u *llmUpstream) last(t *testing.T) llmSeen {
	t.Helper()
	r := u.Last(t)
	return llmSeen{Request: r, state: r.Notes}
}

// llmTestUsage reads X-Test-Usage: "<a>,<b>".
func llmTestUsage(v string) (a, b int64, ok bool) {
	as, bs, found := strings.Cut(v, ",")
	if !found {
		return 0, 0, false
	}
	a, err1 := strconv.ParseInt(as, 10, 64)
	b, err2 := strconv.ParseInt(bs, 10, 64)
	return a, b, err1 == nil && err2 == nil
}

// ---------------------------------------------------------------------------
// A gateway in front of the upstream.

// llmGateway is a Caddy with token_bucket and reverse_proxy in front of an
// llmUpstream, and a client that keeps one connection: HTTP/1.1 serves the
// requests of one connection in turn, so a request answered on it proves
// that the handler of the one before (and its settlement) has returned.
type llmGateway struct {
	*e2eGateway
	up     *llmUpstream
	client *http.Client
}

// llmSite is a site that answers /sync itself and sends everything else
// through limiter (a token_bucket block) to upstream; X-Estimated-Cost
// shows {http.token_bucket.cost}.
func llmSite(upstream, limiter string) string {
	return `
	header >X-Estimated-Cost {http.token_bucket.cost}
	handle /sync {
		respond "synced"
	}
	handle {
		` + limiter + `
		reverse_proxy ` + upstream + `
	}`
}

// llmLimiter is a token_bucket on the X-User header with the tier's limits
// and the extra subdirectives (cost estimate, settle, ...).
func llmLimiter(limits, extra string) string {
	return `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			tier free {
				` + limits + `
			}
			` + extra + `
		}`
}

func startLLMGateway(t *testing.T, limiter string) *llmGateway {
	t.Helper()
	// caddytest skips a test whose prerequisites are missing; here that is
	// a failure.
	t.Cleanup(func() {
		if t.Skipped() && !testing.Short() {
			t.Error("the end-to-end test was skipped: Caddy or Redis could not start")
		}
	})
	up := startLLMUpstream(t)
	g := startGateway(t, llmSite(up.Addr, limiter))
	tr := &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &llmGateway{e2eGateway: g, up: up, client: &http.Client{Transport: tr, Timeout: time.Minute}}
}

// post sends body to path with the headers given as name, value pairs.
func (lg *llmGateway) post(path, body string, headers ...string) e2eResponse {
	lg.t.Helper()
	r, err := lg.do(context.Background(), http.MethodPost, path, body, headers...)
	if err != nil {
		lg.t.Fatal(err)
	}
	return r
}

func (lg *llmGateway) do(ctx context.Context, method, path, body string, headers ...string) (e2eResponse, error) {
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(lg.url, "/")+path, strings.NewReader(body))
	if err != nil {
		return e2eResponse{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if path == "/v1/messages" {
		req.Header.Set("Anthropic-Version", "2023-06-01") // required, as Anthropic's clients send it
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	return readResponse(lg.client.Do(req))
}

// sync returns once the handler of the previous request has returned: it
// sends GET /sync on the same connection, which the server reads only
// after that handler is done (whatever the answer: a site without /sync
// answers it too). It fails if the connection was not reused.
func (lg *llmGateway) sync() {
	lg.t.Helper()
	reused := false
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) { reused = info.Reused }}
	if _, err := lg.do(httptrace.WithClientTrace(context.Background(), trace), http.MethodGet, "/sync", ""); err != nil {
		lg.t.Fatalf("sync: %v", err)
	}
	if !reused {
		lg.t.Fatal("sync: a new connection was dialed, so it does not prove the previous request finished")
	}
}

// state returns the bucket stored at key; ok is false when there is none
// (a full bucket).
func (lg *llmGateway) state(key string) (st bucket.State, ok bool) {
	lg.t.Helper()
	v := lg.value(key)
	if v == "" {
		return bucket.State{}, false
	}
	st, err := bucket.DecodeState(v)
	if err != nil {
		lg.t.Fatalf("%s: %v", key, err)
	}
	return st, true
}

// redisMicros returns the Redis clock in microseconds.
func (lg *llmGateway) redisMicros() int64 {
	lg.t.Helper()
	now, err := lg.rdb.Time(context.Background()).Result()
	if err != nil {
		lg.t.Fatalf("TIME: %v", err)
	}
	return now.UnixMicro()
}

// markers returns the settlement markers of key.
func (lg *llmGateway) markers(key string) []string {
	lg.t.Helper()
	var out []string
	for _, k := range lg.keys() {
		if strings.HasPrefix(k, key+":settled:") {
			out = append(out, k)
		}
	}
	return out
}

// llmSpec compiles a limit written as in the Caddyfile.
func llmSpec(t *testing.T, capacity int64, refill string) bucket.Spec {
	t.Helper()
	rate, err := bucket.ParseRate(refill)
	if err != nil {
		t.Fatal(err)
	}
	spec, err := bucket.Limit{Capacity: capacity, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// wantSettled checks the bucket at key after a request that the upstream
// saw: it holds wantTokens whole tokens, and it is exactly what
// bucket.SettleState (the model of settle.lua) makes of the state the
// upstream saw, after the estimate was charged, with delta more tokens,
// at the time the settlement stored. One marker records the settlement.
func (lg *llmGateway) wantSettled(what, key string, spec bucket.Spec, seen llmSeen, delta, wantTokens int64) {
	lg.t.Helper()
	after := lg.settledExactly(what, key, spec, seen, 0, delta)
	if got := wholeTokens(after); got != wantTokens {
		lg.t.Errorf("%s: %d whole tokens after the settlement, want %d", what, got, wantTokens)
	}
	if m := lg.markers(key); len(m) != 1 {
		lg.t.Errorf("%s: settlement markers %q, want one", what, m)
	}
}

// Request bodies whose estimate is 500 tokens: 40 characters of text
// (⌈40/4⌉ = 10) and a completion budget of 490.
const (
	chat500 = `{"model":"gpt-test","messages":[{"role":"user","content":"0123456789012345678901234567890123456789"}],"max_tokens":490}`
	// stream_options.include_usage asks for the final usage chunk.
	chatStream500 = `{"model":"gpt-test","stream":true,"stream_options":{"include_usage":true},` +
		`"messages":[{"role":"user","content":"0123456789012345678901234567890123456789"}],"max_tokens":490}`
	chatStreamNoUsage500 = `{"model":"gpt-test","stream":true,` +
		`"messages":[{"role":"user","content":"0123456789012345678901234567890123456789"}],"max_tokens":490}`
	// Anthropic: a system string of 16 characters and a message of 24.
	messages500 = `{"model":"claude-test","max_tokens":490,"system":"0123456789abcdef",` +
		`"messages":[{"role":"user","content":"0123456789abcdef01234567"}]}`
	messagesStream500 = `{"model":"claude-test","max_tokens":490,"stream":true,"system":"0123456789abcdef",` +
		`"messages":[{"role":"user","content":"0123456789abcdef01234567"}]}`
)

// ---------------------------------------------------------------------------
// Settlement, end to end.

// TestSettleEndToEnd: a tokens bucket of 10000 refilled at 1 token an hour
// (so the refill during a test is a few millionths of a token), with cost
// estimate and settle. Each case is a fresh user whose request is
// estimated at 500 tokens; the bucket ends at exactly 10000 − used, stored
// exactly as the Go model of settle.lua computes it from the state the
// upstream saw, and the next request of the user sees 10000 − used − 500.
func TestSettleEndToEnd(t *testing.T) {
	const capacity = 10000
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", "cost estimate\n\t\t\tsettle"))
	spec := llmSpec(t, capacity, "1/1h")
	for _, tc := range []struct {
		name, path, body, usage string
		used                    int64 // -1: no usage reported
	}{
		// 320 used of 500 estimated: 180 given back.
		{"openai_json_refund", "/v1/chat/completions", chat500, "100,220", 320},
		// 900 used of 500: 400 more charged.
		{"openai_json_charge", "/v1/chat/completions", chat500, "400,500", 900},
		// The same usage in the last chunk of a stream settles the same.
		{"openai_stream_refund", "/v1/chat/completions", chatStream500, "100,220", 320},
		{"openai_stream_charge", "/v1/chat/completions", chatStream500, "400,500", 900},
		// Anthropic: input_tokens + output_tokens.
		{"anthropic_json", "/v1/messages", messages500, "120,200", 320},
		{"anthropic_stream", "/v1/messages", messagesStream500, "120,200", 320},
		{"anthropic_stream_charge", "/v1/messages", messagesStream500, "700,200", 900},
		// No usage object, or a stream without include_usage: the
		// estimate stands.
		{"openai_json_no_usage", "/v1/chat/completions", chat500, "", -1},
		{"openai_stream_without_include_usage", "/v1/chat/completions", chatStreamNoUsage500, "100,220", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "user-" + tc.name
			key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
			lg.up.watchKeys(lg.rdb, key)
			r := lg.post(tc.path, tc.body, "X-User", user, "X-Test-Usage", tc.usage)
			if r.status != http.StatusOK {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			// The client sees the decision before the usage is known.
			wantHeaders(t, "response", r.header,
				"X-Estimated-Cost", "500",
				"X-RateLimit-Remaining", "9500",
				"RateLimit", `"user-tokens";r=9500;t=1800000`)
			lg.sync()
			seen := lg.up.last(t)
			if got, _ := bucket.DecodeState(seen.state[key]); wholeTokens(got) != capacity-500 {
				t.Fatalf("the upstream saw %d whole tokens, want %d (the estimate charged)", wholeTokens(got), capacity-500)
			}
			if tc.used < 0 {
				// Settled at the estimate: no script ran, not a bit changed.
				if v := lg.value(key); v != seen.state[key] {
					t.Errorf("bucket changed without usage: %x, then %x", seen.state[key], v)
				}
				if m := lg.markers(key); len(m) != 0 {
					t.Errorf("markers %q without usage", m)
				}
				tc.used = 500
			} else {
				lg.wantSettled("after settlement", key, spec, seen, tc.used-500, capacity-tc.used)
			}
			// The next request is decided on the settled bucket.
			r = lg.post(tc.path, tc.body, "X-User", user)
			want := strconv.FormatInt(capacity-tc.used-500, 10)
			if r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != want {
				t.Errorf("next request: %d, remaining %q, want 200, %s", r.status, r.header.Get("X-RateLimit-Remaining"), want)
			}
			lg.sync()
		})
	}
}

// TestSettleLocalDecisions: with Redis down, on_redis_error local (the
// default) decides in the gateway's own buckets, and settles there too. A
// tokens bucket of 1000, refilled at 1 token an hour, and requests
// estimated at 500: a user whose answers report 21 tokens is charged 21
// each, so its 24th request still finds 1000 − 23·21 = 517 ≥ 500 and its
// 25th 496; one whose first answer reports 900 is charged 400 more and
// has 100 left, so its second is denied. Unsettled, each would keep 500,
// and the second request of both would be the last allowed.
func TestSettleLocalDecisions(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 1000 1/1h tokens", "cost estimate\n\t\t\tsettle"))
	lg.redis.Stop()
	for _, tc := range []struct {
		name, usage string
		allowed     int // requests allowed in a row, then one denied
	}{
		{"refund", "10,11", 24},
		{"charge", "400,500", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			for i := 1; i <= tc.allowed+1; i++ {
				r := lg.post("/v1/chat/completions", chat500, "X-User", "local-"+tc.name, "X-Test-Usage", tc.usage)
				want := http.StatusOK
				if i > tc.allowed {
					want = http.StatusTooManyRequests
				}
				if r.status != want {
					t.Fatalf("request %d: status %d (%s), want %d", i, r.status, r.body, want)
				}
				if i == 1 && r.header.Get("X-Estimated-Cost") != "500" {
					t.Fatalf("estimated at %q, want 500", r.header.Get("X-Estimated-Cost"))
				}
				lg.sync()
			}
		})
	}
}

// longAnswer is an answer long enough for Caddy's encode to compress (its
// default minimum_length is 512 bytes).
var longAnswer = strings.Repeat("The gateway settles what the provider reports, not what it guessed. ", 12)

// wantCoded checks that an answer came in the content coding wanted ("":
// none) and carries a usage object once decoded.
func wantCoded(t *testing.T, r e2eResponse, coding string) {
	t.Helper()
	if got := r.header.Get("Content-Encoding"); got != coding {
		t.Fatalf("Content-Encoding %q, want %q", got, coding)
	}
	body, err := providertest.Decode(coding, []byte(r.body))
	if err != nil {
		t.Fatalf("decoding the %s answer: %v", coding, err)
	}
	if !strings.Contains(string(body), `"usage":{`) {
		t.Fatalf("the decoded answer has no usage: %s", body)
	}
	if coding != "" && strings.Contains(r.body, `"usage"`) {
		t.Fatal("the answer reads as plain text")
	}
}

// TestProviderCompressedAnswersSettle: the provider compresses a JSON
// answer in a coding the client's Accept-Encoding allows (reverse_proxy
// passes the header on, and the answer back as it is): gzip, deflate
// (zlib) or zstd. The gateway settles from it exactly as from a plain one:
// 320 used of the 500 estimated.
func TestProviderCompressedAnswersSettle(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", "cost estimate\n\t\t\tsettle"))
	spec := llmSpec(t, 10000, "1/1h")
	for _, tc := range []struct{ name, path, body, coding string }{
		{"openai_identity", "/v1/chat/completions", chat500, ""},
		{"openai_gzip", "/v1/chat/completions", chat500, "gzip"},
		{"openai_deflate", "/v1/chat/completions", chat500, "deflate"},
		{"openai_zstd", "/v1/chat/completions", chat500, "zstd"},
		{"anthropic_gzip", "/v1/messages", messages500, "gzip"},
		{"anthropic_zstd", "/v1/messages", messages500, "zstd"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "coded-" + tc.name
			key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
			lg.up.watchKeys(lg.rdb, key)
			accept := "gzip, deflate, zstd" // a provider that compresses nothing
			if tc.coding != "" {
				lg.up.SetEncodings(tc.coding)
				accept = tc.coding
			} else {
				lg.up.SetEncodings()
			}
			r := lg.post(tc.path, tc.body, "X-User", user, "X-Test-Usage", "100,220", "Accept-Encoding", accept)
			if r.status != http.StatusOK {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			wantCoded(t, r, tc.coding)
			if ae := lg.up.last(t).Header.Get("Accept-Encoding"); ae != accept {
				t.Errorf("the provider got Accept-Encoding %q, want the client's %q", ae, accept)
			}
			lg.sync()
			lg.wantSettled(tc.name, key, spec, lg.up.last(t), 320-500, 10000-320)
		})
	}
}

// TestProviderEncodeCompressedAnswersSettle: Caddy's encode in front of
// reverse_proxy compresses what the provider sends plain, JSON answers and
// event streams alike, in gzip or zstd as the client allows; token_bucket,
// which the directive order puts before encode, settles from what encode
// wrote exactly as from a plain answer: 320 used of the 500 estimated.
func TestProviderEncodeCompressedAnswersSettle(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", "cost estimate\n\t\t\tsettle")+"\n\t\tencode zstd gzip")
	lg.up.SetEncodings()
	lg.up.SetReply(func(r *providertest.Request) providertest.Reply {
		rep := llmTestReply(r)
		rep.Text = longAnswer
		return rep
	})
	spec := llmSpec(t, 10000, "1/1h")
	for _, tc := range []struct{ name, path, body, coding string }{
		{"openai_json_gzip", "/v1/chat/completions", chat500, "gzip"},
		{"openai_json_zstd", "/v1/chat/completions", chat500, "zstd"},
		{"openai_stream_gzip", "/v1/chat/completions", chatStream500, "gzip"},
		{"openai_stream_zstd", "/v1/chat/completions", chatStream500, "zstd"},
		{"anthropic_json_gzip", "/v1/messages", messages500, "gzip"},
		{"anthropic_stream_gzip", "/v1/messages", messagesStream500, "gzip"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "encoded-" + tc.name
			key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
			lg.up.watchKeys(lg.rdb, key)
			r := lg.post(tc.path, tc.body, "X-User", user, "X-Test-Usage", "100,220", "Accept-Encoding", tc.coding)
			if r.status != http.StatusOK {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			wantCoded(t, r, tc.coding)
			lg.sync()
			lg.wantSettled(tc.name, key, spec, lg.up.last(t), 320-500, 10000-320)
		})
	}
}

// TestSettleHeaderMode: with settle header X-Tokens-Used, the header's
// count settles and the body (which reports other usage) is not read.
func TestSettleHeaderMode(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", "cost estimate\n\t\t\tsettle header X-Tokens-Used"))
	spec := llmSpec(t, 10000, "1/1h")
	for _, tc := range []struct {
		name, tokensUsed string
		want             int64 // whole tokens after; -1: unchanged
	}{
		{"refund", "320", 10000 - 320},
		{"charge", "900", 10000 - 900},
		{"not_a_number", "lots", -1},
		{"negative", "-5", -1},
		{"absent", "", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "header-" + tc.name
			key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
			lg.up.watchKeys(lg.rdb, key)
			r := lg.post("/v1/chat/completions", chat500, "X-User", user, "X-Test-Usage", "1,1", "X-Test-Tokens-Used", tc.tokensUsed)
			if r.status != http.StatusOK || r.header.Get("X-Tokens-Used") != tc.tokensUsed {
				t.Fatalf("%d, X-Tokens-Used %q", r.status, r.header.Get("X-Tokens-Used"))
			}
			lg.sync()
			seen := lg.up.last(t)
			if tc.want < 0 {
				if v := lg.value(key); v != seen.state[key] {
					t.Errorf("bucket changed: %x, then %x", seen.state[key], v)
				}
				return
			}
			lg.wantSettled("header", key, spec, seen, 10000-tc.want-500, tc.want)
		})
	}
}

// TestSettleHeaderHiddenFromClients: a site that keeps the usage header
// from its clients with header -X-Tokens-Used (a deferred deletion, which
// Caddy's order runs before token_bucket, so around it) still settles from
// it: the count is read as the upstream sent it, not after the handlers
// around token_bucket have taken it out.
func TestSettleHeaderHiddenFromClients(t *testing.T) {
	up := startLLMUpstream(t)
	limiter := llmLimiter("user 10000 1/1h tokens", "cost estimate\n\t\t\tsettle header X-Tokens-Used")
	g := startGateway(t, "header -X-Tokens-Used\n"+llmSite(up.Addr, limiter))
	tr := &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	lg := &llmGateway{e2eGateway: g, up: up, client: &http.Client{Transport: tr, Timeout: time.Minute}}
	spec := llmSpec(t, 10000, "1/1h")
	key := bucket.NewKeyer("rl:", "").Key("user", "hidden", "tokens")
	lg.up.watchKeys(lg.rdb, key)
	r := lg.post("/v1/chat/completions", chat500, "X-User", "hidden", "X-Test-Usage", "1,1", "X-Test-Tokens-Used", "320")
	if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != "500" {
		t.Fatalf("%d, estimated cost %q; want 200 with an estimate of 500", r.status, r.header.Get("X-Estimated-Cost"))
	}
	if v := r.header.Values("X-Tokens-Used"); len(v) != 0 {
		t.Fatalf("the client received X-Tokens-Used %q, which the site deletes", v)
	}
	lg.sync()
	lg.wantSettled("hidden header", key, spec, lg.up.last(t), 320-500, 10000-320)
}

// TestSettleDebtDelaysNextRequest: a bucket of 1000 refilled at 1000 a
// minute (1 token per 60 ms). A request estimated at 500 that used 1500
// leaves the bucket 500 tokens in debt: T' = −500. By docs/design.md §2 a request
// of cost c then waits (c − T')/r: a peek (cost 0) exactly debt/refill =
// 500 / (1000/60 s) = 30 s, a request of 500 tokens 60 s, less the refill
// since the charge, which the test brackets between two readings of the
// Redis clock. The denial reports 0 remaining, never a negative count.
func TestSettleDebtDelaysNextRequest(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 1000 1000/1m tokens", "cost estimate\n\t\t\tsettle"))
	spec := llmSpec(t, 1000, "1000/1m")
	key := bucket.NewKeyer("rl:", "").Key("user", "agent", "tokens")
	lg.up.watchKeys(lg.rdb, key)

	const est = `{"model":"gpt-test","messages":[],"max_tokens":500}`
	r := lg.post("/v1/chat/completions", est, "X-User", "agent", "X-Test-Usage", "1000,500")
	if r.status != http.StatusOK {
		t.Fatalf("first request: %d %s", r.status, r.body)
	}
	wantHeaders(t, "first request", r.header, "X-Estimated-Cost", "500", "X-RateLimit-Remaining", "500")
	lg.sync()
	seen := lg.up.last(t)
	charged, _ := bucket.DecodeState(seen.state[key])
	settled, ok := lg.state(key)
	if !ok {
		t.Fatal("no bucket after the settlement")
	}
	// 1000 more tokens: 500 held (plus the refill since the charge) − 1000.
	if model, _ := bucket.SettleState(settled.Last, spec, charged, 1000); model != settled {
		t.Fatalf("settled bucket %+v, want the model's %+v", settled, model)
	}
	if wholeTokens(settled) >= 0 {
		t.Fatalf("bucket holds %d whole tokens after using 1500, want a debt", wholeTokens(settled))
	}

	for _, tc := range []struct {
		name, body string
		cost       int64
		waitS      int64 // (cost + 500) / (1000/60) seconds
	}{
		{"peek", `{"model":"gpt-test","messages":[],"max_tokens":0}`, 0, 30},
		{"cost_500", est, 500, 60},
	} {
		t0 := lg.redisMicros()
		r := lg.post("/v1/chat/completions", tc.body, "X-User", "agent")
		t1 := lg.redisMicros()
		if r.status != http.StatusTooManyRequests {
			t.Fatalf("%s: status %d, want 429: %s", tc.name, r.status, r.body)
		}
		ms, err := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
		if err != nil {
			t.Fatalf("%s: Retry-After-Ms %q", tc.name, r.header.Get("Retry-After-Ms"))
		}
		// The model decides the same request at the earliest and the
		// latest time Redis could have: the wait only shrinks with time.
		early := bucket.Decide(t0, []bucket.Take{{Spec: spec, Cost: tc.cost}}, []bucket.State{settled}, []bool{false})
		late := bucket.Decide(t1, []bucket.Take{{Spec: spec, Cost: tc.cost}}, []bucket.State{settled}, []bool{false})
		if ms > early.RetryAfterMS || ms < late.RetryAfterMS {
			t.Errorf("%s: Retry-After-Ms %d, want the model's wait between %d and %d", tc.name, ms, late.RetryAfterMS, early.RetryAfterMS)
		}
		// The same wait in closed form: (cost + 500) tokens at 60 ms each,
		// less the whole milliseconds of refill since the charge.
		want := func(at int64) int64 { return tc.waitS*1000 - (at-charged.Last)/1000 }
		if ms > want(t0) || ms < want(t1) {
			t.Errorf("%s: Retry-After-Ms %d, want %d s less the refill: between %d and %d", tc.name, ms, tc.waitS, want(t1), want(t0))
		}
		wantAfter := strconv.FormatInt((ms+999)/1000, 10)
		if t1-charged.Last < 1_000_000 {
			wantAfter = strconv.FormatInt(tc.waitS, 10) // under a second since the charge
		}
		wantHeaders(t, tc.name, r.header,
			"Retry-After", wantAfter,
			"X-RateLimit-Remaining", "0",
			"RateLimit", `"user-tokens";r=0;t=`+wantAfter)
		wantBody := fmt.Sprintf(`{"error":"rate_limit_exceeded","retry_after":%s,"retry_after_ms":%d,"tier":"free","dimension":"user"}`+"\n", wantAfter, ms)
		if r.body != wantBody {
			t.Errorf("%s: body %q, want %q", tc.name, r.body, wantBody)
		}
		t.Logf("%s: debt %d tokens, Retry-After %s, Retry-After-Ms %d (%.1f ms since the charge)",
			tc.name, -wholeTokens(settled), r.header.Get("Retry-After"), ms, float64(t1-charged.Last)/1000)
	}
	if v, _ := lg.state(key); v != settled {
		t.Errorf("denials wrote the bucket: %+v, then %+v", settled, v)
	}
	if n := len(lg.up.requests()); n != 1 {
		t.Errorf("the upstream saw %d requests, want 1", n)
	}
}

// TestSettleStreamPassesThrough: a streamed response reaches the client
// event by event while the handler keeps its tail for the usage: the client
// reads the first event while the upstream holds back the rest.
func TestSettleStreamPassesThrough(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", "cost estimate\n\t\t\tsettle"))
	key := bucket.NewKeyer("rl:", "").Key("user", "streamer", "tokens")
	lg.up.watchKeys(lg.rdb, key)
	lg.up.hold()
	req, err := http.NewRequest(http.MethodPost, lg.url+"v1/chat/completions", strings.NewReader(chatStream500))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-User", "streamer")
	req.Header.Set("X-Test-Usage", "100,220")
	res, err := lg.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if mt, _, err := mime.ParseMediaType(res.Header.Get("Content-Type")); res.StatusCode != http.StatusOK || err != nil || mt != "text/event-stream" {
		t.Fatalf("%d %q", res.StatusCode, res.Header.Get("Content-Type"))
	}
	br := bufio.NewReader(res.Body)
	first, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(first, `data: {"id":"chatcmpl-test"`) || !strings.Contains(first, `"role":"assistant"`) {
		t.Fatalf("first event %q, %v", first, err)
	}
	lg.up.release()
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	events := strings.Count(first+string(rest), "data: ")
	if events != 6 || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Errorf("%d events, ending %q; want 6 ending with [DONE]", events, string(rest)[max(0, len(rest)-20):])
	}
	lg.sync()
	lg.wantSettled("stream", key, llmSpec(t, 10000, "1/1h"), lg.up.last(t), 320-500, 10000-320)
}

// TestSettleOnceDirect: settling a request id twice changes the buckets
// once: the second call returns false and leaves every bit as it was.
func TestSettleOnceDirect(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	spec := llmSpec(t, 10000, "1/1h")
	keyer := bucket.NewKeyer("rl:", "")
	keys := []string{keyer.Key("user", "alice", "tokens"), keyer.Key("user", "alice", "tokens-2")}
	store := bucket.Redis{Client: rdb}
	// Charge 500 on both, as the limiter does before the upstream.
	d, err := store.Take(ctx, keys, []bucket.Take{{Spec: spec, Cost: 500}, {Spec: spec, Cost: 500}})
	if err != nil || !d.Allowed {
		t.Fatalf("take: %+v %v", d, err)
	}
	adj := []bucket.Adjust{{Spec: spec, Delta: -180}, {Spec: spec, Delta: -180}}
	ok, err := store.Settle(ctx, "req-1", keys, adj)
	if err != nil || !ok {
		t.Fatalf("first settle: %v %v, want true", ok, err)
	}
	after := make([]string, len(keys))
	for i, k := range keys {
		after[i] = rdb.Get(ctx, k).Val()
		st, err := bucket.DecodeState(after[i])
		if err != nil || wholeTokens(st) != 10000-320 {
			t.Fatalf("%s after the settlement: %+v %v, want %d whole tokens", k, st, err, 10000-320)
		}
	}
	for _, again := range []int64{-180, 400} { // a retry, or a second reading of other usage
		ok, err := store.Settle(ctx, "req-1", keys, []bucket.Adjust{{Spec: spec, Delta: again}, {Spec: spec, Delta: again}})
		if err != nil || ok {
			t.Fatalf("second settle of req-1 (delta %d): %v %v, want false", again, ok, err)
		}
		for i, k := range keys {
			if v := rdb.Get(ctx, k).Val(); v != after[i] {
				t.Errorf("second settle of req-1 changed %s: %x, then %x", k, after[i], v)
			}
		}
	}
	// The marker lives on the first key's slot for bucket.SettleTTL.
	ttl := rdb.PTTL(ctx, keys[0]+":settled:req-1").Val()
	if ttl <= bucket.SettleTTL-10*time.Second || ttl > bucket.SettleTTL {
		t.Errorf("marker TTL %v, want about %v", ttl, bucket.SettleTTL)
	}
	// Another request id settles.
	if ok, err := store.Settle(ctx, "req-2", keys[:1], adj[:1]); err != nil || !ok {
		t.Fatalf("settle req-2: %v %v", ok, err)
	}
	st, _ := bucket.DecodeState(rdb.Get(ctx, keys[0]).Val())
	if wholeTokens(st) != 10000-140 {
		t.Errorf("after req-2: %d whole tokens, want %d", wholeTokens(st), 10000-140)
	}
}

// TestSettleDebtIsCappedAndRefundsFill: a settlement moves a bucket by the
// whole difference, but a debt never goes below minus one capacity, and a
// bucket given back up to full is deleted (a missing key is a full
// bucket), each step stored exactly as bucket.SettleState says.
func TestSettleDebtIsCappedAndRefundsFill(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	spec := llmSpec(t, 1000, "1/1h")
	store := bucket.Redis{Client: rdb}
	key := bucket.NewKeyer("rl:", "").Key("user", "bob", "tokens")
	if d, err := store.Take(ctx, []string{key}, []bucket.Take{{Spec: spec, Cost: 1000}}); err != nil || !d.Allowed {
		t.Fatalf("take: %+v %v", d, err)
	}
	for i, step := range []struct {
		delta, want int64 // want: whole tokens after; 1000 means deleted
	}{
		{5000, -1000}, // 0 − 5000 stops at −1000
		{1, -1000},    // −1001 stops at −1000
		{-1500, 500},  // −1000 + 1500: more than one capacity back
		{-1000, 1000}, // 500 + 1000 stops at full: deleted
	} {
		before, _ := bucket.DecodeState(rdb.Get(ctx, key).Val())
		if ok, err := store.Settle(ctx, "req-"+strconv.Itoa(i), []string{key}, []bucket.Adjust{{Spec: spec, Delta: step.delta}}); err != nil || !ok {
			t.Fatalf("settle %d: %v %v", step.delta, ok, err)
		}
		v, err := rdb.Get(ctx, key).Result()
		if step.want == 1000 {
			if err != redis.Nil {
				t.Errorf("settle %d: bucket still stored (%x, %v), want it deleted as full", step.delta, v, err)
			}
			continue
		}
		after, err := bucket.DecodeState(v)
		if err != nil {
			t.Fatalf("settle %d: %v", step.delta, err)
		}
		model, kept := bucket.SettleState(after.Last, spec, before, step.delta)
		if !kept || after != model || wholeTokens(after) != step.want {
			t.Errorf("settle %d: %+v (%d whole tokens), want the model's %+v: %d", step.delta, after, wholeTokens(after), model, step.want)
		}
	}
}

// ---------------------------------------------------------------------------
// Requests and tokens limits on one dimension.

// TestRequestsAndTokensDenyTogether: a user has a requests limit (3 at 1 an
// hour) and a tokens limit (1000 at 1 an hour). A request the tokens
// bucket denies charges the requests bucket nothing, and the reverse.
func TestRequestsAndTokensDenyTogether(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 3 1/1h\n\t\t\t\tuser 1000 1/1h tokens", "cost estimate"))
	keyer := bucket.NewKeyer("rl:", "")
	body := func(maxTokens int) string {
		return fmt.Sprintf(`{"model":"gpt-test","messages":[],"max_tokens":%d}`, maxTokens)
	}
	both := func(user string) (string, string) {
		return lg.value(keyer.Key("user", user, "")), lg.value(keyer.Key("user", user, "tokens"))
	}
	wantWhole := func(what, v string, want int64) {
		t.Helper()
		st, err := bucket.DecodeState(v)
		if err != nil || wholeTokens(st) != want {
			t.Errorf("%s: %+v %v, want %d whole tokens", what, st, err, want)
		}
	}

	// Tokens deny: 600, then 600 more of the 400 left.
	if r := lg.post("/v1/chat/completions", body(600), "X-User", "alice"); r.status != http.StatusOK {
		t.Fatalf("alice 1: %d", r.status)
	}
	reqBefore, tokBefore := both("alice")
	wantWhole("alice requests", reqBefore, 2)
	wantWhole("alice tokens", tokBefore, 400)
	r := lg.post("/v1/chat/completions", body(600), "X-User", "alice")
	if r.status != http.StatusTooManyRequests || !strings.Contains(r.body, `"dimension":"user"`) {
		t.Fatalf("alice 2: %d %s, want 429", r.status, r.body)
	}
	// The tokens bucket decided: 200 tokens short at 1 an hour. A denial's
	// RateLimit has the denying bucket's item only.
	wantHeaders(t, "alice denied", r.header,
		"Retry-After", "720000",
		"RateLimit", `"user-tokens";r=400;t=720000`,
		"X-RateLimit-Limit", "1000",
		"X-RateLimit-Remaining", "400")
	if reqAfter, tokAfter := both("alice"); reqAfter != reqBefore || tokAfter != tokBefore {
		t.Errorf("a request the tokens bucket denied changed the buckets: requests %x → %x, tokens %x → %x",
			reqBefore, reqAfter, tokBefore, tokAfter)
	}

	// Requests deny: 3 requests of 10 tokens, then a fourth.
	for i := 1; i <= 3; i++ {
		if r := lg.post("/v1/chat/completions", body(10), "X-User", "bob"); r.status != http.StatusOK {
			t.Fatalf("bob %d: %d", i, r.status)
		}
	}
	reqBefore, tokBefore = both("bob")
	wantWhole("bob requests", reqBefore, 0)
	wantWhole("bob tokens", tokBefore, 970)
	r = lg.post("/v1/chat/completions", body(10), "X-User", "bob")
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("bob 4: %d, want 429", r.status)
	}
	wantHeaders(t, "bob denied", r.header,
		"Retry-After", "3600",
		"RateLimit", `"user";r=0;t=3600`,
		"X-RateLimit-Limit", "3",
		"X-RateLimit-Remaining", "0")
	if reqAfter, tokAfter := both("bob"); reqAfter != reqBefore || tokAfter != tokBefore {
		t.Errorf("a request the requests bucket denied changed the buckets: requests %x → %x, tokens %x → %x",
			reqBefore, reqAfter, tokBefore, tokAfter)
	}
	if n := len(lg.up.requests()); n != 4 {
		t.Errorf("the upstream saw %d requests, want the 4 allowed", n)
	}
}

// ---------------------------------------------------------------------------
// OpenAI's rate-limit headers.

// TestOpenAIHeaders: openai_headers adds x-ratelimit-{limit,remaining,
// reset}-{requests,tokens} as OpenAI sends them, resets as Go durations:
// 10 requests an hour refill one in 6 minutes ("6m0s"); 500 tokens at 1000
// a minute take 30 s ("30s"). A prompt above the capacity is 429
// cost_exceeds_capacity with x-should-retry: false and no Retry-After; a
// budget above it is capped to it.
func TestOpenAIHeaders(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10 10/1h\n\t\t\t\tuser 100000 1000/1m tokens", "cost estimate\n\t\t\topenai_headers"))
	r := lg.post("/v1/chat/completions", chat500, "X-User", "alice")
	if r.status != http.StatusOK {
		t.Fatalf("alice: %d %s", r.status, r.body)
	}
	wantHeaders(t, "allowed", r.header,
		"X-Estimated-Cost", "500",
		"x-ratelimit-limit-requests", "10",
		"x-ratelimit-remaining-requests", "9",
		"x-ratelimit-reset-requests", "6m0s",
		"x-ratelimit-limit-tokens", "100000",
		"x-ratelimit-remaining-tokens", "99500",
		"x-ratelimit-reset-tokens", "30s",
		"x-should-retry", "",
		// The generic headers stay: the most constrained bucket (9/10 of
		// requests left against 995/1000 of tokens).
		"X-RateLimit-Limit", "10",
		"X-RateLimit-Remaining", "9",
		"X-RateLimit-Reset", "360")

	// A prompt of 100001 tokens (400004 characters) can never fit in
	// 100000, whatever its budget (a budget alone is capped to fit).
	huge := `{"model":"gpt-test","messages":[{"role":"user","content":"` + strings.Repeat("abcd", 100001) + `"}],"max_tokens":1}`
	r = lg.post("/v1/chat/completions", huge, "X-User", "carol")
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("carol: %d %.300s", r.status, r.body)
	}
	const wantBody = `{"error":"cost_exceeds_capacity","cost":100001,"capacity":100000,"tier":"free","dimension":"user"}` + "\n"
	if r.body != wantBody {
		t.Errorf("body %q, want %q", r.body, wantBody)
	}
	wantHeaders(t, "cost exceeds capacity", r.header,
		"x-should-retry", "false",
		"Retry-After", "",
		"Retry-After-Ms", "",
		"x-ratelimit-limit-requests", "10",
		"x-ratelimit-remaining-requests", "10",
		"x-ratelimit-reset-requests", "0s",
		"x-ratelimit-limit-tokens", "100000",
		"x-ratelimit-remaining-tokens", "100000",
		"x-ratelimit-reset-tokens", "0s")

	// A budget of 100001 tokens with no prompt is capped to the capacity:
	// allowed, charged all of it.
	r = lg.post("/v1/chat/completions", `{"model":"gpt-test","messages":[],"max_tokens":100001}`, "X-User", "carla")
	if r.status != http.StatusOK {
		t.Fatalf("carla: %d %s", r.status, r.body)
	}
	wantHeaders(t, "capped budget", r.header,
		"X-Estimated-Cost", "100000",
		"x-should-retry", "",
		"x-ratelimit-remaining-tokens", "0")

	// The whole capacity, then a request that must wait: the tokens reset
	// is the wait, the same as Retry-After-Ms; a wait helps, so no
	// x-should-retry: false.
	t0 := lg.redisMicros()
	r = lg.post("/v1/chat/completions", `{"model":"gpt-test","messages":[],"max_tokens":100000}`, "X-User", "dave")
	wantHeaders(t, "full capacity", r.header,
		"x-ratelimit-remaining-tokens", "0",
		"x-ratelimit-reset-tokens", "1h40m0s", // 100000 tokens at 1000 a minute
		"x-ratelimit-remaining-requests", "9",
		"x-ratelimit-reset-requests", "6m0s")
	r = lg.post("/v1/chat/completions", chat500, "X-User", "dave")
	t1 := lg.redisMicros()
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("dave 2: %d", r.status)
	}
	// 500 tokens at 60 ms each, less the whole milliseconds refilled
	// between the two requests, which happened between t0 and t1.
	ms, err := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
	if err != nil || ms > 30000 || ms < 30000-(t1-t0)/1000 {
		t.Fatalf("Retry-After-Ms %q, want 30000 less at most the %d ms between the requests", r.header.Get("Retry-After-Ms"), (t1-t0)/1000)
	}
	// The tokens left are what refilled meanwhile: the 30000 - ms whole
	// milliseconds since the charge, a whole token every 60 of them (none
	// while the requests are less than 60 ms apart).
	wantHeaders(t, "rate limited", r.header,
		"x-should-retry", "",
		"x-ratelimit-remaining-tokens", strconv.FormatInt((30000-ms)/60, 10),
		"x-ratelimit-reset-tokens", (time.Duration(ms) * time.Millisecond).String(),
		"x-ratelimit-remaining-requests", "9")
	// Requests headers are absent for a tier without a requests limit.
	lg.load(llmSite(lg.up.Addr,
		llmLimiter("user 100000 1000/1m tokens", "cost estimate\n\t\t\topenai_headers")))
	lg.client.Transport.(*http.Transport).CloseIdleConnections()
	r = lg.post("/v1/chat/completions", chat500, "X-User", "erin")
	wantHeaders(t, "tokens only", r.header,
		"x-ratelimit-limit-requests", "",
		"x-ratelimit-remaining-requests", "",
		"x-ratelimit-reset-requests", "",
		"x-ratelimit-remaining-tokens", "99500",
		"x-ratelimit-reset-tokens", "30s")
}

// TestOpenAIHeadersLongestWait: with two tokens buckets that both deny
// (a user's and an API key's), x-ratelimit-reset-tokens is the longest
// wait, the one Retry-After gives: a client that waited only the shorter
// one would be denied again. A cost above a capacity is the constraint
// over any wait. x-should-retry is not one of these headers: every
// cost_exceeds_capacity denial sends it (TestOpenAIHeaders).
func TestOpenAIHeadersLongestWait(t *testing.T) {
	spec := llmSpec(t, 1000, "1000/1m")
	limits := []*limit{
		{dimension: "user", tokens: true, spec: spec},
		{dimension: "api_key", tokens: true, spec: spec},
		{dimension: "user", spec: llmSpec(t, 10, "10/1h")},
	}
	for _, tc := range []struct {
		name             string
		results          []bucket.Result
		remaining, reset string
		requestsReset    string
	}{
		{"longer_wait_second", []bucket.Result{
			{Remaining: 900, Reason: bucket.RateLimited, RetryAfterMS: 10000},
			{Remaining: 100, Reason: bucket.RateLimited, RetryAfterMS: 60000},
			{Remaining: 9, FullMS: 360000},
		}, "100", "1m0s", "6m0s"},
		{"longer_wait_first", []bucket.Result{
			{Remaining: 100, Reason: bucket.RateLimited, RetryAfterMS: 60000},
			{Remaining: 900, Reason: bucket.RateLimited, RetryAfterMS: 10000},
			{Remaining: 9, FullMS: 360000},
		}, "100", "1m0s", "6m0s"},
		{"cost_exceeds_capacity_over_a_wait", []bucket.Result{
			{Remaining: 100, Reason: bucket.RateLimited, RetryAfterMS: 60000},
			{Remaining: 1000, Reason: bucket.CostExceedsCapacity},
			{Remaining: 10},
		}, "1000", "0s", "0s"},
	} {
		d := bucket.Summarize(tc.results)
		hdr := http.Header{}
		var hs headerSet
		var arr [64]byte
		hs.setIn(hdr, appendOpenAIHeaders(&hs, arr[:0], limits, &d))
		wantHeaders(t, tc.name, hdr,
			"x-ratelimit-limit-tokens", "1000",
			"x-ratelimit-remaining-tokens", tc.remaining,
			"x-ratelimit-reset-tokens", tc.reset,
			"x-ratelimit-reset-requests", tc.requestsReset,
			"x-should-retry", "")
		if want := (time.Duration(d.RetryAfterMS) * time.Millisecond).String(); d.Reason == bucket.RateLimited && tc.reset != want {
			t.Errorf("%s: the test wants reset %s, Retry-After-Ms says %s", tc.name, tc.reset, want)
		}
	}
}

// ---------------------------------------------------------------------------
// Caddyfile.llm.example.

// TestLLMExampleAdapts: Caddyfile.llm.example adapts without warnings (so it
// is formatted as caddy fmt writes it) and its limiter has cost estimate,
// settle and openai_headers.
func TestLLMExampleAdapts(t *testing.T) {
	src, err := os.ReadFile("Caddyfile.llm.example")
	if err != nil {
		t.Fatal(err)
	}
	out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(src, map[string]any{"filename": "Caddyfile.llm.example"})
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	for _, w := range warnings {
		t.Errorf("adapt warning: %s:%d: %s", w.File, w.Line, w.Message)
	}
	var handlers []json.RawMessage
	collectTokenBuckets(t, out, &handlers)
	if len(handlers) != 1 {
		t.Fatalf("%d token_bucket handlers, want 1\n%s", len(handlers), out)
	}
	var h Handler
	if err := json.Unmarshal(handlers[0], &h); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err != nil {
		t.Errorf("validate: %v", err)
	}
	if h.Estimate == nil || h.Estimate.MaxBody != 1<<20 || h.Estimate.DefaultMaxTokens != 1024 ||
		h.Estimate.OnInvalid == nil || *h.Estimate.OnInvalid != -1 {
		t.Errorf("estimate %+v, want max_body 1MiB, default_max_tokens 1024, on_invalid reject", h.Estimate)
	}
	if h.Settle == nil || h.Settle.Header != "" || !h.OpenAIHeaders {
		t.Errorf("settle %+v, openai_headers %v; want settle from the body and openai_headers", h.Settle, h.OpenAIHeaders)
	}
	tokens := 0
	for _, tier := range h.Tiers {
		for _, l := range tier.Limits {
			if l.Unit == UnitTokens {
				tokens++
			}
		}
	}
	if tokens == 0 {
		t.Error("no tokens limit")
	}
}

// collectTokenBuckets finds every token_bucket handler in an adapted config.
func collectTokenBuckets(t *testing.T, raw json.RawMessage, out *[]json.RawMessage) {
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	var walk func(any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "token_bucket" {
				b, _ := json.Marshal(v)
				*out = append(*out, b)
				return
			}
			for _, x := range v {
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		}
	}
	walk(v)
}

// serveExample loads the example Caddyfile file as it is, with its
// environment variables pointing at free ports and a test Redis (a 10 s
// timeout, so that a slow test machine never meets on_redis_error; plain
// SHA-256 keys), until the end of the test. It returns the gateway's base
// URL and a client of the Redis.
func serveExample(t *testing.T, file string) (string, *redis.Client) {
	t.Helper()
	t.Cleanup(func() {
		if t.Skipped() && !testing.Short() {
			t.Error("skipped: Caddy could not start")
		}
	})
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	srv := redistest.Start(t)
	gwPort, upPort := redistest.FreePort(t), redistest.FreePort(t)
	t.Setenv("GATEWAY_PORT", strconv.Itoa(gwPort))
	t.Setenv("UPSTREAM_PORT", strconv.Itoa(upPort))
	t.Setenv("REDIS_URL", "redis://"+srv.Addr)
	t.Setenv("REDIS_TIMEOUT", "10s")
	t.Setenv("CADDY_ADMIN", "localhost:"+strconv.Itoa(adminPort))
	t.Setenv("TOKEN_BUCKET_KEY_SECRET", "")
	tester := caddytest.NewTester(t).WithDefaultOverrides(testerConfig())
	t.Cleanup(func() {
		if err := postLoad(globalOptions(gwPort), "caddyfile"); err != nil {
			t.Errorf("unloading the example: %v", err)
		}
	})
	tester.InitServer(string(src), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	return fmt.Sprintf("http://127.0.0.1:%d/", gwPort), srv.Client(t)
}

// TestLLMExampleRuns loads Caddyfile.llm.example as it is, with its
// environment variables pointing at free ports and a test Redis, and sends
// a chat completion through it: the demo upstream answers with usage 21,
// the estimate (⌈6/4⌉ + 1024 = 1026) is charged first and settled down to
// 21 after.
func TestLLMExampleRuns(t *testing.T) {
	base, rdb := serveExample(t, "Caddyfile.llm.example")
	tr := &http.Transport{MaxConnsPerHost: 1, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	lg := &llmGateway{e2eGateway: &e2eGateway{t: t, rdb: rdb, url: base},
		client: &http.Client{Transport: tr, Timeout: time.Minute}}
	key := bucket.NewKeyer("rl:", "").Key("api_key", "sk-free-demo", "tokens")
	const body = `{"model":"demo","messages":[{"role":"user","content":"Hello!"}]}`
	t0 := lg.redisMicros()
	r := lg.post("/v1/chat/completions", body, "Authorization", "Bearer sk-free-demo")
	if r.status != http.StatusOK || !strings.Contains(r.body, `"total_tokens":21`) {
		t.Fatalf("%d %s", r.status, r.body)
	}
	wantHeaders(t, "example", r.header,
		"x-ratelimit-limit-tokens", "10000",
		"x-ratelimit-remaining-tokens", strconv.Itoa(10000-1026),
		"x-ratelimit-limit-requests", "20",
		"x-ratelimit-remaining-requests", "19")
	lg.sync()
	st, ok := lg.state(key)
	if !ok {
		t.Fatal("no tokens bucket after the request")
	}
	// 10000 − 21 tokens, plus what refilled (1 unit per µs) between the
	// charge, at some time after t0, and the settlement at st.Last.
	spec := llmSpec(t, 10000, "10000/1m")
	extra := st.Units - (10000-21)*spec.Scale
	if extra < 0 || extra > (st.Last-t0)*spec.Refill {
		t.Errorf("settled bucket %+v: %d units above 10000 − 21 tokens, want 0 to %d (the refill since the request)",
			st, extra, (st.Last-t0)*spec.Refill)
	}
	if m := lg.markers(key); len(m) != 1 {
		t.Errorf("markers %q, want one", m)
	}
}

// TestRequestsWithoutBodyCostNoTokens: with cost estimate, a request
// without a body (GET /v1/models, which the OpenAI SDK's models.list
// sends; HEAD; a CORS preflight; DELETE; a POST that cancels a response
// or a batch, as the SDKs' cancel calls send it) is estimated at 0 tokens
// and passes, charged 1 in its requests limit. It used to be 400
// invalid_body, so a gateway in front of an LLM API refused every model
// listing and every cancel.
func TestRequestsWithoutBodyCostNoTokens(t *testing.T) {
	g := startGateway(t, "header >X-Estimated-Cost {http.token_bucket.cost}\n"+
		llmLimiter("user 10 1/1h\n\t\t\t\tuser 1000 1/1h tokens", "cost estimate")+"\nrespond 200")
	for _, tc := range []struct{ method, path string }{
		{http.MethodGet, "v1/models"}, {http.MethodHead, "v1/models"}, {http.MethodOptions, "v1/chat/completions"},
		{http.MethodDelete, "v1/responses/resp_1"}, {http.MethodPost, "v1/responses/resp_1/cancel"},
	} {
		r := g.send(tc.method, tc.path, nil, "X-User", "alice")
		if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != "0" {
			t.Errorf("%s /%s without a body: %d, estimated cost %q, want 200 with 0: %s", tc.method, tc.path, r.status, r.header.Get("X-Estimated-Cost"), r.body)
		}
	}
	k := bucket.NewKeyer("rl:", "")
	if n := storedTokens(t, g.rdb, k.Key("user", "alice", "")); n != 5 {
		t.Errorf("requests bucket holds %d, want 5 (5 requests charged)", n)
	}
	if keys := g.keys(); len(keys) != 1 {
		t.Errorf("Redis holds %q, want the requests bucket alone (0 tokens charge no tokens bucket)", keys)
	}
}

// TestRequestBodyMaxSizeBefore: request_body's max_size in front of the
// handler is answered 413, as Caddy answers it without the handler,
// whether the body declares its length (Caddy refuses it before the
// handler runs) or is chunked (the handler's read meets the limit; it used
// to answer 400 invalid_body). Nothing is charged.
func TestRequestBodyMaxSizeBefore(t *testing.T) {
	g := startGateway(t, "request_body {\n\tmax_size 1KB\n}\n"+
		llmLimiter("user 10 1/1h\n\t\t\t\tuser 100000 1/1h tokens", "cost estimate")+"\nrespond 200")
	body := `{"messages":[{"role":"user","content":"` + strings.Repeat("a", 2000) + `"}]}`
	for _, chunked := range []bool{false, true} {
		var rd io.Reader = strings.NewReader(body)
		if chunked {
			rd = io.MultiReader(rd) // no length: sent chunked
		}
		r := g.send(http.MethodPost, "v1/chat/completions", rd, "X-User", "alice")
		if r.status != http.StatusRequestEntityTooLarge {
			t.Errorf("chunked %v: %d %q, want 413", chunked, r.status, r.body)
		}
	}
	if keys := g.keys(); len(keys) != 0 {
		t.Errorf("Redis holds %q, want nothing charged", keys)
	}
}

// TestUpstreamRateLimitHeadersDropped: an upstream that sends rate-limit
// headers of its own (a provider's, for the gateway's key) behind
// reverse_proxy's header_down -Ratelimit* and -X-Ratelimit-*, as the
// examples have it: the client gets the gateway's values alone, one each.
// Without them the upstream's follow as second values ("9, 4999" to a
// client that reads the field).
func TestUpstreamRateLimitHeadersDropped(t *testing.T) {
	up := startRawUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		for name, v := range map[string]string{"X-Ratelimit-Remaining-Requests": "4999", "X-Ratelimit-Limit-Requests": "5000",
			"Ratelimit": `"default";r=4999;t=1`, "Ratelimit-Policy": `"default";q=5000;w=60`} {
			w.Header().Set(name, v)
		}
		w.WriteHeader(http.StatusOK)
	})
	for _, drop := range []bool{true, false} {
		t.Run(fmt.Sprintf("header_down_%v", drop), func(t *testing.T) {
			downs := ""
			if drop {
				downs = "header_down -Ratelimit*\n\t\theader_down -X-Ratelimit-*"
			}
			g := startGateway(t, llmLimiter("user 10 1/1h", "openai_headers")+
				fmt.Sprintf("\nreverse_proxy %s {\n\t%s\n}", up, downs))
			r := g.get("X-User", "alice")
			if r.status != http.StatusOK {
				t.Fatalf("status %d", r.status)
			}
			want := map[string][]string{"X-Ratelimit-Remaining-Requests": {"9"}, "X-Ratelimit-Limit-Requests": {"10"},
				"Ratelimit": {`"user";r=9;t=3600`}, "Ratelimit-Policy": {`"user";q=10;w=36000`}}
			for name, vals := range want {
				got := r.header.Values(name)
				if !drop {
					vals = append(vals, "") // the upstream's follow: counted, not compared
				}
				if len(got) != len(vals) || got[0] != vals[0] {
					t.Errorf("%s: %q, want the gateway's %q first, %d values", name, got, vals[0], len(vals))
				}
			}
		})
	}
}

// TestFormsStoredObjectsAndNoCompletion: with cost estimate and settle,
// behind an upstream that answers as OpenAI does:
//   - reading a stored response back (GET, no body) charges nothing, though
//     its answer carries the usage of the request that made it: that usage
//     was settled then (it used to be charged again on every read, and a
//     completed batch's usage emptied the key's budget);
//   - an audio transcription (a multipart form) passes at 0 tokens and is
//     settled from the usage its answer reports (it used to be 400
//     invalid_body under any tokens limit);
//   - a moderation and an embedding generate no completion, so their
//     estimate is their input alone, without default_max_tokens (a
//     moderation answer reports no usage, so that estimate stands).
func TestFormsStoredObjectsAndNoCompletion(t *testing.T) {
	up := startRawUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/responses/resp_1":
			_, _ = io.WriteString(w, `{"id":"resp_1","object":"response","status":"completed","usage":{"input_tokens":40,"output_tokens":50,"total_tokens":90}}`)
		case "/v1/audio/transcriptions":
			_, _ = io.WriteString(w, `{"text":"hello","usage":{"type":"tokens","input_tokens":10,"output_tokens":5,"total_tokens":15}}`)
		case "/v1/moderations":
			_, _ = io.WriteString(w, `{"id":"modr-1","model":"omni-moderation-latest","results":[{"flagged":false}]}`)
		case "/v1/embeddings":
			_, _ = io.WriteString(w, `{"object":"list","data":[],"model":"text-embedding-3-small","usage":{"prompt_tokens":8,"total_tokens":8}}`)
		default:
			http.NotFound(w, r)
		}
	})
	g := startGateway(t, "header >X-Estimated-Cost {http.token_bucket.cost}\n"+
		llmLimiter("user 1000 1/1h tokens", "cost estimate\n\t\t\tsettle")+"\nreverse_proxy "+up)
	key := bucket.NewKeyer("rl:", "").Key("user", "alice", "tokens")
	tr := &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	send := func(method, path, contentType, body string) e2eResponse {
		t.Helper()
		var rd io.Reader
		if body != "" {
			rd = strings.NewReader(body)
		}
		req, err := http.NewRequest(method, g.url+path, rd)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-User", "alice")
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		r, err := readResponse(client.Do(req))
		if err != nil {
			t.Fatal(err)
		}
		// The settlement runs after the answer: a request on the same
		// connection is read once the handler is done.
		if _, err := readResponse(client.Get(g.url + "sync")); err != nil {
			t.Fatal(err)
		}
		return r
	}
	form := "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ngpt-4o-transcribe\r\n--XyZ\r\n" +
		"Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--XyZ--\r\n"
	for _, step := range []struct {
		what, method, path, contentType, body, cost string
		tokens                                      int64 // the bucket's whole tokens after
	}{
		{"read back a stored response", http.MethodGet, "v1/responses/resp_1", "", "", "0", 1000},
		{"transcription", http.MethodPost, "v1/audio/transcriptions", "multipart/form-data; boundary=XyZ", form, "0", 985},
		{"moderation", http.MethodPost, "v1/moderations", "application/json", `{"input":"abcd"}`, "1", 984},
		{"embedding", http.MethodPost, "v1/embeddings", "application/json", `{"model":"text-embedding-3-small","input":"abcd"}`, "1", 976},
	} {
		r := send(step.method, step.path, step.contentType, step.body)
		if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != step.cost {
			t.Fatalf("%s: %d, estimated cost %q; want 200 with %s: %s", step.what, r.status, r.header.Get("X-Estimated-Cost"), step.cost, r.body)
		}
		got := int64(1000)
		if v := g.value(key); v != "" {
			got = storedTokens(t, g.rdb, key)
		}
		if got != step.tokens {
			t.Errorf("%s: the tokens bucket holds %d, want %d", step.what, got, step.tokens)
		}
	}
	// A form is free only where the providers take one: a chat request
	// sent as form data (LiteLLM's proxy reads it as the request), or as
	// UTF-16 JSON labelled a form (Starlette's json.loads reads it), is
	// an invalid body.
	utf16 := string([]byte{0, '{', 0, '}'})
	for _, tc := range []struct{ contentType, body string }{
		{"application/x-www-form-urlencoded", "model=gpt-4o&messages=hi&stream=true"},
		{"multipart/form-data; boundary=XyZ", form},
		{"application/x-www-form-urlencoded", utf16},
	} {
		if r := send(http.MethodPost, "v1/chat/completions", tc.contentType, tc.body); r.status != http.StatusBadRequest {
			t.Errorf("a %s body to chat completions: %d %q, want 400", tc.contentType, r.status, r.body)
		}
	}
	// A body-less read-back whose request declares no length (as every
	// HTTP/3 request does; here an empty chunked body) is no body either.
	req, err := http.NewRequest(http.MethodGet, g.url+"v1/responses/resp_1", strings.NewReader(""))
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = -1
	req.TransferEncoding = []string{"chunked"}
	req.Header.Set("X-User", "alice")
	r, err := readResponse(client.Do(req))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := readResponse(client.Get(g.url + "sync")); err != nil {
		t.Fatal(err)
	}
	if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != "0" {
		t.Errorf("a read-back with an empty chunked body: %d, estimated cost %q; want 200 with 0", r.status, r.header.Get("X-Estimated-Cost"))
	}
	if got := storedTokens(t, g.rdb, key); got != 976 {
		t.Errorf("after the chunked read-back the tokens bucket holds %d, want 976 (not settled)", got)
	}
}

// TestCompletesAndUploads: which paths get default_max_tokens, which count
// tokens, and which take a form.
func TestCompletesAndUploads(t *testing.T) {
	for path, want := range map[string]bool{"/v1/chat/completions": true, "/v1/completions": true, "/v1/responses": true,
		"/v1/messages": true, "/v1/embeddings": false, "/v1/embeddings/": false, "/api/embed": false, "/api/embeddings": false,
		"/v1/moderations": false} {
		if got := completes(path); got != want {
			t.Errorf("completes(%q) = %v, want %v", path, got, want)
		}
	}
	for path, want := range map[string]bool{"/v1/messages/count_tokens": true, "/v1/messages/count_tokens/": true,
		"/v1/responses/input_tokens": true, "/v1/messages": false, "/v1/responses": false, "/v1/chat/completions": false,
		"/v1/chat/completions/count_tokens": false, "/v1/messages;/count_tokens": false, "/x/input_tokens/": false,
		"/v1/chat/completions/messages/count_tokens": false, "/v1/chat/completions/v1/responses/input_tokens": false,
		"/anthropic/v1/messages/count_tokens": false,
		// Gemini's and Vertex AI's, the whole path.
		"/v1beta/models/gemini-2.5-flash:countTokens": true, "/v1/models/gemini-2.5-pro:countTokens/": true,
		"/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro:countTokens":   true,
		"/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro:computeTokens": true,
		"/v1beta/models/gemini-2.5-flash:computeTokens":                                              false, "/v1beta/models/gemini-2.5-flash:generateContent": false,
		"/v1beta/models/gemini-2.5-flash:streamGenerateContent": false, "/v2/models/gemini-2.5-flash:countTokens": false,
		"/gemini/v1beta/models/gemini-2.5-flash:countTokens":                                         false,
		"/v1/chat/completions/models/gemini-2.5-flash:countTokens":                                   false,
		"/v1/projects/p/locations/us-central1/publishers/anthropic/models/claude:countTokens":        false,
		"/v1/projects/p/locations/us-central1/endpoints/123:countTokens":                             false,
		"/v1/projects//locations/us-central1/publishers/google/models/gemini-2.5-pro:countTokens":    false,
		"/v1/projects/p/locations/us-central1/publishers/google/x/models/gemini-2.5-pro:countTokens": false,
		"/v1beta/models/gemini-2.5-flash:countTokens:generateContent":                                false} {
		if got := countsTokens(path); got != want {
			t.Errorf("countsTokens(%q) = %v, want %v", path, got, want)
		}
	}
	for path, want := range map[string]bool{"/v1/audio/transcriptions": true, "/v1/audio/translations/": true, "/v1/files": true,
		"/v1/uploads/upload_1/parts": true, "/v1/images/edits": true, "/v1/images/variations": true,
		"/v1/chat/completions": false, "/v1/completions": false, "/v1/responses": false, "/v1/embeddings": false} {
		if got := uploads(path); got != want {
			t.Errorf("uploads(%q) = %v, want %v", path, got, want)
		}
	}
}

// TestFailuresThatMayHaveRunKeepTheEstimate: an answer that says the
// model did not run (a 503 with OpenAI's error object, a 422 with
// Mistral's, a 429 in any shape, here Azure API Management's) gives the
// estimate back, unless settle {
// keep_failed } says to keep it; a failure that may have come after the
// model ran keeps it:
// reverse_proxy's 502 (it cannot tell whether an earlier try of lb_retries
// reached the model) and 504 (an upstream that took the request and did
// not answer in time), and the errors a proxy between the gateway and the
// model answers itself (a 504, Envoy's plain-text 503, an HTML 500).
func TestFailuresThatMayHaveRunKeepTheEstimate(t *testing.T) {
	stop := make(chan struct{})
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		switch r.URL.Path {
		case "/proxy504/v1/chat/completions":
			http.Error(w, "upstream request timeout", http.StatusGatewayTimeout)
		case "/apim429/v1/chat/completions":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusTooManyRequests)
			_, _ = io.WriteString(w, `{"statusCode":429,"message":"Rate limit is exceeded. Try again in 6 seconds."}`)
		case "/503/v1/chat/completions", "/keep/503/v1/chat/completions":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"error":{"message":"The engine is currently overloaded, please try again later","type":"server_error","param":null,"code":null}}`)
		case "/mistral422/v1/chat/completions":
			// Mistral's (and vLLM's) error shape: "object":"error".
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnprocessableEntity)
			_, _ = io.WriteString(w, `{"object":"error","message":{"detail":[{"type":"extra_forbidden","loc":["body","frequency_penalty"],`+
				`"msg":"Extra inputs are not permitted","input":0.0}]},"type":"invalid_request_error","param":null,"code":null}`)
		case "/envoy503/v1/chat/completions":
			http.Error(w, "upstream connect error or disconnect/reset before headers. reset reason: connection termination", http.StatusServiceUnavailable)
		case "/html500/v1/chat/completions":
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, "<html><body><h1>500 Internal Server Error</h1></body></html>")
		default:
			<-stop // took the request; never answers
		}
	}))
	t.Cleanup(silent.Close)
	t.Cleanup(func() { close(stop) })
	dead := fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t)) // nothing listens
	limiter := llmLimiter("user 100000 1/1h tokens", "cost estimate\n\t\t\tsettle")
	g := startGateway(t, `
	handle_errors {
		header X-Estimated-Cost {http.token_bucket.cost}
		respond {err.status_code} {err.status_code}
	}
	header >X-Estimated-Cost {http.token_bucket.cost}
	handle /dead/* {
		`+limiter+`
		reverse_proxy `+dead+`
	}
	handle /keep/* {
		`+llmLimiter("user 100000 1/1h tokens", "cost estimate\n\t\t\tsettle {\n\t\t\t\tkeep_failed\n\t\t\t}")+`
		reverse_proxy `+strings.TrimPrefix(silent.URL, "http://")+`
	}
	handle {
		`+limiter+`
		reverse_proxy `+strings.TrimPrefix(silent.URL, "http://")+` {
			transport http {
				response_header_timeout 300ms
			}
		}
	}`)
	const body = `{"model":"gpt-4o","max_tokens":100,"messages":[{"role":"user","content":"hello"}]}`
	keyer := bucket.NewKeyer("rl:", "")
	// The settlement runs before the handler returns, and before Caddy or
	// handle_errors answers: it is stored when the client has the answer.
	for _, tc := range []struct {
		path   string
		status int
		kept   bool
	}{
		{"dead/v1/chat/completions", http.StatusBadGateway, true},
		{"v1/chat/completions", http.StatusGatewayTimeout, true},
		{"proxy504/v1/chat/completions", http.StatusGatewayTimeout, true},
		{"envoy503/v1/chat/completions", http.StatusServiceUnavailable, true},
		{"html500/v1/chat/completions", http.StatusInternalServerError, true},
		{"503/v1/chat/completions", http.StatusServiceUnavailable, false},
		{"apim429/v1/chat/completions", http.StatusTooManyRequests, false},
		{"mistral422/v1/chat/completions", http.StatusUnprocessableEntity, false},
		{"keep/503/v1/chat/completions", http.StatusServiceUnavailable, true},
	} {
		user := strings.ReplaceAll(tc.path, "/", "-")
		r := g.send(http.MethodPost, tc.path, strings.NewReader(body), "X-User", user, "Content-Type", "application/json")
		est, err := strconv.ParseInt(r.header.Get("X-Estimated-Cost"), 10, 64)
		if r.status != tc.status || err != nil || est <= 100 {
			t.Fatalf("%s: %d, estimated cost %q; want %d with an estimate over the 100-token budget", tc.path, r.status, r.header.Get("X-Estimated-Cost"), tc.status)
		}
		key := keyer.Key("user", user, "tokens")
		switch v := g.value(key); {
		case tc.kept && storedTokens(t, g.rdb, key) != 100000-est:
			t.Errorf("%s: the bucket holds %d tokens, want %d: the estimate %d kept", tc.path, storedTokens(t, g.rdb, key), 100000-est, est)
		case !tc.kept && v != "":
			t.Errorf("%s: the bucket holds %x, want none stored (full): the estimate given back", tc.path, v)
		}
	}
}

// TestOllamaManagementEndToEnd: behind the gateway, Ollama's model
// management runs no model and its answers report no usage: ollama
// create's blob upload (a 3 MiB model file, over the default max_body,
// sent with its length and chunked) reaches the upstream byte for byte
// (which checks it against its digest, as Ollama does) and is answered
// 201, not 400 invalid_body; it and the create, pull, show and delete
// calls pay the requests limit alone: the tokens bucket is never written.
// A generate is still charged its estimate and settled at the usage
// Ollama reports.
func TestOllamaManagementEndToEnd(t *testing.T) {
	ollama := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		sum := sha256.Sum256(body)
		w.Header().Set("X-Body-Sha256", hex.EncodeToString(sum[:]))
		w.Header().Set("X-Body-Length", strconv.Itoa(len(body)))
		ndjson := func(lines ...string) {
			w.Header().Set("Content-Type", "application/x-ndjson")
			for _, l := range lines {
				_, _ = io.WriteString(w, l+"\n")
			}
		}
		switch r.Method + " " + r.URL.Path {
		case "POST /api/blobs/sha256:" + hex.EncodeToString(sum[:]):
			w.WriteHeader(http.StatusCreated)
		case "POST /api/create":
			ndjson(`{"status":"using existing layer sha256:abc"}`, `{"status":"writing manifest"}`, `{"status":"success"}`)
		case "POST /api/pull":
			ndjson(`{"status":"pulling manifest"}`, `{"status":"pulling abc","digest":"sha256:abc","total":2019393189,"completed":2019393189}`, `{"status":"success"}`)
		case "POST /api/show":
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"modelfile":"FROM llama3.2","details":{"format":"gguf","family":"llama","parameter_size":"3.2B"}}`)
		case "DELETE /api/delete":
			w.WriteHeader(http.StatusOK)
		case "POST /api/generate", "POST /api/chat":
			// Without a prompt (or messages) Ollama loads the model and
			// answers so, running nothing.
			w.Header().Set("Content-Type", "application/json; charset=utf-8")
			if !bytes.Contains(body, []byte(`"prompt"`)) && !bytes.Contains(body, []byte(`"content"`)) {
				reason := "load"
				if bytes.Contains(body, []byte(`"keep_alive":0`)) {
					reason = "unload"
				}
				_, _ = io.WriteString(w, `{"model":"llama3.2","created_at":"2026-12-03T05:00:00Z","response":"","done":true,"done_reason":"`+reason+`"}`)
				return
			}
			_, _ = io.WriteString(w, `{"model":"llama3.2","response":"Hi.","done":true,"done_reason":"stop","prompt_eval_count":10,"eval_count":5}`)
		default:
			http.Error(w, `{"error":"digest mismatch"}`, http.StatusBadRequest)
		}
	}))
	t.Cleanup(ollama.Close)
	limiter := llmLimiter("user 100 1/1h\n\t\t\t\tuser 10000 1/1h tokens", "cost estimate\n\t\t\tsettle")
	tr := &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	lg := &llmGateway{e2eGateway: startGateway(t, llmSite(strings.TrimPrefix(ollama.URL, "http://"), limiter)),
		client: &http.Client{Transport: tr, Timeout: time.Minute}}
	send := func(method, path string, body io.Reader, headers ...string) e2eResponse {
		t.Helper()
		req, err := http.NewRequest(method, strings.TrimSuffix(lg.url, "/")+path, body)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-User", "ollama")
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		r, err := readResponse(lg.client.Do(req))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	keyer := bucket.NewKeyer("rl:", "")
	requestsKey, tokensKey := keyer.Key("user", "ollama", ""), keyer.Key("user", "ollama", "tokens")

	blob := ollamaModelFile(3 << 20)
	blobPath := "/api/blobs/sha256:" + sha256Hex(string(blob))
	for _, tc := range []struct {
		name, method, path string
		body               io.Reader
		status             int
		contentType        string
	}{
		{"blob", http.MethodPost, blobPath, bytes.NewReader(blob), http.StatusCreated, ""},
		{"blob_chunked", http.MethodPost, blobPath, io.MultiReader(bytes.NewReader(blob)), http.StatusCreated, "application/octet-stream"},
		{"create", http.MethodPost, "/api/create", strings.NewReader(`{"model":"mario","files":{"model.gguf":"` + blobPath[len("/api/blobs/"):] + `"},` +
			`"system":"You are Mario from Super Mario Bros."}`), http.StatusOK, "application/json"},
		{"pull", http.MethodPost, "/api/pull", strings.NewReader(`{"model":"llama3.2"}`), http.StatusOK, "application/json"},
		{"show", http.MethodPost, "/api/show", strings.NewReader(`{"model":"llama3.2"}`), http.StatusOK, "application/json"},
		{"delete", http.MethodDelete, "/api/delete", strings.NewReader(`{"model":"mario"}`), http.StatusOK, "application/json"},
	} {
		var headers []string
		if tc.contentType != "" {
			headers = []string{"Content-Type", tc.contentType}
		}
		r := send(tc.method, tc.path, tc.body, headers...)
		if r.status != tc.status {
			t.Fatalf("%s: status %d (%s), want %d", tc.name, r.status, r.body, tc.status)
		}
		wantHeaders(t, tc.name, r.header, "X-Estimated-Cost", "0")
		if tc.name == "blob" || tc.name == "blob_chunked" {
			wantHeaders(t, tc.name, r.header, "X-Body-Sha256", sha256Hex(string(blob)), "X-Body-Length", strconv.Itoa(len(blob)))
		}
		lg.sync()
	}
	if n := storedTokens(t, lg.rdb, requestsKey); n != 100-6 {
		t.Errorf("requests bucket: %d, want %d: one each", n, 100-6)
	}
	if v := lg.value(tokensKey); v != "" {
		t.Errorf("tokens bucket written (%x), want none: the management calls cost 0 tokens", v)
	}

	// A generate is estimated (1 + 100) and settled at its 10 + 5.
	r := send(http.MethodPost, "/api/generate", strings.NewReader(`{"model":"llama3.2","prompt":"abcd","options":{"num_predict":100}}`),
		"Content-Type", "application/json")
	if r.status != http.StatusOK {
		t.Fatalf("generate: status %d (%s)", r.status, r.body)
	}
	wantHeaders(t, "generate", r.header, "X-Estimated-Cost", "101")
	lg.sync()
	if n := storedTokens(t, lg.rdb, tokensKey); n != 10000-15 {
		t.Errorf("tokens bucket after the generate: %d, want %d: settled at its usage", n, 10000-15)
	}

	// ollama run loads the model first (a chat without messages), as a
	// generate without a prompt does, and keep_alive 0 unloads it: each
	// is charged default_max_tokens and given it back, since Ollama
	// answers that it loaded or unloaded the model. They kept it for good.
	for _, body := range []string{`{"model":"llama3.2"}`, `{"model":"llama3.2","messages":[]}`, `{"model":"llama3.2","keep_alive":0}`} {
		path := "/api/generate"
		if strings.Contains(body, "messages") {
			path = "/api/chat"
		}
		r := send(http.MethodPost, path, strings.NewReader(body), "Content-Type", "application/json")
		if r.status != http.StatusOK || !strings.Contains(r.body, `load"`) {
			t.Fatalf("%s %s: status %d (%s), want 200 and a load or unload", path, body, r.status, r.body)
		}
		wantHeaders(t, path, r.header, "X-Estimated-Cost", "1024")
		lg.sync()
		if n := storedTokens(t, lg.rdb, tokensKey); n != 10000-15 {
			t.Errorf("%s %s: tokens bucket %d, want %d: a load is given its estimate back", path, body, n, 10000-15)
		}
	}
}
