package providertest

import (
	"encoding/json"
	"fmt"
)

// Anthropic's Messages API, as its reference documents it.

// anthropicUsage is a usage object of the Messages API; output is what
// it reports as output_tokens (1 in message_start).
func anthropicUsage(u *Usage, output int64) any {
	if u == nil {
		return nil
	}
	return obj(
		"input_tokens", u.Input,
		"cache_creation_input_tokens", u.CacheCreation,
		"cache_read_input_tokens", u.Cached,
		"cache_creation", obj("ephemeral_5m_input_tokens", u.CacheCreation, "ephemeral_1h_input_tokens", 0),
		"output_tokens", output,
		"service_tier", "standard",
	)
}

func messageID(*Request) string { return "msg_test" }

// message is a message object; without usage, it has no usage member.
func message(req *Request, content []any, stopReason any, usage any) json.RawMessage {
	kv := []any{
		"id", messageID(req),
		"type", "message",
		"role", "assistant",
		"model", modelOf(req, "claude-sonnet-4-5"),
		"content", content,
		"stop_reason", stopReason,
		"stop_sequence", nil,
	}
	if usage != nil {
		kv = append(kv, "usage", usage)
	}
	return obj(kv...)
}

func messagesJSON(req *Request, rep *Reply) json.RawMessage {
	var out int64
	if rep.Usage != nil {
		out = rep.Usage.Output
	}
	return message(req, []any{obj("type", "text", "text", rep.Text)}, "end_turn", anthropicUsage(rep.Usage, out))
}

// messagesStream is a Messages stream: message_start (its message's usage
// has the input and cache tokens and output_tokens 1), a text content
// block (content_block_start, a ping, one content_block_delta per word,
// content_block_stop), message_delta with the cumulative output_tokens,
// and message_stop.
func messagesStream(req *Request, rep *Reply) []event {
	ev := func(name string, data []byte) string {
		return "event: " + name + "\ndata: " + string(data) + "\n\n"
	}
	events := []event{
		{text: ev("message_start", obj("type", "message_start", "message",
			message(req, []any{}, nil, anthropicUsage(rep.Usage, 1))))},
		{text: ev("content_block_start", obj("type", "content_block_start", "index", 0,
			"content_block", obj("type", "text", "text", "")))},
		{text: ev("ping", []byte(`{"type": "ping"}`))},
	}
	for _, w := range words(rep.Text) {
		events = append(events, event{text: ev("content_block_delta", obj("type", "content_block_delta", "index", 0,
			"delta", obj("type", "text_delta", "text", w)))})
	}
	delta := []any{"type", "message_delta", "delta", obj("stop_reason", "end_turn", "stop_sequence", nil)}
	if rep.Usage != nil {
		delta = append(delta, "usage", obj("output_tokens", rep.Usage.Output))
	}
	events = append(events,
		event{text: ev("content_block_stop", obj("type", "content_block_stop", "index", 0))},
		event{text: ev("message_delta", obj(delta...)), usage: rep.Usage != nil},
		event{text: ev("message_stop", obj("type", "message_stop")), end: true},
	)
	return events
}

// messageBatch answers a Message Batch's creation as the API does: 200
// with the batch, in_progress, every request processing, and no usage
// (its requests run later; their usage is in the batch's results). As
// the API, it refuses a batch without requests, or one whose request
// lacks a custom_id or params: 400 invalid_request_error.
func (a *answer) messageBatch() {
	var b struct {
		Requests []struct {
			CustomID *string         `json:"custom_id"`
			Params   json.RawMessage `json:"params"`
		} `json:"requests"`
	}
	if err := json.Unmarshal(a.req.Body, &b); err != nil || len(b.Requests) == 0 {
		a.error(400, "invalid_request_error", "", "requests: Field required")
		return
	}
	for i, r := range b.Requests {
		if r.CustomID == nil || len(r.Params) == 0 || r.Params[0] != '{' {
			a.error(400, "invalid_request_error", "", fmt.Sprintf("requests.%d: custom_id and params are required", i))
			return
		}
	}
	a.json(200, obj(
		"id", "msgbatch_test",
		"type", "message_batch",
		"processing_status", "in_progress",
		"request_counts", obj("processing", len(b.Requests), "succeeded", 0, "errored", 0, "canceled", 0, "expired", 0),
		"ended_at", nil,
		"created_at", "2026-12-01T00:00:00Z",
		"expires_at", "2026-12-02T00:00:00Z",
		"archived_at", nil,
		"cancel_initiated_at", nil,
		"results_url", nil,
	))
}

// sessionEvents answers events sent to an agent session as the API does:
// 200 with the events sent, each given an id, and no usage (the session
// runs them later; its usage is the session's). It refuses a body without
// events, or an event without a type: 400 invalid_request_error.
func (a *answer) sessionEvents() {
	var b struct {
		Events []map[string]any `json:"events"`
	}
	if err := json.Unmarshal(a.req.Body, &b); err != nil || len(b.Events) == 0 {
		a.error(400, "invalid_request_error", "", "events: Field required")
		return
	}
	data := make([]any, len(b.Events))
	for i, e := range b.Events {
		if _, ok := e["type"].(string); !ok {
			a.error(400, "invalid_request_error", "", fmt.Sprintf("events.%d.type: Field required", i))
			return
		}
		e["id"] = fmt.Sprintf("sevt_test_%d", i+1)
		data[i] = e
	}
	a.json(200, obj("data", data))
}
