package tokenbucket

import (
	"bytes"
	"context"
	"fmt"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// recorded passes chunks through a recorder as reverse_proxy would write
// them, with the response's Content-Type and extra headers (name, value
// pairs).
func recorded(contentType string, chunks []string, headers ...string) *recorder {
	rec := &recorder{ResponseWriter: httptest.NewRecorder(), tailCap: DefaultSettleTail}
	rec.Header().Set("Content-Type", contentType)
	for i := 0; i+1 < len(headers); i += 2 {
		rec.Header().Set(headers[i], headers[i+1])
	}
	for _, c := range chunks {
		rec.Write([]byte(c))
	}
	return rec
}

// sseOpenAI is an OpenAI chat stream of n content chunks padded with pad
// bytes each, ending with a usage chunk when usage is not "".
func sseOpenAI(n, pad int, usage string) []string {
	var out []string
	for i := 0; i < n; i++ {
		out = append(out, `data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"`+
			strings.Repeat("x", pad)+`"},"finish_reason":null}],"usage":null}`+"\n\n")
	}
	if usage != "" {
		out = append(out, `data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":`+usage+"}\n\n")
	}
	return append(out, "data: [DONE]\n\n")
}

// TestSettleUsageParsing: where a response reports its usage, and what
// counts: total_tokens, else prompt + completion (OpenAI), else input +
// output (Anthropic); in a JSON body, in the events of a stream, or in a
// header; anything unreadable settles at the estimate (ok false).
func TestSettleUsageParsing(t *testing.T) {
	const sse = "text/event-stream"
	anthropic := anthropicStream(120, 200)
	for _, tc := range []struct {
		name        string
		settle      Settle
		contentType string
		chunks      []string
		headers     []string
		want        int64 // -1: no usage
	}{
		{"openai_json", Settle{}, "application/json", []string{openAIJSON(100, 220, true)}, nil, 320},
		{"openai_json_in_pieces", Settle{}, "application/json; charset=utf-8",
			splitEvery(openAIJSON(100, 220, true), 7), nil, 320},
		{"total_tokens_wins", Settle{}, "application/json",
			[]string{`{"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":50}}`}, nil, 50},
		{"prompt_plus_completion", Settle{}, "application/json",
			[]string{`{"usage":{"prompt_tokens":10,"completion_tokens":20}}`}, nil, 30},
		{"responses_api_json", Settle{}, "application/json",
			[]string{`{"object":"response","usage":{"input_tokens":10,"output_tokens":20,"total_tokens":30}}`}, nil, 30},
		{"anthropic_json", Settle{}, "application/json", []string{anthropicJSON(120, 200, true)}, nil, 320},
		{"json_without_usage", Settle{}, "application/json", []string{openAIJSON(0, 0, false)}, nil, -1},
		{"json_usage_null", Settle{}, "application/json", []string{`{"id":"x","usage":null}`}, nil, -1},
		{"error_body", Settle{}, "application/json",
			[]string{`{"error":{"message":"overloaded","type":"server_error"}}`}, nil, -1},
		{"not_json", Settle{}, "text/plain", []string{"upstream said no"}, nil, -1},
		{"empty", Settle{}, "application/json", nil, nil, -1},

		{"openai_stream", Settle{}, sse, openAIStream(100, 220, true), nil, 320},
		{"openai_stream_crlf", Settle{}, sse, crlf(openAIStream(100, 220, true)), nil, 320},
		{"openai_stream_no_usage", Settle{}, sse, openAIStream(100, 220, false), nil, -1},
		{"anthropic_stream", Settle{}, sse, anthropic, nil, 320},
		// Anthropic streams that report the input again in message_delta.
		{"anthropic_stream_cumulative", Settle{}, sse, append(anthropic[:6:6],
			"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},"+
				"\"usage\":{\"input_tokens\":120,\"output_tokens\":200}}\n\n"), nil, 320},
		{"anthropic_stream_in_bytes", Settle{}, sse, splitEvery(strings.Join(anthropic, ""), 1), nil, 320},
		{"stream_without_data", Settle{}, sse, []string{": keep-alive\n\n"}, nil, -1},
		// Responses API: the usage is in response.completed's response.
		{"responses_stream", Settle{}, sse, []string{
			"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null}}\n\n",
			"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n",
			"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"status\":\"completed\"," +
				"\"usage\":{\"input_tokens\":100,\"output_tokens\":220,\"total_tokens\":320}}}\n\n",
		}, nil, 320},

		{"header", Settle{Header: "X-Tokens-Used"}, "application/json",
			[]string{openAIJSON(1, 1, true)}, []string{"X-Tokens-Used", "320"}, 320},
		{"header_zero", Settle{Header: "X-Tokens-Used"}, "application/json", nil, []string{"X-Tokens-Used", "0"}, 0},
		{"header_spaces", Settle{Header: "X-Tokens-Used"}, "application/json", nil, []string{"X-Tokens-Used", " 42 "}, 42},
		{"header_missing_body_ignored", Settle{Header: "X-Tokens-Used"}, "application/json",
			[]string{openAIJSON(100, 220, true)}, nil, -1},
		{"header_negative", Settle{Header: "X-Tokens-Used"}, "application/json", nil, []string{"X-Tokens-Used", "-3"}, -1},
		{"header_not_a_number", Settle{Header: "X-Tokens-Used"}, "application/json", nil, []string{"X-Tokens-Used", "3.5"}, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := tc.settle.used(recorded(tc.contentType, tc.chunks, tc.headers...))
			if tc.want < 0 && ok {
				t.Errorf("used = %d, true; want no usage", got)
			}
			if tc.want >= 0 && (!ok || got != tc.want) {
				t.Errorf("used = %d, %v; want %d", got, ok, tc.want)
			}
		})
	}
}

func splitEvery(s string, n int) []string {
	var out []string
	for len(s) > n {
		out, s = append(out, s[:n]), s[n:]
	}
	return append(out, s)
}

func crlf(events []string) []string {
	out := make([]string, len(events))
	for i, e := range events {
		out[i] = strings.ReplaceAll(e, "\n", "\r\n")
	}
	return out
}

// TestSettleUsageAtEveryOffset: the usage event is found wherever it falls
// against the 8 KiB head the recorder keeps, including across its end.
// The usage line of an OpenAI stream that straddled byte 8192 used to be
// cut in two and lost, settling such responses at the estimate.
func TestSettleUsageAtEveryOffset(t *testing.T) {
	usage := `{"prompt_tokens":100,"completion_tokens":220,"total_tokens":320}`
	tail := sseOpenAI(0, 0, usage)
	usageLen := len(tail[0])
	for _, contentType := range []string{"text/event-stream", "application/json"} {
		// The usage line (or object) starts from 100 bytes before the head's
		// end to after it.
		for start := DefaultSettleHead - usageLen - 100; start <= DefaultSettleHead+10; start++ {
			var chunks []string
			if contentType == "application/json" {
				pad := start - len(`{"choices":[{"text":"`) - len(`"}],"usage":`)
				chunks = []string{`{"choices":[{"text":"` + strings.Repeat("x", pad) + `"}],"usage":` + usage + `}`}
			} else {
				pad := `data: {"choices":[{"delta":{"content":"`
				n := start - len(pad) - len(`"}}]}`+"\n\n")
				chunks = append([]string{pad + strings.Repeat("x", n) + `"}}]}` + "\n\n"}, tail...)
			}
			if got, ok := (&Settle{}).used(recorded(contentType, chunks)); !ok || got != 320 {
				t.Fatalf("%s, usage from byte %d: used = %d, %v; want 320", contentType, start, got, ok)
			}
		}
	}
}

// TestSettleLongResponses: responses longer than the head and tail the
// recorder keeps (8 KiB + 64 KiB) still settle from their end: an OpenAI
// stream of 300 KB, a JSON body of 300 KB, and an Anthropic stream whose
// input tokens are in the head and output tokens in the tail.
func TestSettleLongResponses(t *testing.T) {
	usage := `{"prompt_tokens":100,"completion_tokens":220,"total_tokens":320}`
	long := sseOpenAI(3000, 80, usage)
	anthropic := anthropicStream(120, 200)
	middle := slices.Repeat([]string{`event: content_block_delta` + "\n" +
		`data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"` + strings.Repeat("y", 100) + `"}}` + "\n\n"}, 3000)
	for _, tc := range []struct {
		name, contentType string
		chunks            []string
	}{
		{"openai_stream", "text/event-stream", long},
		{"json", "application/json", []string{`{"choices":[{"message":{"content":"` + strings.Repeat("z", 300000) + `"}}],"usage":` + usage + `}`}},
		{"anthropic_stream", "text/event-stream", slices.Concat(anthropic[:3], middle, anthropic[3:])},
	} {
		rec := recorded(tc.contentType, tc.chunks)
		if got, ok := (&Settle{}).used(rec); !ok || got != 320 {
			t.Errorf("%s: used = %d, %v; want 320", tc.name, got, ok)
		}
		if !rec.truncated || len(rec.head) != DefaultSettleHead || len(rec.tail) != DefaultSettleTail {
			t.Errorf("%s: head %d, tail %d, truncated %v: want a response longer than both", tc.name, len(rec.head), len(rec.tail), rec.truncated)
		}
	}
}

// TestSettleRecorderKeepsHeadAndTail: whatever the sizes of the writes, the
// recorder passes every byte through and keeps exactly the first 8 KiB and
// the last 64 KiB after them for parsing.
func TestSettleRecorderKeepsHeadAndTail(t *testing.T) {
	body := make([]byte, 500_000)
	for i := range body {
		body[i] = byte('a' + i*7%26)
	}
	for _, size := range []int{1, 7, 150, 4096, 8192, 70_000, 200_000, len(body)} {
		w := httptest.NewRecorder()
		rec := &recorder{ResponseWriter: w, tailCap: DefaultSettleTail}
		for _, c := range splitEvery(string(body), size) {
			if n, err := rec.Write([]byte(c)); n != len(c) || err != nil {
				t.Fatalf("write %d: %d, %v", len(c), n, err)
			}
		}
		(&Settle{}).used(rec)
		if !bytes.Equal(w.Body.Bytes(), body) {
			t.Fatalf("writes of %d: the response did not pass through whole", size)
		}
		if !bytes.Equal(rec.head, body[:DefaultSettleHead]) || !bytes.Equal(rec.tail, body[len(body)-DefaultSettleTail:]) || !rec.truncated {
			t.Errorf("writes of %d: head %d bytes, tail %d bytes, truncated %v; want the first 8 KiB and the last 64 KiB",
				size, len(rec.head), len(rec.tail), rec.truncated)
		}
	}
}

// TestSettleHasUsageObject: the filter that spares the JSON parse of
// stream lines whose usage is null (every OpenAI chunk but the last).
func TestSettleHasUsageObject(t *testing.T) {
	for in, want := range map[string]bool{
		`{"choices":[],"usage":{"total_tokens":3}}`:             true,
		`{"usage" : {"total_tokens":3}}`:                        true,
		`{"type":"message_start","message":{"usage":{}}}`:       true,
		`{"usage":null,"response":{"usage":{"x":1}}}`:           true,
		`{"choices":[{"delta":{"content":"hi"}}],"usage":null}`: false,
		`{"delta":{"text":"the \"usage\": {} of it"}}`:          false,
		`{"type":"ping"}`: false,
		`"usage"`:         false,
	} {
		if got := hasUsageObject([]byte(in)); got != want {
			t.Errorf("hasUsageObject(%s) = %v, want %v", in, got, want)
		}
	}
}

// ---------------------------------------------------------------------------
// Benchmarks.

// BenchmarkSettleParse: what settlement costs a response in-process: the
// recorder keeping head and tail while the response passes, then the usage
// parse. A typical JSON chat completion (one write), 40-event streams, and
// a 1000-event OpenAI stream.
func BenchmarkSettleParse(b *testing.B) {
	for _, bc := range []struct {
		name, contentType string
		chunks            []string
	}{
		{"json", "application/json", []string{openAIJSON(100, 220, true)}},
		{"sse_openai", "text/event-stream", sseOpenAI(40, 8, `{"prompt_tokens":100,"completion_tokens":220,"total_tokens":320}`)},
		// A long answer: 1000 chunks, about 150 KB, of which the recorder
		// keeps 8 KiB + 64 KiB.
		{"sse_openai_1000", "text/event-stream", sseOpenAI(1000, 8, `{"prompt_tokens":100,"completion_tokens":220,"total_tokens":320}`)},
		{"sse_anthropic", "text/event-stream", slices.Concat(anthropicStream(120, 200)[:4],
			slices.Repeat([]string{`event: content_block_delta` + "\n" +
				`data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"xxxxxxxx"}}` + "\n\n"}, 36),
			anthropicStream(120, 200)[4:])},
	} {
		chunks := make([][]byte, len(bc.chunks))
		size := 0
		for i, c := range bc.chunks {
			chunks[i] = []byte(c)
			size += len(c)
		}
		w := httptest.NewRecorder()
		w.Header().Set("Content-Type", bc.contentType)
		s := &Settle{}
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(size))
			for b.Loop() {
				w.Body.Reset()
				rec := &recorder{ResponseWriter: w, tailCap: DefaultSettleTail}
				for _, c := range chunks {
					rec.Write(c)
				}
				if n, ok := s.used(rec); !ok || n != 320 {
					b.Fatalf("used = %d, %v", n, ok)
				}
			}
		})
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
