// Package llm estimates the tokens of an LLM API request body before it is
// sent: OpenAI chat completions, legacy completions, embeddings and the
// Responses API, and Anthropic messages. It knows nothing of HTTP; the
// caller reads the body, calls ParseRequest, charges Request.Cost, and,
// for a streamed request, may send the body WithStreamUsage so that the
// provider reports the real usage at the end of the stream.
//
// # One pass, bounded
//
// ParseRequest reads the body once, token by token, with a streaming JSON
// decoder (github.com/go-json-experiment/json/jsontext) that reads the
// body in place: time and memory are linear in the size of the body,
// whatever its shape. Objects and arrays may nest MaxDepth (128) levels
// deep, the top-level object being level 1; a deeper body is invalid.
// The body must be one JSON object (whitespace around it is fine);
// invalid UTF-8 and lone surrogate escapes in strings are accepted and
// counted.
//
// # Names and duplicates
//
// Member names are matched exactly, after decoding their escapes, as the
// providers' JSON parsers do. But a server behind the gateway may read a
// body otherwise: Go's encoding/json (Ollama, LocalAI and other Go
// servers) matches names in any case, Unicode folding included, and keeps
// the last value that is not null; Python's json keeps the last value;
// pydantic's lax mode reads "true" and 1 as true. So that no server reads
// a model, stream or budget the estimate did not, a body is invalid when
//
//   - a member of the top-level object that the estimate reads (below),
//     or stream_options' include_usage, or the params, request, body or
//     content of a batch's item, or such a member of a batched request,
//     or the input_config (inputConfig) and requests of Gemini's batch,
//     is spelled in another case ("MAX_TOKENS", "Model", "N", "ſtream",
//     "Params");
//   - it has two "model" or two "stream" members;
//   - its "stream" is not true, false or null.
//
// A part's member in another case ("Content") is another member, ignored:
// it only holds text, counted or not, and settlement charges what was
// used. Of other duplicate members the providers keep the last; wherever
// that matters to the estimate, the estimate takes the higher reading
// instead:
//
//   - every copy of a member that holds text counts (two "messages"
//     arrays count both);
//   - of duplicate budget members, the largest number is the budget (and
//     see Request.Budget for a null duplicate);
//   - "stream_options" is the last one, as the provider reads it.
//
// # What is counted
//
// PromptTokens is the sum, over every text listed below, of the tokens of
// that text, plus MediaPartTokens (85) for each media part. The members of
// the top-level object that count are:
//
//	system, prompt, input,     a content value (below): Anthropic system (a
//	inputs, instructions,      string or text blocks), legacy completions
//	suffix                     prompt (a string, strings, token ids) and
//	                           suffix, Responses API input (a string or
//	                           items) and instructions, embeddings input (a
//	                           string, strings, token ids, arrays of ids),
//	                           Mistral's conversation inputs (a string or
//	                           entries) and Hugging Face TGI's generate
//	                           inputs
//	contents                   a content value: Gemini's generateContent
//	                           contents (Google AI, Vertex AI), whose
//	                           entries are parts with "parts"
//	systemInstruction,         Gemini's system instruction: an object is
//	system_instruction         read as a message, anything else as a
//	                           content value
//	content                    Gemini's embedContent content, read as
//	                           systemInstruction is
//	title                      a content value: Gemini's embedContent
//	                           title (taskType RETRIEVAL_DOCUMENT), which
//	                           is embedded with the content
//	instances                  Vertex AI's :predict instances, each one
//	                           prediction (Request.Prompts counts them):
//	                           a string is a text; an object's content,
//	                           title, text, prompt, input and inputs are
//	                           content values, its messages a messages
//	                           array, and its budget members and
//	                           parameters are read as a settings
//	                           object's (a text model deployed on an
//	                           endpoint takes them there); an object
//	                           with none of those texts is one media
//	                           part
//	query                      a content value: a rerank's query (Cohere's,
//	                           vLLM's)
//	documents                  an array's strings are texts and its other
//	                           items their raw JSON text; anything else a
//	                           content value: a rerank's documents, a
//	                           grounded chat's (Cohere's, vLLM's)
//	context                    a content value: Ollama's generate context,
//	                           the token ids of the exchange before, one
//	                           token each
//	images                     MediaPartTokens per item of the array:
//	                           Ollama's images (base64), in a generate
//	                           request or in a chat message
//	messages                   an array of messages (objects or null, else
//	                           the body is invalid), each read as a part
//	                           that never counts MediaPartTokens itself
//	tools, functions,          the raw JSON text of the value: function and
//	response_format,           tool definitions, JSON schemas (Anthropic's
//	output_format, toolConfig  beta structured output format, Bedrock
//	                           Converse's tools)
//	text, output_config        its "format" member, as raw JSON text (the
//	                           Responses API's and Anthropic's structured
//	                           output schema)
//	requests                   a batch (Anthropic's Message Batches,
//	                           Mistral's inline batch jobs): an array
//	                           whose objects' "params" (or "request", or
//	                           "body") objects are each read as a
//	                           request body, their texts counting here and
//	                           their budgets in Request.BatchBudget; an
//	                           item's content and title (Gemini's
//	                           batchEmbedContents, whose items are the
//	                           requests) as at the top level; another
//	                           item is one text when a string, else its
//	                           raw JSON text (null: nothing); a requests
//	                           that is neither an array nor null counts
//	                           as its raw JSON text
//	events, initial_events     a content value: the events sent to an
//	                           agent session (Anthropic's and OpenAI's
//	                           managed agents), each read as a part
//	batch                      Gemini's inline batch: its
//	                           input_config.requests.requests (or
//	                           inputConfig), read as requests is (a
//	                           batched request's "content" and "title", in
//	                           an embedding batch, as at the top level)
//
// A content value is one text when it is a string, its items when it is
// an array, nothing when it is null, and its raw JSON text otherwise. An
// item of such an array is: a string, one text; a number, one token (a
// token id); an array, its items; an object, a part; null, nothing; true
// or false, its raw JSON text.
//
// A part is a message, a content block or part, a tool call or result, or
// a Responses API item. Its members are read in one pass in any order, and
// all those that carry text for the model count, whatever the type:
//
//	text, content, output,     a content value, so nested blocks count (an
//	summary, tool_calls,       OpenAI role "tool" message's content, an
//	outputs, queries,          Anthropic tool_result's content and a
//	commands, command,         compaction block's tool_changes, a Responses
//	tool_changes, lines,       function_call_output's output, an assistant
//	parts                      message's tool_calls, a reasoning item's
//	                           summary and content, a
//	                           code_interpreter_call's outputs, a
//	                           file_search_call's queries, a shell_call's
//	                           commands and a local_shell_call's command,
//	                           an Anthropic text editor edit's lines, a
//	                           Gemini content's parts);
//	                           but an object output is read as a part (a
//	                           Responses computer_call_output's
//	                           screenshot, one image part: its data URL is
//	                           not read), and so is the object content of
//	                           an Anthropic server tool result whose type
//	                           comes first (a web_fetch_result, whose
//	                           document of a PDF is one media part, not its
//	                           base64 as text; a code execution or text
//	                           editor result); any other object content
//	                           counts as its raw JSON text
//	tools, tool                its raw JSON text (an mcp_list_tools item's
//	                           tool definitions, an Anthropic
//	                           tool_addition's tool)
//	input, arguments,          a string is one text, anything else its raw
//	name, refusal,             JSON text: tool call arguments and input (an
//	thinking, code, logs,      Anthropic tool_use's input object, a
//	stdout, stderr, diff,      custom_tool_call's input string), the names
//	title, context, query,     of messages, tools and functions called
//	pattern, reason, error,    (short: they count as any text, which is
//	error_message, args,       never low), a code_interpreter_call's code
//	response, json,            and its logs, a shell_call_output's stdout
//	description, rubric,
//	deny_message
//	                           and stderr (and an Anthropic code execution
//	                           result's), an apply_patch_call's diff, the
//	                           title and context of an Anthropic document
//	                           or search result, a web_search_call
//	                           action's query or find pattern, an
//	                           mcp_approval_response's reason, an
//	                           mcp_call's or mcp_list_tools item's error,
//	                           an Anthropic text editor error's message, a
//	                           Gemini function call's args and function
//	                           response's response, a Bedrock tool
//	                           result's json, an agent session outcome's
//	                           description and rubric, a tool
//	                           confirmation's deny_message; but the array
//	                           input of a part whose type, read before
//	                           it, is agent.session.input.message is a
//	                           content value (the messages of an agent
//	                           session's input message)
//	action, actions,           an object read as a message, so that only
//	operation                  its text counts (a shell_call's or
//	                           local_shell_call's action, an
//	                           apply_patch_call's operation, the text of a
//	                           computer_call's type action); an array, each
//	                           of its objects so (a computer_call's
//	                           batched actions)
//	results                    the "text" of each result object, a content
//	                           value (a file_search_call's results)
//	result                     a string is one text, anything else its raw
//	                           JSON text (a program_output's result); not
//	                           read in an image_generation_call, whose
//	                           result is its image, base64
//	function, function_call,   an object read as a part (OpenAI tool call
//	custom, functionCall,      and legacy function call: name, arguments;
//	functionResponse,          a chat custom tool call: name, input;
//	function_response,         Gemini's function call: name, args, its
//	executableCode,            response: name, response, its code and the
//	executable_code,           code's result: code, output; Bedrock
//	codeExecutionResult,       Converse's tool use: name, input, its tool
//	code_execution_result,     result: content, and reasoning: text)
//	toolUse, toolResult,
//	reasoningContent,
//	reasoningText
//	source                     a string is one text (an Anthropic search
//	                           result's source), anything but an object its
//	                           raw JSON text; an object: the "data" of a
//	                           plain-text source
//	                           ({"type":"text","data":...}) as one text,
//	                           the "content" of a content source
//	                           ({"type":"content","content":...}) as a
//	                           content value (an Anthropic document's text
//	                           or blocks); the data of any other source
//	                           (base64, url, file) counts nothing
//
// role, type and every other member count nothing. A part also counts
// MediaPartTokens when, not being a message, it has a "type" that is not
// a text type (text, input_text, output_text, refusal, summary_text,
// message, reasoning, reasoning_text, thinking, function, function_call,
// function_call_output, custom, custom_tool_call, custom_tool_call_output,
// tool_use, server_tool_use, tool_result, code_interpreter_call, logs,
// file_search_call, computer_call_output, shell_call, shell_call_output,
// local_shell_call, local_shell_call_output, apply_patch_call,
// apply_patch_call_output, mcp_call, mcp_approval_request,
// mcp_approval_response, mcp_list_tools, search_result, program,
// program_output, tool_addition, tool_removal, web_fetch_tool_result,
// web_fetch_result, code_execution_tool_result, code_execution_result,
// bash_code_execution_tool_result, bash_code_execution_result and the
// text_editor_code_execution results and error, and Mistral's
// conversation entries message.input, message.output, function.call and
// function.result, and the agent session events user.message,
// user.interrupt, user.tool_confirmation, user.custom_tool_result,
// user.tool_result, user.define_outcome, system.message and OpenAI's
// agent.session.input.message, agent.session.input.tool_result,
// agent.session.input.cancel,
// agent.session.input.mcp_approval_request_result and
// agent.session.input.computer_use_approval_request_result),
// or has neither a
// type nor any of the members above nor a role; but not when it has a
// "source" and all its sources are plain-text or content sources. So
// image_url, input_image, image, input_audio, file, input_file,
// computer_screenshot, a document of a base64, url or file source (a PDF),
// a web_search_call, a Gemini part of inlineData or fileData and unknown
// types count 85 each,
// whatever their size or detail; a document of plain text or of content
// blocks counts its text (and 85 per image block) instead.
//
// Not counted: the roles and per-message framing tokens the provider adds
// (a few per message), tool_choice, metadata, and the budget itself, which
// is apart (Request.MaxTokens).
//
// # Tokenizers
//
// A text is either a decoded JSON string (escapes decoded: "\u00e9" is the
// two UTF-8 bytes of é) or the raw JSON text of a value, byte for byte as
// in the body, whitespace included. Each text is counted on its own and
// the counts are summed, so a body's estimate is the sum of its parts and
// appending a text never lowers it:
//
//   - Approx (the default): ⌈UTF-8 bytes / 4⌉ per text, so three texts of
//     one byte count 3. Bytes, not characters: CJK text is about one token
//     per character in the real vocabularies, three bytes each.
//   - O200kBase, Cl100kBase: the byte-pair encodings of tiktoken
//     (github.com/tiktoken-go/tokenizer, whose vocabularies are compiled
//     in: nothing is downloaded), special tokens counted as plain text,
//     invalid UTF-8 as U+FFFD. To keep the time linear, a text is cut
//     before tokenizing where a whitespace run passes 64 bytes or a run
//     without whitespace passes 1 KB, which may add a token per cut;
//     ordinary text has no such run. They cost some 100 times the CPU of
//     Approx (see the benchmarks).
//
// # Budget
//
// max_completion_tokens (OpenAI chat), max_tokens (OpenAI legacy and
// Anthropic) and max_output_tokens (Responses API) are one budget:
// Request.MaxTokens is the largest of them. Each must be null (absent) or
// an integer up to MaxCost written without fraction or exponent; a
// negative one (LM Studio's and llama.cpp's -1, no limit) and
// max_output_tokens's string "inf" (the Realtime API's unlimited budget: a
// session's, or a call's that realtime.calls.accept sends) set no budget,
// as null does, and since a server may read that member rather than
// another (llama.cpp's reads max_completion_tokens before max_tokens,
// Ollama's max_tokens alone), the caller's default is then charged even
// beside a number, as with a null duplicate (the larger of the two);
// anything else makes the body invalid. The APIs that keep their budget in
// an object of settings are read there too: Ollama's options.num_predict,
// Hugging Face TGI's parameters.max_new_tokens, Gemini's
// generationConfig.maxOutputTokens (generation_config.max_output_tokens)
// and Bedrock Converse's inferenceConfig.maxTokens, and so is llama.cpp's
// top-level n_predict (which its server reads before the other members),
// each a number, or a string holding one, rounded up (a negative one,
// Ollama's -1 and -2, sets no budget; anything else is not read); TGI's
// parameters.best_of and Gemini's candidateCount are read as n is.
// Request.Budget multiplies it by the completions asked for each prompt
// (n, best_of) and by the number of prompts (a legacy completions prompt
// may be an array of prompts; each of :predict's instances is one), at
// most MaxCost. Of a batch,
// Request.BatchBudget sums its requests' budgets (each times its n and
// prompts, plus the caller's default for each that sets none, has a null
// duplicate or sets no limit) and the top level's budget if it sets one;
// Request.Budget is the top level's Budget plus that sum.
package llm
