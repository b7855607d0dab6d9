package llm

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

// FuzzParseRequest: ParseRequest does not panic nor change the body; what
// it accepts is one valid JSON object within bounds; and a message added
// to a body adds exactly the count of its text (the estimate is the sum
// of its texts, so it never decreases when a text is added), under Approx
// and, for small bodies, o200k_base. Seeds are in
// testdata/fuzz/FuzzParseRequest.
func FuzzParseRequest(f *testing.F) {
	o200kTok, _ := ParseTokenizer(O200kBase)
	f.Fuzz(func(t *testing.T, body []byte, text string) {
		if len(body) > 64<<10 {
			return
		}
		orig := bytes.Clone(body)
		req, err := ParseRequest(body, nil)
		if !bytes.Equal(body, orig) {
			t.Fatalf("the body changed: %q", body)
		}
		if err != nil {
			if !errors.Is(err, ErrInvalidBody) {
				t.Fatalf("error %v does not wrap ErrInvalidBody", err)
			}
			return
		}
		if !json.Valid(body) || bytes.TrimLeft(body, " \t\r\n")[0] != '{' {
			t.Fatalf("accepted %q, not a JSON object", body)
		}
		if req.PromptTokens < 0 || req.PromptTokens > MaxCost || req.MaxTokens < -1 || req.MaxTokens > MaxCost ||
			req.Requests < 0 || req.Budget(1024) < 0 || req.Budget(1024) > MaxCost || req.Budget(MaxCost) > MaxCost {
			t.Fatalf("out of bounds: %+v", req)
		}
		goServerReads(t, body, req)

		// Add a message with text right after the opening brace.
		quoted, _ := json.Marshal(text)
		var decoded string
		if err := json.Unmarshal(quoted, &decoded); err != nil {
			t.Fatal(err)
		}
		i := bytes.IndexByte(body, '{') + 1
		msg := `"messages":[{"role":"user","content":` + string(quoted) + `}]`
		if !req.rw.objEmpty {
			msg += ","
		}
		more := append(append(append([]byte(nil), body[:i]...), msg...), body[i:]...)
		toks := []Tokenizer{approxTokenizer{}}
		if len(more) < 2<<10 {
			toks = append(toks, o200kTok)
		}
		for _, tok := range toks {
			before, err := ParseRequest(body, tok)
			if err != nil {
				t.Fatalf("%s: %v", tok.Name(), err)
			}
			after, err := ParseRequest(more, tok)
			want := before.PromptTokens + tok.Count([]byte(decoded))
			if err != nil || after.PromptTokens != want || after.MaxTokens != before.MaxTokens || after.Model != before.Model {
				t.Fatalf("%s: adding a message of %q: %+v, %v; want prompt %d from %+v", tok.Name(), decoded, after, err, want, before)
			}
		}
	})
}

// goServerReads checks that a Go server decoding an accepted body with
// encoding/json (names matched in any case, the last non-null value kept,
// duplicate objects merged) reads the model and stream the estimate read,
// include_usage true where the estimate read it true, no budget, n or
// number of prompts above what the estimate charges, and, where it reads
// a negative budget (no limit), a charge of the default at least.
func goServerReads(t *testing.T, body []byte, req Request) {
	t.Helper()
	var g struct {
		Model               string `json:"model"`
		Stream              bool   `json:"stream"`
		MaxTokens           *int64 `json:"max_tokens"`
		MaxCompletionTokens *int64 `json:"max_completion_tokens"`
		MaxOutputTokens     *int64 `json:"max_output_tokens"`
		N                   *int64 `json:"n"`
		Prompt              any    `json:"prompt"`
		StreamOptions       *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if json.Unmarshal(body, &g) != nil {
		return // the server answers 400 itself
	}
	// A batch without a top-level model has the model its requests name,
	// which a server reading the body as one request does not read.
	batchModel := g.Model == "" && req.Requests > 0
	if g.Model != req.Model && !batchModel || g.Stream != req.Stream {
		t.Fatalf("%q: a Go server reads model %q, stream %v; the estimate %q, %v", body, g.Model, g.Stream, req.Model, req.Stream)
	}
	if req.IncludeUsage && (g.StreamOptions == nil || !g.StreamOptions.IncludeUsage) {
		t.Fatalf("%q: a Go server reads include_usage false; the estimate true", body)
	}
	const defaultMax = 1024
	for _, b := range []*int64{g.MaxTokens, g.MaxCompletionTokens, g.MaxOutputTokens} {
		if b != nil && *b >= 0 && *b > req.Budget(defaultMax) {
			t.Fatalf("%q: a Go server reads a budget of %d; the estimate charges %d", body, *b, req.Budget(defaultMax))
		}
	}
	if g.MaxTokens == nil && g.MaxCompletionTokens == nil && g.MaxOutputTokens == nil && req.Budget(defaultMax) < defaultMax {
		t.Fatalf("%q: a Go server reads no budget (its default); the estimate charges %d", body, req.Budget(defaultMax))
	}
	// A negative budget is no limit to the server that reads it (Ollama's
	// num_predict -1), whichever of the others it reads first.
	for _, b := range []*int64{g.MaxTokens, g.MaxCompletionTokens, g.MaxOutputTokens} {
		if b != nil && *b < 0 && req.Budget(defaultMax) < defaultMax {
			t.Fatalf("%q: a Go server reads a budget of %d (no limit); the estimate charges %d", body, *b, req.Budget(defaultMax))
		}
	}
	if g.N != nil && *g.N > max(req.Choices, 1) {
		t.Fatalf("%q: a Go server reads n %d; the estimate %d", body, *g.N, req.Choices)
	}
	if ps, ok := g.Prompt.([]any); ok {
		var n int64
		for _, v := range ps {
			switch v.(type) {
			case string, []any:
				n++
			}
		}
		if n > max(req.Prompts, 1) {
			t.Fatalf("%q: a Go server reads %d prompts; the estimate %d", body, n, req.Prompts)
		}
	}
}

// FuzzWithStreamUsage: the rewrite does not panic; a changed body is
// valid JSON that decodes to the same value but for include_usage (a
// Go map keeps the last of duplicate names, as the provider does), and
// parses to the same estimate; an unchanged body is the same slice.
// Seeds are in testdata/fuzz/FuzzWithStreamUsage.
func FuzzWithStreamUsage(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		if len(body) > 64<<10 {
			return
		}
		req, err := ParseRequest(body, nil)
		if err != nil {
			return
		}
		orig := bytes.Clone(body)
		out, changed, err := WithStreamUsage(body, req)
		if !bytes.Equal(body, orig) {
			t.Fatalf("the body changed: %q", body)
		}
		if !changed {
			if len(out) != len(body) || len(out) > 0 && &out[0] != &body[0] {
				t.Fatalf("unchanged, but another slice: %q", out)
			}
			switch {
			case err == nil && req.NeedsStreamUsage():
				t.Fatalf("no change, no error, and %+v needs one", req)
			case err != nil && (!errors.Is(err, ErrStreamOptionsNotObject) || !req.NeedsStreamUsage()):
				t.Fatalf("error %v for %+v", err, req)
			}
			return
		}
		if err != nil || !req.NeedsStreamUsage() {
			t.Fatalf("changed with %v for %+v", err, req)
		}
		if !json.Valid(out) {
			t.Fatalf("invalid JSON: %q", out)
		}
		again, err := ParseRequest(out, nil)
		if err != nil || !again.IncludeUsage || !again.Stream || again.PromptTokens != req.PromptTokens ||
			again.MaxTokens != req.MaxTokens || again.Model != req.Model {
			t.Fatalf("%q parses to %+v, %v; from %+v", out, again, err, req)
		}
		want, got := decodeJSON(t, body), decodeJSON(t, out)
		if so, ok := want["stream_options"].(map[string]any); ok {
			so["include_usage"] = true
		} else {
			want["stream_options"] = map[string]any{"include_usage": true}
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%q decodes to\n%v\nwant\n%v", out, got, want)
		}
	})
}

func decodeJSON(t *testing.T, b []byte) map[string]any {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var m map[string]any
	if err := d.Decode(&m); err != nil {
		t.Fatalf("%q: %v", b, err)
	}
	return m
}
