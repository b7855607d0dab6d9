package tokenbucket

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/providertest"
	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/llm"
)

// The official OpenAI and Anthropic SDKs (sdk/package.json), run by Node.js
// through sdk/run.mjs, against Caddy with token_bucket in front of the
// providertest stand-in: what applications see of settlement, 429s and
// retries, with exact bucket contents.

// sdkTimeout bounds one run of the SDK script: node's start, the SDKs'
// import and the calls, retries and their waits included, on a loaded
// machine running -race.
const sdkTimeout = 3 * time.Minute

// settleTimeout bounds the wait for a settlement to be stored after the
// SDK has read the whole answer.
const settleTimeout = 20 * time.Second

// minNodeMajor is the oldest Node.js the SDK scripts run on: Debian 12's
// nodejs is 18, Debian 13's 20.
const minNodeMajor = 18

var (
	nodeVersionOnce sync.Once
	nodeVersion     string
	nodeVersionErr  error
)

// sdkOptions is SDK_OPTIONS of sdk/run.mjs.
type sdkOptions struct {
	APIKey     string            `json:"apiKey,omitempty"`
	Headers    map[string]string `json:"headers,omitempty"`
	MaxRetries *int              `json:"maxRetries,omitempty"`
	Params     map[string]any    `json:"params,omitempty"`
	Repeat     int               `json:"repeat,omitempty"`
}

// sdkCall is what run.mjs prints of one SDK call.
type sdkCall struct {
	Result   json.RawMessage   `json:"result"`
	Chunks   []json.RawMessage `json:"chunks"`
	Error    *sdkError         `json:"error"`
	Attempts []sdkAttempt      `json:"attempts"`
}

// sdkError is an error the SDK threw.
type sdkError struct {
	Name             string            `json:"name"`
	Class            string            `json:"class"`
	Message          string            `json:"message"`
	IsRateLimitError bool              `json:"isRateLimitError"`
	IsAPIError       bool              `json:"isAPIError"`
	Status           int               `json:"status"`
	Code             json.RawMessage   `json:"code"`
	Type             json.RawMessage   `json:"type"`
	Param            json.RawMessage   `json:"param"`
	Error            json.RawMessage   `json:"error"`
	Headers          map[string]string `json:"headers"`
}

// sdkAttempt is one HTTP attempt of the SDK, seen by its fetch function;
// times are performance.now() in milliseconds.
type sdkAttempt struct {
	Start          float64           `json:"start"`
	End            float64           `json:"end"`
	Method         string            `json:"method"`
	URL            string            `json:"url"`
	RequestHeaders map[string]string `json:"requestHeaders"`
	RequestBody    *string           `json:"requestBody"`
	Status         int               `json:"status"`
	Headers        map[string]string `json:"headers"`
	ResponseBody   *string           `json:"responseBody"`
	FetchError     string            `json:"fetchError"`
}

// sdkNode returns the node binary, after checking that the SDKs are
// installed in sdk/node_modules. Either missing is a failure.
func sdkNode(t *testing.T) string {
	t.Helper()
	redistest.SkipShort(t)
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("node is not on PATH: the SDK tests run the official OpenAI and Anthropic SDKs under Node.js; " +
			"make test installs it (scripts/install-node.sh), as does apt-get install nodejs npm")
	}
	nodeVersionOnce.Do(func() {
		out, err := exec.Command(node, "--version").Output()
		nodeVersion = strings.TrimSpace(string(out))
		major, _, _ := strings.Cut(strings.TrimPrefix(nodeVersion, "v"), ".")
		if n, perr := strconv.Atoi(major); err != nil || perr != nil || n < minNodeMajor {
			nodeVersionErr = fmt.Errorf("node --version says %q (%v): the SDK tests need Node.js %d or later", nodeVersion, err, minNodeMajor)
		}
	})
	if nodeVersionErr != nil {
		t.Fatal(nodeVersionErr)
	}
	for _, pkg := range []string{"openai", "@anthropic-ai/sdk"} {
		if _, err := os.Stat(filepath.Join("sdk", "node_modules", pkg, "package.json")); err != nil {
			t.Fatalf("the %s SDK is not installed in sdk/node_modules (%v): run npm ci in sdk/ (make test does)", pkg, err)
		}
	}
	return node
}

// runSDK runs scenario of sdk/run.mjs against the gateway at baseURL and
// returns its calls.
func runSDK(t *testing.T, scenario, baseURL string, opts sdkOptions) []sdkCall {
	t.Helper()
	node := sdkNode(t)
	optJSON, err := json.Marshal(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), sdkTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "run.mjs", scenario, strings.TrimSuffix(baseURL, "/"))
	cmd.Dir = "sdk"
	cmd.Env = append(os.Environ(), "SDK_OPTIONS="+string(optJSON), "NODE_NO_WARNINGS=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			t.Fatalf("node run.mjs %s: no result within %v\nstdout: %s\nstderr: %s", scenario, sdkTimeout, stdout.Bytes(), stderr.Bytes())
		}
		t.Fatalf("node run.mjs %s: %v\nstdout: %s\nstderr: %s", scenario, err, stdout.Bytes(), stderr.Bytes())
	}
	var out struct {
		Scenario string    `json:"scenario"`
		Calls    []sdkCall `json:"calls"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &out); err != nil || out.Scenario != scenario {
		t.Fatalf("node run.mjs %s printed %q (%v)\nstderr: %s", scenario, stdout.Bytes(), err, stderr.Bytes())
	}
	if want := max(1, opts.Repeat); len(out.Calls) != want {
		t.Fatalf("%d calls, want %d", len(out.Calls), want)
	}
	return out.Calls
}

// okCall checks that the call succeeded in one attempt, answered 200, and
// returns that attempt.
func okCall(t *testing.T, what string, c sdkCall) sdkAttempt {
	t.Helper()
	if c.Error != nil {
		t.Fatalf("%s: the SDK threw %+v\nattempts: %+v", what, *c.Error, c.Attempts)
	}
	if len(c.Attempts) != 1 || c.Attempts[0].Status != http.StatusOK {
		t.Fatalf("%s: attempts %+v, want one answered 200", what, c.Attempts)
	}
	return c.Attempts[0]
}

// sdkGateway is an llmGateway whose upstream reports usage for every
// answer (whatever the request's headers).
func sdkGateway(t *testing.T, limiter string, usage providertest.Usage) *llmGateway {
	t.Helper()
	lg := startLLMGateway(t, limiter)
	lg.up.SetReply(nil)
	lg.up.SetUsage(usage)
	return lg
}

// waitMarkers waits until the bucket at key has n settlement markers: the
// settlement of the n-th request is stored (the script that writes the
// marker writes the bucket).
func (lg *llmGateway) waitMarkers(key string, n int) {
	lg.t.Helper()
	redistest.WaitFor(lg.t, settleTimeout, fmt.Sprintf("settlement %d of %s", n, key), func() error {
		if got := len(lg.markers(key)); got != n {
			return fmt.Errorf("%d settlement markers, want %d", got, n)
		}
		return nil
	})
}

// settledExactly checks the bucket at key after a settlement: it is what
// bucket.SettleState (the model of settle.lua) makes, at the time the
// settlement stored, of the state the upstream saw after the charge, with
// used − charged more tokens. It returns the stored state.
func (lg *llmGateway) settledExactly(what, key string, spec bucket.Spec, seen llmSeen, charged, used int64) bucket.State {
	lg.t.Helper()
	before, err := bucket.DecodeState(seen.state[key])
	if err != nil {
		lg.t.Fatalf("%s: the bucket the upstream saw: %v", what, err)
	}
	after, ok := lg.state(key)
	if !ok {
		lg.t.Fatalf("%s: no bucket stored after the settlement", what)
	}
	model, kept := bucket.SettleState(after.Last, spec, before, used-charged)
	if !kept || model != after {
		lg.t.Errorf("%s: stored %+v, want the model's %+v (kept %v) from %+v, charged %d, used %d",
			what, after, model, kept, before, charged, used)
	}
	return after
}

// chargedFromFull is the cost charged to a bucket that was full: the
// upstream saw capacity − cost.
func chargedFromFull(t *testing.T, spec bucket.Spec, seen llmSeen, key string) int64 {
	t.Helper()
	st, err := bucket.DecodeState(seen.state[key])
	if err != nil {
		t.Fatalf("the bucket the upstream saw: %v", err)
	}
	gone := spec.CapacityUnits() - st.Units
	if st.Scale != spec.Scale || gone%spec.Scale != 0 {
		t.Fatalf("the bucket the upstream saw (%+v) is not a full bucket less a whole cost", st)
	}
	return gone / spec.Scale
}

// estimatedCost is X-Estimated-Cost of an answer: the cost charged.
func estimatedCost(t *testing.T, a sdkAttempt) int64 {
	t.Helper()
	n, err := strconv.ParseInt(a.Headers["x-estimated-cost"], 10, 64)
	if err != nil {
		t.Fatalf("X-Estimated-Cost %q: %v", a.Headers["x-estimated-cost"], err)
	}
	return n
}

// sentBody is the request body the SDK sent on an attempt.
func sentBody(t *testing.T, a sdkAttempt) string {
	t.Helper()
	if a.RequestBody == nil {
		t.Fatal("the SDK sent no string body")
	}
	return *a.RequestBody
}

// wantUpstreamBody checks that the upstream received exactly want.
func wantUpstreamBody(t *testing.T, seen llmSeen, want string) {
	t.Helper()
	if string(seen.Body) != want {
		t.Errorf("the upstream received\n%s\nwant\n%s", seen.Body, want)
	}
}

// sdkUsage is what the stand-in reports to OpenAI chat requests: 21 tokens.
var sdkUsage = providertest.Usage{Input: 12, Output: 9}

// settleLimiter is llmLimiter with a tokens limit, cost estimate and
// settle, on tier (the metrics' tier label).
func settleLimiter(tier string) string {
	return strings.Replace(llmLimiter("user 100000 1/1h tokens", "cost estimate\n\t\t\tsettle"), "tier free", "tier "+tier, 1)
}

// testOpenAIChatSettles runs three chat completions of one user through the
// SDK and checks that the bucket is charged exactly 3 × 21 tokens, each
// settlement exactly as the model says, and that the metrics of tier say
// so: the estimates charged, all but the 21 used of each given back;
// wantEncoding is the Content-Encoding the SDK must see.
func testOpenAIChatSettles(t *testing.T, lg *llmGateway, tier, wantEncoding string) {
	const capacity = 100000
	spec := llmSpec(t, capacity, "1/1h")
	user := "sdk-" + strings.ReplaceAll(t.Name(), "/", "-")
	key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
	lg.up.watchKeys(lg.rdb, key)
	used := sdkUsage.Total(providertest.ChatCompletions)
	chargedS := series("caddy_token_bucket_tokens_charged_total", "tier", tier, "dimension", "user", "unit", "tokens")
	refundedS := series("caddy_token_bucket_tokens_refunded_total", "tier", tier, "dimension", "user", "unit", "tokens")
	estimates := int64(0)
	for i := 1; i <= 3; i++ {
		c := runSDK(t, "openai.chat", lg.url, sdkOptions{Headers: map[string]string{"X-User": user}, Params: map[string]any{"max_tokens": 100}})[0]
		a := okCall(t, fmt.Sprintf("request %d", i), c)
		var res struct {
			Object  string
			Choices []struct{ Message struct{ Content string } }
			Usage   struct {
				TotalTokens int64 `json:"total_tokens"`
			}
		}
		if err := json.Unmarshal(c.Result, &res); err != nil || res.Object != "chat.completion" || res.Usage.TotalTokens != used ||
			len(res.Choices) != 1 || res.Choices[0].Message.Content == "" {
			t.Fatalf("request %d: the SDK returned %s (%v)", i, c.Result, err)
		}
		if got := a.Headers["content-encoding"]; got != wantEncoding {
			t.Errorf("request %d: the SDK got Content-Encoding %q, want %q", i, got, wantEncoding)
		}
		seen := lg.up.last(t)
		wantUpstreamBody(t, seen, sentBody(t, a))
		if ae := seen.Header.Get("Accept-Encoding"); !strings.Contains(ae, "gzip") {
			t.Errorf("request %d: the SDK sent Accept-Encoding %q, want gzip among them", i, ae)
		}
		charged := estimatedCost(t, a)
		if i == 1 && chargedFromFull(t, spec, seen, key) != charged {
			t.Errorf("X-Estimated-Cost %d is not what the full bucket was charged (%d)", charged, chargedFromFull(t, spec, seen, key))
		}
		lg.waitMarkers(key, i)
		after := lg.settledExactly(fmt.Sprintf("request %d", i), key, spec, seen, charged, used)
		if got, want := wholeTokens(after), capacity-int64(i)*used; got != want {
			t.Errorf("after request %d: %d whole tokens, want %d: %d × %d used, not the estimate %d", i, got, want, i, used, charged)
		}
		// The handler counts the settlement once Redis has answered it.
		estimates += charged
		var m metricSet
		redistest.WaitFor(t, time.Minute, "the settlement in the metrics", func() error {
			if m = scrape(t); m[chargedS]-m[refundedS] != float64(int64(i)*used) {
				return fmt.Errorf("charged %v, refunded %v", m[chargedS], m[refundedS])
			}
			return nil
		})
		m.want(t, fmt.Sprintf("request %d", i), check{chargedS, float64(estimates)}, check{refundedS, float64(estimates - int64(i)*used)})
	}
}

// TestSDKOpenAIChatGzipSettlesUsage: the openai SDK's JSON chat
// completions, answered gzip-compressed by the provider (the SDK sends
// Accept-Encoding: gzip, deflate): each is charged the 21 tokens reported,
// not the estimate; three requests leave exactly 3 × 21 charged.
func TestSDKOpenAIChatGzipSettlesUsage(t *testing.T) {
	tier := uniqueTier("sdk_gzip")
	lg := sdkGateway(t, settleLimiter(tier), sdkUsage)
	lg.up.SetEncodings("gzip")
	testOpenAIChatSettles(t, lg, tier, "gzip")
}

// TestSDKOpenAIChatIdentitySettlesUsage: the same with a provider that
// does not compress: the plain case the compressed ones must match.
func TestSDKOpenAIChatIdentitySettlesUsage(t *testing.T) {
	tier := uniqueTier("sdk_identity")
	lg := sdkGateway(t, settleLimiter(tier), sdkUsage)
	lg.up.SetEncodings()
	testOpenAIChatSettles(t, lg, tier, "")
}

// TestSDKOpenAIChatEncodeSettlesUsage: the provider does not compress,
// Caddy's encode gzip (which the directive order puts after token_bucket,
// so token_bucket sees what encode writes) compresses the answer: settled
// the same, exactly 3 × 21.
func TestSDKOpenAIChatEncodeSettlesUsage(t *testing.T) {
	tier := uniqueTier("sdk_encode")
	lg := sdkGateway(t, settleLimiter(tier)+"\n\t\tencode gzip", sdkUsage)
	lg.up.SetEncodings()
	lg.up.SetReply(func(*providertest.Request) providertest.Reply {
		u := sdkUsage
		return providertest.Reply{Usage: &u, Text: longAnswer}
	})
	testOpenAIChatSettles(t, lg, tier, "gzip")
}

// chatChunks checks the chunks of a chat completion stream: every chunk
// has one choice and no usage member, except, with includeUsage, a last
// chunk with no choices and the usage; it returns the text.
func chatChunks(t *testing.T, chunks []json.RawMessage, includeUsage bool, wantTotal int64) string {
	t.Helper()
	var text strings.Builder
	for i, raw := range chunks {
		var fields map[string]json.RawMessage
		var ch struct {
			Object  string
			Choices []struct {
				Delta struct{ Content string }
			}
			Usage *struct {
				TotalTokens int64 `json:"total_tokens"`
			}
		}
		if err := json.Unmarshal(raw, &fields); err != nil || json.Unmarshal(raw, &ch) != nil || ch.Object != "chat.completion.chunk" {
			t.Fatalf("chunk %d: %s (%v)", i, raw, err)
		}
		usage, hasUsage := fields["usage"]
		last := i == len(chunks)-1
		switch {
		case !includeUsage && hasUsage:
			t.Errorf("chunk %d has a usage member the client did not ask for: %s", i, raw)
		case !includeUsage && len(ch.Choices) == 0:
			t.Errorf("chunk %d has no choices: a usage chunk the client did not ask for: %s", i, raw)
		case includeUsage && last:
			if len(ch.Choices) != 0 || ch.Usage == nil || ch.Usage.TotalTokens != wantTotal {
				t.Errorf("last chunk %s, want no choices and usage with total_tokens %d", raw, wantTotal)
			}
		case includeUsage && string(usage) != "null":
			t.Errorf("chunk %d: usage %s, want null before the usage chunk", i, usage)
		}
		if len(ch.Choices) == 1 {
			text.WriteString(ch.Choices[0].Delta.Content)
		}
	}
	return text.String()
}

// TestSDKOpenAIStreamIncludeUsage: with settle { include_usage }, a
// stream whose client did not ask for usage is sent upstream with
// "stream_options":{"include_usage":true} inserted after the body's
// opening brace (every other byte the same); the SDK sees no usage chunk
// and no usage member in any chunk; the bucket is settled to the exact
// usage. A client that asked for usage itself gets its body through
// unchanged and the usage chunk as before, with settle { include_usage }
// as with a plain settle.
func TestSDKOpenAIStreamIncludeUsage(t *testing.T) {
	const capacity = 100000
	spec := llmSpec(t, capacity, "1/1h")
	used := sdkUsage.Total(providertest.ChatCompletions)
	includeUsage := "cost estimate\n\t\t\tsettle {\n\t\t\t\tinclude_usage\n\t\t\t}"
	for _, tc := range []struct {
		name, extra string
		params      map[string]any
		clientAsked bool
	}{
		{"client_without_usage", includeUsage, map[string]any{"max_tokens": 100}, false},
		{"client_asks_usage", includeUsage, map[string]any{"max_tokens": 100, "stream_options": map[string]any{"include_usage": true}}, true},
		{"client_asks_usage_plain_settle", "cost estimate\n\t\t\tsettle",
			map[string]any{"max_tokens": 100, "stream_options": map[string]any{"include_usage": true}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg := sdkGateway(t, llmLimiter("user 100000 1/1h tokens", tc.extra), sdkUsage)
			user := "sdk-stream-" + tc.name
			key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
			lg.up.watchKeys(lg.rdb, key)
			c := runSDK(t, "openai.chat.stream", lg.url, sdkOptions{Headers: map[string]string{"X-User": user}, Params: tc.params})[0]
			a := okCall(t, tc.name, c)
			sent := sentBody(t, a)
			seen := lg.up.last(t)
			if !seen.Stream {
				t.Fatalf("the upstream saw no stream request: %s", seen.Body)
			}
			want := sent
			if !tc.clientAsked {
				if !strings.HasPrefix(sent, "{") || strings.Contains(sent, "stream_options") {
					t.Fatalf("the SDK sent %s", sent)
				}
				want = `{"stream_options":{"include_usage":true},` + sent[1:]
			}
			wantUpstreamBody(t, seen, want)
			if !seen.IncludeUsage {
				t.Errorf("the upstream was not asked for usage")
			}
			if text := chatChunks(t, c.Chunks, tc.clientAsked, used); text != providertest.DefaultText {
				t.Errorf("the SDK read %q, want %q", text, providertest.DefaultText)
			}
			lg.waitMarkers(key, 1)
			after := lg.settledExactly("stream", key, spec, seen, chargedFromFull(t, spec, seen, key), used)
			if got := wholeTokens(after); got != capacity-used {
				t.Errorf("%d whole tokens after the settlement, want %d", got, capacity-used)
			}
		})
	}
}

// TestSDKOtherAPIsSettleUsage: the Responses API (JSON, gzip, and
// streamed), embeddings (gzip) through the openai SDK, and Anthropic's
// messages.create (JSON, gzip) and messages.stream with cache tokens, each
// settled to exactly what the provider bills: total_tokens for OpenAI,
// input + cache creation + cache reads + output for Anthropic.
func TestSDKOtherAPIsSettleUsage(t *testing.T) {
	const capacity = 100000
	lg := sdkGateway(t, llmLimiter("user 100000 1/1h tokens", "cost estimate\n\t\t\tsettle"), sdkUsage)
	lg.up.SetEncodings("gzip")
	spec := llmSpec(t, capacity, "1/1h")
	cache := providertest.Usage{Input: 20, CacheCreation: 50, Cached: 100, Output: 30}
	for _, tc := range []struct {
		name, scenario string
		api            providertest.API
		usage          providertest.Usage
		encoding       string // the Content-Encoding the SDK sees
		check          func(t *testing.T, c sdkCall)
	}{
		{"responses", "openai.responses", providertest.Responses, providertest.Usage{Input: 40, Output: 2, Cached: 8, Reasoning: 1}, "gzip",
			func(t *testing.T, c sdkCall) {
				var r struct {
					OutputText string `json:"output_text"`
					Usage      struct {
						TotalTokens int64 `json:"total_tokens"`
					}
				}
				if json.Unmarshal(c.Result, &r) != nil || r.OutputText != providertest.DefaultText || r.Usage.TotalTokens != 42 {
					t.Errorf("the SDK returned %s", c.Result)
				}
			}},
		{"responses_stream", "openai.responses.stream", providertest.Responses, providertest.Usage{Input: 40, Output: 2}, "",
			func(t *testing.T, c sdkCall) {
				var last struct {
					Type     string
					Response struct {
						Usage struct {
							TotalTokens int64 `json:"total_tokens"`
						}
					}
				}
				if len(c.Chunks) == 0 || json.Unmarshal(c.Chunks[len(c.Chunks)-1], &last) != nil ||
					last.Type != "response.completed" || last.Response.Usage.TotalTokens != 42 {
					t.Errorf("the SDK's last event: %s", c.Chunks[len(c.Chunks)-1])
				}
			}},
		// The estimate is the input alone (no completion budget): 8 under
		// approx; the provider's count differs, so there is a settlement.
		{"embeddings", "openai.embeddings", providertest.Embeddings, providertest.Usage{Input: 12}, "gzip",
			func(t *testing.T, c sdkCall) {
				var r struct {
					Data  []struct{ Embedding []float64 }
					Usage struct {
						TotalTokens int64 `json:"total_tokens"`
					}
				}
				if json.Unmarshal(c.Result, &r) != nil || len(r.Data) != 2 || len(r.Data[0].Embedding) != 8 || r.Usage.TotalTokens != 12 {
					t.Errorf("the SDK returned %s", c.Result)
				}
			}},
		{"anthropic_messages", "anthropic.messages", providertest.Messages, cache, "gzip",
			func(t *testing.T, c sdkCall) {
				var m struct {
					Type  string
					Usage anthropicUsageSeen
				}
				if json.Unmarshal(c.Result, &m) != nil || m.Type != "message" || m.Usage != (anthropicUsageSeen{20, 50, 100, 30}) {
					t.Errorf("the SDK returned %s", c.Result)
				}
			}},
		{"anthropic_stream", "anthropic.stream", providertest.Messages, cache, "",
			func(t *testing.T, c sdkCall) {
				var m struct {
					Content []struct{ Text string }
					Usage   anthropicUsageSeen
				}
				if json.Unmarshal(c.Result, &m) != nil || len(m.Content) != 1 || m.Content[0].Text != providertest.DefaultText ||
					m.Usage != (anthropicUsageSeen{20, 50, 100, 30}) {
					t.Errorf("the SDK's final message: %s", c.Result)
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "sdk-" + tc.name
			key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
			lg.up.watchKeys(lg.rdb, key)
			lg.up.SetUsage(tc.usage)
			c := runSDK(t, tc.scenario, lg.url, sdkOptions{Headers: map[string]string{"X-User": user}})[0]
			a := okCall(t, tc.name, c)
			tc.check(t, c)
			if got := a.Headers["content-encoding"]; got != tc.encoding {
				t.Errorf("the SDK got Content-Encoding %q, want %q", got, tc.encoding)
			}
			seen := lg.up.last(t)
			if seen.API != tc.api {
				t.Fatalf("the upstream saw %s %s", seen.Method, seen.Path)
			}
			wantUpstreamBody(t, seen, sentBody(t, a))
			used := tc.usage.Total(tc.api)
			lg.waitMarkers(key, 1)
			after := lg.settledExactly(tc.name, key, spec, seen, chargedFromFull(t, spec, seen, key), used)
			if got := wholeTokens(after); got != capacity-used {
				t.Errorf("%d whole tokens after the settlement, want %d (%d billed)", got, capacity-used, used)
			}
		})
	}
}

// anthropicUsageSeen is the usage of a message as the Anthropic SDK
// returns it.
type anthropicUsageSeen struct {
	InputTokens              int64 `json:"input_tokens"`
	CacheCreationInputTokens int64 `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int64 `json:"cache_read_input_tokens"`
	OutputTokens             int64 `json:"output_tokens"`
}

// keyLimiter is a token_bucket whose one dimension, api_key, is the raw
// value of the request header (the API key), with the tier's limits and
// the extra subdirectives.
func keyLimiter(header, limits, extra string) string {
	return `token_bucket {
			redis redis://REDIS_ADDR {
				timeout 10s
			}
			dimension api_key {http.request.header.` + header + `}
			tier free {
				` + limits + `
			}
			` + extra + `
		}`
}

// jsonString is s as a JSON string.
func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// errorMessage returns the message member of a 429 body of shape
// prefix + <message> + suffix, and checks the shape.
func errorMessage(t *testing.T, body, prefix, suffix string) string {
	t.Helper()
	body = strings.TrimSuffix(body, "\n")
	if !strings.HasPrefix(body, prefix) || !strings.HasSuffix(body, suffix) {
		t.Fatalf("429 body %s\nwant %s<message>%s", body, prefix, suffix)
	}
	var msg string
	if err := json.Unmarshal([]byte(strings.TrimSuffix(strings.TrimPrefix(body, prefix), suffix)), &msg); err != nil || msg == "" {
		t.Fatalf("429 body %s: the message is not a non-empty JSON string (%v)", body, err)
	}
	return msg
}

// TestSDKErrorFormats: with error_format openai, the openai SDK throws
// a RateLimitError with status 429, code rate_limit_exceeded and type
// requests (or tokens, when a tokens limit denies), from the body
// {"error":{"message":…,"type":…,"param":null,"code":"rate_limit_exceeded"}};
// with error_format anthropic, the Anthropic SDK throws a RateLimitError
// whose error.error.type is rate_limit_error, from
// {"type":"error","error":{"type":"rate_limit_error","message":…}}. The
// message never contains the API key.
func TestSDKErrorFormats(t *testing.T) {
	zero := 0
	for _, tc := range []struct {
		name, scenario, limits, extra, wantType string
		params                                  map[string]any
	}{
		{"openai_requests", "openai.chat", "api_key 1 1/1h", "error_format openai", "requests", nil},
		{"openai_tokens", "openai.chat", "api_key 1000 1/1h tokens", "cost estimate\n\t\t\terror_format openai", "tokens",
			map[string]any{"max_tokens": 900}},
		{"anthropic", "anthropic.messages", "api_key 1 1/1h", "error_format anthropic", "rate_limit_error", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Both SDKs send the key as Authorization: Bearer <key>.
			lg := sdkGateway(t, keyLimiter("Authorization", tc.limits, tc.extra), sdkUsage)
			calls := runSDK(t, tc.scenario, lg.url, sdkOptions{APIKey: sdkAPIKey, MaxRetries: &zero, Repeat: 2, Params: tc.params})
			okCall(t, "first call", calls[0])
			wantRateLimitError(t, calls[1], tc.wantType)
			if n := len(lg.up.requests()); n != 1 {
				t.Errorf("the upstream saw %d requests, want the first", n)
			}
		})
	}
}

// sdkAPIKey is the API key of the error tests; no answer may show it.
const sdkAPIKey = "sk-secret-0123456789abcdef"

// wantRateLimitError checks a call that got one 429 and threw: a
// RateLimitError with status 429; for type rate_limit_error the Anthropic
// shape, {"type":"error","error":{"type":"rate_limit_error","message":…}}
// (error.error.type rate_limit_error); for others OpenAI's,
// {"error":{"message":…,"type":<type>,"param":null,"code":"rate_limit_exceeded"}}
// (code, type and param as the SDK's error's). Neither the body nor the
// error's message shows the API key.
func wantRateLimitError(t *testing.T, c sdkCall, wantType string) {
	t.Helper()
	if c.Error == nil || len(c.Attempts) != 1 || c.Attempts[0].Status != http.StatusTooManyRequests || c.Attempts[0].ResponseBody == nil {
		t.Fatalf("error %+v, attempts %+v; want one 429 and a thrown error", c.Error, c.Attempts)
	}
	e, body := c.Error, *c.Attempts[0].ResponseBody
	if e.Status != http.StatusTooManyRequests || !e.IsRateLimitError || e.Class != "RateLimitError" {
		t.Errorf("the SDK threw %s status %d (RateLimitError: %v), want a RateLimitError with status 429", e.Class, e.Status, e.IsRateLimitError)
	}
	if wantType != "rate_limit_error" {
		msg := errorMessage(t, body, `{"error":{"message":`, `,"type":"`+wantType+`","param":null,"code":"rate_limit_exceeded"}}`)
		if string(e.Code) != `"rate_limit_exceeded"` || string(e.Type) != jsonString(wantType) || string(e.Param) != "null" {
			t.Errorf("the SDK's error: code %s, type %s, param %s; want \"rate_limit_exceeded\", %q, null", e.Code, e.Type, e.Param, wantType)
		}
		if want := fmt.Sprintf(`{"message":%s,"type":%s,"param":null,"code":"rate_limit_exceeded"}`, jsonString(msg), jsonString(wantType)); string(e.Error) != want {
			t.Errorf("the SDK's error.error %s, want %s", e.Error, want)
		}
	} else {
		msg := errorMessage(t, body, `{"type":"error","error":{"type":"rate_limit_error","message":`, `}}`)
		var ee struct {
			Type  string
			Error struct{ Type, Message string }
		}
		if err := json.Unmarshal(e.Error, &ee); err != nil || ee.Type != "error" || ee.Error.Type != "rate_limit_error" || ee.Error.Message != msg {
			t.Errorf("the SDK's error.error %s, want type error, error.type rate_limit_error, the body's message", e.Error)
		}
	}
	for _, secret := range []string{sdkAPIKey, "Bearer"} {
		if strings.Contains(body, secret) || strings.Contains(e.Message, secret) {
			t.Errorf("the 429 shows the API key: %s", body)
		}
	}
	if ct := c.Attempts[0].Headers["content-type"]; !strings.HasPrefix(ct, "application/json") {
		t.Errorf("429 Content-Type %q", ct)
	}
}

// TestSDKProviderRateLimitErrors: the providers' own 429s, passed through
// the gateway, read as wantRateLimitError says, in the SDKs as in the
// shapes that error_format must write.
func TestSDKProviderRateLimitErrors(t *testing.T) {
	zero := 0
	for _, tc := range []struct{ name, scenario, wantType string }{
		{"openai_requests", "openai.chat", "requests"},
		{"openai_tokens", "openai.chat", "tokens"},
		{"anthropic", "anthropic.messages", "rate_limit_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg := sdkGateway(t, keyLimiter("X-User", "api_key 100 1/1h", ""), sdkUsage)
			lg.up.SetReply(func(*providertest.Request) providertest.Reply {
				r := providertest.Reply{Status: http.StatusTooManyRequests, ErrorMessage: "Rate limit reached for requests."}
				if tc.wantType == "tokens" {
					r.ErrorType = "tokens"
				}
				return r
			})
			c := runSDK(t, tc.scenario, lg.url, sdkOptions{APIKey: sdkAPIKey, MaxRetries: &zero, Headers: map[string]string{"X-User": "u"}})[0]
			wantRateLimitError(t, c, tc.wantType)
		})
	}
}

// TestSDKRetryHonoursRetryAfter: a requests limit of 1 refilled 1
// every 5 seconds (so that the SDK's second call comes well before the
// refill, even on a loaded machine). The second call gets a 429 with
// retry-after-ms and Retry-After, the SDK waits at least what
// retry-after-ms says and then succeeds: exactly two attempts, the second
// 200.
func TestSDKRetryHonoursRetryAfter(t *testing.T) {
	two := 2
	for _, tc := range []struct{ name, scenario string }{
		{"openai", "openai.chat"},
		{"anthropic", "anthropic.messages"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg := sdkGateway(t, llmLimiter("user 1 1/5s", ""), sdkUsage)
			calls := runSDK(t, tc.scenario, lg.url, sdkOptions{Headers: map[string]string{"X-User": "retry-" + tc.name}, MaxRetries: &two, Repeat: 2})
			okCall(t, "first call", calls[0])
			c := calls[1]
			if c.Error != nil {
				t.Fatalf("second call: the SDK threw %+v\nattempts %+v", *c.Error, c.Attempts)
			}
			if len(c.Attempts) != 2 || c.Attempts[0].Status != http.StatusTooManyRequests || c.Attempts[1].Status != http.StatusOK {
				t.Fatalf("second call: attempts %+v, want a 429 then a 200", c.Attempts)
			}
			denied := c.Attempts[0]
			ms, err := strconv.ParseInt(denied.Headers["retry-after-ms"], 10, 64)
			if err != nil || ms <= 0 || ms > 5000 {
				t.Fatalf("retry-after-ms %q, want 1 to 5000", denied.Headers["retry-after-ms"])
			}
			if want := strconv.FormatInt((ms+999)/1000, 10); denied.Headers["retry-after"] != want {
				t.Errorf("Retry-After %q, want %s (retry-after-ms %d in whole seconds)", denied.Headers["retry-after"], want, ms)
			}
			// The SDK sleeps retry-after-ms with a Node timer, which counts
			// whole milliseconds from the current one: 1 ms of slack.
			gap := c.Attempts[1].Start - denied.End
			if gap < float64(ms)-1 || gap > float64(ms)+10000 {
				t.Errorf("the SDK retried %.1f ms after the 429, want retry-after-ms (%d) to %d", gap, ms, ms+10000)
			}
			if rc := c.Attempts[1].RequestHeaders["x-stainless-retry-count"]; rc != "1" {
				t.Errorf("x-stainless-retry-count %q on the retry, want 1", rc)
			}
			t.Logf("retry-after-ms %d, the SDK waited %.1f ms", ms, gap)
			if n := len(lg.up.requests()); n != 2 {
				t.Errorf("the upstream saw %d requests, want 2", n)
			}
		})
	}
}

// TestSDKCostNeverFitsIsNotRetried: a prompt larger than the tokens
// capacity can never be served: the 429 carries x-should-retry: false
// even without openai_headers, and the SDK (maxRetries 2) makes exactly
// one attempt.
func TestSDKCostNeverFitsIsNotRetried(t *testing.T) {
	lg := sdkGateway(t, llmLimiter("user 100 1/1h tokens", "cost estimate\n\t\t\tsettle"), sdkUsage)
	prompt := strings.Repeat("0123456789", 100) // 1000 characters: 250 tokens
	for _, tc := range []struct {
		name, scenario string
		params         map[string]any
	}{
		{"openai", "openai.chat", map[string]any{"max_tokens": 10, "messages": []any{map[string]any{"role": "user", "content": prompt}}}},
		{"anthropic", "anthropic.messages", map[string]any{"max_tokens": 10, "messages": []any{map[string]any{"role": "user", "content": prompt}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := runSDK(t, tc.scenario, lg.url, sdkOptions{Headers: map[string]string{"X-User": "huge-" + tc.name}, Params: tc.params})[0]
			if c.Error == nil || c.Error.Status != http.StatusTooManyRequests {
				t.Fatalf("the SDK returned %s, error %+v; want a 429 error", c.Result, c.Error)
			}
			if len(c.Attempts) != 1 {
				t.Errorf("%d attempts (statuses %v), want exactly one: the SDK must not retry a cost that can never fit", len(c.Attempts), statuses(c.Attempts))
			}
			if got := c.Attempts[0].Headers["x-should-retry"]; got != "false" {
				t.Errorf("x-should-retry %q, want false", got)
			}
			if body := c.Attempts[0].ResponseBody; body == nil || !strings.Contains(*body, "cost_exceeds_capacity") {
				t.Errorf("429 body %v, want cost_exceeds_capacity", body)
			}
		})
	}
	if n := len(lg.up.requests()); n != 0 {
		t.Errorf("the upstream saw %d requests", n)
	}
}

func statuses(attempts []sdkAttempt) []int {
	var out []int
	for _, a := range attempts {
		out = append(out, a.Status)
	}
	return out
}

// TestSDKSmallTokensLimitAllowsDefaultBudget: a tokens limit of 500 a
// minute, smaller than the default completion budget of 1024: a request
// without max_tokens is allowed (its budget capped to fit), not a
// permanent cost_exceeds_capacity, and settles to the 21 tokens used.
func TestSDKSmallTokensLimitAllowsDefaultBudget(t *testing.T) {
	const capacity = 500
	lg := sdkGateway(t, llmLimiter("user 500 500/1m tokens", "cost estimate {\n\t\t\t\tdefault_max_tokens 1024\n\t\t\t}\n\t\t\tsettle"), sdkUsage)
	spec := llmSpec(t, capacity, "500/1m")
	key := bucket.NewKeyer("rl:", "").Key("user", "small", "tokens")
	lg.up.watchKeys(lg.rdb, key)
	c := runSDK(t, "openai.chat", lg.url, sdkOptions{Headers: map[string]string{"X-User": "small"}})[0]
	if c.Error != nil {
		body := ""
		if len(c.Attempts) > 0 && c.Attempts[0].ResponseBody != nil {
			body = *c.Attempts[0].ResponseBody
		}
		t.Fatalf("the SDK threw %s %d: %s\n%s", c.Error.Class, c.Error.Status, c.Error.Message, body)
	}
	a := okCall(t, "request", c)
	seen := lg.up.last(t)
	if strings.Contains(string(seen.Body), "max_tokens") || strings.Contains(sentBody(t, a), "max_tokens") {
		t.Fatalf("the request set a budget: %s", seen.Body)
	}
	charged := chargedFromFull(t, spec, seen, key)
	if charged <= 0 || charged > capacity {
		t.Errorf("charged %d, want 1 to %d", charged, capacity)
	}
	used := sdkUsage.Total(providertest.ChatCompletions)
	lg.waitMarkers(key, 1)
	after := lg.settledExactly("settlement", key, spec, seen, charged, used)
	if got := wholeTokens(after); got < capacity-used || got >= capacity {
		t.Errorf("%d whole tokens after the settlement, want %d plus the refill since the charge", got, capacity-used)
	}
}

// TestSDKOpenAIChatModelQuotaAndSlot: the openai SDK's chat completions
// (model gpt-4o-mini), answered gzip-compressed, through a tier with a
// tokens limit scoped to that model, a monthly tokens quota and a
// concurrency limit: each request is settled to the 21 tokens reported in
// both the scoped bucket and the quota, and its slot is given back.
func TestSDKOpenAIChatModelQuotaAndSlot(t *testing.T) {
	lg := sdkGateway(t, llmLimiter("user 100000 1/1h tokens models gpt-4o-mini\n\t\t\t\tuser 1000000 per month tokens\n\t\t\t\tuser 2 concurrent",
		"cost estimate\n\t\t\tsettle"), sdkUsage)
	lg.up.SetEncodings("gzip")
	user := "sdk-" + t.Name()
	keyer := bucket.NewKeyer("rl:", "")
	scoped := keyer.Key("user", user, "tokens:m:"+keyer.ID("gpt-4o-mini"))
	quota, slots := keyer.Key("user", user, "tokens:month"), keyer.Key("user", user, "concurrent")
	used := sdkUsage.Total(providertest.ChatCompletions)
	for i := int64(1); i <= 3; i++ {
		c := runSDK(t, "openai.chat", lg.url, sdkOptions{Headers: map[string]string{"X-User": user}, Params: map[string]any{"max_tokens": 100}})[0]
		a := okCall(t, fmt.Sprintf("request %d", i), c)
		if got := a.Headers["content-encoding"]; got != "gzip" {
			t.Errorf("request %d: the SDK got Content-Encoding %q, want gzip", i, got)
		}
		lg.waitMarkers(scoped, int(i))
		st, ok := lg.state(scoped)
		if !ok || wholeTokens(st) != 100000-i*used {
			t.Errorf("after request %d: the gpt-4o-mini bucket holds %+v, want %d whole tokens", i, st, 100000-i*used)
		}
		q, ok := lg.state(quota)
		if !ok || q.Units != i*used {
			t.Errorf("after request %d: the quota has used %+v, want %d", i, q, i*used)
		}
		// The slot is given back after the settlement, both after the response.
		redistest.WaitFor(t, settleTimeout, fmt.Sprintf("the slot of request %d given back", i), func() error {
			if n := lg.rdb.ZCard(context.Background(), slots).Val(); n != 0 {
				return fmt.Errorf("%d concurrency slots held, want 0", n)
			}
			return nil
		})
	}
}

// TestSDKOpenAIModelsList: the OpenAI SDK's models.list (GET /v1/models,
// no body) passes a gateway with cost estimate, charged 1 request and no
// tokens, and returns the upstream's list. It used to throw
// BadRequestError invalid_body.
func TestSDKOpenAIModelsList(t *testing.T) {
	lg := sdkGateway(t, llmLimiter("user 10 1/1h\n\t\t\t\tuser 1000 1/1h tokens", "cost estimate\n\t\t\tsettle"), sdkUsage)
	c := runSDK(t, "openai.models.list", lg.url, sdkOptions{Headers: map[string]string{"X-User": "sdk-models"}})[0]
	a := okCall(t, "models.list", c)
	if a.Method != http.MethodGet || !strings.HasSuffix(a.URL, "/v1/models") {
		t.Errorf("the SDK sent %s %s, want GET …/v1/models", a.Method, a.URL)
	}
	var models []struct{ ID string }
	if err := json.Unmarshal(c.Result, &models); err != nil || len(models) != 2 || models[0].ID != "gpt-4o-mini" {
		t.Errorf("the SDK returned %s (%v), want the upstream's two models", c.Result, err)
	}
	k := bucket.NewKeyer("rl:", "")
	if n := storedTokens(t, lg.rdb, k.Key("user", "sdk-models", "")); n != 9 {
		t.Errorf("requests bucket holds %d, want 9", n)
	}
	if keys := lg.keys(); len(keys) != 1 {
		t.Errorf("Redis holds %q, want the requests bucket alone", keys)
	}
}

// TestSDKFailedCallsGiveTheEstimateBack: the providers bill no call that
// fails, and the SDKs retry 5xx (Anthropic's 529 overloaded_error
// included) twice by default. Each failed attempt is settled at 0 tokens,
// so after the SDK gives up the tokens bucket is full again, not three
// estimates short; a 400 the same, after its one attempt.
func TestSDKFailedCallsGiveTheEstimateBack(t *testing.T) {
	const capacity = 100000
	tier := uniqueTier("sdk_failed")
	lg := sdkGateway(t, settleLimiter(tier), sdkUsage)
	chargedS := series("caddy_token_bucket_tokens_charged_total", "tier", tier, "dimension", "user", "unit", "tokens")
	refundedS := series("caddy_token_bucket_tokens_refunded_total", "tier", tier, "dimension", "user", "unit", "tokens")
	for _, tc := range []struct {
		name, scenario string
		status         int
		attempts       int
		// The error comes in a 200 stream, as its one event: the SDK's
		// error has no status, and it does not retry.
		inStream bool
	}{
		{"openai_500", "openai.chat", http.StatusInternalServerError, 3, false},
		{"anthropic_529", "anthropic.messages", 529, 3, false},
		{"openai_400", "openai.chat", http.StatusBadRequest, 1, false},
		{"anthropic_overloaded_in_stream", "anthropic.stream", 529, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.up.SetReply(func(*providertest.Request) providertest.Reply {
				return providertest.Reply{Status: tc.status, InStream: tc.inStream}
			})
			errStatus, status := tc.status, tc.status
			if tc.inStream {
				errStatus, status = 0, http.StatusOK
			}
			user := "failed-" + tc.name
			key := bucket.NewKeyer("rl:", "").Key("user", user, "tokens")
			before, metricsBefore := len(lg.up.Requests()), scrape(t)
			c := runSDK(t, tc.scenario, lg.url, sdkOptions{Headers: map[string]string{"X-User": user}, Params: map[string]any{"max_tokens": 4096}})[0]
			if c.Error == nil || c.Error.Status != errStatus || len(c.Attempts) != tc.attempts {
				t.Fatalf("the SDK: error %+v, attempts %+v; want %d attempts, then an error with status %d", c.Error, c.Attempts, tc.attempts, errStatus)
			}
			if tc.inStream && !strings.Contains(c.Error.Message, "overloaded_error") {
				t.Errorf("the SDK's error %q does not tell the overload", c.Error.Message)
			}
			estimates := int64(0)
			for i, a := range c.Attempts {
				estimates += estimatedCost(t, a)
				if a.Status != status || estimatedCost(t, a) < 4096 {
					t.Errorf("attempt %d: status %d, estimated cost %s; want %d, charged the 4096-token budget and more", i, a.Status, a.Headers["x-estimated-cost"], status)
				}
			}
			if n := len(lg.up.Requests()) - before; n != tc.attempts {
				t.Errorf("the upstream saw %d requests, want %d", n, tc.attempts)
			}
			lg.waitMarkers(key, tc.attempts)
			// A bucket settled back to full has no key: expiry is a full bucket.
			if st, ok := lg.state(key); ok && wholeTokens(st) != capacity {
				t.Errorf("after %d failed attempts the bucket holds %d whole tokens, want %d: every estimate given back", tc.attempts, wholeTokens(st), capacity)
			}
			// Each estimate charged, and given back once its settlement is
			// counted (after Redis has answered it).
			var m metricSet
			redistest.WaitFor(t, time.Minute, "the refunds in the metrics", func() error {
				if m = scrape(t); m[refundedS]-metricsBefore[refundedS] != float64(estimates) {
					return fmt.Errorf("refunded %v of %d", m[refundedS]-metricsBefore[refundedS], estimates)
				}
				return nil
			})
			if got := m[chargedS] - metricsBefore[chargedS]; got != float64(estimates) {
				t.Errorf("tokens_charged_total grew by %v, want the %d estimated", got, estimates)
			}
		})
	}
}

// TestSDKCountTokensIsFree: Anthropic serves token counting free, with
// rate limits of its own. The SDK's messages.countTokens costs its
// requests limit and 0 tokens, and is not settled (the count is not
// usage): a client that counts before it sends pays for the prompt once.
func TestSDKCountTokensIsFree(t *testing.T) {
	lg := sdkGateway(t, llmLimiter("user 100 1/1h\n\t\t\t\tuser 100000 1/1h tokens", "cost estimate\n\t\t\tsettle"), providertest.Usage{Input: 12000})
	user := "counter"
	keyer := bucket.NewKeyer("rl:", "")
	tokens, requests := keyer.Key("user", user, "tokens"), keyer.Key("user", user, "")
	for i := 1; i <= 3; i++ {
		c := runSDK(t, "anthropic.countTokens", lg.url, sdkOptions{Headers: map[string]string{"X-User": user}})[0]
		a := okCall(t, fmt.Sprintf("count %d", i), c)
		if string(c.Result) != `{"input_tokens":12000}` || estimatedCost(t, a) != 0 {
			t.Fatalf("count %d: the SDK returned %s, estimated cost %d; want the count, and 0", i, c.Result, estimatedCost(t, a))
		}
		if got := storedTokens(t, lg.rdb, requests); got != 100-int64(i) {
			t.Errorf("after count %d the requests bucket holds %d, want %d", i, got, 100-i)
		}
	}
	if seen := lg.up.last(t); seen.Path != "/v1/messages/count_tokens" {
		t.Fatalf("the upstream saw %s", seen.Path)
	}
	if v := lg.value(tokens); v != "" || len(lg.markers(tokens)) != 0 {
		t.Errorf("the tokens bucket was charged or settled: %q, %d markers", v, len(lg.markers(tokens)))
	}
}

// TestSDKEstimateReadsAgentItems: the items an agent loop gives back
// through the SDKs, as their types define them, are charged their text
// before the call: a computer call's batched type action, a program's
// output, a custom tool call's input (its text, not its JSON), a
// reasoning item's content and an MCP approval's reason (Responses), a
// search result's source (Anthropic), each 4000 bytes, 1000 tokens under
// approx.
func TestSDKEstimateReadsAgentItems(t *testing.T) {
	lg := sdkGateway(t, llmLimiter("user 100000 1/1h tokens", "cost estimate\n\t\t\tsettle"), sdkUsage)
	big := strings.Repeat("0123456789", 400)
	for _, tc := range []struct {
		name, scenario string
		params         map[string]any
		cost           int64
		path           string
	}{
		// 85 for the computer call, 5 × 1000, and "apply" (2), + the
		// budget of 16.
		{"responses", "openai.responses", map[string]any{"max_output_tokens": 16, "input": []any{
			map[string]any{"type": "computer_call", "id": "cu_1", "call_id": "c1", "status": "completed", "pending_safety_checks": []any{},
				"actions": []any{map[string]any{"type": "type", "text": big}}},
			map[string]any{"type": "program_output", "id": "po_1", "call_id": "c2", "result": big, "status": "completed"},
			map[string]any{"type": "custom_tool_call", "call_id": "c3", "name": "apply", "input": big},
			map[string]any{"type": "reasoning", "id": "rs_1", "summary": []any{},
				"content": []any{map[string]any{"type": "reasoning_text", "text": big}}},
			map[string]any{"type": "mcp_approval_response", "approval_request_id": "a1", "approve": false, "reason": big},
		}}, 85 + 5*1000 + 2 + 16, "/v1/responses"},
		// The source (1000), title and text (1 + 1), + the budget of 16.
		{"anthropic", "anthropic.messages", map[string]any{"max_tokens": 16, "messages": []any{map[string]any{"role": "user",
			"content": []any{map[string]any{"type": "search_result", "source": big, "title": "t",
				"content": []any{map[string]any{"type": "text", "text": "abcd"}}}}}}},
			1000 + 1 + 1 + 16, "/v1/messages"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			c := runSDK(t, tc.scenario, lg.url, sdkOptions{Headers: map[string]string{"X-User": "items-" + tc.name}, Params: tc.params})[0]
			a := okCall(t, tc.name, c)
			if got := estimatedCost(t, a); got != tc.cost {
				t.Errorf("estimated cost %d, want %d", got, tc.cost)
			}
			seen := lg.up.last(t)
			if seen.Path != tc.path {
				t.Fatalf("the upstream saw %s %s", seen.Method, seen.Path)
			}
			wantUpstreamBody(t, seen, sentBody(t, a))
		})
	}
}

// TestSDKLongCompressedStreamSettles: a client that asks for its own usage
// chunk keeps its Accept-Encoding (the openai SDK sends gzip), so Caddy's
// encode compresses the stream. A stream whose compressed bytes pass
// llm.MaxEncodedBody (here 5000 words of 300 random characters, as
// top_logprobs makes them) is decoded as it passes, and settles to the
// usage it reports: it used to keep the estimate, a fraction of a long
// answer's tokens.
func TestSDKLongCompressedStreamSettles(t *testing.T) {
	const capacity = 1_000_000
	used := providertest.Usage{Input: 12, Output: 120_000}
	lg := sdkGateway(t, llmLimiter("user 1000000 1/1h tokens", "cost estimate\n\t\t\tsettle")+"\n\t\tencode gzip", used)
	rnd := rand.New(rand.NewPCG(7, 8))
	raw := make([]byte, 225)
	var text strings.Builder
	for range 5000 {
		for i := range raw {
			raw[i] = byte(rnd.Uint32())
		}
		text.WriteString(" " + base64.RawURLEncoding.EncodeToString(raw))
	}
	lg.up.SetReply(func(*providertest.Request) providertest.Reply {
		u := used
		return providertest.Reply{Usage: &u, Text: text.String()}
	})
	params := map[string]any{"stream_options": map[string]any{"include_usage": true}}

	// The stream as the gateway sends it, compressed: over the bound.
	r, err := lg.do(context.Background(), http.MethodPost, "/v1/chat/completions",
		`{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`,
		"X-User", "measure", "Accept-Encoding", "gzip")
	if err != nil || r.header.Get("Content-Encoding") != "gzip" || len(r.body) <= llm.MaxEncodedBody {
		t.Fatalf("the stream: %v, Content-Encoding %q, %d bytes; want gzip, over %d", err, r.header.Get("Content-Encoding"), len(r.body), llm.MaxEncodedBody)
	}

	spec := llmSpec(t, capacity, "1/1h")
	key := bucket.NewKeyer("rl:", "").Key("user", "long", "tokens")
	lg.up.watchKeys(lg.rdb, key)
	c := runSDK(t, "openai.chat.stream", lg.url, sdkOptions{Headers: map[string]string{"X-User": "long"}, Params: params})[0]
	a := okCall(t, "the stream", c)
	if got := a.Headers["content-encoding"]; got != "gzip" {
		t.Errorf("the SDK got Content-Encoding %q, want gzip", got)
	}
	if n := len(c.Chunks); n < 5000 {
		t.Errorf("the SDK read %d chunks, want the 5000 words and more", n)
	}
	seen := lg.up.last(t)
	charged := estimatedCost(t, a)
	lg.waitMarkers(key, 1)
	after := lg.settledExactly("the stream", key, spec, seen, charged, used.Total(providertest.ChatCompletions))
	if got, want := wholeTokens(after), capacity-used.Total(providertest.ChatCompletions); got != want {
		t.Errorf("after the stream: %d whole tokens, want %d: the %d used, not the estimate %d", got, want, used.Total(providertest.ChatCompletions), charged)
	}
}

// TestExampleDemoStreamsForTheSDK: each example Caddyfile as it is
// served. The openai SDK's chat stream, which asks for one with "stream":
// true in its body, gets the demo upstream's stream: two content chunks
// and no usage, as it did not ask for usage; the gateway asked for it
// (include_usage), took it out, and settled the request from it. The demo
// used to stream only for Accept: text/event-stream (Caddyfile.example)
// or never (Caddyfile.llm.example), and the SDK read its JSON answer as a
// stream of nothing.
func TestExampleDemoStreamsForTheSDK(t *testing.T) {
	for _, tc := range []struct{ file, apiKey string }{
		{"Caddyfile.example", "sk-standard-demo"},
		{"Caddyfile.llm.example", "sk-pro-demo"},
	} {
		t.Run(tc.file, func(t *testing.T) {
			base, rdb := serveExample(t, tc.file)
			c := runSDK(t, "openai.chat.stream", base, sdkOptions{APIKey: tc.apiKey})[0]
			okCall(t, "the stream", c)
			var text strings.Builder
			for i, raw := range c.Chunks {
				var ch struct {
					Object  string
					Choices []struct{ Delta struct{ Content string } }
					Usage   json.RawMessage
				}
				if err := json.Unmarshal(raw, &ch); err != nil || ch.Object != "chat.completion.chunk" || len(ch.Choices) != 1 || ch.Usage != nil {
					t.Fatalf("chunk %d: %s (%v); want a content chunk without usage", i, raw, err)
				}
				text.WriteString(ch.Choices[0].Delta.Content)
			}
			if len(c.Chunks) != 2 || text.String() != "Hello from the demo upstream." {
				t.Fatalf("%d chunks saying %q, want 2 saying the demo's answer", len(c.Chunks), text.String())
			}
			key := bucket.NewKeyer("rl:", "").Key("api_key", tc.apiKey, "tokens")
			redistest.WaitFor(t, settleTimeout, "the stream's settlement", func() error {
				if n := len(rdb.Keys(context.Background(), key+":settled:*").Val()); n != 1 {
					return fmt.Errorf("%d settlement markers", n)
				}
				return nil
			})
		})
	}
}

// TestSDKCallsWithoutUsage: SDK calls whose answers report no usage
// reach the upstream as sent and are charged their estimate, which stays
// (no settlement). The openai SDK's model calls that send a form:
// videos.create (prompt, 36 bytes: 9 tokens, and default_max_tokens),
// realtime.calls.create with a session (instructions, 18 bytes: 5, and
// the budget) or with the bare SDP offer (the budget alone), and
// realtime.calls.accept with the Realtime API's unlimited budget,
// max_output_tokens "inf" (instructions and default_max_tokens): the
// gateway used to refuse the forms as invalid bodies, and "inf" too.
// Anthropic's beta.agents.create (an agent's definition, runs no model)
// costs 0 and leaves the bucket untouched, where it was charged 1029 for
// good; beta.deployments.run (a POST without a body that starts the
// agent's session at once) is charged default_max_tokens, where it ran
// for nothing. A Message Batch (messages.batches.create, and through
// beta) is charged what its three requests would be alone, where the
// whole batch cost default_max_tokens. A user message sent to an agent
// session (beta.sessions.events.send) is charged its text and
// default_max_tokens, where its text was not read.
func TestSDKCallsWithoutUsage(t *testing.T) {
	const capacity = 100000
	lg := sdkGateway(t, llmLimiter("user 100000 1/1h tokens", "cost estimate\n\t\t\tsettle"), sdkUsage)
	keyer := bucket.NewKeyer("rl:", "")
	for _, tc := range []struct {
		name, scenario string
		params         map[string]any
		api            providertest.API
		status         int
		cost           int64
		result         string
	}{
		{"video", "openai.videos", nil, providertest.Videos, http.StatusOK, 9 + 1024, ""},
		{"realtime_call", "openai.realtime.calls", nil, providertest.RealtimeCalls, http.StatusCreated, 5 + 1024,
			`{"status":201,"location":"/v1/realtime/calls/rtc_test","sdp":"v=0\r\no=- 4611731400430051336 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n"}`},
		{"realtime_call_sdp_only", "openai.realtime.calls", map[string]any{"session": nil}, providertest.RealtimeCalls, http.StatusCreated, 1024, ""},
		{"realtime_accept", "openai.realtime.calls.accept", nil, providertest.RealtimeAccept, http.StatusOK, 5 + 1024, `"accepted"`},
		{"agent_create", "anthropic.agents.create", nil, providertest.Agents, http.StatusOK, 0, ""},
		{"deployment_run", "anthropic.deployments.run", nil, providertest.DeploymentRun, http.StatusOK, 1024, ""},
		// Three requests: 7 + 7 + 10 prompt tokens, 256 + 300 + 500 budget.
		{"message_batch", "anthropic.batches.create", nil, providertest.MessageBatches, http.StatusOK, 24 + 1056, ""},
		{"message_batch_beta", "anthropic.beta.batches.create", nil, providertest.MessageBatches, http.StatusOK, 24 + 1056, ""},
		{"session_events", "anthropic.sessions.events.send", nil, providertest.SessionEvents, http.StatusOK, 7 + 1024, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lg.t = t
			user := "no-usage-" + tc.name
			key := keyer.Key("user", user, "tokens")
			c := runSDK(t, tc.scenario, lg.url, sdkOptions{Headers: map[string]string{"X-User": user}, Params: tc.params})[0]
			if c.Error != nil || len(c.Attempts) != 1 || c.Attempts[0].Status != tc.status {
				t.Fatalf("the SDK threw %+v; attempts %+v; want one answered %d", c.Error, c.Attempts, tc.status)
			}
			if tc.result != "" && string(c.Result) != tc.result {
				t.Errorf("the SDK returned %s, want %s", c.Result, tc.result)
			}
			seen := lg.up.last(t)
			if seen.API != tc.api || (len(seen.Body) == 0) != (tc.api == providertest.DeploymentRun) {
				t.Fatalf("the upstream saw %s %s with %d bytes of body", seen.Method, seen.Path, len(seen.Body))
			}
			if got := estimatedCost(t, c.Attempts[0]); got != tc.cost {
				t.Errorf("X-Estimated-Cost %d, want %d", got, tc.cost)
			}
			if tc.cost > 0 {
				if got := storedTokens(t, lg.rdb, key); got != capacity-tc.cost {
					t.Errorf("the tokens bucket holds %d, want %d", got, capacity-tc.cost)
				}
			} else if n, err := lg.rdb.Exists(context.Background(), key).Result(); err != nil || n != 0 && storedTokens(t, lg.rdb, key) != capacity {
				t.Errorf("the tokens bucket was charged (exists %d, %v)", n, err)
			}
			if n := len(lg.markers(key)); n != 0 {
				t.Errorf("%d settlements of a call whose answer reports no usage", n)
			}
		})
	}
}
