package llm

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/go-json-experiment/json/jsontext"
	"github.com/klauspost/compress/gzip"
)

// splitAt cuts body at the points splits picks (each byte a fraction of
// the rest), at most 8 of them.
func splitAt(body, splits []byte) [][]byte {
	var parts [][]byte
	for _, s := range splits[:min(len(splits), 8)] {
		k := int(s) * len(body) / 256
		parts, body = append(parts, body[:k]), body[k:]
	}
	return append(parts, body)
}

// Fuzz modes: bit 0, an event stream; bits 1-2, the body's coding; bit
// 3, newline-delimited JSON (when not an event stream).
const (
	fuzzSSE     = 1
	fuzzGzip    = 2 // the body gzip-compressed by the test
	fuzzGzipRaw = 4 // the bytes as they are, labelled gzip
	fuzzNDJSON  = 8
)

var fuzzGzipWriter = gzip.NewWriter(io.Discard)

// FuzzUsageReader: on any body, however split, the reader does not
// panic, reports Found counts only from 0 to MaxTokenCount (their sum
// too), and gives the same result whatever the writes and whenever
// Result is called on the way. On a valid JSON object it reads the
// top-level usage member exactly as a full JSON parser finds it.
func FuzzUsageReader(f *testing.F) {
	for _, body := range []string{
		openAIChatJSON, responsesJSON, embeddingsJSON, anthropicMessageJSON,
		`{"a":"\\","b":"\\\"usage\":{\"total_tokens\":1}","usage":{"prompt_tokens":5}}`,
		`{"us\u0061ge":{"prompt_tokens":1.5e1}}`,
		`{"usage":{"prompt_tokens":9007199254740991,"completion_tokens":1}}`,
		geminiJSON, ollamaChatJSON, ollamaEmbedJSON,
		geminiArray, "[" + geminiJSON + "]", ` [{"error":{"code":429}}]`,
	} {
		f.Add([]byte(body), []byte{10, 200}, byte(0))
		f.Add([]byte(body), []byte{128}, byte(fuzzGzip))
	}
	f.Add([]byte(ollamaChatStream), []byte{100, 200}, byte(fuzzNDJSON))
	f.Add([]byte(ollamaChatStream), []byte{128}, byte(fuzzNDJSON|fuzzGzip))
	for _, body := range []string{
		openAIChatStream(true), responsesStream("response.completed"), anthropicMessagesStream(`{"output_tokens":15}`),
		geminiStream,
		strings.ReplaceAll(openAIChatStream(true), "\n", "\r\n"),
		"\xef\xbb\xbfdata: {\"usage\":\r\ndata: {\"prompt_tokens\":5}}\r\r: x\ndata\n\n",
	} {
		f.Add([]byte(body), []byte{30, 60, 90}, byte(fuzzSSE))
		f.Add([]byte(body), []byte{128}, byte(fuzzSSE|fuzzGzip))
	}
	f.Add([]byte("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"), []byte{5}, byte(fuzzGzipRaw))
	f.Fuzz(func(t *testing.T, body, splits []byte, mode byte) {
		if len(body) > 64<<10 {
			return
		}
		ct, ce := "application/json", ""
		switch {
		case mode&fuzzSSE != 0:
			ct = sse
		case mode&fuzzNDJSON != 0:
			ct = "application/x-ndjson"
		}
		switch {
		case mode&fuzzGzip != 0:
			var buf bytes.Buffer
			fuzzGzipWriter.Reset(&buf)
			fuzzGzipWriter.Write(body)
			fuzzGzipWriter.Close()
			body, ce = buf.Bytes(), "gzip"
		case mode&fuzzGzipRaw != 0:
			ce = "gzip"
		}
		r := NewUsageReader(ct, ce)
		defer r.Release()
		r.Write(body)
		want, wantSt := r.Result()
		if want2, st2 := r.Result(); want2 != want || st2 != wantSt {
			t.Fatalf("a second Result: %+v, %v; then %+v, %v", want, wantSt, want2, st2)
		}
		if wantSt == Found {
			for _, n := range []int64{want.InputTokens, want.OutputTokens, want.CacheCreationInputTokens,
				want.CacheReadInputTokens, want.TotalTokens, want.OtherTokens, want.Total(), want.sum()} {
				if n < 0 || n > MaxTokenCount {
					t.Fatalf("Found %+v: a count out of range", want)
				}
			}
		} else if want != (Usage{}) {
			t.Fatalf("%v with usage %+v", wantSt, want)
		}
		// The same in pieces, with Result asked between them.
		r.Reset(ct, ce)
		for _, part := range splitAt(body, splits) {
			r.Write(part)
			r.Result()
		}
		if got, st := r.Result(); got != want || st != wantSt {
			t.Fatalf("split: %+v, %v; whole: %+v, %v", got, st, want, wantSt)
		}
		if len(body) <= 256 && ce == "" {
			r.Reset(ct, ce)
			for i := range body {
				r.Write(body[i : i+1])
			}
			if got, st := r.Result(); got != want || st != wantSt {
				t.Fatalf("byte by byte: %+v, %v; whole: %+v, %v", got, st, want, wantSt)
			}
		}
		if ct != "application/json" || ce != "" {
			return
		}
		// A valid JSON array of objects that carry no usage but Gemini's:
		// read as the events of a stream, one element each, as Gemini's
		// chunks are the same with alt=sse.
		if events, ok := arrayAsEvents(body); ok {
			r.Reset(sse, "")
			r.Write(events)
			if got, st := r.Result(); got != want || st != wantSt {
				t.Fatalf("as events: %+v, %v; as an array: %+v, %v", got, st, want, wantSt)
			}
			return
		}
		// A valid JSON object: the usage is its top-level member's, read
		// alone.
		member, ok := topLevelUsage(body)
		if !ok {
			return
		}
		if member == nil {
			if wantSt != NotReported {
				t.Fatalf("no top-level usage, but %+v, %v", want, wantSt)
			}
			return
		}
		r.Reset(ct, ce)
		r.Write([]byte(`{"usage":`))
		r.Write(member)
		r.Write([]byte(`}`))
		if got, st := r.Result(); got != want || st != wantSt {
			t.Fatalf("usage %s alone: %+v, %v; in the body: %+v, %v", member, got, st, want, wantSt)
		}
	})
}

// topLevelUsage returns the value of the top-level "usage" member of a
// valid JSON object (nil when it has none); ok is false when body is not
// one valid JSON object, or has another provider's usage (Gemini's
// usageMetadata, Ollama's counts).
func topLevelUsage(body []byte) (member []byte, ok bool) {
	d := jsontext.NewDecoder(bytes.NewReader(body))
	if tok, err := d.ReadToken(); err != nil || tok.Kind() != '{' {
		return nil, false
	}
	for d.PeekKind() == '"' {
		tok, err := d.ReadToken()
		if err != nil {
			return nil, false
		}
		name := tok.String()
		v, err := d.ReadValue()
		if err != nil {
			return nil, false
		}
		switch name {
		case "usage":
			member = bytes.Clone(v)
		case "usageMetadata", "prompt_eval_count", "eval_count":
			return nil, false
		}
	}
	if _, err := d.ReadToken(); err != nil {
		return nil, false
	}
	if _, err := d.ReadToken(); err != io.EOF {
		return nil, false
	}
	return member, true
}

// arrayAsEvents returns the elements of a valid JSON array as the events
// of a stream; ok is false when body is not one, or an element is not an
// object on one line, or has a top-level member of another provider's
// usage ("usage", "message", "response", Ollama's counts), which an
// array does not read.
func arrayAsEvents(body []byte) (events []byte, ok bool) {
	d := jsontext.NewDecoder(bytes.NewReader(body))
	if tok, err := d.ReadToken(); err != nil || tok.Kind() != '[' {
		return nil, false
	}
	for d.PeekKind() != ']' {
		v, err := d.ReadValue()
		if err != nil || v.Kind() != '{' || bytes.ContainsAny(v, "\r\n") {
			return nil, false
		}
		e := jsontext.NewDecoder(bytes.NewReader(v))
		e.ReadToken()
		for e.PeekKind() == '"' {
			tok, _ := e.ReadToken()
			switch tok.String() {
			case "usage", "message", "response", "prompt_eval_count", "eval_count":
				return nil, false
			}
			if _, err := e.ReadValue(); err != nil {
				return nil, false
			}
		}
		events = append(append(append(events, "data: "...), v...), "\n\n"...)
	}
	if _, err := d.ReadToken(); err != nil {
		return nil, false
	}
	if _, err := d.ReadToken(); err != io.EOF {
		return nil, false
	}
	return events, true
}

// filterAll writes parts through a filter and returns the output.
func filterAll(parts ...[]byte) []byte {
	var out bytes.Buffer
	f := NewUsageChunkFilter(&out)
	for _, p := range parts {
		f.Write(p)
	}
	f.Close()
	return out.Bytes()
}

// FuzzUsageChunkFilter: on any stream, however split, the filter does not
// panic and writes the same bytes; a stream without usage passes
// unchanged; filtering the output again changes nothing.
func FuzzUsageChunkFilter(f *testing.F) {
	for _, s := range []string{
		gatewayStream, clientStream, strings.ReplaceAll(gatewayStream, "\n", "\r\n"),
		strings.ReplaceAll(gatewayStream, "\n", "\r"), anthropicMessagesStream(`{"output_tokens":15}`),
		responsesStream("response.completed"),
		"data: {\"usage\":null,\"id\":1}\n\ndata: { \"us\\u0061ge\" : null }\r\n\r\n",
		"id: 9\nevent: chunk\n: note\ndata: {\"choices\":[ ],\n\ndata: \"usage\":{\"total_tokens\":3}}\r\r\ndata: [DONE]",
	} {
		f.Add([]byte(s), []byte{50, 100, 150})
	}
	f.Fuzz(func(t *testing.T, in, splits []byte) {
		if len(in) > 64<<10 {
			return
		}
		want := filterAll(in)
		if got := filterAll(splitAt(in, splits)...); !bytes.Equal(got, want) {
			t.Fatalf("split:\n got %q\nwant %q", got, want)
		}
		if len(in) <= 256 {
			var bytewise [][]byte
			for i := range in {
				bytewise = append(bytewise, in[i:i+1])
			}
			if got := filterAll(bytewise...); !bytes.Equal(got, want) {
				t.Fatalf("byte by byte:\n got %q\nwant %q", got, want)
			}
		}
		if !bytes.Contains(in, []byte("usage")) && !bytes.Contains(in, []byte(`\u`)) && !bytes.Equal(want, in) {
			t.Fatalf("a stream without usage changed:\n got %q\nwant %q", want, in)
		}
		if again := filterAll(want); !bytes.Equal(again, want) {
			t.Fatalf("filtering twice:\n once %q\ntwice %q", want, again)
		}
	})
}
