package llm

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"
)

// Bounds and fixed costs of the estimate.
const (
	// MaxCost is the largest count the estimate handles: 2^53 - 1, the
	// largest integer that JSON numbers and Lua (double) numbers hold
	// exactly. A budget above it makes the body invalid; PromptTokens and
	// Cost saturate at it.
	MaxCost = 1<<53 - 1
	// MaxDepth is the deepest nesting of objects and arrays a body may
	// have, the top-level object being level 1. A deeper body is invalid.
	// Real requests, JSON schemas of tools included, stay far below it.
	MaxDepth = 128
	// MediaPartTokens is what a content part that is not text counts (an
	// image, audio, a file or a part of an unknown type): the base cost of
	// a low-detail image in OpenAI's pricing.
	MediaPartTokens = 85
)

// ErrInvalidBody is returned, wrapped with the reason, by ParseRequest
// for a body that is not one JSON object (invalid JSON, another value,
// trailing data), that nests deeper than MaxDepth, whose messages is not
// an array of objects, whose budget (max_tokens, max_completion_tokens,
// max_output_tokens) is neither null nor an integer up to MaxCost (a
// negative one sets no limit) nor max_output_tokens's "inf", whose n or
// best_of is neither null nor an integer from 0 to MaxCost, or
// that parsers read differently (see the package documentation).
var ErrInvalidBody = errors.New("llm: invalid request body")

// Request is what the estimate reads of an LLM API request body.
type Request struct {
	// PromptTokens is the estimate of the input tokens: the sum of the
	// counts of every text the package documentation lists, under the
	// tokenizer given to ParseRequest, plus MediaPartTokens per media part.
	// At most MaxCost.
	PromptTokens int64
	// MaxTokens is the completion budget the body sets, in tokens: the
	// largest number among every max_completion_tokens, max_tokens and
	// max_output_tokens member (duplicates included) and every budget of
	// a settings object (Ollama's options, TGI's parameters, Gemini's
	// generationConfig, Bedrock's inferenceConfig: see settings) and of
	// llama.cpp's top-level n_predict (read as those are), from 0 to
	// MaxCost;
	// -1 when none is set to a number from 0 (absent, null, negative or
	// "inf"). Charge Budget, which accounts for a null duplicate and a
	// member without limit too.
	MaxTokens int64
	// Model is the "model" member when it is a string, else "", with each
	// byte that is not valid UTF-8 read as U+FFFD. A batch (see Requests)
	// without one has the model that every batched request naming one
	// names, "" when two of them differ.
	Model string
	// Stream is true when the "stream" member is true.
	Stream bool
	// Inputs is true when the body has an "inputs" member, whatever its
	// value: Mistral's conversations run the model on a body that has one,
	// even when its entries hold no text the estimate counts (an empty
	// function result).
	Inputs bool
	// IncludeUsage is true when the last "stream_options" member is an
	// object whose last "include_usage" member is true.
	IncludeUsage bool
	// Choices is how many completions the request asks for per prompt:
	// the largest of every "n" (OpenAI chat and completions) and "best_of"
	// (legacy completions) member, and of a settings object's best_of
	// (TGI) and candidateCount (Gemini), 1 when none is set (or set to 0 or
	// null). Each completion may use the whole budget, so Budget
	// multiplies by it: a body with "n":128 and "max_tokens":1000 may use
	// 128,000 completion tokens.
	Choices int64
	// Prompts is how many prompts the request sends: the number of
	// strings and arrays in a "prompt" array (legacy completions: an
	// array of prompts, ["a","b"], or of token id arrays, [[1,2],[3]]),
	// 1 when prompt is a string, one array of token ids, anything else,
	// or absent; of duplicate prompt members, the largest; and as many
	// as the items of an "instances" array (Vertex AI's :predict, whose
	// instances are each one prediction), if more. Legacy
	// completions generates Choices completions for each prompt, so
	// Budget multiplies by it too: "prompt":["a","b","c"], "n":2 and
	// "max_tokens":100 may use 600 completion tokens.
	Prompts int64

	// MixedModels is true when the body names more than one model: two
	// batched requests name different ones, or one and the top level.
	// Model is then the top level's, or "" (and the model of what runs is
	// no one model).
	MixedModels bool
	// Endpoint is the top-level "endpoint" member when it is a string (the
	// last one), else "": the API a batch job's requests call (Mistral's
	// batch jobs, "/v1/embeddings"), read as Model is.
	Endpoint string
	// Requests is how many batched requests the body holds: the objects
	// in the "params" (or "request", or "body") member of each item of a
	// top-level "requests" array, as Anthropic's Message Batches
	// (messages.batches.create) and Mistral's inline batch jobs send them,
	// or of batch.input_config.requests.requests (or inputConfig), as
	// Gemini's inline batches do. Each is read as a
	// request body is, its texts counting in PromptTokens; BatchBudget
	// adds up the budgets they would be charged alone. 0 for a body
	// without them.
	Requests int64

	// batchBudget: the budgets the batched requests set, each times its
	// choices and prompts; batchDefaults: the sum of the choices times
	// prompts of those whose provider may apply its own default budget
	// (none set, or one with a null duplicate). Both at most MaxCost.
	batchBudget, batchDefaults int64
	// budgetSure: some budget member is a number in all its occurrences,
	// and none sets no limit, so the provider's own default budget never
	// applies.
	budgetSure bool
	rw         rewriteSpots
}

// Budget returns the completion budget to charge, in tokens: MaxTokens,
// or defaultMax when the body sets no budget, times Choices, times
// Prompts (at most MaxCost). When every budget member
// set to a number also has a null duplicate, the provider may read null
// (the last duplicate wins) and apply its own default: Budget is then the
// larger of MaxTokens and defaultMax. So it is when some budget member
// sets no limit (a negative integer, max_output_tokens "inf"), which a
// server may read rather than the others.
//
// A body with batched requests (Requests > 0) adds their budgets (see
// BatchBudget): a server that reads it as one request may run the top
// level with its default budget, a batch endpoint runs the batch.
func (r Request) Budget(defaultMax int64) int64 {
	return satAdd(r.topBudget(defaultMax), r.batchedBudget(defaultMax))
}

// BatchBudget returns the completion budget to charge for a body sent to a
// batch endpoint (Anthropic's Message Batches, Mistral's batch jobs,
// Gemini's batchGenerateContent), in tokens: what its batched requests
// would be charged alone, the sum of their budgets plus defaultMax for
// each that sets none or has a null duplicate (which the provider may
// read), each times its own choices and prompts; plus the top level's budget
// only where it sets one, since a batch has no completion of its own. At
// most MaxCost.
func (r Request) BatchBudget(defaultMax int64) int64 {
	b := r.batchedBudget(defaultMax)
	if r.MaxTokens > 0 {
		b = satAdd(b, satMul(r.MaxTokens, satMul(r.Choices, r.Prompts)))
	}
	return b
}

// batchedBudget is the sum of the batched requests' budgets.
func (r Request) batchedBudget(defaultMax int64) int64 {
	return satAdd(r.batchBudget, satMul(r.batchDefaults, defaultMax))
}

// topBudget is Budget of the top level alone.
func (r Request) topBudget(defaultMax int64) int64 {
	b := r.MaxTokens
	switch {
	case r.MaxTokens < 0:
		b = defaultMax
	case !r.budgetSure:
		b = max(r.MaxTokens, defaultMax)
	}
	return satMul(b, satMul(r.Choices, r.Prompts))
}

// Cost returns PromptTokens + Budget(defaultMax), at most MaxCost.
func (r Request) Cost(defaultMax int64) int64 {
	c := r.PromptTokens + r.Budget(defaultMax)
	if c > MaxCost || c < 0 {
		return MaxCost
	}
	return c
}

// ParseRequest reads body in one pass and estimates its tokens with tok
// (nil: Approx). Member names are matched exactly, as the providers do; a
// body that parsers read differently is invalid (see the package
// documentation, "Names and duplicates"). The body is not
// modified nor retained. Time and memory are linear in len(body). Under
// Approx a parse allocates only the Model and Endpoint strings (and a
// buffer for a string over 64 KB with escapes, or for more than 1,024
// source data or result members read before their type); a BPE
// tokenizer allocates per text. The error wraps ErrInvalidBody.
func ParseRequest(body []byte, tok Tokenizer) (Request, error) {
	if tok == nil {
		tok = approxTokenizer{}
	}
	p := parserPool.Get().(*parser)
	req, err := p.run(body, tok)
	p.release()
	return req, err
}

// run parses body with p.
func (p *parser) run(body []byte, tok Tokenizer) (Request, error) {
	p.body, p.tok, p.prompt = body, tok, 0
	p.pending = p.pending[:0]
	p.in = *bytes.NewBuffer(body) // the decoder reads body in place, no copy
	p.dec.Reset(&p.in, decodeOptions...)
	req, err := p.parse()
	if err != nil {
		return Request{}, err
	}
	return req, nil
}

// decodeOptions: duplicate names are the parser's business (it counts
// every copy); invalid UTF-8 is counted, as a lenient provider would read
// it, rather than refused.
var decodeOptions = []jsontext.Options{
	jsontext.AllowDuplicateNames(true),
	jsontext.AllowInvalidUTF8(true),
}

var parserPool = sync.Pool{New: func() any { return new(parser) }}

// parser is the state of one ParseRequest, pooled.
type parser struct {
	dec    jsontext.Decoder
	in     bytes.Buffer
	body   []byte
	tok    Tokenizer
	prompt int64
	name   []byte // an unquoted member name with escapes
	text   []byte // an unquoted string with escapes
	// pending holds the spans of the "data" members of the sources, and
	// of the "result" members of the parts, being read whose type is not
	// known yet (see source and part), innermost last.
	pending []span
	batch   batchState // the body's batched requests (see batchRequests)
}

// span is the offsets in the body of a value's first byte and of the
// byte past its last.
type span struct{ start, end int }

func (p *parser) release() {
	p.body, p.tok = nil, nil
	p.in = bytes.Buffer{}
	p.dec.Reset(&p.in)
	if cap(p.text) > 64<<10 || cap(p.name) > 64<<10 || cap(p.batch.model) > 64<<10 {
		p.text, p.name, p.batch.model = nil, nil, nil // do not pin the memory of a huge string
	}
	if cap(p.pending) > 1<<10 {
		p.pending = nil
	}
	parserPool.Put(p)
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidBody}, args...)...)
}

// syntax wraps an error of the decoder.
func syntax(err error) error {
	return fmt.Errorf("%w: %w", ErrInvalidBody, err)
}

// The budget members, all three equivalent.
const (
	budgetMaxTokens = iota
	budgetMaxCompletionTokens
	budgetMaxOutputTokens
	budgetSettings // of a settings object: see settings
	budgets
)

// parse reads the top-level object.
func (p *parser) parse() (Request, error) {
	req := Request{MaxTokens: -1, Choices: 1, Prompts: 1, rw: rewriteSpots{bodyLen: len(p.body)}}
	if k := p.dec.PeekKind(); k != '{' {
		if k == jsontext.KindInvalid {
			_, err := p.dec.ReadToken()
			return req, syntax(err)
		}
		return req, invalid("not a JSON object")
	}
	if _, err := p.dec.ReadToken(); err != nil {
		return req, syntax(err)
	}
	req.rw.objOpen = int(p.dec.InputOffset()) - 1
	req.rw.objEmpty = p.dec.PeekKind() == '}'
	var st requestState
	p.batch = batchState{model: p.batch.model[:0]} // the buffer is kept
	if err := p.requestMembers(&req, &st, true); err != nil {
		return req, err
	}
	if _, err := p.dec.ReadToken(); err != nil {
		return req, syntax(err)
	}
	end := int(p.dec.InputOffset())
	for _, c := range p.body[end:] {
		if c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			return req, invalid("data after the top-level object at byte %d", end)
		}
	}
	st.finish(&req)
	req.MixedModels = p.batch.mixed
	switch {
	case st.model.start >= 0:
		// The top level's, also beside a batch: the model any server
		// that reads the body as one request runs (and Mistral's batch
		// jobs run where a request names none).
		model := p.unquote(p.body[st.model.start:st.model.end])
		req.MixedModels = req.MixedModels || p.batch.named && !sameModel(model, p.batch.model)
		req.Model = validUTF8(model)
	case p.batch.named && !p.batch.mixed:
		req.Model = validUTF8(p.batch.model)
	}
	if st.endpoint.start >= 0 {
		req.Endpoint = validUTF8(p.unquote(p.body[st.endpoint.start:st.endpoint.end]))
	}
	req.Requests = p.batch.requests
	req.batchBudget, req.batchDefaults = p.batch.budget, p.batch.defaults
	req.PromptTokens = min(p.prompt, MaxCost)
	req.rw.ok = true
	return req, nil
}

// requestState is what the members of one request object set besides its
// Request: which budget members were numbers and null, and where its
// model is.
type requestState struct {
	numeric, null         [budgets]bool
	unlimited             bool // some budget member is a negative integer or "inf": no limit
	seenModel, seenStream bool
	model                 span // the model's string in the body; start -1 without
	endpoint              span // the last top-level "endpoint" string; start -1 without
}

// finish sets req's budgetSure from what its members set.
func (st *requestState) finish(req *Request) {
	for b := range budgets {
		req.budgetSure = req.budgetSure || st.numeric[b] && !st.null[b]
	}
	if st.null[budgetSettings] || st.unlimited {
		// Ollama's num_predict -1 (no limit) or -2 (fill the context):
		// Ollama reads no top-level budget, so none is sure. A top-level
		// member without limit (max_tokens -1, max_output_tokens "inf")
		// may be the one a server reads of several: llama.cpp's server
		// reads max_completion_tokens before max_tokens, Ollama max_tokens
		// alone, so the other members are no surer.
		req.budgetSure = false
	}
}

// requestMembers reads the members of a request object, the top-level one
// (top) or a batched request's (see batchRequests), up to its '}'. Its
// texts count in p.prompt; the rest is set in req and st. Only the top
// level reads "stream_options" and a batch ("requests", "batch").
func (p *parser) requestMembers(req *Request, st *requestState, top bool) error {
	st.model, st.endpoint = span{-1, -1}, span{-1, -1}
	for p.dec.PeekKind() != '}' {
		name, err := p.memberName()
		if err != nil {
			return err
		}
		if !top && topLevelOnly(name) {
			// A batched request has no stream options, endpoint or
			// batch of its own.
			if err := p.skip(); err != nil {
				return err
			}
			continue
		}
		b := -1
		switch string(name) {
		case "model":
			if st.seenModel {
				return invalid("duplicate model member")
			}
			st.seenModel = true
			if p.dec.PeekKind() == '"' {
				st.model, err = p.stringSpan()
			} else {
				err = p.skip()
			}
		case "stream":
			if st.seenStream {
				return invalid("duplicate stream member")
			}
			st.seenStream = true
			switch p.dec.PeekKind() {
			case 't', 'f', 'n':
			default:
				return invalid("stream is not true, false or null")
			}
			req.Stream = p.dec.PeekKind() == 't'
			err = p.skip()
		case "stream_options":
			err = p.streamOptions(req)
		case "endpoint":
			// A batch job's endpoint (Mistral's): the API its requests
			// call. The last one, as a Python server reads it.
			if p.dec.PeekKind() == '"' {
				st.endpoint, err = p.stringSpan()
			} else {
				err = p.skip()
			}
		case "requests":
			err = p.batchRequests()
		case "batch":
			err = p.geminiBatch()
		case "max_tokens":
			b = budgetMaxTokens
		case "max_completion_tokens":
			b = budgetMaxCompletionTokens
		case "max_output_tokens":
			b = budgetMaxOutputTokens
		case "n", "best_of":
			var n int64
			var isNull bool
			if n, isNull, err = p.budget(name); err == nil && !isNull {
				req.Choices = max(req.Choices, n)
			}
		case "messages":
			err = p.messages()
		case "prompt":
			var n int64
			if n, err = p.prompts(); err == nil {
				req.Prompts = max(req.Prompts, n)
			}
		case "system", "input", "inputs", "instructions", "suffix", "contents":
			req.Inputs = req.Inputs || string(name) == "inputs"
			err = p.content()
		case "events", "initial_events":
			// The events sent to an agent session (Anthropic's
			// beta.sessions.events.send and a session's initial events,
			// OpenAI's beta.agents.sessions.events.create): a user
			// message, a tool result, an outcome to reach.
			err = p.content()
		case "instances":
			// Vertex AI's :predict (Google's text and multimodal
			// embeddings, Imagen; a model deployed on an endpoint): its
			// instances, each one prediction (see instances).
			var n int64
			if n, err = p.instances(req, st); err == nil {
				req.Prompts = max(req.Prompts, n)
			}
		case "content":
			// Gemini's EmbedContentRequest (:embedContent, and each of
			// :asyncBatchEmbedContent's requests): one Content, read as
			// a message is.
			if p.dec.PeekKind() == '{' {
				err = p.part(true)
			} else {
				err = p.content()
			}
		case "title":
			// An EmbedContentRequest's title (taskType
			// RETRIEVAL_DOCUMENT), which the model embeds with its
			// content: a content value.
			err = p.content()
		case "systemInstruction", "system_instruction":
			// Gemini's system instruction, one Content ({"parts":[...]}),
			// read as a message is.
			if p.dec.PeekKind() == '{' {
				err = p.part(true)
			} else {
				err = p.content()
			}
		case "tools", "functions", "response_format", "output_format", "toolConfig":
			err = p.jsonText()
		case "query":
			// A rerank's query (Cohere's, vLLM's /rerank, as LiteLLM
			// serves them).
			err = p.content()
		case "documents":
			err = p.documents()
		case "context":
			// Ollama's generate context: the token ids of the exchange
			// before, which the model reads again, one token each.
			err = p.content()
		case "images":
			err = p.images()
		case "options", "parameters", "generationConfig", "generation_config", "inferenceConfig":
			err = p.settings(req, &st.numeric[budgetSettings], &st.null[budgetSettings])
		case "n_predict":
			// llama.cpp's server's own budget, which it reads before
			// max_completion_tokens and max_tokens (on /completion and on
			// its OpenAI-compatible routes alike), as loosely as a
			// settings object's: -1 (no limit) sets none, and no other
			// budget is sure.
			err = p.looseBudget(req, &st.numeric[budgetSettings], &st.null[budgetSettings])
		case "text", "output_config":
			// The Responses API's text.format, Anthropic's
			// output_config.format (output_format in its beta): a
			// structured output's schema, counted as OpenAI counts
			// response_format's.
			err = p.textOptions()
		default:
			if m := foldsTo(name, topLevelNames); m != nil {
				return invalid("member %q is %q in another case", name, m)
			}
			err = p.skip()
		}
		if b >= 0 {
			n, isNull, e := p.budget(name)
			if e != nil {
				return e
			}
			if isNull {
				st.null[b] = true
				st.unlimited = st.unlimited || n < 0
			} else {
				st.numeric[b] = true
				req.MaxTokens = max(req.MaxTokens, n)
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// topLevelOnly reports whether name is a member only the top level reads:
// stream options and a batch's.
func topLevelOnly(name []byte) bool {
	switch string(name) {
	case "stream_options", "endpoint", "requests", "batch":
		return true
	}
	return false
}

// geminiBatch reads Gemini's inline batch (batchGenerateContent):
// batch.input_config (or inputConfig).requests.requests, an array of
// {"request", "metadata"} (see batchRequests).
func (p *parser) geminiBatch() error {
	return p.members(func(n []byte) error {
		if string(n) != "input_config" && string(n) != "inputConfig" {
			if m := foldsTo(n, inputConfigNames); m != nil {
				return invalid("member %q of batch is %q in another case", n, m)
			}
			return p.skip()
		}
		return p.exactMember("requests", func() error {
			return p.exactMember("requests", p.batchRequests)
		})
	})
}

// batchState is what a body's batched requests add up to (see
// batchRequests).
type batchState struct {
	requests int64  // the batched requests read
	budget   int64  // the budgets they set, times their choices and prompts
	defaults int64  // their choices times prompts where the budget may be the provider's default
	model    []byte // the model they name, unquoted (the parser's buffer)
	named    bool   // some batched request names a model: model
	mixed    bool   // two of them name different models
}

// batchRequests reads the requests of a batch: Anthropic's Message
// Batch (messages.batches.create: a top-level "requests" array of
// {"custom_id", "params"}, each params a Messages request), Mistral's
// inline batch job (of {"custom_id", "body"}, each body a request of the
// job's endpoint) or Gemini's inline batch (an array of {"request",
// "metadata"}, each request a generateContent or embedContent body). The
// texts of every batched request count in p.prompt, and each adds to
// p.batch the completion budget it would be charged alone (see
// Request.BatchBudget). An item's content (Gemini's batchEmbedContents,
// whose items are the requests) counts as a message's, and its title as
// a content value. An item that is
// not an object counts as one text when a string, else as its JSON text
// (null: nothing), and so does a "requests" that is not an array; a
// params, request or body that is not an object counts nothing.
func (p *parser) batchRequests() error {
	switch p.dec.PeekKind() {
	case 'n':
		return p.skip()
	case '[':
	default:
		return p.jsonText()
	}
	return p.elements(func() error {
		if p.dec.PeekKind() != '{' {
			return p.strOrJSON()
		}
		return p.members(func(name []byte) error {
			switch string(name) {
			case "params", "request", "body":
				if p.dec.PeekKind() != '{' {
					return p.skip()
				}
				return p.batchedRequest()
			case "content":
				// An item that is a request of its own: Gemini's
				// batchEmbedContents (an EmbedContentRequest: model,
				// content), whose content is embedded. Its text counts;
				// it sets no budget.
				if p.dec.PeekKind() == '{' {
					return p.part(true)
				}
				return p.content()
			case "title":
				// Such an item's title, embedded with its content.
				return p.content()
			}
			if m := foldsTo(name, batchItemNames); m != nil {
				// A Go server (encoding/json) would run it as the
				// batched request the estimate did not read.
				return invalid("member %q of a batched request is %q in another case", name, m)
			}
			return p.skip()
		})
	})
}

// batchedRequest reads one batched request object and adds it to p.batch.
func (p *parser) batchedRequest() error {
	if err := p.begin(); err != nil {
		return err
	}
	req := Request{MaxTokens: -1, Choices: 1, Prompts: 1}
	var st requestState
	if err := p.requestMembers(&req, &st, false); err != nil {
		return err
	}
	if err := p.end(); err != nil {
		return err
	}
	st.finish(&req)
	b := &p.batch
	b.requests++
	per := satMul(req.Choices, req.Prompts)
	if req.MaxTokens >= 0 {
		b.budget = satAdd(b.budget, satMul(req.MaxTokens, per))
	}
	if !req.budgetSure {
		// No budget, or one with a null duplicate: the provider's default
		// may apply, and is charged on top (more than max(budget,
		// default), never less).
		b.defaults = satAdd(b.defaults, per)
	}
	if st.model.start >= 0 {
		model := p.unquote(p.body[st.model.start:st.model.end])
		switch {
		case !b.named:
			b.model, b.named = append(b.model[:0], model...), true
		case !sameModel(model, b.model):
			b.mixed = true
		}
	}
	return nil
}

// sameModel reports whether two model names name one model: the same
// bytes, but for a leading "models/" (Gemini names a model both
// "models/gemini-2.5-pro" and "gemini-2.5-pro").
func sameModel(a, b []byte) bool {
	return bytes.Equal(bytes.TrimPrefix(a, modelsPrefix), bytes.TrimPrefix(b, modelsPrefix))
}

var modelsPrefix = []byte("models/")

// satAdd returns a + b, both from 0 to MaxCost, at most MaxCost.
func satAdd(a, b int64) int64 { return min(a+b, MaxCost) }

// satMul returns a × b, both from 0 to MaxCost, at most MaxCost.
func satMul(a, b int64) int64 {
	if a != 0 && b > MaxCost/a {
		return MaxCost
	}
	return a * b
}

// topLevelNames are the members of the top-level object the estimate
// reads.
var topLevelNames = namesOf("model", "stream", "stream_options", "max_tokens",
	"max_completion_tokens", "max_output_tokens", "n", "best_of", "messages",
	"system", "prompt", "input", "inputs", "instructions", "suffix", "tools",
	"functions", "response_format", "text", "output_config", "output_format",
	"options", "context", "images", "requests", "events", "initial_events", "batch", "endpoint", "content", "title", "instances")

// batchItemNames are the members of a batch's item that hold its request
// (Anthropic's params, Gemini's request, Mistral's body) or its text
// (the content and title of Gemini's batchEmbedContents), and
// inputConfigNames those of Gemini's batch that lead to its requests: in
// another case, Go's encoding/json reads them as these, so a body with
// one is invalid, as with topLevelNames.
var (
	batchItemNames   = namesOf("params", "request", "body", "content", "title")
	inputConfigNames = namesOf("input_config", "inputConfig")
)

// includeUsage is the member of stream_options the estimate reads.
var includeUsage = namesOf("include_usage")

func namesOf(names ...string) [][]byte {
	b := make([][]byte, len(names))
	for i, n := range names {
		b[i] = []byte(n)
	}
	return b
}

// foldsTo returns the one of names that name equals under Unicode case
// folding (bytes.EqualFold, as Go's encoding/json matches member names to
// struct fields), or nil. The caller has already matched name exactly. A
// name whose first byte is ASCII but no letter of any of names, in either
// case, is not compared (U+017F and U+212A, which fold to 's' and 'k', are
// not ASCII).
func foldsTo(name []byte, names [][]byte) []byte {
	if len(name) == 0 {
		return nil
	}
	if c := name[0]; c < utf8.RuneSelf && !strings.ContainsRune("bcefimnoprstBCEFIMNOPRST", rune(c)) {
		return nil
	}
	for _, n := range names {
		if bytes.EqualFold(name, n) {
			return n
		}
	}
	return nil
}

// memberName reads an object member name and returns it unquoted; it is
// valid until the next memberName.
func (p *parser) memberName() ([]byte, error) {
	raw, err := p.dec.ReadValue()
	if err != nil {
		return nil, syntax(err)
	}
	s := raw[1 : len(raw)-1]
	if bytes.IndexByte(s, '\\') < 0 {
		return s, nil
	}
	p.name, _ = jsontext.AppendUnquote(p.name[:0], raw) // syntax checked by the decoder
	return p.name, nil
}

// unquote returns the text of a JSON string read by the decoder, valid
// until the next unquote. Escapes are decoded; invalid UTF-8 and lone
// surrogate escapes become U+FFFD when the string has escapes, and stay
// as they are otherwise.
func (p *parser) unquote(raw []byte) []byte {
	s := raw[1 : len(raw)-1]
	if bytes.IndexByte(s, '\\') < 0 {
		return s
	}
	p.text, _ = jsontext.AppendUnquote(p.text[:0], raw) // syntax checked by the decoder
	return p.text
}

// validUTF8 returns b as a string in which each byte that is not part of
// valid UTF-8 is U+FFFD, as Go's encoding/json decodes a string (and as
// unquote does for a string with escapes).
func validUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var s strings.Builder
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		s.WriteRune(r) // utf8.RuneError for an invalid byte, n == 1
		b = b[n:]
	}
	return s.String()
}

func (p *parser) add(n int64) { p.prompt += n }

// budget reads the value of a budget member, or of n or best_of: null, or
// an integer from 0 to MaxCost. A budget member may also be a negative
// integer, which reads as null, no budget: LM Studio's and llama.cpp's
// OpenAI-compatible servers take "max_tokens": -1 for no limit (llama.cpp's
// n_predict -1), where OpenAI and vLLM refuse it, so that charging
// defaultMax holds either way. max_output_tokens may also be "inf" (the
// Realtime API's unlimited budget, as in realtime.calls.accept), which
// reads as null too. Both are isNull with n -1 (a null is n 0): no limit,
// which no other budget member overrides (see requestState.finish).
func (p *parser) budget(name []byte) (n int64, isNull bool, err error) {
	k := p.dec.PeekKind()
	if k == '"' && string(name) == "max_output_tokens" {
		raw, err := p.dec.ReadValue()
		if err != nil {
			return 0, false, syntax(err)
		}
		if string(raw) != `"inf"` {
			return 0, false, invalid("%s %.20s is not a number or \"inf\"", name, raw)
		}
		return -1, true, nil
	}
	if k != 'n' && k != '0' {
		if err := p.skip(); err != nil {
			return 0, false, err
		}
		return 0, false, invalid("%s is not a number", name)
	}
	raw, err := p.dec.ReadValue()
	if err != nil {
		return 0, false, syntax(err)
	}
	if k == 'n' {
		return 0, true, nil
	}
	if raw[0] == '-' {
		if string(name) == "n" || string(name) == "best_of" || !digits(raw[1:]) {
			return 0, false, invalid("%s %.20s is not an integer from 0", name, raw)
		}
		return -1, true, nil
	}
	if len(raw) > 16 { // MaxCost has 16 digits
		return 0, false, invalid("%s %.20s is not an integer up to %d", name, raw, int64(MaxCost))
	}
	if !digits(raw) {
		return 0, false, invalid("%s %.20s is not an integer", name, raw)
	}
	for _, c := range raw {
		n = n*10 + int64(c-'0')
	}
	if n > MaxCost {
		return 0, false, invalid("%s %s is above %d", name, raw, int64(MaxCost))
	}
	return n, false, nil
}

// digits reports whether b is one or more decimal digits: a JSON number
// without sign, fraction or exponent.
func digits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return len(b) > 0
}

// begin reads the '{' or '[' the decoder is at, within MaxDepth.
func (p *parser) begin() error {
	if _, err := p.dec.ReadToken(); err != nil {
		return syntax(err)
	}
	if p.dec.StackDepth() > MaxDepth {
		return invalid("nested deeper than %d at byte %d", MaxDepth, p.dec.InputOffset()-1)
	}
	return nil
}

// end reads the '}' or ']' the decoder is at.
func (p *parser) end() error {
	if _, err := p.dec.ReadToken(); err != nil {
		return syntax(err)
	}
	return nil
}

// stringSpan reads the string the decoder is at and returns where it is
// in the body, quotes included.
func (p *parser) stringSpan() (span, error) {
	raw, err := p.dec.ReadValue()
	if err != nil {
		return span{}, syntax(err)
	}
	end := int(p.dec.InputOffset())
	return span{end - len(raw), end}, nil
}

// skipSpan reads a value, whatever it is, within MaxDepth, and returns
// the offsets in the body of its first byte and of the byte past its last.
func (p *parser) skipSpan() (start, end int, err error) {
	switch p.dec.PeekKind() {
	case '{', '[':
	default:
		raw, err := p.dec.ReadValue()
		if err != nil {
			return 0, 0, syntax(err)
		}
		end = int(p.dec.InputOffset())
		return end - len(raw), end, nil
	}
	if err := p.begin(); err != nil {
		return 0, 0, err
	}
	start = int(p.dec.InputOffset()) - 1
	for depth := p.dec.StackDepth() - 1; p.dec.StackDepth() > depth; {
		switch p.dec.PeekKind() {
		case '{', '[':
			err = p.begin()
		default:
			_, err = p.dec.ReadToken()
			if err != nil {
				err = syntax(err)
			}
		}
		if err != nil {
			return 0, 0, err
		}
	}
	return start, int(p.dec.InputOffset()), nil
}

func (p *parser) skip() error {
	_, _, err := p.skipSpan()
	return err
}

// jsonText counts the raw JSON text of a value; null counts nothing.
func (p *parser) jsonText() error {
	if p.dec.PeekKind() == 'n' {
		return p.skip()
	}
	start, end, err := p.skipSpan()
	if err != nil {
		return err
	}
	p.add(p.tok.Count(p.body[start:end]))
	return nil
}

// str counts the string the decoder is at.
func (p *parser) str() error {
	raw, err := p.dec.ReadValue()
	if err != nil {
		return syntax(err)
	}
	p.add(p.tok.Count(p.unquote(raw)))
	return nil
}

// strOrJSON counts a string as one text, anything else as its raw JSON
// text (null: nothing).
func (p *parser) strOrJSON() error {
	if p.dec.PeekKind() == '"' {
		return p.str()
	}
	return p.jsonText()
}

// countSpan counts the value at s in the body as strOrJSON does.
func (p *parser) countSpan(s span) {
	switch p.body[s.start] {
	case '"':
		p.add(p.tok.Count(p.unquote(p.body[s.start:s.end])))
	case 'n':
	default:
		p.add(p.tok.Count(p.body[s.start:s.end]))
	}
}

// content counts a content value: a string is a text; an array holds
// items; null is nothing; anything else counts as JSON text.
func (p *parser) content() error {
	switch p.dec.PeekKind() {
	case '"':
		return p.str()
	case '[':
		_, err := p.items()
		return err
	case 'n':
		return p.skip()
	}
	return p.jsonText()
}

// prompts counts a "prompt" member as a content value and returns how
// many prompts it holds (see Request.Prompts).
func (p *parser) prompts() (int64, error) {
	if p.dec.PeekKind() != '[' {
		return 1, p.content()
	}
	n, err := p.items()
	return max(n, 1), err
}

// items counts the items of the array the decoder is at, and returns how
// many of them are strings or arrays.
func (p *parser) items() (n int64, err error) {
	if err := p.begin(); err != nil {
		return 0, err
	}
	for {
		switch p.dec.PeekKind() {
		case ']':
			return n, p.end()
		case '"':
			n++
			err = p.str()
		case '0': // a token id
			p.add(1)
			err = p.skip()
		case '[':
			n++
			_, err = p.items()
		case '{':
			err = p.part(false)
		case 'n':
			err = p.skip()
		default:
			err = p.jsonText()
		}
		if err != nil {
			return n, err
		}
	}
}

// instances reads the "instances" of Vertex AI's :predict (and of the
// prediction protocols it follows: KServe's v1, TensorFlow Serving's) and
// returns how many predictions they ask for (see Request.Prompts): each
// item of an array is one, which the model runs with the top level's
// parameters, as legacy completions runs each prompt of an array; an
// array of none, or a value that is no array, counts as one. A string
// item is a text, an array item holds items (token ids count one each),
// an object item is read by instance; anything else counts as JSON text.
func (p *parser) instances(req *Request, st *requestState) (int64, error) {
	if p.dec.PeekKind() != '[' {
		return 1, p.content()
	}
	var n int64
	err := p.elements(func() error {
		switch p.dec.PeekKind() {
		case 'n':
			return p.skip()
		case '"':
			n++
			return p.str()
		case '0':
			n++
			p.add(1)
			return p.skip()
		case '[':
			n++
			_, err := p.items()
			return err
		case '{':
			n++
			return p.instance(req, st)
		}
		n++
		return p.jsonText()
	})
	return max(n, 1), err
}

// instance reads one object of instances. Google's models take a text
// embedding's content and title, a multimodal embedding's text, Imagen's
// prompt; a text model deployed on an endpoint (Model Garden's vLLM,
// Hugging Face TGI and Hex-LLM containers,
// https://cloud.google.com/vertex-ai/generative-ai/docs/open-models/vllm/use-vllm)
// takes its prompt, inputs or chat messages and its budget there, and
// answers with no usage: every such text counts, and the instance's budget
// (max_tokens, max_new_tokens, max_output_tokens, max_completion_tokens,
// maxOutputTokens, or a budget of its parameters) is read as a settings
// object's is (see settings): a number or a string that holds one,
// rounded up; a negative one sets no limit. An instance without any of
// those texts (an image or video to embed or edit) counts MediaPartTokens.
// Its budget only raises the charge: it makes no budget sure (see
// Request.Budget), since a server that reads no instances (a chat
// completion's, where a body may carry them) runs with its own.
func (p *parser) instance(req *Request, st *requestState) error {
	known := false
	var numeric bool // not recorded: see above
	err := p.members(func(name []byte) error {
		switch string(name) {
		case "content", "title", "text", "prompt", "inputs", "input":
			known = true
			return p.content()
		case "messages":
			known = true
			return p.messages()
		case "max_tokens", "max_new_tokens", "max_output_tokens", "max_completion_tokens", "maxOutputTokens":
			return p.looseBudget(req, &numeric, &st.null[budgetSettings])
		case "parameters":
			return p.settings(req, &numeric, &st.null[budgetSettings])
		}
		return p.skip()
	})
	if err == nil && !known {
		p.add(MediaPartTokens)
	}
	return err
}

// messages counts the array of messages the decoder is at.
func (p *parser) messages() error {
	switch p.dec.PeekKind() {
	case 'n':
		return p.skip()
	case '[':
	default:
		if err := p.skip(); err != nil {
			return err
		}
		return invalid("messages is not an array")
	}
	if err := p.begin(); err != nil {
		return err
	}
	for {
		var err error
		switch p.dec.PeekKind() {
		case ']':
			return p.end()
		case '{':
			err = p.part(true)
		case 'n':
			err = p.skip()
		default:
			if err := p.skip(); err != nil {
				return err
			}
			return invalid("a message is not an object")
		}
		if err != nil {
			return err
		}
	}
}

// part counts an object of a content array, an input or a messages array:
// a message, a content part, a tool call or result, a Responses API item.
// Members are read in one pass, whatever their order: every member that
// carries text for the model counts, whatever the type. A part whose type
// is not one of textTypes, or that has no type and none of the members
// that carry text, counts MediaPartTokens, unless it is a message.
func (p *parser) part(message bool) error {
	if err := p.begin(); err != nil {
		return err
	}
	var typed, media, known, image, serverResult bool
	var textSource, mediaSource bool
	var sessionInput bool // the type, read so far, is an agent session's input message
	mark := len(p.pending)
	for p.dec.PeekKind() != '}' {
		name, err := p.memberName()
		if err != nil {
			return err
		}
		switch string(name) {
		case "type":
			typed = true
			var t []byte
			if t, err = p.typeName(); err == nil {
				media = media || t == nil || !textType(t)
				image = image || string(t) == "image_generation_call"
				serverResult = serverResult || serverToolResult(t)
				sessionInput = string(t) == "agent.session.input.message"
			}
		case "output":
			known = true
			if p.dec.PeekKind() == '{' {
				// A computer_call_output's screenshot, an image part.
				err = p.part(false)
			} else {
				err = p.content()
			}
		case "content":
			// The content object of an Anthropic server tool result
			// whose type came first, as the API writes it, is a part: a
			// web_fetch_result and its document, whose base64 PDF is one
			// media part, not text; a code execution or text editor
			// result or error. Any other content object, which the
			// providers do not take, is its JSON text: its members are
			// not known, and an upstream that takes it may read them all.
			known = true
			if serverResult && p.dec.PeekKind() == '{' {
				err = p.part(false)
			} else {
				err = p.content()
			}
		case "text", "summary", "tool_calls", "outputs", "queries",
			"commands", "command", "tool_changes", "lines", "parts":
			known = true
			err = p.content()
		case "tools", "tool":
			// An mcp_list_tools item's tool definitions, an Anthropic
			// tool_addition's tool, which the model reads as it reads the
			// request's own tools.
			known = true
			err = p.jsonText()
		case "input":
			// A tool call's input, a string or anything else (its JSON
			// text, every member the tool and the model read); but the
			// array of an agent session's input message (OpenAI's
			// agent.session.input.message), its type coming first as
			// the SDK writes it, holds messages, read as a content
			// value. Any other array is JSON text: read as a content
			// value, an object item of unknown members would count as
			// one media part, whatever it holds.
			known = true
			if sessionInput && p.dec.PeekKind() == '[' {
				err = p.content()
			} else {
				err = p.strOrJSON()
			}
		case "arguments", "name", "refusal", "thinking", "code", "logs",
			"stdout", "stderr", "diff", "title", "context", "query", "pattern",
			"reason", "error", "error_message", "args", "response", "json",
			"description", "rubric", "deny_message":
			known = true
			err = p.strOrJSON()
		case "results":
			known = true
			err = p.results()
		case "result":
			// A program_output's result, counted as strOrJSON does once
			// the type is known; an image_generation_call's result is its
			// image, base64, not read.
			known = true
			var s span
			s.start, s.end, err = p.skipSpan()
			p.pending = append(p.pending, s)
		case "source":
			if p.dec.PeekKind() != '{' {
				// A search result's source, a URL or an identifier the
				// model reads and cites.
				err = p.strOrJSON()
				break
			}
			var text, other bool
			text, other, err = p.source()
			textSource = textSource || text
			mediaSource = mediaSource || other
		case "function", "function_call", "custom", "functionCall", "functionResponse",
			"function_response", "executableCode", "executable_code",
			"codeExecutionResult", "code_execution_result",
			"toolUse", "toolResult", "reasoningContent", "reasoningText":
			known = true
			if p.dec.PeekKind() == '{' {
				err = p.part(true)
			} else {
				err = p.jsonText()
			}
		case "action", "actions", "operation":
			// A shell or local shell call's commands, an apply_patch
			// call's diff, a web search call's query, a computer call's
			// typed text (in its action, or in its batched actions:
			// ComputerActionList).
			err = p.action()
		case "role":
			known = true
			err = p.skip()
		case "images":
			// An Ollama chat message's images.
			err = p.images()
		default:
			err = p.skip()
		}
		if err != nil {
			return err
		}
	}
	if !image {
		for _, s := range p.pending[mark:] {
			p.countSpan(s)
		}
	}
	p.pending = p.pending[:mark]
	// A part whose sources all carry text (an Anthropic document of plain
	// text or of content blocks) is that text, not a media part.
	textOnly := textSource && !mediaSource
	if !message && !textOnly && (media || !typed && !known) {
		p.add(MediaPartTokens)
	}
	return p.end()
}

// source counts the "source" object of an Anthropic content block: the
// "data" of a plain-text source ({"type":"text","media_type":"text/plain",
// "data":"..."}) is one text, the "content" of a content source
// ({"type":"content","content": a string or text and image blocks}) a
// content value. It reports whether some type of the source is one of
// those two (text), and whether the source has no type or some other
// (base64, url, file: other, a media source). Members are read in any
// order: data met before a type "text" is kept as a span of the body and
// counted once that type is met, so each byte is still counted at most
// once. The data of any other source (a base64 image or PDF) counts
// nothing.
func (p *parser) source() (text, other bool, err error) {
	if err := p.begin(); err != nil {
		return false, false, err
	}
	mark := len(p.pending)
	var typed, plain bool
	for p.dec.PeekKind() != '}' {
		name, err := p.memberName()
		if err != nil {
			return false, false, err
		}
		switch string(name) {
		case "type":
			typed = true
			var t []byte
			if t, err = p.typeName(); err != nil {
				break
			}
			switch string(t) {
			case "text":
				plain, text = true, true
			case "content":
				text = true
			default:
				other = true
			}
		case "data":
			if plain {
				err = p.strOrJSON()
				break
			}
			var s span
			s.start, s.end, err = p.skipSpan()
			p.pending = append(p.pending, s)
		case "content":
			err = p.content()
		default:
			err = p.skip()
		}
		if err != nil {
			return false, false, err
		}
	}
	if plain {
		for _, s := range p.pending[mark:] {
			p.countSpan(s)
		}
	}
	p.pending = p.pending[:mark]
	return text, other || !typed, p.end()
}

// action reads an "action", "actions" or "operation" member: an object is
// read as a message, so that only its text counts and it is no media part
// of its own; an array (a computer_call's batched actions) is its items,
// each read so; anything else counts nothing (an image_generation_call's
// action is a word, "generate").
func (p *parser) action() error {
	switch p.dec.PeekKind() {
	case '{':
		return p.part(true)
	case '[':
		return p.elements(p.action)
	}
	return p.skip()
}

// serverToolResult reports whether t is the type of an Anthropic server
// tool result, or of a web fetch's result, whose object content is read
// as a part (see part).
func serverToolResult(t []byte) bool {
	switch string(t) {
	case "web_fetch_tool_result", "web_fetch_result", "code_execution_tool_result",
		"bash_code_execution_tool_result", "text_editor_code_execution_tool_result":
		return true
	}
	return false
}

// typeName reads a "type" member's value: the string, unquoted, or nil
// for a value that is not a string (skipped).
func (p *parser) typeName() ([]byte, error) {
	if p.dec.PeekKind() != '"' {
		return nil, p.skip()
	}
	raw, err := p.dec.ReadValue()
	if err != nil {
		return nil, syntax(err)
	}
	return p.unquote(raw), nil
}

// textType reports whether a part of that type carries text (or tool
// calls and results, or a code interpreter's logs) rather than media.
func textType(t []byte) bool {
	switch string(t) {
	case "text", "input_text", "output_text", "refusal", "summary_text",
		"message", "reasoning", "reasoning_text", "thinking",
		"function", "function_call", "function_call_output", "custom",
		"custom_tool_call", "custom_tool_call_output",
		"tool_use", "server_tool_use", "tool_result",
		"code_interpreter_call", "logs", "file_search_call",
		"computer_call_output",
		"shell_call", "shell_call_output", "local_shell_call", "local_shell_call_output",
		"apply_patch_call", "apply_patch_call_output",
		"mcp_call", "mcp_approval_request", "mcp_approval_response", "mcp_list_tools", "search_result",
		"program", "program_output", "tool_addition", "tool_removal",
		"web_fetch_tool_result", "web_fetch_result",
		"code_execution_tool_result", "code_execution_result",
		"bash_code_execution_tool_result", "bash_code_execution_result",
		"text_editor_code_execution_tool_result", "text_editor_code_execution_view_result",
		"text_editor_code_execution_create_result", "text_editor_code_execution_str_replace_result",
		"text_editor_code_execution_tool_result_error",
		"message.input", "message.output", "function.call", "function.result",
		"user.message", "user.interrupt", "user.tool_confirmation", "user.custom_tool_result",
		"user.tool_result", "user.define_outcome", "system.message",
		"agent.session.input.message", "agent.session.input.tool_result", "agent.session.input.cancel",
		"agent.session.input.mcp_approval_request_result",
		"agent.session.input.computer_use_approval_request_result":
		return true
	}
	return false
}

// results counts the "results" of a Responses API file_search_call: the
// "text" of each result, a content value. Anything else in it counts
// nothing (a result's file_id, filename, score and attributes).
func (p *parser) results() error {
	if p.dec.PeekKind() != '[' {
		return p.skip()
	}
	return p.elements(func() error { return p.objectMember("text", p.content) })
}

// settings reads the object of generation settings of an API that keeps
// its budget there: Ollama's options (num_predict), Hugging Face TGI's
// parameters (max_new_tokens, best_of), Gemini's generationConfig or
// generation_config (maxOutputTokens or max_output_tokens, candidateCount
// or candidate_count) and Bedrock Converse's inferenceConfig (maxTokens),
// as LiteLLM's pass-throughs send them. Any of these members in any of
// these objects counts. Their servers read numbers more loosely than the
// top-level budget is read: Ollama takes 1e3 and truncates 100.5, Google's
// JSON takes "8192"; so a number, or a string that holds one, sets the
// budget (or the completions per prompt) to its value rounded up, at most
// MaxCost, and a negative one (Ollama's num_predict -1, no limit, and -2,
// fill the context) sets none (null: the server's own default, which
// Budget charges as defaultMax at least); anything else is not read, and
// is the server's to refuse. numeric and null record the budget as the
// top-level budget members do.
func (p *parser) settings(req *Request, numeric, null *bool) error {
	return p.members(func(name []byte) (err error) {
		switch string(name) {
		case "num_predict", "max_new_tokens", "maxOutputTokens", "max_output_tokens", "maxTokens":
			return p.looseBudget(req, numeric, null)
		case "candidateCount", "candidate_count", "best_of":
			n, ok, _, err := p.looseCount()
			if ok {
				req.Choices = max(req.Choices, n)
			}
			return err
		}
		return p.skip()
	})
}

// looseBudget reads a budget of a settings object (or llama.cpp's
// top-level n_predict), a count (see looseCount), into req.MaxTokens, and
// records in numeric and null whether it set one or none.
func (p *parser) looseBudget(req *Request, numeric, null *bool) error {
	n, ok, isNull, err := p.looseCount()
	if ok {
		*numeric = true
		req.MaxTokens = max(req.MaxTokens, n)
	}
	*null = *null || isNull
	return err
}

// looseCount reads a count of a settings object (see settings): a number,
// or a string that holds one, is ok, rounded up to an integer, at most
// MaxCost; a negative one is isNull, as is null; anything else neither.
func (p *parser) looseCount() (n int64, ok, isNull bool, err error) {
	k := p.dec.PeekKind()
	if k != '0' && k != '"' && k != 'n' {
		return 0, false, false, p.skip()
	}
	raw, err := p.dec.ReadValue()
	if err != nil {
		return 0, false, false, syntax(err)
	}
	if k == 'n' {
		return 0, false, true, nil
	}
	text := raw
	if k == '"' {
		text = bytes.TrimSpace(p.unquote(raw))
	}
	f, perr := strconv.ParseFloat(string(text), 64)
	switch {
	case perr != nil && !errors.Is(perr, strconv.ErrRange), math.IsNaN(f):
		return 0, false, false, nil
	case f < 0:
		return 0, false, true, nil
	case f >= MaxCost:
		return MaxCost, true, false, nil
	}
	return int64(math.Ceil(f)), true, false, nil
}

// documents counts a "documents" member: the documents of a rerank
// (Cohere's /v2/rerank, vLLM's /rerank and /v1/rerank) or of a chat that
// grounds its answer on them (Cohere's chat, vLLM's chat completions, which
// put them in the prompt). A string is one text; an array's strings are
// texts, and its other items (Cohere's {"text":...} or {"data":{...}},
// {"title":...,"snippet":...}) count as their raw JSON text, since the
// model reads whichever of their members its API takes; anything else
// counts as a content value.
func (p *parser) documents() error {
	if p.dec.PeekKind() != '[' {
		return p.content()
	}
	return p.elements(p.strOrJSON)
}

// images counts an "images" member, Ollama's (a generate request's, a
// chat message's): MediaPartTokens for each item of an array (an image,
// base64), whatever its size; anything else counts nothing.
func (p *parser) images() error {
	if p.dec.PeekKind() != '[' {
		return p.skip()
	}
	return p.elements(func() error {
		if p.dec.PeekKind() != 'n' {
			p.add(MediaPartTokens)
		}
		return p.skip()
	})
}

// textOptions reads the Responses API "text" object: its "format" counts
// as JSON text.
func (p *parser) textOptions() error {
	return p.objectMember("format", p.jsonText)
}

// objectMember reads the object the decoder is at, its members named name
// with read, and skips the others; a value that is not an object is
// skipped whole.
func (p *parser) objectMember(name string, read func() error) error {
	return p.members(func(n []byte) error {
		if string(n) == name {
			return read()
		}
		return p.skip()
	})
}

// exactMember is objectMember for a member that a Go server would read in
// any case: a member that is name in another case makes the body invalid.
func (p *parser) exactMember(name string, read func() error) error {
	return p.members(func(n []byte) error {
		if string(n) == name {
			return read()
		}
		if bytes.EqualFold(n, []byte(name)) {
			return invalid("member %q is %q in another case", n, name)
		}
		return p.skip()
	})
}

// elements reads the array the decoder is at, each element with read.
func (p *parser) elements(read func() error) error {
	if err := p.begin(); err != nil {
		return err
	}
	for p.dec.PeekKind() != ']' {
		if err := read(); err != nil {
			return err
		}
	}
	return p.end()
}

// members reads the object the decoder is at, each member's value with
// read, given the member's name (valid until the next memberName); a
// value that is not an object is skipped whole.
func (p *parser) members(read func(name []byte) error) error {
	if p.dec.PeekKind() != '{' {
		return p.skip()
	}
	if err := p.begin(); err != nil {
		return err
	}
	for p.dec.PeekKind() != '}' {
		name, err := p.memberName()
		if err != nil {
			return err
		}
		if err := read(name); err != nil {
			return err
		}
	}
	return p.end()
}

// streamOptions reads a "stream_options" member and records where the
// rewrite goes. The last one wins.
func (p *parser) streamOptions(req *Request) error {
	req.IncludeUsage = false
	rw := &req.rw
	rw.iuStart, rw.iuEnd = -1, -1
	switch p.dec.PeekKind() {
	case 'n':
		start, end, err := p.skipSpan()
		rw.so, rw.soStart, rw.soEnd = soNull, start, end
		return err
	case '{':
	default:
		rw.so = soOther
		return p.skip()
	}
	if err := p.begin(); err != nil {
		return err
	}
	rw.so, rw.soStart = soObject, int(p.dec.InputOffset())-1
	rw.soEmpty = p.dec.PeekKind() == '}'
	for p.dec.PeekKind() != '}' {
		name, err := p.memberName()
		if err != nil {
			return err
		}
		switch {
		case string(name) == "include_usage":
			req.IncludeUsage = p.dec.PeekKind() == 't'
			rw.iuStart, rw.iuEnd, err = p.skipSpan()
		case foldsTo(name, includeUsage) != nil:
			return invalid("member %q is %q in another case", name, includeUsage[0])
		default:
			err = p.skip()
		}
		if err != nil {
			return err
		}
	}
	return p.end()
}
