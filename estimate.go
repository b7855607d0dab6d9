package tokenbucket

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"unicode/utf8"
)

// Defaults of the cost estimator.
const (
	DefaultEstimateMaxBody   = 1 << 20
	DefaultEstimateMaxTokens = 1024
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
	// too large: -1 (the default) answers 400 invalid_body instead.
	OnInvalid *int64 `json:"on_invalid,omitempty"`
}

var errInvalidBody = errors.New("request body is not a JSON chat or completion request within the size limit")

// estimate reads r's body, restores it, and returns the estimated tokens.
func (e *Estimate) estimate(r *http.Request) (int64, error) {
	limit := e.MaxBody
	if limit <= 0 {
		limit = DefaultEstimateMaxBody
	}
	if r.Body == nil || r.Body == http.NoBody {
		return e.invalid()
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	rest := r.Body
	// Give the upstream every byte: what was read, then the unread rest.
	r.Body = readCloser{io.MultiReader(bytes.NewReader(body), rest), rest}
	if err != nil || int64(len(body)) > limit {
		return e.invalid()
	}
	n, ok := estimateTokens(body, e.defaultMaxTokens())
	if !ok {
		return e.invalid()
	}
	return n, nil
}

func (e *Estimate) defaultMaxTokens() int64 {
	if e.DefaultMaxTokens > 0 {
		return e.DefaultMaxTokens
	}
	return DefaultEstimateMaxTokens
}

func (e *Estimate) invalid() (int64, error) {
	if e.OnInvalid != nil && *e.OnInvalid >= 0 {
		return *e.OnInvalid, nil
	}
	return 0, errInvalidBody
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
func estimateTokens(body []byte, defaultMax int64) (n int64, ok bool) {
	// json.Unmarshal takes null for an object; the estimate does not.
	if b := bytes.TrimLeft(body, " \t\r\n"); len(b) == 0 || b[0] != '{' {
		return 0, false
	}
	var req llmRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return 0, false
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
	budget := defaultMax
	for _, b := range []*int64{req.MaxOutputTokens, req.MaxTokens, req.MaxCompletionTokens} {
		if b != nil {
			budget = *b
		}
	}
	if budget < 0 || budget > MaxCost {
		return 0, false
	}
	n = (chars+CharsPerToken-1)/CharsPerToken + parts*ImagePartTokens + budget
	return min(n, MaxCost), true
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
	if e.MaxBody < 0 {
		return fmt.Errorf("estimate.max_body %d: must be > 0", e.MaxBody)
	}
	if e.DefaultMaxTokens < 0 || e.DefaultMaxTokens > MaxCost {
		return fmt.Errorf("estimate.default_max_tokens %d: must be from 1 to %d", e.DefaultMaxTokens, int64(MaxCost))
	}
	if e.OnInvalid != nil && (*e.OnInvalid < -1 || *e.OnInvalid > MaxCost) {
		return fmt.Errorf("estimate.on_invalid %d: must be a cost from 0 to %d, or -1 to reject", *e.OnInvalid, int64(MaxCost))
	}
	return nil
}
