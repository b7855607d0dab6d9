package llm

import "bytes"

// sseLines follows the framing of an event stream pushed to it in pieces,
// as the HTML standard parses it
// (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
// a leading byte order mark is skipped; lines end with LF, CRLF or CR; a
// line starting with a colon is a comment; a field line is "name:value"
// with one leading space of the value dropped, or "name" alone with an
// empty value; the values of an event's data lines are joined with LF;
// a blank line ends the event. Only data lines matter here: their values
// go to the usageBody's jsonScan as they arrive, so an event of any length
// is read without being kept. Other fields (event, id, retry) are skipped.
type sseLines struct {
	state     uint8
	cr        bool // the last byte was a CR that ended a line
	nameN     int  // length of the field name so far
	nameData  bool // the field name so far is a prefix of "data"
	dataLines int  // data lines of the current event so far
	bom       int  // bytes of a leading byte order mark seen
	started   bool // past the place of a byte order mark
}

const (
	lineStart  = iota
	lineName   // in a field name
	lineValue0 // right after "data:"
	lineData   // in the value of a data line
	lineSkip   // in a comment, or another field
)

const sseBOM = "\xef\xbb\xbf"

var sseNewline = []byte{'\n'}

// feed reads the next bytes of the stream.
func (l *sseLines) feed(b *usageBody, p []byte) {
	i := 0
	for !l.started && i < len(p) {
		if p[i] == sseBOM[l.bom] {
			i++
			if l.bom++; l.bom == len(sseBOM) {
				l.started = true
			}
			continue
		}
		l.started = true
		if l.bom > 0 {
			// A partial mark: bytes of a field name that is not "data".
			l.state, l.nameN, l.nameData = lineName, l.bom, false
		}
	}
	for i < len(p) {
		switch l.state {
		case lineStart:
			c := p[i]
			if c == '\n' && l.cr {
				l.cr = false
				i++
				continue
			}
			l.cr = false
			switch c {
			case '\r', '\n':
				l.dispatch(b)
				l.cr = c == '\r'
				i++
				continue
			case ':':
				l.state = lineSkip
				i++
				continue
			}
			l.state, l.nameN, l.nameData = lineName, 0, true
		case lineName:
			c := p[i]
			isData := l.nameData && l.nameN == len("data")
			switch c {
			case ':':
				l.state = lineSkip
				if isData {
					l.state = lineValue0
				}
			case '\r', '\n':
				if isData {
					l.dataLine(b)
				}
				l.endLine(c)
			default:
				l.nameData = l.nameData && l.nameN < len("data") && c == "data"[l.nameN]
				l.nameN++
			}
			i++
		case lineValue0:
			l.dataLine(b)
			l.state = lineData
			if p[i] == ' ' {
				i++
			}
		case lineData, lineSkip:
			k := sseLineEnd(p[i:])
			if k < 0 {
				if l.state == lineData {
					b.scan.feed(b, p[i:])
				}
				i = len(p)
				continue
			}
			if l.state == lineData {
				b.scan.feed(b, p[i:i+k])
			}
			l.endLine(p[i+k])
			i += k + 1
		}
	}
}

// dataLine starts the value of a data line.
func (l *sseLines) dataLine(b *usageBody) {
	if l.dataLines > 0 {
		b.scan.feed(b, sseNewline)
	}
	l.dataLines++
}

func (l *sseLines) endLine(c byte) {
	l.state = lineStart
	l.cr = c == '\r'
}

// dispatch ends an event.
func (l *sseLines) dispatch(b *usageBody) {
	b.endEvent(l.dataLines > 0, b.scan.errorObj, true)
	l.dataLines = 0
}

// sseLineEnd returns the index of the first CR or LF in p, or -1.
func sseLineEnd(p []byte) int {
	// One scan for either byte: looking for '\n' first and then for a
	// '\r' before it searched the whole rest on every line of a stream
	// framed by '\r' alone, quadratic in its length.
	return bytes.IndexAny(p, "\r\n")
}
