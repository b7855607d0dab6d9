package llm

import (
	"bytes"

	"github.com/go-json-experiment/json/jsontext"
)

// jsonScan follows one JSON text pushed to it in pieces, tracking only
// strings, escapes and nesting, to find the value of the top-level
// object's "usage" member (and, for event data, of "message"."usage" and
// "response"."usage"), of its "usageMetadata" member (Gemini's) and of its
// "prompt_eval_count" and "eval_count" members (Ollama's) and pass it
// whole to usageBody.report; and to read the string values of its
// "object" and "done_reason" members (see errorTop, loadTop). It does not
// validate the JSON: a usage value it hands over is validated when
// parsed. It is linear in the input, allocates nothing, and keeps no
// input but the usage value it reads (usageBody.capture): strings are
// skipped with bytes.IndexByte, names of interest are kept in a small
// array.
//
// Member names are compared by value: a name written with escapes
// ("us\u0061ge") is the same name.
type jsonScan struct {
	paths bool // also "message"."usage" and "response"."usage"

	depth   int  // 1 inside the top-level object
	started bool // the top-level value has begun
	done    bool // the top-level value has ended, or is not an object

	inStr bool
	esc   bool // in a string: the next byte is escaped

	// Member names are read at the tracked depths: 1, and 2 inside the
	// object value of a top-level "message" or "response" (parent).
	want   bool              // at a tracked depth, the next string is a member name
	inName bool              // reading a member name
	nameN  int               // its raw length so far
	name   [maxName + 2]byte // quotes included
	member int               // the last member name read at a tracked depth
	parent int               // at depth 2 and deeper: the tracked object we are in

	capturing bool // reading a usage value (after its colon)
	capDepth  int  // the depth of its member
	capMember int  // its member: memberUsage, memberUsageMetadata, memberPromptEval or memberEval

	errorTop  bool // the top-level object has an "error" member, or "object":"error"
	errorNext bool // the next value is the top-level "error" member's
	objNext   bool // the next value is the top-level "object" or "done_reason" member's
	inObjVal  bool // reading the string value of that member
	valOf     int  // which member that is: memberObject or memberDoneReason
	errorObj  bool // the top-level "error" member's value is an object

	// loadTop: the top-level "done_reason" is "load" or "unload", the
	// answer of Ollama's /api/generate without a prompt and /api/chat
	// without messages, which load (or, with keep_alive 0, unload) the
	// model and run nothing (https://github.com/ollama/ollama/blob/main/docs/api.md,
	// "Load a model", "Unload a model").
	loadTop bool
}

// maxName is the longest raw member name kept: "response" with every
// letter escaped as \uXXXX. (Longer names of ours, "usageMetadata" and
// "prompt_eval_count", are kept when they are written with fewer escapes,
// as their senders write them.)
const maxName = 6 * len("response")

// Member names that matter.
const (
	memberOther = iota
	memberUsage
	memberMessage
	memberResponse
	memberError
	memberUsageMetadata // Gemini's usage, top-level only
	memberPromptEval    // Ollama's prompt_eval_count, top-level only
	memberEval          // Ollama's eval_count, top-level only
	memberObject        // "object": an error's when its value is "error"
	memberDoneReason    // Ollama's "done_reason": see loadTop
)

func (s *jsonScan) reset(paths bool) {
	*s = jsonScan{paths: paths}
}

// tracked reports whether member names are read at the current depth.
func (s *jsonScan) tracked() bool {
	return s.depth == 1 || (s.depth == 2 && s.parent != memberOther)
}

// feed scans the next bytes of the JSON text and returns how many it
// read: all of p, or those up to the end of the top-level value.
func (s *jsonScan) feed(b *usageBody, p []byte) int {
	capStart := 0 // where the usage value being read starts in p
	i := 0
	for i < len(p) && !s.done {
		if s.inStr {
			j := bytes.IndexByte(p[i:], '"')
			if j < 0 {
				seg := p[i:]
				run := trailingBackslashes(seg)
				s.esc = (s.esc && run == len(seg)) != (run&1 == 1)
				if s.inName || s.inObjVal {
					s.nameAppend(seg)
				}
				i = len(p)
				break
			}
			seg := p[i : i+j]
			run := trailingBackslashes(seg)
			escaped := (s.esc && run == j) != (run&1 == 1)
			s.esc = false
			if s.inName || s.inObjVal {
				s.nameAppend(p[i : i+j+1])
			}
			i += j + 1
			if escaped {
				continue
			}
			s.closeString()
			continue
		}
		c := p[i]
		switch c {
		case ' ', '\t', '\n', '\r':
		case '"':
			if s.depth == 0 {
				s.done = true // not an object
				break
			}
			s.inStr, s.errorNext = true, false
			if s.want {
				s.want, s.inName, s.nameN = false, true, 0
				s.nameAppend(p[i : i+1])
			} else if s.objNext {
				s.inObjVal, s.nameN = true, 0
				s.nameAppend(p[i : i+1])
			}
			s.objNext = false
		case '{', '[':
			if s.errorNext {
				s.errorNext, s.errorObj = false, c == '{'
			}
			s.objNext = false
			if s.depth == 0 {
				if c == '[' {
					s.done = true
					break
				}
				s.started = true
			}
			entering := false
			if c == '{' && s.depth == 1 && s.paths && !s.capturing &&
				(s.member == memberMessage || s.member == memberResponse) {
				s.parent, entering = s.member, true
			}
			s.depth++
			s.want = c == '{' && (s.depth == 1 || entering)
			s.member = memberOther
		case '}', ']':
			if s.capturing && s.depth == s.capDepth {
				s.endCapture(b, p[capStart:i]) // a scalar value, ended by its parent
			}
			s.depth--
			if s.capturing && s.depth == s.capDepth {
				// An object or array value, whole: report it now, not
				// when the next member or the end of its parent comes.
				s.endCapture(b, p[capStart:i+1])
			}
			if s.depth <= 0 {
				s.done = true
			}
			if s.depth <= 1 {
				s.parent = memberOther
			}
			s.want = false
		case ',':
			if s.capturing && s.depth == s.capDepth {
				s.endCapture(b, p[capStart:i])
			}
			if s.tracked() {
				s.want, s.member = true, memberOther
			}
		case ':':
			if !s.capturing && (s.member == memberUsage && s.tracked() ||
				s.depth == 1 && (s.member == memberUsageMetadata || s.member == memberPromptEval || s.member == memberEval)) {
				s.capturing, s.capDepth, s.capMember, capStart = true, s.depth, s.member, i+1
			}
			s.errorNext = s.member == memberError && s.depth == 1
			s.objNext = s.depth == 1 && (s.member == memberObject || s.member == memberDoneReason)
			s.valOf = s.member
		default:
			if s.depth == 0 {
				s.done = true // not an object
			}
			s.errorNext, s.objNext = false, false // null, false, a number
		}
		i++
	}
	if s.capturing {
		b.captureAppend(p[capStart:i])
	}
	return i
}

// closeString ends the string being read.
func (s *jsonScan) closeString() {
	s.inStr = false
	if s.inObjVal {
		s.inObjVal = false
		var v []byte // the value, unquoted; nil when longer than maxName
		if raw := s.name[:min(s.nameN, len(s.name))]; s.nameN <= len(s.name) && bytes.IndexByte(raw, '\\') < 0 {
			// Unescaped, as senders write it (every OpenAI chunk's
			// "object":"chat.completion.chunk"): compared as it is.
			v = raw[1 : len(raw)-1]
		} else if s.nameN <= len(s.name) {
			var buf [maxName]byte
			if u, err := jsontext.AppendUnquote(buf[:0], raw); err == nil {
				v = u
			}
		}
		switch s.valOf {
		case memberObject:
			// "object":"error": the error shape of Mistral's API and of
			// vLLM's (before its OpenAI-shaped one), which have no
			// "error" member.
			s.errorTop = s.errorTop || string(v) == "error"
		case memberDoneReason:
			s.loadTop = string(v) == "load" || string(v) == "unload" // the last one, as a JSON parser reads it
		}
		return
	}
	if s.inName {
		s.inName = false
		s.member = s.nameIs()
		if s.member == memberError && s.depth == 1 {
			s.errorTop = true
		}
	}
}

func (s *jsonScan) endCapture(b *usageBody, last []byte) {
	b.captureAppend(last)
	s.capturing = false
	where := usageTop
	switch s.capMember {
	case memberUsageMetadata:
		where = usageGemini
	case memberPromptEval:
		where = countPromptEval
	case memberEval:
		where = countEval
	}
	if s.capDepth == 2 {
		where = usageMessage
		if s.parent == memberResponse {
			where = usageResponse
		}
	}
	b.report(where)
}

// nameAppend keeps the next raw bytes of a member name (quotes included).
func (s *jsonScan) nameAppend(p []byte) {
	if s.nameN+len(p) <= len(s.name) {
		copy(s.name[s.nameN:], p)
	}
	s.nameN += len(p)
}

// nameIs returns which member the name just read is.
func (s *jsonScan) nameIs() int {
	if s.nameN > len(s.name) {
		return memberOther
	}
	raw := s.name[:s.nameN]
	switch n := len(raw); {
	case n == len(`"usage"`), n == len(`"message"`), n == len(`"response"`), n == len(`"object"`):
	case n < len(`"\u0075sage"`):
		return memberOther // too short to have an escape, not one of ours
	}
	var buf [maxName]byte
	var name []byte
	if bytes.IndexByte(raw, '\\') < 0 {
		name = raw[1 : len(raw)-1]
	} else {
		n, err := jsontext.AppendUnquote(buf[:0], raw)
		if err != nil || len(n) > len(buf) {
			return memberOther
		}
		name = n
	}
	switch string(name) {
	case "usage":
		return memberUsage
	case "message":
		return memberMessage
	case "response":
		return memberResponse
	case "error":
		return memberError
	case "object":
		return memberObject
	case "done_reason":
		return memberDoneReason
	case "usageMetadata":
		return memberUsageMetadata
	case "prompt_eval_count":
		return memberPromptEval
	case "eval_count":
		return memberEval
	}
	return memberOther
}

// trailingBackslashes counts the backslashes that end p.
func trailingBackslashes(p []byte) int {
	n := 0
	for n < len(p) && p[len(p)-1-n] == '\\' {
		n++
	}
	return n
}
