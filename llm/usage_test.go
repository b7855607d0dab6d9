package llm

import (
	"fmt"
	"strings"
	"testing"
)

// Bodies as the providers send them (trimmed of nothing that matters).
const (
	openAIChatJSON = `{
  "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
  "object": "chat.completion",
  "created": 1741569952,
  "model": "gpt-4.1-2025-04-14",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "Hello! How can I assist you today?",
        "refusal": null,
        "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 19,
    "completion_tokens": 10,
    "total_tokens": 29,
    "prompt_tokens_details": {
      "cached_tokens": 0,
      "audio_tokens": 0
    },
    "completion_tokens_details": {
      "reasoning_tokens": 0,
      "audio_tokens": 0,
      "accepted_prediction_tokens": 0,
      "rejected_prediction_tokens": 0
    }
  },
  "service_tier": "default"
}`

	responsesJSON = `{"id":"resp_67ccd3a9da748190baa7f1570fe91ac604becb25c45c1d41","object":"response",` +
		`"created_at":1741476777,"status":"completed","error":null,"incomplete_details":null,"instructions":null,` +
		`"max_output_tokens":null,"model":"gpt-4o-2024-08-06","output":[{"type":"message",` +
		`"id":"msg_67ccd3acc8d48190a77525dc6de64b4104becb25c45c1d41","status":"completed","role":"assistant",` +
		`"content":[{"type":"output_text","text":"In a peaceful grove beneath a silver moon...","annotations":[]}]}],` +
		`"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":null,"summary":null},` +
		`"store":true,"temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],` +
		`"top_p":1.0,"truncation":"disabled","usage":{"input_tokens":328,"input_tokens_details":{"cached_tokens":128},` +
		`"output_tokens":52,"output_tokens_details":{"reasoning_tokens":12},"total_tokens":380},"user":null,"metadata":{}}`

	embeddingsJSON = `{"object":"list","data":[{"object":"embedding","index":0,` +
		`"embedding":[0.0023064255,-0.009327292,-0.0028842222]}],"model":"text-embedding-3-small",` +
		`"usage":{"prompt_tokens":8,"total_tokens":8}}`

	anthropicMessageJSON = `{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant",` +
		`"model":"claude-sonnet-4-20250514","content":[{"type":"text","text":"Hello!"}],"stop_reason":"end_turn",` +
		`"stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":100,` +
		`"cache_read_input_tokens":2000,"cache_creation":{"ephemeral_5m_input_tokens":100,` +
		`"ephemeral_1h_input_tokens":0},"output_tokens":6,"service_tier":"standard"}}`
)

// openAIChatStream is a chat completions stream; with include_usage every
// chunk has "usage":null and a last chunk with no choices carries usage.
func openAIChatStream(includeUsage bool) string {
	null := ""
	if includeUsage {
		null = `,"usage":null`
	}
	chunk := func(delta, finish string) string {
		return `data: {"id":"chatcmpl-BC4kqGhNY9IDiNJsm7nDvLMVPjKtN","object":"chat.completion.chunk",` +
			`"created":1742305016,"model":"gpt-4o-mini-2024-07-18","service_tier":"default",` +
			`"system_fingerprint":"fp_b8bc95a0ac","choices":[{"index":0,"delta":` + delta +
			`,"logprobs":null,"finish_reason":` + finish + `}]` + null + "}\n\n"
	}
	s := chunk(`{"role":"assistant","content":"","refusal":null}`, "null") +
		chunk(`{"content":"Hello"}`, "null") +
		chunk(`{"content":"! The \"usage\": {\"total_tokens\": 1} of it."}`, "null") +
		chunk(`{}`, `"stop"`)
	if includeUsage {
		s += `data: {"id":"chatcmpl-BC4kqGhNY9IDiNJsm7nDvLMVPjKtN","object":"chat.completion.chunk",` +
			`"created":1742305016,"model":"gpt-4o-mini-2024-07-18","service_tier":"default",` +
			`"system_fingerprint":"fp_b8bc95a0ac","choices":[],"usage":{"prompt_tokens":9,` +
			`"completion_tokens":9,"total_tokens":18,"prompt_tokens_details":{"cached_tokens":0,` +
			`"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,` +
			`"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}` + "\n\n"
	}
	return s + "data: [DONE]\n\n"
}

func sseEvent(name, data string) string { return "event: " + name + "\ndata: " + data + "\n\n" }

// responsesStream is a Responses API stream ending with terminal (its
// event type: response.completed, response.incomplete).
func responsesStream(terminal string) string {
	resp := func(status, usage string) string {
		return `{"id":"resp_67c9fdcecf488190bdd9a0409de3a1ec07b8b0ad4e5eb654","object":"response",` +
			`"created_at":1741290958,"status":"` + status + `","error":null,"incomplete_details":null,` +
			`"instructions":"You are a helpful assistant.","max_output_tokens":null,"model":"gpt-4.1-2025-04-14",` +
			`"output":[{"id":"msg_1","type":"message","status":"completed","role":"assistant","content":` +
			`[{"type":"output_text","text":"Hi there! Ask me about \"usage\":{\"total_tokens\":1}.","annotations":[]}]}],` +
			`"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":null,"summary":null},` +
			`"store":true,"temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],` +
			`"top_p":1.0,"truncation":"disabled","usage":` + usage + `,"user":null,"metadata":{"usage":{"total_tokens":7}}}`
	}
	return sseEvent("response.created", `{"type":"response.created","sequence_number":0,"response":`+resp("in_progress", "null")+`}`) +
		sseEvent("response.in_progress", `{"type":"response.in_progress","sequence_number":1,"response":`+resp("in_progress", "null")+`}`) +
		sseEvent("response.output_item.added", `{"type":"response.output_item.added","sequence_number":2,"output_index":0,`+
			`"item":{"id":"msg_1","status":"in_progress","type":"message","role":"assistant","content":[]}}`) +
		sseEvent("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":3,"item_id":"msg_1",`+
			`"output_index":0,"content_index":0,"delta":"Hi"}`) +
		sseEvent(terminal, `{"type":"`+terminal+`","sequence_number":4,"response":`+
			resp("completed", `{"input_tokens":37,"input_tokens_details":{"cached_tokens":0},"output_tokens":11,`+
				`"output_tokens_details":{"reasoning_tokens":0},"total_tokens":48}`)+`}`)
}

// anthropicMessagesStream is a Messages stream; delta is the usage of its
// message_delta.
func anthropicMessagesStream(delta string) string {
	return sseEvent("message_start", `{"type":"message_start","message":{"id":"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY",`+
		`"type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-20250514","stop_reason":null,`+
		`"stop_sequence":null,"usage":{"input_tokens":25,"cache_creation_input_tokens":0,"cache_read_input_tokens":1500,`+
		`"output_tokens":1}}}`) +
		sseEvent("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`) +
		sseEvent("ping", `{"type": "ping"}`) +
		sseEvent("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}`) +
		sseEvent("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta",`+
			`"partial_json":"{\"usage\": {\"output_tokens\": 1}"}}`) +
		sseEvent("content_block_stop", `{"type":"content_block_stop","index":0}`) +
		sseEvent("message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},`+
			`"usage":`+delta+`}`) +
		sseEvent("message_stop", `{"type":"message_stop"}`)
}

const sse = "text/event-stream"

// readBody feeds chunks to a new reader and returns its result.
func readBody(contentType, contentEncoding string, chunks ...string) (Usage, Status) {
	r := NewUsageReader(contentType, contentEncoding)
	defer r.Release()
	for _, c := range chunks {
		r.Write([]byte(c))
	}
	return r.Result()
}

type usageCase struct {
	name        string
	contentType string
	body        string
	want        Usage
	status      Status
	total       int64
}

func checkUsage(t *testing.T, tc usageCase, got Usage, st Status) {
	t.Helper()
	if st != tc.status || got != tc.want {
		t.Fatalf("got %+v, %v; want %+v, %v", got, st, tc.want, tc.status)
	}
	if st == Found && got.Total() != tc.total {
		t.Fatalf("Total() = %d, want %d", got.Total(), tc.total)
	}
}

// checkSplits reads body whole, in two writes split at every offset, and
// byte by byte, and checks every result.
func checkSplits(t *testing.T, tc usageCase) {
	t.Helper()
	got, st := readBody(tc.contentType, "", tc.body)
	checkUsage(t, tc, got, st)
	for i := range len(tc.body) + 1 {
		got, st := readBody(tc.contentType, "", tc.body[:i], tc.body[i:])
		if st != tc.status || got != tc.want {
			t.Fatalf("split at %d: got %+v, %v; want %+v, %v", i, got, st, tc.want, tc.status)
		}
	}
	r := NewUsageReader(tc.contentType, "")
	defer r.Release()
	for i := range len(tc.body) {
		r.Write([]byte{tc.body[i]})
	}
	if got, st := r.Result(); st != tc.status || got != tc.want {
		t.Fatalf("byte by byte: got %+v, %v; want %+v, %v", got, st, tc.want, tc.status)
	}
}

// TestUsageShapes: every provider shape gives its exact usage and total,
// however the body is split into writes.
func TestUsageShapes(t *testing.T) {
	for _, tc := range []usageCase{
		{"openai_chat_json", "application/json", openAIChatJSON,
			Usage{InputTokens: 19, OutputTokens: 10, TotalTokens: 29}, Found, 29},
		{"openai_chat_stream", sse, openAIChatStream(true),
			Usage{InputTokens: 9, OutputTokens: 9, TotalTokens: 18}, Found, 18},
		{"openai_chat_stream_without_include_usage", sse, openAIChatStream(false), Usage{}, NotReported, 0},
		{"responses_json", "application/json", responsesJSON,
			Usage{InputTokens: 328, OutputTokens: 52, TotalTokens: 380}, Found, 380},
		{"responses_stream", sse, responsesStream("response.completed"),
			Usage{InputTokens: 37, OutputTokens: 11, TotalTokens: 48}, Found, 48},
		{"responses_stream_incomplete", sse, responsesStream("response.incomplete"),
			Usage{InputTokens: 37, OutputTokens: 11, TotalTokens: 48}, Found, 48},
		{"embeddings_json", "application/json", embeddingsJSON,
			Usage{InputTokens: 8, TotalTokens: 8}, Found, 8},
		{"anthropic_json", "application/json", anthropicMessageJSON,
			Usage{InputTokens: 12, OutputTokens: 6, CacheCreationInputTokens: 100, CacheReadInputTokens: 2000}, Found, 2118},
		{"anthropic_stream", sse, anthropicMessagesStream(`{"output_tokens":15}`),
			Usage{InputTokens: 25, OutputTokens: 15, CacheReadInputTokens: 1500}, Found, 1540},
		{"anthropic_stream_cumulative", sse, anthropicMessagesStream(`{"input_tokens":25,` +
			`"cache_creation_input_tokens":0,"cache_read_input_tokens":1500,"output_tokens":15,` +
			`"server_tool_use":{"web_search_requests":0}}`),
			Usage{InputTokens: 25, OutputTokens: 15, CacheReadInputTokens: 1500}, Found, 1540},
		// A newer count in message_delta wins over message_start's.
		{"anthropic_stream_latest_wins", sse, anthropicMessagesStream(`{"input_tokens":30,"output_tokens":15}`),
			Usage{InputTokens: 30, OutputTokens: 15, CacheReadInputTokens: 1500}, Found, 1545},
		// Cut after message_start: input final, output the count at the start.
		{"anthropic_stream_cut_after_start", sse, anthropicMessagesStream(`{"output_tokens":15}`)[:400],
			Usage{InputTokens: 25, OutputTokens: 1, CacheReadInputTokens: 1500, Partial: true}, Found, 1526},
	} {
		t.Run(tc.name, func(t *testing.T) { checkSplits(t, tc) })
	}
}

// Answers of other upstreams, in their documented shapes: Gemini's
// generateContent (https://ai.google.dev/api/generate-content) and
// Ollama's native API (https://github.com/ollama/ollama/blob/main/docs/api.md).
const (
	geminiJSON = `{"candidates":[{"content":{"parts":[{"text":"A bucket of tokens."}],"role":"model"},` +
		`"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":12,` +
		`"totalTokenCount":420,"promptTokensDetails":[{"modality":"TEXT","tokenCount":8}],"thoughtsTokenCount":400},` +
		`"modelVersion":"gemini-2.5-flash","responseId":"mKdXaKbSIo2c1dkP2Y6H0Qc"}`
	geminiStream = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"A bucket\"}],\"role\":\"model\"},\"index\":0}]," +
		"\"usageMetadata\":{\"promptTokenCount\":8,\"totalTokenCount\":8},\"modelVersion\":\"gemini-2.5-flash\"}\r\n\r\n" +
		"data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\" of tokens.\"}],\"role\":\"model\"},\"finishReason\":\"STOP\",\"index\":0}]," +
		"\"usageMetadata\":{\"promptTokenCount\":8,\"candidatesTokenCount\":30,\"totalTokenCount\":138,\"thoughtsTokenCount\":100}," +
		"\"modelVersion\":\"gemini-2.5-flash\"}\r\n\r\n"
	geminiArray = "[{\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"A bucket\"}],\"role\":\"model\"},\"index\":0}]," +
		"\"usageMetadata\":{\"promptTokenCount\":8,\"totalTokenCount\":8},\"modelVersion\":\"gemini-2.5-flash\"}\r\n,\r\n" +
		"{\"candidates\":[{\"content\":{\"parts\":[{\"text\":\" of tokens.\"}],\"role\":\"model\"},\"finishReason\":\"STOP\",\"index\":0}]," +
		"\"usageMetadata\":{\"promptTokenCount\":8,\"candidatesTokenCount\":30,\"totalTokenCount\":138,\"thoughtsTokenCount\":100}," +
		"\"modelVersion\":\"gemini-2.5-flash\"}\r\n]"
	ollamaChatJSON = `{"model":"llama3.2","created_at":"2023-12-12T14:13:43.416799Z","message":{"role":"assistant",` +
		`"content":"Hello! How are you today?"},"done":true,"total_duration":5191566416,"load_duration":2154458,` +
		`"prompt_eval_count":26,"prompt_eval_duration":383809000,"eval_count":298,"eval_duration":4799921000}`
	ollamaChatStream = `{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00","message":{"role":"assistant",` +
		`"content":"The"},"done":false}` + "\n" +
		`{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00","message":{"role":"assistant",` +
		`"content":" sky\n\"eval_count\":1}"},"done":false}` + "\n" +
		`{"model":"llama3.2","created_at":"2023-08-04T19:22:45.499127Z","message":{"role":"assistant","content":""},` +
		`"done":true,"done_reason":"stop","total_duration":4883583458,"load_duration":1334875,"prompt_eval_count":26,` +
		`"prompt_eval_duration":342546000,"eval_count":282,"eval_duration":4535599000}` + "\n"
	ollamaEmbedJSON = `{"model":"all-minilm","embeddings":[[0.010071029,-0.0017594862,0.05007221]],` +
		`"total_duration":14143917,"load_duration":1019500,"prompt_eval_count":8}`
)

// TestUsageOtherUpstreams: the usage that Gemini (usageMetadata, in a JSON
// body and in each event of an alt=sse stream), Bedrock Converse (its
// camelCase usage object) and Ollama's native API
// (prompt_eval_count and eval_count, in a JSON body and in the last line
// of a newline-delimited JSON stream) report is read exactly, however the
// body is split. Before, all of them were NotReported: the estimate
// stood.
func TestUsageOtherUpstreams(t *testing.T) {
	const ndjson = "application/x-ndjson"
	for _, tc := range []usageCase{
		{"gemini_json", "application/json", geminiJSON,
			Usage{InputTokens: 8, OutputTokens: 12, OtherTokens: 400, TotalTokens: 420}, Found, 420},
		// Without a total, the thoughts count as well.
		{"gemini_json_without_total", "application/json",
			`{"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":12,"thoughtsTokenCount":400,"toolUsePromptTokenCount":5,"cachedContentTokenCount":6}}`,
			Usage{InputTokens: 8, OutputTokens: 12, OtherTokens: 405}, Found, 425},
		{"gemini_stream", sse, geminiStream,
			Usage{InputTokens: 8, OutputTokens: 30, OtherTokens: 100, TotalTokens: 138}, Found, 138},
		// Cut before its last event: the prompt's count, a floor.
		{"gemini_stream_cut", sse, geminiStream[:strings.LastIndex(geminiStream, "data:")],
			Usage{InputTokens: 8, TotalTokens: 8, Partial: true}, Found, 8},
		{"ollama_chat_json", "application/json; charset=utf-8", ollamaChatJSON,
			Usage{InputTokens: 26, OutputTokens: 298}, Found, 324},
		{"ollama_chat_stream", ndjson, ollamaChatStream, Usage{InputTokens: 26, OutputTokens: 282}, Found, 308},
		{"ollama_chat_stream_crlf", "Application/X-NDJSON; charset=utf-8", strings.ReplaceAll(ollamaChatStream, "\n", "\r\n"),
			Usage{InputTokens: 26, OutputTokens: 282}, Found, 308},
		// Cut before the last line ends: its counts came whole all the same.
		{"ollama_chat_stream_unterminated", ndjson, strings.TrimSuffix(ollamaChatStream, "\n"),
			Usage{InputTokens: 26, OutputTokens: 282}, Found, 308},
		{"ollama_chat_stream_cut", ndjson, ollamaChatStream[:strings.LastIndex(ollamaChatStream, `"done":true`)],
			Usage{}, NotReported, 0},
		// A prompt served from Ollama's cache has no prompt_eval_count.
		{"ollama_cached_prompt", "application/json", `{"done":true,"eval_count":12}`, Usage{OutputTokens: 12}, Found, 12},
		{"ollama_embed_json", "application/json", ollamaEmbedJSON, Usage{InputTokens: 8}, Found, 8},
		// Counts nested elsewhere (in a message, in options) are not the
		// answer's.
		{"ollama_nested_counts", "application/json", `{"message":{"eval_count":5},"options":{"prompt_eval_count":6}}`,
			Usage{}, NotReported, 0},
		// A count named twice, or a count beside a usage object, in one
		// JSON body: parsers keep different ones.
		{"ollama_count_twice", "application/json", `{"eval_count":12,"eval_count":1}`, Usage{}, Invalid, 0},
		{"ollama_count_and_usage", "application/json", `{"usage":{"prompt_tokens":3},"prompt_eval_count":30}`, Usage{}, Invalid, 0},
		{"usage_and_usage_metadata", "application/json", `{"usage":{"total_tokens":3},"usageMetadata":{"totalTokenCount":30}}`,
			Usage{}, Invalid, 0},
		{"ollama_count_fraction", "application/json", `{"eval_count":1.5}`, Usage{}, Invalid, 0},
		{"ollama_count_string", "application/json", `{"eval_count":"12"}`, Usage{}, Invalid, 0},
		{"ollama_count_null", "application/json", `{"eval_count":null}`, Usage{}, NotReported, 0},
		// Bedrock Converse's usage, camelCase.
		{"bedrock_converse_json", "application/json", `{"output":{"message":{"role":"assistant","content":[{"text":"Hi."}]}},` +
			`"stopReason":"end_turn","usage":{"inputTokens":30,"outputTokens":12,"totalTokens":542,` +
			`"cacheReadInputTokens":400,"cacheWriteInputTokens":100},"metrics":{"latencyMs":800}}`,
			Usage{InputTokens: 30, OutputTokens: 12, CacheReadInputTokens: 400, CacheCreationInputTokens: 100, TotalTokens: 542}, Found, 542},
		// An NDJSON line that is not an object ends at its newline.
		{"ndjson_broken_line", ndjson, "\"abc\n{\"eval_count\":7}\n", Usage{OutputTokens: 7}, Found, 7},
		// Gemini's streamGenerateContent without alt=sse: its chunks as
		// the elements of one JSON array; the last one counts the answer,
		// and one cut before it leaves the prompt's count, a floor.
		{"gemini_array", "application/json; charset=UTF-8", geminiArray,
			Usage{InputTokens: 8, OutputTokens: 30, OtherTokens: 100, TotalTokens: 138}, Found, 138},
		{"gemini_array_cut", "application/json", geminiArray[:strings.LastIndex(geminiArray, "{\"candidates\"")],
			Usage{InputTokens: 8, TotalTokens: 8, Partial: true}, Found, 8},
		{"gemini_array_one_chunk", "application/json", "[" + geminiJSON + "]",
			Usage{InputTokens: 8, OutputTokens: 12, OtherTokens: 400, TotalTokens: 420}, Found, 420},
		// What follows the array, or an element that is no object, ends
		// the reading.
		{"gemini_array_then_more", "application/json", "[" + geminiJSON + "]" + `{"usageMetadata":{"totalTokenCount":1}}`,
			Usage{InputTokens: 8, OutputTokens: 12, OtherTokens: 400, TotalTokens: 420}, Found, 420},
		{"gemini_array_string_element", "application/json", `["{\"usageMetadata\":{\"totalTokenCount\":1}}",` + geminiJSON + "]",
			Usage{}, NotReported, 0},
		// Only Gemini's usage is read in an array: an array of answers
		// (a batch's) each with its usage is no one answer's.
		{"array_of_usages", "application/json", `[{"usage":{"total_tokens":5}},{"usage":{"total_tokens":7}}]`, Usage{}, NotReported, 0},
		{"array_of_ollama_counts", "application/json", `[{"prompt_eval_count":5,"eval_count":7}]`, Usage{}, NotReported, 0},
	} {
		t.Run(tc.name, func(t *testing.T) { checkSplits(t, tc) })
	}
}

// TestUsageSettleCases: the cases the handler's own usage parsing was
// tested with.
func TestUsageSettleCases(t *testing.T) {
	openAI := func(prompt, completion int64, withUsage bool) string {
		usage := ""
		if withUsage {
			usage = fmt.Sprintf(`,"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,`+
				`"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}`,
				prompt, completion, prompt+completion)
		}
		return `{"id":"chatcmpl-test","object":"chat.completion","created":1700000000,"model":"gpt-test",` +
			`"choices":[{"index":0,"message":{"role":"assistant","content":"Hello there."},"finish_reason":"stop"}]` +
			usage + `}`
	}
	anthropicStream := anthropicMessagesStream(`{"output_tokens":200}`)
	anthropicStream = strings.Replace(anthropicStream, `"input_tokens":25`, `"input_tokens":120`, 1)
	anthropicStream = strings.Replace(anthropicStream, `"cache_read_input_tokens":1500`, `"cache_read_input_tokens":0`, 1)
	cut := strings.Index(anthropicStream, "event: message_delta")
	anthropicUsage := Usage{InputTokens: 120, OutputTokens: 200}
	openAIUsage := Usage{InputTokens: 100, OutputTokens: 220, TotalTokens: 320}
	stream := strings.ReplaceAll(openAIChatStream(true), `"prompt_tokens":9,"completion_tokens":9,"total_tokens":18`,
		`"prompt_tokens":100,"completion_tokens":220,"total_tokens":320`)
	for _, tc := range []usageCase{
		{"openai_json", "application/json", openAI(100, 220, true), openAIUsage, Found, 320},
		{"openai_json_charset", "application/json; charset=utf-8", openAI(100, 220, true), openAIUsage, Found, 320},
		{"total_tokens_wins", "application/json", `{"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":50}}`,
			Usage{InputTokens: 1, OutputTokens: 2, TotalTokens: 50}, Found, 50},
		{"prompt_plus_completion", "application/json", `{"usage":{"prompt_tokens":10,"completion_tokens":20}}`,
			Usage{InputTokens: 10, OutputTokens: 20}, Found, 30},
		{"responses_api_json", "application/json", `{"object":"response","usage":{"input_tokens":10,"output_tokens":20,"total_tokens":30}}`,
			Usage{InputTokens: 10, OutputTokens: 20, TotalTokens: 30}, Found, 30},
		{"anthropic_json", "application/json", `{"id":"msg_test","type":"message","role":"assistant","model":"claude-test",` +
			`"content":[{"type":"text","text":"Hello there."}],"stop_reason":"end_turn","stop_sequence":null,` +
			`"usage":{"input_tokens":120,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":200}}`,
			anthropicUsage, Found, 320},
		{"json_without_usage", "application/json", openAI(0, 0, false), Usage{}, NotReported, 0},
		{"json_usage_null", "application/json", `{"id":"x","usage":null}`, Usage{}, NotReported, 0},
		{"error_body", "application/json", `{"error":{"message":"overloaded","type":"server_error"}}`, Usage{}, NotReported, 0},
		{"not_json", "text/plain", "upstream said no", Usage{}, NotReported, 0},
		{"empty", "application/json", "", Usage{}, NotReported, 0},
		{"openai_stream", sse, stream, openAIUsage, Found, 320},
		{"openai_stream_crlf", sse, strings.ReplaceAll(stream, "\n", "\r\n"), openAIUsage, Found, 320},
		{"openai_stream_cr", sse, strings.ReplaceAll(stream, "\n", "\r"), openAIUsage, Found, 320},
		{"openai_stream_no_usage", sse, openAIChatStream(false), Usage{}, NotReported, 0},
		{"anthropic_stream", sse, anthropicStream, anthropicUsage, Found, 320},
		{"anthropic_stream_cumulative", sse, anthropicStream[:cut] +
			"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"}," +
			"\"usage\":{\"input_tokens\":120,\"output_tokens\":200}}\n\n", anthropicUsage, Found, 320},
		{"stream_without_data", sse, ": keep-alive\n\n", Usage{}, NotReported, 0},
		{"empty_stream", sse, "", Usage{}, NotReported, 0},
	} {
		t.Run(tc.name, func(t *testing.T) { checkSplits(t, tc) })
	}
}

// TestUsageOnlyTopLevel: only the provider's own usage object counts, not
// a "usage" inside content, tool arguments or metadata, before or after
// it, however long the body.
func TestUsageOnlyTopLevel(t *testing.T) {
	real := `{"prompt_tokens":100,"completion_tokens":220,"total_tokens":320}`
	want := Usage{InputTokens: 100, OutputTokens: 220, TotalTokens: 320}
	long := strings.Repeat(`x\"usage\":{\"total_tokens\":1}\\`, 10000) // 300 KB of content
	for _, tc := range []usageCase{
		{"content_after", "application/json", `{"usage":` + real + `,"choices":[{"message":{"content":"` + long + `"}}]}`,
			want, Found, 320},
		{"content_before", "application/json", `{"choices":[{"message":{"content":"` + long + `"}}],"usage":` + real + `}`,
			want, Found, 320},
		{"metadata_after", "application/json", `{"choices":[],"usage":` + real + `,"metadata":{"usage":{"total_tokens":1}}}`,
			want, Found, 320},
		{"tool_arguments", "application/json", `{"choices":[{"message":{"tool_calls":[{"function":{"name":"f",` +
			`"arguments":"{\"usage\":{\"total_tokens\":1}}"}}]}}],"usage":` + real + `,"x":[{"usage":{"total_tokens":2}}]}`,
			want, Found, 320},
		{"nested_only", "application/json", `{"choices":[{"usage":{"total_tokens":2}}],"meta":{"usage":{"total_tokens":3}}}`,
			Usage{}, NotReported, 0},
		{"escaped_name", "application/json", `{"us\u0061ge":` + real + `}`, want, Found, 320},
		{"escaped_quotes_and_backslashes", "application/json",
			`{"a":"\\","b":"\\\"usage\":{\"total_tokens\":1}","c":"\\\\","usage":` + real + `}`, want, Found, 320},
		{"name_usage_as_value", "application/json", `{"a":"usage","b":{"usage":{"total_tokens":1}},"usage":` + real + `}`,
			want, Found, 320},
		{"top_level_array", "application/json", `[{"usage":` + real + `}]`, Usage{}, NotReported, 0},
		{"duplicate_usage", "application/json", `{"usage":` + real + `,"usage":` + real + `}`, Usage{}, Invalid, 0},
		{"usage_not_object", "application/json", `{"usage":320}`, Usage{}, Invalid, 0},
		{"usage_empty_object", "application/json", `{"usage":{}}`, Usage{}, NotReported, 0},
		{"usage_object_too_large", "application/json", `{"usage":{"prompt_tokens":1,"x":"` + strings.Repeat("y", MaxUsageObject) + `"}}`,
			Usage{}, Invalid, 0},
		{"cut_inside_usage", "application/json", `{"usage":{"prompt_tokens":100,"completion_tokens":2`, Usage{}, NotReported, 0},
		{"cut_after_usage", "application/json", `{"usage":` + real + `,"choices":[{"message":{"content":"abc`, want, Found, 320},
		{"sse_nested_usage_ignored", sse, `data: {"choices":[{"delta":{"usage":{"total_tokens":5}}}],"meta":{"usage":{"total_tokens":6}}}` + "\n\n",
			Usage{}, NotReported, 0},
		{"sse_long_event", sse, `data: {"choices":[{"delta":{"content":"` + long + `"}}],"usage":` + real + "}\n\n",
			want, Found, 320},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if len(tc.body) > 100_000 {
				// Too long to split at every byte: a few splits.
				for _, n := range []int{1, 7, 4096, len(tc.body)} {
					r := NewUsageReader(tc.contentType, "")
					for b := tc.body; len(b) > 0; {
						k := min(n, len(b))
						r.Write([]byte(b[:k]))
						b = b[k:]
					}
					got, st := r.Result()
					r.Release()
					checkUsage(t, tc, got, st)
				}
				return
			}
			checkSplits(t, tc)
		})
	}
}

// TestUsageNumbers: counts are exact integers from 0 to 2^53-1; anything
// else, and a sum above 2^53-1, is Invalid.
func TestUsageNumbers(t *testing.T) {
	for _, tc := range []struct {
		usage  string
		want   Usage
		status Status
	}{
		{`{"prompt_tokens":5,"completion_tokens":7}`, Usage{InputTokens: 5, OutputTokens: 7}, Found},
		{`{"prompt_tokens":5.0,"completion_tokens":7e0}`, Usage{InputTokens: 5, OutputTokens: 7}, Found},
		{`{"prompt_tokens":3.2e2,"completion_tokens":1E3}`, Usage{InputTokens: 320, OutputTokens: 1000}, Found},
		{`{"prompt_tokens":32000e-2}`, Usage{InputTokens: 320}, Found},
		{`{"prompt_tokens":-0,"completion_tokens":0.0e5}`, Usage{}, Found},
		{`{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}`, Usage{}, Found},
		{`{"prompt_tokens":9007199254740991}`, Usage{InputTokens: MaxTokenCount}, Found},
		{`{"prompt_tokens":9007199254740991,"total_tokens":9007199254740991}`,
			Usage{InputTokens: MaxTokenCount, TotalTokens: MaxTokenCount}, Found},
		{`{"prompt_tokens":null,"completion_tokens":7}`, Usage{OutputTokens: 7}, Found},
		{`{"prompt_tokens":5,"input_tokens":5}`, Usage{InputTokens: 5}, Found},
		{`{"input_tokens":5,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,"output_tokens":3}`,
			Usage{InputTokens: 5, OutputTokens: 3}, Found},
		{`{"prompt_tokens":-1,"completion_tokens":7}`, Usage{}, Invalid},
		{`{"prompt_tokens":-5,"completion_tokens":700}`, Usage{}, Invalid},
		{`{"prompt_tokens":1.5}`, Usage{}, Invalid},
		{`{"prompt_tokens":1e-3}`, Usage{}, Invalid},
		{`{"prompt_tokens":1.05e1}`, Usage{}, Invalid},
		{`{"prompt_tokens":9007199254740992}`, Usage{}, Invalid},
		{`{"prompt_tokens":1e16}`, Usage{}, Invalid},
		{`{"prompt_tokens":1e999999999999999999}`, Usage{}, Invalid},
		{`{"prompt_tokens":92233720368547758070}`, Usage{}, Invalid},
		{`{"prompt_tokens":9223372036854775807,"completion_tokens":9223372036854775807}`, Usage{}, Invalid},
		{`{"prompt_tokens":9007199254740991,"completion_tokens":1}`, Usage{}, Invalid},
		{`{"prompt_tokens":"5"}`, Usage{}, Invalid},
		{`{"prompt_tokens":true}`, Usage{}, Invalid},
		{`{"prompt_tokens":[5]}`, Usage{}, Invalid},
		{`{"prompt_tokens":5,"input_tokens":6}`, Usage{}, Invalid},
		{`{"prompt_tokens":5,"prompt_tokens":5}`, Usage{}, Invalid},
		{`{"prompt_tokens":05}`, Usage{}, Invalid},
		{`{"prompt_tokens":5,}`, Usage{}, Invalid},
		{`{"Prompt_Tokens":5}`, Usage{}, NotReported},
		{`{"prompt_tokens_details":{"cached_tokens":5}}`, Usage{}, NotReported},
		{`{"prompt_tokens":5,"x":{"deep":[1,2,{"y":null}]},"completion_tokens":1}`, Usage{InputTokens: 5, OutputTokens: 1}, Found},
		{`{"prompt_tokens":5,"x":"\ud800"}`, Usage{}, Invalid},
	} {
		for _, ct := range []string{"application/json", sse} {
			body := `{"usage":` + tc.usage + `}`
			if ct == sse {
				body = "data: " + body + "\n\n"
			}
			got, st := readBody(ct, "", body)
			if got != tc.want || st != tc.status {
				t.Errorf("%s %s: got %+v, %v; want %+v, %v", ct, tc.usage, got, st, tc.want, tc.status)
			}
		}
	}
}

// TestUsageStreamInvalidSticks: a stream with one invalid usage report is
// Invalid, whatever follows.
func TestUsageStreamInvalidSticks(t *testing.T) {
	body := "data: {\"usage\":{\"prompt_tokens\":-5}}\n\ndata: {\"usage\":{\"prompt_tokens\":5}}\n\n"
	if u, st := readBody(sse, "", body); st != Invalid || u != (Usage{}) {
		t.Fatalf("got %+v, %v; want Invalid", u, st)
	}
}

// TestUsageResultAnyTime: Result reflects everything written so far, can
// be called between writes, and does not change what later writes give.
func TestUsageResultAnyTime(t *testing.T) {
	body := anthropicMessagesStream(`{"output_tokens":15}`)
	start := strings.Index(body, `"output_tokens":1}`) + len(`"output_tokens":1}`)
	delta := strings.Index(body, "event: message_delta")
	deltaUsageEnd := strings.Index(body[delta:], `"output_tokens":15}`) + delta + len(`"output_tokens":15}`)
	r := NewUsageReader(sse, "")
	defer r.Release()
	for i := range len(body) {
		r.Write([]byte{body[i]})
		u, st := r.Result()
		n := i + 1
		switch {
		case n < start: // message_start's usage object is not whole yet
			if st != NotReported {
				t.Fatalf("after %d bytes: %+v, %v; want NotReported", n, u, st)
			}
		case n >= start && n < deltaUsageEnd:
			if want := (Usage{InputTokens: 25, OutputTokens: 1, CacheReadInputTokens: 1500, Partial: true}); st != Found || u != want {
				t.Fatalf("after %d bytes: %+v, %v; want %+v", n, u, st, want)
			}
		case n >= deltaUsageEnd:
			// Counted as soon as the usage object is whole, before the event ends.
			if want := (Usage{InputTokens: 25, OutputTokens: 15, CacheReadInputTokens: 1500}); st != Found || u != want {
				t.Fatalf("after %d bytes: %+v, %v; want %+v", n, u, st, want)
			}
		}
	}
}

// TestUsageContentTypes: text/event-stream in any case and with
// parameters selects the stream reading.
func TestUsageContentTypes(t *testing.T) {
	body := "data: {\"usage\":{\"prompt_tokens\":5}}\n\n"
	for ct, want := range map[string]Status{
		"text/event-stream":                 Found,
		"Text/Event-Stream; charset=utf-8":  Found,
		" text/event-stream ;charset=utf-8": Found,
		"application/json":                  NotReported,
		"":                                  NotReported,
	} {
		if _, st := readBody(ct, "", body); st != want {
			t.Errorf("%q: %v, want %v", ct, st, want)
		}
	}
}

// TestUsageReaderReuse: a released reader comes back clean.
func TestUsageReaderReuse(t *testing.T) {
	for range 3 {
		if _, st := readBody("application/json", "", `{"usage":{"prompt_tokens":-1}}`); st != Invalid {
			t.Fatalf("%v", st)
		}
		if u, st := readBody(sse, "", "data: {\"usage\":{\"prompt_tokens\":5}}\n\n"); st != Found || u.InputTokens != 5 {
			t.Fatalf("%+v %v", u, st)
		}
		if _, st := readBody("application/json", "", `{}`); st != NotReported {
			t.Fatalf("%v", st)
		}
	}
}

func TestParseCount(t *testing.T) {
	for in, want := range map[string]int64{
		"0": 0, "-0": 0, "0.0": 0, "0e7": 0, "1": 1, "10": 10, "100": 100, "1.0": 1, "1.50e1": 15,
		"12345678901234.5e2": 1234567890123450, "9007199254740991": MaxTokenCount, "9007199254740991.000": MaxTokenCount,
		"900719925474099.1e1": MaxTokenCount, "1e15": 1e15, "10e14": 1e15, "0.00001e5": 1, "100e-2": 1,
		"-1": -1, "1.5": -1, "0.1": -1, "1e-1": -1, "9007199254740992": -1, "1e16": -1, "-1e2": -1,
		"1e+2": 100, "1E02": 100, "123456789012345678901234567890e-20": -1, "100000000000000000000e-10": 1e10,
	} {
		got, ok := parseCount([]byte(in))
		if !ok {
			got = -1
		}
		if got != want {
			t.Errorf("parseCount(%s) = %d, %v; want %d", in, got, ok, want)
		}
	}
}

// TestUsageReaderAllocs: an identity body costs no allocation per write.
func TestUsageReaderAllocs(t *testing.T) {
	json := []byte(openAIChatJSON)
	stream := []byte(openAIChatStream(true))
	r := NewUsageReader("application/json", "")
	r.Write(json) // warm the capture buffer and the decoder
	r.Result()
	allocs := testing.AllocsPerRun(100, func() {
		r.Reset("application/json", "")
		for i := 0; i < len(json); i += 64 {
			r.Write(json[i:min(i+64, len(json))])
		}
		if _, st := r.Result(); st != Found {
			t.Fatal(st)
		}
		r.Reset(sse, "")
		for i := 0; i < len(stream); i += 64 {
			r.Write(stream[i:min(i+64, len(stream))])
		}
		if _, st := r.Result(); st != Found {
			t.Fatal(st)
		}
	})
	if allocs != 0 {
		t.Errorf("%v allocations per body, want 0", allocs)
	}
}

// TestIsIdentity: the Content-Encoding lists a UsageChunkFilter may read.
func TestIsIdentity(t *testing.T) {
	for list, want := range map[string]bool{
		"": true, "identity": true, " Identity , identity": true,
		"gzip": false, "identity, gzip": false, "br": false, "compress": false, "gzip, gzip": false,
	} {
		if got := IsIdentity(list); got != want {
			t.Errorf("IsIdentity(%q) = %v, want %v", list, got, want)
		}
	}
}

// wantReadAs checks what told says of body once a UsageReader has read
// it, whole and split in two at each of splits, and gzipped.
func wantReadAs(t *testing.T, name, contentType, body string, splits []int, want bool, told func(*UsageReader) bool) {
	t.Helper()
	for _, split := range splits {
		chunks := []string{body}
		if split > 0 && split < len(body) {
			chunks = []string{body[:split], body[split:]}
		}
		r := NewUsageReader(contentType, "")
		for _, c := range chunks {
			r.Write([]byte(c))
		}
		r.Result()
		if got := told(r); got != want {
			t.Errorf("%s split at %d: %v, want %v", name, split, got, want)
		}
		r.Release()
	}
	enc, _ := compress(t, "gzip", false, body)
	r := NewUsageReader(contentType, "gzip")
	r.Write(enc)
	r.Result()
	if got := told(r); got != want {
		t.Errorf("%s, gzip: %v, want %v", name, got, want)
	}
	r.Release()
}

// TestLoadOnly: Ollama's answer to /api/generate without a prompt or
// /api/chat without messages, which loads (or unloads) the model and runs
// nothing, is told apart from an answer of a model that ran, however it
// is written or encoded and split at any byte.
func TestLoadOnly(t *testing.T) {
	const generateLoad = `{"model":"llama3.2","created_at":"2026-12-03T05:00:00.000000000Z","response":"","done":true,"done_reason":"load"}`
	const chatLoad = `{"model":"llama3.2","created_at":"2026-12-03T05:00:00.000000000Z","message":{"role":"assistant","content":""},"done_reason":"load","done":true}`
	for _, tc := range []struct {
		name, contentType, body string
		want                    bool
	}{
		{"generate_load", "application/json; charset=utf-8", generateLoad, true},
		{"chat_load", "application/json; charset=utf-8", chatLoad, true},
		{"unload", "application/json", `{"model":"llama3.2","response":"","done":true,"done_reason":"unload"}`, true},
		{"escaped", "application/json", `{"d\u006fne_reason":"lo\u0061d"}`, true},
		{"ran", "application/json", ollamaChatJSON, false},
		{"stop", "application/json", `{"done":true,"done_reason":"stop","prompt_eval_count":3,"eval_count":4}`, false},
		// The last of two, as JSON parsers read them.
		{"load_then_stop", "application/json", `{"done_reason":"load","done_reason":"stop"}`, false},
		{"stop_then_load", "application/json", `{"done_reason":"stop","done_reason":"load"}`, true},
		{"nested", "application/json", `{"message":{"done_reason":"load"}}`, false},
		{"in_a_string", "application/json", `{"response":"\"done_reason\":\"load\""}`, false},
		{"not_a_string", "application/json", `{"done_reason":["load"]}`, false},
		{"loading", "application/json", `{"done_reason":"loading"}`, false},
		{"ndjson", "application/x-ndjson", generateLoad + "\n", false},
		{"event_stream", sse, "data: " + generateLoad + "\n\n", false},
		// A JSON array is no answer of Ollama's, whole or cut inside an
		// element.
		{"array", "application/json", "[" + generateLoad + "]", false},
		{"array_cut", "application/json", "[" + generateLoad[:len(generateLoad)-1], false},
	} {
		wantReadAs(t, tc.name, tc.contentType, tc.body, []int{0, 1, 5, 90}, tc.want, (*UsageReader).LoadOnly)
	}
}

// TestOpenedWithError: an event stream whose first event with data is an
// error object, as Anthropic sends an overload after its 200, opened with
// an error; one whose error comes after another event, or whose first
// event is not an error, did not; a JSON body never does.
func TestOpenedWithError(t *testing.T) {
	const overloaded = `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`
	const start = `{"type":"message_start","message":{"id":"m","usage":{"input_tokens":12,"output_tokens":1}}}`
	for _, tc := range []struct {
		name, contentType, body string
		want                    bool
	}{
		{"anthropic_overloaded", sse, "event: error\ndata: " + overloaded + "\n\n", true},
		{"cut_before_the_blank_line", sse, "event: error\ndata: " + overloaded, true},
		{"after_comments_and_a_bom", sse, "\xef\xbb\xbf: keep-alive\r\n\r\nevent: error\r\ndata: " + overloaded + "\r\n\r\n", true},
		{"openai_chunk", sse, "data: {\"error\":{\"message\":\"The server had an error\",\"type\":\"server_error\"}}\n\n", true},
		{"after_message_start", sse, "event: message_start\ndata: " + start + "\n\nevent: error\ndata: " + overloaded + "\n\n", false},
		{"message_start", sse, "event: message_start\ndata: " + start + "\n\n", false},
		{"nested_error", sse, "data: {\"type\":\"x\",\"data\":{\"error\":1}}\n\n", false},
		// OpenRouter's chunks carry "error": null when all is well.
		{"error_null_with_content", sse, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"error\":null," +
			"\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n", false},
		{"error_false", sse, "data: {\"error\":false,\"choices\":[]}\n\n", false},
		{"error_string", sse, "data: {\"error\":\"x\"}\n\n", false},
		{"error_object_after_null_members", sse, "data: {\"id\":null,\"error\" : {\"message\":\"x\"}}\n\n", true},
		{"empty", sse, "", false},
		{"json_body", "application/json", overloaded, false},
	} {
		wantReadAs(t, tc.name, tc.contentType, tc.body, []int{0, 1, 7, 20}, tc.want, (*UsageReader).OpenedWithError)
	}
}

// TestErrorObject: a JSON body whose top-level object has an "error"
// member is the provider's error object, however it is written or
// encoded, and split at any byte; a nested "error", a proxy's page and an
// event stream are not.
func TestErrorObject(t *testing.T) {
	for _, tc := range []struct {
		name, contentType, body string
		want                    bool
	}{
		{"openai", "application/json", `{"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}}`, true},
		{"anthropic", "application/json", `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`, true},
		{"escaped_name", "application/json", ` {"\u0065rror":"x"}`, true},
		{"after_other_members", "application/json", `{"id":"x","usage":null,"error":null}`, true},
		{"nested", "application/json", `{"data":{"error":{"message":"x"}}}`, false},
		{"in_a_string", "application/json", `{"message":"\"error\":1"}`, false},
		// Gemini's streamGenerateContent without alt=sse answers its
		// error as the array's one element: the first element is read, as
		// the first line of newline-delimited JSON is, whole or cut.
		{"gemini_array", "application/json", "[{\n  \"error\": {\n    \"code\": 503,\n    \"message\": \"The model is overloaded. " +
			"Please try again later.\",\n    \"status\": \"UNAVAILABLE\"\n  }\n}\n]", true},
		{"gemini_array_cut", "application/json", `[{"error":{"code":503,"status":"UNAVAILABLE"`, true},
		{"array", "application/json", ` [{"error":1}]`, true},
		{"array_error_after_a_chunk", "application/json", "[" + geminiJSON + `,{"error":{"code":500}}]`, false},
		{"array_error_after_a_chunk_cut", "application/json", "[" + geminiJSON + `,{"error":{"code":500}`, false},
		{"array_not_of_objects", "application/json", `["x",{"error":1}]`, false},
		{"nested_array", "application/json", `[[{"error":1}]]`, false},
		{"envoy", "text/plain", "upstream connect error or disconnect/reset before headers. reset reason: connection termination", false},
		{"nginx", "text/html", "<html><head><title>502 Bad Gateway</title></head></html>", false},
		{"event_stream", sse, "data: {\"error\":{\"message\":\"x\"}}\n\n", false},
		// Mistral's and vLLM's error shape: "object":"error", no "error"
		// member (a 422 to a stream_options member, a prompt over the
		// context); they used to keep their estimate.
		{"mistral", "application/json", `{"object":"error","message":{"detail":[{"type":"extra_forbidden","loc":["body","stream_options",` +
			`"include_usage"],"msg":"Extra inputs are not permitted","input":true}]},"type":"invalid_request_error","param":null,"code":null}`, true},
		{"vllm", "application/json", `{"object":"error","message":"This model's maximum context length is 8192 tokens. However, you requested ` +
			`9000 tokens.","type":"BadRequestError","param":null,"code":400}`, true},
		{"object_error_escaped", "application/json", `{"type":"x","object":"\u0065rror"}`, true},
		{"object_other", "application/json", `{"object":"chat.completion","choices":[]}`, false},
		{"object_error_nested", "application/json", `{"data":{"object":"error"}}`, false},
		{"object_error_in_a_string", "application/json", `{"message":"\"object\":\"error\""}`, false},
		{"object_not_a_string", "application/json", `{"object":["error"]}`, false},
		{"object_error_member_name", "application/json", `{"object":"x","error_x":"error"}`, false},
	} {
		wantReadAs(t, tc.name, tc.contentType, tc.body, []int{0, 1, 3, 9}, tc.want, (*UsageReader).ErrorObject)
	}
}
