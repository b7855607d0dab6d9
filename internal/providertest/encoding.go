package providertest

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/klauspost/compress/zstd"
)

// encoders compress a whole body in one content coding.
var encoders = map[string]func([]byte) []byte{
	"gzip": func(b []byte) []byte {
		var buf bytes.Buffer
		w := gzip.NewWriter(&buf)
		w.Write(b)
		w.Close()
		return buf.Bytes()
	},
	"deflate": func(b []byte) []byte {
		var buf bytes.Buffer
		w := zlib.NewWriter(&buf)
		w.Write(b)
		w.Close()
		return buf.Bytes()
	},
	"zstd": func(b []byte) []byte {
		w, err := zstd.NewWriter(nil)
		if err != nil {
			panic(err)
		}
		defer w.Close()
		return w.EncodeAll(b, nil)
	},
}

// Decode undoes a content coding the server uses ("" and "identity" leave
// the body as it is).
func Decode(coding string, b []byte) ([]byte, error) {
	var r io.Reader
	switch coding {
	case "", "identity":
		return b, nil
	case "gzip":
		gr, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, err
		}
		r = gr
	case "deflate":
		zr, err := zlib.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, err
		}
		r = zr
	case "zstd":
		d, err := zstd.NewReader(nil)
		if err != nil {
			return nil, err
		}
		defer d.Close()
		return d.DecodeAll(b, nil)
	default:
		return nil, fmt.Errorf("providertest: unknown content coding %q", coding)
	}
	return io.ReadAll(r)
}

// Negotiate returns the first of the server's codings (in its order of
// preference) that the Accept-Encoding values allow with a q-value above
// zero, by name or through "*"; "" when none is allowed.
func Negotiate(acceptEncoding []string, codings []string) string {
	q := map[string]float64{}
	star := -1.0
	for _, line := range acceptEncoding {
		for _, item := range strings.Split(line, ",") {
			name, params, _ := strings.Cut(item, ";")
			name = strings.ToLower(strings.TrimSpace(name))
			if name == "" {
				continue
			}
			weight := 1.0
			for _, p := range strings.Split(params, ";") {
				k, v, _ := strings.Cut(strings.TrimSpace(p), "=")
				if strings.EqualFold(strings.TrimSpace(k), "q") {
					if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
						weight = f
					}
				}
			}
			if name == "*" {
				star = weight
			} else {
				q[name] = weight
			}
		}
	}
	for _, c := range codings {
		w, ok := q[c]
		if !ok {
			w = star
		}
		if w > 0 {
			return c
		}
	}
	return ""
}
