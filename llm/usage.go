package llm

import (
	"bytes"
	"io"
	"strings"
	"sync"

	"github.com/go-json-experiment/json/jsontext"
)

// MaxTokenCount is the largest token count a usage report may carry, for
// each of its numbers and for their sum: 2^53-1, the largest integer that
// every JSON implementation (and the Lua of the Redis scripts, whose
// numbers are doubles) holds exactly. A larger count is Invalid.
const MaxTokenCount = 1<<53 - 1

// MaxUsageObject is the largest usage object, in bytes of JSON as
// written, that a UsageReader reads. The usage objects of OpenAI and
// Anthropic are a few hundred bytes; a larger one is Invalid.
const MaxUsageObject = 4 << 10

// Usage is a response's reported token usage, in tokens.
//
// The fields are read from the provider's usage object:
//
//   - InputTokens: prompt_tokens (OpenAI chat completions and embeddings,
//     https://platform.openai.com/docs/api-reference/chat/object) or
//     input_tokens (OpenAI Responses API,
//     https://platform.openai.com/docs/api-reference/responses/object;
//     Anthropic Messages API,
//     https://docs.anthropic.com/en/api/messages). The cached part of an
//     OpenAI prompt (prompt_tokens_details.cached_tokens,
//     input_tokens_details.cached_tokens) is inside this count already and
//     is not read.
//   - OutputTokens: completion_tokens (OpenAI chat completions) or
//     output_tokens (Responses API, Anthropic). Reasoning tokens
//     (completion_tokens_details.reasoning_tokens,
//     output_tokens_details.reasoning_tokens) are inside this count and
//     are not read.
//   - CacheCreationInputTokens, CacheReadInputTokens:
//     cache_creation_input_tokens and cache_read_input_tokens (Anthropic,
//     https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching);
//     Anthropic's input_tokens excludes them, so they count as input.
//   - TotalTokens: total_tokens (OpenAI), as reported; 0 when not reported.
//
// Gemini's usageMetadata (generateContent, each event of
// streamGenerateContent?alt=sse and each element of the JSON array it
// answers without alt=sse, Google AI and Vertex AI,
// https://ai.google.dev/api/generate-content#UsageMetadata) gives
// InputTokens (promptTokenCount, the cached part included),
// OutputTokens (candidatesTokenCount), OtherTokens (thoughtsTokenCount +
// toolUsePromptTokenCount, billed apart from both) and TotalTokens
// (totalTokenCount, which includes all of them). Ollama's native API
// (/api/chat, /api/generate, /api/embed,
// https://github.com/ollama/ollama/blob/main/docs/api.md) reports its
// counts as top-level members of the answer, or of a stream's last line:
// InputTokens is prompt_eval_count, OutputTokens eval_count.
//
// Bedrock's Converse API (as LiteLLM's /bedrock pass-through answers it,
// https://docs.aws.amazon.com/bedrock/latest/APIReference/API_runtime_TokenUsage.html)
// names them in its usage object inputTokens, outputTokens,
// cacheWriteInputTokens, cacheReadInputTokens and totalTokens.
//
// A field the provider reports as null counts as not reported.
type Usage struct {
	InputTokens              int64
	OutputTokens             int64
	CacheCreationInputTokens int64
	CacheReadInputTokens     int64
	TotalTokens              int64
	OtherTokens              int64

	// Partial is true when the only report seen is the one an Anthropic
	// stream opens with (message_start's message.usage): its input counts
	// are final, but its output_tokens is the count at the start of the
	// answer (typically 1), not the final one, which only message_delta
	// carries. A stream cut between the two ends with a Partial usage.
	// So is a Gemini stream's usage when the last event that reported it
	// had no candidatesTokenCount: the events before the last report the
	// prompt's count and a total without the answer's.
	Partial bool
}

// Total returns the tokens a settlement charges: TotalTokens when the
// provider reports a nonzero total, else InputTokens +
// CacheCreationInputTokens + CacheReadInputTokens + OutputTokens +
// OtherTokens. (A total
// of 0 next to nonzero parts is not believed.) The result of Found usage
// is at most MaxTokenCount.
func (u Usage) Total() int64 {
	if u.TotalTokens > 0 {
		return u.TotalTokens
	}
	return u.sum()
}

func (u Usage) sum() int64 {
	return u.InputTokens + u.CacheCreationInputTokens + u.CacheReadInputTokens + u.OutputTokens + u.OtherTokens
}

// Status tells what a UsageReader made of a response.
type Status uint8

const (
	// NotReported: no usage was seen (yet): the body has no usage object,
	// or only a null one, or one with none of the token counts Usage
	// reads, or the body was cut before its usage object ended. The
	// estimate stands.
	NotReported Status = iota
	// Found: the Usage is what the provider reported.
	Found
	// Invalid: a usage object was seen but cannot be believed: a count
	// that is not a number, negative, not an integer or above
	// MaxTokenCount (the exact value of the JSON number decides: 320.0 and
	// 3.2e2 are 320, -0 is 0, and 1.5, 1e-3 and 1e16 are Invalid); counts
	// that sum above MaxTokenCount; a usage value that is not valid JSON,
	// has a duplicate name, is larger than MaxUsageObject, or is neither
	// an object nor null; more than one top-level usage member in a JSON
	// body. One such report makes a whole event stream Invalid. The
	// estimate should stand, and the response be counted or logged.
	Invalid
	// Unreadable: the body could not be read: an unknown or unsupported
	// content coding, a decoded body over MaxDecodedBody and
	// MaxDecodeRatio, or corrupt compressed data before any usage.
	Unreadable
)

func (s Status) String() string {
	switch s {
	case NotReported:
		return "not_reported"
	case Found:
		return "found"
	case Invalid:
		return "invalid"
	case Unreadable:
		return "unreadable"
	}
	return "unknown"
}

// A UsageReader reads the token usage a response body reports, from the
// bytes written to it as the body passes through a gateway, without
// keeping the body. It knows these shapes:
//
//   - A JSON body (any Content-Type but text/event-stream): the value of
//     the top-level "usage" member of the top-level object, wherever it
//     is in the body, however long the body. "usage" names nested deeper
//     (in choices, content, metadata, tool arguments) are not read.
//     OpenAI chat completions, embeddings and Responses API bodies and
//     Anthropic Messages bodies all carry their usage there.
//   - A text/event-stream body
//     (https://html.spec.whatwg.org/multipage/server-sent-events.html):
//     in the JSON data of every event, the top-level "usage" member (the
//     last chunk of an OpenAI chat stream with
//     stream_options.include_usage,
//     https://platform.openai.com/docs/api-reference/chat-streaming;
//     Anthropic's message_delta,
//     https://docs.anthropic.com/en/docs/build-with-claude/streaming),
//     "message"."usage" (Anthropic's message_start) and
//     "response"."usage" (the Responses API's response.completed,
//     response.incomplete and response.failed,
//     https://platform.openai.com/docs/api-reference/responses-streaming).
//     Each count takes the latest value any event reports for it:
//     Anthropic's message_delta carries the cumulative output_tokens (and
//     in newer API versions the input and cache counts again). Events of
//     any length are read: the event data is scanned as it arrives, not
//     kept.
//   - In a JSON body or an event's data, also the top-level
//     "usageMetadata" member (Gemini's), and the top-level
//     "prompt_eval_count" and "eval_count" members (Ollama's native
//     API). In one JSON body a count may be reported once: a usage object
//     beside usageMetadata or beside an Ollama count, or a count named
//     twice, is Invalid.
//   - A newline-delimited JSON body (application/x-ndjson or
//     application/ndjson: Ollama's streams): each line is read as a JSON
//     body of its own, and each count takes the latest value any line
//     reports for it (Ollama reports them in its last line, "done":true).
//
// A UsageReader uses bounded memory: it keeps at most one usage object
// (MaxUsageObject) of an identity body, and the encoded bytes of a
// compressed one up to MaxEncodedBody (see NewUsageReader); past them, the
// decoder's window (32 KiB for gzip and deflate, up to maxZstdWindow for
// zstd and 16 MiB for brotli, as the body's sender chose).
//
// A UsageReader is not safe for concurrent use: Write and Result must not
// run at the same time (a handler calls both from its own goroutine).
type UsageReader struct {
	codings  [maxCodings]coding
	ncodings int
	unknown  bool // a coding that is not read: Unreadable

	enc    []byte         // the encoded body, when ncodings > 0, up to MaxEncodedBody
	stream *streamDecoder // past MaxEncodedBody: the body decoded as written

	// The result of decoding the first decodedLen bytes of enc.
	decoded    bool
	decodedLen int
	usage      Usage
	status     Status

	body usageBody
}

var readerPool = sync.Pool{New: func() any { return new(UsageReader) }}

// NewUsageReader returns a UsageReader for a response with the given
// Content-Type and Content-Encoding header values.
//
// contentType text/event-stream (any case, any parameters) selects the
// event-stream reading, application/x-ndjson and application/ndjson the
// newline-delimited reading; anything else is read as JSON (a JSON array
// as Gemini's chunks, see usageBody.feedArray).
//
// contentEncoding lists the content codings applied to the body, in the
// order they were applied (RFC 9110, section 8.4), comma separated, any
// case: "" and identity (none), gzip and x-gzip, deflate (zlib-wrapped as
// RFC 9110 says, and raw deflate as browsers accept too), br and zstd; at
// most one of them (see maxCodings). Any other coding, or stacked
// codings, makes the reader report Unreadable.
// An identity body is read as it is written; a compressed body is kept,
// up to MaxEncodedBody bytes, and decoded when Result is called, and a
// longer one is decoded as it is written, in a goroutine of its own.
//
// The reader comes from a pool: call Release once done with it (after
// the last Result), or let the garbage collector have it.
func NewUsageReader(contentType, contentEncoding string) *UsageReader {
	r := readerPool.Get().(*UsageReader)
	r.Reset(contentType, contentEncoding)
	return r
}

// Reset makes r a new reader for a response with the given Content-Type
// and Content-Encoding, as NewUsageReader does, keeping its buffers.
func (r *UsageReader) Reset(contentType, contentEncoding string) {
	r.ncodings, r.unknown = parseCodings(contentEncoding, &r.codings)
	r.enc = r.enc[:0]
	r.stream = nil
	r.decoded = false
	r.body.lines = isNDJSON(contentType)
	r.body.reset(IsEventStream(contentType))
}

// Release returns r to the pool NewUsageReader takes readers from. r must
// not be used after.
func (r *UsageReader) Release() {
	if r.stream != nil && !r.decoded {
		r.stream.finish() // the decoder writes to r.body until it ends
	}
	r.stream = nil
	if cap(r.enc) > 64<<10 {
		r.enc = nil // don't keep a large buffer in the pool
	}
	r.body.release()
	readerPool.Put(r)
}

// Write reads p, the next bytes of the body as sent (still encoded). It
// always consumes all of p and never returns an error.
func (r *UsageReader) Write(p []byte) (int, error) {
	switch {
	case r.unknown:
	case r.ncodings == 0:
		r.body.Write(p)
	case r.stream != nil:
		r.stream.write(p)
	case len(r.enc)+len(p) > MaxEncodedBody:
		r.body.reset(r.body.sse)
		r.decoded = false // a Result of the bytes before is stale
		r.stream = startStream(r.codings[:r.ncodings], r.enc, &r.body)
		r.stream.write(p)
		r.enc = r.enc[:0] // the decoder has copied them
	default:
		if need := len(r.enc) + len(p); need > cap(r.enc) {
			// Grow by doubling, from 4 KiB, but never past the bound.
			enc := make([]byte, len(r.enc), min(max(need, 2*cap(r.enc), 4<<10), MaxEncodedBody))
			copy(enc, r.enc)
			r.enc = enc
		}
		r.enc = append(r.enc, p...)
	}
	return len(p), nil
}

// Result returns the usage the body written so far reports, and what was
// made of it. It can be called at any time, any number of times, also
// with more writes in between: it reads the body as if it ended here. An
// event-stream event counts as soon as its usage object is complete,
// without waiting for the blank line that ends the event (so a stream cut
// right after its usage still settles); a JSON body cut before its usage
// object ends reports NotReported.
//
// For a compressed body, Result decodes the bytes written so far (a cut
// stream decodes as far as it goes) and caches the result until the next
// Write: calling it twice decodes once. For one past MaxEncodedBody, which
// is decoded as it is written, Result ends the body: later writes are not
// read. Corrupt compressed data is Unreadable unless a usage report was
// read before it.
//
// The Usage is zero unless the Status is Found.
func (r *UsageReader) Result() (Usage, Status) {
	switch {
	case r.unknown:
		return Usage{}, Unreadable
	case r.ncodings == 0:
		return r.body.result()
	case r.decoded && (r.stream != nil || r.decodedLen == len(r.enc)):
		return r.usage, r.status
	}
	var outcome decodeOutcome
	if r.stream != nil {
		outcome = r.stream.finish()
	} else {
		r.body.reset(r.body.sse)
		outcome = decodeBody(r.enc, r.codings[:r.ncodings], &r.body)
	}
	u, s := r.body.result()
	switch {
	case outcome == decodeTooLarge:
		u, s = Usage{}, Unreadable
	case outcome == decodeCorrupt && s == NotReported:
		s = Unreadable
	}
	r.decoded, r.decodedLen, r.usage, r.status = true, len(r.enc), u, s
	return u, s
}

// ErrorObject reports whether the body is a JSON object with a top-level
// "error" member: the error shape of OpenAI's API, Anthropic's
// ({"type":"error","error":{...}}) and the APIs that follow them; or with
// a top-level "object" member whose value is "error": Mistral's
// ({"object":"error","message":...,"type":"invalid_request_error"}) and
// vLLM's (before it took OpenAI's shape); and not
// the page of a proxy in between (HTML, plain text). It reads the body as
// far as it was written, and for a compressed body as far as Result last
// decoded it: call it after Result. An event stream is never one; of a
// newline-delimited JSON body, its first line is read, and of a JSON
// array (see feedArray), its first element: Gemini's
// streamGenerateContent without alt=sse answers its error as the
// array's one element ([{"error":{"code":503,"status":"UNAVAILABLE",...}}],
// https://github.com/continuedev/continue/issues/8308,
// https://github.com/google-gemini/gemini-cli/issues/6454).
func (r *UsageReader) ErrorObject() bool {
	b := &r.body
	if (b.lines || b.array > 0) && b.events > 0 {
		return !r.unknown && b.firstError // the first line's, or element's
	}
	return !r.unknown && !b.sse && b.scan.errorTop
}

// LoadOnly reports whether the body is Ollama's answer to a call that ran
// no model: a JSON object whose top-level "done_reason" is "load" or
// "unload", as /api/generate without a prompt and /api/chat without
// messages answer when they load the model (or, with keep_alive 0,
// unload it), with no prompt_eval_count or eval_count
// (https://github.com/ollama/ollama/blob/main/docs/api.md, "Load a model",
// "Unload a model"). A JSON array is not one: its scan is that of the
// element being read (see feedArray), and Ollama answers none. Call it
// after Result.
func (r *UsageReader) LoadOnly() bool {
	b := &r.body
	return !r.unknown && !b.sse && !b.lines && b.array <= 0 && b.scan.loadTop
}

// OpenedWithError reports whether the body is an event stream whose first
// event with data is an error object (a JSON object whose top-level
// "error" member is an object; not null, as OpenRouter's chunks carry it
// when all is well): Anthropic answers an overload that comes after its 200
// this way, with an error event in place of message_start
// (https://docs.anthropic.com/en/api/errors, "When receiving a streaming
// response via SSE, it's possible that an error can occur after returning
// a 200 response"), and OpenAI a stream that fails before its first
// chunk. The model did not run: nothing came before. It reads the stream
// as far as it was written, and a compressed one as far as Result last
// decoded it: call it after Result.
func (r *UsageReader) OpenedWithError() bool {
	b := &r.body
	return !r.unknown && b.sse && (b.firstError || b.events == 0 && b.scan.errorObj)
}

// IsIdentity reports whether a Content-Encoding list applies no content
// coding: empty, or identity only. A UsageChunkFilter reads only such a
// stream.
func IsIdentity(contentEncoding string) bool {
	var c [maxCodings]coding
	n, unknown := parseCodings(contentEncoding, &c)
	return n == 0 && !unknown
}

// IsEventStream reports whether a Content-Type is text/event-stream (any
// case, any parameters): the body a UsageReader reads as events.
func IsEventStream(contentType string) bool {
	mt, _, _ := strings.Cut(contentType, ";")
	return strings.EqualFold(strings.TrimSpace(mt), "text/event-stream")
}

// usageBody reads decoded body bytes: a JSON body, or an event stream.
type usageBody struct {
	sse   bool
	lines bool     // newline-delimited JSON: each line a JSON text of its own
	array int8     // a JSON body: 0 until its first byte; 1 an array being read, 2 one read to its end or to an element that is no object (see feedArray); -1 no array
	ev    sseLines // event-stream framing
	scan  jsonScan // the JSON body, or the data of the current event

	capture []byte // the usage value being read, up to MaxUsageObject
	capOver bool

	events     int  // events with data ended so far (an event stream)
	firstError bool // the first of them was an error object

	tally tally

	dec *jsontext.Decoder
	buf bytes.Buffer
}

func (b *usageBody) reset(sse bool) {
	b.sse = sse
	b.ev = sseLines{}
	b.scan.reset(sse)
	b.capture = b.capture[:0]
	b.capOver = false
	b.events, b.firstError = 0, false
	b.array = 0
	b.tally = tally{}
}

func (b *usageBody) release() {
	if cap(b.capture) > MaxUsageObject {
		b.capture = nil
	}
	b.buf.Reset()
}

// Write reads the next decoded bytes of the body.
func (b *usageBody) Write(p []byte) (int, error) {
	switch {
	case b.sse:
		b.ev.feed(b, p)
	case b.lines:
		b.feedLines(p)
	case b.array >= 0:
		b.feedArray(p)
	default:
		b.scan.feed(b, p)
	}
	return len(p), nil
}

// feedArray reads the next bytes of a JSON body that may be an array:
// Gemini's streamGenerateContent without alt=sse answers its chunks as
// the elements of one JSON array, sent as they come
// (https://ai.google.dev/api/generate-content#method:-models.streamgeneratecontent).
// Each element is scanned as a JSON body of its own, as an event of a
// stream is, so that the last one's usageMetadata counts the answer (see
// report); no other usage in an array is read, since an array of
// answers (a batch's) each with its usage is no one answer's. Reading
// stops at the array's end and at an element that is not an object,
// which Gemini does not send. A body whose first byte (after white space)
// is not '[' is scanned as one JSON text.
func (b *usageBody) feedArray(p []byte) {
	switch b.array {
	case 2:
		return
	case 0:
		p = bytes.TrimLeft(p, " \t\r\n")
		switch {
		case len(p) == 0:
			return
		case p[0] != '[':
			b.array = -1
			b.scan.feed(b, p)
			return
		}
		b.array = 1
		b.scan.reset(false)
		p = p[1:]
	}
	for len(p) > 0 {
		if !b.scan.started {
			// Between elements: white space, their commas, the end.
			p = bytes.TrimLeft(p, " \t\r\n,")
			if len(p) == 0 {
				return
			}
			if p[0] != '{' {
				b.array = 2 // the end, or an element that is no object
				return
			}
		}
		n := b.scan.feed(b, p)
		p = p[n:]
		if b.scan.done {
			b.endEvent(b.scan.started, b.scan.errorTop, false)
		}
	}
}

// feedLines reads the next bytes of a newline-delimited JSON body
// (Ollama's streams): each line is scanned as a JSON body of its own, so
// that its last line's counts are read, and a line that is not one JSON
// object (a string cut short) ends at its newline, which no JSON string
// holds unescaped. As in an event stream, each count takes the latest
// value a line reports.
func (b *usageBody) feedLines(p []byte) {
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			b.scan.feed(b, p)
			return
		}
		b.scan.feed(b, p[:i])
		b.endEvent(b.scan.started, b.scan.errorTop, false)
		p = p[i+1:]
	}
}

// endEvent ends one event of a stream, an SSE event (sse) or an NDJSON
// line: one that held data (counted) is counted, and the first one's
// isError recorded; the scan and the capture start over.
func (b *usageBody) endEvent(counted, isError, sse bool) {
	if counted {
		if b.events == 0 {
			b.firstError = isError
		}
		b.events++
	}
	b.scan.reset(sse)
	b.capture, b.capOver = b.capture[:0], false
}

// isNDJSON reports whether a Content-Type is newline-delimited JSON
// (application/x-ndjson, as Ollama streams, or application/ndjson; any
// case, any parameters).
func isNDJSON(contentType string) bool {
	mt, _, _ := strings.Cut(contentType, ";")
	mt = strings.TrimSpace(mt)
	return strings.EqualFold(mt, "application/x-ndjson") || strings.EqualFold(mt, "application/ndjson")
}

func (b *usageBody) result() (Usage, Status) {
	t := &b.tally
	switch {
	case t.invalid:
		return Usage{}, Invalid
	case t.set == 0:
		return Usage{}, NotReported
	}
	u := Usage{
		InputTokens:              t.vals[fieldInput],
		OutputTokens:             t.vals[fieldOutput],
		CacheCreationInputTokens: t.vals[fieldCacheCreation],
		CacheReadInputTokens:     t.vals[fieldCacheRead],
		TotalTokens:              t.vals[fieldTotal],
		OtherTokens:              t.vals[fieldThoughts] + t.vals[fieldToolUsePrompt],
		Partial:                  t.partial,
	}
	// Each count is at most MaxTokenCount, so the sum does not overflow.
	if u.sum() > MaxTokenCount {
		return Usage{}, Invalid
	}
	return u, Found
}

// captureAppend adds p to the usage value being read.
func (b *usageBody) captureAppend(p []byte) {
	if b.capOver || len(p) == 0 {
		return
	}
	if len(b.capture)+len(p) > MaxUsageObject {
		b.capOver = true
		return
	}
	b.capture = append(b.capture, p...)
}

// Where a usage object is.
const (
	usageTop        = iota // the top-level "usage"
	usageMessage           // "message"."usage": Anthropic's message_start
	usageResponse          // "response"."usage": the Responses API's last events
	usageGemini            // the top-level "usageMetadata": Gemini's
	countPromptEval        // the top-level "prompt_eval_count": Ollama's
	countEval              // the top-level "eval_count": Ollama's
)

// report reads a usage value the scan has read whole into b.capture.
func (b *usageBody) report(where int) {
	raw, over := b.capture, b.capOver
	b.capture, b.capOver = b.capture[:0], false
	t := &b.tally
	if b.array > 0 && where != usageGemini {
		return // an array's elements are Gemini's chunks (see feedArray): another usage is not the answer's
	}
	whole := !b.sse && !b.lines && b.array <= 0 // one JSON body: no report may come twice
	if whole && (where == usageTop || where == usageGemini) {
		t.reports++
		if t.reports > 1 {
			t.invalid = true // a duplicate top-level member
			return
		}
	}
	if over {
		t.invalid = true
		return
	}
	raw = bytes.TrimSpace(raw)
	if string(raw) == "null" {
		return // every OpenAI chunk but the last, with include_usage
	}
	var f usageFields
	ok := false
	switch where {
	case countPromptEval:
		ok = b.parseCountMember(raw, fieldInput, &f)
	case countEval:
		ok = b.parseCountMember(raw, fieldOutput, &f)
	default:
		ok = b.parseUsage(raw, where == usageGemini, &f)
	}
	if !ok {
		t.invalid = true
		return
	}
	if f.set == 0 {
		return
	}
	if whole && t.set&f.set != 0 {
		// A count reported twice in one JSON body (an Ollama count
		// named twice, or beside a usage object): parsers keep
		// different ones.
		t.invalid = true
		return
	}
	for i := range numFields {
		if f.set&(1<<i) != 0 {
			t.vals[i] = f.vals[i]
		}
	}
	t.set |= f.set
	// A floor: Anthropic's message_start, or a Gemini stream's event
	// before its last (only its last reports candidatesTokenCount; the
	// ones before report the prompt, and a total without the answer).
	t.partial = where == usageMessage || where == usageGemini && (b.sse || b.array > 0) && f.set&(1<<fieldOutput) == 0
}

// The counts of a usage object.
const (
	fieldInput = iota
	fieldOutput
	fieldCacheCreation
	fieldCacheRead
	fieldTotal
	fieldThoughts      // Gemini's thoughtsTokenCount
	fieldToolUsePrompt // Gemini's toolUsePromptTokenCount
	numFields
)

type usageFields struct {
	vals [numFields]int64
	set  uint8 // bit i: vals[i] was reported
}

// tally is the usage read so far.
type tally struct {
	usageFields
	invalid bool
	partial bool
	reports int // top-level usage members of a JSON body
}

// fieldOf returns the count a usage member's name (raw JSON string) is,
// or -1: of OpenAI's and Anthropic's usage object, or of Gemini's
// usageMetadata when gemini.
func fieldOf(name []byte, gemini bool) int {
	var buf [40]byte
	s, ok := unquoteName(name, buf[:0])
	if !ok {
		return -1
	}
	if gemini {
		switch string(s) {
		case "promptTokenCount":
			return fieldInput
		case "candidatesTokenCount":
			return fieldOutput
		case "thoughtsTokenCount":
			return fieldThoughts
		case "toolUsePromptTokenCount":
			return fieldToolUsePrompt
		case "totalTokenCount":
			return fieldTotal
		}
		return -1
	}
	switch string(s) {
	case "prompt_tokens", "input_tokens", "inputTokens":
		return fieldInput
	case "completion_tokens", "output_tokens", "outputTokens":
		return fieldOutput
	case "cache_creation_input_tokens", "cacheWriteInputTokens":
		return fieldCacheCreation
	case "cache_read_input_tokens", "cacheReadInputTokens":
		return fieldCacheRead
	case "total_tokens", "totalTokens":
		return fieldTotal
	}
	return -1
}

// unquoteName returns the value of a JSON string (with its quotes) that is
// short enough to be a name we look for, appended to dst; ok is false for
// an invalid or longer string. It does not allocate when dst has room.
func unquoteName(raw, dst []byte) ([]byte, bool) {
	if len(raw) < 2 || len(raw) > 2+cap(dst)*6 {
		return nil, false
	}
	if bytes.IndexByte(raw, '\\') < 0 {
		s := raw[1 : len(raw)-1]
		return s, len(s) <= cap(dst)
	}
	s, err := jsontext.AppendUnquote(dst, raw)
	return s, err == nil && len(s) <= cap(dst)
}

// parseUsage reads a usage value with the JSON decoder: null or an object
// whose known members (see fieldOf) are null or valid counts (see
// parseCount); unknown members may be anything. A count named twice
// (prompt_tokens and input_tokens, say) must agree. It reports false for
// anything else.
func (b *usageBody) parseUsage(raw []byte, gemini bool, f *usageFields) bool {
	d := b.decoder(raw)
	switch d.PeekKind() {
	case 'n':
		if _, err := d.ReadToken(); err != nil {
			return false
		}
	case '{':
		if _, err := d.ReadToken(); err != nil {
			return false
		}
		for d.PeekKind() == '"' {
			name, err := d.ReadValue()
			if err != nil {
				return false
			}
			i := fieldOf(name, gemini)
			v, err := d.ReadValue()
			if err != nil {
				return false
			}
			if i < 0 || v.Kind() == 'n' {
				continue
			}
			if v.Kind() != '0' {
				return false
			}
			n, ok := parseCount(v)
			if !ok || (f.set&(1<<i) != 0 && f.vals[i] != n) {
				return false
			}
			f.vals[i] = n
			f.set |= 1 << i
		}
		if _, err := d.ReadToken(); err != nil { // the closing brace
			return false
		}
	default:
		return false
	}
	_, err := d.ReadToken()
	return err == io.EOF // nothing after the value
}

// decoder returns the reader's JSON decoder, reset to read raw.
func (b *usageBody) decoder(raw []byte) *jsontext.Decoder {
	if b.dec == nil {
		b.dec = jsontext.NewDecoder(&b.buf)
	}
	b.buf.Reset()
	b.buf.Write(raw)
	b.dec.Reset(&b.buf)
	return b.dec
}

// parseCountMember reads the value of a top-level count member (Ollama's
// prompt_eval_count and eval_count) as the count i: null (not reported)
// or a valid count (see parseCount). It reports false for anything else.
func (b *usageBody) parseCountMember(raw []byte, i int, f *usageFields) bool {
	d := b.decoder(raw)
	v, err := d.ReadValue()
	if err != nil {
		return false
	}
	if _, err := d.ReadToken(); err != io.EOF { // nothing after the value
		return false
	}
	switch v.Kind() {
	case 'n':
		return true
	case '0':
		n, ok := parseCount(v)
		f.vals[i], f.set = n, 1<<i
		return ok
	}
	return false
}

// parseCount returns the token count a JSON number (valid per RFC 8259)
// is. A count is valid when its exact value is an integer from 0 to
// MaxTokenCount: 320, 320.0, 3.2e2 and -0 are valid; -1, 1.5, 1e-3 and
// 1e16 are not. Exponents are read exactly, not through a float, so no
// rounding turns a fraction into an integer.
func parseCount(b []byte) (int64, bool) {
	neg := len(b) > 0 && b[0] == '-'
	if neg {
		b = b[1:]
	}
	// The value is sig * 10^(zeros - frac + exp): sig is the significant
	// digits without their trailing zeros, zeros the count of those.
	var sig uint64
	zeros, frac, i := 0, 0, 0
	inFrac := false
	for ; i < len(b); i++ {
		c := b[i]
		switch {
		case c == '.':
			inFrac = true
			continue
		case c < '0' || c > '9':
		case c == '0':
			if sig != 0 {
				zeros++
			}
			if inFrac {
				frac++
			}
			continue
		default:
			for ; zeros > 0; zeros-- {
				if sig *= 10; sig > MaxTokenCount {
					return 0, false
				}
			}
			if sig = sig*10 + uint64(c-'0'); sig > MaxTokenCount {
				return 0, false
			}
			if inFrac {
				frac++
			}
			continue
		}
		break
	}
	exp := 0
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		eneg := false
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			eneg = b[i] == '-'
			i++
		}
		for ; i < len(b); i++ {
			if exp < 1000 { // saturate: any larger exponent is out of range
				exp = exp*10 + int(b[i]-'0')
			}
		}
		if eneg {
			exp = -exp
		}
	}
	if sig == 0 {
		return 0, true
	}
	if neg {
		return 0, false
	}
	for k := zeros - frac + exp; k != 0; k-- {
		if k < 0 {
			return 0, false // a fraction: the last significant digit is not 0
		}
		if sig *= 10; sig > MaxTokenCount {
			return 0, false
		}
	}
	return int64(sig), true
}
