package llm

import (
	"fmt"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"github.com/tiktoken-go/tokenizer"
)

// Names of the tokenizers, as ParseTokenizer takes them.
const (
	// Approx is the default tokenizer: ⌈UTF-8 bytes / BytesPerToken⌉ per
	// text. It needs no vocabulary and costs next to nothing.
	Approx = "approx"
	// O200kBase is the byte-pair encoding of GPT-4o, GPT-4.1, GPT-5 and the
	// o-series models.
	O200kBase = "o200k_base"
	// Cl100kBase is the byte-pair encoding of GPT-4 and GPT-3.5-turbo.
	Cl100kBase = "cl100k_base"
)

// BytesPerToken is the Approx rule of thumb: one token per four bytes of
// UTF-8 text, rounded up. Bytes, not characters: the BPE vocabularies hold
// about one token per CJK character (3 UTF-8 bytes), so counting runes
// would undercount such text three- to fourfold.
const BytesPerToken = 4

// Tokenizer counts the tokens of one text. Implementations are safe for
// concurrent use by any number of goroutines.
type Tokenizer interface {
	// Name is the name ParseTokenizer takes for this tokenizer.
	Name() string
	// Count returns the number of tokens of text, which is UTF-8 (a
	// decoded JSON string, or the raw text of a JSON value); invalid UTF-8
	// is counted, never rejected. Count does not retain text.
	Count(text []byte) int64
}

// ParseTokenizer returns the tokenizer of that name: "approx" (also ""),
// "o200k_base" or "cl100k_base". The BPE tokenizers are built once per
// process, on their first ParseTokenizer (their vocabularies are compiled
// into the binary; building one takes a fraction of a second and some tens
// of MB), and shared. An unknown name is an error that names it and the
// choices.
func ParseTokenizer(name string) (Tokenizer, error) {
	switch name {
	case Approx, "":
		return approxTokenizer{}, nil
	case O200kBase:
		return o200k(), nil
	case Cl100kBase:
		return cl100k(), nil
	}
	return nil, fmt.Errorf("llm: unknown tokenizer %q: want %s, %s or %s", name, Approx, O200kBase, Cl100kBase)
}

// approxTokenizer counts ⌈len(text) / BytesPerToken⌉.
type approxTokenizer struct{}

func (approxTokenizer) Name() string { return Approx }

func (approxTokenizer) Count(text []byte) int64 {
	return (int64(len(text)) + BytesPerToken - 1) / BytesPerToken
}

// bpe counts with a tiktoken byte-pair encoding. A tokenizer.Codec is safe
// for concurrent use as long as nobody calls its SetErrorMode: Count reads
// the vocabulary map and runs a regexp2.Regexp, documented safe for
// concurrent use.
type bpe struct {
	name  string
	codec tokenizer.Codec
}

var (
	o200k  = sync.OnceValue(func() *bpe { return newBPE(tokenizer.O200kBase) })
	cl100k = sync.OnceValue(func() *bpe { return newBPE(tokenizer.Cl100kBase) })
)

func newBPE(enc tokenizer.Encoding) *bpe {
	c, err := tokenizer.Get(enc)
	if err != nil {
		panic("llm: tokenizer " + string(enc) + ": " + err.Error()) // a constant name the library supports
	}
	return &bpe{name: string(enc), codec: c}
}

func (b *bpe) Name() string { return b.name }

// Runs of text that Count cuts before tokenizing, in bytes. The split
// pattern of the tokenizer library takes time quadratic in the length of a
// whitespace run that holds line breaks (16 KB of " \n" cost a quarter of
// a second), and byte-pair merging costs more than linear time in the
// length of a piece without whitespace (a long base64 or minified JSON
// text is one run). Cutting bounds both: the cost of Count is linear in
// len(text). A cut may add a token where it splits what would have been
// one; ordinary text has no whitespace run over 64 bytes nor any word
// over 1 KB, and is counted exactly as the library counts it.
const (
	maxSpaceRun = 64
	maxWordRun  = 1024
)

// Count tokenizes text as tiktoken does, special tokens as plain text,
// cutting long runs (see maxSpaceRun). Invalid UTF-8 is first replaced by
// U+FFFD. Should the codec fail, a piece counts its length: no byte-level
// BPE token is shorter than one byte.
func (b *bpe) Count(text []byte) int64 {
	if len(text) == 0 {
		return 0
	}
	s := string(text)
	if !utf8.ValidString(s) {
		s = replaceInvalid(s)
	}
	var n int64
	start, spaces, word := 0, 0, 0
	for i := 0; i < len(s); {
		r, size := rune(s[i]), 1
		if r >= utf8.RuneSelf {
			r, size = utf8.DecodeRuneInString(s[i:])
		}
		if unicode.IsSpace(r) {
			spaces, word = spaces+size, 0
			if spaces > maxSpaceRun {
				n += b.count(s[start:i])
				start, spaces = i, size
			}
		} else {
			spaces, word = 0, word+size
			if word > maxWordRun {
				n += b.count(s[start:i])
				start, word = i, size
			}
		}
		i += size
	}
	return n + b.count(s[start:])
}

func (b *bpe) count(s string) int64 {
	n, err := b.codec.Count(s)
	if err != nil {
		return int64(len(s))
	}
	return int64(n)
}

// replaceInvalid replaces each invalid byte of s with U+FFFD, as a
// provider's decoder does (strings.ToValidUTF8 replaces a whole run with
// one, so 100,000 invalid bytes counted one token).
func replaceInvalid(s string) string {
	var b strings.Builder
	b.Grow(len(s) + len(s)/2)
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b.WriteString("\uFFFD")
		} else {
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}
