// Package providertest is an in-process stand-in for the LLM APIs that a
// token_bucket gateway sits in front of: OpenAI's chat completions,
// Responses and embeddings, and Anthropic's Messages, each answered as the
// provider documents it, as JSON or as server-sent events.
//
// The usage each answer reports is chosen by the test (SetUsage, SetReply),
// so a test knows exact totals. JSON answers are compressed when the
// request's Accept-Encoding allows a coding the server is set to use (gzip
// by default), with Content-Encoding and Vary: Accept-Encoding, as the real
// APIs do; streams are never compressed. Every request is recorded (path,
// headers, exact body bytes) for assertions. A reply can be an error in the
// provider's own shape, a stream can be held after its first event, and a
// stream can be cut right after its usage event, as an upstream that dies.
package providertest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// API is one of the endpoints the server answers.
type API string

// The endpoints, by path.
const (
	ChatCompletions API = "chat.completions" // POST /v1/chat/completions
	Responses       API = "responses"        // POST /v1/responses
	Embeddings      API = "embeddings"       // POST /v1/embeddings
	Messages        API = "messages"         // POST /v1/messages (Anthropic)
	CountTokens     API = "count_tokens"     // POST /v1/messages/count_tokens (Anthropic)
	Models          API = "models"           // GET /v1/models
	// Videos is a video generation (the SDK's videos.create: a form of
	// model, prompt, seconds, size and an optional input_reference file),
	// answered with the queued video job, which reports no usage.
	Videos API = "videos" // POST /v1/videos
	// RealtimeCalls is a Realtime call's WebRTC offer (the SDK's
	// realtime.calls.create: a bare application/sdp body, or a form of
	// sdp and session), answered 201 with an SDP answer and the call's
	// Location, which report no usage.
	RealtimeCalls API = "realtime.calls" // POST /v1/realtime/calls
	// RealtimeAccept accepts an incoming call (the SDK's
	// realtime.calls.accept: a JSON session configuration), answered
	// 200 with no body.
	RealtimeAccept API = "realtime.calls.accept" // POST /v1/realtime/calls/rtc_test/accept
	// Agents creates a managed agent's definition (Anthropic's
	// beta.agents.create: JSON), answered with the agent, which reports no
	// usage: it runs no model.
	Agents API = "agents" // POST /v1/agents (Anthropic)
	// DeploymentRun starts an agent deployment's session at once
	// (Anthropic's beta.deployments.run: a POST without a body), answered
	// with the run, which reports no usage.
	DeploymentRun API = "deployments.run" // POST /v1/deployments/depl_test/run (Anthropic)
	// MessageBatches creates a Message Batch (Anthropic's
	// messages.batches.create: JSON {"requests": [{"custom_id",
	// "params"}]}), answered with the batch in processing, which reports
	// no usage: its requests run later, their usage is in its results.
	MessageBatches API = "messages.batches" // POST /v1/messages/batches (Anthropic)
	// SessionEvents sends events to an agent session (Anthropic's
	// beta.sessions.events.send: JSON {"events": [...]}), answered with
	// the events as sent, which report no usage: the session runs them
	// later.
	SessionEvents API = "sessions.events" // POST /v1/sessions/sesn_test/events (Anthropic)
)

// apiOf maps a request path to its API; "" for a path the server does not
// answer.
func apiOf(path string) API {
	switch path {
	case "/v1/chat/completions":
		return ChatCompletions
	case "/v1/responses":
		return Responses
	case "/v1/embeddings":
		return Embeddings
	case "/v1/messages":
		return Messages
	case "/v1/messages/count_tokens":
		return CountTokens
	case "/v1/models":
		return Models
	case "/v1/videos":
		return Videos
	case "/v1/realtime/calls":
		return RealtimeCalls
	case "/v1/realtime/calls/rtc_test/accept":
		return RealtimeAccept
	case "/v1/agents":
		return Agents
	case "/v1/deployments/depl_test/run":
		return DeploymentRun
	case "/v1/messages/batches":
		return MessageBatches
	case "/v1/sessions/sesn_test/events":
		return SessionEvents
	}
	return ""
}

// method is the HTTP method of the API's requests.
func (a API) method() string {
	if a == Models {
		return http.MethodGet
	}
	return http.MethodPost
}

// Anthropic reports whether the API is Anthropic's (errors in its shape).
func (a API) Anthropic() bool {
	return a == Messages || a == CountTokens || a == Agents || a == DeploymentRun || a == MessageBatches || a == SessionEvents
}

// Usage is the token usage an answer reports.
//
// For OpenAI, Input is prompt_tokens (input_tokens in the Responses API),
// Cached the part of it read from the prompt cache
// (prompt_tokens_details.cached_tokens), Output completion_tokens
// (output_tokens), Reasoning the part of it spent reasoning; total_tokens
// is Input + Output. Embeddings report Input only.
//
// For Anthropic, Input is input_tokens, which excludes the cache:
// CacheCreation is cache_creation_input_tokens and Cached
// cache_read_input_tokens, both billed on top; Output is output_tokens.
type Usage struct {
	Input         int64
	Output        int64
	Cached        int64
	CacheCreation int64
	Reasoning     int64
}

// Total is the tokens the provider bills for the usage on api: OpenAI's
// total_tokens (input + output; embeddings: input), Anthropic's input +
// cache creation + cache reads + output.
func (u Usage) Total(api API) int64 {
	switch api {
	case Messages:
		return u.Input + u.CacheCreation + u.Cached + u.Output
	case Embeddings:
		return u.Input
	}
	return u.Input + u.Output
}

// DefaultUsage is what every answer reports until the test says otherwise:
// 12 prompt tokens and 9 completion tokens, 21 in all.
var DefaultUsage = Usage{Input: 12, Output: 9}

// DefaultText is the assistant's answer.
const DefaultText = "Hello there."

// Request is what the server saw of one request.
type Request struct {
	Seq    int // 1 for the first request the server saw
	Method string
	Path   string
	Header http.Header
	Body   []byte // exactly as received

	// Parsed from the body (zero when it is not JSON).
	API            API
	Model          string
	Stream         bool
	IncludeUsage   bool   // stream_options.include_usage
	EncodingFormat string // embeddings: encoding_format
	Inputs         int    // embeddings: the number of inputs
	ValidJSON      bool   // the body is a JSON object

	// Notes is for the hook (SetHook) to record what it saw while the
	// request was in flight, such as the state of the buckets.
	Notes map[string]string
}

// Reply is how the server answers one request.
type Reply struct {
	// Usage is the usage reported; nil reports none (no usage object, and
	// no usage chunk in a stream).
	Usage *Usage
	// Text is the assistant's answer (default DefaultText), streamed one
	// word (with its leading space) per event.
	Text string
	// Status, when neither 0 nor 200, answers an error with this status in
	// the provider's shape instead: OpenAI's {"error":{"message","type",
	// "param","code"}}, Anthropic's {"type":"error","error":{"type",
	// "message"}}.
	Status int
	// InStream sends the error of Status to an Anthropic stream request as
	// Anthropic sends one that comes after its headers (an overload): a
	// 200 stream whose one event is the error object (event: error).
	InStream bool
	// ErrorType and ErrorCode override the error's type and code (OpenAI);
	// ErrorMessage its message.
	ErrorType, ErrorCode, ErrorMessage string
	// Header is added to the answer's headers.
	Header http.Header
	// AbortAfterUsage cuts the connection of a stream right after the
	// event that carries its final usage (for a stream without one, before
	// its end marker), without ending the response: an upstream that dies.
	AbortAfterUsage bool
}

// Server is the stand-in: an HTTP server on 127.0.0.1 on a free port,
// closed at the end of the test.
type Server struct {
	// URL is the base URL, http://127.0.0.1:<port>.
	URL string
	// Addr is host:port, for reverse_proxy.
	Addr string

	srv *httptest.Server

	mu        sync.Mutex
	reply     func(*Request) Reply
	usage     Usage
	encodings []string
	hook      func(*Request) error
	lenient   bool
	gate      chan struct{}
	seen      []Request
}

// Start starts a server; it is closed when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{usage: DefaultUsage, encodings: []string{"gzip"}}
	s.srv = httptest.NewUnstartedServer(http.HandlerFunc(s.serve))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("providertest: listen: %v", err)
	}
	s.srv.Listener.Close()
	s.srv.Listener = l
	s.srv.Start()
	s.URL = s.srv.URL
	s.Addr = strings.TrimPrefix(s.srv.URL, "http://")
	t.Cleanup(func() {
		s.Release()
		s.srv.CloseClientConnections()
		s.srv.Close()
	})
	return s
}

// SetUsage makes every answer report u (unless SetReply decides).
func (s *Server) SetUsage(u Usage) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.usage = u
}

// SetReply makes f decide each answer; nil goes back to SetUsage's usage.
func (s *Server) SetReply(f func(*Request) Reply) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reply = f
}

// SetEncodings sets the content codings the server may compress JSON
// answers with, in its order of preference: the first one the request's
// Accept-Encoding allows is used. None: never compress. The default is
// gzip. Supported: gzip, deflate (zlib, as HTTP's deflate is) and zstd.
func (s *Server) SetEncodings(codings ...string) {
	for _, c := range codings {
		if _, ok := encoders[c]; !ok {
			panic(fmt.Sprintf("providertest: unsupported content coding %q", c))
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.encodings = append([]string(nil), codings...)
}

// SetHook makes f run on each request before it is answered (and after
// it is parsed); it may fill the request's Notes, which are recorded. An
// error answers 500.
func (s *Server) SetHook(f func(*Request) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hook = f
}

// AcceptInvalidJSON makes the server answer a body that is not a JSON
// object as it answers an empty request, instead of the provider's 400.
func (s *Server) AcceptInvalidJSON() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lenient = true
}

// Hold makes the streams that start from now on wait after their first
// event until Release.
func (s *Server) Hold() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gate == nil {
		s.gate = make(chan struct{})
	}
}

// Release lets held streams go on.
func (s *Server) Release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gate != nil {
		close(s.gate)
		s.gate = nil
	}
}

// Requests returns what the server has seen so far, in order.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.seen...)
}

// Last returns the last request the server saw; it fails the test when
// there is none.
func (s *Server) Last(t testing.TB) Request {
	t.Helper()
	seen := s.Requests()
	if len(seen) == 0 {
		t.Fatal("providertest: the provider saw no request")
	}
	return seen[len(seen)-1]
}

// requestFields is what the server reads of a request body.
type requestFields struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	EncodingFormat string          `json:"encoding_format"`
	Input          json.RawMessage `json:"input"`
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req := &Request{
		Method: r.Method,
		Path:   r.URL.Path,
		Header: r.Header.Clone(),
		Body:   body,
		API:    apiOf(r.URL.Path),
	}
	var f requestFields
	if b := bytes.TrimLeft(body, " \t\r\n"); len(b) > 0 && b[0] == '{' && json.Unmarshal(body, &f) == nil {
		req.ValidJSON = true
		req.Model, req.Stream, req.EncodingFormat = f.Model, f.Stream, f.EncodingFormat
		req.IncludeUsage = f.StreamOptions != nil && f.StreamOptions.IncludeUsage
		req.Inputs = countInputs(f.Input)
	}

	s.mu.Lock()
	hook, replyFn, usage, encodings, lenient, gate := s.hook, s.reply, s.usage, s.encodings, s.lenient, s.gate
	s.mu.Unlock()
	var hookErr error
	if hook != nil {
		hookErr = hook(req)
	}
	s.mu.Lock()
	req.Seq = len(s.seen) + 1
	s.seen = append(s.seen, *req)
	s.mu.Unlock()

	var rep Reply
	if replyFn != nil {
		rep = replyFn(req)
	} else {
		u := usage
		rep.Usage = &u
	}
	if rep.Text == "" {
		rep.Text = DefaultText
	}
	for name, values := range rep.Header {
		for _, v := range values {
			w.Header().Add(name, v)
		}
	}
	a := answer{w: w, r: r, req: req, rep: &rep, encodings: encodings, gate: gate}
	switch {
	case hookErr != nil:
		a.error(http.StatusInternalServerError, "", "", "the test hook failed: "+hookErr.Error())
	case req.API == "":
		a.error(http.StatusNotFound, "", "", fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path))
	case r.Method != req.API.method():
		a.error(http.StatusMethodNotAllowed, "", "", fmt.Sprintf("Invalid method for URL (%s %s)", r.Method, r.URL.Path))
	case req.API.Anthropic() && r.Header.Get("Anthropic-Version") == "":
		a.error(http.StatusBadRequest, "", "", "anthropic-version: header is required")
	case req.API == Models:
		a.json(http.StatusOK, modelsJSON())
	case req.API == Videos || req.API == RealtimeCalls:
		a.formCall()
	case req.API == DeploymentRun:
		a.json(http.StatusOK, mustJSON(map[string]string{
			"id": "drun_test", "type": "deployment_run", "deployment_id": "depl_test", "session_id": "sesn_test",
		}))
	case !req.ValidJSON && !lenient:
		msg := "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP library correctly. " +
			"The OpenAI API expects a JSON payload, but what was sent was not valid JSON. If you have trouble figuring out how to fix this, please contact us through our help center at help.openai.com.)"
		if req.API.Anthropic() {
			msg = "There was an issue with the request body: the body must be a JSON object."
		}
		a.error(http.StatusBadRequest, "", "", msg)
	case req.API == RealtimeAccept:
		a.w.WriteHeader(http.StatusOK)
	case req.API == Agents:
		a.json(http.StatusOK, mustJSON(map[string]any{"id": "agent_test", "type": "agent", "version": 1}))
	case req.API == MessageBatches:
		a.messageBatch()
	case req.API == SessionEvents:
		a.sessionEvents()
	case rep.Status != 0 && rep.Status != http.StatusOK && rep.InStream && req.Stream && req.API == Messages:
		a.stream([]event{{text: "event: error\ndata: " + string(anthropicError(rep.Status, rep.ErrorType, rep.ErrorMessage)) + "\n\n"}})
	case rep.Status != 0 && rep.Status != http.StatusOK:
		a.error(rep.Status, rep.ErrorType, rep.ErrorCode, rep.ErrorMessage)
	default:
		a.answer()
	}
}

// modelsJSON is the list GET /v1/models answers, in OpenAI's shape.
func modelsJSON() []byte {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	return mustJSON(struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{"list", []model{{"gpt-4o-mini", "model", 1721172741, "system"}, {"text-embedding-3-small", "model", 1705948997, "system"}}})
}

// countInputs returns the number of embeddings an input asks for: one per
// element of an array of strings or of token arrays, else one (a string,
// or one array of token numbers).
func countInputs(raw json.RawMessage) int {
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) != nil || len(list) == 0 {
		return 1
	}
	if first := bytes.TrimSpace(list[0]); len(first) > 0 && first[0] != '"' && first[0] != '[' {
		return 1 // one input of token numbers
	}
	return len(list)
}

// answer writes one answer.
type answer struct {
	w         http.ResponseWriter
	r         *http.Request
	req       *Request
	rep       *Reply
	encodings []string
	gate      chan struct{}
}

func (a *answer) answer() {
	now := time.Now().Unix()
	switch a.req.API {
	case ChatCompletions:
		if a.req.Stream {
			a.stream(chatStream(a.req, a.rep, now))
		} else {
			a.json(http.StatusOK, chatJSON(a.req, a.rep, now))
		}
	case Responses:
		if a.req.Stream {
			a.stream(responsesStream(a.req, a.rep, now))
		} else {
			a.json(http.StatusOK, responsesJSON(a.req, a.rep, now))
		}
	case Embeddings:
		a.json(http.StatusOK, embeddingsJSON(a.req, a.rep))
	case Messages:
		if a.req.Stream {
			a.stream(messagesStream(a.req, a.rep))
		} else {
			a.json(http.StatusOK, messagesJSON(a.req, a.rep))
		}
	case CountTokens:
		// The count alone, no usage: counting runs no model.
		var n int64
		if a.rep.Usage != nil {
			n = a.rep.Usage.Input
		}
		a.json(http.StatusOK, mustJSON(map[string]int64{"input_tokens": n}))
	}
}

// json writes a JSON answer, compressed when the request allows a coding
// the server uses.
func (a *answer) json(status int, body []byte) {
	h := a.w.Header()
	h.Set("Content-Type", "application/json")
	h.Add("Vary", "Accept-Encoding")
	if coding := Negotiate(a.r.Header.Values("Accept-Encoding"), a.encodings); coding != "" {
		body = encoders[coding](body)
		h.Set("Content-Encoding", coding)
	}
	h.Set("Content-Length", fmt.Sprint(len(body)))
	a.w.WriteHeader(status)
	a.w.Write(body)
}

// event is one server-sent event; usage marks the one that carries the
// final usage, end the end marker ([DONE]) if any.
type event struct {
	text  string
	usage bool
	end   bool
}

// stream writes events, one flush each; with a gate, it waits after the
// first until the gate closes. With AbortAfterUsage it cuts the connection
// after the usage event (or before the end marker).
func (a *answer) stream(events []event) {
	h := a.w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	a.w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(a.w)
	hasUsage := false
	for _, ev := range events {
		hasUsage = hasUsage || ev.usage
	}
	for i, ev := range events {
		if ev.end && a.rep.AbortAfterUsage && !hasUsage {
			panic(http.ErrAbortHandler)
		}
		if _, err := io.WriteString(a.w, ev.text); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
		if ev.usage && a.rep.AbortAfterUsage {
			panic(http.ErrAbortHandler)
		}
		if i == 0 && a.gate != nil {
			select {
			case <-a.gate:
			case <-a.r.Context().Done():
				return
			}
		}
	}
}

// error writes an error in the shape of the request's provider.
func (a *answer) error(status int, typ, code, message string) {
	if a.req.API.Anthropic() {
		a.json(status, anthropicError(status, typ, message))
		return
	}
	defType, defCode := openAIErrorType(status)
	if typ == "" {
		typ = defType
	}
	if code == "" {
		code = defCode
	}
	if message == "" {
		message = http.StatusText(status)
	}
	var c any
	if code != "" {
		c = code
	}
	a.json(status, mustJSON(struct {
		Error openAIError `json:"error"`
	}{openAIError{Message: message, Type: typ, Param: nil, Code: c}}))
}

type openAIError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   any    `json:"param"`
	Code    any    `json:"code"`
}

// openAIErrorType is the type and code OpenAI gives errors of a status.
func openAIErrorType(status int) (typ, code string) {
	switch {
	case status == http.StatusUnauthorized:
		return "invalid_request_error", "invalid_api_key"
	case status == http.StatusTooManyRequests:
		return "requests", "rate_limit_exceeded"
	case status >= 500:
		return "server_error", ""
	}
	return "invalid_request_error", ""
}

// anthropicError is Anthropic's error object for status, of type typ (by
// default the one Anthropic documents for status) and message (by default
// the status text).
func anthropicError(status int, typ, message string) []byte {
	if typ == "" {
		typ = anthropicErrorType(status)
	}
	if message == "" {
		message = http.StatusText(status)
	}
	return obj("type", "error", "error", obj("type", typ, "message", message))
}

// anthropicErrorType is the error type Anthropic documents for a status.
func anthropicErrorType(status int) string {
	switch status {
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case 529:
		return "overloaded_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// words splits text into stream deltas: each word with its leading space.
func words(text string) []string {
	var out []string
	for len(text) > 0 {
		i := strings.IndexByte(text[1:], ' ')
		if i < 0 {
			out = append(out, text)
			break
		}
		out = append(out, text[:i+1])
		text = text[i+1:]
	}
	return out
}
