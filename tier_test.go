package tokenbucket

import (
	"errors"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
)

// TestNormalizeIdentityForms: addresses are masked whatever their spelling
// (upper case, IPv4-mapped, a zone of any bytes); API keys, names and
// near-addresses are kept as they are.
func TestNormalizeIdentityForms(t *testing.T) {
	h := &Handler{IPv4Prefix: 24, IPv6Prefix: 48}
	for _, tc := range []struct{ id, want string }{
		{"192.0.2.7", "192.0.2.0/24"},
		{"::ffff:192.0.2.7", "192.0.2.0/24"},
		{"2001:DB8:1:2::1", "2001:db8:1::/48"},
		{"fe80::1%eth0", "fe80::/48"},
		{"fe80::1%zone with spaces", "fe80::/48"},
		{"192.0.2.7%eth0", "192.0.2.7%eth0"}, // IPv4 has no zone
		{"fe80::1%", "fe80::1%"},
		{"1.2.3", "1.2.3"},
		{"deadbeef", "deadbeef"},
		{"dead:beef", "dead:beef"},
		{"sk-live-0123456789abcdef", "sk-live-0123456789abcdef"},
		{"user-42", "user-42"},
		{"%eth0", "%eth0"},
	} {
		if got := h.normalizeIdentity(tc.id); got != tc.want {
			t.Errorf("normalizeIdentity(%q) = %q, want %q", tc.id, got, tc.want)
		}
	}
}

// FuzzNormalizeIdentity: skipping netip.ParseAddr for identities that
// cannot be addresses changes no result.
func FuzzNormalizeIdentity(f *testing.F) {
	for _, s := range []string{"192.0.2.7", "::1", "fe80::1%eth0", "::ffff:1.2.3.4", "1::2::3", "0.0.0.0",
		"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "1:2:3:4:5:6:1.2.3.4", "a.b", "%", ":", "sk-0123", ""} {
		f.Add(s, 32, 64)
		f.Add(s, 8, 3)
	}
	f.Fuzz(func(t *testing.T, id string, v4, v6 int) {
		h := &Handler{IPv4Prefix: v4, IPv6Prefix: v6}
		want := id
		if ip, err := netip.ParseAddr(id); err == nil {
			ip = ip.Unmap().WithZone("")
			bits := v6
			if ip.Is4() {
				bits = v4
			}
			if p, err := ip.Prefix(bits); err == nil {
				want = p.String()
			}
		}
		if got := h.normalizeIdentity(id); got != want {
			t.Errorf("normalizeIdentity(%q) with /%d /%d = %q, want %q", id, v4, v6, got, want)
		}
	})
}

// TestLonePlaceholderIdentity: an identity template that is one
// placeholder, read with Replacer.Get, resolves as ReplaceOrErr would
// resolve it, for every kind of value; other templates go to ReplaceOrErr.
func TestLonePlaceholderIdentity(t *testing.T) {
	repl := caddy.NewReplacer()
	for k, v := range map[string]any{"s": "alice", "braces": "{s}", "n": 12345, "empty": "", "nil": nil,
		"err": errors.New("boom"), "bytes": []byte("raw"), "ip": "192.0.2.7", "": "empty key"} {
		repl.Set(k, v)
	}
	templates := []string{"{s}", "{braces}", "{n}", "{empty}", "{nil}", "{err}", "{bytes}", "{ip}", "{unknown}",
		"{}", "x{s}", "{s}x", "{s}{n}", `{s\}`, `\{s}`, "{s", "s}", "{{s}}", "plain"}
	var dims []Dimension
	for _, tmpl := range templates {
		dims = append(dims, Dimension{Name: "d", Identity: tmpl})
	}
	fast := &Handler{Dimensions: dims, IPv4Prefix: 32, IPv6Prefix: 64}
	for _, d := range dims {
		fast.idSources = append(fast.idSources, newIDSource(d.Identity))
	}
	slow := &Handler{Dimensions: dims, IPv4Prefix: 32, IPv6Prefix: 64} // no idSources: ReplaceOrErr
	r := httptest.NewRequest("GET", "/", nil)
	for i, tmpl := range templates {
		if got, want := fast.identity(r, repl, i), slow.identity(r, repl, i); got != want {
			t.Errorf("template %q (source %+v): identity %q, ReplaceOrErr gives %q", tmpl, fast.idSources[i], got, want)
		}
	}
	for tmpl, want := range map[string]idSource{
		"{s}":                             {key: "s"},
		"{http.request.header.X-User}":    {key: "http.request.header.X-User", header: "X-User"},
		"{http.request.header.X-API-Key}": {key: "http.request.header.X-Api-Key", header: "X-Api-Key"},
		"{http.request.header.x odd}":     {key: "http.request.header.x odd", header: "x odd"},
		"{http.request.header.}":          {key: "http.request.header."},
		"{http.vars.client_ip}":           {key: "http.vars.client_ip", vr: "client_ip"},
		"{http.vars.}":                    {key: "http.vars."},
		"{}":                              {}, "x{s}": {}, "{s}{n}": {}, `{s\}`: {}, "{file.key}": {},
	} {
		if got := newIDSource(tmpl); got != want {
			t.Errorf("newIDSource(%q) = %+v, want %+v", tmpl, got, want)
		}
	}
}

// TestDirectIdentity: a lone {http.request.header.*} or {http.vars.*}
// identity, read from the request without the replacer, is what the
// general path gives for it (Caddy's replacer, with a header field read
// by headerIdentity): for a field name in any case, a field sent twice,
// absent, empty or padded, and for variables of every kind, set or not.
// A header field is its first line, without the spaces and tabs around
// it, in a lone placeholder and in a template of several.
func TestDirectIdentity(t *testing.T) {
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-API-Key", "sk-1")
	r.Header.Add("X-Twice", "a")
	r.Header.Add("X-Twice", "b")
	r.Header.Set("X-Empty", "")
	r.Header.Set("X-Padded", " \tsk-2\t ") // as HTTP/2 passes it on
	r.Header.Add("X-Blank-First", " ")
	r.Header.Add("X-Blank-First", "sk-3")
	repl := caddy.NewReplacer()
	r = caddyhttp.PrepareRequest(r, repl, httptest.NewRecorder(), &caddyhttp.Server{})
	caddyhttp.SetVar(r.Context(), "client_ip", "192.0.2.7")
	caddyhttp.SetVar(r.Context(), "n", 42)
	caddyhttp.SetVar(r.Context(), "nil", nil)
	caddyhttp.SetVar(r.Context(), "empty", "")
	for _, tmpl := range []string{"{http.request.header.X-API-Key}", "{http.request.header.x-api-key}",
		"{http.request.header.X-Api-Key}", "{http.request.header.X-Twice}", "{http.request.header.X-Empty}",
		"{http.request.header.X-Other}", "{http.request.header.X-Padded}", "{http.request.header.X-Blank-First}",
		"{http.vars.client_ip}", "{http.vars.n}", "{http.vars.nil}",
		"{http.vars.empty}", "{http.vars.unset}"} {
		dims := []Dimension{{Name: "d", Identity: tmpl}}
		fast := &Handler{Dimensions: dims, idSources: []idSource{newIDSource(tmpl)}}
		slow := &Handler{Dimensions: dims} // no idSources: ReplaceOrErr
		if fast.idSources[0].header == "" && fast.idSources[0].vr == "" {
			t.Fatalf("template %q is not read directly: %+v", tmpl, fast.idSources[0])
		}
		if got, want := fast.identity(r, repl, 0), slow.identity(r, repl, 0); got != want {
			t.Errorf("template %q (source %+v): identity %q, ReplaceOrErr gives %q", tmpl, fast.idSources[0], got, want)
		}
	}
	for tmpl, want := range map[string]string{"{http.request.header.x-api-key}": "sk-1",
		"{http.request.header.X-Twice}": "a", "{http.request.header.X-Padded}": "sk-2", "{http.request.header.X-Blank-First}": "",
		"{http.request.header.X-Twice}:{http.request.header.x-padded}":      "a:sk-2",
		"{http.request.header.X-Twice}:{http.request.header.X-Blank-First}": "",
		"{http.vars.client_ip}": "192.0.2.7/32", "{http.vars.n}": "42"} {
		h := &Handler{Dimensions: []Dimension{{Name: "d", Identity: tmpl}}, idSources: []idSource{newIDSource(tmpl)},
			IPv4Prefix: 32, IPv6Prefix: 64}
		if got := h.identity(r, repl, 0); got != want {
			t.Errorf("template %q: identity %q, want %q", tmpl, got, want)
		}
	}
}

// TestInputsResolveOnce: a request built for two tiers (its own and a
// demotion's penalty tier) resolves its identities and estimates its body
// once: the penalty tier's tokens bucket is charged the same estimate even
// when the body has changed in between. An estimate that fails is 400
// invalid_body whichever tier asked for it; a bad cost template is 400
// invalid_cost.
func TestInputsResolveOnce(t *testing.T) {
	dims := []Dimension{{Name: "user", Identity: "{http.request.header.X-User}"}}
	tiers, _ := compileTiers(dims, []Tier{
		{Name: "own", Limits: []Limit{{Dimension: "user", Capacity: 10, RefillRate: 1}}},
		{Name: "penalty", Limits: []Limit{{Dimension: "user", Capacity: 100000, RefillRate: 1, Unit: UnitTokens}}},
	}, "", 1, false)
	h := &Handler{Dimensions: dims, Estimate: &Estimate{}, keyer: bucket.NewKeyer("rl:", ""),
		IPv4Prefix: 32, IPv6Prefix: 64, idSources: []idSource{newIDSource(dims[0].Identity)}}
	if err := h.Estimate.provision(); err != nil {
		t.Fatal(err)
	}
	newInputs := func(body string) (*inputs, *http.Request) {
		r := httptest.NewRequest("POST", "/", strings.NewReader(body))
		r.Header.Set("X-User", "alice")
		repl := caddy.NewReplacer()
		repl.Set("http.request.header.X-User", "alice")
		return &inputs{r: r, repl: repl}, r
	}

	in, r := newInputs(`{"prompt":"abcdefgh","max_tokens":10}`) // 2 + 10 tokens
	if req, err := h.buildRequest(in, tiers["own"]); err != nil || len(req.takes) != 1 || req.takes[0].Cost != 1 {
		t.Fatalf("own tier: %+v, %v; want one bucket charged 1", req, err)
	}
	if req, err := h.buildRequest(in, tiers["penalty"]); err != nil || req.takes[0].Cost != 12 {
		t.Fatalf("penalty tier, first estimate: %+v, %v; want 12", req, err)
	}
	r.Body = io.NopCloser(strings.NewReader(`{"prompt":"` + strings.Repeat("a", 400) + `","max_tokens":10}`))
	req, err := h.buildRequest(in, tiers["penalty"])
	if err != nil || req.takes[0].Cost != 12 || in.ids[0] != "alice" {
		t.Fatalf("penalty tier again: %+v, %v; want the estimate of 12 kept", req, err)
	}
	if !req.priced || req.cost != 12 { // {http.token_bucket.cost} when it decides
		t.Errorf("the request's price: %v, %d; want 12", req.priced, req.cost)
	}

	in, _ = newInputs(`not json`)
	if _, err := h.buildRequest(in, tiers["own"]); err != nil {
		t.Fatalf("own tier has no tokens limit, so no estimate: %v", err)
	}
	_, err = h.buildRequest(in, tiers["penalty"])
	w := httptest.NewRecorder()
	if rerr := h.rejectInput(w, err); rerr != nil || w.Code != 400 || !strings.Contains(w.Body.String(), `"error":"invalid_body"`) {
		t.Errorf("bad body on the penalty tier: %v, %d %s; want 400 invalid_body", rerr, w.Code, w.Body)
	}

	h.Estimate, h.Cost, h.cost = nil, "{http.request.header.X-Cost}", -1
	in, _ = newInputs(`{}`)
	in.repl.Set("http.request.header.X-Cost", "1.5")
	_, err = h.buildRequest(in, tiers["penalty"])
	w = httptest.NewRecorder()
	if rerr := h.rejectInput(w, err); rerr != nil || w.Code != 400 || !strings.Contains(w.Body.String(), `"error":"invalid_cost"`) {
		t.Errorf("bad cost: %v, %d %s; want 400 invalid_cost", rerr, w.Code, w.Body)
	}
	v := invalidVerdict(tiers["penalty"], err)
	h.record(&exchange{inputs: *in}, &v)
	if v, _ := in.repl.Get("http.token_bucket.decision"); v != "invalid_cost" {
		t.Errorf("{http.token_bucket.decision} = %v, want invalid_cost", v)
	}
}

// TestLocalShareScalesEveryLimit: local_share scales the capacity and the
// refill of every token bucket, also where rate × share has no short
// fraction in binary (the shipped Kubernetes example: 500/1m and 1000/1m
// with local_share 0.33, 3 replicas). Each local limit holds ⌊C·share⌋
// tokens refilled at exactly r·share tokens a second.
func TestLocalShareScalesEveryLimit(t *testing.T) {
	for _, tc := range []struct {
		capacity int64
		rate     float64 // tokens a second
		share    float64
		wantCap  int64
		wantRate *big.Rat
	}{
		{500, 500.0 / 60, 0.33, 165, big.NewRat(11, 4)},
		{1000, 1000.0 / 60, 0.33, 330, big.NewRat(11, 2)},
		{300, 5, 0.33, 99, big.NewRat(33, 20)},
		{3000, 50, 1.0 / 3, 1000, big.NewRat(50, 3)},
		{200000, 200000.0 / 60, 0.2, 40000, big.NewRat(2000, 3)},
		{20000, 20000.0 / 60, 0.3, 6000, big.NewRat(100, 1)},
		{100, 1, 0.29, 29, big.NewRat(29, 100)}, // 100 × 0.29 is 28.999999999999996 in binary
	} {
		tiers, _ := compileTiers([]Dimension{{Name: "api_key"}}, []Tier{{Name: "pro", Limits: []Limit{
			{Dimension: "api_key", Capacity: tc.capacity, RefillRate: tc.rate},
		}}}, "", tc.share, false)
		l := tiers["pro"].limits[0].local
		got := new(big.Rat).SetFrac(big.NewInt(l.Refill*1_000_000), big.NewInt(l.Scale))
		if l.Capacity != tc.wantCap || got.Cmp(tc.wantRate) != 0 {
			t.Errorf("%d at %v/s × %v: local %d tokens at %s/s, want %d at %s/s",
				tc.capacity, tc.rate, tc.share, l.Capacity, got.RatString(), tc.wantCap, tc.wantRate.RatString())
		}
	}
}
