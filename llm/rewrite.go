package llm

import "errors"

// ErrStreamOptionsNotObject is returned by WithStreamUsage for a streamed
// request whose (last) stream_options is neither an object nor null: the
// body is left as it is, and the stream may end without a usage report.
var ErrStreamOptionsNotObject = errors.New("llm: stream_options is not an object")

// ErrBodyMismatch is returned by WithStreamUsage when the body is not the
// one the Request was parsed from.
var ErrBodyMismatch = errors.New("llm: the body is not the one the request was parsed from")

// What the last stream_options member of a body is.
const (
	soNone = iota
	soObject
	soNull
	soOther
)

// rewriteSpots are the byte offsets ParseRequest records for
// WithStreamUsage, so that it needs no second scan.
type rewriteSpots struct {
	ok       bool // set by a successful ParseRequest
	bodyLen  int
	objOpen  int  // the top-level '{'
	objEmpty bool // the top-level object has no member
	so       int  // the last stream_options: soNone, soObject, soNull, soOther
	soStart  int  // its value: '{' or the start of null
	soEnd    int  // past its null
	soEmpty  bool // its object has no member
	iuStart  int  // its last include_usage value, -1 when none
	iuEnd    int
}

// StreamUsage is the member WithStreamUsage adds to a streamed request.
const StreamUsage = `"stream_options":{"include_usage":true}`

// NeedsStreamUsage reports whether the request streams without asking for
// the usage report: "stream": true without "stream_options":
// {"include_usage": true}. WithStreamUsage then has a change to make.
func (r Request) NeedsStreamUsage() bool { return r.Stream && !r.IncludeUsage }

// WithStreamUsage returns body with "stream_options": {"include_usage":
// true} when req (parsed from body by ParseRequest) streams without it,
// every other byte unchanged, so that the provider ends the stream with
// the usage report:
//
//   - no stream_options member: `"stream_options":{"include_usage":true}`
//     is inserted right after the opening '{' of the body, followed by ','
//     when the object has members;
//   - stream_options null: the null is replaced by {"include_usage":true};
//   - stream_options an object without include_usage: "include_usage":true
//     is inserted right after its '{', followed by ',' when it has members;
//   - include_usage other than true (false, null, anything): that value is
//     replaced by true.
//
// Of duplicate members, the last one (the one the provider reads) is the
// one changed. The result is a new slice when changed is true (its length
// is the new Content-Length; replacing null by true keeps the length),
// and body itself otherwise: when the request does not stream, already
// asks for usage, or on an error. The errors are ErrStreamOptionsNotObject
// (stream_options is a string, a number, a boolean or an array) and
// ErrBodyMismatch (req is not from body, or is a zero Request).
func WithStreamUsage(body []byte, req Request) (out []byte, changed bool, err error) {
	rw := req.rw
	if !rw.ok || rw.bodyLen != len(body) || body[rw.objOpen] != '{' {
		return body, false, ErrBodyMismatch
	}
	if !req.NeedsStreamUsage() {
		return body, false, nil
	}
	switch rw.so {
	case soNone:
		return splice(body, rw.objOpen+1, rw.objOpen+1, StreamUsage, !rw.objEmpty), true, nil
	case soNull:
		if string(body[rw.soStart:rw.soEnd]) != "null" {
			return body, false, ErrBodyMismatch
		}
		return splice(body, rw.soStart, rw.soEnd, `{"include_usage":true}`, false), true, nil
	case soObject:
		if body[rw.soStart] != '{' {
			return body, false, ErrBodyMismatch
		}
		if rw.iuStart >= 0 {
			return splice(body, rw.iuStart, rw.iuEnd, "true", false), true, nil
		}
		return splice(body, rw.soStart+1, rw.soStart+1, `"include_usage":true`, !rw.soEmpty), true, nil
	}
	return body, false, ErrStreamOptionsNotObject
}

// splice returns a new slice: body with body[from:to] replaced by s, and
// a comma after s when comma is true.
func splice(body []byte, from, to int, s string, comma bool) []byte {
	out := make([]byte, 0, len(body)-(to-from)+len(s)+1)
	out = append(out, body[:from]...)
	out = append(out, s...)
	if comma {
		out = append(out, ',')
	}
	return append(out, body[to:]...)
}
