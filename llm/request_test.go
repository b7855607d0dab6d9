package llm

import (
	"errors"
	"strings"
	"testing"
)

// ap is the Approx count of one text: ⌈bytes/4⌉.
func ap(s string) int64 { return (int64(len(s)) + 3) / 4 }

// Texts that are raw JSON values in the bodies below.
const (
	openAITools = `[{"type":"function","function":{"name":"get_weather","description":"Current weather in a city",` +
		`"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]`
	anthropicTools = `[{"name":"get_weather","description":"Current weather in a city",` +
		`"input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}]`
	prettyTools = "[\n  {\n    \"name\": \"f\",\n    \"parameters\": {}\n  }\n]"
	legacyFuncs = `[{"name":"get_weather","parameters":{"type":"object","properties":{}}}]`
	respFormat  = `{"type":"json_schema","json_schema":{"name":"answer","schema":{"type":"object",` +
		`"properties":{"answer":{"type":"string"}},"required":["answer"]}}}`
	textFormat = `{"type":"json_schema","name":"answer","schema":{"type":"object","properties":{}}}`
	toolInput  = `{"city":"Paris"}`
	// Anthropic's JSONOutputFormat.
	jsonSchemaFormat = `{"type":"json_schema","schema":{"type":"object","properties":{"answer":{"type":"string"}}}}`
	mcpTools         = `[{"name":"lookup","description":"Looks a word up in the glossary.","input_schema":{"type":"object"}}]`
	mcpError         = `{"type":"http_error","code":500,"message":"boom"}`
	// An Anthropic tool_addition's tool, and a tool_removal's.
	toolAddition  = `{"type":"tool_definition","definition":{"name":"lookup","description":"Looks a word up.","input_schema":{"type":"object"}}}`
	toolReference = `{"type":"tool_reference","name":"old"}`
	// Bedrock Converse's toolConfig.
	bedrockTools = `{"tools":[{"toolSpec":{"name":"f","description":"Weather","inputSchema":{"json":{"type":"object"}}}}]}`
)

// TestParseRequestApprox: exact estimates under Approx, ⌈bytes/4⌉ per
// text summed, + 85 per media part, on every request shape, and the
// bodies that are invalid. prompt is PromptTokens, budget MaxTokens.
func TestParseRequestApprox(t *testing.T) {
	for _, tc := range []struct {
		name           string
		body           string
		prompt, budget int64 // prompt -1: invalid body
	}{
		// OpenAI chat. 14, 23, 15 and 7 bytes: 4 + 6 + 4 + 2.
		{"chat_strings", `{"model":"gpt-4o","messages":[` +
			`{"role":"system","content":"You are terse."},` +
			`{"role":"user","content":"What is a token bucket?"},` +
			`{"role":"assistant","content":"A rate limiter."},` +
			`{"role":"user","content":"Thanks!"}],"max_tokens":100}`, 16, 100},
		// 22 bytes: 6, + 85 for the image.
		{"text_and_image_url", `{"messages":[{"role":"user","content":[` +
			`{"type":"text","text":"What is in this image?"},` +
			`{"type":"image_url","image_url":{"url":"https://example.com/cat.png","detail":"high"}}]}],"max_tokens":50}`, 6 + 85, 50},
		// 8 bytes: 2, + 3 × 85.
		{"two_images_and_audio", `{"messages":[{"role":"user","content":[` +
			`{"type":"text","text":"Compare."},` +
			`{"type":"image_url","image_url":{"url":"https://example.com/a.png"}},` +
			`{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}},` +
			`{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}}]}],"max_completion_tokens":10}`, 2 + 3*85, 10},
		{"file_part", `{"messages":[{"role":"user","content":[{"type":"file","file":{"file_id":"file-1"}}]}]}`, 85, -1},
		{"unknown_part_type", `{"messages":[{"role":"user","content":[{"type":"hologram","text":"abcd"}]}]}`, 1 + 85, -1},
		{"untyped_text_part", `{"messages":[{"content":[{"text":"abcd"}]}]}`, 1, -1},
		{"untyped_part_without_text", `{"messages":[{"content":[{"image_url":{"url":"x"}}]}]}`, 85, -1},
		{"part_members_in_any_order", `{"messages":[{"content":[{"text":"abcdefgh","type":"text"}],"role":"user"}]}`, 2, -1},
		{"refusal_part", `{"messages":[{"role":"assistant","content":[{"type":"refusal","refusal":"I can't."}]}]}`, 2, -1},
		{"message_name", `{"messages":[{"role":"user","name":"alice","content":"Hi!"}]}`, 2 + 1, -1},
		{"missing_max_tokens", `{"messages":[{"role":"user","content":"Hi!"}]}`, 1, -1},
		{"null_max_tokens", `{"messages":[{"role":"user","content":"Hi!"}],"max_tokens":null}`, 1, -1},
		{"largest_budget_of_three", `{"messages":[{"role":"user","content":"Hi!"}],` +
			`"max_tokens":999,"max_output_tokens":7,"max_completion_tokens":300}`, 1, 999},
		{"max_tokens_over_max_output_tokens", `{"input":"Hi!","max_output_tokens":7,"max_tokens":20}`, 1, 20},
		{"budget_zero", `{"prompt":"abcd","max_tokens":0}`, 1, 0},
		// The Realtime API's unlimited budget sets none.
		{"inf_max_output_tokens", `{"type":"realtime","instructions":"abcd","max_output_tokens":"inf"}`, 1, -1},
		{"budget_at_max_cost", `{"max_tokens":9007199254740991}`, 0, MaxCost},

		// OpenAI tools, structured output, tool calls and tool results:
		// the tool definitions and schemas count as raw JSON text.
		{"openai_tools", `{"messages":[{"role":"user","content":"Weather in Paris?"}],"tools":` + openAITools + `}`,
			5 + ap(openAITools), -1},
		{"openai_legacy_functions", `{"messages":[],"functions":` + legacyFuncs + `}`, ap(legacyFuncs), -1},
		{"openai_response_format", `{"messages":[{"role":"user","content":"abcd"}],"response_format":` + respFormat + `}`,
			1 + ap(respFormat), -1},
		{"response_format_json_object", `{"response_format":{"type":"json_object"}}`, ap(`{"type":"json_object"}`), -1},
		{"pretty_printed_tools_count_whitespace", "{\"tools\": " + prettyTools + "}", ap(prettyTools), -1},
		{"null_tools", `{"tools":null,"response_format":null}`, 0, -1},
		// Assistant tool call: content null; name "get_weather" (11: 3),
		// arguments {"city":"Paris"} (16: 4); the tool result "15 °C"
		// (6 bytes: 2); then a tool result as text parts (5: 2).
		{"openai_tool_call_and_result", `{"messages":[` +
			`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",` +
			`"function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},` +
			`{"role":"tool","tool_call_id":"call_1","content":"15 °C"},` +
			`{"role":"tool","tool_call_id":"call_2","content":[{"type":"text","text":"sunny"}]}],"max_tokens":1}`, 3 + 4 + 2 + 2, 1},
		// Legacy function_call of an assistant message: name 1, arguments 1.
		{"openai_legacy_function_call", `{"messages":[{"role":"assistant","content":null,` +
			`"function_call":{"name":"f","arguments":"{}"}},{"role":"function","name":"f","content":"ok"}]}`, 1 + 1 + 1 + 1, -1},
		// Old estimator test: a null content and a tool message "42".
		{"tool_call_with_null_content", `{"messages":[` +
			`{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},` +
			`{"role":"tool","tool_call_id":"c1","content":"42"}],"max_tokens":1}`, 3, 1},

		// Anthropic messages. 17 + 5 bytes: 5 + 2.
		{"anthropic_system_string", `{"model":"claude","max_tokens":1000,"system":"You are a pirate.",` +
			`"messages":[{"role":"user","content":"Hello"}]}`, 5 + 2, 1000},
		// 17, 14 and 12 bytes: 5 + 4 + 3, + 85 for the image.
		{"anthropic_system_blocks_and_image", `{"model":"claude","max_tokens":1000,"system":[` +
			`{"type":"text","text":"You are a pirate."},` +
			`{"type":"text","text":"Speak briefly.","cache_control":{"type":"ephemeral"}}],` +
			`"messages":[{"role":"user","content":[` +
			`{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}},` +
			`{"type":"text","text":"Describe it."}]}]}`, 5 + 4 + 3 + 85, 1000},
		{"anthropic_tools", `{"max_tokens":10,"tools":` + anthropicTools + `,"messages":[{"role":"user","content":"abcd"}]}`,
			ap(anthropicTools) + 1, 10},
		// tool_use: a text (8: 2), name (3), input as JSON text (4); then
		// tool_result as a string (10: 3), and as blocks: text (3) and an
		// image (85).
		{"anthropic_tool_use_and_result", `{"max_tokens":10,"messages":[` +
			`{"role":"assistant","content":[{"type":"text","text":"Checking"},` +
			`{"type":"tool_use","id":"toolu_1","name":"get_weather","input":` + toolInput + `}]},` +
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"15 degrees"}]},` +
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_2","content":[` +
			`{"type":"text","text":"15 degrees"},{"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}]}]}`,
			2 + 3 + ap(toolInput) + 3 + 3 + 85, 10},
		{"anthropic_thinking", `{"messages":[{"role":"assistant","content":[` +
			`{"type":"thinking","thinking":"Let me see.","signature":"abc"}]}]}`, 3, -1},
		// A document is its text when its source is plain text (data:
		// 11 bytes, 3) or content (a string, 1; blocks: a text, 2, and an
		// image, 85), whatever the order of the source's members (the data
		// before the type, escapes decoded: 6 bytes, 2); a base64, url or
		// file source is a media part, its data not read.
		{"anthropic_document_text_source", `{"messages":[{"role":"user","content":[` +
			`{"type":"document","source":{"type":"text","media_type":"text/plain","data":"a long text"}}]}]}`, 3, -1},
		{"anthropic_document_data_before_type", `{"messages":[{"role":"user","content":[` +
			`{"source":{"data":"h\u00e9llo","media_type":"text/plain","type":"text"},"type":"document","title":"t"}]}]}`, 2 + 1, -1},
		// A document's title and context reach the model (8 and 16 bytes: 2
		// + 4), beside its PDF's 85; its citations setting counts nothing.
		{"anthropic_document_title_and_context", `{"messages":[{"role":"user","content":[` +
			`{"type":"document","title":"Q3 notes","context":"Internal, draft.","citations":{"enabled":true},` +
			`"source":{"type":"base64","media_type":"application/pdf","data":"JVBERi0xLjQK"}}]}]}`, 2 + 4 + 85, -1},
		// A search result is text: its source, title and content blocks
		// (21, 9 and 23 bytes: 6 + 3 + 6), which the model reads and
		// cites; no media part.
		{"anthropic_search_result", `{"messages":[{"role":"user","content":[{"type":"search_result",` +
			`"source":"https://example.com/a","title":"A buckets","content":[{"type":"text","text":"A token bucket refills."}]}]}]}`, 6 + 3 + 6, -1},
		// Mistral's conversation inputs (a string or entries) and TGI's
		// generate inputs are what the model reads.
		{"mistral_conversation_inputs", `{"model":"mistral-medium-latest","inputs":[{"role":"user","content":"abcd"},` +
			`{"type":"function.result","tool_call_id":"c1","result":"efgh"},{"type":"message.output","role":"assistant","content":"ijkl"}]}`, 1 + 1 + 1, -1},
		{"tgi_generate_inputs", `{"inputs":"abcdefgh","parameters":{"max_new_tokens":20}}`, 2, 20},
		// Agent session events, no media part each: a user message's
		// text, an outcome's description and rubric (its JSON text, 32
		// bytes: 8), a confirmation's result and message, a tool result.
		// Vertex AI's :predict instances: a text embedding's content and
		// title, a string; an object of no known member is a media part.
		{"vertex_predict_instances", `{"instances":[{"task_type":"RETRIEVAL_DOCUMENT","title":"abcd","content":"abcdefgh"},"abcd",{"image":{}}]}`, 1 + 2 + 1 + 85, -1},
		{"anthropic_session_events", `{"events":[{"type":"user.message","content":[{"type":"text","text":"abcdefgh"}]},` +
			`{"type":"user.define_outcome","description":"abcd","rubric":{"type":"text","content":"abcd"}},` +
			`{"type":"user.tool_confirmation","result":"deny","tool_use_id":"t","deny_message":"abcd"},` +
			`{"type":"user.custom_tool_result","custom_tool_use_id":"t","content":[{"type":"text","text":"abcd"}]},` +
			`{"type":"user.interrupt"}]}`, 2 + 1 + 8 + 1 + 1 + 1, -1},
		{"anthropic_session_initial_events", `{"agent":"agent_1","environment_id":"env_1",` +
			`"initial_events":[{"type":"user.message","content":[{"type":"text","text":"abcd"}]}]}`, 1, -1},
		// An input message's messages, a tool result's error.
		{"openai_agent_session_events", `{"events":[{"type":"agent.session.input.message","input":[{"role":"user","content":"abcd"}]},` +
			`{"type":"agent.session.input.tool_result","call_id":"c","turn_id":"t","success":false,"error":"abcd"},` +
			`{"type":"agent.session.input.cancel"}]}`, 1 + 1, -1},
		// Any other array input is its JSON text (32 bytes: 8), not items
		// (an object of unknown members would be one media part, 85,
		// whatever it holds): a tool call's input, and an input message
		// whose type comes after it.
		{"tool_input_array", `{"messages":[{"role":"assistant","content":[{"type":"tool_use","input":[{"x":"abcdefghijklmnop"}]}]}]}`, 7, -1},
		{"session_input_type_after", `{"events":[{"input":[{"x":"abcdefghijklmnop"}],"type":"agent.session.input.message"}]}`, 7, -1},
		// Gemini's generateContent (Google AI and Vertex AI, as LiteLLM's
		// /gemini and /vertex_ai pass-throughs send it): contents and the
		// system instruction (camelCase or snake_case, as Google's JSON
		// reads both) are what the model reads: texts (16 + 8 + 4 bytes:
		// 4 + 2 + 1), a function call's name and args (2 + ap of the
		// args), a function response's name and response, code and its
		// result (4 + 4 bytes: 1 + 1); an inline image or a file is one
		// media part.
		{"gemini_contents", `{"systemInstruction":{"parts":[{"text":"You are a cat. "}]},` +
			`"contents":[{"role":"user","parts":[{"text":"abcdefgh"},{"inlineData":{"mimeType":"image/png","data":"iVBORw0KGgo="}}]},` +
			`{"role":"model","parts":[{"functionCall":{"name":"f","args":` + toolInput + `}},{"executableCode":{"language":"PYTHON","code":"x=1;"}}]},` +
			`{"role":"user","parts":[{"functionResponse":{"name":"f","response":{"t":15}}},{"codeExecutionResult":{"outcome":"OUTCOME_OK","output":"1234"}},` +
			`{"fileData":{"mimeType":"application/pdf","fileUri":"gs://b/a.pdf"}},{"text":"abcd"}]}]}`,
			4 + 2 + 85 + 1 + ap(toolInput) + 1 + 1 + ap(`{"t":15}`) + 1 + 85 + 1, -1},
		// A rerank (Cohere's, vLLM's /rerank): its query (8 bytes: 2) and
		// documents, strings (4,000 bytes: 1,000 each) or objects (their
		// JSON text), which it used to skip. A chat's documents (Cohere's,
		// vLLM's) are in its prompt too.
		{"rerank", `{"model":"rerank-v3.5","query":"abcdefgh","top_n":1,"documents":["` + strings.Repeat("abcd", 1000) + `","` +
			strings.Repeat("abcd", 1000) + `",{"text":"abcd"}]}`, 2 + 1000 + 1000 + ap(`{"text":"abcd"}`), -1},
		{"chat_documents", `{"messages":[{"role":"user","content":"abcd"}],"documents":[{"title":"T","snippet":"` +
			strings.Repeat("abcd", 100) + `"}]}`, 1 + ap(`{"title":"T","snippet":"`+strings.Repeat("abcd", 100)+`"}`), -1},
		// Bedrock Converse (LiteLLM's /bedrock pass-through): system and
		// message texts (8 + 4 + 4 bytes: 2 + 1 + 1), a tool use's name and
		// input (1 + ap), a tool result's text and JSON (4,000 bytes:
		// 1,000; ap: it was one media part of 85),
		// reasoning text (4: 1), the tool definitions of toolConfig; an
		// image is one media part. Its budget is inferenceConfig.maxTokens.
		{"bedrock_converse", `{"system":[{"text":"abcdefgh"}],"inferenceConfig":{"maxTokens":300},"toolConfig":` + bedrockTools + `,` +
			`"messages":[{"role":"user","content":[{"text":"abcd"},{"image":{"format":"png","source":{"bytes":"iVBORw0KGgo="}}}]},` +
			`{"role":"assistant","content":[{"reasoningContent":{"reasoningText":{"text":"hmm.","signature":"s"}}},` +
			`{"toolUse":{"toolUseId":"t1","name":"f","input":` + toolInput + `}}]},` +
			`{"role":"user","content":[{"toolResult":{"toolUseId":"t1","content":[{"text":"` + strings.Repeat("abcd", 1000) + `"},{"json":{"t":15}}]}}]}]}`,
			2 + ap(bedrockTools) + 1 + 85 + 1 + 1 + ap(toolInput) + 1000 + ap(`{"t":15}`), 300},
		// Ollama's generate: its prompt and system (4 + 8 bytes: 1 + 2), the
		// token ids of its context (5), and 85 per image, base64, however
		// long; a chat message's images too.
		{"ollama_generate", `{"model":"llama3.2","prompt":"abcd","system":"abcdefgh","context":[1,2,3,4,5],` +
			`"images":["iVBORw0KGgo=","` + strings.Repeat("iVBO", 1000) + `"]}`, 1 + 2 + 5 + 2*85, -1},
		{"ollama_chat_images", `{"model":"llava","messages":[{"role":"user","content":"abcd","images":["` +
			strings.Repeat("iVBO", 1000) + `"]}]}`, 1 + 85, -1},
		{"context_in_another_case", `{"Context":[1,2]}`, -1, 0},
		{"images_in_another_case", `{"IMAGES":[]}`, -1, 0},
		{"gemini_snake_case", `{"system_instruction":{"parts":[{"text":"abcdefgh"}]},"contents":[{"parts":[{"text":"abcd"},` +
			`{"function_call":{"name":"f","args":{}}},{"function_response":{"name":"f","response":"ok"}},{"inline_data":{"data":"AAAA"}}]}]}`,
			2 + 1 + 1 + ap(`{}`) + 1 + 1 + 85, -1},
		// Anthropic's structured output schema (output_config.format, the
		// beta's output_format) counts as JSON text, as OpenAI's
		// response_format; output_config's effort counts nothing.
		{"anthropic_output_config_format", `{"messages":[{"role":"user","content":"abcd"}],"max_tokens":50,` +
			`"output_config":{"effort":"high","format":` + jsonSchemaFormat + `}}`, 1 + ap(jsonSchemaFormat), 50},
		{"anthropic_beta_output_format", `{"messages":[{"role":"user","content":"abcd"}],"output_format":` + jsonSchemaFormat + `}`,
			1 + ap(jsonSchemaFormat), -1},
		{"output_config_in_another_case", `{"Output_Config":{}}`, -1, 0},
		{"inputs_in_another_case", `{"Inputs":"abcd"}`, -1, 0},
		// An Anthropic web fetch result, which the client sends back: its
		// document is a PDF, one media part, however long its base64 (it
		// used to count as JSON text: 1,000 tokens here), beside its title
		// (7 bytes: 2); or plain text, its text (8 bytes: 2).
		{"anthropic_web_fetch_pdf", `{"messages":[{"role":"assistant","content":[{"type":"web_fetch_tool_result","tool_use_id":"srvtoolu_1",` +
			`"content":{"type":"web_fetch_result","url":"https://example.com/a.pdf","retrieved_at":"2026-11-30T10:00:00Z",` +
			`"content":{"type":"document","title":"A paper","source":{"type":"base64","media_type":"application/pdf","data":"` +
			strings.Repeat("JVBE", 1000) + `"}}}}]}]}`, 85 + 2, -1},
		{"anthropic_web_fetch_text", `{"messages":[{"role":"assistant","content":[{"type":"web_fetch_tool_result","tool_use_id":"srvtoolu_1",` +
			`"content":{"type":"web_fetch_result","url":"https://example.com/a",` +
			`"content":{"type":"document","source":{"type":"text","media_type":"text/plain","data":"abcdefgh"}}}}]}]}`, 2, -1},
		{"anthropic_web_fetch_error", `{"messages":[{"role":"assistant","content":[{"type":"web_fetch_tool_result","tool_use_id":"srvtoolu_1",` +
			`"content":{"type":"web_fetch_tool_result_error","error_code":"url_not_accessible"}}]}]}`, 85, -1},
		// Any other content object counts as its JSON text, as does a
		// server tool result's whose type comes after it: the providers
		// take none, and an upstream that does may read all its members.
		{"tool_result_content_object", `{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1",` +
			`"content":{"note":"abcdefgh"}}]}]}`, ap(`{"note":"abcdefgh"}`), -1},
		{"responses_message_content_object", `{"input":[{"type":"message","role":"user","content":{"type":"text","data":"abcdefgh"}}]}`,
			ap(`{"type":"text","data":"abcdefgh"}`), -1},
		{"web_fetch_result_type_last", `{"messages":[{"role":"assistant","content":[{"tool_use_id":"srvtoolu_1",` +
			`"content":{"note":"abcdefgh"},"type":"web_fetch_tool_result"}]}]}`, ap(`{"note":"abcdefgh"}`), -1},
		// Code execution and text editor results: their output, an edit's
		// lines (4 + 4 bytes), an error's message (12 bytes: 3), the view
		// of a file (8 bytes: 2); an output file is one media part.
		{"anthropic_code_execution_results", `{"messages":[{"role":"assistant","content":[` +
			`{"type":"bash_code_execution_tool_result","tool_use_id":"srvtoolu_1","content":{"type":"bash_code_execution_result",` +
			`"stdout":"abcd","stderr":"ef","return_code":0,"content":[{"type":"bash_code_execution_output","file_id":"file_1"}]}},` +
			`{"type":"text_editor_code_execution_tool_result","tool_use_id":"srvtoolu_2","content":` +
			`{"type":"text_editor_code_execution_str_replace_result","lines":["abcd","efgh"],"new_lines":2,"new_start":1,"old_lines":1,"old_start":1}},` +
			`{"type":"text_editor_code_execution_tool_result","tool_use_id":"srvtoolu_3","content":` +
			`{"type":"text_editor_code_execution_tool_result_error","error_code":"unavailable","error_message":"out of space"}},` +
			`{"type":"text_editor_code_execution_tool_result","tool_use_id":"srvtoolu_4","content":` +
			`{"type":"text_editor_code_execution_view_result","content":"abcdefgh","file_type":"text","num_lines":1}}]}]}`,
			1 + 1 + 85 + 1 + 1 + 3 + 2, -1},
		// A tool added mid-conversation (a system message's or a
		// compaction's tool_changes) is a definition the model reads: its
		// JSON text, as the request's own tools; a removal, its reference.
		// The compaction block stays one part of 85 beside its content (1).
		{"anthropic_tool_changes", `{"messages":[{"role":"system","content":[{"type":"tool_addition","tool":` + toolAddition + `}]},` +
			`{"role":"assistant","content":[{"type":"compaction","content":"abcd","tool_changes":[` +
			`{"type":"tool_addition","tool":` + toolAddition + `},{"type":"tool_removal","tool":` + toolReference + `}]}]}]}`,
			ap(toolAddition) + 85 + 1 + ap(toolAddition) + ap(toolReference), -1},
		{"anthropic_document_content_string", `{"messages":[{"role":"user","content":[` +
			`{"type":"document","source":{"type":"content","content":"abcd"}}]}]}`, 1, -1},
		{"anthropic_document_content_blocks", `{"messages":[{"role":"user","content":[` +
			`{"type":"document","source":{"type":"content","content":[{"type":"text","text":"abcdefgh"},` +
			`{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}}]}}]}]}`, 2 + 85, -1},
		{"anthropic_document_pdf", `{"messages":[{"role":"user","content":[` +
			`{"type":"document","source":{"type":"base64","media_type":"application/pdf","data":"JVBERi0xLjQKJcOkw7zDtsOfCjIgMCBvYmoK"}},` +
			`{"type":"document","source":{"data":"JVBERi0xLjQKJcOkw7zDtsOfCjIgMCBvYmoK","type":"base64"}},` +
			`{"type":"document","source":{"type":"url","url":"https://example.com/a.pdf"}},` +
			`{"type":"document","source":{"type":"file","file_id":"file_1"}},` +
			`{"type":"document","source":{"data":"abcd"}}]}]}`, 5 * 85, -1},
		// Two sources, text and base64: the text, and the media part.
		{"anthropic_document_duplicate_sources", `{"messages":[{"role":"user","content":[{"type":"document",` +
			`"source":{"type":"text","data":"abcd"},"source":{"type":"base64","data":"JVBERi0xLjQK"}}]}]}`, 1 + 85, -1},

		// Responses API. "Write a haiku about rate limits." is 32 bytes.
		{"responses_input_string", `{"model":"gpt-4.1","input":"Write a haiku about rate limits.","max_output_tokens":64}`, 8, 64},
		// 13 + 19 bytes: 4 + 5, and an input_image.
		{"responses_input_messages", `{"model":"gpt-4.1","input":[` +
			`{"role":"developer","content":"Answer in one"},` +
			`{"type":"message","role":"user","content":[{"type":"input_text","text":"What is this image?"},` +
			`{"type":"input_image","image_url":"https://example.com/x.png"}]}],"max_output_tokens":64}`, 4 + 5 + 85, 64},
		// instructions (16: 4); a function_call item: name 1, arguments
		// {"a":1} (7: 2); its output "result" (6: 2); output_text (5: 2).
		{"responses_instructions_and_items", `{"instructions":"Be very concise.","input":[` +
			`{"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\":1}"},` +
			`{"type":"function_call_output","call_id":"c1","output":"result"},` +
			`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Done."}]}]}`, 4 + 1 + 2 + 2 + 2, -1},
		// A reasoning item given back: its summary and its content (4 and
		// 8 bytes: 1 + 2), reasoning_text parts being text, not media; its
		// encrypted_content is not read.
		{"responses_reasoning_item", `{"input":[{"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"abcd"}],` +
			`"content":[{"type":"reasoning_text","text":"abcdefgh"}],"encrypted_content":"gAAAAABo"}]}`, 1 + 2, -1},
		// A custom tool call's input is a string: one text, its escapes
		// decoded (30 bytes: 8), not its JSON text (34: 9); name 5 bytes
		// (2), output 2 (1). In chat, the call's custom object is read as
		// a function's is, and the call is no media part.
		{"responses_custom_tool_call", `{"input":[{"type":"custom_tool_call","call_id":"c8","name":"apply",` +
			`"input":"*** Begin Patch\n*** End Patch\n"},{"type":"custom_tool_call_output","call_id":"c8","output":"ok"}]}`, 2 + 8 + 1, -1},
		{"chat_custom_tool_call", `{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"call_9","type":"custom",` +
			`"custom":{"name":"apply","input":"*** Begin Patch\n*** End Patch\n"}}]},{"role":"tool","tool_call_id":"call_9","content":"ok"}]}`,
			2 + 8 + 1, -1},
		// Built-in tool calls given back as input: a code_interpreter_call's
		// code (12 bytes: 3) and outputs, its logs (2: 1) and an image
		// (85); a file_search_call's queries (12: 3) and its results' text
		// (23: 6), not their file ids, names, scores nor attributes.
		{"responses_code_interpreter_call", `{"input":[{"type":"code_interpreter_call","id":"ci_1","container_id":"cntr_1",` +
			`"status":"completed","code":"print(1 + 1)","outputs":[{"type":"logs","logs":"2\n"},{"type":"image","url":"https://x/p.png"}]},` +
			`{"type":"code_interpreter_call","id":"ci_2","container_id":"cntr_1","status":"failed","code":null,"outputs":null}]}`, 3 + 1 + 85, -1},
		{"responses_file_search_call", `{"input":[{"type":"file_search_call","id":"fs_1","status":"completed","queries":["token bucket"],` +
			`"results":[{"file_id":"file-1","filename":"a.md","score":0.9,"text":"A token bucket refills.","attributes":{"k":"not read"}},` +
			`{"file_id":"file-2"}]},{"type":"file_search_call","id":"fs_2","status":"searching","queries":[],"results":null}]}`, 3 + 6, -1},
		// A computer_call_output's screenshot is one image part, its data
		// URL or file id unread (as an input_image's).
		{"responses_computer_call_output", `{"input":[{"type":"computer_call_output","call_id":"call_1",` +
			`"output":{"type":"computer_screenshot","image_url":"data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA"},` +
			`"acknowledged_safety_checks":[{"id":"sc_1","code":"malicious_instructions","message":"Check the page."}]},` +
			`{"type":"computer_call_output","call_id":"call_2","output":{"file_id":"file-1","type":"computer_screenshot"}}]}`, 2 * 85, -1},
		// The shell tool: a shell_call's commands (6 and 10 bytes: 2 + 3),
		// its output's stdout and stderr (8, 0, 8 and 12: 2 + 0 + 2 + 3),
		// not their outcomes; no media part for the items nor the output
		// chunks.
		{"responses_shell_call", `{"input":[{"type":"shell_call","call_id":"c1","status":"completed",` +
			`"action":{"commands":["ls -la","cat go.mod"],"timeout_ms":1000,"max_output_length":null}},` +
			`{"type":"shell_call_output","call_id":"c1","max_output_length":null,"output":[` +
			`{"stdout":"total 8\n","stderr":"","outcome":{"type":"exit","exit_code":0}},` +
			`{"stdout":"module x","stderr":"no such file","outcome":{"type":"timeout"}}]}]}`, 2 + 3 + 2 + 2 + 3, -1},
		// The local shell tool: its command (4 and 2 bytes: 1 + 1), not its
		// environment, and its output (3: 1).
		{"responses_local_shell_call", `{"input":[{"type":"local_shell_call","call_id":"c2","status":"completed",` +
			`"action":{"type":"exec","command":["echo","hi"],"env":{"A":"not read"}}},` +
			`{"type":"local_shell_call_output","id":"c2","output":"hi\n"}]}`, 1 + 1 + 1, -1},
		// apply_patch: the operation's diff (18 bytes: 5), not its path,
		// and the output (2: 1).
		{"responses_apply_patch_call", `{"input":[{"type":"apply_patch_call","call_id":"c3","status":"completed",` +
			`"operation":{"type":"update_file","path":"a.go","diff":"@@ -1 +1 @@\n-a\n+b\n"}},` +
			`{"type":"apply_patch_call_output","call_id":"c3","status":"completed","output":"ok"}]}`, 5 + 1, -1},
		// An MCP call is a tool call: its name, arguments and output (6, 2
		// and 5 bytes: 2 + 1 + 2), no media part. A computer_call's action
		// has no text: the call stays one part of 85.
		// An MCP approval is no media part; a web search call's query (12
		// bytes: 3) reaches the model; the call itself stays one part of 85
		// (its results are not in the request).
		{"responses_mcp_approval_and_web_search", `{"input":[{"type":"mcp_approval_response","approval_request_id":"a1","approve":true},` +
			`{"type":"web_search_call","id":"ws_1","status":"completed","action":{"type":"search","query":"token bucket"}}]}`, 3 + 85, -1},
		{"responses_mcp_and_computer_call", `{"input":[{"type":"mcp_call","id":"m1","server_label":"s",` +
			`"name":"lookup","arguments":"{}","output":"found"},` +
			`{"type":"computer_call","call_id":"c4","status":"completed","pending_safety_checks":[],` +
			`"action":{"type":"click","button":"left","x":1,"y":2}}]}`, 2 + 1 + 2 + 85, -1},
		// A computer_call's batched actions (computer_use): a type
		// action's text (12 bytes: 3) counts, as in its action; the call
		// stays one part of 85, its actions none.
		{"responses_computer_call_batched_actions", `{"input":[{"type":"computer_call","id":"cu_1","call_id":"c5",` +
			`"status":"completed","pending_safety_checks":[],"actions":[{"type":"click","button":"left","x":1,"y":2},` +
			`{"type":"type","text":"hello world!"},{"type":"keypress","keys":["ENTER"]}]}]}`, 85 + 3, -1},
		// Programmatic tool calling: a program's code (8 bytes: 2) and a
		// program_output's result (2 and 8: 1 + 2, read before its type
		// too), no media parts; an image_generation_call's result is its
		// image, base64, not read: 85 each, whatever the order.
		{"responses_program_and_output", `{"input":[{"type":"program","id":"p1","call_id":"c6","code":"print(2)","fingerprint":"fp"},` +
			`{"type":"program_output","id":"po1","call_id":"c6","result":"2\n","status":"completed"},` +
			`{"result":"abcdefgh","type":"program_output","id":"po2","call_id":"c7","status":"incomplete"},` +
			`{"type":"image_generation_call","id":"ig_1","status":"completed","result":"iVBORw0KGgoAAAANSUhEUgAA"},` +
			`{"result":"iVBORw0KGgoAAAANSUhEUgAA","id":"ig_2","status":"completed","type":"image_generation_call"}]}`, 2 + 1 + 2 + 2*85, -1},
		// Client text of MCP items and a web search's find: an approval's
		// reason (16 bytes: 4); a failed call's name, arguments and error
		// object (2 + 1 + its JSON text); a listing's tools and error (2
		// and 11: 1 + 3); a find_in_page action's pattern (11: 3), beside
		// the web search call's 85.
		{"responses_mcp_errors_reason_and_find_pattern", `{"input":[` +
			`{"type":"mcp_approval_response","approval_request_id":"a2","approve":false,"reason":"Not on weekends."},` +
			`{"type":"mcp_call","id":"m2","server_label":"s","name":"lookup","arguments":"{}","status":"failed","error":` + mcpError + `},` +
			`{"type":"mcp_list_tools","id":"l2","server_label":"s","tools":[],"error":"unreachable"},` +
			`{"type":"web_search_call","id":"ws_2","status":"completed","action":{"type":"find_in_page","pattern":"refill rate",` +
			`"url":"https://example.com/a"}}]}`, 4 + 2 + 1 + ap(mcpError) + 1 + 3 + 85 + 3, -1},
		// An mcp_list_tools item's tools are definitions the model reads:
		// their JSON text, as the request's own tools, not one media part.
		{"responses_mcp_list_tools", `{"input":[{"type":"mcp_list_tools","id":"l1","server_label":"s","tools":` + mcpTools + `}]}`, ap(mcpTools), -1},
		{"responses_text_format", `{"input":"abcd","text":{"verbosity":"low","format":` + textFormat + `}}`, 1 + ap(textFormat), -1},
		{"responses_text_not_an_object", `{"input":"abcd","text":"ignored"}`, 1, -1},

		// Legacy completions. "Say this is a test" is 18 bytes.
		{"legacy_prompt_string", `{"model":"gpt-3.5-turbo-instruct","prompt":"Say this is a test","max_tokens":7}`, 5, 7},
		{"legacy_prompt_array", `{"prompt":["Say this","is a test!"],"max_tokens":7}`, 2 + 3, 7},
		{"legacy_prompt_token_ids", `{"prompt":[1212,318,257,1332],"suffix":"abcdef"}`, 4 + 2, -1},

		// Embeddings: strings, token ids, arrays of token ids.
		{"embeddings_string", `{"model":"text-embedding-3-small","input":"The food was delicious"}`, 6, -1},
		{"embeddings_strings", `{"input":["abcd","abcde",""]}`, 1 + 2 + 0, -1},
		{"embeddings_token_ids", `{"input":[9906,1917,0,-1,2.5]}`, 5, -1},
		{"embeddings_token_id_arrays", `{"input":[[1,2,3],[4],[]]}`, 4, -1},

		// Texts are UTF-8 bytes, escapes decoded: 10 CJK characters are 30
		// bytes (8), 👋🌍🚀✨ 15 bytes (4); h\u00e9llo \"w\" is 10 bytes.
		{"cjk_bytes_not_runes", `{"messages":[{"role":"user","content":"日本語のテキストです"},` +
			`{"role":"user","content":"👋🌍🚀✨"}],"max_tokens":0}`, 8 + 4, 0},
		{"json_escapes_decoded", `{"messages":[{"role":"user","content":"h\u00e9llo \"w\""}],"max_tokens":0}`, 3, 0},
		{"surrogate_pair_escape", `{"prompt":"\ud83d\ude80"}`, 1, -1},
		{"lone_surrogate_is_fffd", `{"prompt":"ab\ud800"}`, 2, -1}, // 2 + 3 bytes
		{"invalid_utf8_counted", "{\"prompt\":\"abc\xff\xfe\"}", 2, -1},
		{"four_bytes_one_token", `{"prompt":"abcd","max_tokens":0}`, 1, 0},
		{"five_bytes_two_tokens", `{"prompt":"abcde","max_tokens":0}`, 2, 0},
		// Each text rounds up on its own: 3 × ⌈1/4⌉.
		{"rounding_per_text", `{"messages":[{"content":"a"},{"content":"b"},{"content":"c"}],"max_tokens":0}`, 3, 0},
		{"empty_strings", `{"messages":[{"content":""}],"prompt":""}`, 0, -1},
		{"nothing", `{"messages":[],"max_tokens":0}`, 0, 0},
		{"empty_object", `{}`, 0, -1},
		{"null_messages_and_elements", `{"messages":null,"system":null}`, 0, -1},
		{"null_message", `{"messages":[null,{"content":"abcd"}]}`, 1, -1},
		{"whitespace_around", " \r\n\t{\"prompt\":\"abcd\",\"max_tokens\":3}\n", 1, 3},
		{"unexpected_content_types_count_as_json", `{"messages":[{"content":{"a":1}},{"content":12345}],"prompt":true}`,
			ap(`{"a":1}`) + ap("12345") + ap("true"), -1},
		{"unknown_members_ignored", `{"metadata":{"user":"a long string that is not sent"},"temperature":0.2,"tool_choice":"auto"}`, 0, -1},

		// Names are matched exactly; in a part, another case is another
		// member (a top-level member in another case is invalid: see
		// TestParseRequestAmbiguous).
		{"mixed_case_part_names_ignored", `{"messages":[{"Content":"abcd","content":"ab"}]}`, 1, -1},
		{"unknown_name_starting_like_a_read_one", `{"metadata":{},"seed":1,"top_p":1,"parallel_tool_calls":true}`, 0, -1},
		{"escaped_name_matches", `{"max\u005ftokens":42,"m\u0065ssages":[{"content":"abcd"}]}`, 1, 42},

		// Duplicates: every copy of text counts; the largest budget.
		{"duplicate_budget_largest_first", `{"max_tokens":1000,"max_tokens":1}`, 0, 1000},
		{"duplicate_budget_largest_last", `{"max_tokens":1,"max_tokens":1000}`, 0, 1000},
		{"duplicate_messages_both_count", `{"messages":[{"content":"abcd"}],"messages":[{"content":"abcdefgh"}]}`, 1 + 2, -1},
		{"duplicate_content_both_count", `{"messages":[{"content":"abcd","content":"abcdefgh"}]}`, 1 + 2, -1},
		{"duplicate_text_both_count", `{"messages":[{"content":[{"type":"text","text":"abcd","text":"abcd"}]}]}`, 2, -1},
		{"duplicate_type_media_wins", `{"messages":[{"content":[{"type":"image_url","type":"text","text":"abcd"}]}]}`, 1 + 85, -1},
		{"duplicate_system_prompt_input", `{"system":"abcd","system":"abcd","prompt":"abcd","input":"abcd","input":["abcd"]}`, 5, -1},

		// Invalid bodies.
		{"not_json", `hello`, -1, 0},
		{"empty_body", ``, -1, 0},
		{"only_whitespace", " \n", -1, 0},
		{"truncated_json", `{"messages":[`, -1, 0},
		{"trailing_garbage", `{"max_tokens":1} x`, -1, 0},
		{"two_objects", `{} {}`, -1, 0},
		{"json_array", `[{"messages":[]}]`, -1, 0},
		{"json_string", `"hello"`, -1, 0},
		{"json_null", `null`, -1, 0},
		{"json_number", `42`, -1, 0},
		{"trailing_comma", `{"prompt":"a",}`, -1, 0},
		{"single_quotes", `{'prompt':'a'}`, -1, 0},
		{"nan", `{"temperature":NaN}`, -1, 0},
		{"negative_fractional_budget", `{"max_tokens":-1.5}`, -1, 0},
		{"negative_exponent_budget", `{"max_tokens":-1e3}`, -1, 0},
		{"negative_n", `{"n":-1}`, -1, 0},
		{"negative_best_of", `{"best_of":-2}`, -1, 0},
		{"fractional_budget", `{"max_tokens":1.5}`, -1, 0},
		{"integral_float_budget", `{"max_tokens":1.0}`, -1, 0},
		{"exponent_budget", `{"max_tokens":1e3}`, -1, 0},
		{"string_budget", `{"max_tokens":"5"}`, -1, 0},
		{"bool_budget", `{"max_completion_tokens":true}`, -1, 0},
		{"object_budget", `{"max_output_tokens":{}}`, -1, 0},
		{"inf_max_tokens", `{"max_tokens":"inf"}`, -1, 0},
		{"other_string_max_output_tokens", `{"max_output_tokens":"Inf"}`, -1, 0},
		{"escaped_inf_max_output_tokens", `{"max_output_tokens":"\u0069nf"}`, -1, 0},
		{"budget_above_max_cost", `{"max_tokens":9007199254740992}`, -1, 0},
		{"budget_far_above_max_cost", `{"max_tokens":100000000000000000000000}`, -1, 0},
		{"invalid_duplicate_budget", `{"max_tokens":5,"max_tokens":-5.5}`, -1, 0},
		{"messages_not_an_array", `{"messages":"hi"}`, -1, 0},
		{"message_not_an_object", `{"messages":["hi"]}`, -1, 0},
		{"control_character_in_string", "{\"prompt\":\"a\x01b\"}", -1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := ParseRequest([]byte(tc.body), nil)
			if tc.prompt < 0 {
				if !errors.Is(err, ErrInvalidBody) {
					t.Fatalf("ParseRequest = %+v, %v; want ErrInvalidBody", req, err)
				}
				return
			}
			if err != nil || req.PromptTokens != tc.prompt || req.MaxTokens != tc.budget {
				t.Fatalf("ParseRequest = prompt %d, budget %d, %v; want %d, %d", req.PromptTokens, req.MaxTokens, err, tc.prompt, tc.budget)
			}
		})
	}
}

// TestParseRequestBPE: exact counts under the tiktoken encodings, found by
// running them once; "hello world" is 2 tokens in both, as published.
func TestParseRequestBPE(t *testing.T) {
	for _, tc := range []struct {
		name, body    string
		o200k, cl100k int64
	}{
		{"hello_world", `{"prompt":"hello world"}`, 2, 2},
		{"sentence", `{"messages":[{"role":"user","content":"The quick brown fox jumps over the lazy dog."}]}`, 10, 10},
		{"cjk", `{"messages":[{"role":"user","content":"日本語のテキストです"}]}`, 7, 9},
		// Each text on its own: 2 + 2, and the escape decoded (é).
		{"two_texts_and_escape", `{"system":"hello world","prompt":"h\u00e9llo world"}`, 2 + 3, 2 + 4},
		// The schema's raw JSON text, and an image's 85.
		{"json_text_and_image", `{"response_format":{"type":"object","properties":{"city":{"type":"string"}}},` +
			`"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, 14 + 85, 14 + 85},
		{"special_tokens_as_text", `{"prompt":"<|endoftext|>"}`, 7, 7},
		{"token_ids_one_each", `{"input":[[1,2,3],[4]]}`, 4, 4},
		{"code_interpreter_call_code", `{"input":[{"type":"code_interpreter_call","code":"hello world"}]}`, 2, 2},
		// A plain-text document's data, read before its type.
		{"document_text_source", `{"messages":[{"role":"user","content":[{"type":"document",` +
			`"source":{"data":"hello world","type":"text","media_type":"text/plain"}}]}]}`, 2, 2},
	} {
		for _, enc := range []struct {
			name string
			want int64
		}{{O200kBase, tc.o200k}, {Cl100kBase, tc.cl100k}} {
			t.Run(tc.name+"/"+enc.name, func(t *testing.T) {
				tok, err := ParseTokenizer(enc.name)
				if err != nil {
					t.Fatal(err)
				}
				req, err := ParseRequest([]byte(tc.body), tok)
				if err != nil || req.PromptTokens != enc.want {
					t.Fatalf("PromptTokens = %d, %v; want %d", req.PromptTokens, err, enc.want)
				}
			})
		}
	}
}

func TestParseRequestFields(t *testing.T) {
	for _, tc := range []struct {
		name, body           string
		model                string
		stream, includeUsage bool
	}{
		{"plain", `{"model":"gpt-4o","messages":[]}`, "gpt-4o", false, false},
		{"escaped_model", `{"model":"gpt-4o\u002dmini"}`, "gpt-4o-mini", false, false},
		{"non_string_model", `{"model":5}`, "", false, false},
		{"invalid_utf8_model", "{\"model\":\"gpt\x85\xff-4o\"}", "gpt\ufffd\ufffd-4o", false, false},
		{"null_model", `{"model":null}`, "", false, false},
		{"stream", `{"stream":true}`, "", true, false},
		{"stream_false", `{"stream":false}`, "", false, false},
		{"stream_null", `{"stream":null}`, "", false, false},
		{"include_usage", `{"stream":true,"stream_options":{"include_usage":true}}`, "", true, true},
		{"include_usage_false", `{"stream":true,"stream_options":{"include_usage":false}}`, "", true, false},
		{"last_include_usage_wins", `{"stream":true,"stream_options":{"include_usage":true,"include_usage":false}}`, "", true, false},
		{"last_stream_options_wins", `{"stream":true,"stream_options":{"include_usage":true},"stream_options":{}}`, "", true, false},
		{"last_stream_options_wins_true", `{"stream":true,"stream_options":null,"stream_options":{"include_usage":true}}`, "", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := ParseRequest([]byte(tc.body), nil)
			if err != nil || req.Model != tc.model || req.Stream != tc.stream || req.IncludeUsage != tc.includeUsage {
				t.Fatalf("ParseRequest = %+v, %v; want model %q, stream %v, include_usage %v", req, err, tc.model, tc.stream, tc.includeUsage)
			}
		})
	}
}

// TestParseRequestAmbiguous: a body that parsers read differently is
// invalid, so that the provider behind the gateway never reads a model,
// stream or budget the estimate did not. Go's encoding/json (Ollama,
// LocalAI and other Go servers) matches member names to fields in any
// case, Unicode folding included, and keeps the last non-null value;
// Python's json keeps the last value, null included; pydantic's lax mode
// reads "true" and 1 as true. So a top-level member the estimate reads
// (or stream_options' include_usage) spelled in another case, a second
// model or stream, and a stream that is not a boolean are invalid.
func TestParseRequestAmbiguous(t *testing.T) {
	for _, tc := range []struct{ name, body, reason string }{
		{"upper_case_budget", `{"max_tokens":1,"MAX_TOKENS":100000}`, `member "MAX_TOKENS" is "max_tokens" in another case`},
		{"upper_case_budget_first", `{"MAX_TOKENS":100000,"max_tokens":1}`, `member "MAX_TOKENS" is "max_tokens" in another case`},
		{"mixed_case_messages", `{"Messages":[{"content":"abcd"}]}`, `member "Messages" is "messages" in another case`},
		{"mixed_case_model", `{"model":"gpt-4.1-mini","Model":"gpt-4o"}`, `member "Model" is "model" in another case`},
		{"upper_case_events", `{"Events":[{"type":"user.message","content":"abcd"}]}`, `member "Events" is "events" in another case`},
		{"upper_case_n", `{"N":50,"max_tokens":10}`, `member "N" is "n" in another case`},
		{"mixed_case_stream", `{"Stream":true}`, `member "Stream" is "stream" in another case`},
		{"escaped_upper_case", `{"\u004dODEL":"gpt-4o"}`, `member "MODEL" is "model" in another case`},
		// U+017F (long s) folds to 's', U+212A (Kelvin sign) to 'k'.
		{"long_s_stream", `{"ſtream":true}`, `member "ſtream" is "stream" in another case`},
		{"kelvin_max_tokens", `{"max_to\u212aens":100000}`, "member \"max_to\u212aens\" is \"max_tokens\" in another case"},
		{"upper_case_include_usage", `{"stream":true,"stream_options":{"INCLUDE_USAGE":false}}`, `member "INCLUDE_USAGE" is "include_usage" in another case`},
		{"duplicate_model", `{"model":"a","model":"b"}`, "duplicate model member"},
		{"duplicate_model_null", `{"model":"gpt-4o","model":null}`, "duplicate model member"},
		{"duplicate_stream", `{"stream":true,"stream":false}`, "duplicate stream member"},
		{"duplicate_stream_null", `{"stream":true,"stream":null}`, "duplicate stream member"},
		{"stream_string", `{"stream":"true"}`, "stream is not true, false or null"},
		{"stream_number", `{"stream":1}`, "stream is not true, false or null"},
		{"stream_object", `{"stream":{}}`, "stream is not true, false or null"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseRequest([]byte(tc.body), nil)
			if want := "llm: invalid request body: " + tc.reason; err == nil || err.Error() != want || !errors.Is(err, ErrInvalidBody) {
				t.Fatalf("ParseRequest(%s) = %v, want %q", tc.body, err, want)
			}
		})
	}
}

// TestBudget: the budget charged, with the handler's default of 1024.
func TestBudget(t *testing.T) {
	for _, tc := range []struct {
		body       string
		budget     int64
		cost       int64 // with a prompt of "abcd": 1
		maxTokens  int64
		defaultMax int64
	}{
		{`{"prompt":"abcd"}`, 1024, 1025, -1, 1024},
		{`{"prompt":"abcd","max_tokens":null}`, 1024, 1025, -1, 1024},
		{`{"prompt":"abcd","max_tokens":5}`, 5, 6, 5, 1024},
		{`{"prompt":"abcd","max_tokens":0}`, 0, 1, 0, 1024},
		// The provider may read the null (the last one wins) and apply its
		// own default: the larger of 5 and the default.
		{`{"prompt":"abcd","max_tokens":5,"max_tokens":null}`, 1024, 1025, 5, 1024},
		{`{"prompt":"abcd","max_tokens":null,"max_tokens":5}`, 1024, 1025, 5, 1024},
		{`{"prompt":"abcd","max_tokens":5000,"max_tokens":null}`, 5000, 5001, 5000, 1024},
		// Another budget member is a number for sure: no default.
		{`{"prompt":"abcd","max_tokens":5,"max_completion_tokens":null}`, 5, 6, 5, 1024},
		{`{"prompt":"abcd","max_tokens":5,"max_tokens":null,"max_output_tokens":3}`, 5, 6, 5, 1024},
		{`{"prompt":"abcd","max_tokens":9007199254740991}`, MaxCost, MaxCost, MaxCost, 1024},
		// "inf" is null: the default, or the larger of it and a number.
		{`{"prompt":"abcd","max_output_tokens":"inf"}`, 1024, 1025, -1, 1024},
		{`{"prompt":"abcd","max_output_tokens":5,"max_output_tokens":"inf"}`, 1024, 1025, 5, 1024},
		// A negative integer is null too: LM Studio's and llama.cpp's -1,
		// no limit.
		{`{"prompt":"abcd","max_tokens":-1}`, 1024, 1025, -1, 1024},
		{`{"prompt":"abcd","max_tokens":-0}`, 1024, 1025, -1, 1024},
		{`{"prompt":"abcd","max_completion_tokens":-99999999999999999999}`, 1024, 1025, -1, 1024},
		{`{"prompt":"abcd","max_tokens":5,"max_tokens":-1}`, 1024, 1025, 5, 1024},
		// A negative integer is no absence: a server may read it before
		// the other members (llama.cpp reads max_completion_tokens before
		// max_tokens, Ollama max_tokens alone), and run without limit. The
		// larger of the numbers and the default, as with a null duplicate.
		{`{"prompt":"abcd","max_tokens":-1,"max_completion_tokens":5}`, 1024, 1025, 5, 1024},
		{`{"prompt":"abcd","max_tokens":5,"max_completion_tokens":-1}`, 1024, 1025, 5, 1024},
		{`{"prompt":"abcd","max_tokens":5000,"max_completion_tokens":-1}`, 5000, 5001, 5000, 1024},
		{`{"prompt":"abcd","max_tokens":5,"max_output_tokens":"inf"}`, 1024, 1025, 5, 1024},
	} {
		req, err := ParseRequest([]byte(tc.body), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		if req.MaxTokens != tc.maxTokens || req.Budget(tc.defaultMax) != tc.budget || req.Cost(tc.defaultMax) != tc.cost {
			t.Errorf("%s: MaxTokens %d, Budget %d, Cost %d; want %d, %d, %d",
				tc.body, req.MaxTokens, req.Budget(tc.defaultMax), req.Cost(tc.defaultMax), tc.maxTokens, tc.budget, tc.cost)
		}
	}
}

// TestSettingsBudget: the APIs that keep the budget in an object of
// settings (Ollama's options.num_predict, TGI's parameters.max_new_tokens
// and best_of, Gemini's generationConfig.maxOutputTokens and
// candidateCount, Bedrock Converse's inferenceConfig.maxTokens) are
// charged that budget, as their servers read it, not default_max_tokens
// (a TGI call of max_new_tokens 4000 was charged 1024, and its answer
// reports no usage to settle it).
func TestSettingsBudget(t *testing.T) {
	for _, tc := range []struct {
		body      string
		budget    int64 // with default_max_tokens 1024
		maxTokens int64
	}{
		{`{"inputs":"abcd","parameters":{"max_new_tokens":4000}}`, 4000, 4000},
		{`{"inputs":"abcd","parameters":{"max_new_tokens":100,"best_of":3}}`, 300, 100},
		{`{"model":"llama3.2","prompt":"abcd","options":{"temperature":0.1,"num_predict":4000}}`, 4000, 4000},
		{`{"model":"llama3.2","prompt":"abcd","options":{"num_predict":64}}`, 64, 64},
		// Ollama reads 1e3 as 1000 and 100.5 as 100: the estimate rounds up.
		{`{"model":"llama3.2","options":{"num_predict":1e3}}`, 1000, 1000},
		{`{"model":"llama3.2","options":{"num_predict":100.5}}`, 101, 101},
		// -1 (no limit) and -2 (fill the context) set none: the default,
		// even beside a top-level max_tokens that Ollama does not read.
		{`{"model":"llama3.2","options":{"num_predict":-1}}`, 1024, -1},
		{`{"model":"llama3.2","max_tokens":10,"options":{"num_predict":-2}}`, 1024, 10},
		{`{"contents":[],"generationConfig":{"maxOutputTokens":8192,"candidateCount":2}}`, 16384, 8192},
		{`{"contents":[],"generation_config":{"max_output_tokens":"300","candidate_count":"2"}}`, 600, 300},
		{`{"messages":[],"inferenceConfig":{"maxTokens":2000}}`, 2000, 2000},
		// Beside a top-level budget, the larger.
		{`{"max_tokens":10,"generationConfig":{"maxOutputTokens":50}}`, 50, 50},
		{`{"options":{"num_predict":1e300}}`, MaxCost, MaxCost},
		// llama.cpp's server reads a top-level n_predict before
		// max_completion_tokens and max_tokens, on its own /completion
		// and on its OpenAI-compatible routes: -1 is no limit.
		{`{"prompt":"abcd","n_predict":4000}`, 4000, 4000},
		{`{"prompt":"abcd","max_tokens":5,"n_predict":100}`, 100, 100},
		{`{"messages":[],"max_tokens":5,"n_predict":-1}`, 1024, 5},
		{`{"prompt":"abcd","n_predict":128.5}`, 129, 129},
		// What no server reads as a count is not read: the default.
		{`{"options":{"num_predict":"lots"},"parameters":[1],"generationConfig":null}`, 1024, -1},
	} {
		req, err := ParseRequest([]byte(tc.body), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		if got := req.Budget(1024); got != tc.budget || req.MaxTokens != tc.maxTokens {
			t.Errorf("%s: Budget %d, MaxTokens %d; want %d, %d", tc.body, got, req.MaxTokens, tc.budget, tc.maxTokens)
		}
	}
	// Ollama (Go's encoding/json) reads "Options" as options.
	if _, err := ParseRequest([]byte(`{"Options":{"num_predict":4000}}`), nil); !errors.Is(err, ErrInvalidBody) {
		t.Errorf(`"Options": %v; want invalid`, err)
	}
}

// nest returns a body whose messages content nests parts depth levels
// below the top-level object: {"messages":[{"content":[{"content":...
func nest(depth int, leaf string) string {
	// Levels: 1 the object, 2 messages, 3 the message, then 2 per level of
	// content (array, part).
	var b strings.Builder
	b.WriteString(`{"messages":[{"content":`)
	n := 3
	for ; n+2 <= depth; n += 2 {
		b.WriteString(`[{"content":`)
	}
	closes := strings.Repeat("}]", (n-3)/2)
	if n < depth { // one level left: an array
		b.WriteString(`[` + leaf + `]`)
	} else {
		b.WriteString(leaf)
	}
	b.WriteString(closes + `}]}`)
	return b.String()
}

// TestDepthBound: MaxDepth levels are fine, one more is invalid, wherever
// the nesting is: in counted content, in JSON text, in skipped members.
func TestDepthBound(t *testing.T) {
	for _, depth := range []int{MaxDepth - 1, MaxDepth, MaxDepth + 1, 10 * MaxDepth} {
		for name, body := range map[string]string{
			"content": nest(depth, `"abcd"`),
			"tools":   `{"tools":` + strings.Repeat(`[`, depth-1) + strings.Repeat(`]`, depth-1) + `}`,
			"skipped": `{"metadata":` + strings.Repeat(`{"a":`, depth-1) + `1` + strings.Repeat(`}`, depth-1) + `}`,
			"input":   `{"input":` + strings.Repeat(`[`, depth-1) + `1` + strings.Repeat(`]`, depth-1) + `}`,
		} {
			req, err := ParseRequest([]byte(body), nil)
			if depth <= MaxDepth && err != nil {
				t.Errorf("%s at depth %d: %v", name, depth, err)
			}
			if depth > MaxDepth && !errors.Is(err, ErrInvalidBody) {
				t.Errorf("%s at depth %d: %+v, %v; want ErrInvalidBody", name, depth, req, err)
			}
		}
	}
	// The content at depth MaxDepth is counted.
	if req, err := ParseRequest([]byte(nest(MaxDepth, `"abcdefgh"`)), nil); err != nil || req.PromptTokens != 2 {
		t.Errorf("content at depth %d: %d, %v; want 2", MaxDepth, req.PromptTokens, err)
	}
}

// TestDeepNestingAllocs: allocations do not grow with depth. The old
// estimator re-parsed each level, quadratic in depth.
func TestDeepNestingAllocs(t *testing.T) {
	// One parser, not the pool's: the race detector makes sync.Pool drop
	// items at random, which would count as allocations of the parse.
	p := new(parser)
	allocs := func(depth int) float64 {
		body := []byte(nest(depth, `"abcd"`))
		if _, err := p.run(body, approxTokenizer{}); err != nil {
			t.Fatal(err)
		}
		return testing.AllocsPerRun(100, func() { _, _ = p.run(body, approxTokenizer{}) })
	}
	shallow, deep := allocs(5), allocs(MaxDepth)
	if shallow > 4 || deep > 4 {
		t.Errorf("allocations per parse: %.0f at depth 5, %.0f at depth %d; want at most 4", shallow, deep, MaxDepth)
	}
	t.Logf("allocations per parse: %.0f at depth 5, %.0f at depth %d", shallow, deep, MaxDepth)
}

// TestParseRequestLeavesBodyAlone: the body is neither modified nor
// needed after the call.
func TestParseRequestLeavesBodyAlone(t *testing.T) {
	const body = `{"model":"m","messages":[{"content":"h\u00e9llo"}],"tools":[{"a":1}],"max_tokens":3}`
	b := []byte(body)
	req, err := ParseRequest(b, nil)
	if err != nil || string(b) != body {
		t.Fatalf("body after the parse: %q, %v", b, err)
	}
	copy(b, strings.Repeat("x", len(b)))
	if req.Model != "m" {
		t.Errorf("Model %q depends on the body", req.Model)
	}
}

func TestParseTokenizer(t *testing.T) {
	for _, name := range []string{"", Approx, O200kBase, Cl100kBase} {
		tok, err := ParseTokenizer(name)
		if err != nil {
			t.Fatalf("%q: %v", name, err)
		}
		want := name
		if name == "" {
			want = Approx
		}
		if tok.Name() != want {
			t.Errorf("%q: Name %q", name, tok.Name())
		}
	}
	a, _ := ParseTokenizer(O200kBase)
	b, _ := ParseTokenizer(O200kBase)
	if a != b {
		t.Error("o200k_base built twice")
	}
	_, err := ParseTokenizer("O200K_BASE")
	if err == nil || !strings.Contains(err.Error(), `"O200K_BASE"`) || !strings.Contains(err.Error(), "approx, o200k_base or cl100k_base") {
		t.Errorf("unknown name: %v", err)
	}
}

func TestTokenizerCount(t *testing.T) {
	o, _ := ParseTokenizer(O200kBase)
	c, _ := ParseTokenizer(Cl100kBase)
	for _, tc := range []struct {
		text                  string
		approx, o200k, cl100k int64
	}{
		{"", 0, 0, 0},
		{"hello world", 3, 2, 2},
		{"日本語のテキストです", 8, 7, 9},
		{"\xff\xfeabc", 2, 2, 2}, // invalid UTF-8: one U+FFFD for the BPEs
	} {
		if got := (approxTokenizer{}).Count([]byte(tc.text)); got != tc.approx {
			t.Errorf("approx %q = %d, want %d", tc.text, got, tc.approx)
		}
		if got := o.Count([]byte(tc.text)); got != tc.o200k {
			t.Errorf("o200k_base %q = %d, want %d", tc.text, got, tc.o200k)
		}
		if got := c.Count([]byte(tc.text)); got != tc.cl100k {
			t.Errorf("cl100k_base %q = %d, want %d", tc.text, got, tc.cl100k)
		}
	}
}

// TestTokenizerConcurrent: one shared encoder counts right from many
// goroutines at once (run with -race).
func TestTokenizerConcurrent(t *testing.T) {
	o, _ := ParseTokenizer(O200kBase)
	body := []byte(`{"messages":[{"role":"user","content":"The quick brown fox jumps over the lazy dog."}]}`)
	done := make(chan int64)
	for range 8 {
		go func() {
			var n int64
			for range 50 {
				req, _ := ParseRequest(body, o)
				n += req.PromptTokens
			}
			done <- n
		}()
	}
	for range 8 {
		if n := <-done; n != 50*10 {
			t.Errorf("a goroutine counted %d, want %d", n, 50*10)
		}
	}
}

// TestBPECuts: ordinary text, words and indented code included, counts
// exactly as the tokenizer library counts it; runs past the cut lengths
// count the sum of their cut pieces.
func TestBPECuts(t *testing.T) {
	for _, name := range []string{O200kBase, Cl100kBase} {
		tok, _ := ParseTokenizer(name)
		b := tok.(*bpe)
		code := strings.Repeat("func f() {\n\tif x {\n\t\treturn   y // done\n\t}\n}\n\n", 50)
		for _, text := range []string{prose(5000, 3), code, strings.Repeat(" ", maxSpaceRun) + "x" + strings.Repeat("a", maxWordRun-1)} {
			if got, want := b.Count([]byte(text)), b.count(text); got != want {
				t.Errorf("%s: %d tokens, the library counts %d", name, got, want)
			}
		}
		spaces := strings.Repeat(" \n", maxSpaceRun) // two runs of 64 bytes
		if got, want := b.Count([]byte("a"+spaces+"b")), b.count("a"+spaces[:maxSpaceRun])+b.count(spaces[maxSpaceRun:]+"b"); got != want {
			t.Errorf("%s: a long whitespace run counts %d, want %d", name, got, want)
		}
		word := strings.Repeat("x", 2*maxWordRun+1)
		if got, want := b.Count([]byte(word)), 2*b.count(word[:maxWordRun])+b.count("x"); got != want {
			t.Errorf("%s: a long word counts %d, want %d", name, got, want)
		}
	}
}

// TestChoicesMultiplyBudget: "n" and "best_of" ask for several
// completions, each of which may use the whole budget, so the budget is
// multiplied (a body of "n":128 was estimated at one completion and used
// 128).
func TestChoicesMultiplyBudget(t *testing.T) {
	for _, tc := range []struct {
		body       string
		budget     int64
		choices    int64
		defaultMax int64
	}{
		{`{"n":128,"max_tokens":1000}`, 128_000, 128, 1024},
		{`{"n":3}`, 3 * 1024, 3, 1024},
		{`{"best_of":5,"n":2,"max_tokens":10}`, 50, 5, 1024},
		{`{"n":0,"max_tokens":10}`, 10, 1, 1024},
		{`{"n":null,"max_tokens":10}`, 10, 1, 1024},
		{`{"n":9007199254740991,"max_tokens":2}`, MaxCost, MaxCost, 1024},
	} {
		req, err := ParseRequest([]byte(tc.body), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		if got := req.Budget(tc.defaultMax); got != tc.budget || req.Choices != tc.choices {
			t.Errorf("%s: budget %d, choices %d; want %d, %d", tc.body, got, req.Choices, tc.budget, tc.choices)
		}
	}
	if _, err := ParseRequest([]byte(`{"n":"3"}`), nil); err == nil {
		t.Error(`"n":"3" parsed; want invalid`)
	}
}

// TestScreenshotIsOneImage: a computer-use turn gives back a screenshot
// of some 300 KB as a data URL; it counts MediaPartTokens, as the same
// image does as an input_image, not its base64 as text (some 100,000
// tokens, which a tokens limit refused as cost_exceeds_capacity).
func TestScreenshotIsOneImage(t *testing.T) {
	url := "data:image/png;base64," + strings.Repeat("iVBORw0KGgoAAAANSUhEUgAA", 300<<10/24)
	for _, body := range []string{
		`{"model":"computer-use-preview","truncation":"auto","input":[{"type":"computer_call_output","call_id":"call_1",` +
			`"output":{"type":"computer_screenshot","image_url":"` + url + `"}}]}`,
		`{"model":"gpt-4.1","input":[{"role":"user","content":[{"type":"input_image","image_url":"` + url + `"}]}]}`,
	} {
		for _, name := range []string{Approx, O200kBase} {
			tok, _ := ParseTokenizer(name)
			req, err := ParseRequest([]byte(body), tok)
			if err != nil || req.PromptTokens != MediaPartTokens {
				t.Errorf("%s, %.60s...: %d prompt tokens, %v; want %d", name, body, req.PromptTokens, err, MediaPartTokens)
			}
		}
	}
}

// TestPromptsMultiplyBudget: legacy completions' "prompt" may be an array
// of prompts, strings or token id arrays, and n and best_of are "how many
// completions to generate for each prompt": three prompts with "n":2 and
// "max_tokens":100 may use 600 completion tokens. A string, or one array
// of token ids, is one prompt.
func TestPromptsMultiplyBudget(t *testing.T) {
	for _, tc := range []struct {
		body             string
		budget           int64
		prompts, choices int64
	}{
		{`{"prompt":"abcd","max_tokens":100}`, 100, 1, 1},
		{`{"prompt":["a","b","c"],"max_tokens":100}`, 300, 3, 1},
		{`{"prompt":["a","b","c"],"max_tokens":100,"n":2}`, 600, 3, 2},
		{`{"prompt":[[1,2],[3,4],[5,6]],"max_tokens":100,"best_of":2,"n":1}`, 600, 3, 2},
		{`{"prompt":["a","b"]}`, 2 * 1024, 2, 1}, // default_max_tokens
		{`{"prompt":[1212,318,257],"max_tokens":100,"n":2}`, 200, 1, 2},
		{`{"prompt":[],"max_tokens":100}`, 100, 1, 1},
		{`{"prompt":null,"max_tokens":100}`, 100, 1, 1},
		{`{"prompt":{"id":"pmpt_1"},"max_tokens":100}`, 100, 1, 1},
		// Strings and arrays are prompts, other items are not.
		{`{"prompt":["a",["b"],null,{"text":"c"},7,true],"max_tokens":10}`, 20, 2, 1},
		// Of duplicate prompts, the most.
		{`{"prompt":["a","b"],"prompt":"c","max_tokens":10}`, 20, 2, 1},
		{`{"prompt":"c","prompt":["a","b","c","d"],"max_tokens":10}`, 40, 4, 1},
		// Other requests send one prompt.
		{`{"messages":[{"content":["a","b"]}],"input":["a","b","c"],"n":2,"max_tokens":10}`, 20, 1, 2},
		// The product is bounded by MaxCost: 2 × (2^52 − 1) fits, 3 × 2^52
		// and 2 × (2^53 − 1) do not.
		{`{"prompt":["a","b"],"n":4503599627370495,"max_tokens":1}`, MaxCost - 1, 2, 4503599627370495},
		{`{"prompt":["a","b","c"],"n":4503599627370496,"max_tokens":1}`, MaxCost, 3, 4503599627370496},
		{`{"prompt":["a","b"],"best_of":9007199254740991,"max_tokens":9007199254740991}`, MaxCost, 2, MaxCost},
	} {
		req, err := ParseRequest([]byte(tc.body), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		if got := req.Budget(1024); got != tc.budget || req.Prompts != tc.prompts || req.Choices != tc.choices {
			t.Errorf("%s: budget %d, prompts %d, choices %d; want %d, %d, %d",
				tc.body, got, req.Prompts, req.Choices, tc.budget, tc.prompts, tc.choices)
		}
	}
	// The prompts count as before: each text and token id.
	if req, err := ParseRequest([]byte(`{"prompt":["abcd","abcdefgh",[1,2]]}`), nil); err != nil || req.PromptTokens != 1+2+2 {
		t.Errorf("PromptTokens %d, %v; want 5", req.PromptTokens, err)
	}
}

// TestBPEInvalidUTF8CountsEachByte: each invalid byte counts as the
// U+FFFD a provider reads it as (one replacement for a whole run made
// 100,000 invalid bytes one token).
func TestBPEInvalidUTF8CountsEachByte(t *testing.T) {
	tok, err := ParseTokenizer(O200kBase)
	if err != nil {
		t.Fatal(err)
	}
	invalid := tok.Count([]byte(strings.Repeat("\xff", 3000)))
	replaced := tok.Count([]byte(strings.Repeat("\uFFFD", 3000)))
	if invalid != replaced || invalid != 386 {
		t.Errorf("3000 invalid bytes count %d, 3000 U+FFFD %d; want both 386", invalid, replaced)
	}
}

// TestParseBatch: a batch is charged what its batched requests would be
// charged alone (Anthropic's Message Batches, Gemini's inline batches):
// every request's texts, and the sum of their budgets, each times its
// choices; default_max_tokens (1024 here) for one without a budget. A
// batch of 10,000 Messages requests was charged 1024 tokens, whatever
// they held.
func TestParseBatch(t *testing.T) {
	const def = 1024
	// 8 bytes: 2 tokens; 4 bytes: 1.
	a := `{"custom_id":"a","params":{"model":"claude-x","max_tokens":100,"messages":[{"role":"user","content":"abcdefgh"}]}}`
	b := `{"custom_id":"b","params":{"model":"claude-x","max_tokens":50,"system":"abcd","messages":[{"role":"user","content":"abcd"}]}}`
	for _, tc := range []struct {
		name             string
		body             string
		prompt, requests int64
		budget, batch    int64 // Budget(1024), BatchBudget(1024)
		model            string
	}{
		{"anthropic", `{"requests":[` + a + `,` + b + `]}`, 4, 2, 150 + def, 150, "claude-x"},
		{"one_with_no_limit", `{"requests":[` + a + `,{"custom_id":"c","params":{"model":"claude-x","max_tokens":-1,"messages":[{"role":"user","content":"abcd"}]}}]}`, 3, 2, 100 + def + def, 100 + def, "claude-x"},
		{"one_with_no_limit_beside_a_budget", `{"requests":[` + a + `,{"custom_id":"c","params":{"model":"claude-x","max_tokens":5,"max_completion_tokens":-1,"messages":[{"role":"user","content":"abcd"}]}}]}`, 3, 2, 105 + def + def, 105 + def, "claude-x"},
		{"one_without_budget", `{"requests":[` + a + `,{"custom_id":"c","params":{"model":"claude-x","messages":[{"role":"user","content":"abcd"}]}}]}`, 3, 2, 100 + def + def, 100 + def, "claude-x"},
		// The provider may read the null: both are charged, the larger
		// reading's bound.
		{"null_duplicate", `{"requests":[{"params":{"max_tokens":5,"max_tokens":null,"messages":[]}}]}`, 0, 1, 5 + def + def, 5 + def, ""},
		{"choices", `{"requests":[{"params":{"n":3,"max_tokens":10,"prompt":"abcd"}}]}`, 1, 1, 30 + def, 30, ""},
		{"settings_budget", `{"requests":[{"params":{"generationConfig":{"maxOutputTokens":40}}}]}`, 0, 1, 40 + def, 40, ""},
		{"mixed_models", `{"requests":[` + a + `,{"params":{"model":"claude-y","max_tokens":1}}]}`, 2, 2, 101 + def, 101, ""},
		{"escaped_model_same", `{"requests":[` + a + `,{"params":{"model":"claude-\u0078","max_tokens":1}}]}`, 2, 2, 101 + def, 101, "claude-x"},
		{"top_level_model_same", `{"model":"claude-x","requests":[` + a + `]}`, 2, 1, 100 + def, 100, "claude-x"},
		// The top level's model is the one a server reading the body as
		// one request runs: it is the body's.
		{"top_level_model_other", `{"model":"claude-y","requests":[` + a + `]}`, 2, 1, 100 + def, 100, "claude-y"},
		{"top_level_model_mixed_batch", `{"model":"claude-y","requests":[` + a + `,{"params":{"model":"claude-z","max_tokens":1}}]}`, 2, 2, 101 + def, 101, "claude-y"},
		// A budget at the top level is added to the batch's; its default
		// is not (Budget adds it: a server that reads the body as one
		// request may apply it).
		{"top_level_budget", `{"max_tokens":7,"requests":[` + a + `]}`, 2, 1, 107, 107, "claude-x"},
		{"saturates", `{"requests":[{"params":{"max_tokens":9007199254740991}},{"params":{"max_tokens":9007199254740991}}]}`, 0, 2, MaxCost, MaxCost, ""},
		// What is not a request counts as JSON text, or nothing.
		{"item_not_object", `{"requests":["abcd"]}`, 1, 0, def, 0, ""},
		{"params_not_object", `{"requests":[{"params":"abcdefgh"}]}`, 0, 0, def, 0, ""},
		{"requests_not_array", `{"requests":{"a":1}}`, 2, 0, def, 0, ""},
		{"requests_null", `{"requests":null}`, 0, 0, def, 0, ""},
		{"empty", `{"requests":[]}`, 0, 0, def, 0, ""},
		// Only the top level has batched requests.
		{"nested_requests_not_read", `{"requests":[{"params":{"max_tokens":1,"requests":[` + a + `]}}]}`, 0, 1, 1 + def, 1, ""},
		// Gemini's inline batch; its model is in the path.
		{"gemini_inline", `{"batch":{"display_name":"x","input_config":{"requests":{"requests":[` +
			`{"request":{"contents":[{"parts":[{"text":"abcdefgh"}]}],"generationConfig":{"maxOutputTokens":30}},"metadata":{"key":"a"}},` +
			`{"request":{"contents":[{"parts":[{"text":"abcd"}]}]}}]}}}}`, 3, 2, 30 + def + def, 30 + def, ""},
		// Gemini's embedding batch: each request's content (one Content,
		// read as a message is: its parts' text, no media part).
		{"gemini_embed_inline", `{"batch":{"inputConfig":{"requests":{"requests":[` +
			`{"request":{"model":"models/e","content":{"parts":[{"text":"abcdefgh"}]}}},` +
			`{"request":{"model":"models/e","content":"abcd"}}]}}}}`, 3, 2, def + def + def, def + def, "models/e"},
		// A top-level content is read (Gemini's embedContent has one).
		{"top_level_content_read", `{"content":"abcd","requests":[` + a + `]}`, 3, 1, 100 + def, 100, "claude-x"},
		{"gemini_inline_camel_case", `{"batch":{"inputConfig":{"requests":{"requests":[{"request":{"contents":"abcd","generationConfig":{"maxOutputTokens":3}}}]}}}}`, 1, 1, 3 + def, 3, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := ParseRequest([]byte(tc.body), nil)
			if err != nil {
				t.Fatal(err)
			}
			if req.PromptTokens != tc.prompt || req.Requests != tc.requests || req.Budget(def) != tc.budget ||
				req.BatchBudget(def) != tc.batch || req.Model != tc.model {
				t.Errorf("prompt %d, requests %d, budget %d, batch budget %d, model %q; want %d, %d, %d, %d, %q",
					req.PromptTokens, req.Requests, req.Budget(def), req.BatchBudget(def), req.Model,
					tc.prompt, tc.requests, tc.budget, tc.batch, tc.model)
			}
		})
	}
	for _, body := range []string{
		`{"Requests":[]}`, // Go's encoding/json reads it as requests
		`{"requests":[{"params":{"model":"a","model":"b"}}]}`,
		`{"requests":[{"params":{"max_tokens":-1.5}}]}`,
		`{"requests":[{"params":{"MAX_TOKENS":1}}]}`,
		`{"requests":[{"params":{"messages":"abcd"}}]}`,
	} {
		if _, err := ParseRequest([]byte(body), nil); !errors.Is(err, ErrInvalidBody) {
			t.Errorf("%s: %v, want ErrInvalidBody", body, err)
		}
	}
	// A batch allocates nothing more than a body without one: the
	// batched requests' model is compared in the parser's buffer. One
	// parser, not the pool's: the race detector makes sync.Pool drop items
	// at random, which would count as allocations of the parse.
	body := []byte(`{"requests":[` + a + `,` + b + `]}`)
	p := new(parser)
	if _, err := p.run(body, approxTokenizer{}); err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = p.run(body, approxTokenizer{}) }); n != 1 {
		t.Errorf("%v allocations per parse, want 1 (the model)", n)
	}
}

// TestParseBatchModels: MixedModels says when a body names more than one
// model (two batched requests, or one and the top level), whatever Model
// then is; Endpoint is a batch job's endpoint (Mistral's). Mistral's
// inline batch jobs name their requests "body" and may give the model at
// the top level only.
func TestParseBatchModels(t *testing.T) {
	for _, tc := range []struct {
		name, body      string
		model, endpoint string
		mixed           bool
		requests        int64
	}{
		{"one_model", `{"requests":[{"params":{"model":"a","max_tokens":1}},{"params":{"model":"a"}}]}`, "a", "", false, 2},
		{"a_request_without_model", `{"requests":[{"params":{"model":"a","max_tokens":1}},{"params":{}}]}`, "a", "", false, 2},
		{"two_models", `{"requests":[{"params":{"model":"a"}},{"params":{"model":"b"}}]}`, "", "", true, 2},
		{"top_level_and_batch_agree", `{"model":"a","requests":[{"params":{"model":"a"}}]}`, "a", "", false, 1},
		{"top_level_and_batch_differ", `{"model":"b","requests":[{"params":{"model":"a"}}]}`, "b", "", true, 1},
		{"duplicate_params", `{"requests":[{"params":{"model":"a"},"params":{"model":"b"}}]}`, "", "", true, 2},
		// Gemini names a model with and without "models/".
		{"gemini_models_prefix", `{"requests":[{"request":{"model":"models/g"}},{"request":{"model":"g"}}]}`, "models/g", "", false, 2},
		{"gemini_models_prefix_top_level", `{"model":"g","requests":[{"request":{"model":"models/g"}}]}`, "g", "", false, 1},
		{"mistral_job", `{"model":"mistral-small-latest","endpoint":"/v1/chat/completions",` +
			`"requests":[{"custom_id":"0","body":{"max_tokens":100,"messages":[{"role":"user","content":"abcd"}]}}]}`,
			"mistral-small-latest", "/v1/chat/completions", false, 1},
		{"last_endpoint", `{"endpoint":"/v1/chat/completions","endpoint":"/v1/embeddings","requests":[]}`, "", "/v1/embeddings", false, 0},
		{"endpoint_not_a_string", `{"endpoint":1}`, "", "", false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := ParseRequest([]byte(tc.body), nil)
			if err != nil {
				t.Fatal(err)
			}
			if req.Model != tc.model || req.Endpoint != tc.endpoint || req.MixedModels != tc.mixed || req.Requests != tc.requests {
				t.Errorf("model %q, endpoint %q, mixed %v, requests %d; want %q, %q, %v, %d",
					req.Model, req.Endpoint, req.MixedModels, req.Requests, tc.model, tc.endpoint, tc.mixed, tc.requests)
			}
		})
	}
	for _, body := range []string{`{"Batch":{}}`, `{"ENDPOINT":"/v1/embeddings"}`,
		// A batched request's member in another case, which Go's
		// encoding/json (a Go gateway in front of the provider) runs as
		// the request the estimate did not read: a decoy of a cheaper
		// model beside it, or a batch charged one request's default.
		`{"requests":[{"custom_id":"a","params":{"model":"cheap","max_tokens":1}},{"custom_id":"b","Params":{"model":"dear","max_tokens":100000}}]}`,
		`{"model":"m","requests":[{"custom_id":"a","BODY":{"max_tokens":100000}}]}`,
		`{"batch":{"input_config":{"requests":{"requests":[{"Request":{"contents":"abcd"}}]}}}}`,
		`{"batch":{"InputConfig":{"requests":{"requests":[{"request":{"contents":"abcd"}}]}}}}`,
		`{"batch":{"input_config":{"Requests":{"requests":[{"request":{"contents":"abcd"}}]}}}}`,
		`{"batch":{"input_config":{"requests":{"REQUESTS":[{"request":{"contents":"abcd"}}]}}}}`,
	} {
		if _, err := ParseRequest([]byte(body), nil); !errors.Is(err, ErrInvalidBody) {
			t.Errorf("%s: %v, want ErrInvalidBody", body, err)
		}
	}
}

// TestParseBatchEmbedContents: Gemini's batchEmbedContents sends its
// requests as the items themselves ({model, content}): their content
// counts, and they set no budget nor count as batched requests. Their
// texts were not read (1000 tokens of text estimated at 0).
func TestParseBatchEmbedContents(t *testing.T) {
	body := `{"requests":[{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcdefgh"}]}},` +
		`{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcd"}]},"taskType":"RETRIEVAL_DOCUMENT"}]}`
	req, err := ParseRequest([]byte(body), nil)
	if err != nil {
		t.Fatal(err)
	}
	if req.PromptTokens != 3 || req.Requests != 0 || req.Budget(0) != 0 {
		t.Errorf("prompt %d, requests %d, budget %d; want 3, 0, 0", req.PromptTokens, req.Requests, req.Budget(0))
	}
	if _, err := ParseRequest([]byte(`{"requests":[{"Content":"abcd"}]}`), nil); !errors.Is(err, ErrInvalidBody) {
		t.Errorf("an item's Content: %v, want ErrInvalidBody", err)
	}
	// A document's title is embedded with its content.
	body = `{"requests":[{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcd"}]},` +
		`"taskType":"RETRIEVAL_DOCUMENT","title":"abcdefgh"}]}`
	if req, err := ParseRequest([]byte(body), nil); err != nil || req.PromptTokens != 3 {
		t.Errorf("an item with a title: prompt %d, %v; want 3", req.PromptTokens, err)
	}
	if _, err := ParseRequest([]byte(`{"requests":[{"content":"abcd","TITLE":"abcd"}]}`), nil); !errors.Is(err, ErrInvalidBody) {
		t.Errorf("an item's TITLE: %v, want ErrInvalidBody", err)
	}
}
