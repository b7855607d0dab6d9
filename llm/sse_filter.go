package llm

import (
	"bytes"
	"io"

	"github.com/go-json-experiment/json/jsontext"
)

// MaxFilteredEvent is the longest event, in bytes, a UsageChunkFilter
// holds back to filter: the usage chunks it removes and edits are a few
// hundred bytes. A longer event passes through unfiltered, from the
// moment it is known to be longer.
const MaxFilteredEvent = 64 << 10

// A UsageChunkFilter passes an OpenAI chat completions event stream
// through unchanged but for what stream_options.include_usage adds to it
// (https://platform.openai.com/docs/api-reference/chat/create#chat-create-stream_options),
// for a gateway that asked for the usage on behalf of a client that did
// not:
//
//  1. the usage chunk, an event whose data is a JSON object with a
//     top-level "choices" that is an empty array and a top-level "usage"
//     that is not null, is removed whole: its lines and the blank line
//     that ends it;
//  2. in every other event whose data is a JSON object, a top-level
//     "usage" member whose value is null is removed with its comma.
//
// Everything else passes byte for byte: comments, other fields,
// data: [DONE], events that are not JSON, the line ends as sent, and
// streams of other APIs (Anthropic's events have no top-level "choices"
// and no null top-level "usage"). Member names are compared by value.
// The null "usage" member of an event whose data spans several data lines
// is not removed (OpenAI sends one data line per event).
//
// Event framing is the HTML standard's (lines end with LF, CRLF or CR; a
// blank line ends an event). The filter holds back at most the one event
// still arriving, up to MaxFilteredEvent bytes, and writes each event as
// soon as the blank line that ends it arrives, in the same Write.
//
// The filter changes the length of the body: the response must not carry
// a Content-Length. It reads identity-coded streams only.
type UsageChunkFilter struct {
	w   io.Writer
	err error

	hold   []byte // the start of the event still arriving
	evLen  int    // its length so far
	pass   bool   // the event is over MaxFilteredEvent: passing it through
	atLine bool   // the last byte ended a line (or nothing was written yet)
	cr     bool   // the last byte was a CR that ended a line
	lf     uint8  // a blank line ended with CR: what to do with a next LF

	out  []byte // what one Write sends on, when it is not a part of p
	edit []byte // an edited event
	data []byte // the joined data of an event's data lines
	dec  *jsontext.Decoder
	buf  bytes.Buffer
}

const (
	lfNone = iota
	lfKeep // the LF ends an event that was sent on
	lfDrop // the LF ends an event that was removed
)

// NewUsageChunkFilter returns a filter that writes the stream written to
// it on to w.
func NewUsageChunkFilter(w io.Writer) *UsageChunkFilter {
	return &UsageChunkFilter{w: w, atLine: true}
}

// Write filters the next bytes of the stream and writes every event they
// complete on to w, with at most one w.Write. It consumes all of p and
// returns len(p), nil, unless w fails: then it returns 0 and w's error,
// and so does every later call.
func (f *UsageChunkFilter) Write(p []byte) (int, error) {
	if f.err != nil {
		return 0, f.err
	}
	// What goes on is p[from:to] while it is an unchanged run of p
	// (direct), else f.out.
	f.out = f.out[:0]
	from, to, direct := 0, 0, true
	emit := func(b []byte, inP bool, start int) {
		switch {
		case len(b) == 0:
		case direct && inP && from == to:
			from, to = start, start+len(b)
		case direct && inP && start == to:
			to += len(b)
		case direct:
			f.out = append(append(f.out, p[from:to]...), b...)
			direct = false
		default:
			f.out = append(f.out, b...)
		}
	}
	evStart := 0 // where the event being read starts in p
	i := 0
	for i < len(p) {
		if f.lf != lfNone {
			// The LF of the CRLF that ended the last event belongs to it.
			keep := f.lf == lfKeep
			f.lf = lfNone
			if p[i] == '\n' {
				f.cr = false
				if keep {
					emit(p[i:i+1], true, i)
				}
				i++
				evStart = i
				continue
			}
		}
		k := sseLineEnd(p[i:])
		if k < 0 {
			f.evLen += len(p) - i
			f.atLine, f.cr = false, false
			break
		}
		c := p[i+k]
		lfOfCRLF := k == 0 && c == '\n' && f.cr
		blank := k == 0 && f.atLine && !lfOfCRLF
		f.cr = c == '\r'
		f.atLine = true
		f.evLen += k + 1
		i += k + 1
		if !blank {
			continue
		}
		// An event ends at p[i-1].
		inP := len(f.hold) == 0
		ev := p[evStart:i]
		if !inP {
			f.hold = append(f.hold, ev...)
			ev = f.hold
		}
		keep := true
		switch {
		case f.pass:
			emit(ev, true, evStart) // the rest of an over-long event
		case f.evLen > MaxFilteredEvent:
			emit(ev, inP, evStart)
		default:
			switch edited, drop := f.filter(ev); {
			case drop:
				keep = false
			case edited != nil:
				emit(edited, false, 0)
			default:
				emit(ev, inP, evStart)
			}
		}
		if c == '\r' {
			f.lf = lfDrop
			if keep {
				f.lf = lfKeep
			}
		}
		f.hold = f.hold[:0]
		f.evLen, f.pass = 0, false
		evStart = i
	}
	// The event still arriving: held, or passed on once over the bound.
	if evStart < len(p) {
		if !f.pass && f.evLen > MaxFilteredEvent {
			f.pass = true
			emit(f.hold, false, 0)
			f.hold = f.hold[:0]
		}
		if f.pass {
			emit(p[evStart:], true, evStart)
		} else {
			f.hold = append(f.hold, p[evStart:]...)
		}
	}
	out := f.out
	if direct {
		out = p[from:to]
	}
	if len(out) > 0 {
		if _, err := f.w.Write(out); err != nil {
			f.err = err
			return 0, err
		}
	}
	return len(p), nil
}

// Close writes on the event still arriving when the stream ends (one cut
// before the blank line that would end it), filtered as a whole event
// would be, and returns the error of the last write. It is for the end of
// the stream, not for every flush.
func (f *UsageChunkFilter) Close() error {
	if f.err != nil {
		return f.err
	}
	if len(f.hold) > 0 {
		out := f.hold
		if !f.pass {
			switch edited, drop := f.filter(f.hold); {
			case drop:
				out = nil
			case edited != nil:
				out = edited
			}
		}
		if len(out) > 0 {
			_, f.err = f.w.Write(out)
		}
		f.hold = f.hold[:0]
		f.pass = true // the rest of that event, if any, follows unfiltered
	}
	return f.err
}

// filter returns what becomes of a whole event ev (its blank line
// included): removed (drop), edited (the event to send instead), or
// unchanged (neither).
func (f *UsageChunkFilter) filter(ev []byte) (edited []byte, drop bool) {
	if !bytes.Contains(ev, []byte("usage")) && !bytes.Contains(ev, []byte(`\u`)) {
		return nil, false // the common case
	}
	// The data lines: their values joined, and where the value of the
	// last one starts in ev.
	f.data = f.data[:0]
	var data []byte
	dataAt, lines := 0, 0
	start := 0
	if bytes.HasPrefix(ev, []byte(sseBOM)) { // the stream's first event
		start = len(sseBOM)
	}
	for at := start; at < len(ev); {
		rest := ev[at:]
		k := sseLineEnd(rest)
		if k < 0 {
			k = len(rest)
		}
		if v, ok := bytes.CutPrefix(rest[:k], []byte("data")); ok && (len(v) == 0 || v[0] == ':') {
			off := len("data")
			if len(v) > 0 {
				v, off = v[1:], off+1
				if len(v) > 0 && v[0] == ' ' {
					v, off = v[1:], off+1
				}
			}
			if lines > 0 {
				f.data = append(f.data, '\n')
			}
			f.data = append(f.data, v...)
			data, dataAt = v, at+off
			lines++
		}
		at += k + 1
		if k < len(rest)-1 && rest[k] == '\r' && rest[k+1] == '\n' {
			at++
		}
	}
	if lines == 0 {
		return nil, false
	}
	if lines > 1 {
		data = f.data
	}
	cut, usageOnly, ok := f.inspect(data)
	switch {
	case !ok:
		return nil, false
	case usageOnly:
		return nil, true
	case cut[1] > cut[0] && lines == 1:
		f.edit = append(append(f.edit[:0], ev[:dataAt+cut[0]]...), ev[dataAt+cut[1]:]...)
		return f.edit, false
	}
	return nil, false
}

// Top-level members the filter looks at.
const (
	filterOther = iota
	filterChoices
	filterUsage
)

// inspect reads the JSON data of an event: whether it is an object with
// an empty "choices" array and a "usage" that is not null (usageOnly),
// and the bytes to cut to remove a "usage": null member with its comma
// (cut[0] < cut[1] when there is one). ok is false when data is not one
// valid JSON object.
func (f *UsageChunkFilter) inspect(data []byte) (cut [2]int, usageOnly, ok bool) {
	if f.dec == nil {
		f.dec = jsontext.NewDecoder(&f.buf)
	}
	f.buf.Reset()
	f.buf.Write(data)
	d := f.dec
	d.Reset(&f.buf)
	if tok, err := d.ReadToken(); err != nil || tok.Kind() != '{' {
		return cut, false, false
	}
	prevEnd := int(d.InputOffset()) // the end of the last member, or of '{'
	emptyChoices, usage, first, cutToName := false, false, true, false
	for d.PeekKind() == '"' {
		name, err := d.ReadValue()
		if err != nil {
			return cut, false, false
		}
		nameEnd := int(d.InputOffset())
		nameStart := nameEnd - len(name)
		if cutToName {
			cut[1], cutToName = nameStart, false
		}
		which := filterOther
		var buf [len("choices")]byte
		if s, ok := unquoteName(name, buf[:0]); ok {
			switch string(s) {
			case "choices":
				which = filterChoices
			case "usage":
				which = filterUsage
			}
		}
		v, err := d.ReadValue()
		if err != nil {
			return cut, false, false
		}
		end := int(d.InputOffset())
		switch which {
		case filterChoices:
			emptyChoices = v.Kind() == '[' && len(bytes.TrimSpace(v[1:len(v)-1])) == 0
		case filterUsage:
			switch {
			case v.Kind() != 'n':
				usage = true
			case first:
				// The first member: cut up to the next name, if any.
				cut, cutToName = [2]int{nameStart, end}, true
			default:
				cut = [2]int{prevEnd, end} // from the comma before
			}
		}
		prevEnd, first = end, false
	}
	if _, err := d.ReadToken(); err != nil { // the closing brace
		return cut, false, false
	}
	if _, err := d.ReadToken(); err != io.EOF {
		return cut, false, false
	}
	return cut, emptyChoices && usage, true
}
