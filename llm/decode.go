package llm

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"sync"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zlib"
	"github.com/klauspost/compress/zstd"
)

// MaxEncodedBody is the largest compressed body, in bytes as sent, that a
// UsageReader keeps to decode: over it, the reader reports Unreadable. A
// compressed chat completion is a few KB. An event stream compressed and
// flushed event by event (as Caddy's encode handler does) takes about 28
// bytes an OpenAI chat chunk and 75 bytes an Anthropic text delta with
// gzip, br or zstd, so this holds streams of some 37,000 OpenAI chunks or
// 14,000 Anthropic deltas: answers of about 30,000 tokens and more.
const MaxEncodedBody = 1 << 20

// MaxDecodedBody is the most a UsageReader decodes of a compressed body,
// in bytes: a body that decodes to more (a decompression bomb) is
// Unreadable.
const MaxDecodedBody = 64 << 20

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
	decodeTooLarge                      // over MaxDecodedBody
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
// the decoded bytes to w, at most MaxDecodedBody of them. Decoding stops
// without error where enc ends, even in the middle of a stream: a body
// still arriving, or cut, decodes as far as its whole blocks go.
func decodeBody(enc []byte, codings []coding, w io.Writer) decodeOutcome {
	s := decodeSourcesPool.Get().(*decodeSources)
	defer decodeSourcesPool.Put(s)
	s.body.Reset(enc)
	var src io.Reader = &s.body
	n := 0
	defer func() {
		for i := range n {
			s.decs[i].release()
			s.decs[i] = bodyDecoder{}
		}
		s.body.Reset(nil)
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
	total, empty := 0, 0
	for {
		m, err := src.Read(buf[:])
		if m > 0 {
			if total += m; total > MaxDecodedBody {
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
