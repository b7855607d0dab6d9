package tokenbucket

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
)

// Default sizes of what a settlement keeps of a response for parsing.
const (
	DefaultSettleHead = 8 << 10
	DefaultSettleTail = 64 << 10
)

// Settle reads a response's actual LLM token usage and charges or gives
// back the difference from the request's estimated cost against the same
// tokens buckets, in one script call, once per request. Usage is read from
// the configured response header, else from the body: usage.total_tokens,
// else prompt_tokens + completion_tokens (OpenAI), else input_tokens +
// output_tokens (Anthropic), in a JSON body or in the events of a
// text/event-stream (OpenAI's final usage chunk with
// stream_options.include_usage; the Responses API's response.completed;
// Anthropic's message_start and message_delta). The response passes through unbuffered; only the first
// 8 KiB and the last 64 KiB are kept for parsing. A response with no usage
// settles at the estimate (nothing changes).
type Settle struct {
	// Header names a response header that carries the total tokens used;
	// when set, the body is not parsed.
	Header string `json:"header,omitempty"`
	// IncludeUsage makes OpenAI-style streams report their usage: a request
	// with "stream": true that does not ask for usage reaches the upstream
	// with "stream_options":{"include_usage":true} added (every other byte
	// unchanged), and the client receives the stream it asked for: the
	// usage-only final chunk ("choices":[]) and the "usage":null member of
	// the other chunks are taken out. Without it such a stream reports no
	// usage and settles at the estimate. Needs estimate, which reads the
	// body.
	IncludeUsage bool `json:"include_usage,omitempty"`
}

// usage is the usage object of OpenAI and Anthropic responses.
type usage struct {
	TotalTokens      int64 `json:"total_tokens"`
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	InputTokens      int64 `json:"input_tokens"`
	OutputTokens     int64 `json:"output_tokens"`
}

func (u *usage) total() int64 {
	switch {
	case u.TotalTokens > 0:
		return u.TotalTokens
	case u.PromptTokens+u.CompletionTokens > 0:
		return u.PromptTokens + u.CompletionTokens
	default:
		return u.InputTokens + u.OutputTokens
	}
}

// recorder passes a response through and keeps its head and tail.
type recorder struct {
	http.ResponseWriter
	head, tail []byte
	tailCap    int
	truncated  bool
}

func (rec *recorder) Write(p []byte) (int, error) {
	n, err := rec.ResponseWriter.Write(p)
	rec.keep(p[:n])
	return n, err
}

// Unwrap lets http.ResponseController reach Flush and the rest.
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.ResponseWriter }

func (rec *recorder) keep(p []byte) {
	if room := DefaultSettleHead - len(rec.head); room > 0 {
		k := min(room, len(p))
		rec.head = append(rec.head, p[:k]...)
		p = p[k:]
	}
	if len(p) == 0 {
		return
	}
	rec.tail = append(rec.tail, p...)
	// Drop the oldest bytes only once a quarter of tailCap is over, so a
	// long stream of small writes copies the tail once per 16 KiB, not once
	// per write.
	if len(rec.tail) > rec.tailCap+rec.tailCap/4 {
		rec.trim()
	}
}

// trim keeps the last tailCap bytes of the tail.
func (rec *recorder) trim() {
	if over := len(rec.tail) - rec.tailCap; over > 0 {
		rec.tail = append(rec.tail[:0], rec.tail[over:]...)
		rec.truncated = true
	}
}

// used returns the tokens the response reports, and whether it reports any.
func (s *Settle) used(rec *recorder) (int64, bool) {
	if s.Header != "" {
		n, err := strconv.ParseInt(strings.TrimSpace(rec.Header().Get(s.Header)), 10, 64)
		return n, err == nil && n >= 0
	}
	rec.trim()
	if strings.HasPrefix(rec.Header().Get("Content-Type"), "text/event-stream") {
		if !rec.truncated {
			// Head and tail are one run of bytes: an event across their
			// border must be read whole.
			return streamUsage(append(append([]byte(nil), rec.head...), rec.tail...), nil)
		}
		return streamUsage(rec.head, rec.tail)
	}
	if !rec.truncated {
		var body struct{ Usage *usage }
		if json.Unmarshal(append(append([]byte(nil), rec.head...), rec.tail...), &body) == nil && body.Usage != nil {
			return body.Usage.total(), true
		}
		return 0, false
	}
	// A long body: the usage object is at its end.
	i := bytes.LastIndex(rec.tail, []byte(`"usage"`))
	if i < 0 {
		return 0, false
	}
	j := bytes.IndexByte(rec.tail[i:], '{')
	if j < 0 {
		return 0, false
	}
	var u usage
	if json.NewDecoder(bytes.NewReader(rec.tail[i+j:])).Decode(&u) != nil {
		return 0, false
	}
	return u.total(), true
}

// streamUsage reads usage from server-sent events: the last event with a
// usage total (OpenAI), or Anthropic's input_tokens from message_start plus
// the last output_tokens of message_delta.
func streamUsage(head, tail []byte) (int64, bool) {
	var total, input, output int64
	found := false
	for _, part := range [][]byte{head, tail} {
		for _, line := range bytes.Split(part, []byte("\n")) {
			data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:"))
			if !ok || !hasUsageObject(data) {
				continue
			}
			var ev struct {
				Usage   *usage `json:"usage"`
				Message struct {
					Usage *usage `json:"usage"`
				} `json:"message"`
				Response struct {
					Usage *usage `json:"usage"`
				} `json:"response"`
			}
			if json.Unmarshal(bytes.TrimSpace(data), &ev) != nil {
				continue
			}
			if ev.Usage == nil {
				ev.Usage = ev.Response.Usage // Responses API: response.completed
			}
			if u := ev.Message.Usage; u != nil && u.InputTokens > 0 {
				input, found = u.InputTokens, true
			}
			if u := ev.Usage; u != nil {
				if u.OutputTokens > 0 || u.InputTokens > 0 {
					input, output, found = max(input, u.InputTokens), u.OutputTokens, true
				}
				if t := u.TotalTokens + u.PromptTokens + u.CompletionTokens; t > 0 {
					total, found = u.total(), true
				}
			}
		}
	}
	if total > 0 {
		return total, true
	}
	return input + output, found
}

// hasUsageObject reports whether data has "usage": followed by an object,
// so that the chunks of an OpenAI stream with "usage":null (all but the
// last, with include_usage) are not parsed.
func hasUsageObject(data []byte) bool {
	for {
		i := bytes.Index(data, []byte(`"usage"`))
		if i < 0 {
			return false
		}
		data = data[i+len(`"usage"`):]
		rest := bytes.TrimLeft(data, " \t")
		if len(rest) > 0 && rest[0] == ':' {
			if rest = bytes.TrimLeft(rest[1:], " \t"); len(rest) > 0 && rest[0] == '{' {
				return true
			}
		}
	}
}

// settle charges or gives back the difference between the request's
// estimate and the usage its response reports, after the response.
func (h *Handler) settle(r *http.Request, repl *caddy.Replacer, req *request, rec *recorder) {
	used, ok := h.Settle.used(rec)
	if !ok {
		return // no usage reported: the estimate stands
	}
	var keys []string
	var adj []bucket.Adjust
	for i, l := range req.limits {
		if l.tokens {
			if delta := used - req.takes[i].Cost; delta != 0 {
				keys, adj = append(keys, req.keys[i]), append(adj, bucket.Adjust{Spec: l.spec, Delta: delta})
			}
		}
	}
	repl.Set("http.token_bucket.tokens_used", used)
	if len(keys) == 0 {
		return
	}
	id, _ := repl.GetString("http.request.uuid")
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), h.conn.timeout)
	defer cancel()
	if _, err := h.conn.settle(ctx, id, keys, adj); err != nil {
		h.logger.Warn("settling llm token usage failed; the estimate stands",
			zap.Int64("used", used), zap.Error(err))
		return
	}
	if h.denials != nil && adj[0].Delta < 0 {
		for _, k := range keys {
			h.denials.Forget(k) // tokens came back: let Redis decide again
		}
	}
}

// settler is a store that can settle.
type settler interface {
	Settle(ctx context.Context, id string, keys []string, adj []bucket.Adjust) (bool, error)
}

func (c *conn) settle(ctx context.Context, id string, keys []string, adj []bucket.Adjust) (bool, error) {
	s, ok := c.store.(settler)
	if !ok {
		return false, nil
	}
	start := time.Now()
	defer observeRedisCall(start)
	return s.Settle(ctx, id, keys, adj)
}
