package tokenbucket

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/llm"
)

// Defaults and bounds of the cost estimator.
const (
	// DefaultEstimateMaxBody is the default max_body: 1 MiB, in bytes.
	DefaultEstimateMaxBody = 1 << 20
	// MaxEstimateBody is the largest max_body: 1 GiB, in bytes.
	MaxEstimateBody = 1 << 30
	// DefaultEstimateMaxTokens is the default default_max_tokens: the
	// completion budget, in tokens, of a request that sets none.
	DefaultEstimateMaxTokens = 1024
	// DefaultEstimateReadTimeout bounds the time the whole body may take to
	// arrive.
	DefaultEstimateReadTimeout = 10 * time.Second
	// readChunk is the most a body read allocates before bytes arrive.
	readChunk = 64 << 10
)

// Estimate estimates the LLM tokens of an OpenAI- or Anthropic-style JSON
// request body before it is sent (see package llm for what is counted:
// messages, system, prompt, input, instructions, Gemini's contents and
// system instruction, tools, functions,
// response_format, tool calls and results (built-in ones included: the
// code, logs and file search results of Responses API items), the text of
// Anthropic documents of plain text or content blocks, 85 per image or
// file part), plus the completion budget: the body's
// max_completion_tokens, max_tokens or max_output_tokens (or the budget
// Ollama, TGI, Gemini and Bedrock keep in their settings), else
// DefaultMaxTokens (none for embeddings and moderations), times the
// completions asked for each prompt (n, best_of) and the prompts of a
// legacy completions prompt array. The charge is capped so that a request
// whose prompt fits the smallest tokens capacity is never denied as
// cost_exceeds_capacity because of its budget (see tokenEstimate.cost);
// a batch, which no usage settles, is not capped.
// The body is read once, up to MaxBody bytes, in one linear pass, and
// given back whole to the next handler (an Ollama blob upload's is not
// read: see uploadsBlob).
type Estimate struct {
	// MaxBody is the largest body read, in bytes: 1 to 1 GiB (default
	// 1 MiB). A larger body is invalid.
	MaxBody int64 `json:"max_body,omitempty"`
	// DefaultMaxTokens is the completion budget of a request that sets
	// neither max_tokens, max_completion_tokens nor max_output_tokens
	// (default 1024).
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

	tok llm.Tokenizer
}

var (
	errInvalidBody = errors.New("request body is not a JSON chat or completion request within the size limit")
	errBodyTimeout = errors.New("request body did not arrive within estimate.read_timeout")
	// errBodyTooLarge: the body is over a limit a handler before this one
	// set (request_body's max_size, http.MaxBytesReader), which Caddy
	// answers 413 Request Entity Too Large.
	errBodyTooLarge = errors.New("request body is larger than the server's limit (request_body max_size)")
	// errClientGone: the client went away while it sent the body (an
	// HTTP/2 or HTTP/3 stream reset, a connection reset): there is
	// nothing to answer, and the body is not invalid.
	errClientGone = errors.New("the client went away while sending the request body")
	// errMixedModels: the request names more than one model (a batch
	// whose requests name several, a Gemini body and its path), where the
	// buckets depend on the model: no one model's limits are those of what
	// runs.
	errMixedModels = errors.New("request body names more than one model, where limits depend on the model")
)

// provision sets the defaults of the unset fields and builds the
// tokenizer (a BPE encoder is built once per process and shared).
func (e *Estimate) provision() error {
	if e == nil {
		return nil
	}
	if e.MaxBody == 0 {
		e.MaxBody = DefaultEstimateMaxBody
	}
	if e.DefaultMaxTokens == 0 {
		e.DefaultMaxTokens = DefaultEstimateMaxTokens
	}
	if e.ReadTimeout == 0 {
		e.ReadTimeout = caddy.Duration(DefaultEstimateReadTimeout)
	}
	tok, err := llm.ParseTokenizer(e.Tokenizer)
	if err != nil {
		return fmt.Errorf("estimate.tokenizer: %w", err)
	}
	e.tok = tok
	return nil
}

// tokenEstimate is what the estimate makes of a request.
type tokenEstimate struct {
	prompt      int64  // the prompt's tokens
	completion  int64  // the completion budget: the body's, else default_max_tokens
	streamUsage bool   // stream_options.include_usage was added to the body
	model       string // the body's model, "" when it has none
	// noInference: the request runs no model. It has no body (a list, a
	// read-back of a stored response or batch, a cancel; but see
	// runsWithoutBody), counts tokens (see countsTokens), stores an
	// object (see storesObjects, configures) or manages Ollama's models
	// (see ollamaManages, uploadsBlob). It costs 0 tokens, and usage
	// in its answer (a stored response's, read back) is not its own, so it
	// is not settled.
	noInference bool
	// read: the whole body was read (and is given to the next handler from
	// memory).
	read bool
	// mixedModels: the body names more than one model (a batch's
	// requests, or they and its top level: llm.Request.MixedModels), so
	// no one model's limits are those of what runs (see readCost).
	mixedModels bool
	// batch: the body holds batched requests (llm.Request.Requests), whose
	// answer reports no usage: the estimate is the charge, so cost does not
	// cap it.
	batch bool
}

// cost is the charge of the estimate against tokens limits whose smallest
// capacity is capacity: prompt + completion, with the completion budget
// capped so that the charge fits that capacity. A request whose prompt
// fits is never denied as cost_exceeds_capacity because of
// default_max_tokens or a large max_tokens (a budget larger than a tokens
// limit would lock every such request out for good, a bug LiteLLM shipped
// and fixed); only a prompt larger than the capacity alone is, since no
// wait can serve it. Settlement charges what the answer really used.
// A batch (see batch) is not capped: its answer reports no usage, so a
// capped estimate would charge a capacity once for any number of
// requests; one larger than capacity is denied cost_exceeds_capacity.
func (e tokenEstimate) cost(capacity int64) int64 {
	if e.batch {
		return min(e.prompt+e.completion, llm.MaxCost) // each at most MaxCost: no overflow
	}
	if e.prompt >= capacity {
		return e.prompt
	}
	return min(e.prompt+e.completion, capacity)
}

// estimate reads r's body, restores it, and estimates its tokens. With
// streamUsage (settle { include_usage }), an OpenAI chat or completions
// stream (see includesUsage) that does not ask for its usage is sent on
// with stream_options.include_usage added. A request without a body (see
// noContent, noBody), a token count (see countsTokens), a stored object
// (see storesObjects, configures), Ollama's management of its models (see
// ollamaManages) and an upload's form (see uploads, formBody) are 0
// tokens; so is an Ollama blob upload, whose body is not read at all (see
// uploadsBlob). A model call sent as a form is estimated from it (see
// formCall, formCallEstimate). A body that cannot be read is
// errInvalidBody, or, with on_invalid <cost>, an estimate of that cost
// with no completion budget; a body that does not arrive in time is
// errBodyTimeout, one over request_body's max_size errBodyTooLarge.
func (e *Estimate) estimate(w http.ResponseWriter, r *http.Request, streamUsage bool) (tokenEstimate, error) {
	if noContent(r) {
		return e.noBody(r, false), nil
	}
	if uploadsBlob(r) {
		// An Ollama blob, a model file of gigabytes: not read, neither
		// into memory nor as JSON, and sent on as it comes.
		return tokenEstimate{noInference: true}, nil
	}
	body, err := e.readBody(w, r)
	if err == errBodyTimeout || err == errBodyTooLarge || err == errClientGone {
		return tokenEstimate{}, err
	}
	if err == nil && len(body) == 0 {
		// No body after all, where none was declared (HTTP/3, whose
		// requests give no Content-Length; an empty chunked body).
		return e.noBody(r, true), nil
	}
	read := err == nil
	// The path as the upstream may read it: a server or proxy in front
	// of the model (nginx, Envoy's and Istio's path normalization,
	// Cloudflare's URL normalization) removes dot segments and merges
	// slashes, as Caddy's own path matchers do, so
	// /v1/chat/completions/. and /v1/uploads/../chat/completions are
	// chat completions, not stored objects.
	// But a path is free (a form upload, a token count, a stored object)
	// only when it reads so both ways: as it came too, for an upstream
	// that does not resolve dot segments (one that routes by prefix), or
	// does not take an escaped slash for one (Envoy's and Cloudflare's
	// normalizations keep %2F, which r.URL.Path has decoded):
	// /v1/chat/completions%2F..%2F..%2Fmessages%2Fcount_tokens is a chat
	// completion to them. A form keeps its reading both ways (a client
	// that sends one to /v1//files is still served); a token count, a
	// stored object, an Ollama model's management or blob, or a call
	// without a completion needs a clean path:
	// with dot segments or doubled slashes it may read one way to the
	// rule and another to the upstream (/v1/chat/completions/../../threads
	// is a thread once cleaned, a chat completion to a router by prefix),
	// and no SDK sends them.
	urlPath := cleanPath(r.URL.Path)
	clean := urlPath == r.URL.Path
	var req llm.Request
	if err == nil {
		req, err = llm.ParseRequest(body, e.tok)
	}
	if err != nil {
		// A model call's form over max_body is invalid, as a JSON body is.
		if read && formCall(urlPath) && (clean || formCall(r.URL.Path)) {
			if est, ok := e.formCallEstimate(r, urlPath, body); ok {
				return est, nil
			}
		}
		if uploads(urlPath) && (clean || uploads(r.URL.Path)) {
			form, ferr := e.formBody(w, r, body)
			if ferr != nil {
				return tokenEstimate{}, ferr
			}
			if form {
				// An audio transcription, a file upload: no text or model
				// the estimate reads. 0 tokens; usage its answer reports
				// settles it.
				return tokenEstimate{read: read}, nil
			}
		}
		est, err := e.invalid()
		est.read = read // a whole body priced on_invalid is in memory all the same
		return est, err
	}
	model, mixed := req.Model, req.MixedModels
	if m := pathModel(urlPath); m != "" {
		// Gemini's and Vertex AI's model is in the path, and it is what
		// runs: a model the body names beside it ("models/<m>", as a
		// batch's requests name theirs) must be the same one, and the
		// path as it came must name it too.
		if model != "" && strings.TrimPrefix(model, "models/") != m || !clean && pathModel(r.URL.Path) != m {
			mixed = true
		}
		model = m
	}
	if clean && (countsTokens(urlPath) || storesObjects(urlPath) && !startsConversation(urlPath, req) || configures(urlPath) ||
		ollamaManages(urlPath)) {
		return tokenEstimate{model: model, mixedModels: mixed, noInference: true, read: true}, nil
	}
	defaultMax := e.DefaultMaxTokens
	if clean && !completes(urlPath) { // /v1/chat/completions/../../embeddings keeps its budget
		defaultMax = 0
	}
	// A body with batched requests is not capped (see tokenEstimate.cost),
	// at a batch path or not: an upstream that normalizes the path
	// (/v1//messages/batches) runs it as a batch all the same.
	est := tokenEstimate{prompt: req.PromptTokens, model: model, read: true, batch: req.Requests > 0, mixedModels: mixed}
	if req.Requests > 0 && clean && batches(urlPath) {
		if req.Endpoint != "" && !completes(req.Endpoint) && endsIn(urlPath, "/batch/jobs") {
			// A batch job of embeddings (Mistral's endpoint). Only
			// Mistral's batch jobs have one: at another batch path it is
			// no member of the API, and would take every request's
			// default budget off the charge.
			defaultMax = 0
		}
		est.completion = req.BatchBudget(defaultMax)
	} else {
		est.completion = req.Budget(defaultMax)
	}
	if streamUsage && req.NeedsStreamUsage() && includesUsage(urlPath) && !oldAzureVersion(r.URL.Query()) {
		if out, changed, err := llm.WithStreamUsage(body, req); err == nil && changed {
			setBody(r, out)
			// The usage chunk is cut out of the stream on its way back,
			// which an encoded stream would not allow: neither the
			// upstream nor Caddy's encode may compress it.
			r.Header.Del("Accept-Encoding")
			est.streamUsage = true
		}
	}
	return est, nil
}

// cleanPath returns p with its dot segments resolved and repeated
// slashes merged (path.Clean), keeping a trailing slash. A clean path is
// returned as it is, without an allocation.
func cleanPath(p string) string {
	if p == "" {
		return p
	}
	c := path.Clean(p)
	if strings.HasSuffix(p, "/") && c != "/" {
		if len(c) == len(p)-1 && p[:len(c)] == c {
			return p
		}
		c += "/"
	}
	return c
}

// noContent reports whether r is a request without a body (Content-Length
// 0, or none and not chunked: Caddy wraps even an empty body): GET
// /v1/models, a HEAD, a CORS preflight, a DELETE of a stored response, a
// POST that cancels a batch or a response. It asks the model for nothing,
// so its estimate is 0 tokens: no prompt, no completion (a chat request
// without a body is the upstream's to refuse).
func noContent(r *http.Request) bool {
	return r.ContentLength == 0 // -1: chunked, or an HTTP/2 stream left open
}

// noBody is the estimate of a request without a body (see noContent): 0
// tokens and not settled, except a POST that starts an agent without a
// body (see runsWithoutBody), which is charged default_max_tokens and
// settled from the usage its answer reports (none: the charge stays), as
// a session that starts with a body is. read is whether the (empty) body
// was read.
func (e *Estimate) noBody(r *http.Request, read bool) tokenEstimate {
	if r.Method == http.MethodPost && (runsWithoutBody(r.URL.Path) || runsWithoutBody(cleanPath(r.URL.Path))) {
		return tokenEstimate{completion: e.DefaultMaxTokens, read: read}
	}
	return tokenEstimate{noInference: true, read: read}
}

// runsWithoutBody reports whether a POST without a body to path runs a
// model: an agent deployment's run (Anthropic's beta.deployments.run,
// "Run Deployment Now": /deployments/<id>/run) or an automation's manual
// delivery (OpenAI's beta.agents.automations.invocations.create:
// /automations/<id>/invocations), each of which starts the agent's
// session at once. Segments are matched in any case, and either reading
// of the path (as it came, cleaned) is enough: the rule only charges. A
// trailing slash is ignored.
func runsWithoutBody(path string) bool {
	var last [3]string // the last three segments, the last one last
	for seg := range strings.SplitSeq(strings.TrimRight(path, "/"), "/") {
		last = [3]string{last[1], last[2], seg}
	}
	return strings.EqualFold(last[0], "deployments") && strings.EqualFold(last[2], "run") ||
		strings.EqualFold(last[0], "automations") && strings.EqualFold(last[2], "invocations")
}

// completes reports whether a request to path generates a completion,
// and so is charged default_max_tokens when its body sets no budget: not
// embeddings (OpenAI's /embeddings, Ollama's /api/embed), moderations
// nor classifications (Mistral's /classifications, /chat/classifications),
// whose answers carry no completion, nor Gemini's embeddings
// (:embedContent, and the batches :asyncBatchEmbedContent and
// :batchEmbedContents), which embed their content, nor Google's models
// called with :predict on Vertex AI (see googlePredict). A trailing slash
// is ignored.
func completes(path string) bool {
	return !endsIn(path, "/embeddings", "/embed", "/moderations", "/classifications",
		":embedContent", ":asyncBatchEmbedContent", ":batchEmbedContents") && !googlePredict(path)
}

// googlePredict reports whether path calls one of Google's models on
// Vertex AI with :predict (.../publishers/google/models/<model>:predict,
// https://cloud.google.com/vertex-ai/generative-ai/docs/model-reference/text-embeddings-api):
// its text embeddings (text-embedding-005, text-multilingual-embedding-002,
// gemini-embedding-001), multimodal embeddings and Imagen, none of which
// answers with text (PaLM's text-bison and chat-bison, which did, are
// retired; Gemini is called with :generateContent). Another :predict
// path may serve a text model (one deployed on a Vertex AI endpoint,
// /endpoints/<id>:predict; KServe's /v1/models/<model>:predict) and keeps
// its budget. A trailing slash is ignored.
func googlePredict(path string) bool {
	path = strings.TrimRight(path, "/")
	i := strings.LastIndexByte(path, '/')
	return i >= 0 && strings.HasSuffix(path, ":predict") && strings.HasSuffix(path[:i], "/publishers/google/models")
}

// storesObjects reports whether a request to path creates or changes a
// stored object of OpenAI's API, which runs no model: an upload (and its
// completion), a vector store (and its files and searches), a fine-tuning
// job, an assistant, a thread or its messages (but not a run: a path with
// a "runs" segment), a conversation or its items, an eval, a container,
// a stored chat completion's metadata (/chat/completions/<id>), a skill,
// a ChatKit session, a voice consent's metadata, a Realtime client secret
// or beta session (/realtime/client_secrets, /realtime/sessions,
// /realtime/transcription_sessions: an ephemeral key, whose session runs
// elsewhere), or a Realtime call's or a Live session's hangup, refer or
// reject (but not its accept or a Live session's fork, which start the
// model): the SDKs' uploads, vectorStores, fineTuning.jobs,
// beta.assistants, beta.threads, conversations, evals, containers,
// chat.completions.update, skills, beta.chatkit.sessions,
// audio.voiceConsents.update, realtime.clientSecrets,
// realtime.translations.clientSecrets, beta.realtime.sessions,
// beta.realtime.transcriptionSessions, realtime.calls and live.sessions.
// Their answers report no usage, so an estimate charged to them would
// never be given back. A trailing slash is ignored.
func storesObjects(path string) bool {
	stored, threads, runs, realtime, live := false, false, false, false, false
	var last [3]string // the last three segments, the last one last
	for seg := range strings.SplitSeq(strings.TrimRight(path, "/"), "/") {
		switch seg {
		case "uploads", "vector_stores", "fine_tuning", "assistants", "conversations", "evals", "containers",
			"skills", "chatkit", "voice_consents":
			stored = true
		case "threads":
			threads = true
		case "realtime":
			realtime = true
		case "live":
			live = true
		default:
			runs = runs || runOrModel(seg)
		}
		last = [3]string{last[1], last[2], seg}
	}
	hangup := last[2] == "hangup" || last[2] == "refer" || last[2] == "reject"
	secretOrCall := realtime && (last[2] == "client_secrets" ||
		last[1] == "realtime" && (last[2] == "sessions" || last[2] == "transcription_sessions") ||
		last[0] == "calls" && hangup) ||
		live && last[0] == "sessions" && hangup
	return !runs && (stored || threads || secretOrCall || last[0] == "chat" && last[1] == "completions" && last[2] != "")
}

// startsConversation reports whether a request to a conversations path
// (a stored object of OpenAI's API, see storesObjects) runs a model all
// the same: Mistral's conversations API starts, appends to and restarts
// a conversation at /v1/conversations, /v1/conversations/<id> and
// /v1/conversations/<id>/restart, with the model's inputs (and a model or
// an agent), where OpenAI's conversations.create, update and items.create
// send items and metadata, which the estimate does not count. So a body
// with a model, with text the estimate counts, or with Mistral's inputs
// at all (an append of an empty function result runs the model on the
// whole stored conversation) is no stored object there.
func startsConversation(path string, req llm.Request) bool {
	if req.Model == "" && req.PromptTokens == 0 && !req.Inputs {
		return false
	}
	for seg := range strings.SplitSeq(path, "/") {
		if seg == "conversations" {
			return true
		}
	}
	return false
}

// runOrModel reports whether a path segment makes its path never free.
// A run samples a model: a thread's run, an eval's run
// (evals.runs.create), a grader's run (fineTuning.alpha.graders.run),
// also in another case or with path parameters (ASP.NET Core and Fiber
// route case-insensitively, Java servlet containers drop ";params"); a
// segment after deployments or engines names a model (an Azure
// deployment, LiteLLM's /engines/<model>, which takes the path's model),
// whatever its name.
func runOrModel(seg string) bool {
	name, _, _ := strings.Cut(seg, ";")
	return strings.EqualFold(name, "runs") || strings.EqualFold(name, "run") ||
		strings.EqualFold(name, "deployments") || strings.EqualFold(name, "engines")
}

// ollamaManages reports whether a request to path is one of Ollama's
// model-management calls, which run no model and whose answers report no
// usage (no prompt_eval_count or eval_count; pull, push and create stream
// NDJSON status lines): POST /api/show, /api/pull, /api/push, /api/create
// and /api/copy, and DELETE /api/delete (its client libraries' show,
// pull, push, create, copy and delete; see Ollama's API,
// https://github.com/ollama/ollama/blob/main/docs/api.md). The name must
// be the one segment after the path's "api" segment (see ollamaCall),
// in any method, as for configures; the caller asks for a
// clean path. A create's system prompt or messages are stored with the
// model, not run. /api/generate without a prompt loads a model, and is
// estimated as any generate is. A trailing slash is ignored.
func ollamaManages(path string) bool {
	switch ollamaCall(path) {
	case "show", "pull", "push", "create", "copy", "delete":
		return true
	}
	return false
}

// ollamaBlob reports whether path is that of an Ollama blob,
// /api/blobs/<digest> (see ollamaCall), where <digest> is "sha256:" or
// "sha256-" and 64 hex digits, as Ollama's server reads it: the model
// file that ollama create uploads with a POST (see uploadsBlob) after
// asking with a HEAD whether the server has it. A trailing slash is
// ignored.
func ollamaBlob(path string) bool {
	digest, ok := strings.CutPrefix(ollamaCall(path), "blobs/")
	if !ok || len(digest) != len("sha256:")+64 || !strings.HasPrefix(digest, "sha256") || digest[6] != ':' && digest[6] != '-' {
		return false
	}
	for _, c := range []byte(digest[7:]) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// ollamaCall returns what follows the "api" segment of path, less a
// trailing slash: the call of Ollama's native API it names (show,
// blobs/<digest>). The path is /api/<call>, or /<prefix>/api/<call> with
// a prefix of one segment that the route may keep (/ollama/api/show:
// Open WebUI's and other proxies' mount of Ollama's API) and that is no
// run, deployments or engines segment (see runOrModel); else it is "".
// One segment, since a longer prefix may be a model call's path, which a
// router by prefix sends to that call: /v1/chat/completions/api/show,
// /api/chat/api/show. The segments are matched exactly, as Ollama's
// router (gin) matches them: /api/Show or /api/show;v=1 is no call of
// Ollama's, and not free.
func ollamaCall(path string) string {
	rest, ok := strings.CutPrefix(strings.TrimRight(path, "/"), "/")
	if !ok {
		return ""
	}
	if call, ok := strings.CutPrefix(rest, "api/"); ok {
		return call
	}
	prefix, rest, _ := strings.Cut(rest, "/")
	if call, ok := strings.CutPrefix(rest, "api/"); ok && prefix != "" && !runOrModel(prefix) {
		return call
	}
	return ""
}

// uploadsBlob reports whether r uploads an Ollama blob: a POST to a clean
// path (see cleanPath, estimate) that is a blob's (see ollamaBlob). Its
// body is a model file (GGUF, safetensors) of up to many gigabytes, not
// JSON, sent without a Content-Type or as application/octet-stream, and
// its answer (201 Created) reports no usage. The estimate does not read
// it (read within max_body, it was refused as invalid, and ollama create
// failed): it costs 0 tokens, is not settled, and reaches the next
// handler as it comes (read_timeout does not bound it; Caddy's servers {
// timeouts { read_body } } does).
func uploadsBlob(r *http.Request) bool {
	return r.Method == http.MethodPost && ollamaBlob(r.URL.Path) && cleanPath(r.URL.Path) == r.URL.Path
}

// configures reports whether a request to path creates or changes an
// object of the providers' agent or account APIs, which runs no model,
// named by the segment right after a "v1" segment (/v1/<name>/...,
// /openai/v1/<name>/..., /anthropic/v1/<name>/...): OpenAI's and
// Anthropic's organization administration (organization,
// organizations), OpenAI's project roles (/projects/<id>/roles,
// /projects/<id>/groups/<id>/roles, /projects/<id>/users/<id>/roles) and
// webhook endpoints (webhook_endpoints), and the managed agents' stored
// objects: vaults and their credentials, environments (and their work
// items and files), memory stores, tunnels, user profiles, compliance
// review cases, an agent's definition (/agents, /agents/<id>), an
// automation's schedule (/agents/automations, /agents/automations/<id>:
// saved "without invoking it"), an environment template, and a session's
// settings (OpenAI's /agents/sessions/<id>, Anthropic's /sessions/<id>)
// or resources (/sessions/<id>/resources). The SDKs'
// admin.organization, beta.organization and organization, webhooks,
// beta.vaults, beta.agents.vaults, beta.environments,
// beta.agents.environments, beta.memoryStores, beta.tunnels,
// userProfiles, beta.compliance, beta.agents (create, update),
// beta.agents.automations (create, update), beta.agents.sessions.update,
// beta.sessions.update and beta.sessions.resources. Their answers report
// no usage. Not free: a session's creation or its events (a user
// message starts the model, asynchronously: beta.sessions.create with
// initial_events, beta.sessions.events.send, beta.agents.sessions.create
// with input, beta.agents.sessions.events.create), a dream
// (beta.dreams.create), and Anthropic's deployments (beta.deployments:
// a path with a deployments segment names an Azure model). The anchor
// after v1 keeps apart the generic names of other APIs: Bedrock's
// InvokeInlineAgent (/agents/<session>, which LiteLLM's /bedrock pass-through
// serves), Vertex AI's /v1/projects/<id>/locations/..., a Live session
// (/v1/live/sessions). A path with a run, deployments or engines segment
// (see runOrModel) is never free. A trailing slash is ignored.
func configures(path string) bool {
	var name string
	var rest [5]string // the segments after name, at most five kept
	n, prev := 0, ""
	for seg := range strings.SplitSeq(strings.TrimRight(path, "/"), "/") {
		if runOrModel(seg) {
			return false
		}
		switch {
		case name != "":
			if n < len(rest) {
				rest[n] = seg
			}
			n++
		case prev == "v1" && seg != "":
			name = seg
		}
		prev = seg
	}
	switch name {
	case "organization", "organizations", "webhook_endpoints", "vaults", "environments", "memory_stores",
		"tunnels", "user_profiles", "compliance":
		return true
	case "agents":
		switch {
		case n == 0: // an agent's creation
			return true
		case rest[0] == "sessions": // a session's settings, not its creation nor its events
			return n == 2
		case rest[0] == "automations": // an automation, not its invocations
			return n <= 2
		case rest[0] == "environments":
			return true
		}
		// An agent's update, but not Mistral's agents completion
		// (/v1/agents/completions, its SDK's agents.complete, also in
		// another case or with path parameters, as runOrModel reads a
		// run), which runs the agent's model.
		seg, _, _ := strings.Cut(rest[0], ";")
		return n == 1 && !strings.EqualFold(seg, "completions")
	case "sessions":
		return n == 1 || n >= 2 && n <= 3 && rest[1] == "resources"
	case "projects":
		return n == 2 && rest[1] == "roles" || n == 3 && rest[1] == "roles" ||
			n == 4 && (rest[1] == "groups" || rest[1] == "users") && rest[3] == "roles"
	}
	return false
}

// endsIn reports whether path, less a trailing slash, ends in one of
// suffixes.
func endsIn(path string, suffixes ...string) bool {
	path = strings.TrimRight(path, "/")
	for _, s := range suffixes {
		if strings.HasSuffix(path, s) {
			return true
		}
	}
	return false
}

// pathModel returns the model a path names the way Gemini's API (Google
// AI's /v1beta/models/<model>:generateContent) and Vertex AI's
// (.../publishers/google/models/<model>:generateContent) do: a last
// segment <model>:<method> right after a "models" segment; "" for any
// other path. The model is a part of path, not a copy.
func pathModel(path string) string {
	i := strings.LastIndexByte(path, '/')
	if i < 0 || !strings.HasSuffix(path[:i], "/models") {
		return ""
	}
	model, _, ok := strings.Cut(path[i+1:], ":")
	if !ok {
		return ""
	}
	return model
}

// batches reports whether a request to path creates a batch whose
// requests come in its body: Anthropic's Message Batches (a path ending in
// /messages/batches: messages.batches.create, beta.messages.batches.create),
// Mistral's inline batch jobs (/batch/jobs: batch.jobs.create with
// requests; its requests call the body's "endpoint", and one of
// embeddings or moderations has no completion) and Gemini's inline
// batches (a last segment ending in :batchGenerateContent). It is charged
// what its requests would be alone (llm.Request.BatchBudget), not a
// default budget of its own besides; the caller asks for a clean path, as
// for the rules that make a request free. A trailing slash is ignored.
func batches(path string) bool {
	return endsIn(path, "/messages/batches", ":batchGenerateContent", "/batch/jobs")
}

// countsTokens reports whether a request to path counts its prompt's
// tokens without running the model: Anthropic's /v1/messages/count_tokens
// and OpenAI's /v1/responses/input_tokens, the whole path as this handler
// sees it (after handle_path or uri strip_prefix), a trailing slash
// ignored. The providers serve both free (Anthropic: "free to use but
// subject to requests per minute rate limits", with limits of their own
// apart from message creation), and their answers report a count, not
// usage, so charging the prompt would bill a client that counts before it
// sends twice for one prompt, and never give it back. No other path is
// one: an upstream that routes by prefix would serve
// /v1/chat/completions/v1/messages/count_tokens as a completion. So are
// Gemini's and Vertex AI's token counts (see googleCountsTokens).
func countsTokens(path string) bool {
	path = strings.TrimRight(path, "/")
	return path == "/v1/messages/count_tokens" || path == "/v1/responses/input_tokens" || googleCountsTokens(path)
}

// googleCountsTokens reports whether path, less a trailing slash, is a
// token count of Gemini's API (/<version>/models/<model>:countTokens,
// models.countTokens) or of a Google model on Vertex AI
// (/<version>/projects/<project>/locations/<location>/publishers/google/models/<model>:countTokens
// or :computeTokens), the whole path, its version v1, v1beta or v1alpha.
// Google serves them free, under a quota of their own
// (https://ai.google.dev/api/tokens,
// https://cloud.google.com/vertex-ai/generative-ai/docs/multimodal/get-token-count),
// and their answers report a count (totalTokens, tokensInfo), not usage:
// the SDKs call them to size a context before each call (Gemini CLI does),
// and each was charged its prompt and default_max_tokens for good.
func googleCountsTokens(path string) bool {
	rest, ok := strings.CutPrefix(path, "/")
	if !ok {
		return false
	}
	version, rest, _ := strings.Cut(rest, "/")
	if version != "v1" && version != "v1beta" && version != "v1alpha" {
		return false
	}
	if call, ok := strings.CutPrefix(rest, "models/"); ok {
		return modelCall(call, ":countTokens")
	}
	var seg [6]string // projects, <p>, locations, <l>, publishers, google
	for i := range seg {
		var found bool
		if seg[i], rest, found = strings.Cut(rest, "/"); !found {
			return false
		}
	}
	call, ok := strings.CutPrefix(rest, "models/")
	return ok && seg[0] == "projects" && seg[1] != "" && seg[2] == "locations" && seg[3] != "" &&
		seg[4] == "publishers" && seg[5] == "google" && (modelCall(call, ":countTokens") || modelCall(call, ":computeTokens"))
}

// modelCall reports whether seg is <model><method>: a model name (not
// empty, without ':' or '/') and the method, as ":countTokens".
func modelCall(seg, method string) bool {
	model, ok := strings.CutSuffix(seg, method)
	return ok && model != "" && !strings.ContainsAny(model, ":/")
}

// uploads reports whether a request to path is one whose body is a form
// for the providers: OpenAI's audio transcriptions and translations, file
// and upload parts, image edits and variations. A form to another path (a
// chat completion sent as "form" data, which LiteLLM's proxy reads as the
// request, as Starlette reads a UTF-16 JSON body whatever its label) is an
// invalid body, not a free one.
func uploads(path string) bool {
	if endsIn(path, "/audio/transcriptions", "/audio/translations", "/files", "/images/edits", "/images/variations", "/parts",
		"/audio/voices", "/audio/voice_consents", "/content_provenance_checks", "/skills", "/plugins", "/plugin_marketplaces/validate_archive") {
		return true
	}
	// A skill's or a plugin's new version: .../skills/<id>/versions.
	p := strings.TrimRight(path, "/")
	if rest, ok := strings.CutSuffix(p, "/versions"); ok {
		if i := strings.LastIndexByte(rest, '/'); i > 0 {
			return endsIn(rest[:i], "/skills", "/plugins")
		}
	}
	return false
}

// formBody reports whether r's body, of which prefix was read (nil when
// its Content-Length was over max_body: then up to 512 bytes are read here,
// within read_timeout, and given back; errBodyTimeout when they do not
// arrive in time), is an HTML form: multipart/form-data (OpenAI's audio
// transcriptions and translations, file uploads, image edits) or
// application/x-www-form-urlencoded, by its Content-Type and by its first
// byte that is not a space, which is not a JSON object's or array's. A
// JSON body labelled a form, which a server that ignores Content-Type
// (Go's encoding/json behind gin or net/http) would still read, is not
// one.
func (e *Estimate) formBody(w http.ResponseWriter, r *http.Request, prefix []byte) (bool, error) {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" && mt != "application/x-www-form-urlencoded" {
		return false, nil
	}
	if prefix == nil && r.Body != nil {
		rc := http.NewResponseController(w)
		if rc.SetReadDeadline(time.Now().Add(time.Duration(e.ReadTimeout))) == nil {
			defer rc.SetReadDeadline(time.Time{})
		}
		var buf [512]byte
		n, err := io.ReadFull(r.Body, buf[:])
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return false, errBodyTimeout
		}
		prefix = bytes.Clone(buf[:n])
		r.Body = readCloser{io.MultiReader(bytes.NewReader(prefix), r.Body), r.Body}
	}
	prefix = bytes.TrimLeft(prefix, " \t\r\n")
	return len(prefix) > 0 && prefix[0] != '{' && prefix[0] != '[', nil
}

// formCall reports whether a request to path is a model call that the
// OpenAI SDK sends as a form: a video's generation, edit, extension,
// remix or character (videos.create, edit, extend, remix and
// createCharacter: /videos, /videos/edits, /videos/extensions,
// /videos/<id>/remix, /videos/characters) and a Realtime call's SDP offer
// (realtime.calls.create: /realtime/calls). A trailing slash is ignored.
func formCall(path string) bool {
	if endsIn(path, "/videos", "/videos/edits", "/videos/extensions", "/videos/characters", "/realtime/calls") {
		return true
	}
	rest, ok := strings.CutSuffix(strings.TrimRight(path, "/"), "/remix")
	i := strings.LastIndexByte(rest, '/')
	return ok && i > 0 && strings.HasSuffix(rest[:i], "/videos")
}

// maxFormParts is the most parts a form model call's body may have; the
// SDK sends at most six. A body of more is invalid: each part costs an
// allocation to read.
const maxFormParts = 64

// formCallEstimate estimates a form model call (see formCall) from its
// whole body: the tokens of its prompt fields, MediaPartTokens for each
// file part (a video's input_reference, the video to edit or extend), and
// for a Realtime call the instructions and tools of its session field
// (JSON, read by llm.ParseRequest); its completion budget is the
// session's max_output_tokens, else default_max_tokens. Its model is the
// model field's, else the session's. A Realtime call's bare SDP offer
// (application/sdp: the SDK sends no form when it has no session) is the
// budget alone. Their answers report no usage, so the estimate is what
// the call is charged. ok is false, the body invalid, when it is no form
// (nor an SDP offer), cannot be read, has more than maxFormParts parts,
// has two model or session fields, or has a part with two
// Content-Disposition headers, one that does not parse or is not
// form-data (which the upstream's form parser would read one way and the
// estimate another). A model or session sent as a file is read as its
// value.
func (e *Estimate) formCallEstimate(r *http.Request, urlPath string, body []byte) (est tokenEstimate, ok bool) {
	est = tokenEstimate{completion: e.DefaultMaxTokens, read: true}
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		return est, false
	}
	var model, session []byte
	var models, sessions int
	field := func(name string, value []byte, file bool) {
		switch {
		case name == "prompt": // its text, even sent as a file
			est.prompt += e.tok.Count(value)
		case name == "model":
			model, models = value, models+1
		case name == "session":
			session, sessions = value, sessions+1
		case file:
			est.prompt += llm.MediaPartTokens
		}
	}
	switch mt {
	case "application/sdp":
		return est, endsIn(urlPath, "/realtime/calls")
	case "multipart/form-data":
		mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
		for n := 0; ; n++ {
			p, err := mr.NextRawPart()
			if err == io.EOF {
				break
			}
			if err != nil || n == maxFormParts {
				return est, false
			}
			// A part's name as any form parser reads it: one
			// Content-Disposition, form-data, whose parameters parse.
			// Python's parsers (python-multipart, behind FastAPI and
			// LiteLLM) take the last of two headers or of two name
			// parameters, and read a name whatever the disposition,
			// where FormName would read none: a session or a prompt
			// hidden so would not be counted.
			disp := p.Header.Values("Content-Disposition")
			if len(disp) > 1 {
				return est, false
			}
			if len(disp) == 1 {
				if d, _, err := mime.ParseMediaType(disp[0]); err != nil || d != "form-data" {
					return est, false
				}
			}
			// A prompt, a model or a session sent as a file is read as
			// its value: a parser that takes a file's content for a
			// field would run it. Other values are not read (from
			// memory; a file's bytes are not copied).
			name := p.FormName()
			var value []byte
			if name == "prompt" || name == "model" || name == "session" {
				value, _ = io.ReadAll(p)
			}
			field(name, value, p.FileName() != "")
		}
	case "application/x-www-form-urlencoded":
		if bytes.Count(body, []byte("&")) >= maxFormParts {
			return est, false
		}
		values, err := url.ParseQuery(string(body))
		if err != nil {
			return est, false
		}
		for name, vs := range values {
			for _, v := range vs {
				field(name, []byte(v), false)
			}
		}
	default:
		return est, false
	}
	if models > 1 || sessions > 1 {
		return est, false
	}
	if session != nil {
		req, err := llm.ParseRequest(session, e.tok)
		if err != nil {
			return est, false
		}
		est.prompt = min(est.prompt+req.PromptTokens, llm.MaxCost)
		est.completion = req.Budget(e.DefaultMaxTokens)
		est.model = req.Model
	}
	if model != nil {
		est.model = strings.ToValidUTF8(string(model), "\uFFFD") // as llm.Request.Model
	}
	return est, true
}

// includesUsage reports whether a request to path is one whose stream
// reports usage with stream_options.include_usage: OpenAI's (and the
// compatible APIs') chat completions and completions. Anthropic's messages
// reject members they do not know, and the Responses API reports usage in
// every stream, so their bodies are never changed. Nor are those of
// Mistral's own completions, its FIM (/fim/completions, the SDK's
// fim.complete) and agents (/agents/completions, agents.complete):
// Mistral refuses a stream_options member with 422 extra_forbidden ("Extra
// inputs are not permitted"), and reports usage in the last chunk of
// every stream.
func includesUsage(path string) bool {
	return strings.HasSuffix(path, "/completions") && // chat completions too
		!strings.HasSuffix(path, "/fim/completions") && !strings.HasSuffix(path, "/agents/completions")
}

// oldAzureVersion reports whether a request's query names an Azure
// OpenAI api-version older than 2024-09-01 (2024-06-01,
// 2024-08-01-preview): those answer a stream_options member 400
// "Unrecognized request argument supplied: stream_options" (or "Unknown
// parameter"); Azure takes it from 2024-09-01-preview and the GA
// 2024-10-21 on. Such a stream is sent as it came, and keeps its
// estimate. A version that is not a date (Azure's v1 API has none) is not
// old.
func oldAzureVersion(q url.Values) bool {
	for _, v := range q["api-version"] {
		if len(v) >= len("2006-01-02") {
			if _, err := time.Parse("2006-01-02", v[:10]); err == nil && v[:10] < "2024-09-01" {
				return true
			}
		}
	}
	return false
}

// setBody makes body r's body, with its Content-Length.
func setBody(r *http.Request, body []byte) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.Header.Set("Content-Length", strconv.Itoa(len(body)))
	r.Header.Del("Transfer-Encoding")
	r.TransferEncoding = nil
}

// readBody reads r's body, up to max_body bytes and within read_timeout,
// and gives it back to r whole for the next handler: what was read, then
// the unread rest. It fails with errInvalidBody for a missing body or one
// over max_body (told by Content-Length before any byte is read, where
// there is one), errBodyTimeout when the body does not arrive in time,
// errBodyTooLarge when it is over the limit of a handler before this one,
// and errClientGone when the client went away before its end.
// The deadline is set on the connection (http.ResponseController) and
// cleared once the read is done, so it never cuts the response short.
func (e *Estimate) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	limit := e.MaxBody
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength > limit {
		return nil, errInvalidBody
	}
	timeout := time.Duration(e.ReadTimeout)
	rc := http.NewResponseController(w)
	timed := rc.SetReadDeadline(time.Now().Add(timeout)) == nil
	// The buffer grows as the bytes arrive: a Content-Length is only a
	// claim, and allocating it up front let bodies that never came hold
	// max_body each.
	n := limit + 1
	if r.ContentLength >= 0 {
		n = r.ContentLength
	}
	var buf bytes.Buffer
	buf.Grow(int(min(n, readChunk)))
	_, err := buf.ReadFrom(io.LimitReader(r.Body, n))
	if err == nil && r.ContentLength >= 0 && int64(buf.Len()) < r.ContentLength {
		err = io.ErrUnexpectedEOF
	}
	body := buf.Bytes()
	if timed {
		_ = rc.SetReadDeadline(time.Time{})
	}
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, errBodyTimeout
		}
		if errors.As(err, new(*http.MaxBytesError)) {
			return nil, errBodyTooLarge
		}
		if errors.As(err, new(*net.OpError)) || r.ProtoMajor >= 2 && r.Context().Err() != nil {
			// An HTTP/1.x connection reset fails the read; an HTTP/2 or
			// HTTP/3 stream's reset ends the request's context. (An
			// HTTP/1.x connection closed mid-body ends the read early and
			// its context too, as a client that half-closes after a body
			// shorter than its Content-Length does, which is still there
			// to read the 400.)
			return nil, errClientGone
		}
		return nil, errInvalidBody
	}
	rest, tooLarge := r.Body, int64(len(body)) > limit
	if tooLarge && timed {
		// Only on_invalid <cost> lets such a body through: the rest comes
		// with the same deadline per read.
		rest = &deadlineReader{ReadCloser: rest, rc: rc, timeout: timeout}
	}
	r.Body = readCloser{io.MultiReader(bytes.NewReader(body), rest), rest}
	if tooLarge {
		return body, errInvalidBody // what was read, for formBody
	}
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

func (e *Estimate) validate() error {
	if e == nil {
		return nil
	}
	if err := maxBodyRule(e.MaxBody); e.MaxBody != 0 && err != nil {
		return fmt.Errorf("estimate.max_body %d: %v", e.MaxBody, err)
	}
	if err := durationRule(time.Duration(e.ReadTimeout)); e.ReadTimeout != 0 && err != nil {
		return fmt.Errorf("estimate.read_timeout %v: %v", time.Duration(e.ReadTimeout), err)
	}
	switch e.Tokenizer {
	case "", llm.Approx, llm.O200kBase, llm.Cl100kBase:
	default:
		return fmt.Errorf("estimate.tokenizer %q: must be %s, %s or %s", e.Tokenizer, llm.Approx, llm.O200kBase, llm.Cl100kBase)
	}
	if err := budgetRule(e.DefaultMaxTokens); e.DefaultMaxTokens != 0 && err != nil {
		return fmt.Errorf("estimate.default_max_tokens %d: %v", e.DefaultMaxTokens, err)
	}
	if e.OnInvalid != nil && (*e.OnInvalid < -1 || *e.OnInvalid > MaxCost) {
		return fmt.Errorf("estimate.on_invalid %d: must be a cost from 0 to %d, or -1 to reject", *e.OnInvalid, int64(MaxCost))
	}
	return nil
}
