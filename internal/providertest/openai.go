package providertest

import (
	"bytes"
	"cmp"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"mime"
	"mime/multipart"
	"net/http"
	"time"
)

// OpenAI's answers, as its API reference documents them.

const systemFingerprint = "fp_providertest"

// modelOf is the model an answer names: the request's, else a default.
func modelOf(req *Request, deflt string) string {
	if req.Model != "" {
		return req.Model
	}
	return deflt
}

type chatUsage struct {
	PromptTokens            int64          `json:"prompt_tokens"`
	CompletionTokens        int64          `json:"completion_tokens"`
	TotalTokens             int64          `json:"total_tokens"`
	PromptTokensDetails     promptDetails  `json:"prompt_tokens_details"`
	CompletionTokensDetails completionDets `json:"completion_tokens_details"`
}

type promptDetails struct {
	CachedTokens int64 `json:"cached_tokens"`
	AudioTokens  int64 `json:"audio_tokens"`
}

type completionDets struct {
	ReasoningTokens          int64 `json:"reasoning_tokens"`
	AudioTokens              int64 `json:"audio_tokens"`
	AcceptedPredictionTokens int64 `json:"accepted_prediction_tokens"`
	RejectedPredictionTokens int64 `json:"rejected_prediction_tokens"`
}

func newChatUsage(u *Usage) *chatUsage {
	if u == nil {
		return nil
	}
	return &chatUsage{
		PromptTokens:            u.Input,
		CompletionTokens:        u.Output,
		TotalTokens:             u.Input + u.Output,
		PromptTokensDetails:     promptDetails{CachedTokens: u.Cached},
		CompletionTokensDetails: completionDets{ReasoningTokens: u.Reasoning},
	}
}

type chatMessage struct {
	Role        string  `json:"role"`
	Content     string  `json:"content"`
	Refusal     *string `json:"refusal"`
	Annotations []any   `json:"annotations"`
}

type chatChoice struct {
	Index        int         `json:"index"`
	Message      chatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason string      `json:"finish_reason"`
}

type chatCompletion struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	Choices           []chatChoice `json:"choices"`
	Usage             *chatUsage   `json:"usage,omitempty"`
	ServiceTier       string       `json:"service_tier"`
	SystemFingerprint string       `json:"system_fingerprint"`
}

func chatID(*Request) string { return "chatcmpl-test" }

// chatJSON is a chat.completion object.
func chatJSON(req *Request, rep *Reply, now int64) []byte {
	return mustJSON(chatCompletion{
		ID:      chatID(req),
		Object:  "chat.completion",
		Created: now,
		Model:   modelOf(req, "gpt-4o-mini"),
		Choices: []chatChoice{{
			Message:      chatMessage{Role: "assistant", Content: rep.Text, Annotations: []any{}},
			FinishReason: "stop",
		}},
		Usage:             newChatUsage(rep.Usage),
		ServiceTier:       "default",
		SystemFingerprint: systemFingerprint,
	})
}

type chunkChoice struct {
	Index        int             `json:"index"`
	Delta        json.RawMessage `json:"delta"`
	Logprobs     any             `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type chatChunk struct {
	ID                string          `json:"id"`
	Object            string          `json:"object"`
	Created           int64           `json:"created"`
	Model             string          `json:"model"`
	ServiceTier       string          `json:"service_tier"`
	SystemFingerprint string          `json:"system_fingerprint"`
	Choices           []chunkChoice   `json:"choices"`
	Usage             json.RawMessage `json:"usage,omitempty"`
}

// chatStream is a chat.completion.chunk stream: a first chunk with the
// role, one chunk per word, a chunk with the finish reason and an empty
// delta, then data: [DONE]. Only when the request sets
// stream_options.include_usage does every chunk carry "usage":null and a
// last chunk with no choices carry the usage, before [DONE].
func chatStream(req *Request, rep *Reply, now int64) []event {
	withUsage := req.IncludeUsage
	chunk := func(choices []chunkChoice, usage json.RawMessage) string {
		c := chatChunk{
			ID: chatID(req), Object: "chat.completion.chunk", Created: now,
			Model: modelOf(req, "gpt-4o-mini"), ServiceTier: "default", SystemFingerprint: systemFingerprint,
			Choices: choices,
		}
		if withUsage {
			c.Usage = usage
		}
		return "data: " + string(mustJSON(c)) + "\n\n"
	}
	null := json.RawMessage("null")
	delta := func(d string, finish *string) []chunkChoice {
		return []chunkChoice{{Delta: json.RawMessage(d), FinishReason: finish}}
	}
	events := []event{{text: chunk(delta(`{"role":"assistant","content":"","refusal":null}`, nil), null)}}
	for _, w := range words(rep.Text) {
		events = append(events, event{text: chunk(delta(`{"content":`+string(mustJSON(w))+`}`, nil), null)})
	}
	stop := "stop"
	events = append(events, event{text: chunk(delta(`{}`, &stop), null)})
	if withUsage && rep.Usage != nil {
		events = append(events, event{text: chunk([]chunkChoice{}, mustJSON(newChatUsage(rep.Usage))), usage: true})
	}
	return append(events, event{text: "data: [DONE]\n\n", end: true})
}

// The Responses API.

type responsesUsage struct {
	InputTokens         int64 `json:"input_tokens"`
	InputTokensDetails  any   `json:"input_tokens_details"`
	OutputTokens        int64 `json:"output_tokens"`
	OutputTokensDetails any   `json:"output_tokens_details"`
	TotalTokens         int64 `json:"total_tokens"`
}

func newResponsesUsage(u *Usage) *responsesUsage {
	if u == nil {
		return nil
	}
	return &responsesUsage{
		InputTokens:         u.Input,
		InputTokensDetails:  map[string]int64{"cached_tokens": u.Cached},
		OutputTokens:        u.Output,
		OutputTokensDetails: map[string]int64{"reasoning_tokens": u.Reasoning},
		TotalTokens:         u.Input + u.Output,
	}
}

type outputText struct {
	Type        string `json:"type"`
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
	Logprobs    []any  `json:"logprobs"`
}

type outputMessage struct {
	ID      string       `json:"id"`
	Type    string       `json:"type"`
	Status  string       `json:"status"`
	Content []outputText `json:"content"`
	Role    string       `json:"role"`
}

type response struct {
	ID                 string          `json:"id"`
	Object             string          `json:"object"`
	CreatedAt          int64           `json:"created_at"`
	Status             string          `json:"status"`
	Error              any             `json:"error"`
	IncompleteDetails  any             `json:"incomplete_details"`
	Instructions       any             `json:"instructions"`
	MaxOutputTokens    any             `json:"max_output_tokens"`
	Model              string          `json:"model"`
	Output             []outputMessage `json:"output"`
	ParallelToolCalls  bool            `json:"parallel_tool_calls"`
	PreviousResponseID any             `json:"previous_response_id"`
	Store              bool            `json:"store"`
	Temperature        float64         `json:"temperature"`
	ToolChoice         string          `json:"tool_choice"`
	Tools              []any           `json:"tools"`
	TopP               float64         `json:"top_p"`
	Truncation         string          `json:"truncation"`
	Usage              *responsesUsage `json:"usage"`
	Metadata           map[string]any  `json:"metadata"`
}

func responseIDs(*Request) (resp, msg string) {
	return "resp_test", "msg_test"
}

// newResponse is a response object; completed ones carry the text and the
// usage, others (response.created, response.in_progress) neither.
func newResponse(req *Request, rep *Reply, now int64, completed bool) response {
	id, msgID := responseIDs(req)
	r := response{
		ID: id, Object: "response", CreatedAt: now, Status: "in_progress",
		Model: modelOf(req, "gpt-4o-mini"), Output: []outputMessage{}, ParallelToolCalls: true, Store: true,
		Temperature: 1, ToolChoice: "auto", Tools: []any{}, TopP: 1, Truncation: "disabled",
		Metadata: map[string]any{},
	}
	if completed {
		r.Status = "completed"
		r.Output = []outputMessage{{ID: msgID, Type: "message", Status: "completed", Role: "assistant",
			Content: []outputText{{Type: "output_text", Text: rep.Text, Annotations: []any{}, Logprobs: []any{}}}}}
		r.Usage = newResponsesUsage(rep.Usage)
	}
	return r
}

func responsesJSON(req *Request, rep *Reply, now int64) []byte {
	return mustJSON(newResponse(req, rep, now, true))
}

// responsesStream is the Responses API's stream of typed events, each with
// its event: line: response.created, response.in_progress, the output item
// and content part, one response.output_text.delta per word, the done
// events, and response.completed, whose response carries the usage. It
// has no [DONE].
func responsesStream(req *Request, rep *Reply, now int64) []event {
	_, msgID := responseIDs(req)
	seq := 0
	ev := func(typ string, fields ...any) string {
		data := obj(append([]any{"type", typ, "sequence_number", seq}, fields...)...)
		seq++
		return "event: " + typ + "\ndata: " + string(data) + "\n\n"
	}
	part := func(text string) outputText {
		return outputText{Type: "output_text", Text: text, Annotations: []any{}, Logprobs: []any{}}
	}
	item := func(status string, content ...outputText) json.RawMessage {
		return obj("id", msgID, "type", "message", "status", status, "content", append([]outputText{}, content...), "role", "assistant")
	}
	text := rep.Text
	events := []event{
		{text: ev("response.created", "response", newResponse(req, rep, now, false))},
		{text: ev("response.in_progress", "response", newResponse(req, rep, now, false))},
		{text: ev("response.output_item.added", "output_index", 0, "item", item("in_progress"))},
		{text: ev("response.content_part.added", "item_id", msgID, "output_index", 0, "content_index", 0, "part", part(""))},
	}
	for _, w := range words(text) {
		events = append(events, event{text: ev("response.output_text.delta",
			"item_id", msgID, "output_index", 0, "content_index", 0, "delta", w, "logprobs", []any{})})
	}
	events = append(events,
		event{text: ev("response.output_text.done", "item_id", msgID, "output_index", 0, "content_index", 0, "text", text, "logprobs", []any{})},
		event{text: ev("response.content_part.done", "item_id", msgID, "output_index", 0, "content_index", 0, "part", part(text))},
		event{text: ev("response.output_item.done", "output_index", 0, "item", item("completed", part(text)))},
		event{text: ev("response.completed", "response", newResponse(req, rep, now, true)), usage: rep.Usage != nil},
	)
	return events
}

// obj is a JSON object of name, value pairs in the order given, as the
// providers write their events.
func obj(kv ...any) json.RawMessage {
	var b bytes.Buffer
	b.WriteByte('{')
	for i := 0; i+1 < len(kv); i += 2 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.Write(mustJSON(kv[i].(string)))
		b.WriteByte(':')
		b.Write(mustJSON(kv[i+1]))
	}
	b.WriteByte('}')
	return b.Bytes()
}

// Embeddings.

// embeddingDims is the length of every embedding the server returns.
const embeddingDims = 8

type embedding struct {
	Object    string `json:"object"`
	Index     int    `json:"index"`
	Embedding any    `json:"embedding"`
}

// embeddingsJSON is a list of one embedding per input, as floats or, with
// encoding_format base64 (what the openai SDK asks for by default), as the
// base64 of little-endian float32s; usage has prompt_tokens and
// total_tokens.
func embeddingsJSON(req *Request, rep *Reply) []byte {
	data := make([]embedding, max(1, req.Inputs))
	for i := range data {
		vec := make([]float32, embeddingDims)
		for j := range vec {
			vec[j] = float32(i+1) / float32(j+2)
		}
		var v any = vec
		if req.EncodingFormat == "base64" {
			b := make([]byte, 4*len(vec))
			for j, f := range vec {
				binary.LittleEndian.PutUint32(b[4*j:], math.Float32bits(f))
			}
			v = base64.StdEncoding.EncodeToString(b)
		}
		data[i] = embedding{Object: "embedding", Index: i, Embedding: v}
	}
	out := struct {
		Object string      `json:"object"`
		Data   []embedding `json:"data"`
		Model  string      `json:"model"`
		Usage  any         `json:"usage,omitempty"`
	}{Object: "list", Data: data, Model: modelOf(req, "text-embedding-3-small")}
	if rep.Usage != nil {
		out.Usage = map[string]int64{"prompt_tokens": rep.Usage.Input, "total_tokens": rep.Usage.Input}
	}
	return mustJSON(out)
}

// formCall answers a video generation or a Realtime call's offer as
// OpenAI does: the form is read (multipart, or a bare SDP offer for a
// call); a form without its required field (prompt; sdp) is a 400
// invalid_request_error; a video is answered with its queued job, a call
// with 201 Created, its SDP answer and its Location. Neither reports usage.
func (a *answer) formCall() {
	fields := map[string]string{}
	mt, params, _ := mime.ParseMediaType(a.r.Header.Get("Content-Type"))
	switch {
	case mt == "multipart/form-data":
		form, err := multipart.NewReader(bytes.NewReader(a.req.Body), params["boundary"]).ReadForm(1 << 20)
		if err != nil {
			a.error(http.StatusBadRequest, "", "", "Could not parse multipart form: "+err.Error())
			return
		}
		for name, values := range form.Value {
			fields[name] = values[len(values)-1]
		}
		for name, files := range form.File {
			fields[name] = files[len(files)-1].Filename
		}
	case mt == "application/sdp" && a.req.API == RealtimeCalls:
		fields["sdp"] = string(a.req.Body)
	}
	required := "prompt"
	if a.req.API == RealtimeCalls {
		required = "sdp"
	}
	if fields[required] == "" {
		a.error(http.StatusBadRequest, "", "missing_required_parameter", fmt.Sprintf("Missing required parameter: '%s'.", required))
		return
	}
	if a.req.API == RealtimeCalls {
		h := a.w.Header()
		h.Set("Content-Type", "application/sdp")
		h.Set("Location", "/v1/realtime/calls/rtc_test")
		a.w.WriteHeader(http.StatusCreated)
		io.WriteString(a.w, "v=0\r\no=- 4611731400430051336 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n")
		return
	}
	seconds, size := cmp.Or(fields["seconds"], "4"), cmp.Or(fields["size"], "720x1280")
	a.json(http.StatusOK, obj("id", "video_test", "object", "video", "created_at", time.Now().Unix(), "status", "queued",
		"model", cmp.Or(fields["model"], "sora-2"), "progress", 0, "seconds", seconds, "size", size))
}
