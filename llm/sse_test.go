package llm

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

// TestSSEFraming: the reader parses event streams as the HTML standard
// does, however the stream is split into writes.
func TestSSEFraming(t *testing.T) {
	u5 := Usage{InputTokens: 5}
	for _, tc := range []usageCase{
		{"lf", sse, "data: {\"usage\":{\"prompt_tokens\":5}}\n\n", u5, Found, 5},
		{"crlf", sse, "data: {\"usage\":{\"prompt_tokens\":5}}\r\n\r\n", u5, Found, 5},
		{"cr", sse, "data: {\"usage\":{\"prompt_tokens\":5}}\r\r", u5, Found, 5},
		{"no_space", sse, "data:{\"usage\":{\"prompt_tokens\":5}}\n\n", u5, Found, 5},
		{"two_spaces", sse, "data:  {\"usage\":{\"prompt_tokens\":5}}\n\n", u5, Found, 5},
		{"multi_line", sse, "data: {\"usage\":\ndata: {\"prompt_tokens\":\ndata:5}}\n\n", u5, Found, 5},
		{"multi_line_crlf_cr", sse, "data: {\"usage\":\r\ndata: {\"prompt_tokens\":\rdata:5}}\r\n\n", u5, Found, 5},
		// A line "data" alone adds an empty line (whitespace to JSON).
		{"data_without_colon", sse, "data: {\"usage\":\ndata\ndata: {\"prompt_tokens\":5}}\n\n", u5, Found, 5},
		{"comments_and_fields", sse, ": ping\nevent: x\nid: 7\nretry: 10\ndata: {\"usage\":\n: comment\ndata: {\"prompt_tokens\":5}}\n\n",
			u5, Found, 5},
		{"bom", sse, "\xef\xbb\xbfdata: {\"usage\":{\"prompt_tokens\":5}}\n\n", u5, Found, 5},
		// A partial mark is a field name that is not "data": the line is skipped.
		{"partial_bom", sse, "\xef\xbbdata: {\"usage\":{\"prompt_tokens\":5}}\n\n", Usage{}, NotReported, 0},
		{"other_field_names", sse, "Data: {\"usage\":{\"prompt_tokens\":5}}\ndatum: {\"usage\":{\"prompt_tokens\":5}}\n" +
			"database: {\"usage\":{\"prompt_tokens\":5}}\ndat: {\"usage\":{\"prompt_tokens\":5}}\n\n", Usage{}, NotReported, 0},
		// A blank line ends an event: the halves are two invalid events.
		{"blank_line_splits", sse, "data: {\"usage\":\n\ndata: {\"prompt_tokens\":5}}\n\n", Usage{}, NotReported, 0},
		{"blank_line_splits_cr_lf", sse, "data: {\"usage\":\r\rdata: {\"prompt_tokens\":5}}\n\n", Usage{}, NotReported, 0},
		{"done", sse, "data: [DONE]\n\n", Usage{}, NotReported, 0},
		{"not_json", sse, "data: usage: {\"prompt_tokens\":5}\n\n", Usage{}, NotReported, 0},
		// Cut before the blank line: the usage object is whole, so it counts.
		{"no_blank_line", sse, "data: {\"usage\":{\"prompt_tokens\":5}}", u5, Found, 5},
		{"latest_per_field", sse, "data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n" +
			"data: {\"usage\":{\"completion_tokens\":9}}\n\n", Usage{InputTokens: 5, OutputTokens: 9}, Found, 14},
		// message.usage and response.usage are read in events only.
		{"json_message_usage_ignored", "application/json", `{"message":{"usage":{"prompt_tokens":5}}}`, Usage{}, NotReported, 0},
		{"sse_message_not_object", sse, "data: {\"message\":[{\"usage\":{\"prompt_tokens\":5}}]}\n\n", Usage{}, NotReported, 0},
		{"sse_response_deeper_ignored", sse, "data: {\"response\":{\"x\":{\"usage\":{\"prompt_tokens\":5}}}}\n\n", Usage{}, NotReported, 0},
	} {
		t.Run(tc.name, func(t *testing.T) { checkSplits(t, tc) })
	}
}

// gatewayStream is the stream OpenAI sends when the gateway added
// include_usage; clientStream is what the client asked for.
var (
	gatewayStream = openAIChatStream(true)
	clientStream  = openAIChatStream(false)
)

// filtered writes chunks through a filter and returns what came out, and
// checks that each Write passed on every event its bytes completed.
func filtered(t *testing.T, chunks ...string) string {
	t.Helper()
	var out bytes.Buffer
	f := NewUsageChunkFilter(&out)
	for _, c := range chunks {
		before := out.Len()
		writes := countingWriter{w: &out}
		f.w = &writes
		if n, err := f.Write([]byte(c)); n != len(c) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
		if writes.n > 1 {
			t.Fatalf("one Write made %d writes", writes.n)
		}
		_ = before
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

type countingWriter struct {
	w interface{ Write([]byte) (int, error) }
	n int
}

func (c *countingWriter) Write(p []byte) (int, error) { c.n++; return c.w.Write(p) }

// checkFilter filters in whole, in two writes split at every offset, in
// three writes, and byte by byte.
func checkFilter(t *testing.T, in, want string) {
	t.Helper()
	if got := filtered(t, in); got != want {
		t.Fatalf("whole:\n got %q\nwant %q", got, want)
	}
	for i := range len(in) + 1 {
		if got := filtered(t, in[:i], in[i:]); got != want {
			t.Fatalf("split at %d:\n got %q\nwant %q", i, got, want)
		}
	}
	for i := 0; i <= len(in); i += max(7, len(in)/40) {
		for j := i; j <= len(in); j += max(13, len(in)/30) {
			if got := filtered(t, in[:i], in[i:j], in[j:]); got != want {
				t.Fatalf("split at %d and %d:\n got %q\nwant %q", i, j, got, want)
			}
		}
	}
	var bytewise []string
	for i := range len(in) {
		bytewise = append(bytewise, in[i:i+1])
	}
	if got := filtered(t, bytewise...); got != want {
		t.Fatalf("byte by byte:\n got %q\nwant %q", got, want)
	}
}

func TestUsageChunkFilter(t *testing.T) {
	anthropic := anthropicMessagesStream(`{"output_tokens":15}`)
	responses := responsesStream("response.completed")
	for _, tc := range []struct{ name, in, want string }{
		{"openai", gatewayStream, clientStream},
		{"openai_crlf", strings.ReplaceAll(gatewayStream, "\n", "\r\n"), strings.ReplaceAll(clientStream, "\n", "\r\n")},
		{"openai_cr", strings.ReplaceAll(gatewayStream, "\n", "\r"), strings.ReplaceAll(clientStream, "\n", "\r")},
		{"openai_without_usage", clientStream, clientStream},
		{"anthropic", anthropic, anthropic},
		{"anthropic_crlf", strings.ReplaceAll(anthropic, "\n", "\r\n"), strings.ReplaceAll(anthropic, "\n", "\r\n")},
		{"responses", responses, responses},
		{"done", "data: [DONE]\n\n", "data: [DONE]\n\n"},
		{"bom", "\xef\xbb\xbf" + gatewayStream, "\xef\xbb\xbf" + clientStream},
		// A stream cut right after its usage chunk, before the blank line.
		{"cut_after_usage", "data: {\"choices\":[],\"usage\":{\"total_tokens\":3}}\n", ""},
		{"cut_after_null", "data: {\"id\":1,\"usage\":null}", "data: {\"id\":1}"},
		{"comments_kept", ": keep-alive\n\n" + gatewayStream, ": keep-alive\n\n" + clientStream},
		{"blank_lines_kept", "\n\n" + gatewayStream + "\n", "\n\n" + clientStream + "\n"},
		{"usage_first", "data: {\"usage\":null,\"id\":\"x\"}\n\n", "data: {\"id\":\"x\"}\n\n"},
		{"usage_only_member", "data: {\"usage\":null}\n\n", "data: {}\n\n"},
		{"usage_spaces", "data: { \"id\" : 1 , \"usage\" : null }\n\n", "data: { \"id\" : 1 }\n\n"},
		{"usage_first_spaces", "data: { \"usage\" : null , \"id\" : 1 }\n\n", "data: { \"id\" : 1 }\n\n"},
		{"usage_escaped_name", "data: {\"id\":1,\"us\\u0061ge\":null}\n\n", "data: {\"id\":1}\n\n"},
		{"no_space_after_colon", "data:{\"id\":1,\"usage\":null}\n\n", "data:{\"id\":1}\n\n"},
		{"nested_usage_null_kept", "data: {\"choices\":[{\"usage\":null}]}\n\n", "data: {\"choices\":[{\"usage\":null}]}\n\n"},
		{"empty_choices_null_usage", "data: {\"choices\":[],\"usage\":null}\n\n", "data: {\"choices\":[]}\n\n"},
		{"choices_and_usage_kept", "data: {\"choices\":[{}],\"usage\":{\"total_tokens\":3}}\n\n",
			"data: {\"choices\":[{}],\"usage\":{\"total_tokens\":3}}\n\n"},
		{"usage_without_choices_kept", "data: {\"usage\":{\"total_tokens\":3}}\n\n", "data: {\"usage\":{\"total_tokens\":3}}\n\n"},
		{"usage_chunk_with_fields", "id: 9\nevent: chunk\n: note\ndata: {\"choices\":[ ],\"usage\":{\"total_tokens\":3}}\n\ndata: [DONE]\n\n",
			"data: [DONE]\n\n"},
		{"usage_chunk_multi_line", "data: {\"choices\":[],\ndata: \"usage\":{\"total_tokens\":3}}\n\ndata: [DONE]\n\n", "data: [DONE]\n\n"},
		{"multi_line_null_kept", "data: {\"id\":1,\ndata: \"usage\":null}\n\n", "data: {\"id\":1,\ndata: \"usage\":null}\n\n"},
		{"not_json_kept", "data: {\"usage\":null\n\n", "data: {\"usage\":null\n\n"},
		{"trailing_garbage_kept", "data: {\"usage\":null} x\n\n", "data: {\"usage\":null} x\n\n"},
		{"duplicate_kept", "data: {\"usage\":null,\"usage\":null}\n\n", "data: {\"usage\":null,\"usage\":null}\n\n"},
		{"no_blank_line_at_end", "data: {\"usage\":null}\n\ndata: {\"usage\":null}", "data: {}\n\ndata: {}"},
		{"usage_chunk_cr_then_lf_apart", "data: {\"choices\":[],\"usage\":{}}\r\r\ndata: 1\n\n", "data: 1\n\n"},
	} {
		t.Run(tc.name, func(t *testing.T) { checkFilter(t, tc.in, tc.want) })
	}
}

// TestUsageChunkFilterLongEvent: an event over MaxFilteredEvent passes
// unfiltered, however it is split, and the events after it are filtered.
func TestUsageChunkFilterLongEvent(t *testing.T) {
	long := "data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("x", MaxFilteredEvent) + "\"}}],\"usage\":null}\n\n"
	in := long + "data: {\"id\":1,\"usage\":null}\n\n"
	want := long + "data: {\"id\":1}\n\n"
	for _, n := range []int{1, 100, 4096, MaxFilteredEvent - 10, MaxFilteredEvent + 50, len(in)} {
		var chunks []string
		for s := in; len(s) > 0; {
			k := min(n, len(s))
			chunks, s = append(chunks, s[:k]), s[k:]
		}
		if got := filtered(t, chunks...); got != want {
			t.Fatalf("writes of %d: got %d bytes, want %d", n, len(got), len(want))
		}
	}
	// Just at the bound: filtered.
	at := "data: {\"id\":\"" + strings.Repeat("y", MaxFilteredEvent-len("data: {\"id\":\"\",\"usage\":null}\n\n")) + "\",\"usage\":null}\n\n"
	if len(at) != MaxFilteredEvent {
		t.Fatal(len(at))
	}
	if got := filtered(t, at[:100], at[100:]); got != strings.Replace(at, ",\"usage\":null", "", 1) {
		t.Fatal("an event of MaxFilteredEvent bytes was not filtered")
	}
}

// TestUsageChunkFilterLatency: each event goes on with the Write that
// completes it; only a partial event is held.
func TestUsageChunkFilterLatency(t *testing.T) {
	var out bytes.Buffer
	f := NewUsageChunkFilter(&out)
	events := strings.SplitAfter(gatewayStream, "\n\n")
	sent := ""
	for _, ev := range events {
		if ev == "" {
			continue
		}
		f.Write([]byte(ev[:5]))
		if out.String() != sent {
			t.Fatalf("a partial event went on: %q", out.String())
		}
		f.Write([]byte(ev[5:]))
		sent += filtered(t, ev)
		if out.String() != sent {
			t.Fatalf("after a whole event:\n got %q\nwant %q", out.String(), sent)
		}
	}
	if out.String() != clientStream {
		t.Fatal("the stream is not the client's")
	}
}

type failWriter struct{ err error }

func (w failWriter) Write(p []byte) (int, error) { return 0, w.err }

func TestUsageChunkFilterWriteError(t *testing.T) {
	boom := errors.New("client gone")
	f := NewUsageChunkFilter(failWriter{boom})
	if _, err := f.Write([]byte("data: 1\n\n")); err != boom {
		t.Fatalf("err = %v", err)
	}
	if _, err := f.Write([]byte("data: 2\n\n")); err != boom {
		t.Fatalf("err = %v", err)
	}
	if err := f.Close(); err != boom {
		t.Fatalf("Close: %v", err)
	}
}

// TestUsageChunkFilterAllocs: filtering a stream costs no allocation once
// the filter's buffers have grown.
func TestUsageChunkFilterAllocs(t *testing.T) {
	in := []byte(gatewayStream)
	var out bytes.Buffer
	out.Grow(len(in))
	f := NewUsageChunkFilter(&out)
	f.Write(in)
	allocs := testing.AllocsPerRun(100, func() {
		out.Reset()
		for i := 0; i < len(in); i += 100 {
			f.Write(in[i:min(i+100, len(in))])
		}
	})
	if out.String() != clientStream {
		t.Fatalf("got %q", out.String())
	}
	if allocs != 0 {
		t.Errorf("%v allocations per stream, want 0", allocs)
	}
}

// BenchmarkUsageChunkFilter: filtering a 200-chunk stream with
// include_usage, written an event at a time.
func BenchmarkUsageChunkFilter(b *testing.B) {
	stream := chatStream(200)
	writes := make([][]byte, len(stream))
	size := 0
	for i, e := range stream {
		writes[i] = []byte(e)
		size += len(e)
	}
	b.ReportAllocs()
	b.SetBytes(int64(size))
	for b.Loop() {
		f := NewUsageChunkFilter(io.Discard)
		for _, w := range writes {
			f.Write(w)
		}
		f.Close()
	}
}
