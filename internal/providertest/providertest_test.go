package providertest

import (
	"bufio"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"
)

// client sees answers as they are sent: no transparent decompression.
var client = &http.Client{Transport: &http.Transport{DisableCompression: true}, Timeout: time.Minute}

type answerSeen struct {
	status int
	header http.Header
	raw    []byte // as sent
	body   []byte // decoded
}

// post sends body to path with the headers given as name, value pairs.
func post(t *testing.T, s *Server, path, body string, headers ...string) answerSeen {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, s.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	raw, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	body2, err := Decode(res.Header.Get("Content-Encoding"), raw)
	if err != nil {
		t.Fatalf("decoding %q: %v", res.Header.Get("Content-Encoding"), err)
	}
	return answerSeen{status: res.StatusCode, header: res.Header, raw: raw, body: body2}
}

const chatBody = `{"model":"gpt-test","messages":[{"role":"user","content":"hi"}]}`

func TestCompressesOnlyWhenAsked(t *testing.T) {
	s := Start(t)
	s.SetUsage(Usage{Input: 7, Output: 14})
	want := `"usage":{"prompt_tokens":7,"completion_tokens":14,"total_tokens":21,`
	for _, tc := range []struct {
		name      string
		encodings []string // nil: the default
		accept    string
		coding    string // the Content-Encoding wanted
	}{
		{"default_gzip", nil, "gzip, deflate", "gzip"},
		{"no_accept_encoding", nil, "", ""},
		{"identity_only", nil, "identity", ""},
		{"gzip_refused", nil, "gzip;q=0, deflate;q=0", ""},
		{"star", nil, "*", "gzip"},
		{"star_but_gzip_refused", nil, "gzip;q=0, *;q=0.5", ""},
		{"br_only", nil, "br", ""},
		{"server_prefers_zstd", []string{"zstd", "gzip"}, "gzip, deflate, zstd", "zstd"},
		{"zstd_not_accepted", []string{"zstd", "gzip"}, "gzip, deflate", "gzip"},
		{"deflate", []string{"deflate"}, "gzip, deflate", "deflate"},
		{"never", []string{}, "gzip, deflate, zstd", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.encodings != nil {
				s.SetEncodings(tc.encodings...)
				defer s.SetEncodings("gzip")
			}
			headers := []string{}
			if tc.accept != "" {
				headers = append(headers, "Accept-Encoding", tc.accept)
			}
			a := post(t, s, "/v1/chat/completions", chatBody, headers...)
			if a.status != http.StatusOK {
				t.Fatalf("status %d: %s", a.status, a.body)
			}
			if got := a.header.Get("Content-Encoding"); got != tc.coding {
				t.Errorf("Content-Encoding %q, want %q", got, tc.coding)
			}
			if got := a.header.Values("Vary"); len(got) != 1 || got[0] != "Accept-Encoding" {
				t.Errorf("Vary %q, want Accept-Encoding", got)
			}
			if tc.coding == "" && string(a.raw) != string(a.body) {
				t.Error("an answer without Content-Encoding is not plain")
			}
			if tc.coding != "" && strings.Contains(string(a.raw), `"usage"`) {
				t.Error("a compressed answer reads as plain JSON")
			}
			if !json.Valid(a.body) || !strings.Contains(string(a.body), want) {
				t.Errorf("body %s, want JSON with %s", a.body, want)
			}
			if a.header.Get("Content-Length") != itoa(len(a.raw)) {
				t.Errorf("Content-Length %q, %d bytes sent", a.header.Get("Content-Length"), len(a.raw))
			}
		})
	}
	// Streams are never compressed.
	s.SetEncodings("gzip", "zstd")
	a := post(t, s, "/v1/chat/completions", `{"model":"gpt-test","stream":true}`, "Accept-Encoding", "gzip, zstd")
	if ce := a.header.Get("Content-Encoding"); ce != "" || !strings.HasPrefix(string(a.raw), "data: {") {
		t.Errorf("stream: Content-Encoding %q, starts %.20q", ce, a.raw)
	}
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// events splits a text/event-stream body into its events' data lines.
func dataLines(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, d)
		}
	}
	return out
}

func TestChatStreamUsageChunkOnlyWithIncludeUsage(t *testing.T) {
	s := Start(t)
	s.SetUsage(Usage{Input: 30, Output: 12, Cached: 10, Reasoning: 4})
	for _, tc := range []struct {
		name, body string
		usage      bool
	}{
		{"no_stream_options", `{"model":"gpt-test","stream":true,"messages":[]}`, false},
		{"include_usage_false", `{"model":"gpt-test","stream":true,"stream_options":{"include_usage":false}}`, false},
		{"include_usage", `{"model":"gpt-test","stream":true,"stream_options":{"include_usage":true}}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := post(t, s, "/v1/chat/completions", tc.body)
			if ct := a.header.Get("Content-Type"); a.status != http.StatusOK || ct != "text/event-stream; charset=utf-8" {
				t.Fatalf("%d %q", a.status, ct)
			}
			lines := dataLines(t, a.body)
			// role, "Hello", " there.", finish, [usage], [DONE]
			want := 5
			if tc.usage {
				want = 6
			}
			if len(lines) != want || lines[len(lines)-1] != "[DONE]" {
				t.Fatalf("%d events %q, want %d ending with [DONE]", len(lines), lines, want)
			}
			var content string
			for i, l := range lines[:len(lines)-1] {
				var c struct {
					Object  string
					Choices []struct {
						Delta        struct{ Role, Content string }
						FinishReason *string `json:"finish_reason"`
					}
					Usage json.RawMessage
				}
				var fields map[string]json.RawMessage
				if err := json.Unmarshal([]byte(l), &c); err != nil || json.Unmarshal([]byte(l), &fields) != nil {
					t.Fatalf("chunk %d %q: %v", i, l, err)
				}
				if c.Object != "chat.completion.chunk" {
					t.Errorf("chunk %d object %q", i, c.Object)
				}
				_, hasUsage := fields["usage"]
				last := i == len(lines)-2
				switch {
				case !tc.usage && hasUsage:
					t.Errorf("chunk %d has usage without include_usage: %s", i, l)
				case tc.usage && last:
					if len(c.Choices) != 0 || string(c.Usage) != `{"prompt_tokens":30,"completion_tokens":12,"total_tokens":42,`+
						`"prompt_tokens_details":{"cached_tokens":10,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":4,`+
						`"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}` {
						t.Errorf("usage chunk %s", l)
					}
				case tc.usage && string(c.Usage) != "null":
					t.Errorf("chunk %d: usage %s, want null", i, c.Usage)
				}
				if !(tc.usage && last) {
					if len(c.Choices) != 1 {
						t.Fatalf("chunk %d: %d choices", i, len(c.Choices))
					}
					content += c.Choices[0].Delta.Content
				}
			}
			if content != DefaultText {
				t.Errorf("content %q", content)
			}
			if !strings.Contains(lines[0], `"delta":{"role":"assistant","content":"","refusal":null}`) {
				t.Errorf("first chunk %s", lines[0])
			}
		})
	}
}

func TestResponsesAndEmbeddings(t *testing.T) {
	s := Start(t)
	s.SetEncodings()
	s.SetUsage(Usage{Input: 40, Output: 2, Cached: 8, Reasoning: 1})
	a := post(t, s, "/v1/responses", `{"model":"gpt-test","input":"hi"}`)
	var r struct {
		Object, Status string
		Output         []struct {
			Content []struct{ Type, Text string }
		}
		Usage json.RawMessage
	}
	if err := json.Unmarshal(a.body, &r); err != nil || r.Object != "response" || r.Status != "completed" ||
		len(r.Output) != 1 || r.Output[0].Content[0].Text != DefaultText {
		t.Fatalf("%v %s", err, a.body)
	}
	const usage = `{"input_tokens":40,"input_tokens_details":{"cached_tokens":8},"output_tokens":2,"output_tokens_details":{"reasoning_tokens":1},"total_tokens":42}`
	if string(r.Usage) != usage {
		t.Errorf("usage %s, want %s", r.Usage, usage)
	}

	a = post(t, s, "/v1/responses", `{"model":"gpt-test","input":"hi","stream":true}`)
	var types []string
	var text string
	sc := bufio.NewScanner(strings.NewReader(string(a.body)))
	for sc.Scan() {
		name, ok := strings.CutPrefix(sc.Text(), "event: ")
		if !ok {
			continue
		}
		sc.Scan()
		data, _ := strings.CutPrefix(sc.Text(), "data: ")
		var ev struct {
			Type     string
			Delta    string
			Response struct{ Usage json.RawMessage }
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil || ev.Type != name {
			t.Fatalf("event %s: %q %v", name, data, err)
		}
		types = append(types, name)
		text += ev.Delta
		if name == "response.created" && string(ev.Response.Usage) != "null" {
			t.Errorf("response.created usage %s", ev.Response.Usage)
		}
		if name == "response.completed" && string(ev.Response.Usage) != usage {
			t.Errorf("response.completed usage %s", ev.Response.Usage)
		}
	}
	if want := "response.created response.in_progress response.output_item.added response.content_part.added " +
		"response.output_text.delta response.output_text.delta response.output_text.done response.content_part.done " +
		"response.output_item.done response.completed"; strings.Join(types, " ") != want || text != DefaultText {
		t.Errorf("events %q, text %q", types, text)
	}

	for _, tc := range []struct {
		body string
		n    int
	}{
		{`{"model":"text-embedding-3-small","input":"hello","encoding_format":"base64"}`, 1},
		{`{"model":"text-embedding-3-small","input":["a","b","c"],"encoding_format":"base64"}`, 3},
		{`{"model":"text-embedding-3-small","input":[1,2,3]}`, 1},
	} {
		a = post(t, s, "/v1/embeddings", tc.body)
		var e struct {
			Object string
			Data   []struct {
				Index     int
				Embedding json.RawMessage
			}
			Usage json.RawMessage
		}
		if err := json.Unmarshal(a.body, &e); err != nil || e.Object != "list" || len(e.Data) != tc.n {
			t.Fatalf("%s: %v %s", tc.body, err, a.body)
		}
		if string(e.Usage) != `{"prompt_tokens":40,"total_tokens":40}` {
			t.Errorf("embeddings usage %s", e.Usage)
		}
		var floats []float32
		if strings.Contains(tc.body, "base64") {
			var s string
			json.Unmarshal(e.Data[0].Embedding, &s)
			b, err := base64.StdEncoding.DecodeString(s)
			if err != nil || len(b) != 4*embeddingDims {
				t.Fatalf("base64 embedding %q: %v", s, err)
			}
			for i := 0; i < len(b); i += 4 {
				floats = append(floats, math.Float32frombits(binary.LittleEndian.Uint32(b[i:])))
			}
		} else if err := json.Unmarshal(e.Data[0].Embedding, &floats); err != nil {
			t.Fatal(err)
		}
		if len(floats) != embeddingDims || floats[0] != 0.5 {
			t.Errorf("embedding %v", floats)
		}
	}
}

func TestAnthropicMessages(t *testing.T) {
	s := Start(t)
	s.SetUsage(Usage{Input: 20, Output: 30, Cached: 100, CacheCreation: 50})
	const body = `{"model":"claude-test","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`

	a := post(t, s, "/v1/messages", body, "Accept-Encoding", "gzip")
	const noVersion = `{"type":"error","error":{"type":"invalid_request_error","message":"anthropic-version: header is required"}}`
	if a.status != http.StatusBadRequest || string(a.body) != noVersion || a.header.Get("Content-Encoding") != "gzip" {
		t.Errorf("without anthropic-version: %d %s (%q), want 400 %s", a.status, a.body, a.header.Get("Content-Encoding"), noVersion)
	}

	a = post(t, s, "/v1/messages", body, "Anthropic-Version", "2023-06-01", "Accept-Encoding", "gzip, deflate")
	const usage = `{"input_tokens":20,"cache_creation_input_tokens":50,"cache_read_input_tokens":100,` +
		`"cache_creation":{"ephemeral_5m_input_tokens":50,"ephemeral_1h_input_tokens":0},"output_tokens":30,"service_tier":"standard"}`
	want := `{"id":"msg_test","type":"message","role":"assistant","model":"claude-test",` +
		`"content":[{"type":"text","text":"Hello there."}],"stop_reason":"end_turn","stop_sequence":null,"usage":` + usage + `}`
	if a.status != http.StatusOK || string(a.body) != want || a.header.Get("Content-Encoding") != "gzip" {
		t.Errorf("JSON: %d %q\n%s\nwant\n%s", a.status, a.header.Get("Content-Encoding"), a.body, want)
	}
	if got := (Usage{Input: 20, Output: 30, Cached: 100, CacheCreation: 50}).Total(Messages); got != 200 {
		t.Errorf("Total %d, want 200", got)
	}

	a = post(t, s, "/v1/messages", strings.Replace(body, `"max_tokens"`, `"stream":true,"max_tokens"`, 1),
		"Anthropic-Version", "2023-06-01", "Accept-Encoding", "gzip")
	if a.header.Get("Content-Encoding") != "" {
		t.Errorf("stream compressed")
	}
	wantStream := "event: message_start\n" +
		`data: {"type":"message_start","message":{"id":"msg_test","type":"message","role":"assistant","model":"claude-test",` +
		`"content":[],"stop_reason":null,"stop_sequence":null,"usage":` + strings.Replace(usage, `"output_tokens":30`, `"output_tokens":1`, 1) + "}}\n\n" +
		"event: content_block_start\n" + `data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}` + "\n\n" +
		"event: ping\n" + `data: {"type": "ping"}` + "\n\n" +
		"event: content_block_delta\n" + `data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}` + "\n\n" +
		"event: content_block_delta\n" + `data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" there."}}` + "\n\n" +
		"event: content_block_stop\n" + `data: {"type":"content_block_stop","index":0}` + "\n\n" +
		"event: message_delta\n" + `data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":30}}` + "\n\n" +
		"event: message_stop\n" + `data: {"type":"message_stop"}` + "\n\n"
	if string(a.body) != wantStream {
		t.Errorf("stream\n%s\nwant\n%s", a.body, wantStream)
	}
}

func TestRecordsRequestsAndHook(t *testing.T) {
	s := Start(t)
	s.SetHook(func(r *Request) error {
		r.Notes = map[string]string{"seen-by-hook": r.Header.Get("X-Mark")}
		return nil
	})
	body := "{ \"model\" : \"gpt-test\",\n\"stream_options\":{\"include_usage\":true}, \"stream\":true }"
	post(t, s, "/v1/chat/completions", body, "X-Mark", "one")
	a := post(t, s, "/v1/chat/completions", "not json", "X-Mark", "two")
	if a.status != http.StatusBadRequest || !strings.Contains(string(a.body), `"type":"invalid_request_error"`) {
		t.Errorf("invalid JSON: %d %s", a.status, a.body)
	}
	s.AcceptInvalidJSON()
	if a := post(t, s, "/v1/chat/completions", "not json"); a.status != http.StatusOK {
		t.Errorf("invalid JSON accepted: %d %s", a.status, a.body)
	}
	seen := s.Requests()
	if len(seen) != 3 {
		t.Fatalf("%d requests", len(seen))
	}
	r := seen[0]
	if r.Seq != 1 || r.Method != "POST" || r.Path != "/v1/chat/completions" || string(r.Body) != body || r.API != ChatCompletions ||
		r.Model != "gpt-test" || !r.Stream || !r.IncludeUsage || r.Header.Get("X-Mark") != "one" || r.Notes["seen-by-hook"] != "one" {
		t.Errorf("recorded %+v", r)
	}
	if s.Last(t).Seq != 3 || seen[1].Notes["seen-by-hook"] != "two" || seen[1].ValidJSON {
		t.Errorf("recorded %+v", seen[1:])
	}
}

func TestErrorReplies(t *testing.T) {
	s := Start(t)
	s.SetEncodings()
	s.SetReply(func(r *Request) Reply {
		return Reply{Status: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"3"}}}
	})
	a := post(t, s, "/v1/chat/completions", chatBody)
	if want := `{"error":{"message":"Too Many Requests","type":"requests","param":null,"code":"rate_limit_exceeded"}}`; a.status != 429 ||
		string(a.body) != want || a.header.Get("Retry-After") != "3" {
		t.Errorf("OpenAI 429: %d %s %v", a.status, a.body, a.header)
	}
	a = post(t, s, "/v1/messages", `{}`, "Anthropic-Version", "2023-06-01")
	if want := `{"type":"error","error":{"type":"rate_limit_error","message":"Too Many Requests"}}`; a.status != 429 || string(a.body) != want {
		t.Errorf("Anthropic 429: %d %s", a.status, a.body)
	}
	a = post(t, s, "/v1/nothing", `{}`)
	if want := `{"error":{"message":"Invalid URL (POST /v1/nothing)","type":"invalid_request_error","param":null,"code":null}}`; a.status != 404 ||
		string(a.body) != want {
		t.Errorf("unknown path: %d %s", a.status, a.body)
	}
}

// stream opens a streaming request and returns its reader.
func stream(t *testing.T, s *Server, path, body string, headers ...string) *bufio.Reader {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, s.URL+path, strings.NewReader(body))
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Body.Close() })
	return bufio.NewReader(res.Body)
}

func TestAbortAfterUsage(t *testing.T) {
	s := Start(t)
	s.SetReply(func(r *Request) Reply { return Reply{Usage: &Usage{Input: 5, Output: 6}, AbortAfterUsage: true} })
	for _, tc := range []struct {
		path, body, last string
		headers          []string
	}{
		{"/v1/chat/completions", `{"stream":true,"stream_options":{"include_usage":true}}`, `"choices":[],"usage":{"prompt_tokens":5`, nil},
		{"/v1/messages", `{"stream":true}`, `"type":"message_delta"`, []string{"Anthropic-Version", "2023-06-01"}},
		{"/v1/responses", `{"stream":true}`, `"type":"response.completed"`, nil},
	} {
		b, err := io.ReadAll(stream(t, s, tc.path, tc.body, tc.headers...))
		if !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("%s: read error %v, want an unexpected EOF", tc.path, err)
		}
		lines := dataLines(t, b)
		if len(lines) == 0 || !strings.Contains(lines[len(lines)-1], tc.last) {
			t.Errorf("%s: last event %q, want the usage event", tc.path, lines)
		}
	}
}

func TestHoldAndRelease(t *testing.T) {
	s := Start(t)
	s.Hold()
	br := stream(t, s, "/v1/chat/completions", `{"stream":true}`)
	first, err := br.ReadString('\n')
	if err != nil || !strings.Contains(first, `"role":"assistant"`) {
		t.Fatalf("first event %q %v", first, err)
	}
	// The first event arrived while the rest waits for Release.
	s.Release()
	rest, err := io.ReadAll(br)
	if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Errorf("rest %q %v", rest, err)
	}
}
