package tokenbucket

import (
	"strconv"

	"github.com/token-bucket/token_bucket/bucket"
)

// Values of error_format: the shape of the JSON bodies of the handler's own
// 429, 400, 408 and 503 answers.
const (
	// FormatJSON is this handler's own shape (the default):
	// {"error":"rate_limit_exceeded","retry_after":6,...}; see README.
	FormatJSON = "json"
	// FormatOpenAI is the shape of OpenAI's API errors,
	// {"error":{"message":"…","type":"…","param":null,"code":"…"}}, which
	// the openai SDKs read into error.code and error.type. A 429's type is
	// the unit of the limit that denied ("requests" or "tokens") and its
	// code "rate_limit_exceeded", as OpenAI's own 429s; a 400's type is
	// "invalid_request_error".
	FormatOpenAI = "openai"
	// FormatAnthropic is the shape of Anthropic's API errors,
	// {"type":"error","error":{"type":"…","message":"…"}}: a 429 is a
	// "rate_limit_error", a 400 or 408 an "invalid_request_error", a 503
	// an "api_error" (Anthropic's error types, which its SDK maps to
	// RateLimitError and the others).
	FormatAnthropic = "anthropic"
)

// errorAnswer is one answer of the handler's own, to be written in the
// configured error_format.
type errorAnswer struct {
	code    string // this handler's error code: rate_limit_exceeded, invalid_body, ...
	oaiType string // OpenAI's error type
	antType string // Anthropic's error type
	message string // for a person: which limit, the wait, the tier; never an identity
	json    []byte // the body in the json format, where it is fixed
}

// appendErrorBody appends the body of e in format, openai or anthropic
// (the json format's bodies are written where they are made).
func appendErrorBody(b []byte, format string, e *errorAnswer) []byte {
	if format == FormatAnthropic {
		b = append(b, `{"type":"error","error":{"type":"`...)
		b = append(b, e.antType...)
		b = append(b, `","message":`...)
		b = strconv.AppendQuote(b, e.message)
		return append(b, "}}\n"...)
	}
	b = append(b, `{"error":{"message":`...)
	b = strconv.AppendQuote(b, e.message)
	b = append(b, `,"type":"`...)
	b = append(b, e.oaiType...)
	b = append(b, `","param":null,"code":"`...)
	b = append(b, e.code...)
	return append(b, "\"}}\n"...)
}

// denialError describes a denial of req by d in tier t. Tier and dimension
// names are validated to [A-Za-z0-9_-], so the message needs no escaping
// beyond strconv.Quote's and holds no identity.
func denialError(t *tier, req *request, d *bucket.Decision) errorAnswer {
	l := req.limits[d.Deciding]
	unit := UnitRequests
	if l.tokens {
		unit = UnitTokens
	}
	var m []byte
	if d.Reason == bucket.CostExceedsCapacity {
		m = appendLimitName(append(m, "Request too large for the "...), l, unit, t)
		m = append(m, ": it costs "...)
		m = strconv.AppendInt(m, req.takes[d.Deciding].Cost, 10)
		m = append(m, " and the limit holds at most "...)
		m = strconv.AppendInt(m, l.spec.Capacity, 10)
		m = append(m, "; it can never be served, do not retry it unchanged."...)
		return errorAnswer{code: d.Reason.String(), oaiType: unit, antType: "rate_limit_error", message: string(m)}
	}
	m = appendLimitName(append(m, "Rate limit reached for the "...), l, unit, t)
	m = append(m, ": limit "...)
	m = strconv.AppendInt(m, l.spec.Capacity, 10)
	m = append(m, ", try again in "...)
	m = strconv.AppendInt(m, d.RetryAfterSeconds(), 10)
	m = append(m, "s."...)
	return errorAnswer{code: "rate_limit_exceeded", oaiType: unit, antType: "rate_limit_error", message: string(m)}
}

// appendLimitName appends "<dimension> <unit> limit of tier <tier>".
func appendLimitName(m []byte, l *limit, unit string, t *tier) []byte {
	m = append(m, l.dimension...)
	m = append(m, ' ')
	m = append(m, unit...)
	m = append(m, " limit of tier "...)
	return append(m, t.name...)
}

// The handler's other answers; json is the body in the json format.
var (
	invalidCostError = errorAnswer{code: "invalid_cost", oaiType: "invalid_request_error", antType: "invalid_request_error",
		message: "The request's cost must be an integer from 0 to 9007199254740991.",
		json:    []byte(`{"error":"invalid_cost","message":"the request's cost must be an integer from 0 to 9007199254740991"}` + "\n")}
	invalidBodyError = errorAnswer{code: "invalid_body", oaiType: "invalid_request_error", antType: "invalid_request_error",
		message: "The request body must be a JSON chat or completion request within the size limit.",
		json:    []byte(`{"error":"invalid_body","message":"the request body must be a JSON chat or completion request within the size limit"}` + "\n")}
	mixedModelsError = errorAnswer{code: "mixed_models", oaiType: "invalid_request_error", antType: "invalid_request_error",
		message: "A request that names more than one model (a batch's requests, or a body and its path) cannot be priced under limits that depend on the model; send one model per request.",
		json:    []byte(`{"error":"mixed_models","message":"a request that names more than one model (a batch's requests, or a body and its path) cannot be priced under limits that depend on the model; send one model per request"}` + "\n")}
	bodyTimeoutError = errorAnswer{code: "request_timeout", oaiType: "invalid_request_error", antType: "invalid_request_error",
		message: "The request body did not arrive in time.",
		json:    []byte(`{"error":"request_timeout","message":"the request body did not arrive in time"}` + "\n")}
	unavailableError = errorAnswer{code: "rate_limiter_unavailable", oaiType: "server_error", antType: "api_error",
		message: "The rate limiter cannot reach its store; retry shortly.",
		json:    []byte(`{"error":"rate_limiter_unavailable","message":"the rate limiter cannot reach its store; retry shortly"}` + "\n")}
)

// body returns e's body in format.
func (e *errorAnswer) body(format string) []byte {
	if format == FormatOpenAI || format == FormatAnthropic {
		return appendErrorBody(make([]byte, 0, 64+len(e.message)), format, e)
	}
	return e.json
}
