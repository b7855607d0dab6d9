package llm

import (
	"fmt"
	"strings"
	"testing"
)

// words for the text of realistic bodies: varied enough that a BPE sees
// ordinary English, with some numbers and punctuation.
var words = strings.Fields(`the a token bucket limits how many requests each user sends per minute
while the gateway counts prompt and completion tokens before forwarding them upstream; when the
bucket runs dry, clients wait for 429 responses to clear. Rate limiting protects shared quota,
keeps latency predictable, and lets operators bill teams fairly. Consider 3 users sharing 100000
tokens per hour: streaming answers report usage at the end, so the estimate is settled later.`)

// prose returns about n bytes of sentences, deterministic for a seed.
func prose(n, seed int) string {
	var b strings.Builder
	for i := seed; b.Len() < n; i++ {
		b.WriteString(words[(i*7+i/3)%len(words)])
		b.WriteByte(' ')
	}
	return b.String()[:n]
}

// chatBody is a realistic chat request of about size bytes: a system
// prompt, a tool definition, alternating turns, a budget.
func chatBody(size int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"gpt-4o-mini","temperature":0.2,"max_tokens":512,"stream":true,`)
	b.WriteString(`"tools":[{"type":"function","function":{"name":"lookup_quota","description":"Remaining quota of a team",`)
	b.WriteString(`"parameters":{"type":"object","properties":{"team":{"type":"string"}},"required":["team"]}}}],`)
	b.WriteString(`"messages":[{"role":"system","content":"` + prose(400, 1) + `"}`)
	for i := 0; ; i++ {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		n := min(100+(i*137)%700, size-b.Len()-len(`,{"role":"assistant","content":""}]}`))
		if n < 1 {
			break
		}
		b.WriteString(`,{"role":"` + role + `","content":"` + prose(n, i) + `"}`)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// BenchmarkParseRequest: a realistic 2 KB and 100 KB chat body under each
// tokenizer.
func BenchmarkParseRequest(b *testing.B) {
	for _, name := range []string{Approx, O200kBase, Cl100kBase} {
		tok, err := ParseTokenizer(name)
		if err != nil {
			b.Fatal(err)
		}
		for _, size := range []int{2 << 10, 100 << 10} {
			body := chatBody(size)
			b.Run(fmt.Sprintf("%s/%dKB", name, size>>10), func(b *testing.B) {
				benchParse(b, body, tok)
			})
		}
	}
}

func benchParse(b *testing.B, body []byte, tok Tokenizer) {
	if _, err := ParseRequest(body, tok); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := ParseRequest(body, tok); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/(float64(len(body))/1024), "ns/KB")
}

// repeatTo returns open + units joined by sep + close, about size bytes.
func repeatTo(size int, open, unit, sep, close string) []byte {
	var b strings.Builder
	b.WriteString(open)
	for i := 0; b.Len() < size-len(close)-len(unit); i++ {
		if i > 0 {
			b.WriteString(sep)
		}
		b.WriteString(unit)
	}
	b.WriteString(close)
	return []byte(b.String())
}

// adversarial shapes of a body, by name, of about size bytes. Each must
// cost time linear in its size: compare ns/KB across sizes.
var adversarial = map[string]func(size int) []byte{
	// Parts nested MaxDepth deep, over and over: the shape that was
	// quadratic in depth.
	"deep_content": func(size int) []byte {
		unit := nest(MaxDepth, `"x"`)
		unit = unit[len(`{"messages":[`) : len(unit)-len(`]}`)] // one message
		return repeatTo(size, `{"messages":[`, unit, ",", `]}`)
	},
	// Arrays nested MaxDepth deep in a skipped member.
	"deep_skipped": func(size int) []byte {
		unit := strings.Repeat("[", MaxDepth-2) + strings.Repeat("]", MaxDepth-2)
		return repeatTo(size, `{"metadata":[`, unit, ",", `]}`)
	},
	"tiny_parts": func(size int) []byte {
		return repeatTo(size, `{"messages":[{"role":"user","content":[`, `{"type":"text","text":"a"}`, ",", `]}]}`)
	},
	"tiny_images": func(size int) []byte {
		return repeatTo(size, `{"messages":[{"role":"user","content":[`, `{}`, ",", `]}]}`)
	},
	"token_ids": func(size int) []byte {
		return repeatTo(size, `{"input":[`, `1`, ",", `]}`)
	},
	"huge_string": func(size int) []byte {
		return []byte(`{"prompt":"` + prose(size-13, 0) + `"}`)
	},
	"escapes": func(size int) []byte {
		return repeatTo(size, `{"prompt":"`, `\u00e9\n\"\\\ud83d\ude80`, "", `"}`)
	},
	"many_keys": func(size int) []byte {
		var b strings.Builder
		b.WriteString(`{`)
		for i := 0; b.Len() < size-20; i++ {
			fmt.Fprintf(&b, `"k%d":%d,`, i, i)
		}
		b.WriteString(`"max_tokens":1}`)
		return []byte(b.String())
	},
	"many_duplicate_messages": func(size int) []byte {
		return repeatTo(size, `{`, `"messages":[{"content":"ab"}]`, ",", `}`)
	},
	"many_duplicate_names_in_a_part": func(size int) []byte {
		return repeatTo(size, `{"messages":[{`, `"content":"a","type":"x","name":"b"`, ",", `}]}`)
	},
	"big_tools": func(size int) []byte {
		return repeatTo(size, `{"tools":[`, `{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"string"}}}}}`, ",", `]}`)
	},
}

// BenchmarkAdversarial: the adversarial shapes at 64 KB and 1 MB under
// Approx; ns/KB is the per-KB cost, the same at both sizes when linear.
func BenchmarkAdversarial(b *testing.B) {
	for _, name := range []string{"deep_content", "deep_skipped", "tiny_parts", "tiny_images", "token_ids", "huge_string",
		"escapes", "many_keys", "many_duplicate_messages", "many_duplicate_names_in_a_part", "big_tools"} {
		for _, size := range []int{64 << 10, 1 << 20} {
			body := adversarial[name](size)
			b.Run(fmt.Sprintf("%s/%dKB", name, size>>10), func(b *testing.B) {
				benchParse(b, body, nil)
			})
		}
	}
}

// BenchmarkAdversarialBPE: the shapes where o200k_base does the most
// work per byte, at 64 KB and 512 KB: long runs of one character, and
// whitespace runs with line breaks, on which the tokenizer library's split
// pattern is quadratic unless cut.
func BenchmarkAdversarialBPE(b *testing.B) {
	tok, _ := ParseTokenizer(O200kBase)
	shapes := map[string]func(size int) []byte{}
	for _, name := range []string{"deep_content", "tiny_parts", "huge_string", "escapes", "big_tools"} {
		shapes[name] = adversarial[name]
	}
	for name, unit := range map[string]string{"spaces": " ", "space_newline": ` \n`, "uppercase": "A", "digits": "7", "cjk": "語"} {
		shapes[name] = func(size int) []byte {
			return []byte(`{"prompt":"` + strings.Repeat(unit, (size-13)/len(unit)) + `"}`)
		}
	}
	for _, name := range []string{"deep_content", "tiny_parts", "huge_string", "escapes", "big_tools",
		"spaces", "space_newline", "uppercase", "digits", "cjk"} {
		for _, size := range []int{64 << 10, 512 << 10} {
			body := shapes[name](size)
			b.Run(fmt.Sprintf("%s/%dKB", name, size>>10), func(b *testing.B) { benchParse(b, body, tok) })
		}
	}
}

// BenchmarkWithStreamUsage: the rewrite of a 100 KB streamed body.
func BenchmarkWithStreamUsage(b *testing.B) {
	body := chatBody(100 << 10)
	req, err := ParseRequest(body, nil)
	if err != nil || !req.NeedsStreamUsage() {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, changed, err := WithStreamUsage(body, req); !changed || err != nil {
			b.Fatal(err)
		}
	}
}

// TestBenchmarkBodies: the bodies of the benchmarks are what they claim.
func TestBenchmarkBodies(t *testing.T) {
	for _, size := range []int{2 << 10, 100 << 10} {
		body := chatBody(size)
		if n := len(body); n < size*9/10 || n > size*11/10 {
			t.Errorf("chat body of %d bytes, want about %d", n, size)
		}
		if _, err := ParseRequest(body, nil); err != nil {
			t.Error(err)
		}
	}
	for name, gen := range adversarial {
		body := gen(64 << 10)
		if n := len(body); n < 60<<10 || n > 66<<10 {
			t.Errorf("%s: %d bytes, want about 64 KB", name, n)
		}
		if _, err := ParseRequest(body, nil); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// BenchmarkParseBatch: an Anthropic Message Batch of 100 KB, 100 chat
// requests of about 1 KB each, under Approx: linear, at about the time
// per KB of small chat bodies (each has its tool and system prompt), and
// no allocation per batched request.
func BenchmarkParseBatch(b *testing.B) {
	var s strings.Builder
	s.WriteString(`{"requests":[`)
	for i := range 100 {
		if i > 0 {
			s.WriteByte(',')
		}
		fmt.Fprintf(&s, `{"custom_id":"q%d","params":%s}`, i, chatBody(1000))
	}
	s.WriteString(`]}`)
	benchParse(b, []byte(s.String()), nil)
}
