package tokenbucket

import (
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
