package tokenbucket

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/token-bucket/token_bucket/bucket"
)

// TestHeaderValuesOwnedPerResponse: the header values of an answer share
// one backing array, but each header's slice has capacity 1 and the array
// is the response's own. Caddy's header replace rewrites values in place,
// and Header.Add appends: neither may reach another header or another
// response.
func TestHeaderValuesOwnedPerResponse(t *testing.T) {
	tiers, _ := compileTiers([]Dimension{{Name: "user"}, {Name: "ip"}}, []Tier{{Name: "free", Limits: []Limit{
		{Dimension: "user", Capacity: 10, RefillRate: 1}, {Dimension: "ip", Capacity: 100, RefillRate: 1}}}}, "", 1)
	tr := tiers["free"]
	limits := []*limit{&tr.limits[0], &tr.limits[1]}
	req := &request{keys: []string{"a", "b"}, takes: []bucket.Take{{Spec: limits[0].spec, Cost: 1}, {Spec: limits[1].spec, Cost: 1}}, limits: limits}
	h := &Handler{OpenAIHeaders: true}
	answer := func(allowed bool) http.Header {
		w := httptest.NewRecorder()
		if allowed {
			d := bucket.Summarize([]bucket.Result{{Remaining: 9, FullMS: 1000}, {Remaining: 99, FullMS: 1000}})
			h.writeHeaders(w.Header(), tr, limits, &d)
			return w.Header()
		}
		d := bucket.Summarize([]bucket.Result{{Reason: bucket.RateLimited, RetryAfterMS: 1500}, {Remaining: 50, FullMS: 1000}})
		var hs headerSet
		var arr [headerBuf]byte
		if err := h.deny(w, tr, req, &d, &hs, h.addHeaders(&hs, arr[:0], tr, limits, limits, &d)); err != nil {
			t.Fatal(err)
		}
		return w.Header()
	}
	for _, allowed := range []bool{true, false} {
		first, second := answer(allowed), answer(allowed)
		want := second.Clone()
		for name, vals := range first {
			if len(vals) != 1 || cap(vals) != 1 {
				t.Errorf("allowed %v: %s has len %d, cap %d; want 1, 1", allowed, name, len(vals), cap(vals))
			}
			vals[0] = "edited"
		}
		first.Add("Ratelimit", "appended")
		for name, vals := range first {
			if name != "Ratelimit" && (len(vals) != 1 || vals[0] != "edited") {
				t.Errorf("allowed %v: appending to Ratelimit changed %s to %q", allowed, name, vals)
			}
		}
		for name, vals := range second {
			if vals[0] != want.Get(name) {
				t.Errorf("allowed %v: editing one response changed %s of another to %q", allowed, name, vals[0])
			}
		}
	}
}
