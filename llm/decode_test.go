package llm

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zlib"
	"github.com/klauspost/compress/zstd"
)

// flushWriter is a compressing writer that can flush, as Caddy's encode
// handler flushes when the response is flushed.
type flushWriter interface {
	io.WriteCloser
	Flush() error
}

func newEncoder(t testing.TB, coding string, w io.Writer) flushWriter {
	t.Helper()
	switch coding {
	case "gzip", "x-gzip":
		return gzip.NewWriter(w)
	case "deflate":
		return zlib.NewWriter(w)
	case "deflate-raw":
		fw, err := flate.NewWriter(w, flate.DefaultCompression)
		if err != nil {
			t.Fatal(err)
		}
		return fw
	case "br":
		return brotli.NewWriter(w)
	case "zstd":
		// One goroutine: compress reads the buffer between writes.
		zw, err := zstd.NewWriter(w, zstd.WithEncoderConcurrency(1))
		if err != nil {
			t.Fatal(err)
		}
		return zw
	}
	t.Fatalf("no encoder for %s", coding)
	return nil
}

// headerCoding is the Content-Encoding of a test coding.
func headerCoding(coding string) string {
	if coding == "deflate-raw" {
		return "deflate"
	}
	return coding
}

// compress encodes body with coding, flushing after each of chunks when
// flush is set, and returns the encoded body and where each chunk's bytes
// end in it.
func compress(t testing.TB, coding string, flush bool, chunks ...string) ([]byte, []int) {
	t.Helper()
	var buf bytes.Buffer
	w := newEncoder(t, coding, &buf)
	var ends []int
	for _, c := range chunks {
		if _, err := w.Write([]byte(c)); err != nil {
			t.Fatal(err)
		}
		if flush {
			if err := w.Flush(); err != nil {
				t.Fatal(err)
			}
		}
		ends = append(ends, buf.Len())
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), ends
}

// flushedWrites splits a body compressed with a flush after each chunk into
// the writes a server makes, one per flush, the last with the end of the
// stream (compress's ends).
func flushedWrites(enc []byte, ends []int) [][]byte {
	var writes [][]byte
	prev := 0
	for _, end := range ends {
		writes = append(writes, enc[prev:end])
		prev = end
	}
	writes[len(writes)-1] = enc[ends[len(ends)-2]:]
	return writes
}

var codings = []string{"gzip", "x-gzip", "deflate", "deflate-raw", "br", "zstd"}

// events splits a stream after each blank line.
func events(stream string) []string {
	var out []string
	for _, e := range strings.SplitAfter(stream, "\n\n") {
		if e != "" {
			out = append(out, e)
		}
	}
	return out
}

// TestDecodeShapes: every coding gives the exact usage of a JSON body and
// of an event stream, written whole or in small pieces.
func TestDecodeShapes(t *testing.T) {
	for _, coding := range codings {
		for _, tc := range []usageCase{
			{"openai_chat_json", "application/json", openAIChatJSON,
				Usage{InputTokens: 19, OutputTokens: 10, TotalTokens: 29}, Found, 29},
			{"anthropic_json", "application/json", anthropicMessageJSON,
				Usage{InputTokens: 12, OutputTokens: 6, CacheCreationInputTokens: 100, CacheReadInputTokens: 2000}, Found, 2118},
			{"openai_stream", sse, openAIChatStream(true), Usage{InputTokens: 9, OutputTokens: 9, TotalTokens: 18}, Found, 18},
			{"anthropic_stream", sse, anthropicMessagesStream(`{"output_tokens":15}`),
				Usage{InputTokens: 25, OutputTokens: 15, CacheReadInputTokens: 1500}, Found, 1540},
			{"responses_stream", sse, responsesStream("response.completed"),
				Usage{InputTokens: 37, OutputTokens: 11, TotalTokens: 48}, Found, 48},
			{"no_usage", sse, openAIChatStream(false), Usage{}, NotReported, 0},
		} {
			t.Run(coding+"/"+tc.name, func(t *testing.T) {
				enc, _ := compress(t, coding, tc.contentType == sse, events(tc.body)...)
				got, st := readBody(tc.contentType, headerCoding(coding), string(enc))
				checkUsage(t, tc, got, st)
				var chunks []string
				for i := 0; i < len(enc); i += 10 {
					chunks = append(chunks, string(enc[i:min(i+10, len(enc))]))
				}
				got, st = readBody(tc.contentType, headerCoding(coding), chunks...)
				checkUsage(t, tc, got, st)
			})
		}
	}
}

// TestDecodeCutStreams: a compressed stream cut anywhere (the client gone,
// the upstream aborted) gives the usage of the events whose bytes the
// encoder had flushed before the cut: once the usage chunk's flush is in
// (or enough of it for the decoder to emit the chunk), the usage is Found,
// and stays Found.
func TestDecodeCutStreams(t *testing.T) {
	body := events(openAIChatStream(true))
	usageAt := len(body) - 2 // the usage chunk, before [DONE]
	want := Usage{InputTokens: 9, OutputTokens: 9, TotalTokens: 18}
	for _, coding := range codings {
		t.Run(coding, func(t *testing.T) {
			enc, ends := compress(t, coding, true, body...)
			found := false
			for cut := 0; cut <= len(enc); cut++ {
				u, st := readBody(sse, headerCoding(coding), string(enc[:cut]))
				switch {
				case st == Found && u == want && cut > ends[usageAt-1]:
					found = true
				case st == NotReported && !found && cut < ends[usageAt]:
				default:
					t.Fatalf("cut at %d of %d (usage chunk flushed from %d to %d): %+v, %v",
						cut, len(enc), ends[usageAt-1], ends[usageAt], u, st)
				}
			}
		})
	}
}

// TestDecodeResultWhileWriting: Result decodes what was written so far,
// once; later writes are decoded at the next Result.
func TestDecodeResultWhileWriting(t *testing.T) {
	body := events(anthropicMessagesStream(`{"output_tokens":15}`))
	enc, ends := compress(t, "gzip", true, body...)
	r := NewUsageReader(sse, "gzip")
	defer r.Release()
	r.Write(enc[:ends[0]])
	partial := Usage{InputTokens: 25, OutputTokens: 1, CacheReadInputTokens: 1500, Partial: true}
	if u, st := r.Result(); st != Found || u != partial {
		t.Fatalf("after message_start: %+v, %v", u, st)
	}
	if allocs := testing.AllocsPerRun(10, func() { r.Result() }); allocs != 0 {
		t.Errorf("a second Result allocates %v times", allocs)
	}
	r.Write(enc[ends[0]:])
	if u, st := r.Result(); st != Found || u != (Usage{InputTokens: 25, OutputTokens: 15, CacheReadInputTokens: 1500}) {
		t.Fatalf("at the end: %+v, %v", u, st)
	}
}

// TestDecodeCodingLists: codings applied in order are decoded in reverse;
// names are case-insensitive; identity is no coding.
func TestDecodeCodingLists(t *testing.T) {
	body := openAIChatJSON
	want := usageCase{"", "application/json", "", Usage{InputTokens: 19, OutputTokens: 10, TotalTokens: 29}, Found, 29}
	gz, _ := compress(t, "gzip", false, body)
	gzbr, _ := compress(t, "br", false, string(gz))
	gzbrzstd, _ := compress(t, "zstd", false, string(gzbr))
	raw, _ := compress(t, "deflate-raw", false, string(gzbr))
	for _, tc := range []struct {
		encoding, body string
		status         Status
	}{
		{"", body, Found},
		{"identity", body, Found},
		{" Identity , ", body, Found},
		{"GZIP", string(gz), Found},
		{"identity, gzip", string(gz), Found},
		// Stacked codings multiply the work of decoding: refused.
		{"gzip, br", string(gzbr), Unreadable},
		{"gzip,br,zstd", string(gzbrzstd), Unreadable},
		{"gzip, br, deflate", string(raw), Unreadable},
		{"br, gzip", string(gzbr), Unreadable},
		{"gzip", body, Unreadable},
		{"compress", body, Unreadable},
		{"gzip, compress", body, Unreadable},
		{"aes128gcm", body, Unreadable},
		{"gzip,gzip,gzip,gzip,gzip", body, Unreadable},
	} {
		got, st := readBody("application/json", tc.encoding, tc.body)
		if st != tc.status || (st == Found && got != want.want) {
			t.Errorf("%q: %+v, %v; want %v", tc.encoding, got, st, tc.status)
		}
	}
}

// TestDecodeLimits: corrupt data and a body that decodes to more than
// MaxDecodedBody at more than MaxDecodeRatio are Unreadable; usage read
// before corrupt data stands; a body over MaxEncodedBody is decoded as it
// is written, its usage read wherever it is, and no more of it kept.
func TestDecodeLimits(t *testing.T) {
	usage := `{"usage":{"prompt_tokens":5},"pad":"`
	t.Run("corrupt", func(t *testing.T) {
		for _, coding := range []string{"gzip", "deflate", "br", "zstd"} {
			if _, st := readBody("application/json", coding, "this is not compressed at all, not even a little"); st != Unreadable {
				t.Errorf("%s: %v", coding, st)
			}
		}
	})
	t.Run("corrupt_after_usage", func(t *testing.T) {
		enc, _ := compress(t, "gzip", false, usage+strings.Repeat("x", 10000)+`"}`)
		enc[len(enc)-6] ^= 0xff // the CRC and length trailer
		if u, st := readBody("application/json", "gzip", string(enc)); st != Found || u.InputTokens != 5 {
			t.Fatalf("%+v, %v", u, st)
		}
	})
	t.Run("empty", func(t *testing.T) {
		for _, coding := range []string{"gzip", "deflate", "br", "zstd"} {
			if _, st := readBody("application/json", coding, ""); st != NotReported {
				t.Errorf("%s: %v", coding, st)
			}
		}
	})
	t.Run("encoded_over", func(t *testing.T) {
		// Base64 of random bytes: JSON string text that compresses to
		// about 3/4 of its size.
		rnd := rand.New(rand.NewPCG(1, 2))
		var noise [3]string // three, none like the others: brotli's window is long
		for k := range noise {
			raw := make([]byte, MaxEncodedBody/2)
			for i := range raw {
				raw[i] = byte(rnd.Uint32())
			}
			noise[k] = base64.StdEncoding.EncodeToString(raw)
		}
		for _, coding := range codings {
			for name, body := range map[string][]string{
				"usage_first": {usage, noise[0], noise[1], noise[2], `"}`},
				"usage_last":  {`{"pad":"`, noise[0], noise[1], noise[2], `","usage":{"prompt_tokens":5}}`},
			} {
				enc, _ := compress(t, coding, false, body...)
				if len(enc) <= MaxEncodedBody {
					t.Fatalf("%s %s: %d encoded bytes, want over MaxEncodedBody", coding, name, len(enc))
				}
				r := NewUsageReader("application/json", headerCoding(coding))
				for i := 0; i < len(enc); i += 32 << 10 {
					r.Write(enc[i:min(i+32<<10, len(enc))])
					if cap(r.enc) > MaxEncodedBody {
						t.Fatalf("%s %s: kept %d bytes", coding, name, cap(r.enc))
					}
					if i == 64<<10 {
						r.Result() // a Result before the bound: the one after must not be it
					}
				}
				if u, st := r.Result(); st != Found || u.InputTokens != 5 {
					t.Errorf("%s %s, %d encoded bytes: %+v, %v; want the 5 input tokens found", coding, name, len(enc), u, st)
				}
				if u, st := r.Result(); st != Found || u.InputTokens != 5 {
					t.Errorf("%s %s: a second Result gave %+v, %v", coding, name, u, st)
				}
				r.Release()
			}
		}
	})
	t.Run("encoded_over_corrupt", func(t *testing.T) {
		r := NewUsageReader("application/json", "gzip")
		defer r.Release()
		junk := bytes.Repeat([]byte("not gzip at all "), MaxEncodedBody/8)
		r.Write(junk)
		r.Write(junk) // past MaxEncodedBody: to a decoder that stopped
		r.Write(junk)
		if _, st := r.Result(); st != Unreadable {
			t.Fatalf("%v, want Unreadable", st)
		}
	})
	t.Run("encoded_over_released_unread", func(t *testing.T) {
		// A reader released without Result (a handler that panicked) ends
		// its decoder.
		enc, _ := compress(t, "gzip", false, usage, strings.Repeat("x", 1<<20), `"}`)
		rnd := rand.New(rand.NewPCG(3, 4))
		noise := make([]byte, 2*MaxEncodedBody)
		for i := range noise {
			noise[i] = byte(rnd.Uint32())
		}
		before := runtime.NumGoroutine()
		r := NewUsageReader("application/json", "gzip")
		r.Write(enc[:len(enc)/2])
		r.Write(noise)
		if r.stream == nil {
			t.Fatal("no decoder runs")
		}
		r.Release()
		// Release waited for the decoder's result, its goroutine's last
		// act before it returns.
		deadline := time.Now().Add(10 * time.Second)
		for runtime.NumGoroutine() > before {
			if time.Now().After(deadline) {
				t.Fatalf("%d goroutines after Release, %d before", runtime.NumGoroutine(), before)
			}
			runtime.Gosched()
		}
	})
	t.Run("bomb", func(t *testing.T) {
		var buf bytes.Buffer
		w := newEncoder(t, "zstd", &buf)
		w.Write([]byte(usage))
		zeros := make([]byte, 1<<20)
		for range MaxDecodedBody>>20 + 1 {
			w.Write(zeros)
		}
		w.Close()
		if buf.Len() > MaxEncodedBody {
			t.Fatalf("%d encoded bytes", buf.Len())
		}
		if _, st := readBody("application/json", "zstd", buf.String()); st != Unreadable {
			t.Fatalf("%d encoded bytes: %v", buf.Len(), st)
		}
	})
}

// ---------------------------------------------------------------------------
// Benchmarks.

// chatJSON is an OpenAI chat completion of about size bytes.
func chatJSON(size int) string {
	words := strings.Fields("the quick brown fox jumps over the lazy dog while a \"usage\" of tokens is counted at the end of each answer")
	var b strings.Builder
	for i := 0; b.Len() < size-len(openAIChatJSON); i++ {
		b.WriteString(words[i%len(words)])
		b.WriteByte(' ')
		if i%17 == 0 {
			b.WriteString(fmt.Sprint(i))
		}
	}
	return strings.Replace(openAIChatJSON, "Hello! How can I assist you today?", strings.ReplaceAll(b.String(), `"`, `\"`), 1)
}

// chatStream is an OpenAI chat stream of n content chunks with usage.
func chatStream(n int) []string {
	ev := events(openAIChatStream(true))
	out := []string{ev[0]}
	for i := range n {
		out = append(out, strings.Replace(ev[1], "Hello", fmt.Sprintf("word%d ", i), 1))
	}
	return append(out, ev[3:]...)
}

// BenchmarkUsageReader: what reading the usage costs a response, from
// NewUsageReader to Release: a chat completion of 2 KB and 100 KB in each
// coding, written in 16 KiB writes, and a 200-chunk stream written an
// event at a time, plain and gzip-compressed with a flush per event, and
// a gzip stream past MaxEncodedBody.
func BenchmarkUsageReader(b *testing.B) {
	type bodyCase struct {
		name, contentType, coding string
		writes                    [][]byte
	}
	var cases []bodyCase
	for _, size := range []int{2 << 10, 100 << 10} {
		body := chatJSON(size)
		for _, coding := range []string{"identity", "gzip", "br", "zstd"} {
			enc := []byte(body)
			if coding != "identity" {
				enc, _ = compress(b, coding, false, body)
			}
			var writes [][]byte
			for i := 0; i < len(enc); i += 16 << 10 {
				writes = append(writes, enc[i:min(i+16<<10, len(enc))])
			}
			cases = append(cases, bodyCase{fmt.Sprintf("json_%dKB/%s", size>>10, coding), "application/json", coding, writes})
		}
	}
	stream := chatStream(200)
	for _, coding := range []string{"identity", "gzip"} {
		var writes [][]byte
		if coding == "identity" {
			for _, e := range stream {
				writes = append(writes, []byte(e))
			}
		} else {
			writes = flushedWrites(compress(b, coding, true, stream...))
		}
		cases = append(cases, bodyCase{"sse_200/" + coding, sse, coding, writes})
	}
	// A stream whose gzip passes MaxEncodedBody, decoded as it is written:
	// 5000 chunks of 300 random characters each, as top_logprobs makes them.
	rnd := rand.New(rand.NewPCG(5, 6))
	raw := make([]byte, 225)
	ev := events(openAIChatStream(true))
	long := []string{ev[0]}
	for range 5000 {
		for i := range raw {
			raw[i] = byte(rnd.Uint32())
		}
		long = append(long, strings.Replace(ev[1], "Hello", base64.RawURLEncoding.EncodeToString(raw), 1))
	}
	long = append(long, ev[3:]...)
	enc, ends := compress(b, "gzip", true, long...)
	if len(enc) <= MaxEncodedBody {
		b.Fatalf("the long stream is %d bytes compressed", len(enc))
	}
	cases = append(cases, bodyCase{"sse_5000_over_1MiB/gzip", sse, "gzip", flushedWrites(enc, ends)})
	for _, bc := range cases {
		size := 0
		for _, w := range bc.writes {
			size += len(w)
		}
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(size))
			for b.Loop() {
				r := NewUsageReader(bc.contentType, bc.coding)
				for _, w := range bc.writes {
					r.Write(w)
				}
				if u, st := r.Result(); st != Found || u.Total() == 0 {
					b.Fatalf("%+v, %v", u, st)
				}
				r.Release()
			}
		})
	}
}

// BenchmarkDecodeMechanism compares the two ways a UsageReader decodes a
// body pushed in writes with a pull decoder: keeping the encoded bytes and
// decoding them at Result (its way up to MaxEncodedBody), and decoding as
// the bytes come, through a pipe to a goroutine (startStream, its way
// past it).
func BenchmarkDecodeMechanism(b *testing.B) {
	json := chatJSON(100 << 10)
	jsonEnc, _ := compress(b, "gzip", false, json)
	var jsonWrites [][]byte
	for i := 0; i < len(jsonEnc); i += 16 << 10 {
		jsonWrites = append(jsonWrites, jsonEnc[i:min(i+16<<10, len(jsonEnc))])
	}
	stream := chatStream(200)
	streamWrites := flushedWrites(compress(b, "gzip", true, stream...))
	for _, bc := range []struct {
		name, contentType string
		writes            [][]byte
	}{
		{"json_100KB_gzip", "application/json", jsonWrites},
		{"sse_200_gzip", sse, streamWrites},
	} {
		b.Run(bc.name+"/buffered", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				r := NewUsageReader(bc.contentType, "gzip")
				for _, w := range bc.writes {
					r.Write(w)
				}
				if _, st := r.Result(); st != Found {
					b.Fatal(st)
				}
				r.Release()
			}
		})
		b.Run(bc.name+"/pipe", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				var body usageBody
				body.reset(bc.contentType == sse)
				d := startStream([]coding{codingGzip}, nil, &body)
				for _, w := range bc.writes {
					d.write(w)
				}
				if outcome := d.finish(); outcome != decodeOK {
					b.Fatal(outcome)
				}
				if _, st := body.result(); st != Found {
					b.Fatal(st)
				}
			}
		})
	}
}
