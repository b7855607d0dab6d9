package llm

import (
	"errors"
	"testing"
)

// TestWithStreamUsage: the exact bytes of the rewritten body, every byte
// but the added or replaced ones unchanged.
func TestWithStreamUsage(t *testing.T) {
	for _, tc := range []struct {
		name, body, want string
		err              error // with the body unchanged
	}{
		{"no_stream_options",
			`{"model":"m","stream":true,"messages":[]}`,
			`{"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[]}`, nil},
		{"pretty_printed",
			"{\n  \"model\": \"m\",\n  \"stream\": true\n}\n",
			"{\"stream_options\":{\"include_usage\":true},\n  \"model\": \"m\",\n  \"stream\": true\n}\n", nil},
		{"leading_whitespace",
			" \r\n\t{ \"stream\" : true }",
			" \r\n\t{\"stream_options\":{\"include_usage\":true}, \"stream\" : true }", nil},
		{"empty_stream_options",
			`{"stream":true,"stream_options":{}}`,
			`{"stream":true,"stream_options":{"include_usage":true}}`, nil},
		{"empty_stream_options_with_spaces",
			"{\"stream\":true,\"stream_options\": { \n }}",
			"{\"stream\":true,\"stream_options\": {\"include_usage\":true \n }}", nil},
		{"stream_options_without_include_usage",
			`{"stream":true,"stream_options":{"other":1}}`,
			`{"stream":true,"stream_options":{"include_usage":true,"other":1}}`, nil},
		{"stream_options_pretty",
			"{\n  \"stream_options\": {\n    \"other\": 1\n  },\n  \"stream\": true\n}",
			"{\n  \"stream_options\": {\"include_usage\":true,\n    \"other\": 1\n  },\n  \"stream\": true\n}", nil},
		{"include_usage_false",
			`{"stream":true,"stream_options":{"include_usage":false,"other":1}}`,
			`{"stream":true,"stream_options":{"include_usage":true,"other":1}}`, nil},
		{"include_usage_false_spaced",
			"{\"stream\":true,\"stream_options\":{\"include_usage\" :\n false }}",
			"{\"stream\":true,\"stream_options\":{\"include_usage\" :\n true }}", nil},
		{"include_usage_null",
			`{"stream":true,"stream_options":{"include_usage":null}}`,
			`{"stream":true,"stream_options":{"include_usage":true}}`, nil},
		{"include_usage_other_value",
			`{"stream":true,"stream_options":{"include_usage":{"a":[1]}}}`,
			`{"stream":true,"stream_options":{"include_usage":true}}`, nil},
		{"stream_options_null",
			`{"stream":true,"stream_options":null,"x":1}`,
			`{"stream":true,"stream_options":{"include_usage":true},"x":1}`, nil},
		// Duplicates: the last one, which the provider reads, is changed.
		{"duplicate_include_usage",
			`{"stream":true,"stream_options":{"include_usage":true,"include_usage":false}}`,
			`{"stream":true,"stream_options":{"include_usage":true,"include_usage":true}}`, nil},
		{"duplicate_stream_options",
			`{"stream":true,"stream_options":{"include_usage":true},"stream_options":{"x":1}}`,
			`{"stream":true,"stream_options":{"include_usage":true},"stream_options":{"include_usage":true,"x":1}}`, nil},
		{"duplicate_stream_options_last_false",
			`{"stream_options":{"include_usage":false},"stream":true,"stream_options":{"include_usage":false}}`,
			`{"stream_options":{"include_usage":false},"stream":true,"stream_options":{"include_usage":true}}`, nil},
		{"escaped_names",
			`{"str\u0065am":true,"stream_\u006fptions":{"include_\u0075sage":false}}`,
			`{"str\u0065am":true,"stream_\u006fptions":{"include_\u0075sage":true}}`, nil},

		// Nothing to do.
		{"already_true", `{"stream":true,"stream_options":{"include_usage":true}}`, "", nil},
		{"already_true_last", `{"stream":true,"stream_options":{"include_usage":false,"include_usage":true}}`, "", nil},
		{"not_streamed", `{"stream":false,"messages":[]}`, "", nil},
		{"stream_absent", `{}`, "", nil},

		// stream_options of another type: unchanged, reported.
		{"stream_options_string", `{"stream":true,"stream_options":"x"}`, "", ErrStreamOptionsNotObject},
		{"stream_options_array", `{"stream":true,"stream_options":[]}`, "", ErrStreamOptionsNotObject},
		{"stream_options_number", `{"stream":true,"stream_options":1}`, "", ErrStreamOptionsNotObject},
		{"stream_options_false", `{"stream":true,"stream_options":false}`, "", ErrStreamOptionsNotObject},
		{"last_stream_options_not_an_object", `{"stream":true,"stream_options":{},"stream_options":true}`, "", ErrStreamOptionsNotObject},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := ParseRequest([]byte(tc.body), nil)
			if err != nil {
				t.Fatal(err)
			}
			out, changed, err := WithStreamUsage([]byte(tc.body), req)
			if tc.want == "" {
				if string(out) != tc.body || changed || !errors.Is(err, tc.err) {
					t.Fatalf("WithStreamUsage = %q, %v, %v; want the body unchanged, %v", out, changed, err, tc.err)
				}
				return
			}
			if string(out) != tc.want || !changed || err != nil {
				t.Fatalf("WithStreamUsage = %q, %v, %v\nwant %q", out, changed, err, tc.want)
			}
			again, err := ParseRequest(out, nil)
			if err != nil || !again.IncludeUsage || !again.Stream || again.NeedsStreamUsage() || again.PromptTokens != req.PromptTokens {
				t.Errorf("the rewritten body parses to %+v, %v", again, err)
			}
		})
	}
}

// TestWithStreamUsageNewSlice: a changed body is a new slice; the one
// given is left as it was.
func TestWithStreamUsageNewSlice(t *testing.T) {
	body := []byte(`{"stream":true}`)
	req, _ := ParseRequest(body, nil)
	out, changed, err := WithStreamUsage(body, req)
	if string(out) != `{"stream_options":{"include_usage":true},"stream":true}` || !changed || err != nil {
		t.Fatalf("%q %v %v", out, changed, err)
	}
	if &out[0] == &body[0] || string(body) != `{"stream":true}` {
		t.Errorf("the result shares the body's memory, or the body changed: %q", body)
	}
}

func TestWithStreamUsageMismatch(t *testing.T) {
	body := []byte(`{"stream":true}`)
	req, _ := ParseRequest(body, nil)
	for name, tc := range map[string]struct {
		body []byte
		req  Request
	}{
		"zero_request":     {body, Request{Stream: true}},
		"zero_and_empty":   {nil, Request{Stream: true}},
		"other_body":       {[]byte(`{"stream":true,"x":1}`), req},
		"same_length_body": {[]byte(` {"stream":1}  `), req},
	} {
		out, changed, err := WithStreamUsage(tc.body, tc.req)
		if !errors.Is(err, ErrBodyMismatch) || changed || string(out) != string(tc.body) {
			t.Errorf("%s: %q, %v, %v; want ErrBodyMismatch", name, out, changed, err)
		}
	}
	// An invalid body's Request is a zero Request.
	bad := []byte(`{"stream":true`)
	req, err := ParseRequest(bad, nil)
	if err == nil {
		t.Fatal("no error")
	}
	if _, _, err := WithStreamUsage(bad, req); !errors.Is(err, ErrBodyMismatch) {
		t.Errorf("after an invalid body: %v", err)
	}
}
