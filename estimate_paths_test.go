package tokenbucket

import (
	"errors"
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
	e := &Estimate{}
	if err := e.provision(); err != nil {
		t.Fatal(err)
	}
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
	e := &Estimate{}
	if err := e.provision(); err != nil {
		t.Fatal(err)
	}
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
	e := &Estimate{}
	if err := e.provision(); err != nil {
		t.Fatal(err)
	}
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
	e := &Estimate{}
	if err := e.provision(); err != nil {
		t.Fatal(err)
	}
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
