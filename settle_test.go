package tokenbucket

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/providertest"
	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/llm"
)

// gzipped returns s compressed with gzip.
func gzipped(t testing.TB, s string) []byte {
	t.Helper()
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	if _, err := zw.Write([]byte(s)); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// record passes a response through a usageRecorder in writes of n bytes
// and returns what the client received and what the recorder read.
func record(t *testing.T, s *Settle, filter bool, header http.Header, body []byte, n int) (*httptest.ResponseRecorder, int64, llm.Status) {
	t.Helper()
	w := httptest.NewRecorder()
	for k, v := range header {
		w.Header()[k] = v
	}
	rec := &usageRecorder{ResponseWriter: w, read: true, filterUsage: filter}
	rec.WriteHeader(http.StatusOK)
	for len(body) > 0 {
		k := min(n, len(body))
		if m, err := rec.Write(body[:k]); err != nil || m != k {
			t.Fatalf("write: %d, %v", m, err)
		}
		body = body[k:]
	}
	used, status, _ := rec.finish(s)
	return w, used, status
}

const (
	openAIChatJSON = `{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"My \"usage\": {\"total_tokens\": 1}"},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21}}`
	// An OpenAI stream with include_usage: "usage":null in every chunk,
	// then the usage-only chunk.
	openAIStreamWithUsage = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}],\"usage\":null}\n\n" +
		"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n" +
		"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9}}\n\n" +
		"data: [DONE]\n\n"
	// The same stream as the client asked for it, without include_usage.
	openAIStreamAsAsked = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n" +
		"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n" +
		"data: [DONE]\n\n"
)

// TestUsageRecorder: the recorder reads the usage of what passes through,
// compressed or not, in writes of any size, and the client receives
// exactly the bytes the upstream sent, except the usage chunks of a stream
// whose include_usage the gateway added.
func TestUsageRecorder(t *testing.T) {
	json := http.Header{"Content-Type": {"application/json"}}
	gz := http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}}
	sse := http.Header{"Content-Type": {"text/event-stream; charset=utf-8"}}
	sseGzip := http.Header{"Content-Type": {"text/event-stream"}, "Content-Encoding": {"gzip"}}
	for _, tc := range []struct {
		name   string
		settle *Settle
		filter bool
		header http.Header
		body   []byte
		client []byte // nil: the body
		used   int64
		status llm.Status
	}{
		{"json", &Settle{}, false, json, []byte(openAIChatJSON), nil, 21, llm.Found},
		{"json_gzip", &Settle{}, false, gz, gzipped(t, openAIChatJSON), nil, 21, llm.Found},
		{"stream_asked_for_usage", &Settle{}, false, sse, []byte(openAIStreamWithUsage), nil, 9, llm.Found},
		{"stream_usage_added", &Settle{IncludeUsage: true}, true, sse, []byte(openAIStreamWithUsage), []byte(openAIStreamAsAsked), 9, llm.Found},
		// An upstream that compresses anyway: nothing can be cut, the
		// usage is still read.
		{"stream_usage_added_gzip", &Settle{IncludeUsage: true}, true, sseGzip, gzipped(t, openAIStreamWithUsage), nil, 9, llm.Found},
		{"stream_without_usage", &Settle{}, false, sse, []byte(openAIStreamAsAsked), nil, 0, llm.NotReported},
		{"negative_usage", &Settle{}, false, json, []byte(`{"usage":{"prompt_tokens":-500,"completion_tokens":1}}`), nil, 0, llm.Invalid},
		{"unknown_encoding", &Settle{}, false, http.Header{"Content-Encoding": {"compress"}}, []byte("x"), nil, 0, llm.Unreadable},
		{"header", &Settle{Header: "X-Tokens-Used"}, false, http.Header{"X-Tokens-Used": {" 42 "}}, []byte(openAIChatJSON), nil, 42, llm.Found},
		{"header_negative", &Settle{Header: "X-Tokens-Used"}, false, http.Header{"X-Tokens-Used": {"-1"}}, nil, nil, 0, llm.Invalid},
		{"header_missing", &Settle{Header: "X-Tokens-Used"}, false, http.Header{}, []byte(openAIChatJSON), nil, 0, llm.NotReported},
	} {
		for _, n := range []int{1, 7, 1 << 20} {
			t.Run(tc.name+"/writes_of_"+strconv.Itoa(n), func(t *testing.T) {
				w, used, status := record(t, tc.settle, tc.filter, tc.header, tc.body, n)
				if used != tc.used || status != tc.status {
					t.Errorf("usage %d %v, want %d %v", used, status, tc.used, tc.status)
				}
				want := tc.client
				if want == nil {
					want = tc.body
				}
				if !bytes.Equal(w.Body.Bytes(), want) {
					t.Errorf("client received %q\nwant %q", w.Body.Bytes(), want)
				}
			})
		}
	}
}

// TestUsageRecorderSettlesCutStreams: usage that reached the gateway counts
// when the stream ends right after it, before [DONE] or the blank line.
func TestUsageRecorderSettlesCutStreams(t *testing.T) {
	sse := http.Header{"Content-Type": {"text/event-stream"}}
	cut := openAIStreamWithUsage[:strings.Index(openAIStreamWithUsage, `"total_tokens":9}}`)+len(`"total_tokens":9}}`)]
	if _, used, status := record(t, &Settle{}, false, sse, []byte(cut), 1<<20); used != 9 || status != llm.Found {
		t.Errorf("cut after the usage: %d %v, want 9 found", used, status)
	}
	// A stream compressed as Caddy's encode does it, one flush per event,
	// cut after the usage event's flush (no [DONE], no gzip trailer).
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	for _, ev := range strings.SplitAfter(openAIStreamWithUsage, "\n\n")[:3] {
		if _, err := zw.Write([]byte(ev)); err != nil {
			t.Fatal(err)
		}
		if err := zw.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	gz := http.Header{"Content-Type": {"text/event-stream"}, "Content-Encoding": {"gzip"}}
	if _, used, status := record(t, &Settle{}, false, gz, b.Bytes(), 100); used != 9 || status != llm.Found {
		t.Errorf("gzip stream cut after the usage: %d %v, want 9 found", used, status)
	}
}

// BenchmarkSettleRedis measures the extra Redis round trip that settlement
// adds to a request, against a local redis-server: one settle.lua call on
// one tokens bucket per op, each with a new request id, next to the
// decision's own token_bucket.lua call and a PING. It reports the p50 and
// p99 of the calls' latencies.
func BenchmarkSettleRedis(b *testing.B) {
	srv := redistest.Start(b)
	rdb := srv.Client(b)
	ctx := context.Background()
	spec, err := bucket.Limit{Capacity: 1 << 40, Rate: mustRate(b, "1000/s")}.Spec()
	if err != nil {
		b.Fatal(err)
	}
	store := bucket.Redis{Client: rdb}
	key := bucket.NewKeyer("rl:", "").Key("user", "bench", "tokens")
	keys := []string{key}
	takes := []bucket.Take{{Spec: spec, Cost: 500}}
	adj := []bucket.Adjust{{Spec: spec, Delta: -180}}
	if err := rdb.Ping(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	run := func(b *testing.B, call func(i int) error) {
		lat := make([]time.Duration, 0, 1<<16)
		i := 0
		for b.Loop() {
			start := time.Now()
			if err := call(i); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(start))
			i++
		}
		slices.Sort(lat)
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
		b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
	}
	b.Run("ping", func(b *testing.B) {
		run(b, func(int) error { return rdb.Ping(ctx).Err() })
	})
	b.Run("take", func(b *testing.B) {
		run(b, func(int) error { _, err := store.Take(ctx, keys, takes); return err })
	})
	seq := 0 // request ids are unique across the benchmark's runs
	b.Run("settle", func(b *testing.B) {
		run(b, func(i int) error {
			seq++
			ok, err := store.Settle(ctx, "bench-"+strconv.Itoa(seq), keys, adj)
			if err == nil && !ok {
				err = fmt.Errorf("request %d settled before", i)
			}
			return err
		})
	})
}

func mustRate(b *testing.B, s string) bucket.Rate {
	r, err := bucket.ParseRate(s)
	if err != nil {
		b.Fatal(err)
	}
	return r
}

// TestUsageRecorderPartialAnthropic: an Anthropic stream cut after
// message_start reports its input and an output that had only begun: a
// floor, which settle never turns into a refund.
func TestUsageRecorderPartialAnthropic(t *testing.T) {
	stream := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude\"," +
		"\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":3,\"cache_read_input_tokens\":2,\"output_tokens\":1}}}\n\n"
	w := httptest.NewRecorder()
	w.Header().Set("Content-Type", "text/event-stream")
	rec := &usageRecorder{ResponseWriter: w, read: true}
	if _, err := rec.Write([]byte(stream)); err != nil {
		t.Fatal(err)
	}
	used, status, partial := rec.finish(&Settle{})
	if used != 31 || status != llm.Found || !partial {
		t.Errorf("cut after message_start: %d %v partial %v, want 31 found partial", used, status, partial)
	}
}

// TestSettlementRetriedAfterRedisFails: a stream's settlement whose call
// fails (here the circuit breaker is open: another request's call lost its
// reply, and breaker_failures is 1) is tried again until Redis answers,
// and lands once: the bucket holds the capacity less the usage reported,
// not less the estimate.
func TestSettlementRetriedAfterRedisFails(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	proxy := redistest.StartProxy(t)
	proxy.SetTarget(srv.Addr)
	up := startLLMUpstream(t)
	up.SetReply(nil)
	used := providertest.Usage{Input: 12, Output: 900}
	up.SetUsage(used)
	g := startGateway(t, llmSite(up.Addr, `token_bucket {
			redis redis://`+proxy.Addr+` {
				timeout 10s
				breaker_failures 1
				breaker_cooldown 3s
			}
			dimension user {http.request.header.X-User}
			tier free {
				user 100000 1/1h tokens
			}
			cost estimate
			settle
			on_redis_error allow
		}`))
	key := bucket.NewKeyer("rl:", "").Key("user", "streamer", "tokens")
	markers := func() int { return len(rdb.Keys(context.Background(), key+":settled:*").Val()) }

	up.Hold()
	done := make(chan e2eResponse, 1)
	go func() {
		done <- g.send(http.MethodPost, "v1/chat/completions",
			strings.NewReader(`{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}]}`),
			"X-User", "streamer", "Content-Type", "application/json")
	}()
	redistest.WaitFor(t, time.Minute, "the stream to reach the upstream", func() error {
		if len(up.Requests()) == 0 {
			return errors.New("not yet")
		}
		return nil
	})
	// Another request's call loses its reply: the breaker opens.
	proxy.LoseReplyTo("evalsha")
	if r := g.send(http.MethodPost, "v1/chat/completions", strings.NewReader(`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`),
		"X-User", "other", "Content-Type", "application/json"); r.status != http.StatusOK || proxy.Lost() != 1 {
		t.Fatalf("the other request: %d, %d replies lost; want 200 by on_redis_error allow, 1 lost", r.status, proxy.Lost())
	}
	up.Release()
	if r := <-done; r.status != http.StatusOK {
		t.Fatalf("the stream: %d", r.status)
	}
	if n := markers(); n != 0 {
		t.Fatalf("the stream settled at once, with the breaker open: %d markers", n)
	}
	redistest.WaitFor(t, time.Minute, "the retried settlement", func() error {
		if n := markers(); n != 1 {
			return fmt.Errorf("%d settlement markers, want 1", n)
		}
		return nil
	})
	if got, want := storedTokens(t, rdb, key), 100000-used.Total(providertest.ChatCompletions); got != want {
		t.Errorf("the bucket holds %d tokens, want %d: the %d used, settled once", got, want, used.Total(providertest.ChatCompletions))
	}
}

// TestSettleRetryable: a retry of a failed settlement is made only while
// it runs in Redis a timeout before the first call's marker can expire
// (bucket.SettleTTL after the first call was sent), so that it never lands
// twice. With the default 50 ms timeout every retry is made; with a 10 s
// one whose calls all time out (the first at 10 s, then retries at 11 s,
// failing at 21 s, and at 26 s, failing at 36 s), the third retry, at
// 66 s, is not.
func TestSettleRetryable(t *testing.T) {
	sent := time.Unix(1_800_000_000, 0)
	for _, tc := range []struct {
		at      time.Duration
		timeout time.Duration
		want    bool
	}{
		{36 * time.Second, 50 * time.Millisecond, true},
		{59*time.Second + 900*time.Millisecond, 50 * time.Millisecond, true},
		{59*time.Second + 901*time.Millisecond, 50 * time.Millisecond, false},
		{11 * time.Second, 10 * time.Second, true},
		{26 * time.Second, 10 * time.Second, true},
		{40 * time.Second, 10 * time.Second, true},
		{40*time.Second + time.Millisecond, 10 * time.Second, false},
		{66 * time.Second, 10 * time.Second, false},
	} {
		if got := settleRetryable(sent, sent.Add(tc.at), tc.timeout); got != tc.want {
			t.Errorf("a retry at %v with a %v timeout: %v, want %v", tc.at, tc.timeout, got, tc.want)
		}
	}
	if bucket.SettleTTL != time.Minute {
		t.Errorf("SettleTTL %v: the cases above are for a minute", bucket.SettleTTL)
	}
}

// TestSettlementFailureOutcome: a settlement whose calls all failed is
// counted failed (the estimate stands) only when none of them can have
// reached Redis: refused by the breaker, or unsent (see TestUnsent). One
// that timed out or lost its connection may have run, its reply lost, and
// is counted unknown, as is a Cluster settlement that landed in some
// hash-tag groups before a dial failed.
func TestSettlementFailureOutcome(t *testing.T) {
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, tc := range []struct {
		name  string
		err   error
		never bool
	}{
		{"breaker open", gobreaker.ErrOpenState, true},
		{"breaker half-open", gobreaker.ErrTooManyRequests, true},
		{"dial", dial, true},
		{"timeout", context.DeadlineExceeded, false},
		{"connection reset", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, false},
		{"cluster, settled in part", &bucket.PartialSettleError{Err: dial}, false},
	} {
		if got := neverSent(tc.err); got != tc.never {
			t.Errorf("%s: neverSent %v, want %v", tc.name, got, tc.never)
		}
	}

	h := &Handler{logger: zap.NewNop()}
	st := settlement{req: &request{}, keys: []string{"k"}, adj: []bucket.Adjust{{Delta: -10}}, at: []int{0}, used: 5}
	for _, tc := range []struct {
		err        error
		mayHaveRun bool
		outcome    string
	}{
		{gobreaker.ErrOpenState, false, settleFailedOutcome},
		{context.DeadlineExceeded, true, settleUnknownOutcome},
	} {
		before := map[string]float64{}
		for o, c := range tbMetrics.settleChildren {
			before[o] = testutil.ToFloat64(c)
		}
		h.settled(st, tc.err, tc.mayHaveRun)
		for o, c := range tbMetrics.settleChildren {
			want := 0.0
			if o == tc.outcome {
				want = 1
			}
			if got := testutil.ToFloat64(c) - before[o]; got != want {
				t.Errorf("%v (may have run %v): settlements_total{outcome=%q} grew by %v, want %v", tc.err, tc.mayHaveRun, o, got, want)
			}
		}
	}
}

// TestClusterSettlementInPart: on Redis Cluster a request's user and org
// buckets live on different nodes, and the org's node dies while the
// answer is on its way. The settlement lands in the user's group alone:
// its refund is counted in tokens_refunded_total (the org's is not) and
// ends the user's cached denial, so a request that the refund makes
// affordable is decided by Redis and allowed, not denied from the cache.
// The org's settlement stays unknown (settlements_total{outcome=
// "unknown"}) once its retry fails, and the user's refund is counted
// once.
func TestClusterSettlementInPart(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	// A timeout long enough that one retry is made, 1 s after the first
	// call, and no other (see settleRetryable). Both fail on the dead
	// node, and the retry settles nothing again in the user's group.
	rc := &RedisConfig{Address: cluster.Addrs(), Cluster: true, Timeout: caddy.Duration(28 * time.Second), BreakerFailures: 100}
	tier := uniqueTier("partial")
	h := provisionHandler(t, &Handler{
		Redis: rc,
		Dimensions: []Dimension{
			{Name: "user", Identity: "{http.request.header.X-User}"},
			{Name: "org", Identity: "{http.request.header.X-Org}"},
		},
		Tiers: []Tier{{Name: tier, Limits: []Limit{
			{Dimension: "user", Capacity: 1000, RefillRate: foHour, Unit: "tokens"},
			{Dimension: "org", Capacity: 1000, RefillRate: foHour, Unit: "tokens"},
		}}},
		Estimate: &Estimate{},
		Settle:   &Settle{},
	})
	userKey := h.keyer.Key("user", "u", "tokens")
	userNode := cluster.NodeOf(t, userKey)
	orgOn := func(same bool) string {
		for i := 0; ; i++ {
			org := "org" + strconv.Itoa(i)
			if (cluster.NodeOf(t, h.keyer.Key("org", org, "tokens")) == userNode) == same {
				return org
			}
		}
	}
	farOrg, nearOrg := orgOn(false), orgOn(true)
	orgNode := cluster.NodeOf(t, h.keyer.Key("org", farOrg, "tokens"))
	chat := func(maxTokens int) string {
		return `{"model":"gpt-test","messages":[{"role":"user","content":"0123456789012345678901234567890123456789"}],"max_tokens":` + strconv.Itoa(maxTokens) + `}`
	}
	post := func(org, body string, next caddyhttp.HandlerFunc) int {
		req := httptest.NewRequest(http.MethodPost, "http://gateway.test/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-User", "u")
		req.Header.Set("X-Org", org)
		rec := httptest.NewRecorder()
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
		err := h.ServeHTTP(rec, req, next)
		var he caddyhttp.HandlerError
		if errors.As(err, &he) {
			return he.StatusCode
		}
		if err != nil {
			t.Fatalf("ServeHTTP: %v", err)
		}
		return rec.Code
	}
	answer := func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		_, err := io.WriteString(w, `{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}`)
		return err
	}
	counter := func(c *prometheus.CounterVec, dimension string) float64 {
		return testutil.ToFloat64(c.WithLabelValues(tier, dimension, "tokens"))
	}
	unknown := func() float64 { return testutil.ToFloat64(tbMetrics.settleChildren[settleUnknownOutcome]) }
	unknownBefore := unknown()

	// The first request is charged 500 (10 + 490) on each bucket; its
	// answer comes after a request for 600 more is denied, from Redis,
	// which the deny cache keeps, and after the org's node dies.
	status := post(farOrg, chat(490), func(w http.ResponseWriter, r *http.Request) error {
		if s := post(nearOrg, chat(590), answer); s != http.StatusTooManyRequests {
			t.Errorf("the request for 600: %d, want 429", s)
		}
		orgNode.Stop()
		return answer(w, r)
	})
	if status != http.StatusOK {
		t.Fatalf("the first request: %d", status)
	}
	redistest.WaitFor(t, time.Minute, "the settlement to end", func() error {
		if n := unknown() - unknownBefore; n != 1 {
			return fmt.Errorf("settlements_total{outcome=unknown} grew by %v, want 1", n)
		}
		return nil
	})
	if got := storedTokens(t, userNode.Client(t), userKey); got != 970 {
		t.Errorf("the user's bucket holds %d tokens, want 970: 1000 less the 30 used", got)
	}
	for _, c := range []struct {
		dimension         string
		charged, refunded float64
	}{{"user", 500, 470}, {"org", 500, 0}} {
		if got := counter(tbMetrics.charged, c.dimension); got != c.charged {
			t.Errorf("tokens_charged_total{dimension=%q} = %v, want %v", c.dimension, got, c.charged)
		}
		if got := counter(tbMetrics.refunded, c.dimension); got != c.refunded {
			t.Errorf("tokens_refunded_total{dimension=%q} = %v, want %v", c.dimension, got, c.refunded)
		}
	}
	if s := post(nearOrg, chat(590), answer); s != http.StatusOK {
		t.Errorf("the request for 600 after the refund: %d, want 200 (Redis decides again)", s)
	}
}

// TestStreamWithNullErrorKeepsItsEstimate: an OpenAI-compatible upstream
// that writes "error": null in its successful chunks, as OpenRouter does,
// streams a completion without usage (settle without include_usage): the
// model ran, so the estimate of 501 stands; only a stream that opens with
// an error object gives it back.
func TestStreamWithNullErrorKeepsItsEstimate(t *testing.T) {
	up := startRawUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"error\":null,\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hello\"}}]}\n\n")
		io.WriteString(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"error\":null,\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"},\"finish_reason\":\"stop\"}]}\n\n")
		io.WriteString(w, "data: [DONE]\n\n")
	})
	g := startGateway(t, llmSite(up, llmLimiter("user 100000 1/1h tokens", "cost estimate\n\t\t\tsettle")))
	notReported := tbMetrics.settleChildren[llm.NotReported.String()]
	before := testutil.ToFloat64(notReported)
	r := g.send(http.MethodPost, "v1/chat/completions",
		strings.NewReader(`{"model":"gpt-4o-mini","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"Hi!"}]}`),
		"X-User", "nullerr", "Content-Type", "application/json")
	if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != "501" {
		t.Fatalf("status %d, estimated %q: %s", r.status, r.header.Get("X-Estimated-Cost"), r.body)
	}
	// The answer has a Content-Length: the client may read it all before
	// the settlement, which runs as the handler returns, is counted.
	redistest.WaitFor(t, time.Minute, "the settlement", func() error {
		if n := testutil.ToFloat64(notReported) - before; n != 1 {
			return fmt.Errorf("settlements_total{outcome=\"not_reported\"} grew by %v, want 1", n)
		}
		return nil
	})
	key := bucket.NewKeyer("rl:", "").Key("user", "nullerr", "tokens")
	if v := g.value(key); v == "" {
		t.Fatalf("the bucket is full: the estimate was given back")
	}
	if got := storedTokens(t, g.rdb, key); got != 100000-501 {
		t.Errorf("the bucket holds %d tokens, want %d (the estimate stands)", got, 100000-501)
	}
}
