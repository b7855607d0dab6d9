package tokenbucket

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestEstimateModelRunsUnderStoredObjects: an OpenAI path under a stored
// object's segment that runs a model is estimated and settled, not free:
// a grader run (fineTuning.alpha.graders.run; a score_model or label_model
// grader samples its model and answers at once) and an eval run
// (evals.runs.create; samples the model over the eval's data, as a batch
// does). Their stored neighbours stay free.
func TestEstimateModelRunsUnderStoredObjects(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const grader = `{"grader":{"type":"score_model","name":"g","model":"o4-mini","input":[{"role":"user","content":"Rate 1-10"}],"sampling_params":{"max_completions_tokens":2000}},"model_sample":"an answer"}`
	const evalRun = `{"name":"r","data_source":{"type":"responses","model":"gpt-4o","input_messages":{"type":"template","template":[{"role":"user","content":"Answer {{item.q}}"}]},"sampling_params":{"max_completion_tokens":500},"source":{"type":"file_id","id":"file-abc"}}}`
	for _, tc := range []struct {
		name, path, body string
		free             bool
	}{
		{"grader_run", "/v1/fine_tuning/alpha/graders/run", grader, false},
		{"eval_run", "/v1/evals/eval_abc/runs", evalRun, false},
		{"grader_validate", "/v1/fine_tuning/alpha/graders/validate", grader, true},
		{"eval", "/v1/evals", `{"name":"e","data_source_config":{"type":"custom","item_schema":{}},"testing_criteria":[]}`, true},
		{"fine_tuning_job", "/v1/fine_tuning/jobs", `{"model":"gpt-4o-mini","training_file":"file-abc"}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
			est, err := e.estimate(httptest.NewRecorder(), req, false)
			if err != nil {
				t.Fatal(err)
			}
			got := est.prompt + est.completion
			if free := got == 0 && est.noInference; free != tc.free {
				t.Errorf("%s: estimate %d, not settled %v; want free %v", tc.path, got, est.noInference, tc.free)
			}
		})
	}
}

// TestEstimateSDKFormUploads: the forms the official SDKs send to upload
// paths that run no model (skills and their versions, both SDKs; OpenAI's
// custom voices, voice consents and content provenance checks; Anthropic's
// organization plugins) are 0 tokens, not 400 invalid_body.
func TestEstimateSDKFormUploads(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const body = "--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"s/SKILL.md\"\r\n\r\n# skill\r\n--b--\r\n"
	for _, p := range []string{
		"/v1/skills", "/v1/skills/skill_abc/versions",
		"/v1/audio/voices", "/v1/audio/voice_consents", "/v1/content_provenance_checks",
		"/v1/organizations/plugins", "/v1/organizations/plugins/plg_abc/versions",
		"/v1/organizations/plugin_marketplaces/validate_archive",
	} {
		req := httptest.NewRequest(http.MethodPost, p, strings.NewReader(body))
		req.Header.Set("Content-Type", "multipart/form-data; boundary=b")
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		if err != nil || est.prompt+est.completion != 0 {
			t.Errorf("%s: estimate %d, %v; want 0 tokens", p, est.prompt+est.completion, err)
		}
	}
	// A form to a path that runs a model is still refused.
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "multipart/form-data; boundary=b")
	if _, err := e.estimate(httptest.NewRecorder(), req, false); !errors.Is(err, errInvalidBody) {
		t.Errorf("form to chat completions: %v, want errInvalidBody", err)
	}
}

// TestEstimateCompletionBudgetBothReadings: a path drops the completion
// budget only when it names embeddings or moderations both as it came and
// cleaned: /v1/chat/completions/../../embeddings is a chat completion to an
// upstream that does not resolve dot segments, as the free rules assume;
// a path with dot segments keeps its budget.
func TestEstimateCompletionBudgetBothReadings(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const body = `{"model":"gpt-4o","messages":[{"role":"user","content":"abcd"}]}`
	for p, want := range map[string]int64{
		"/v1/chat/completions/../../embeddings":  1 + 1024,
		"/v1/chat/completions/../../moderations": 1 + 1024,
		"/v1/embeddings":                         1,
		"/v1/embeddings/":                        1,
		"/v1/x/../embeddings":                    1 + 1024,
		"/v1/embeddings/../chat/completions":     1 + 1024,
	} {
		req := httptest.NewRequest(http.MethodPost, p, strings.NewReader(body))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		if got := est.prompt + est.completion; err != nil || got != want {
			t.Errorf("%s: estimate %d, %v; want %d", p, got, err, want)
		}
	}
}

// TestEstimateModelNamesAndRunsInAnyCase: a segment that names a model (an
// Azure deployment, LiteLLM's /engines/<model> and
// /openai/deployments/<model>, which take the path's model over the body's)
// is no stored object whatever its name, and a run is a run in any case
// or with path parameters (ASP.NET Core and Fiber route case-insensitively,
// Java servlet containers drop ";params").
func TestEstimateModelNamesAndRunsInAnyCase(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const chat = `{"messages":[{"role":"user","content":"abcd"}]}`
	for _, p := range []string{
		"/openai/deployments/evals/chat/completions?api-version=2024-10-21",
		"/openai/deployments/assistants/chat/completions",
		"/engines/threads/chat/completions",
		"/v1/threads/thread_abc/RUNS",
		"/v1/threads/Runs",
		"/v1/threads/thread_abc/runs;v=1",
	} {
		req := httptest.NewRequest(http.MethodPost, p, strings.NewReader(chat))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		if got := est.prompt + est.completion; err != nil || got != 1+1024 || est.noInference {
			t.Errorf("%s: estimate %d, not settled %v, %v; want %d and settled", p, got, est.noInference, err, 1+1024)
		}
	}
}

// TestEstimateFormModelCalls: the SDK's form model calls (a video's
// generation, edit, extension, remix or character; a Realtime call's SDP
// offer) are estimated from their forms: the prompt fields' tokens, 85 per
// file part, a Realtime session's instructions and tools, and the
// session's budget or default_max_tokens. A bare SDP offer is the budget
// alone. A form that cannot be read, names its model or session twice,
// or has a part whose name another form parser would read otherwise (two
// name parameters, two Content-Disposition headers, another disposition),
// is invalid, and so is a form to another path. A session or model sent
// as a file is read as its value.
func TestEstimateFormModelCalls(t *testing.T) {
	e := provisioned(t, &Estimate{})
	part := func(name, filename, value string) string {
		if filename != "" {
			return "--b\r\nContent-Disposition: form-data; name=\"" + name + "\"; filename=\"" + filename + "\"\r\nContent-Type: image/png\r\n\r\n" + value + "\r\n"
		}
		return "--b\r\nContent-Disposition: form-data; name=\"" + name + "\"\r\n\r\n" + value + "\r\n"
	}
	raw := func(disposition, value string) string {
		return "--b\r\nContent-Disposition: " + disposition + "\r\n\r\n" + value + "\r\n"
	}
	const multipartType = "multipart/form-data; boundary=b"
	// 36 bytes: 9 tokens under approx.
	const prompt = "A calico cat playing a piano onstage"
	video := part("model", "", "sora-2") + part("prompt", "", prompt) + part("seconds", "", "8") + part("size", "", "1280x720")
	session := `{"type":"realtime","model":"gpt-realtime","instructions":"Be brief and kind.","max_output_tokens":300}` // 18 bytes of instructions: 5
	for _, tc := range []struct {
		name, path, contentType, body string
		prompt, completion            int64
		model                         string
		invalid                       bool
	}{
		{"video", "/v1/videos", multipartType, video + "--b--\r\n", 9, 1024, "sora-2", false},
		{"video_trailing_slash", "/v1/videos/", multipartType, video + "--b--\r\n", 9, 1024, "sora-2", false},
		{"video_with_reference", "/v1/videos", multipartType, video + part("input_reference", "cat.png", "\x89PNG") + "--b--\r\n", 9 + 85, 1024, "sora-2", false},
		{"video_edit", "/v1/videos/edits", multipartType, part("prompt", "", prompt) + part("video", "v.mp4", "....") + "--b--\r\n", 9 + 85, 1024, "", false},
		{"video_extension", "/v1/videos/extensions", multipartType, part("prompt", "", prompt) + "--b--\r\n", 9, 1024, "", false},
		{"video_remix", "/v1/videos/video_123/remix", multipartType, part("prompt", "", prompt) + "--b--\r\n", 9, 1024, "", false},
		{"video_character", "/v1/videos/characters", multipartType, part("name", "", "Mo") + part("video", "v.mp4", "....") + "--b--\r\n", 85, 1024, "", false},
		{"prompt_twice", "/v1/videos", multipartType, part("prompt", "", prompt) + part("prompt", "", prompt) + "--b--\r\n", 18, 1024, "", false},
		{"prompt_as_a_file", "/v1/videos", multipartType, part("prompt", "p.txt", prompt) + "--b--\r\n", 9, 1024, "", false},
		{"urlencoded_video", "/v1/videos", "application/x-www-form-urlencoded",
			"model=sora-2&prompt=" + strings.ReplaceAll(prompt, " ", "+") + "&seconds=4", 9, 1024, "sora-2", false},
		{"realtime_call_sdp", "/v1/realtime/calls", "application/sdp", "v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\n", 0, 1024, "", false},
		{"realtime_call_form", "/v1/realtime/calls", multipartType,
			part("sdp", "", "v=0\r\ns=-") + part("session", "", session) + "--b--\r\n", 5, 300, "gpt-realtime", false},
		{"realtime_call_unlimited", "/v1/realtime/calls", multipartType,
			part("sdp", "", "v=0\r\ns=-") + part("session", "", `{"type":"realtime","max_output_tokens":"inf"}`) + "--b--\r\n", 0, 1024, "", false},
		{"session_as_a_file", "/v1/realtime/calls", multipartType,
			part("sdp", "", "v=0\r\ns=-") + part("session", "s.json", session) + "--b--\r\n", 5, 300, "gpt-realtime", false},
		{"model_twice", "/v1/videos", multipartType, part("model", "", "a") + part("model", "", "b") + "--b--\r\n", 0, 0, "", true},
		// A name Go's FormName would not read, and Python's parsers would
		// (the last name, the last header, any disposition): invalid.
		{"name_twice", "/v1/realtime/calls", multipartType,
			raw(`form-data; name="sdp"; name="session"`, session) + "--b--\r\n", 0, 0, "", true},
		{"disposition_twice", "/v1/realtime/calls", multipartType,
			raw("form-data; name=\"sdp\"\r\nContent-Disposition: form-data; name=\"session\"", session) + "--b--\r\n", 0, 0, "", true},
		{"not_form_data", "/v1/realtime/calls", multipartType, raw(`attachment; name="session"`, session) + "--b--\r\n", 0, 0, "", true},
		{"disposition_unparsable", "/v1/videos", multipartType, raw(`form-data; name=prompt; x`, prompt) + "--b--\r\n", 0, 0, "", true},
		{"session_twice", "/v1/realtime/calls", multipartType, part("session", "", "{}") + part("session", "", "{}") + "--b--\r\n", 0, 0, "", true},
		{"session_not_json", "/v1/realtime/calls", multipartType, part("session", "", "{") + "--b--\r\n", 0, 0, "", true},
		{"unterminated_form", "/v1/videos", multipartType, part("prompt", "", prompt), 0, 0, "", true},
		{"too_many_parts", "/v1/videos", multipartType, strings.Repeat(part("seconds", "", "4"), maxFormParts+1) + "--b--\r\n", 0, 0, "", true},
		{"too_many_fields", "/v1/videos", "application/x-www-form-urlencoded", strings.Repeat("a=1&", maxFormParts) + "prompt=x", 0, 0, "", true},
		{"sdp_elsewhere", "/v1/videos", "application/sdp", "v=0\r\n", 0, 0, "", true},
		{"form_to_chat", "/v1/chat/completions", multipartType, video + "--b--\r\n", 0, 0, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
			req.Header.Set("Content-Type", tc.contentType)
			est, err := e.estimate(httptest.NewRecorder(), req, false)
			if tc.invalid {
				if !errors.Is(err, errInvalidBody) {
					t.Fatalf("estimate %+v, %v; want errInvalidBody", est, err)
				}
				return
			}
			if err != nil || est.prompt != tc.prompt || est.completion != tc.completion || est.model != tc.model || est.noInference || !est.read {
				t.Fatalf("estimate %+v, %v; want prompt %d, completion %d, model %q, read", est, err, tc.prompt, tc.completion, tc.model)
			}
			if b, _ := io.ReadAll(req.Body); string(b) != tc.body {
				t.Errorf("the next handler reads %q, want the body as it came", b)
			}
		})
	}
	// A form over max_body is invalid, as a JSON body is.
	small := provisioned(t, &Estimate{MaxBody: 64})
	req := httptest.NewRequest(http.MethodPost, "/v1/videos", strings.NewReader(video+"--b--\r\n"))
	req.Header.Set("Content-Type", multipartType)
	if est, err := small.estimate(httptest.NewRecorder(), req, false); !errors.Is(err, errInvalidBody) {
		t.Errorf("a form over max_body: estimate %+v, %v; want errInvalidBody", est, err)
	}
}

// TestEstimateBodylessAgentRuns: a POST without a body that starts an
// agent (Anthropic's beta.deployments.run, OpenAI's
// beta.agents.automations.invocations.create) is charged
// default_max_tokens and settled, not free as a bodyless cancel or pause
// is: the SDKs send these with Content-Length 0 (or an empty chunked
// body), and the agent runs at once. A GET there (a list of invocations)
// stays free.
func TestEstimateBodylessAgentRuns(t *testing.T) {
	e := provisioned(t, &Estimate{})
	for _, tc := range []struct {
		method, path string
		chunked      bool
		want         int64 // -1: 0 tokens and not settled
	}{
		{http.MethodPost, "/v1/deployments/depl_abc/run", false, 1024},
		{http.MethodPost, "/v1/deployments/depl_abc/run/", false, 1024},
		{http.MethodPost, "/v1/deployments/depl_abc/RUN", false, 1024},
		{http.MethodPost, "/anthropic/v1/deployments/depl_abc/run", true, 1024},
		{http.MethodPost, "/v1/agents/automations/auto_abc/invocations", false, 1024},
		{http.MethodPost, "/v1/agents/automations/auto_abc/invocations", true, 1024},
		{http.MethodGet, "/v1/agents/automations/auto_abc/invocations", false, -1},
		{http.MethodPost, "/v1/deployments/depl_abc/pause", false, -1},
		{http.MethodPost, "/v1/agents/automations/auto_abc/resume", false, -1},
		{http.MethodPost, "/v1/responses/resp_abc/cancel", false, -1},
		{http.MethodPost, "/v1/sessions/sesn_abc/archive", true, -1},
	} {
		req := httptest.NewRequest(tc.method, tc.path, nil)
		if tc.chunked {
			req.Body, req.ContentLength = io.NopCloser(strings.NewReader("")), -1
		}
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		got := est.prompt + est.completion
		switch {
		case err != nil:
			t.Errorf("%s %s: %v", tc.method, tc.path, err)
		case tc.want < 0 && (got != 0 || !est.noInference):
			t.Errorf("%s %s: estimate %d, not settled %v; want 0 and not settled", tc.method, tc.path, got, est.noInference)
		case tc.want >= 0 && (got != tc.want || est.noInference):
			t.Errorf("%s %s: estimate %d, not settled %v; want %d and settled", tc.method, tc.path, got, est.noInference, tc.want)
		}
	}
}

// TestEstimateBatches: a batch whose requests come in its body is charged
// what they would be alone: Anthropic's Message Batches (and through
// the beta), Gemini's inline batchGenerateContent. OpenAI's batches name a
// file uploaded before, which the estimate cannot read: default_max_tokens,
// as before (README). A batch's cancel, a POST without a body, is free.
// Only a batch path (clean) leaves out the top level's default budget.
func TestEstimateBatches(t *testing.T) {
	e := provisioned(t, &Estimate{})
	// 8 bytes: 2 tokens; 4 bytes: 1.
	const anthropic = `{"requests":[` +
		`{"custom_id":"a","params":{"model":"claude-x","max_tokens":100,"messages":[{"role":"user","content":"abcdefgh"}]}},` +
		`{"custom_id":"b","params":{"model":"claude-x","max_tokens":50,"messages":[{"role":"user","content":"abcd"}]}}]}`
	const gemini = `{"batch":{"display_name":"x","input_config":{"requests":{"requests":[` +
		`{"request":{"contents":[{"parts":[{"text":"abcdefgh"}]}]},"metadata":{"key":"a"}},` +
		`{"request":{"contents":[{"parts":[{"text":"abcd"}]}],"generationConfig":{"maxOutputTokens":30}}}]}}}}`
	const geminiEmbed = `{"batch":{"displayName":"e","inputConfig":{"requests":{"requests":[` +
		`{"request":{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcdefgh"}]}},"metadata":{"key":"a"}},` +
		`{"request":{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcd"}]}}}]}}}}`
	for _, tc := range []struct {
		path, body string
		want       int64 // -1: 0 tokens and not settled
		model      string
	}{
		{"/v1/messages/batches", anthropic, 3 + 150, "claude-x"},
		{"/v1/messages/batches?beta=true", anthropic, 3 + 150, "claude-x"},
		{"/v1beta/models/gemini-2.5-flash:batchGenerateContent", gemini, 3 + 1024 + 30, "gemini-2.5-flash"},
		{"/v1/batches", `{"input_file_id":"file-abc","endpoint":"/v1/chat/completions","completion_window":"24h"}`, 1024, ""},
		// Gemini's embedding batch (asyncBatchEmbedContent): the texts of
		// its requests' content, no completion (it was charged
		// default_max_tokens per request and once more, for embeddings).
		{"/v1beta/models/gemini-embedding-001:asyncBatchEmbedContent", geminiEmbed, 3, "gemini-embedding-001"},
		// Mistral's inline batch jobs: the job's model; a job of
		// embeddings (its endpoint) has no completion.
		{"/v1/batch/jobs", `{"model":"mistral-small-latest","endpoint":"/v1/chat/completions","requests":[` +
			`{"custom_id":"0","body":{"max_tokens":100,"messages":[{"role":"user","content":"abcdefgh"}]}},` +
			`{"custom_id":"1","body":{"messages":[{"role":"user","content":"abcd"}]}}]}`, 3 + 100 + 1024, "mistral-small-latest"},
		{"/v1/batch/jobs", `{"model":"mistral-embed","endpoint":"/v1/embeddings","requests":[` +
			`{"custom_id":"0","body":{"input":["abcdefgh","abcd"]}}]}`, 3, "mistral-embed"},
		{"/v1/batch/jobs", `{"model":"mistral-moderation-latest","endpoint":"/v1/chat/classifications","requests":[` +
			`{"custom_id":"0","body":{"input":["abcdefgh","abcd"]}}]}`, 3, "mistral-moderation-latest"},
		// Gemini's synchronous embedding batch: its items are the
		// requests, whose content counts; no completion.
		{"/v1beta/models/gemini-embedding-001:batchEmbedContents", `{"requests":[` +
			`{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcdefgh"}]}},` +
			`{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcd"}]}}]}`, 3, "gemini-embedding-001"},
		{"/v1beta/models/gemini-embedding-001:batchEmbedContents", `{"requests":[` +
			`{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcd"}]},"taskType":"RETRIEVAL_DOCUMENT","title":"abcdefgh"},` +
			`{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcd"}]}}]}`, 4, "gemini-embedding-001"},
		// An endpoint is a Mistral batch job's alone: at another batch
		// path it takes no request's default budget off.
		{"/v1beta/models/gemini-2.5-flash:batchGenerateContent", `{"endpoint":"/v1/embeddings",` + gemini[1:], 3 + 1024 + 30, "gemini-2.5-flash"},
		{"/v1/messages/batches", `{"endpoint":"/v1/embeddings","requests":[` +
			`{"custom_id":"a","params":{"model":"claude-x","messages":[{"role":"user","content":"abcdefgh"}]}}]}`, 2 + 1024, "claude-x"},
		// Elsewhere, or at a path with dot segments, a server may read the
		// body as one request, with its default budget: both are charged.
		{"/v1/messages", anthropic, 3 + 150 + 1024, "claude-x"},
		{"/v1/chat/completions/../../v1/messages/batches", anthropic, 3 + 150 + 1024, "claude-x"},
		{"/v1/messages/batches/msgbatch_abc/cancel", "", -1, ""},
	} {
		req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		got := est.prompt + est.completion
		switch {
		case err != nil:
			t.Errorf("%s: %v", tc.path, err)
		case tc.want < 0 && (got != 0 || !est.noInference):
			t.Errorf("%s: estimate %d, not settled %v; want 0 and not settled", tc.path, got, est.noInference)
		case tc.want >= 0 && (got != tc.want || est.noInference || est.model != tc.model):
			t.Errorf("%s: estimate %d, not settled %v, model %q; want %d, settled, %q", tc.path, got, est.noInference, est.model, tc.want, tc.model)
		}
	}
}

// TestEstimateGoogleEmbeddings: Google's embedding calls are charged the
// tokens of their texts and no completion: Gemini's :embedContent (its
// content, and a document's title), and Vertex AI's :predict of Google's
// models (the content and title of its instances). Their answers report no
// usage the settlement reads, and they were charged default_max_tokens
// for good, whatever they embedded: neither their content nor their
// instances were read. Another :predict path may serve a text model
// (one deployed on an endpoint, KServe's protocol), and keeps its budget.
func TestEstimateGoogleEmbeddings(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const vertex = "/v1/projects/p/locations/us-central1/publishers/google/models/"
	// 8 bytes: 2 tokens; 4 bytes: 1.
	const gemini = `{"model":"models/gemini-embedding-001","content":{"parts":[{"text":"abcdefgh"},{"text":"abcd"}]},` +
		`"taskType":"RETRIEVAL_DOCUMENT","outputDimensionality":768}`
	const predict = `{"instances":[{"task_type":"RETRIEVAL_DOCUMENT","title":"abcd","content":"abcdefgh"},` +
		`{"content":"abcd"}],"parameters":{"autoTruncate":true,"outputDimensionality":256}}`
	for _, tc := range []struct {
		path, body string
		want       int64 // -1: invalid body
		model      string
	}{
		{"/v1beta/models/gemini-embedding-001:embedContent", gemini, 3, "gemini-embedding-001"},
		{vertex + "gemini-embedding-001:embedContent", gemini, 3, "gemini-embedding-001"},
		{"/v1beta/models/gemini-embedding-001:embedContent", `{"content":{"parts":[{"text":"abcd"}]}}`, 1, "gemini-embedding-001"},
		{"/v1beta/models/gemini-embedding-001:embedContent", `{"content":"abcdefgh"}`, 2, "gemini-embedding-001"},
		// A document's title (taskType RETRIEVAL_DOCUMENT) is embedded
		// with its content: 8 bytes more, 2 tokens.
		{"/v1beta/models/gemini-embedding-001:embedContent", `{"content":{"parts":[{"text":"abcd"}]},` +
			`"taskType":"RETRIEVAL_DOCUMENT","title":"abcdefgh"}`, 3, "gemini-embedding-001"},
		{vertex + "text-embedding-005:predict", predict, 1 + 2 + 1, "text-embedding-005"},
		{vertex + "gemini-embedding-001:predict", predict, 1 + 2 + 1, "gemini-embedding-001"},
		// A multimodal embedding's text.
		{vertex + "multimodalembedding@001:predict", `{"instances":[{"text":"abcdefgh"}]}`, 2, "multimodalembedding@001"},
		// A path with dot segments keeps its budget (see completes), one
		// for each instance.
		{"/v1beta/models/x/../gemini-embedding-001:embedContent", gemini, 3 + 1024, "gemini-embedding-001"},
		{vertex + "x/../text-embedding-005:predict", predict, 1 + 2 + 1 + 2*1024, "text-embedding-005"}, // two instances
		// Another :predict: a model deployed on an endpoint, KServe's.
		{"/v1/projects/p/locations/us-central1/endpoints/123:predict", `{"instances":["abcdefgh"]}`, 2 + 1024, ""},
		{"/v1/models/t5:predict", `{"instances":["abcdefgh"]}`, 2 + 1024, "t5"},
		// A text model deployed on an endpoint (Model Garden's vLLM,
		// TGI and Hex-LLM containers) takes its prompt, chat messages
		// and budget in each instance, and answers without usage: they
		// count, and each instance is one prediction, charged the
		// budget (the top level's parameters too) as a prompt is.
		{"/v1/projects/p/locations/us-central1/endpoints/123:predict",
			`{"instances":[{"prompt":"abcdefgh","max_tokens":8000,"temperature":1}]}`, 2 + 8000, ""},
		{"/v1/projects/p/locations/us-central1/endpoints/123:predict",
			`{"instances":[{"@requestFormat":"chatCompletions","messages":[{"role":"user","content":"abcdefgh"}],"max_tokens":8000}]}`, 2 + 8000, ""},
		{"/v1/projects/p/locations/us-central1/endpoints/123:predict",
			`{"instances":[{"inputs":"abcdefgh","parameters":{"max_new_tokens":8000}}]}`, 2 + 8000, ""},
		{"/v1/projects/p/locations/us-central1/endpoints/123:predict",
			`{"instances":[{"prompt":"abcd"},{"prompt":"abcd"},{"prompt":"abcd"}],"parameters":{"maxOutputTokens":100}}`, 3 + 3*100, ""},
		{"/v1/projects/p/locations/us-central1/endpoints/123:predict", `{"instances":["abcd","abcd"]}`, 2 + 2*1024, ""},
		// An instance's budget only raises the charge: a chat
		// completion that carries one still pays its default budget.
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"abcdefgh"}],"instances":[{"max_tokens":5}]}`, 2 + 85 + 1024, ""},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"abcdefgh"}],"instances":[{"parameters":{"max_new_tokens":0}}]}`, 2 + 85 + 1024, ""},
		// Google's own embeddings stay without a completion, however
		// many instances.
		{vertex + "text-embedding-005:predict", `{"instances":[{"content":"abcd"},{"content":"abcd"},{"content":"abcd"}]}`, 3, "text-embedding-005"},
		// Go's encoding/json reads Content, Title and Instances as
		// content, title and instances.
		{"/v1beta/models/gemini-embedding-001:embedContent", `{"Content":{"parts":[{"text":"abcd"}]}}`, -1, ""},
		{"/v1beta/models/gemini-embedding-001:embedContent", `{"Title":"abcdefgh","content":"abcd"}`, -1, ""},
		{vertex + "text-embedding-005:predict", `{"Instances":[{"content":"abcd"}]}`, -1, ""},
	} {
		req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		got := est.prompt + est.completion
		switch {
		case tc.want < 0 && err != errInvalidBody:
			t.Errorf("%s %s: estimate %d, %v; want errInvalidBody", tc.path, tc.body, got, err)
		case tc.want >= 0 && (err != nil || got != tc.want || est.noInference || est.model != tc.model):
			t.Errorf("%s %s: estimate %d, not settled %v, model %q, %v; want %d, settled, %q",
				tc.path, tc.body, got, est.noInference, est.model, err, tc.want, tc.model)
		}
	}
}

// TestEstimateGoogleTokenCounts: Gemini's and Vertex AI's token counts
// (countTokens, computeTokens), which Google serves free and whose answers
// report a count, not usage, cost 0 tokens and are not settled; they were
// charged their prompt and default_max_tokens for good. Their model is
// still the path's, for limits scoped by models. The same body sent to
// generateContent is estimated.
func TestEstimateGoogleTokenCounts(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const vertex = "/v1/projects/p/locations/us-central1/publishers/google/models/"
	const body = `{"contents":[{"role":"user","parts":[{"text":"abcdefgh"}]}]}` // 2 tokens
	for _, tc := range []struct {
		path string
		want int64 // -1: 0 tokens and not settled
	}{
		{"/v1beta/models/gemini-2.5-flash:countTokens", -1},
		{vertex + "gemini-2.5-flash:countTokens", -1},
		{vertex + "gemini-2.5-flash:computeTokens", -1},
		{"/v1beta/models/gemini-2.5-flash:generateContent", 2 + 1024},
		// Not at a path with dot segments, nor behind a prefix.
		{"/v1beta/models/x/../gemini-2.5-flash:countTokens", 2 + 1024},
		{"/gemini/v1beta/models/gemini-2.5-flash:countTokens", 2 + 1024},
	} {
		req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(body))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		got := est.prompt + est.completion
		switch {
		case err != nil || est.model != "gemini-2.5-flash":
			t.Errorf("%s: model %q, %v; want gemini-2.5-flash", tc.path, est.model, err)
		case tc.want < 0 && (got != 0 || !est.noInference):
			t.Errorf("%s: estimate %d, not settled %v; want 0 and not settled", tc.path, got, est.noInference)
		case tc.want >= 0 && (got != tc.want || est.noInference):
			t.Errorf("%s: estimate %d, not settled %v; want %d and settled", tc.path, got, est.noInference, tc.want)
		}
	}
}

// TestEstimateBatchesNotCapped: a batch's estimate is its charge (its
// answer reports no usage), so the cap that keeps a large max_tokens from
// denying a request (tokenEstimate.cost) does not apply to it: a batch
// whose requests' budgets exceed the smallest tokens capacity is denied
// cost_exceeds_capacity, as README says, not charged that capacity once
// for all of them. Elsewhere (a path a normalizing upstream may read as
// the batch path) such a body is not capped either; a body without
// batched requests still is.
func TestEstimateBatchesNotCapped(t *testing.T) {
	e := provisioned(t, &Estimate{})
	// 4 bytes: 1 token; three requests of 1000 tokens' budget each.
	item := `{"custom_id":"a","params":{"model":"claude-x","max_tokens":1000,"messages":[{"role":"user","content":"abcd"}]}}`
	batch := `{"requests":[` + item + `,` + item + `,` + item + `]}`
	const capacity = 2000
	for _, tc := range []struct {
		path, body string
		want       int64
	}{
		{"/v1/messages/batches", batch, 3 + 3000},
		{"/v1beta/models/g:batchGenerateContent", `{"batch":{"input_config":{"requests":{"requests":[` +
			`{"request":{"contents":"abcd","generationConfig":{"maxOutputTokens":1500}}},` +
			`{"request":{"contents":"abcd","generationConfig":{"maxOutputTokens":1500}}}]}}}}`, 2 + 3000},
		{"/v1//messages/batches", batch, 3 + 3000 + 1024},
		{"/v1/messages", `{"model":"claude-x","max_tokens":5000,"messages":[{"role":"user","content":"abcd"}]}`, capacity},
	} {
		req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		if err != nil {
			t.Fatalf("%s: %v", tc.path, err)
		}
		if got := est.cost(capacity); got != tc.want {
			t.Errorf("%s: cost %d against a capacity of %d, want %d", tc.path, got, capacity, tc.want)
		}
	}
}

// TestEstimateAgentNamesOnlyAfterV1: the agent and account APIs' generic
// names (agents, sessions, projects, environments, vaults) are free only
// right after a v1 segment, in the SDKs' shapes: Bedrock's
// InvokeInlineAgent (/agents/<session>, served by LiteLLM's /bedrock
// pass-through), a Vertex AI model under /v1/projects, an Azure deployment
// or a LiteLLM engine of such a name, Mistral's agents completion, and a
// session's creation or events are estimated.
func TestEstimateAgentNamesOnlyAfterV1(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const chat = `{"messages":[{"role":"user","content":"abcd"}]}`
	for _, p := range []string{
		"/bedrock/agents/sess_abc",
		"/bedrock/agents/agt_abc/agentAliases/al_abc/sessions/sess_abc/text",
		"/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-flash:generateContent",
		"/v1/projects/p/roles/../../chat/completions",
		"/openai/deployments/vaults/chat/completions",
		"/v1/engines/organizations/chat/completions",
		"/v1/deployments/organizations",
		"/v1/sessions",
		"/v1/sessions/sesn_abc/events",
		"/v1/agents/sessions",
		"/v1/agents/sessions/sess_abc/events",
		"/v1/agents/automations/auto_abc/invocations",
		"/v1/live/sessions/ls_abc",
		"/environments/prod/v1/chat/completions",
		"/v1//vaults",
		"/v1/agents/completions",
		"/v1/agents/Completions",
		"/v1/agents/completions;v=1",
	} {
		req := httptest.NewRequest(http.MethodPost, p, strings.NewReader(chat))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		if got := est.prompt + est.completion; err != nil || got != 1+1024 || est.noInference {
			t.Errorf("%s: estimate %d, not settled %v, %v; want %d and settled", p, got, est.noInference, err, 1+1024)
		}
	}
}

// TestIncludeUsageNotForMistral: with settle { include_usage }, a stream
// to Mistral's FIM or agents completions is sent as it came, since
// Mistral answers a stream_options member 422 extra_forbidden (and
// reports usage in every stream); it used to be rewritten, and every such
// stream failed. A chat completions stream is still rewritten.
func TestIncludeUsageNotForMistral(t *testing.T) {
	e := provisioned(t, &Estimate{})
	for _, tc := range []struct {
		path, body string
		rewritten  bool
	}{
		{"/v1/fim/completions", `{"model":"codestral-latest","prompt":"def f(","suffix":"return 1","stream":true}`, false},
		{"/v1/agents/completions", `{"agent_id":"ag_abc","messages":[{"role":"user","content":"abcd"}],"stream":true}`, false},
		{"/v1/chat/completions", `{"model":"mistral-large-latest","messages":[{"role":"user","content":"abcd"}],"stream":true}`, true},
		{"/v1/completions", `{"model":"gpt-3.5-turbo-instruct","prompt":"abcd","stream":true}`, true},
	} {
		req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
		est, err := e.estimate(httptest.NewRecorder(), req, true)
		if err != nil {
			t.Fatalf("%s: %v", tc.path, err)
		}
		body, _ := io.ReadAll(req.Body)
		changed := string(body) != tc.body
		if est.streamUsage != tc.rewritten || changed != tc.rewritten {
			t.Errorf("%s: streamUsage %v, body %s; want rewritten %v", tc.path, est.streamUsage, body, tc.rewritten)
		}
	}
}

// TestIncludeUsageNotForOldAzure: with settle { include_usage }, a stream
// to an Azure OpenAI api-version before 2024-09-01, which answers a
// stream_options member 400 "Unrecognized request argument supplied", is
// sent as it came (it used to be rewritten, and every such stream
// failed); from 2024-09-01-preview on, and without an api-version, it is
// rewritten.
func TestIncludeUsageNotForOldAzure(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const body = `{"messages":[{"role":"user","content":"abcd"}],"stream":true}`
	for _, tc := range []struct {
		url       string
		rewritten bool
	}{
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2024-06-01", false},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2024-08-01-preview", false},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2023-05-15", false},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2024-09-01-preview", true},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21", true},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=latest", true},
		{"/openai/v1/chat/completions", true},
	} {
		req := httptest.NewRequest(http.MethodPost, tc.url, strings.NewReader(body))
		est, err := e.estimate(httptest.NewRecorder(), req, true)
		if err != nil {
			t.Fatalf("%s: %v", tc.url, err)
		}
		got, _ := io.ReadAll(req.Body)
		if est.streamUsage != tc.rewritten || (string(got) != body) != tc.rewritten {
			t.Errorf("%s: streamUsage %v, body %s; want rewritten %v", tc.url, est.streamUsage, got, tc.rewritten)
		}
	}
}

// TestEstimateOtherUpstreams: the model calls of the popular upstreams
// behind the gateway (LiteLLM, vLLM, Ollama, Hugging Face TGI, Mistral,
// Azure OpenAI, Gemini, Bedrock through LiteLLM) are estimated from the
// fields each reads and settled: none is free under a path rule, each
// counts its prompt (11 tokens) and its budget.
func TestEstimateOtherUpstreams(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const text = `"Write a 3,000-word essay on rate limiting."` // 11 tokens
	for _, tc := range []struct {
		name, path, body string
		want             int64
	}{
		{"ollama_chat", "/api/chat", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"ollama_generate", "/api/generate", `{"model":"llama3.2","prompt":` + text + `,"options":{"num_predict":100}}`, 11 + 100},
		{"ollama_embed", "/api/embed", `{"model":"all-minilm","input":` + text + `}`, 11},
		{"ollama_openai", "/v1/chat/completions", `{"model":"llama3.2","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"tgi_generate", "/generate", `{"inputs":` + text + `,"parameters":{"max_new_tokens":100}}`, 11 + 100},
		{"tgi_generate_stream", "/generate_stream", `{"inputs":` + text + `,"parameters":{"max_new_tokens":100,"best_of":2}}`, 11 + 200},
		{"mistral_fim", "/v1/fim/completions", `{"model":"codestral-latest","prompt":` + text + `,"suffix":` + text + `,"max_tokens":100}`, 22 + 100},
		{"mistral_agents", "/v1/agents/completions", `{"agent_id":"ag_abc","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"mistral_conversation", "/v1/conversations", `{"agent_id":"ag_abc","inputs":` + text + `}`, 11 + 1024},
		{"azure", "/openai/deployments/gpt-4o/chat/completions", `{"messages":[{"role":"user","content":` + text + `}],"max_tokens":100}`, 11 + 100},
		{"gemini_openai", "/v1beta/openai/chat/completions", `{"model":"gemini-2.5-flash","messages":[{"role":"user","content":` + text + `}]}`, 11 + 1024},
		{"gemini", "/v1beta/models/gemini-2.5-flash:generateContent", `{"contents":[{"role":"user","parts":[{"text":` + text + `}]}],` +
			`"generationConfig":{"maxOutputTokens":100,"candidateCount":2}}`, 11 + 200},
		{"gemini_stream", "/gemini/v1beta/models/gemini-2.5-flash:streamGenerateContent", `{"contents":[{"parts":[{"text":` + text + `}]}]}`, 11 + 1024},
		{"vertex", "/vertex_ai/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-flash:generateContent",
			`{"systemInstruction":{"parts":[{"text":` + text + `}]},"contents":[{"role":"user","parts":[{"text":` + text + `}]}]}`, 22 + 1024},
		{"bedrock_converse", "/bedrock/model/anthropic.claude-3-5-sonnet-20240620-v1:0/converse",
			`{"messages":[{"role":"user","content":[{"text":` + text + `}]}],"inferenceConfig":{"maxTokens":100}}`, 11 + 100},
		{"bedrock_invoke", "/bedrock/model/anthropic.claude-3-5-sonnet-20240620-v1:0/invoke",
			`{"anthropic_version":"bedrock-2023-05-31","max_tokens":100,"messages":[{"role":"user","content":` + text + `}]}`, 11 + 100},
		{"vllm_rerank", "/v1/rerank", `{"model":"bge-reranker","query":` + text + `,"documents":[` + text + `]}`, 22 + 1024},
	} {
		req := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		if got := est.prompt + est.completion; err != nil || got != tc.want || est.noInference {
			t.Errorf("%s: estimate %d, not settled %v, %v; want %d and settled", tc.name, got, est.noInference, err, tc.want)
		}
	}
}

// provisioned returns e provisioned: its defaults set, its tokenizer
// built.
func provisioned(t testing.TB, e *Estimate) *Estimate {
	t.Helper()
	if err := e.provision(); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestEstimateGeminiPathModel: Gemini's and Vertex AI's model is in the
// path (models/<model>:<method>), which is what runs: it is the
// request's model, for limits scoped by models, where Gemini's calls had
// none. A model the body names beside it ("models/<m>", as a batch's
// requests name theirs) that is another one, or a path that names
// another as it came, makes the body one of several models (400
// mixed_models where the buckets depend on the model).
func TestEstimateGeminiPathModel(t *testing.T) {
	e := provisioned(t, &Estimate{})
	const contents = `"contents":[{"parts":[{"text":"abcd"}]}]`
	item := func(model string) string {
		return `{"request":{"model":"` + model + `",` + contents + `}}`
	}
	batch := func(items string) string {
		return `{"batch":{"input_config":{"requests":{"requests":[` + items + `]}}}}`
	}
	for _, tc := range []struct {
		name, path, body string
		model            string
		mixed            bool
	}{
		{"google_ai", "/v1beta/models/gemini-2.5-pro:generateContent", `{` + contents + `}`, "gemini-2.5-pro", false},
		{"stream", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", `{` + contents + `}`, "gemini-2.5-pro", false},
		{"vertex", "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro:generateContent",
			`{` + contents + `}`, "gemini-2.5-pro", false},
		{"batch_same_model", "/v1beta/models/gemini-2.5-pro:batchGenerateContent",
			batch(item("models/gemini-2.5-pro") + "," + item("gemini-2.5-pro")), "gemini-2.5-pro", false},
		{"batch_other_model", "/v1beta/models/gemini-2.5-pro:batchGenerateContent",
			batch(item("models/gemini-2.5-pro") + "," + item("models/gemini-2.5-flash-lite")), "gemini-2.5-pro", true},
		{"body_other_model", "/v1beta/models/gemini-2.5-pro:generateContent", `{"model":"gemini-2.5-flash",` + contents + `}`, "gemini-2.5-pro", true},
		{"dot_segments", "/v1beta/models/gemini-2.5-flash/../gemini-2.5-pro:generateContent", `{` + contents + `}`, "gemini-2.5-pro", true},
		{"openai_path", "/v1/chat/completions", `{"model":"gpt-4o","messages":[]}`, "gpt-4o", false},
		{"no_method", "/v1/models/gpt-4o", `{"model":"gpt-4o","messages":[]}`, "gpt-4o", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := httptest.NewRequest(http.MethodPost, "http://gateway.test"+tc.path, strings.NewReader(tc.body))
			est, err := e.estimate(httptest.NewRecorder(), req, false)
			if err != nil {
				t.Fatal(err)
			}
			if est.model != tc.model || est.mixedModels != tc.mixed {
				t.Errorf("model %q, mixed %v; want %q, %v", est.model, est.mixedModels, tc.model, tc.mixed)
			}
		})
	}
}

// countingReader counts the bytes read from it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// ollamaModelFile is a stand-in for a GGUF model file of n bytes: its
// magic, then bytes of every value (no JSON).
func ollamaModelFile(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i>>8)
	}
	copy(b, "GGUF\x03\x00\x00\x00")
	return b
}

// TestEstimateOllamaBlobs: ollama create uploads a model file (GGUF,
// gigabytes) to POST /api/blobs/<digest> before it calls /api/create:
// the estimate does not read it at all (not into memory, not as JSON), so
// a file over max_body (3 MiB here, 1 MiB by default) or of unknown
// length (chunked) is 0 tokens and not settled, not 400 invalid_body, and
// reaches the next handler byte for byte. Only at a clean path whose
// last segments are Ollama's, with its digest (sha256: or sha256- and 64
// hex digits): at any other the body is read as ever, and a binary one
// is invalid. DELETE /api/delete is free as its POST is.
func TestEstimateOllamaBlobs(t *testing.T) {
	e := provisioned(t, &Estimate{})
	blob := ollamaModelFile(3 << 20)
	sum := sha256Hex(string(blob))
	digest := "sha256:" + sum
	for _, tc := range []struct {
		name, method, path string
		body               []byte
		unknownLength      bool   // sent chunked: no Content-Length
		contentType        string // "" for none, as ollama create sends it
		free               bool   // else: read, and an invalid body
	}{
		{"upload", http.MethodPost, "/api/blobs/" + digest, blob, false, "", true},
		{"upload_octet_stream", http.MethodPost, "/api/blobs/" + digest, blob, false, "application/octet-stream", true},
		{"upload_chunked", http.MethodPost, "/api/blobs/" + digest, blob, true, "", true},
		{"upload_small", http.MethodPost, "/api/blobs/" + digest, blob[:4096], false, "", true},
		{"upload_json_labelled", http.MethodPost, "/api/blobs/" + digest, blob, false, "application/json", true},
		{"upload_dash_digest", http.MethodPost, "/api/blobs/sha256-" + strings.ToUpper(sum), blob, false, "", true},
		{"upload_prefixed", http.MethodPost, "/ollama/api/blobs/" + digest, blob, false, "", true},
		{"upload_trailing_slash", http.MethodPost, "/api/blobs/" + digest + "/", blob, false, "", true},
		{"upload_dotted_to_chat", http.MethodPost, "/api/blobs/" + digest + "/../../chat", blob[:4096], false, "", false},
		{"upload_dotted_from_chat", http.MethodPost, "/api/chat/../blobs/" + digest, blob[:4096], false, "", false},
		{"upload_doubled_slash", http.MethodPost, "/api//blobs/" + digest, blob[:4096], false, "", false},
		{"upload_under_chat", http.MethodPost, "/api/chat/api/blobs/" + digest, blob[:4096], false, "", false},
		{"upload_under_openai_chat", http.MethodPost, "/v1/chat/completions/api/blobs/" + digest, blob[:4096], false, "", false},
		{"upload_short_digest", http.MethodPost, "/api/blobs/" + digest[:len(digest)-1], blob[:4096], false, "", false},
		{"upload_not_hex", http.MethodPost, "/api/blobs/sha256:" + strings.Repeat("g", 64), blob[:4096], false, "", false},
		{"upload_other_digest", http.MethodPost, "/api/blobs/sha512:" + sum, blob[:4096], false, "", false},
		{"upload_more_segments", http.MethodPost, "/api/blobs/" + digest + "/chat", blob[:4096], false, "", false},
		{"put", http.MethodPut, "/api/blobs/" + digest, blob[:4096], false, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cr := &countingReader{r: bytes.NewReader(tc.body)}
			req := httptest.NewRequest(tc.method, tc.path, cr)
			if !tc.unknownLength {
				req.ContentLength = int64(len(tc.body))
			}
			if tc.contentType != "" {
				req.Header.Set("Content-Type", tc.contentType)
			}
			est, err := e.estimate(httptest.NewRecorder(), req, false)
			got := est.prompt + est.completion
			switch {
			case tc.free && (err != nil || got != 0 || !est.noInference || est.read || cr.n != 0):
				t.Errorf("estimate %d, not settled %v, read %v (%d bytes), %v; want 0 tokens, not settled, unread",
					got, est.noInference, est.read, cr.n, err)
			case !tc.free && (!errors.Is(err, errInvalidBody) || cr.n == 0):
				t.Errorf("estimate %d, %v, %d bytes read; want the body read and errInvalidBody", got, err, cr.n)
			}
			rest, err := io.ReadAll(req.Body)
			if err != nil || !bytes.Equal(rest, tc.body) {
				t.Errorf("body after the estimate: %d bytes, %v; want the %d of the original", len(rest), err, len(tc.body))
			}
		})
	}
	// A chat body at a crafted blob path is read and estimated.
	const chat = `{"model":"llama3.2","messages":[{"role":"user","content":"abcd"}]}`
	for _, p := range []string{"/api/chat/../blobs/" + digest, "/api/blobs/" + digest + "/../../chat", "/api/chat/api/blobs/" + digest,
		"/v1/chat/completions/api/blobs/" + digest} {
		req := httptest.NewRequest(http.MethodPost, p, strings.NewReader(chat))
		est, err := e.estimate(httptest.NewRecorder(), req, false)
		if got := est.prompt + est.completion; err != nil || got != 1+1024 || est.noInference {
			t.Errorf("%s: estimate %d, not settled %v, %v; want %d and settled", p, got, est.noInference, err, 1+1024)
		}
	}
	// Ollama deletes a model with DELETE /api/delete and a JSON body.
	req := httptest.NewRequest(http.MethodDelete, "/api/delete", strings.NewReader(`{"model":"llama3.2:latest"}`))
	est, err := e.estimate(httptest.NewRecorder(), req, false)
	if got := est.prompt + est.completion; err != nil || got != 0 || !est.noInference || est.model != "llama3.2:latest" {
		t.Errorf("DELETE /api/delete: estimate %d, not settled %v, model %q, %v; want 0 tokens, not settled, llama3.2:latest",
			got, est.noInference, est.model, err)
	}
}
