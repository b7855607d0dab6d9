package tokenbucket

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/providertest"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// Hostile and broken LLM traffic, end to end through Caddy and a real
// Redis: ways to spend more tokens than the limit allows, or to take the
// gateway's CPU, memory or settlements away from everyone else.

// hostileLLM is a gateway with one user's tokens limit in front of an
// upstream.
type hostileLLM struct {
	*e2eGateway
	spec bucket.Spec
}

// startHostileLLM loads a gateway limiting X-User to capacity tokens
// (refill 1 an hour, so that the test's own time changes no whole token)
// with cost estimate and settle, in front of upstream (host:port); extra
// goes into the token_bucket block.
func startHostileLLM(t *testing.T, upstream string, capacity int64, extra string) *hostileLLM {
	t.Helper()
	g := startGateway(t, hostileLLMSite(upstream, capacity, extra))
	rate, err := bucket.ParseRate("1/1h")
	if err != nil {
		t.Fatal(err)
	}
	spec, err := bucket.Limit{Capacity: capacity, Rate: rate}.Spec()
	if err != nil {
		t.Fatal(err)
	}
	return &hostileLLM{e2eGateway: g, spec: spec}
}

func hostileLLMSite(upstream string, capacity int64, extra string) string {
	return fmt.Sprintf(`
	header >X-Estimated-Cost {http.token_bucket.cost}
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		tier free {
			user 100 1/1h
			user %d 1/1h tokens
		}
		cost estimate
		settle
		%s
	}
	reverse_proxy %s`, capacity, extra, upstream)
}

// post sends a JSON body to path as user.
func (g *hostileLLM) post(t *testing.T, path, user, body string) e2eResponse {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, strings.TrimSuffix(g.url, "/")+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-User", user)
	r, err := readResponse(g.client.Do(req))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// tokens returns the whole tokens of user's tokens bucket (capacity when
// it has no key: a full bucket).
func (g *hostileLLM) tokens(t *testing.T, user string) int64 {
	t.Helper()
	n, ok := decodeTokens(t, g.value(bucket.NewKeyer("rl:", "").Key("user", user, "tokens")))
	if !ok {
		return g.spec.Capacity
	}
	return n
}

// waitTokens waits until user's bucket holds want whole tokens (a
// settlement that runs after the client has its answer), failing after
// a minute.
func (g *hostileLLM) waitTokens(t *testing.T, user string, want int64) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		got := g.tokens(t, user)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s's bucket holds %d tokens, want %d", user, got, want)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, not timing
	}
}

// nested returns a body whose one message's content nests depth arrays of
// parts, each holding text.
func nested(depth int) string {
	var b strings.Builder
	b.WriteString(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":`)
	for range depth {
		b.WriteString(`[{"type":"text","text":"abcd","content":`)
	}
	b.WriteString(`"x"`)
	for range depth {
		b.WriteString(`}]`)
	}
	b.WriteString(`}]}`)
	return b.String()
}

// TestHostileNestedContent: a body of nested content chains is estimated
// in one pass: up to the depth bound it is counted (each level's text,
// once), deeper it is 400 invalid_body, and a client already denied by its
// requests limit is answered 429 without its body being read at all (a
// 28 KB body of such chains used to cost seconds of CPU, even for a key
// already at 429).
func TestHostileNestedContent(t *testing.T) {
	up := providertest.Start(t)
	g := startHostileLLM(t, up.Addr, 1_000_000, "")
	// 60 levels of "abcd" and the innermost "x": 61 tokens, + 1.
	if r := g.post(t, "/v1/chat/completions", "alice", nested(60)); r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != "62" {
		t.Fatalf("60 levels: %d, cost %q, want 200 with 62", r.status, r.header.Get("X-Estimated-Cost"))
	}
	deep := nested(2000) // 70 KB
	if r := g.post(t, "/v1/chat/completions", "alice", deep); r.status != http.StatusBadRequest || !strings.Contains(r.body, "invalid_body") {
		t.Fatalf("2000 levels: %d %s, want 400 invalid_body", r.status, r.body)
	}
	// bob spends his requests limit and is denied once by Redis; then his
	// deep bodies are not parsed: 429 from the deny cache, where parsing
	// would have said 400.
	g.load(hostileLLMSiteRequests(up.Addr))
	for i := 0; i < 3; i++ {
		want := http.StatusOK
		if i == 2 {
			want = http.StatusTooManyRequests
		}
		if r := g.post(t, "/v1/chat/completions", "bob", nested(1)); r.status != want {
			t.Fatalf("bob %d: %d %s, want %d", i, r.status, r.body, want)
		}
	}
	for i := 0; i < 2; i++ {
		if r := g.post(t, "/v1/chat/completions", "bob", deep); r.status != http.StatusTooManyRequests {
			t.Fatalf("bob, denied, deep body %d: %d %s, want 429", i, r.status, r.body)
		}
	}
}

// hostileLLMSiteRequests limits X-User to 2 requests an hour and 10⁶
// tokens.
func hostileLLMSiteRequests(upstream string) string {
	return fmt.Sprintf(`
	header >X-Estimated-Cost {http.token_bucket.cost}
	token_bucket {
		redis redis://REDIS_ADDR
		dimension user {http.request.header.X-User}
		tier free {
			user 2 1/1h
			user 1000000 1/1h tokens
		}
		cost estimate
	}
	reverse_proxy %s`, upstream)
}

// TestHostileFieldCase: a body that JSON parsers read differently is 400
// invalid_body, and reaches neither Redis nor the upstream. Go's
// encoding/json (Ollama and other Go servers) matches member names in any
// case and keeps the last non-null value, so a "MAX_TOKENS" or "N" beside
// (or instead of) "max_tokens" and "n" used to set a budget the estimate
// never saw: 8 completions of 100,000 tokens each passed a 10,000-token
// limit at the default budget. A second "model", a null one after it
// (Go keeps the first, Python reads null), and a stream that is not a
// boolean are refused the same way. A part's member in another case only
// holds text, counted or not, and is left alone; of duplicate budgets the
// larger is charged.
func TestHostileFieldCase(t *testing.T) {
	up := providertest.Start(t)
	g := startHostileLLM(t, up.Addr, 1_000_000, "")
	for _, body := range []string{
		`{"messages":[{"role":"user","content":"abcd"}],"max_tokens":50000,"MAX_TOKENS":1,"Max_Tokens":2}`,
		`{"model":"m","messages":[],"MAX_TOKENS":100000,"N":8,"Stream":true}`,
		`{"model":"gpt-4.1-mini","Model":"gpt-4o","messages":[]}`,
		`{"model":"gpt-4o","model":null,"messages":[]}`,
		`{"model":"m","messages":[],"stream":"true"}`,
		`{"model":"m","messages":[],"stream":true,"stream":null}`,
	} {
		r := g.post(t, "/v1/chat/completions", "alice", body)
		if r.status != http.StatusBadRequest || !strings.Contains(r.body, `"invalid_body"`) {
			t.Errorf("%s: %d %s, want 400 invalid_body", body, r.status, r.body)
		}
	}
	if n := len(up.Requests()); n != 0 {
		t.Errorf("the upstream saw %d of the ambiguous bodies, want none", n)
	}
	if keys := g.keys(); len(keys) != 0 {
		t.Errorf("Redis holds %q after the ambiguous bodies, want nothing", keys)
	}
	for _, tc := range []struct {
		name, body string
		cost       int64
	}{
		{"content_case_variant_ignored", `{"messages":[{"role":"user","Content":"` + strings.Repeat("x", 4000) + `","content":"abcd"}],"max_tokens":0}`, 1},
		{"duplicate_budget_largest", `{"messages":[],"max_tokens":50000,"max_tokens":1}`, 50000},
	} {
		r := g.post(t, "/v1/chat/completions", tc.name, tc.body)
		if r.status != http.StatusOK || r.header.Get("X-Estimated-Cost") != strconv.FormatInt(tc.cost, 10) {
			t.Errorf("%s: %d, cost %q, want 200 with %d", tc.name, r.status, r.header.Get("X-Estimated-Cost"), tc.cost)
		}
	}
}

// TestHostileUsageCutShort: usage that reached the gateway is settled
// however the response ends. The upstream dies right after the usage
// chunk (reverse_proxy aborts the response), and a client goes away right
// after reading it: both buckets end at the exact usage, not the estimate
// (which used to stand, letting 50,000-token streams through a 1,000-token
// bucket).
func TestHostileUsageCutShort(t *testing.T) {
	up := providertest.Start(t)
	g := startHostileLLM(t, up.Addr, 100_000, "")
	up.SetReply(func(*providertest.Request) providertest.Reply {
		return providertest.Reply{Usage: &providertest.Usage{Input: 40, Output: 60}, AbortAfterUsage: true}
	})
	body := `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":5000,"messages":[{"role":"user","content":"abcd"}]}`
	hostileAbortUser(t, g, body)

	// A client that leaves right after the usage chunk: the upstream holds
	// the rest of its stream until the client is gone.
	release := make(chan struct{})
	usageSent := make(chan struct{})
	raw := startRawUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}],"usage":null}`+"\n\n")
		io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":30,"completion_tokens":20,"total_tokens":50}}`+"\n\n")
		http.NewResponseController(w).Flush()
		close(usageSent)
		<-release
		io.WriteString(w, "data: [DONE]\n\n")
	})
	g.load(hostileLLMSite(raw, 100_000, ""))
	conn, err := net.Dial("tcp", strings.TrimPrefix(strings.TrimSuffix(g.url, "/"), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-User: leaver\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	br := bufio.NewReader(conn)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("reading the stream: %v", err)
		}
		if strings.Contains(line, `"total_tokens":50`) {
			break
		}
	}
	<-usageSent
	conn.Close()
	close(release)
	g.waitTokens(t, "leaver", 100_000-50)
}

// hostileAbortUser sends body as "aborted" through the gateway whose
// upstream aborts after the usage: the bucket is settled to 40 + 60.
func hostileAbortUser(t *testing.T, g *hostileLLM, body string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, g.url+"v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-User", "aborted")
	req.Header.Set("Content-Type", "application/json")
	if r, err := g.client.Do(req); err == nil {
		io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	g.waitTokens(t, "aborted", 100_000-100)
}

// startRawUpstream serves h on 127.0.0.1 and returns its host:port.
func startRawUpstream(t *testing.T, h http.HandlerFunc) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return l.Addr().String()
}

// TestHostileUsageNumbers: usage numbers that are negative, fractional or
// overflow are invalid: the estimate stands, nothing is given back (a
// negative input used to give back far more than was charged; two huge
// numbers whose sum overflowed read as 0). A request that used 50 times
// the capacity leaves its bucket at exactly minus one capacity.
func TestHostileUsageNumbers(t *testing.T) {
	var mu sync.Mutex
	answer := ""
	raw := startRawUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		mu.Lock()
		defer mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	})
	g := startHostileLLM(t, raw, 1000, "")
	body := `{"model":"m","max_tokens":99,"messages":[{"role":"user","content":"abcd"}]}` // estimate 100
	for _, tc := range []struct {
		user, usage string
		want        int64
	}{
		{"negative", `{"prompt_tokens":-500,"completion_tokens":1,"total_tokens":-499}`, 900},
		{"overflow", `{"prompt_tokens":9223372036854775807,"completion_tokens":9223372036854775807}`, 900},
		{"fraction", `{"prompt_tokens":1.5,"completion_tokens":1}`, 900},
		{"above_2_53", `{"total_tokens":9007199254740993}`, 900},
		{"fifty_capacities", `{"prompt_tokens":50000,"completion_tokens":0,"total_tokens":50000}`, -1000},
		{"valid", `{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}`, 990},
	} {
		mu.Lock()
		answer = `{"id":"x","object":"chat.completion","choices":[],"usage":` + tc.usage + `}`
		mu.Unlock()
		if r := g.post(t, "/v1/chat/completions", tc.user, body); r.status != http.StatusOK {
			t.Fatalf("%s: %d %s", tc.user, r.status, r.body)
		}
		g.waitTokens(t, tc.user, tc.want)
	}
}

// TestHostileNestedUsageKey: a long answer whose content, metadata or tool
// arguments hold other "usage" keys, far past any head or tail a parser
// might keep, settles at the provider's own top-level usage.
func TestHostileNestedUsageKey(t *testing.T) {
	filler := strings.Repeat("lorem ipsum ", 20_000) // 240 KB
	answer := `{"id":"x","object":"chat.completion","usage":{"prompt_tokens":11,"completion_tokens":22,"total_tokens":33},` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"` + filler + `","tool_calls":[{"function":{"name":"f","arguments":"{\"usage\":{\"total_tokens\":1}}"}}]}}],` +
		`"metadata":{"usage":{"total_tokens":1},"pad":"` + filler + `"}}`
	raw := startRawUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	})
	g := startHostileLLM(t, raw, 100_000, "")
	r := g.post(t, "/v1/chat/completions", "nested", `{"model":"m","max_tokens":1000,"messages":[{"role":"user","content":"abcd"}]}`)
	if r.status != http.StatusOK || r.body != answer {
		t.Fatalf("%d, body of %d bytes, want 200 and the answer unchanged", r.status, len(r.body))
	}
	g.waitTokens(t, "nested", 100_000-33)
}

// TestReloadKeepsSettlement: a config reload that changes the redis block
// drops the old Redis client, but not under a stream that started before:
// the stream ends 200 and its settlement lands (it used to be lost, and
// requests mid-decision got 503).
func TestReloadKeepsSettlement(t *testing.T) {
	up := providertest.Start(t)
	g := startHostileLLM(t, up.Addr, 100_000, "")
	up.Hold()
	type result struct {
		r   e2eResponse
		err error
	}
	done := make(chan result, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, g.url+"v1/chat/completions",
			strings.NewReader(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":1000,"messages":[{"role":"user","content":"abcd"}]}`))
		req.Header.Set("X-User", "streamer")
		r, err := readResponse(g.client.Do(req))
		done <- result{r, err}
	}()
	// The stream has begun once the upstream has seen it.
	redistest.WaitFor(t, time.Minute, "the stream to reach the upstream", func() error {
		if len(up.Requests()) == 0 {
			return errors.New("not yet")
		}
		return nil
	})
	// Another timeout is another Redis configuration: a new client, and
	// the old one released by the old handler's cleanup.
	if err := postLoad(g.caddyfile(strings.Replace(hostileLLMSite(up.Addr, 100_000, ""), "timeout 10s", "timeout 9s", 1)), "caddyfile"); err != nil {
		t.Fatal(err)
	}
	up.Release()
	res := <-done
	if res.err != nil || res.r.status != http.StatusOK || !strings.Contains(res.r.body, "[DONE]") {
		t.Fatalf("stream across the reload: %v %d %q", res.err, res.r.status, res.r.body)
	}
	g.waitTokens(t, "streamer", 100_000-providertest.DefaultUsage.Total(providertest.ChatCompletions))
}

// TestHostileTrickledBody: a body that trickles in is answered 408 after
// read_timeout, instead of holding its goroutine and buffer for as long
// as the client likes.
func TestHostileTrickledBody(t *testing.T) {
	up := providertest.Start(t)
	g := startHostileLLM(t, up.Addr, 100_000, "")
	g.load(strings.Replace(hostileLLMSite(up.Addr, 100_000, ""), "cost estimate", "cost estimate {\n\t\t\tread_timeout 300ms\n\t\t}", 1))
	conn, err := net.Dial("tcp", strings.TrimPrefix(strings.TrimSuffix(g.url, "/"), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-User: slow\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\":")
	conn.SetReadDeadline(time.Now().Add(time.Minute))
	res, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a stalled body: %v", err)
	}
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(b), "request_timeout") {
		t.Errorf("stalled body: %d %s, want 408 request_timeout", res.StatusCode, b)
	}
	if len(up.Requests()) != 0 {
		t.Errorf("the upstream saw %d requests, want none", len(up.Requests()))
	}
	if got := g.tokens(t, "slow"); got != 100_000 {
		t.Errorf("bucket holds %d, want it untouched", got)
	}
}

// TestIncludeUsageOnlyForChatCompletions: settle { include_usage } changes
// only OpenAI chat completions and completions bodies. Anthropic's messages
// reject members they do not know, and the Responses API reports usage in
// every stream: their streamed bodies reach the provider byte for byte.
func TestIncludeUsageOnlyForChatCompletions(t *testing.T) {
	up := providertest.Start(t)
	g := startGateway(t, strings.Replace(hostileLLMSite(up.Addr, 100_000, ""), "settle", "settle {\n\t\t\tinclude_usage\n\t\t}", 1))
	for _, tc := range []struct{ path, body string }{
		{"/v1/messages", `{"model":"claude","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"abcd"}]}`},
		{"/v1/responses", `{"model":"gpt-4.1","input":"abcd","stream":true}`},
	} {
		req, err := http.NewRequest(http.MethodPost, strings.TrimSuffix(g.url, "/")+tc.path, strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-User", "u")
		req.Header.Set("anthropic-version", "2023-06-01")
		r, err := readResponse(g.client.Do(req))
		if err != nil || r.status != http.StatusOK {
			t.Fatalf("%s: %v %d %s", tc.path, err, r.status, r.body)
		}
		if got := string(up.Last(t).Body); got != tc.body {
			t.Errorf("%s: the provider saw %s, want the body unchanged", tc.path, got)
		}
	}
}

// TestIncludeUsageFilteredWhenDegraded: when on_redis_error decides, the
// body still goes upstream with include_usage added, and the client still
// gets the stream it asked for: no usage-only chunk, no "usage":null.
func TestIncludeUsageFilteredWhenDegraded(t *testing.T) {
	up := providertest.Start(t)
	site := strings.Replace(hostileLLMSite(up.Addr, 100_000, "on_redis_error allow"), "settle", "settle {\n\t\t\tinclude_usage\n\t\t}", 1)
	site = strings.Replace(site, "timeout 10s", "timeout 100ms", 1)
	g := startGateway(t, site)
	g.redis.Stop()
	body := `{"model":"m","stream":true,"max_tokens":100,"messages":[{"role":"user","content":"abcd"}]}`
	req, err := http.NewRequest(http.MethodPost, g.url+"v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-User", "u")
	r, err := readResponse(g.client.Do(req))
	if err != nil || r.status != http.StatusOK {
		t.Fatalf("%v %d %s", err, r.status, r.body)
	}
	if !up.Last(t).IncludeUsage {
		t.Error("the provider was not asked for usage")
	}
	if strings.Contains(r.body, `"usage"`) || strings.Contains(r.body, `"choices":[]`) || !strings.Contains(r.body, "[DONE]") {
		t.Errorf("the client got usage it did not ask for:\n%s", r.body)
	}
}
