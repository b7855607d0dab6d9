package llm

import (
	"bytes"
	"errors"
	"io"
	"slices"
	"strings"
	"sync"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zlib"
	"github.com/klauspost/compress/zstd"
)

// MaxEncodedBody is the largest compressed body, in bytes as sent, that a
// UsageReader keeps to decode once, at its end. A compressed chat
// completion is a few KB. An event stream compressed and flushed event by
// event (as Caddy's encode handler does) takes about 28 bytes an OpenAI
// chat chunk and 75 bytes an Anthropic text delta with gzip, br or zstd,
// so this holds streams of some 37,000 OpenAI chunks or 14,000 Anthropic
// deltas. A longer body is decoded as it is written instead, in a
// goroutine of its own (see streamDecoder), keeping no more of it: its
// usage is read however long it is (a client that asks for top_logprobs
// makes about 450 compressed bytes a token).
const MaxEncodedBody = 1 << 20

// MaxDecodedBody and MaxDecodeRatio bound what a UsageReader decodes of a
// compressed body: a body that decodes to more than MaxDecodedBody bytes
// and to more than MaxDecodeRatio times its encoded bytes (a decompression
// bomb: gzip reaches 1032 times) is Unreadable. Text and JSON compress
// some 3 to 20 times; a long answer past 64 MiB decodes within the ratio.
const (
	MaxDecodedBody = 64 << 20
	MaxDecodeRatio = 64
)

// maxZstdWindow is the largest zstd window decoded: 8 MiB, what RFC 9659
// allows the zstd content coding.
const maxZstdWindow = 8 << 20

// maxCodings is the most content codings a body may have: one. Each layer
// of stacked codings multiplies the work of the layer under it, and
// MaxDecodedBody bounds only the last (a 13 KB body coded "deflate,
// deflate, gzip" cost 17 s of CPU to decode to nothing); no provider and
// no Caddy encoder stacks codings. A body with more is Unreadable.
const maxCodings = 1

// A coding is a content coding.
type coding uint8

const (
	codingGzip coding = iota + 1
	codingDeflate
	codingBrotli
	codingZstd
)

// parseCodings reads a Content-Encoding value into dst, in the order the
// codings were applied. unknown is true for a coding not decoded here, or
// too many codings.
func parseCodings(s string, dst *[maxCodings]coding) (n int, unknown bool) {
	for s != "" {
		var tok string
		tok, s, _ = strings.Cut(s, ",")
		tok = strings.TrimSpace(tok)
		var c coding
		switch {
		case tok == "", strings.EqualFold(tok, "identity"):
			continue
		case strings.EqualFold(tok, "gzip"), strings.EqualFold(tok, "x-gzip"):
			c = codingGzip
		case strings.EqualFold(tok, "deflate"):
			c = codingDeflate
		case strings.EqualFold(tok, "br"):
			c = codingBrotli
		case strings.EqualFold(tok, "zstd"):
			c = codingZstd
		default:
			return 0, true
		}
		if n == maxCodings {
			return 0, true
		}
		dst[n] = c
		n++
	}
	return n, false
}

// What became of a decoding.
type decodeOutcome uint8

const (
	decodeOK       decodeOutcome = iota // to the end, or as far as a cut body goes
	decodeCorrupt                       // invalid compressed data
	decodeTooLarge                      // over MaxDecodedBody and MaxDecodeRatio
)

// Pools of decoders, and of the buffer decoded bytes are read into: a
// gzip or deflate decoder costs some 40 KB to make, a brotli or zstd one
// more.
var (
	gzipPool          sync.Pool // *gzip.Reader
	zlibPool          sync.Pool // io.ReadCloser, a zlib.Resetter
	flatePool         sync.Pool // io.ReadCloser, a flate.Resetter
	brotliPool        sync.Pool // *brotli.Reader
	zstdPool          sync.Pool // *zstd.Decoder
	decodeBufPool     = sync.Pool{New: func() any { return new([16 << 10]byte) }}
	decodeSourcesPool = sync.Pool{New: func() any { return new(decodeSources) }}
)

// decodeSources are the readers a decoding chains, reused.
type decodeSources struct {
	body   bytes.Reader
	prefix [maxCodings]prefixReader
	decs   [maxCodings]bodyDecoder
}

// bodyDecoder is a pooled decoder in use.
type bodyDecoder struct {
	c coding
	r io.Reader
}

// decodeBody decodes enc, compressed with codings in that order, and writes
// the decoded bytes to w (see decodeFrom). Decoding stops without error
// where enc ends, even in the middle of a stream: a body still arriving,
// or cut, decodes as far as its whole blocks go.
func decodeBody(enc []byte, codings []coding, w io.Writer) decodeOutcome {
	s := decodeSourcesPool.Get().(*decodeSources)
	defer decodeSourcesPool.Put(s)
	s.body.Reset(enc)
	defer s.body.Reset(nil)
	encoded := int64(len(enc))
	return decodeFrom(&s.body, &encoded, codings, w, s)
}

// decodeFrom decodes src, compressed with codings in that order, and
// writes the decoded bytes to w, while they stay within MaxDecodedBody or
// MaxDecodeRatio times *encoded, the bytes read from src so far (kept up
// to date by the caller's src). s holds the decoders, which it releases.
func decodeFrom(src io.Reader, encoded *int64, codings []coding, w io.Writer, s *decodeSources) decodeOutcome {
	n := 0
	defer func() {
		for i := range n {
			s.decs[i].release()
			s.decs[i] = bodyDecoder{}
		}
	}()
	for i := len(codings) - 1; i >= 0; i-- {
		d, err := newBodyDecoder(codings[i], src, &s.prefix[i])
		if d.r == nil {
			return decodeOutcomeOf(err)
		}
		s.decs[n] = d
		n++
		if err != nil {
			return decodeOutcomeOf(err)
		}
		src = d.r
	}
	buf := decodeBufPool.Get().(*[16 << 10]byte)
	defer decodeBufPool.Put(buf)
	total, empty := int64(0), 0
	for {
		m, err := src.Read(buf[:])
		if m > 0 {
			if total += int64(m); total > MaxDecodedBody && total > MaxDecodeRatio*(*encoded) {
				return decodeTooLarge
			}
			w.Write(buf[:m])
			empty = 0
		} else if empty++; empty > 100 && err == nil {
			return decodeCorrupt // a decoder that makes no progress
		}
		if err != nil {
			return decodeOutcomeOf(err)
		}
	}
}

// streamDecoder decodes a compressed body as it is written, in a goroutine
// of its own, into a usageBody: a Write hands its bytes over through a
// pipe (it returns once the decoder has them), and finish ends the body
// and waits for the decoder. The usageBody is the decoder's until finish
// returns.
type streamDecoder struct {
	pw   *io.PipeWriter
	done chan decodeOutcome
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// startStream starts decoding a body compressed with codings into w,
// first the bytes kept of it so far.
func startStream(codings []coding, kept []byte, w io.Writer) *streamDecoder {
	pr, pw := io.Pipe()
	d := &streamDecoder{pw: pw, done: make(chan decodeOutcome, 1)}
	codings = slices.Clone(codings)
	go func() {
		s := decodeSourcesPool.Get().(*decodeSources)
		defer decodeSourcesPool.Put(s)
		src := &countingReader{r: pr}
		outcome := decodeFrom(src, &src.n, codings, w, s)
		// A decoder that stopped before the end (corrupt data, too large)
		// fails the writes still to come at once.
		pr.CloseWithError(errDecoderStopped)
		d.done <- outcome
	}()
	d.write(kept)
	return d
}

var errDecoderStopped = errors.New("llm: the decoder stopped")

// write hands p to the decoder; after the decoder stopped, it does nothing.
func (d *streamDecoder) write(p []byte) { _, _ = d.pw.Write(p) }

// finish ends the body where it is (a cut stream decodes as far as its
// whole blocks go) and returns what became of the decoding.
func (d *streamDecoder) finish() decodeOutcome {
	_ = d.pw.Close()
	return <-d.done
}

// decodeOutcomeOf classes a decoder's error: the end, or a body that ends
// early, is fine; anything else is corrupt data.
func decodeOutcomeOf(err error) decodeOutcome {
	if err == nil || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return decodeOK
	}
	return decodeCorrupt
}

// newBodyDecoder returns a decoder of c reading src, from the pool when it
// has one. The decoder is set (d.r != nil) when it must be released, even
// with an error (a header that could not be read).
func newBodyDecoder(c coding, src io.Reader, pre *prefixReader) (bodyDecoder, error) {
	d := bodyDecoder{c: c}
	switch c {
	case codingGzip:
		z, _ := gzipPool.Get().(*gzip.Reader)
		if z == nil {
			z = new(gzip.Reader)
		}
		d.r = z
		return d, z.Reset(src)
	case codingDeflate:
		// RFC 9110 deflate is zlib (RFC 1950); some servers send raw
		// deflate (RFC 1951). A zlib stream starts with a header whose
		// method is 8 and whose 16 bits are a multiple of 31.
		pre.reset(src)
		if h, err := pre.peek(); err != nil {
			return bodyDecoder{}, err
		} else if h[0]&0x0f == 8 && h[0]>>4 <= 7 && (uint(h[0])<<8|uint(h[1]))%31 == 0 {
			d.c = codingZlib
			if z, _ := zlibPool.Get().(io.ReadCloser); z != nil {
				d.r = z
				return d, z.(zlib.Resetter).Reset(pre, nil)
			}
			z, err := zlib.NewReader(pre)
			if z == nil {
				return bodyDecoder{}, err
			}
			d.r = z
			return d, err
		}
		if z, _ := flatePool.Get().(io.ReadCloser); z != nil {
			d.r = z
			return d, z.(flate.Resetter).Reset(pre, nil)
		}
		d.r = flate.NewReader(pre)
		return d, nil
	case codingBrotli:
		b, _ := brotliPool.Get().(*brotli.Reader)
		if b == nil {
			b = brotli.NewReader(src)
		} else {
			b.Reset(src)
		}
		d.r = b
		return d, nil
	case codingZstd:
		z, _ := zstdPool.Get().(*zstd.Decoder)
		if z == nil {
			var err error
			z, err = zstd.NewReader(nil,
				zstd.WithDecoderConcurrency(1), // decode in the caller's goroutine
				zstd.WithDecoderLowmem(true),
				zstd.WithDecoderMaxWindow(maxZstdWindow),
				zstd.WithDecoderMaxMemory(MaxDecodedBody))
			if err != nil {
				return bodyDecoder{}, err
			}
		}
		d.r = z
		return d, z.Reset(src)
	}
	return bodyDecoder{}, errors.New("llm: unknown content coding")
}

// codingZlib is a deflate decoder that found a zlib header.
const codingZlib coding = 100

// release returns the decoder to its pool.
func (d bodyDecoder) release() {
	switch d.c {
	case codingGzip:
		gzipPool.Put(d.r)
	case codingZlib:
		zlibPool.Put(d.r)
	case codingDeflate:
		flatePool.Put(d.r)
	case codingBrotli:
		brotliPool.Put(d.r)
	case codingZstd:
		z := d.r.(*zstd.Decoder)
		z.Reset(nil) // drop the input; the decoder stays usable
		zstdPool.Put(z)
	}
}

// prefixReader reads src, with its first two bytes peeked.
type prefixReader struct {
	src  io.Reader
	head [2]byte
	n, i int
	one  [1]byte
}

func (p *prefixReader) reset(src io.Reader) {
	*p = prefixReader{src: src}
}

// peek reads the first two bytes.
func (p *prefixReader) peek() ([2]byte, error) {
	n, err := io.ReadFull(p.src, p.head[:])
	p.n = n
	if err != nil {
		if n == 0 && err == io.EOF {
			return p.head, err
		}
		return p.head, io.ErrUnexpectedEOF
	}
	return p.head, nil
}

func (p *prefixReader) Read(b []byte) (int, error) {
	if p.i < p.n {
		n := copy(b, p.head[p.i:p.n])
		p.i += n
		return n, nil
	}
	return p.src.Read(b)
}

// ReadByte lets the flate decoders read without a bufio.Reader of their
// own when the source allows it.
func (p *prefixReader) ReadByte() (byte, error) {
	if p.i < p.n {
		p.i++
		return p.head[p.i-1], nil
	}
	if br, ok := p.src.(io.ByteReader); ok {
		return br.ReadByte()
	}
	_, err := io.ReadFull(p.src, p.one[:])
	return p.one[0], err
}
