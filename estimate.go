package tokenbucket

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
)

// Defaults and bounds of the cost estimator.
const (
	DefaultEstimateMaxBody = 1 << 20
	// MaxEstimateBody is the largest max_body: 1 GiB.
	MaxEstimateBody          = 1 << 30
	DefaultEstimateMaxTokens = 1024
	// DefaultEstimateReadTimeout bounds the time the whole body may take to
	// arrive.
	DefaultEstimateReadTimeout = 10 * time.Second
	// CharsPerToken is the estimator's rule of thumb: one token per four
	// characters of English text (OpenAI's own guidance), rounded up.
	CharsPerToken = 4
	// ImagePartTokens is what a non-text content part (an image) counts:
	// the base cost of a low-detail image in OpenAI's pricing.
	ImagePartTokens = 85
)

// Estimate estimates the LLM tokens of an OpenAI-compatible or
// Anthropic-style request body before it is sent: the prompt tokens
// ⌈characters / 4⌉ over every text in system, messages (string content or
// text parts) and prompt, plus 85 per non-text part, plus the completion
// budget: max_completion_tokens, else max_tokens, else DefaultMaxTokens.
// The body is read once, up to MaxBody bytes, and given back whole to the
// next handler.
type Estimate struct {
	// MaxBody is the largest body read, in bytes (default 1 MiB). A larger
	// body is invalid.
	MaxBody int64 `json:"max_body,omitempty"`
	// DefaultMaxTokens is the completion budget of a request that sets
	// neither max_tokens nor max_completion_tokens (default 1024).
	DefaultMaxTokens int64 `json:"default_max_tokens,omitempty"`
	// OnInvalid is the cost of a body that is not JSON, not an object, or
	// too large: -1 (the default) answers 400 invalid_body instead. A cost
	// here lets a client choose it: any body padded past max_body is
	// charged this, whatever its max_tokens; see README.
	OnInvalid *int64 `json:"on_invalid,omitempty"`
	// Tokenizer counts the tokens of the body's texts: "approx" (the
	// default: ⌈UTF-8 bytes / 4⌉ per text, OpenAI's rule of thumb for
	// English, which over-counts most other text rather than under-counts
	// it), "o200k_base" (the encoding of GPT-4o, GPT-4.1 and the o-series)
	// or "cl100k_base" (GPT-4, GPT-3.5). The BPE vocabularies are built in;
	// nothing is downloaded.
	Tokenizer string `json:"tokenizer,omitempty"`
	// ReadTimeout bounds the time the request body may take to arrive
	// (default 10s): a body that trickles in is answered 408
	// request_timeout instead of holding its goroutine and buffer. Caddy's
	// own servers { timeouts { read_body } } bounds every body as well.
	ReadTimeout caddy.Duration `json:"read_timeout,omitempty"`
}

// Names of estimate.tokenizer.
const (
	TokenizerApprox = "approx"
	TokenizerO200k  = "o200k_base"
	TokenizerCl100k = "cl100k_base"
)

var (
	errInvalidBody = errors.New("request body is not a JSON chat or completion request within the size limit")
	errBodyTimeout = errors.New("request body did not arrive within estimate.read_timeout")
)

// tokenEstimate is what the estimate makes of a request.
type tokenEstimate struct {
	prompt     int64 // the prompt's tokens
	completion int64 // the completion budget: the body's, else default_max_tokens
}

// cost is the charge of the estimate against tokens limits whose smallest
// capacity is capacity: prompt + completion, with the completion budget
// capped so that the charge fits that capacity. A request whose prompt
// fits is never denied as cost_exceeds_capacity because of
// default_max_tokens or a large max_tokens (LiteLLM's
// BerriAI/litellm#6938 class of bug: a budget larger than a TPM limit
// locked every such request out for good); only a prompt larger than the
// capacity alone is, since no wait can serve it. Settlement charges what
// the answer really used.
func (e tokenEstimate) cost(capacity int64) int64 {
	if e.prompt >= capacity {
		return e.prompt
	}
	return min(e.prompt+e.completion, capacity)
}

// estimate reads r's body, restores it, and estimates its tokens. A body
// that cannot be read is errInvalidBody, or, with on_invalid <cost>, an
// estimate of that cost with no completion budget; a body that does not
// arrive in time is errBodyTimeout.
func (e *Estimate) estimate(w http.ResponseWriter, r *http.Request) (tokenEstimate, error) {
	body, err := e.readBody(w, r)
	if err != nil {
		if err == errBodyTimeout {
			return tokenEstimate{}, err
		}
		return e.invalid()
	}
	prompt, budget, ok := estimateTokens(body, e.defaultMaxTokens())
	if !ok {
		return e.invalid()
	}
	return tokenEstimate{prompt: prompt, completion: budget}, nil
}

// readBody reads r's body, up to max_body bytes and within read_timeout,
// and gives it back to r whole for the next handler: what was read, then
// the unread rest. It fails with errInvalidBody for a missing body or one
// over max_body (told by Content-Length before any byte is read, where
// there is one), and errBodyTimeout when the body does not arrive in time.
// The deadline is set on the connection (http.ResponseController) and
// cleared once the read is done, so it never cuts the response short.
func (e *Estimate) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	limit := e.MaxBody
	if limit <= 0 {
		limit = DefaultEstimateMaxBody
	}
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength > limit {
		return nil, errInvalidBody
	}
	timeout := time.Duration(e.ReadTimeout)
	if timeout <= 0 {
		timeout = DefaultEstimateReadTimeout
	}
	rc := http.NewResponseController(w)
	timed := rc.SetReadDeadline(time.Now().Add(timeout)) == nil
	var body []byte
	var err error
	if r.ContentLength >= 0 {
		body = make([]byte, r.ContentLength)
		_, err = io.ReadFull(r.Body, body)
	} else {
		body, err = io.ReadAll(io.LimitReader(r.Body, limit+1))
	}
	if timed {
		_ = rc.SetReadDeadline(time.Time{})
	}
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, errBodyTimeout
		}
		return nil, errInvalidBody
	}
	rest := r.Body
	if int64(len(body)) > limit {
		// Only on_invalid <cost> lets such a body through: the rest comes
		// with the same deadline per read.
		if timed {
			rest = &deadlineReader{ReadCloser: rest, rc: rc, timeout: timeout}
		}
		r.Body = readCloser{io.MultiReader(bytes.NewReader(body), rest), rest}
		return nil, errInvalidBody
	}
	r.Body = readCloser{io.MultiReader(bytes.NewReader(body), rest), rest}
	return body, nil
}

// deadlineReader reads a request body with a read deadline of timeout from
// each read, cleared at its end.
type deadlineReader struct {
	io.ReadCloser
	rc      *http.ResponseController
	timeout time.Duration
}

func (d *deadlineReader) Read(p []byte) (int, error) {
	_ = d.rc.SetReadDeadline(time.Now().Add(d.timeout))
	n, err := d.ReadCloser.Read(p)
	if err != nil {
		_ = d.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}

func (e *Estimate) defaultMaxTokens() int64 {
	if e.DefaultMaxTokens > 0 {
		return e.DefaultMaxTokens
	}
	return DefaultEstimateMaxTokens
}

func (e *Estimate) invalid() (tokenEstimate, error) {
	if e.OnInvalid != nil && *e.OnInvalid >= 0 {
		return tokenEstimate{prompt: *e.OnInvalid}, nil
	}
	return tokenEstimate{}, errInvalidBody
}

type readCloser struct {
	io.Reader
	io.Closer
}

// llmRequest is the part of an OpenAI chat/completions or Anthropic
// messages request that the estimate reads.
type llmRequest struct {
	System              json.RawMessage `json:"system"`
	Messages            []llmMessage    `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	Input               json.RawMessage `json:"input"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	MaxOutputTokens     *int64          `json:"max_output_tokens"`
}

type llmMessage struct {
	Content json.RawMessage `json:"content"`
}

// estimateTokens applies the rule to a JSON body; ok is false when the body
// is not a JSON object or a budget is negative.
func estimateTokens(body []byte, defaultMax int64) (prompt, budget int64, ok bool) {
	// json.Unmarshal takes null for an object; the estimate does not.
	if b := bytes.TrimLeft(body, " \t\r\n"); len(b) == 0 || b[0] != '{' {
		return 0, 0, false
	}
	var req llmRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return 0, 0, false
	}
	var chars, parts int64
	count := func(raw json.RawMessage) {
		c, p := countContent(raw)
		chars, parts = chars+c, parts+p
	}
	count(req.System)
	count(req.Prompt)
	count(req.Input)
	for _, m := range req.Messages {
		count(m.Content)
	}
	budget = defaultMax
	for _, b := range []*int64{req.MaxOutputTokens, req.MaxTokens, req.MaxCompletionTokens} {
		if b != nil {
			budget = *b
		}
	}
	if budget < 0 || budget > MaxCost {
		return 0, 0, false
	}
	prompt = (chars+CharsPerToken-1)/CharsPerToken + parts*ImagePartTokens
	return min(prompt, MaxCost), budget, true
}

// countContent counts the characters of a content value: a string, an
// array of strings or of parts ({"type":"text","text":...} or another
// type, counted as one non-text part). Anything else counts nothing.
func countContent(raw json.RawMessage) (chars, parts int64) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return 0, 0
	}
	switch raw[0] {
	case '"':
		var s string
		if json.Unmarshal(raw, &s) == nil {
			return int64(utf8.RuneCountInString(s)), 0
		}
	case '[':
		var items []json.RawMessage
		if json.Unmarshal(raw, &items) != nil {
			return 0, 0
		}
		for _, it := range items {
			c, p := countPart(it)
			chars, parts = chars+c, parts+p
		}
	}
	return chars, parts
}

func countPart(raw json.RawMessage) (chars, parts int64) {
	raw = bytes.TrimSpace(raw)
	if len(raw) > 0 && raw[0] == '"' {
		return countContent(raw)
	}
	var p struct {
		Type    string          `json:"type"`
		Text    string          `json:"text"`
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(raw, &p) != nil {
		return 0, 0
	}
	if (p.Type == "" || p.Type == "message") && p.Content != nil {
		return countContent(p.Content) // a message in a Responses API input
	}
	if p.Type == "text" || p.Type == "input_text" || (p.Type == "" && p.Text != "") {
		return int64(utf8.RuneCountInString(p.Text)), 0
	}
	return 0, 1
}

func (e *Estimate) validate() error {
	if e == nil {
		return nil
	}
	if e.MaxBody < 0 || e.MaxBody > MaxEstimateBody {
		return fmt.Errorf("estimate.max_body %d: must be a size in bytes from 1 to %d (1 GiB), or 0 for the default", e.MaxBody, MaxEstimateBody)
	}
	if e.ReadTimeout < 0 {
		return fmt.Errorf("estimate.read_timeout %v: must be > 0, or 0 for the default", time.Duration(e.ReadTimeout))
	}
	switch e.Tokenizer {
	case "", TokenizerApprox, TokenizerO200k, TokenizerCl100k:
	default:
		return fmt.Errorf("estimate.tokenizer %q: must be %s, %s or %s", e.Tokenizer, TokenizerApprox, TokenizerO200k, TokenizerCl100k)
	}
	if e.DefaultMaxTokens < 0 || e.DefaultMaxTokens > MaxCost {
		return fmt.Errorf("estimate.default_max_tokens %d: must be from 1 to %d, or 0 for the default", e.DefaultMaxTokens, int64(MaxCost))
	}
	if e.OnInvalid != nil && (*e.OnInvalid < -1 || *e.OnInvalid > MaxCost) {
		return fmt.Errorf("estimate.on_invalid %d: must be a cost from 0 to %d, or -1 to reject", *e.OnInvalid, int64(MaxCost))
	}
	return nil
}
