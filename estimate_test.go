package tokenbucket

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

func int64p(n int64) *int64 { return &n }

// promptOfSize is a legacy completion body of exactly n bytes (n ≥ 28):
// n − 28 characters of prompt and a budget of 1.
func promptOfSize(n int) string {
	return `{"prompt":"` + strings.Repeat("x", n-28) + `","max_tokens":1}`
}

// TestEstimateTable: the handler's side of the estimate: the body is read
// within max_body, estimated by package llm (whose own tables hold every
// request shape), charged the body's budget or default_max_tokens, and
// refused or priced by on_invalid when it cannot be read. Whatever the
// outcome, the body reads back byte for byte afterwards.
func TestEstimateTable(t *testing.T) {
	small := &Estimate{MaxBody: 64}
	fallback := &Estimate{OnInvalid: int64p(7)}
	reject := &Estimate{OnInvalid: int64p(-1)}
	for _, tc := range []struct {
		name string
		e    *Estimate // nil: defaults
		body string    // "<nil>": no body at all
		want int64     // -1: invalid body
	}{
		{"missing_max_tokens_default", nil, `{"messages":[{"role":"user","content":"Hi!"}]}`, 1 + 1024},
		{"configured_default", &Estimate{DefaultMaxTokens: 256}, `{"messages":[{"role":"user","content":"Hi!"}]}`, 1 + 256},
		{"null_max_tokens_default", nil, `{"messages":[{"role":"user","content":"Hi!"}],"max_tokens":null}`, 1 + 1024},
		{"model_alone_default", nil, `{"model":"gpt-4o-mini"}`, 1024},
		{"empty_object_default", nil, `{}`, 1024},
		// UTF-8 bytes, not runes: 30 + 15 bytes are ⌈30/4⌉ + ⌈15/4⌉ = 12.
		{"utf8_bytes_not_runes", nil,
			`{"messages":[{"role":"user","content":"日本語のテキストです"},{"role":"user","content":"👋🌍🚀✨"}],"max_tokens":0}`, 12},
		{"four_bytes_one_token", nil, `{"prompt":"abcd","max_tokens":0}`, 1},
		{"whitespace_around", nil, " \r\n\t{\"prompt\":\"abcd\",\"max_tokens\":3}\n", 4},
		{"budget_at_max_cost", nil, `{"max_tokens":9007199254740991}`, MaxCost},
		// Legacy completions: n completions for each of 3 prompts.
		{"prompts_times_n", nil, `{"prompt":["abcd","abcd","abcd"],"max_tokens":100,"n":2}`, 3 + 3*2*100},
		{"prompts_default_budget", nil, `{"prompt":[[1,2],[3]]}`, 3 + 2*1024},
		{"name_in_another_case", nil, `{"max_tokens":5000,"MAX_TOKENS":1,"prompt":"abcd"}`, -1},
		{"not_json", nil, `hello`, -1},
		{"empty_body", nil, ``, 0}, // no body: 0 tokens (see noContent)
		{"no_body", nil, "<nil>", 0},
		{"truncated_json", nil, `{"messages":[`, -1},
		{"trailing_garbage", nil, `{"max_tokens":1} x`, -1},
		{"json_array", nil, `[{"messages":[]}]`, -1},
		{"json_string", nil, `"hello"`, -1},
		{"json_null", nil, `null`, -1},
		{"json_number", nil, `42`, -1},
		// LM Studio's and llama.cpp's "no limit": the default budget.
		{"negative_budget_default", nil, `{"messages":[{"role":"user","content":"Hi!"}],"max_tokens":-1}`, 1 + 1024},
		// llama.cpp reads max_completion_tokens first: no limit, not 5.
		{"negative_budget_beside_a_number", nil, `{"messages":[{"role":"user","content":"Hi!"}],"max_tokens":5,"max_completion_tokens":-1}`, 1 + 1024},
		{"negative_fractional_budget", nil, `{"max_tokens":-1.5}`, -1},
		{"fractional_budget", nil, `{"max_tokens":1.5}`, -1},
		{"budget_above_max_cost", nil, `{"max_tokens":9007199254740992}`, -1},
		{"messages_not_an_array", nil, `{"messages":"hi"}`, -1},

		// max_body 64: 64 bytes pass (36 characters: 9, + 1), 65 do not.
		{"at_max_body", small, promptOfSize(64), 9 + 1},
		{"over_max_body", small, promptOfSize(65), -1},

		// on_invalid <n>: the fallback cost instead of a 400.
		{"on_invalid_not_json", fallback, `hello`, 7},
		{"on_invalid_no_body", fallback, "<nil>", 0},
		{"on_invalid_valid_body_estimated", fallback, `{"prompt":"abcd","max_tokens":3}`, 4},
		{"on_invalid_reject", reject, `hello`, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := tc.e
			if e == nil {
				e = &Estimate{}
			}
			if err := e.provision(); err != nil {
				t.Fatal(err)
			}
			var req *http.Request
			if tc.body == "<nil>" {
				req = httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
			} else {
				req = httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(tc.body))
			}
			est, err := e.estimate(httptest.NewRecorder(), req, false)
			got := est.prompt + est.completion
			switch {
			case tc.want < 0 && !errors.Is(err, errInvalidBody):
				t.Errorf("estimate = %d, %v; want errInvalidBody", got, err)
			case tc.want >= 0 && (err != nil || got != tc.want):
				t.Errorf("estimate = %d, %v; want %d", got, err, tc.want)
			}
			if tc.body == "<nil>" {
				return
			}
			rest, err := io.ReadAll(req.Body)
			if err != nil || string(rest) != tc.body {
				t.Errorf("body after the estimate: %q, %v; want the original %q", rest, err, tc.body)
			}
		})
	}
}

// TestEstimateOversizedBodyReadsBackWhole: a body far above max_body is
// refused after reading max_body+1 bytes, and the upstream still gets all of
// it, in order, including the unread rest.
func TestEstimateOversizedBodyReadsBackWhole(t *testing.T) {
	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	req := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
	e := provisioned(t, &Estimate{MaxBody: 1000})
	if _, err := e.estimate(httptest.NewRecorder(), req, false); !errors.Is(err, errInvalidBody) {
		t.Fatalf("err %v, want errInvalidBody", err)
	}
	got, err := io.ReadAll(req.Body)
	if err != nil || !bytes.Equal(got, body) {
		t.Fatalf("read back %d bytes (%v), want the %d of the original", len(got), err, len(body))
	}
	if err := req.Body.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
}

// ---------------------------------------------------------------------------
// End to end: Caddy + Redis + the fake upstream.

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// TestEstimateBodyReachesUpstreamIntact: the estimator reads the body
// before reverse_proxy sends it; the upstream gets it byte for byte (its
// SHA-256 and length echoed back), whatever its form: odd whitespace,
// escapes and non-ASCII text; a body over max_body (charged on_invalid);
// a non-JSON one. The bucket is charged exactly the estimate.
func TestEstimateBodyReachesUpstreamIntact(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 1000000 1/1h tokens", "cost estimate {\n\t\t\t\tmax_body 64KiB\n\t\t\t\ton_invalid 7\n\t\t\t}"))
	long := strings.Repeat("Lorem ipsum dolor sit amet, ½ ünïcødé 🚀. ", 1000) // 41000 runes, 49000 bytes
	for _, tc := range []struct {
		name, body string
		cost       int64
	}{
		// "héllo" and "wörld\n\t!": 6 and 9 UTF-8 bytes (escapes count as
		// the bytes they stand for): 2 + 3, + 16.
		{"odd_json", "{ \"messages\" : [ {\"content\":\"héllo\"} ,\r\n\t{\"role\":\"user\",\"content\":\"w\\u00f6rld\\n\\t!\"} ],\n" +
			"  \"max_tokens\" :16 , \"zzz\":[1,2.50,true,null,{}]  }", 2 + 3 + 16},
		{"long_prompt", `{"model":"gpt-test","messages":[{"role":"user","content":"` + long + `"}],"max_tokens":100}`, 49000/4 + 100},
		{"over_max_body", `{"model":"gpt-test","prompt":"` + strings.Repeat(long, 2) + `"}`, 7},
		{"not_json", strings.Repeat("not json at all \x00\xff ", 5000), 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "intact-" + tc.name
			r := lg.post("/v1/chat/completions", tc.body, "X-User", user)
			if r.status != http.StatusOK {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			wantHeaders(t, tc.name, r.header,
				"X-Body-Sha256", sha256Hex(tc.body),
				"X-Body-Length", strconv.Itoa(len(tc.body)),
				"X-Estimated-Cost", strconv.FormatInt(tc.cost, 10),
				"X-RateLimit-Remaining", strconv.FormatInt(1000000-tc.cost, 10))
			st, err := bucket.DecodeState(lg.value(bucket.NewKeyer("rl:", "").Key("user", user, "tokens")))
			if err != nil || wholeTokens(st) != 1000000-tc.cost {
				t.Errorf("bucket %+v (%v), want %d whole tokens", st, err, 1000000-tc.cost)
			}
		})
	}
}

// TestEstimateComputerUseScreenshot: a computer-use turn gives back a
// screenshot of some 300 KB (computer_call_output); it is one image part
// (85 tokens), so a limit of 50,000 tokens admits the turn and settles it
// at what it used. Read as text, its base64 made some 77,000 tokens,
// refused as cost_exceeds_capacity.
func TestEstimateComputerUseScreenshot(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 50000 1/1h tokens", "cost estimate\n\t\t\tsettle"))
	const tools = `[{"type":"computer_use_preview","display_width":1024,"display_height":768,"environment":"browser"}]`
	body := `{"model":"computer-use-preview","truncation":"auto","max_output_tokens":1000,"tools":` + tools + `,` +
		`"input":[{"call_id":"call_1","type":"computer_call_output","output":{"type":"computer_screenshot",` +
		`"image_url":"data:image/png;base64,` + strings.Repeat("iVBORw0KGgoAAAANSUhEUgAA", 300<<10/24) + `"}}]}`
	r := lg.post("/v1/responses", body, "X-User", "cu", "X-Test-Usage", "900,100")
	want := int64((len(tools)+3)/4 + 85 + 1000)
	if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != strconv.FormatInt(want, 10) {
		t.Fatalf("status %d, estimated %s, body %s; want 200, %d", r.status, r.header.Get("X-Estimated-Cost"), r.body, want)
	}
	lg.sync()
	key := bucket.NewKeyer("rl:", "").Key("user", "cu", "tokens")
	if got := storedTokens(t, lg.rdb, key); got != 50000-1000 {
		t.Errorf("after settling 900 + 100 used, the bucket holds %d tokens, want %d", got, 50000-1000)
	}
}

// TestEstimateInvalidBodyIs400: with on_invalid reject (the default), a
// body the estimator cannot read is answered 400 invalid_body before Redis
// or the upstream sees anything: not JSON, JSON that is not an object, a
// body over max_body, a negative budget. (No body at all is 0 tokens: see
// TestRequestsWithoutBodyCostNoTokens.)
func TestEstimateInvalidBodyIs400(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", "cost estimate {\n\t\t\t\tmax_body 1KiB\n\t\t\t}"))
	const want = `{"error":"invalid_body","message":"the request body must be a JSON chat or completion request within the size limit"}` + "\n"
	for _, body := range []string{
		"not json",
		"null",
		"[]",
		`{"max_tokens":-5.5}`,
		promptOfSize(1025),
	} {
		r := lg.post("/v1/chat/completions", body, "X-User", "alice")
		if r.status != http.StatusBadRequest || r.body != want {
			t.Errorf("body %.40q: %d %q, want 400 %q", body, r.status, r.body, want)
		}
		wantNoRateLimitHeaders(t, "invalid body", r.header)
	}
	if keys := lg.keys(); len(keys) != 0 {
		t.Errorf("invalid bodies wrote %q", keys)
	}
	if n := len(lg.up.requests()); n != 0 {
		t.Errorf("the upstream saw %d requests", n)
	}
	// 1024 bytes, 996 characters: 249 tokens, + 1.
	r := lg.post("/v1/chat/completions", promptOfSize(1024), "X-User", "alice")
	if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != "250" || r.header.Get("X-Body-Length") != "1024" {
		t.Errorf("a body of exactly max_body: %d, cost %q, length %q; want 200, 250, 1024",
			r.status, r.header.Get("X-Estimated-Cost"), r.header.Get("X-Body-Length"))
	}
}

// chatBody2K is a typical chat request of about 2 KB: a system prompt, a
// few turns, a budget.
var chatBody2K = func() []byte {
	sentence := "The quick brown fox jumps over the lazy dog while the gateway counts tokens. "
	var b strings.Builder
	b.WriteString(`{"model":"gpt-4o-mini","temperature":0.2,"max_tokens":512,"messages":[`)
	b.WriteString(`{"role":"system","content":"` + strings.Repeat(sentence, 6) + `"},`)
	b.WriteString(`{"role":"user","content":"` + strings.Repeat(sentence, 8) + `"},`)
	b.WriteString(`{"role":"assistant","content":"` + strings.Repeat(sentence, 4) + `"},`)
	b.WriteString(`{"role":"user","content":[{"type":"text","text":"` + strings.Repeat(sentence, 6) + `"}]}]}`)
	return []byte(b.String())
}()

// benchURL is the URL of BenchmarkEstimate's requests: the estimate reads
// the path (see storesObjects).
var benchURL = &url.URL{Path: "/v1/chat/completions"}

// BenchmarkEstimate: the estimate of a 2 KB chat body, with the body read
// from and given back to the request (package llm benchmarks the parse
// alone, per tokenizer and on adversarial shapes).
func BenchmarkEstimate(b *testing.B) {
	if n := len(chatBody2K); n < 1900 || n > 2200 {
		b.Fatalf("body is %d bytes, want about 2 KB", n)
	}
	e := provisioned(b, &Estimate{})
	b.ReportAllocs()
	b.SetBytes(int64(len(chatBody2K)))
	for b.Loop() {
		req := &http.Request{URL: benchURL, Body: io.NopCloser(bytes.NewReader(chatBody2K)), ContentLength: int64(len(chatBody2K))}
		if _, err := e.estimate(httptest.NewRecorder(), req, false); err != nil {
			b.Fatal(err)
		}
	}
}

// goneBody sends part of a body, then fails with err, as net/http's body
// does when its HTTP/1.x connection is reset (a *net.OpError) or ends
// before Content-Length's end (io.ErrUnexpectedEOF).
type goneBody struct {
	part []byte
	err  error
}

func (b *goneBody) Read(p []byte) (int, error) {
	if len(b.part) > 0 {
		n := copy(p, b.part)
		b.part = b.part[n:]
		return n, nil
	}
	return 0, b.err
}

// TestClientGoneMidBody: a client that goes away while it sends the body
// the estimate reads (its connection reset, its HTTP/2 stream reset, which
// ends the request's context) is a client gone, as one that leaves while
// Redis decides: 499 logged, nothing decided, nothing charged, not counted
// as invalid_body. A body shorter than its Content-Length is invalid: its
// client may have half-closed the connection and still read the 400 (see
// TestHalfClosedShortBodyIs400).
func TestClientGoneMidBody(t *testing.T) {
	srv := redistest.Start(t)
	tier := uniqueTier("midbody")
	h := provisionHandler(t, &Handler{
		Redis:      &RedisConfig{Address: []string{srv.Addr}},
		Dimensions: []Dimension{{Name: "user", Identity: "{http.request.header.X-User}"}},
		Tiers:      []Tier{{Name: tier, Limits: []Limit{{Dimension: "user", Capacity: 10000, RefillRate: 1, Unit: UnitTokens}}}},
		Estimate:   &Estimate{},
	})
	const body = `{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}]}`
	reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name    string
		proto   int
		ctx     context.Context
		err     error
		status  int
		outcome string
	}{
		// net/http ends an HTTP/1.x request's context on any read error,
		// the end of a half-closed connection included.
		{"body shorter than Content-Length", 1, canceled, io.ErrUnexpectedEOF, http.StatusBadRequest, "invalid_body"},
		{"connection reset", 1, canceled, reset, statusClientClosedRequest, ""},
		{"stream reset", 2, canceled, errors.New("http2: stream closed"), statusClientClosedRequest, ""},
		{"body that fails otherwise", 1, context.Background(), errors.New("malformed chunked encoding"), http.StatusBadRequest, "invalid_body"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			counters := map[string]prometheus.Counter{}
			before := map[string]float64{}
			for _, o := range outcomeNames {
				counters[o] = tbMetrics.decisions.WithLabelValues(tier, o)
				before[o] = testutil.ToFloat64(counters[o])
			}
			req := httptest.NewRequestWithContext(tc.ctx, http.MethodPost, "http://gateway.test/v1/chat/completions",
				&goneBody{part: []byte(body[:20]), err: tc.err})
			req.ContentLength, req.ProtoMajor = int64(len(body)), tc.proto
			req.Header.Set("X-User", "leaver")
			rec := httptest.NewRecorder()
			req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
			passed := false
			err := h.ServeHTTP(rec, req, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
				passed = true
				return nil
			}))
			status := rec.Code
			var he caddyhttp.HandlerError
			if errors.As(err, &he) {
				status = he.StatusCode
			}
			if status != tc.status || passed {
				t.Errorf("status %d (%v), passed on %v; want %d, not passed on", status, err, passed, tc.status)
			}
			for o, c := range counters {
				want := 0.0
				if o == tc.outcome {
					want = 1
				}
				if got := testutil.ToFloat64(c) - before[o]; got != want {
					t.Errorf("decisions_total{outcome=%q} grew by %v, want %v", o, got, want)
				}
			}
			if keys := srv.Client(t).Keys(context.Background(), "*").Val(); len(keys) != 0 {
				t.Errorf("keys written: %q", keys)
			}
		})
	}
}

// TestHalfClosedShortBodyIs400: through Caddy, an HTTP/1.1 client sends
// 40 bytes of a body whose Content-Length says 260, half-closes its
// connection and reads: it gets 400 invalid_body, counted as such, and
// nothing reaches the upstream or Redis. (net/http ends the request's
// context at the half-close, as it does when a client goes away.)
func TestHalfClosedShortBodyIs400(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", "cost estimate"))
	invalid := decisions("free", "invalid_body")
	before := scrape(t)[invalid]
	body := `{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}]}`[:40]
	status, b := rawExchange(t, lg.port, "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway.test\r\nX-User: halfway\r\n"+
		"Content-Type: application/json\r\nContent-Length: 260\r\n\r\n"+body, true)
	if status != http.StatusBadRequest || !strings.Contains(b, `"invalid_body"`) {
		t.Errorf("answer %d %q, want 400 invalid_body", status, b)
	}
	if got := scrape(t)[invalid] - before; got != 1 {
		t.Errorf("decisions_total{outcome=\"invalid_body\"} grew by %v, want 1", got)
	}
	if keys := lg.keys(); len(keys) != 0 || len(lg.up.requests()) != 0 {
		t.Errorf("keys %q, %d upstream requests; want none", keys, len(lg.up.requests()))
	}
}

// TestOversizedFormThatNeverComesTimesOut: a form to an upload path whose
// Content-Length is over max_body is read for its first 512 bytes (is it
// a form?) within read_timeout, as any body the estimate reads: a client
// that sends its headers and then nothing is answered 408 once the
// timeout passes, not held until it leaves.
func TestOversizedFormThatNeverComesTimesOut(t *testing.T) {
	lg := startLLMGateway(t, llmLimiter("user 10000 1/1h tokens", `cost estimate {
				max_body 1024
				read_timeout 1s
			}`))
	status, b := rawExchange(t, lg.port, "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: gateway.test\r\nX-User: stalled\r\n"+
		"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 4096\r\n\r\n", false)
	if status != http.StatusRequestTimeout || !strings.Contains(b, `"request_timeout"`) {
		t.Errorf("answer %d %q, want 408 request_timeout", status, b)
	}
	if len(lg.up.requests()) != 0 {
		t.Errorf("%d upstream requests, want none", len(lg.up.requests()))
	}
}

// TestEstimateStoredObjects: a JSON POST that creates or changes a stored
// object of OpenAI's API, or an object of the agent and account APIs,
// runs no model and its answer reports no usage: it costs 0 tokens and is
// not settled (see storesObjects, configures), whatever its body
// (a model, instructions, messages). A request that runs a model is
// estimated as always, whatever its path: a run, a chat completion, a
// batch, another API's path.
func TestEstimateStoredObjects(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const text = `"Write a 3,000-word essay on rate limiting."` // 11 tokens
	for _, tc := range []struct {
		name, path, body string
		want             int64 // -1: stored, 0 tokens and not settled
	}{
		{"upload", "/v1/uploads", `{"purpose":"assistants","filename":"notes.txt","bytes":2048,"mime_type":"text/plain"}`, -1},
		{"upload_complete", "/v1/uploads/upload_abc/complete", `{"part_ids":["part_abc"]}`, -1},
		{"vector_store", "/v1/vector_stores", `{"name":"docs","file_ids":["file-abc"]}`, -1},
		{"vector_store_search", "/v1/vector_stores/vs_abc/search", `{"query":` + text + `}`, -1},
		{"fine_tuning_job", "/v1/fine_tuning/jobs", `{"model":"gpt-4o-mini-2024-07-18","training_file":"file-abc"}`, -1},
		{"assistant", "/v1/assistants", `{"model":"gpt-4o","instructions":` + text + `}`, -1},
		{"assistant_update", "/v1/assistants/asst_abc/", `{"model":"gpt-4o-mini"}`, -1},
		{"thread", "/v1/threads", `{"messages":[{"role":"user","content":` + text + `}]}`, -1},
		{"thread_message", "/v1/threads/thread_abc/messages", `{"role":"user","content":` + text + `}`, -1},
		{"conversation_items", "/v1/conversations/conv_abc/items", `{"items":[{"type":"message","role":"user","content":` + text + `}]}`, -1},
		{"conversation", "/v1/conversations", `{"items":[{"type":"message","role":"user","content":` + text + `}],"metadata":{"topic":"demo"}}`, -1},
		{"conversation_update", "/v1/conversations/conv_abc", `{"metadata":{"topic":"demo"}}`, -1},
		// Mistral's conversations run the model on their inputs: a start
		// (with a model or an agent), an append, a restart.
		{"mistral_conversation_start", "/v1/conversations", `{"model":"mistral-medium-latest","inputs":` + text + `}`, 11 + 1024},
		{"mistral_conversation_agent", "/v1/conversations", `{"agent_id":"ag_abc","inputs":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"mistral_conversation_append", "/v1/conversations/conv_abc", `{"inputs":` + text + `,"stream":false}`, 11 + 1024},
		{"mistral_conversation_restart", "/v1/conversations/conv_abc/restart", `{"inputs":` + text + `,"from_entry_id":"msg_abc"}`, 11 + 1024},
		// An append whose inputs hold no text the estimate counts (an empty
		// function result, an empty message) runs the model all the same,
		// on the whole stored conversation: estimated and settled, not free.
		{"mistral_conversation_append_empty_result", "/v1/conversations/conv_abc",
			`{"inputs":[{"type":"function.result","tool_call_id":"call_1","result":""}],"stream":false}`, 1024},
		{"mistral_conversation_append_empty", "/v1/conversations/conv_abc", `{"inputs":""}`, 1024},
		{"chat_completion_metadata", "/v1/chat/completions/chatcmpl-abc", `{"metadata":{"topic":"billing"}}`, -1},
		{"run", "/v1/threads/thread_abc/runs", `{"assistant_id":"asst_abc","additional_instructions":` + text + `}`, 1024},
		{"thread_and_run", "/v1/threads/runs", `{"assistant_id":"asst_abc","thread":{"messages":[{"role":"user","content":` + text + `}]}}`, 1024},
		{"chat_completion", "/v1/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		// Dot segments and doubled slashes are read as an upstream that
		// normalizes the path reads them (nginx, Envoy, Cloudflare), and as
		// Caddy's path matchers do: a chat completion, not a stored object.
		{"chat_completion_dot", "/v1/chat/completions/.", `{"model":"gpt-4o","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"chat_completion_via_uploads", "/v1/uploads/../chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"chat_completion_via_threads", "/v1/threads//../chat/completions/", `{"model":"gpt-4o","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		// But a path is free only when it reads so as it came too: to an
		// upstream that routes by prefix, or that keeps an escaped slash
		// (Envoy, Cloudflare), these are chat completions.
		{"chat_completion_dotted_to_count_tokens", "/v1/chat/completions/../../messages/count_tokens", `{"model":"gpt-4o","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"chat_completion_escaped_to_count_tokens", "/v1/chat/completions%2F..%2F..%2Fmessages%2Fcount_tokens", `{"model":"gpt-4o","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		// A token count or a stored object is free only at a clean path:
		// the segment rule reads /v1/chat/completions/../../threads as a
		// thread both ways, a router by prefix as a chat completion.
		{"chat_completion_dotted_to_threads", "/v1/chat/completions/../../threads", `{"model":"gpt-4o","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"upload_dot", "/v1/uploads/./", `{"purpose":"assistants","filename":"notes.txt","bytes":2048,"mime_type":"text/plain"}`, 1024},
		{"upload_trailing_slash", "/v1/uploads/", `{"purpose":"assistants","filename":"notes.txt","bytes":2048,"mime_type":"text/plain"}`, -1},
		// A skill's update, a ChatKit session, a Realtime client secret and
		// a call's hangup, refer or reject run no model here; a call's
		// accept starts the model on the call and is estimated.
		{"skill_update", "/v1/skills/skill_abc", `{"default_version":"2"}`, -1},
		{"chatkit_session", "/v1/chatkit/sessions", `{"user":"u1","workflow":{"id":"wf_abc"}}`, -1},
		{"realtime_client_secret", "/v1/realtime/client_secrets", `{"session":{"type":"realtime","model":"gpt-realtime","instructions":` + text + `}}`, -1},
		{"realtime_translation_client_secret", "/v1/realtime/translations/client_secrets", `{"session":{"model":"gpt-realtime"}}`, -1},
		{"realtime_call_hangup", "/v1/realtime/calls/rtc_abc/hangup", `{}`, -1},
		{"realtime_call_refer", "/v1/realtime/calls/rtc_abc/refer", `{"target_uri":"tel:+14155550123"}`, -1},
		{"realtime_call_reject", "/v1/realtime/calls/rtc_abc/reject", `{"status_code":486}`, -1},
		{"realtime_call_accept", "/v1/realtime/calls/rtc_abc/accept", `{"type":"realtime","model":"gpt-realtime","instructions":` + text + `}`, 11 + 1024},
		// A beta Realtime session or transcription session is an ephemeral
		// key too; a voice consent's update is metadata; a Live session's
		// refer and reject answer a SIP call without the model, its accept
		// and fork start it.
		{"realtime_beta_session", "/v1/realtime/sessions", `{"model":"gpt-4o-realtime-preview","instructions":` + text + `}`, -1},
		{"realtime_beta_transcription_session", "/v1/realtime/transcription_sessions", `{"input_audio_format":"pcm16"}`, -1},
		{"voice_consent_update", "/v1/audio/voice_consents/cons_abc", `{"name":"Ana"}`, -1},
		{"live_session_refer", "/v1/live/sessions/ls_abc/refer", `{"target_uri":"tel:+14155550123"}`, -1},
		{"live_session_reject", "/v1/live/sessions/ls_abc/reject", `{"status_code":486}`, -1},
		{"live_session_accept", "/v1/live/sessions/ls_abc/accept", `{"type":"live","model":"gpt-live","instructions":` + text + `}`, 11 + 1024},
		{"live_session_fork", "/v1/live/sessions/ls_abc/fork", `{"sdp":"v=0"}`, 1024},
		{"live_session", "/v1/live/sessions", `{"model":"gpt-live","instructions":` + text + `}`, 11 + 1024},
		// The agent and account APIs' objects, right after /v1: an agent's
		// definition, an automation's schedule, an environment, a vault, a
		// session's settings and resources, a memory store, a tunnel, a
		// user profile, a compliance case's answer, webhooks, organization
		// and project administration (OpenAI's and Anthropic's SDKs).
		{"openai_agent", "/v1/agents", `{"name":"support","model":"gpt-5","instructions":` + text + `}`, -1},
		{"openai_agent_update", "/v1/agents/agent_abc", `{"instructions":` + text + `}`, -1},
		{"openai_automation", "/v1/agents/automations", `{"name":"daily","expression":"0 9 * * *","agent_id":"agent_abc","input":` + text + `}`, -1},
		{"openai_automation_update", "/v1/agents/automations/auto_abc", `{"name":"weekly"}`, -1},
		{"openai_environment", "/v1/agents/environments", `{"type":"hosted"}`, -1},
		{"openai_environment_template", "/v1/agents/environments/templates/tmpl_abc", `{"name":"base"}`, -1},
		{"openai_environment_file", "/v1/agents/environments/env_abc/files", `{"path":"/a.txt","file_id":"file-abc"}`, -1},
		{"openai_session_update", "/v1/agents/sessions/sess_abc", `{"metadata":{"k":"v"}}`, -1},
		{"openai_vault_credential", "/v1/vaults/vault_abc/credentials", `{"name":"gh","secret":"x"}`, -1},
		{"openai_webhook_endpoint", "/v1/webhook_endpoints", `{"url":"https://example.com/hook","event_types":["batch.completed"]}`, -1},
		{"openai_admin_project", "/v1/organization/projects", `{"name":"p"}`, -1},
		{"openai_admin_project_role", "/v1/projects/proj_abc/roles/role_abc", `{"role_name":"r"}`, -1},
		{"openai_admin_project_user_role", "/v1/projects/proj_abc/users/user_abc/roles", `{"role_id":"role_abc"}`, -1},
		{"anthropic_agent", "/v1/agents", `{"name":"support","model":"claude-sonnet-4-5","system":` + text + `}`, -1},
		{"anthropic_environment_work", "/v1/environments/env_abc/work/work_abc/stop", `{"force":true}`, -1},
		{"anthropic_memory", "/v1/memory_stores/ms_abc/memories", `{"path":"/notes.md","content":` + text + `}`, -1},
		{"anthropic_session_update", "/v1/sessions/sesn_abc", `{"title":"t"}`, -1},
		{"anthropic_session_resource", "/v1/sessions/sesn_abc/resources", `{"type":"file","file_id":"file_abc"}`, -1},
		{"anthropic_tunnel", "/v1/tunnels", `{"name":"t"}`, -1},
		{"anthropic_user_profile", "/v1/user_profiles/uprof_abc/action_urls", `{}`, -1},
		{"anthropic_compliance_case", "/v1/compliance/review/cases/case_abc/respond", `{"conclusion":"ok"}`, -1},
		{"anthropic_admin_workspace", "/v1/organizations/workspaces", `{"name":"w"}`, -1},
		{"anthropic_admin_via_litellm", "/anthropic/v1/organizations/invites", `{"email":"a@example.com","role":"user"}`, -1},
		// Sessions that start the model (a user message, at creation or as
		// an event), a dream and Anthropic's deployments (a deployments
		// segment names an Azure model) are estimated; a session's prompt
		// is its input, events or initial_events.
		{"openai_session", "/v1/agents/sessions", `{"agent_id":"agent_abc","environment":{"type":"none"},"input":` + text + `}`, 11 + 1024},
		{"openai_session_events", "/v1/agents/sessions/sess_abc/events", `{"events":[{"type":"agent.session.input.message","input":[{"role":"user","content":` + text + `}]}]}`, 11 + 1024},
		{"anthropic_session", "/v1/sessions", `{"agent":"agent_abc","environment_id":"env_abc","initial_events":[{"type":"user.message","content":[{"type":"text","text":` + text + `}]}]}`, 11 + 1024},
		{"anthropic_session_events", "/v1/sessions/sesn_abc/events", `{"events":[{"type":"user.message","content":[{"type":"text","text":` + text + `}]}]}`, 11 + 1024},
		{"anthropic_dream", "/v1/dreams", `{"memory_store_id":"ms_abc"}`, 1024},
		{"anthropic_deployment", "/v1/deployments", `{"agent":{"id":"agent_abc","type":"agent"}}`, 1024},
		{"azure_deployment", "/openai/deployments/gpt-4o/chat/completions", `{"messages":[{"role":"user","content":""}]}`, 1024},
		{"batch", "/v1/batches", `{"input_file_id":"file-abc","endpoint":"/v1/chat/completions","completion_window":"24h"}`, 1024},
		// A Gemini call (Vertex AI's path) is estimated from its contents.
		{"vertex_gemini", "/v1/projects/p/locations/l/publishers/google/models/gemini-2.5-flash:generateContent",
			`{"contents":[{"role":"user","parts":[{"text":` + text + `}]}]}`, 11 + 1024},
		// Budgets kept in an object of settings: Gemini's, TGI's, Ollama's.
		{"gemini_budget", "/gemini/v1beta/models/gemini-2.5-flash:generateContent",
			`{"contents":[{"parts":[{"text":` + text + `}]}],"generationConfig":{"maxOutputTokens":8192}}`, 11 + 8192},
		{"tgi_generate", "/generate", `{"inputs":` + text + `,"parameters":{"max_new_tokens":4000}}`, 11 + 4000},
		{"ollama_generate", "/api/generate", `{"model":"llama3.2","prompt":` + text + `,"options":{"num_predict":4000}}`, 11 + 4000},
		// Ollama's model management runs no model, and its answers (pull,
		// push and create stream NDJSON status lines) report no usage: its
		// calls are free at a clean path, under a prefix too (Open WebUI's
		// /ollama/api/...). A create's system prompt is stored, not run.
		{"ollama_show", "/api/show", `{"model":"llama3.2","verbose":true}`, -1},
		{"ollama_pull", "/api/pull", `{"model":"llama3.2","insecure":false,"stream":true}`, -1},
		{"ollama_push", "/api/push", `{"model":"mattw/pygmalion:latest"}`, -1},
		{"ollama_create", "/api/create", `{"model":"mario","from":"llama3.2","system":` + text + `}`, -1},
		{"ollama_copy", "/api/copy", `{"source":"llama3.2","destination":"llama3.2-backup"}`, -1},
		{"ollama_delete", "/api/delete", `{"model":"llama3.2:latest"}`, -1},
		{"ollama_show_prefixed", "/ollama/api/show", `{"model":"llama3.2"}`, -1},
		{"ollama_pull_trailing_slash", "/api/pull/", `{"model":"llama3.2"}`, -1},
		// Its model calls are estimated as ever; a generate without a
		// prompt (which loads the model) keeps its default budget.
		{"ollama_chat", "/api/chat", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_generate_default", "/api/generate", `{"model":"llama3.2","prompt":` + text + `}`, 11 + 1024},
		{"ollama_generate_load", "/api/generate", `{"model":"llama3.2"}`, 1024},
		{"ollama_embed", "/api/embed", `{"model":"all-minilm","input":` + text + `}`, 11},
		{"ollama_embeddings", "/api/embeddings", `{"model":"all-minilm","prompt":` + text + `}`, 11},
		// A chat is never free by a crafted path: with dot segments, an
		// escaped slash or doubled slashes (either reading may be the
		// upstream's), under another call (a router by prefix sends
		// /api/chat/api/show to chat), in another case or with path
		// parameters, under a model's segment, or with more after.
		{"ollama_chat_dotted_to_show", "/api/chat/../show", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_dotted_to_chat", "/api/show/../chat", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_chat_escaped_to_show", "/api/chat%2F..%2Fshow", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_doubled_slash", "/api//show", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_under_chat", "/api/chat/api/show", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_in_another_case", "/api/Show", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_with_params", "/api/show;v=1", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_under_deployment", "/openai/deployments/llama/api/show", `{"messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		// A prefix of one segment only: a longer one may be a model
		// call's path, which a router by prefix sends to that call.
		{"ollama_show_under_openai_chat", "/v1/chat/completions/api/show", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_under_two_segments", "/a/b/api/show", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_under_run", "/run/api/show", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_show_then_chat", "/api/show/chat", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
			est, err := e.estimate(httptest.NewRecorder(), req, false)
			got := est.prompt + est.completion
			switch {
			case err != nil:
				t.Fatal(err)
			case tc.want < 0 && (got != 0 || !est.noInference):
				t.Errorf("estimate %d, not settled %v; want 0 and not settled", got, est.noInference)
			case tc.want >= 0 && (got != tc.want || est.noInference):
				t.Errorf("estimate %d, not settled %v; want %d and settled", got, est.noInference, tc.want)
			}
		})
	}
}

// TestCleanPath: dot segments resolved and slashes merged, a trailing
// slash kept; a path already clean, with or without its trailing slash,
// is returned without an allocation (every request's estimate reads it).
func TestCleanPath(t *testing.T) {
	for in, want := range map[string]string{
		"":                                "",
		"/":                               "/",
		"/v1/chat/completions":            "/v1/chat/completions",
		"/v1/chat/completions/":           "/v1/chat/completions/",
		"/v1/chat/completions/.":          "/v1/chat/completions",
		"/v1/chat/completions/./":         "/v1/chat/completions/",
		"/v1/uploads/../chat/completions": "/v1/chat/completions",
		"//v1//chat/completions//":        "/v1/chat/completions/",
		"/v1/chat/completions/abc/..":     "/v1/chat/completions",
		"/../v1/messages":                 "/v1/messages",
		"*":                               "*",
	} {
		if got := cleanPath(in); got != want {
			t.Errorf("cleanPath(%q) = %q, want %q", in, got, want)
		}
	}
	for _, p := range []string{"/v1/chat/completions", "/v1/chat/completions/"} {
		if n := testing.AllocsPerRun(100, func() { _ = cleanPath(p) }); n != 0 {
			t.Errorf("cleanPath(%q): %v allocations, want 0", p, n)
		}
	}
}

// rawExchange writes request as it is on a new connection to the gateway
// on port, half-closes the connection after it when halfClose, and
// returns the answer's status and body. It waits up to a minute for the
// answer: a bound on the wait, not a measure of it (a gateway that never
// answers fails the test).
func rawExchange(t *testing.T, port int, request string, halfClose bool) (int, string) {
	t.Helper()
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, request); err != nil {
		t.Fatal(err)
	}
	if halfClose {
		if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
	}
	if err := conn.SetReadDeadline(time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	res, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}
