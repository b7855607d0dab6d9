package tokenbucket

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
)

// Hostile requests, end to end through the in-process Caddy (caddytest)
// and a real Redis: every case asserts the exact status and reads Redis to
// check that no bucket was charged that should not be, and that the bucket
// that should be was charged exactly.

// hostileSite is a token_bucket on the X-User header and the u query
// parameter, 10 requests at 1 an hour each, answering with the tier.
// on_redis_error deny: a Redis failure shows as 503, never as a pass.
const hostileSite = `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		dimension q {http.request.uri.query.u}
		tier free {
			user 10 1/1h
			q 10 1/1h
		}
		on_redis_error deny
	}
	respond "{http.token_bucket.tier}"`

// hostileResult is what a hostile test reads of a response.
type hostileResult struct {
	status int
	header http.Header
	body   string
}

// hostileDo sends req with a client of its own and reads the response.
func hostileDo(t *testing.T, req *http.Request) (hostileResult, error) {
	t.Helper()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	res, err := (&http.Client{Transport: tr, Timeout: time.Minute}).Do(req)
	if err != nil {
		return hostileResult{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return hostileResult{status: res.StatusCode, header: res.Header, body: string(b)}, err
}

// hostileGet sends GET base+path with the headers given as name, value
// pairs (each added, so a name may repeat) and fails the test on a
// transport error.
func hostileGet(t *testing.T, base, path string, headers ...string) hostileResult {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, strings.TrimSuffix(base, "/")+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	r, err := hostileDo(t, req)
	if err != nil {
		t.Fatalf("GET %.60s: %v", path, err)
	}
	return r
}

// hostileRaw writes a raw HTTP/1.1 request (head lines joined with CRLF)
// to addr and returns the status code of the answer.
func hostileRaw(t *testing.T, addr string, lines ...string) int {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := io.WriteString(c, strings.Join(lines, "\r\n")+"\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the answer to %q: %v", lines, err)
	}
	res.Body.Close()
	return res.StatusCode
}

// hostileKeys returns the sorted keys of rdb.
func hostileKeys(t *testing.T, g interface{ keys() []string }) []string {
	t.Helper()
	k := g.keys()
	sort.Strings(k)
	return k
}

// hostileWantKeys checks that Redis holds exactly the buckets of want
// (key → whole tokens left).
func hostileWantKeys(t *testing.T, what string, keys []string, value func(string) string, want map[string]int64) {
	t.Helper()
	if len(keys) != len(want) {
		t.Errorf("%s: %d keys %q, want %d", what, len(keys), keys, len(want))
	}
	for key, tokens := range want {
		got, ok := decodeTokens(t, value(key))
		if !ok {
			got = -1 // no key: a full bucket
		}
		if got != tokens {
			t.Errorf("%s: bucket %s holds %d tokens, want %d", what, key, got, tokens)
		}
	}
}

// hostileLoad loads site into the gateway's Caddy with extra lines in the
// global options block (e.g. a servers block).
func hostileLoad(t *testing.T, g *e2eGateway, globalExtra, site string) {
	t.Helper()
	// A fresh port, as e2eGateway.load takes: a connection made right after
	// a reload on the same port can land in the old listener and be reset.
	g.port = redistest.FreePort(t)
	g.url = "http://127.0.0.1:" + strconv.Itoa(g.port) + "/"
	global := globalOptions(g.port)
	end := strings.LastIndex(global, "}")
	cfg := global[:end] + globalExtra + "\n" + global[end:] +
		fmt.Sprintf(":%d {\n%s\n}\n", g.port, strings.ReplaceAll(site, "REDIS_ADDR", g.redis.Addr))
	if err := postLoad(cfg, "caddyfile"); err != nil {
		t.Fatalf("loading the config: %v\n%s", err, cfg)
	}
}

// TestHostileHeaderSizes: Caddy's default max_header_size (16 KB) answers a
// 64 KB identity or 1,000 small headers with 431 before the handler runs,
// so nothing is charged; 300 headers within the limit pass and charge the
// user's bucket once. Two X-User fields are the identity of the first,
// the same as one field holding "a"; one field holding "a,b" is another
// identity. With max_header_size 1MB, a
// 64 KB identity gets its own bucket with a key of the usual length, and
// one that differs in its last byte another.
func TestHostileHeaderSizes(t *testing.T) {
	g := startGateway(t, hostileSite)
	k := bucket.NewKeyer("rl:", "")
	big := strings.Repeat("x", 64<<10)
	if r := hostileGet(t, g.url, "/", "X-User", big); r.status != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("64 KB identity: status %d, want 431", r.status)
	}
	many := make([]string, 0, 2000)
	for i := 0; i < 1000; i++ {
		many = append(many, fmt.Sprintf("X-Pad-%04d", i), "0123456789abcdef")
	}
	if r := hostileGet(t, g.url, "/", append(many, "X-User", "padded")...); r.status != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("1,000 headers: status %d, want 431", r.status)
	}
	if keys := hostileKeys(t, g); len(keys) != 0 {
		t.Fatalf("rejected requests wrote %q", keys)
	}
	if r := hostileGet(t, g.url, "/", append(many[:600], "X-User", "padded")...); r.status != http.StatusOK {
		t.Errorf("300 headers: status %d, want 200", r.status)
	}
	if r := hostileGet(t, g.url, "/", "X-User", "a", "X-User", "b"); r.status != http.StatusOK {
		t.Errorf("two X-User fields: status %d, want 200", r.status)
	}
	if r := hostileGet(t, g.url, "/", "X-User", "a"); r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "8" {
		t.Errorf("X-User a after two fields a and b: %d, remaining %q; want 200, 8 (one bucket)", r.status, r.header.Get("X-RateLimit-Remaining"))
	}
	if r := hostileGet(t, g.url, "/", "X-User", "a,b"); r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "9" {
		t.Errorf("X-User a,b: %d, remaining %q; want 200, 9 (a bucket of its own)", r.status, r.header.Get("X-RateLimit-Remaining"))
	}
	hostileWantKeys(t, "default header limit", hostileKeys(t, g), g.value, map[string]int64{
		k.Key("user", "padded", ""): 9,
		k.Key("user", "a", ""):      8,
		k.Key("user", "a,b", ""):    9,
	})

	hostileLoad(t, g, "\tservers {\n\t\tmax_header_size 1MB\n\t}", hostileSite)
	if err := g.rdb.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	other := big[:len(big)-1] + "y"
	for i, id := range []string{big, big, other} {
		if r := hostileGet(t, g.url, "/", "X-User", id); r.status != http.StatusOK {
			t.Fatalf("64 KB identity %d with max_header_size 1MB: status %d, want 200", i+1, r.status)
		}
	}
	keys := hostileKeys(t, g)
	hostileWantKeys(t, "64 KB identities", keys, g.value, map[string]int64{
		k.Key("user", big, ""):   8,
		k.Key("user", other, ""): 9,
	})
	for _, key := range keys {
		if len(key) != len("rl:{user:}")+bucket.IDLength {
			t.Errorf("key %q: %d bytes, want %d", key, len(key), len("rl:{user:}")+bucket.IDLength)
		}
	}
}

// TestHostileIdentityBytes: what HTTP lets through into an identity. Go's
// client refuses NUL, CR and LF in a header value; sent raw, Caddy (Go's
// server) answers 400 to NUL and CR in a value, a space in a name and NUL
// in the request target, so none reaches the handler. A tab inside a value
// passes; spaces around it are trimmed, so " alice " is alice; an obs-fold
// continuation line is joined with one space; bare LF line ends are read. Percent-encoding carries NUL, CR/LF, braces, unicode and invalid
// UTF-8 into a query parameter identity: each gets a bucket of its own.
// Placeholder syntax in an identity is not expanded: "{http.request.
// header.X-Other}" is a literal name, not the other header's value.
func TestHostileIdentityBytes(t *testing.T) {
	g := startGateway(t, hostileSite)
	k := bucket.NewKeyer("rl:", "")
	addr := "127.0.0.1:" + strconv.Itoa(g.port)

	for _, v := range []string{"a\x00b", "a\rb", "a\nb", "a\r\nX-Tier: gold"} {
		req, _ := http.NewRequest(http.MethodGet, g.url, nil)
		req.Header.Set("X-User", v)
		if _, err := hostileDo(t, req); err == nil || !strings.Contains(err.Error(), "invalid header field value") {
			t.Errorf("Go's client sent X-User %q: %v", v, err)
		}
	}
	for _, line := range []string{"X-User: a\x00b", "X-User: a\rb", "X-User: \x00", "X User: a"} {
		if status := hostileRaw(t, addr, "GET / HTTP/1.1", "Host: localhost", line, "Connection: close"); status != http.StatusBadRequest {
			t.Errorf("raw %q: status %d, want 400", line, status)
		}
	}
	if status := hostileRaw(t, addr, "GET /?u=a\x00b HTTP/1.1", "Host: localhost", "Connection: close"); status != http.StatusBadRequest {
		t.Errorf("raw NUL in the request target: status %d, want 400", status)
	}
	if keys := hostileKeys(t, g); len(keys) != 0 {
		t.Fatalf("rejected requests wrote %q", keys)
	}

	for _, tc := range []struct{ line, id string }{
		{"X-User: a\tb", "a\tb"},
		{"X-User:   alice \t ", "alice"},
		{"X-User: alice", "alice"},
		{"X-User: ключ-🔑", "ключ-🔑"},
		{"X-User: \xff\xfe", "\xff\xfe"},
		{"X-User: {alice}", "{alice}"},
		{"X-User: folded\r\n line", "folded line"}, // obs-fold: joined with a space
		{"X-User: folded\r\n\tline", "folded line"},
	} {
		if status := hostileRaw(t, addr, "GET / HTTP/1.1", "Host: localhost", tc.line, "Connection: close"); status != http.StatusOK {
			t.Errorf("raw %q: status %d, want 200", tc.line, status)
		}
	}
	// Bare LF line ends are read as CRLF.
	if status := hostileRaw(t, addr, "GET / HTTP/1.1\nHost: localhost\nX-User: bare-lf\nConnection: close"); status != http.StatusOK {
		t.Errorf("bare LF line ends: status %d, want 200", status)
	}
	r := hostileGet(t, g.url, "/", "X-User", "{http.request.header.X-Other}", "X-Other", "alice")
	if r.status != http.StatusOK {
		t.Errorf("placeholder identity: status %d", r.status)
	}
	queries := []string{"a\x00b", "a\r\nb", "{bob}", "}{", "ü", "\xff", "a b", strings.Repeat("%", 2000)}
	for _, q := range queries {
		if r := hostileGet(t, g.url, "/?u="+url.QueryEscape(q)); r.status != http.StatusOK {
			t.Errorf("query identity %.40q: status %d, want 200", q, r.status)
		}
	}
	want := map[string]int64{
		k.Key("user", "a\tb", ""):                          9,
		k.Key("user", "alice", ""):                         8,
		k.Key("user", "ключ-🔑", ""):                        9,
		k.Key("user", "\xff\xfe", ""):                      9,
		k.Key("user", "{alice}", ""):                       9,
		k.Key("user", "folded line", ""):                   8,
		k.Key("user", "bare-lf", ""):                       9,
		k.Key("user", "{http.request.header.X-Other}", ""): 9,
	}
	for _, q := range queries {
		want[k.Key("q", q, "")] = 9
	}
	hostileWantKeys(t, "identities", hostileKeys(t, g), g.value, want)
}

// hostileIPSite limits {client_ip} to 3 requests an hour.
const hostileIPSite = `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension ip {client_ip}
		tier free {
			ip 3 1/1h
		}
		on_redis_error deny
	}
	respond "ok"`

// TestHostileForwardedFor: without trusted_proxies, {client_ip} is the
// peer: spoofed X-Forwarded-For, X-Real-IP and Forwarded headers all land
// in the peer's bucket, which denies the fourth request. With
// trusted_proxies static 127.0.0.1/8 the left-most valid address of
// X-Forwarded-For is the client: IPv4 addresses get their /32, IPv6
// addresses inside one /64 share a bucket and another /64 has its own, an
// IPv4-mapped IPv6 address is its IPv4 address, and a header with no valid
// address falls back to the peer.
func TestHostileForwardedFor(t *testing.T) {
	g := startGateway(t, hostileIPSite)
	k := bucket.NewKeyer("rl:", "")
	spoofs := [][]string{
		{"X-Forwarded-For", "203.0.113.9"},
		{"X-Forwarded-For", "2001:db8::1, 198.51.100.7", "X-Real-IP", "198.51.100.8"},
		{"Forwarded", "for=192.0.2.60;proto=http", "X-Forwarded-For", "10.1.2.3"},
		{"X-Forwarded-For", "203.0.113.10"},
	}
	for i, h := range spoofs {
		want := http.StatusOK
		if i == 3 {
			want = http.StatusTooManyRequests
		}
		if r := hostileGet(t, g.url, "/", h...); r.status != want {
			t.Errorf("untrusted peer, %q: status %d, want %d", h, r.status, want)
		}
	}
	hostileWantKeys(t, "untrusted peer", hostileKeys(t, g), g.value, map[string]int64{k.Key("ip", "127.0.0.1/32", ""): 0})

	hostileLoad(t, g, "\tservers {\n\t\ttrusted_proxies static 127.0.0.1/8\n\t}", hostileIPSite)
	if err := g.rdb.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		xff    string
		status int
	}{
		{"203.0.113.9", 200},
		{"198.51.100.7, 10.0.0.1", 200},
		{"2001:db8:1:2::1", 200},
		{"2001:db8:1:2:ffff:ffff:ffff:fffe", 200},
		{"[2001:db8:1:2:aaaa::1]:4711", 200},
		{"2001:db8:1:2::99", 429}, // the fourth in 2001:db8:1:2::/64
		{"2001:db8:1:3::1", 200},
		{"::ffff:203.0.113.9", 200},
		{"not-an-ip", 200},
	} {
		if r := hostileGet(t, g.url, "/", "X-Forwarded-For", tc.xff); r.status != tc.status {
			t.Errorf("trusted proxy, X-Forwarded-For %q: status %d, want %d", tc.xff, r.status, tc.status)
		}
	}
	hostileWantKeys(t, "trusted proxy", hostileKeys(t, g), g.value, map[string]int64{
		k.Key("ip", "203.0.113.9/32", ""):    1,
		k.Key("ip", "198.51.100.7/32", ""):   2,
		k.Key("ip", "2001:db8:1:2::/64", ""): 0,
		k.Key("ip", "2001:db8:1:3::/64", ""): 2,
		k.Key("ip", "127.0.0.1/32", ""):      2,
	})
}

// TestIPv6IdentitiesMaskedPerPrefix drives a handler in process with the
// peer addresses a client could rotate through: the addresses of one /64
// (the default ipv6_prefix) share one bucket of 5, so the sixth is denied,
// and another /64 has its own. An IPv4-mapped address is its IPv4 address,
// a zone is dropped, and an identity from a header that holds an IPv6
// address is masked the same way. With ipv6_prefix 48 and ipv4_prefix 24
// the networks are wider.
func TestIPv6IdentitiesMaskedPerPrefix(t *testing.T) {
	srv := redistest.Start(t).Addr
	handler := func(v4, v6 int, pool int) *Handler {
		return inprocHandler(t, &Handler{
			Redis:        &RedisConfig{URL: "redis://" + srv, Timeout: caddy.Duration(10 * time.Second), PoolSize: pool},
			Dimensions:   []Dimension{{Name: "ip", Identity: "{http.vars.client_ip}"}, {Name: "fwd", Identity: "{http.request.header.X-Client}"}},
			Tiers:        []Tier{{Name: "free", Limits: []Limit{{Dimension: "ip", Capacity: 5, RefillRate: 1.0 / 3600}, {Dimension: "fwd", Capacity: 5, RefillRate: 1.0 / 3600}}}},
			IPv4Prefix:   v4,
			IPv6Prefix:   v6,
			KeyPrefix:    fmt.Sprintf("v6-%d-%d:", v4, v6),
			OnRedisError: PolicyDeny,
		}, nil)
	}
	type step struct {
		remote, header string
		status         int
		remaining      string
	}
	check := func(h *Handler, steps []step) {
		t.Helper()
		for _, s := range steps {
			headers := []string{}
			if s.header != "" {
				headers = append(headers, "X-Client", s.header)
			}
			w := serveFrom(h, s.remote, headers...)
			if w.err != nil {
				t.Fatalf("ServeHTTP: %v", w.err)
			}
			if w.status != s.status || w.header.Get("X-RateLimit-Remaining") != s.remaining {
				t.Errorf("prefixes /%d /%d, peer %s, X-Client %q: %d, remaining %q; want %d, %s",
					h.IPv4Prefix, h.IPv6Prefix, s.remote, s.header, w.status, w.header.Get("X-RateLimit-Remaining"), s.status, s.remaining)
			}
		}
	}
	check(handler(0, 0, 3), []step{
		{"[2001:db8::1]:1234", "", 200, "4"},
		{"[2001:db8::ffff:1]:1", "", 200, "3"},
		{"[2001:db8:0:0:1234:5678:9abc:def0]:2", "", 200, "2"},
		{"[2001:db8::2%eth0]:3", "", 200, "1"},
		{"[2001:db8:0:0:ffff:ffff:ffff:ffff]:4", "", 200, "0"},
		{"[2001:db8::3]:5", "", 429, "0"},
		{"[2001:db8:0:1::1]:6", "", 200, "4"},
		{"[::ffff:192.0.2.7]:7", "", 200, "4"},
		{"192.0.2.7:8", "", 200, "3"},
		{"192.0.2.8:9", "2001:db8:5::1", 200, "4"},
		{"192.0.2.9:9", "2001:db8:5::abcd", 200, "3"}, // fresh ip bucket: 3 is the fwd /64's
	})
	check(handler(24, 48, 4), []step{
		{"[2001:db8::1]:1", "", 200, "4"},
		{"[2001:db8:0:ffff::1]:2", "", 200, "3"},
		{"[2001:db8:1::1]:3", "", 200, "4"},
		{"192.0.2.7:4", "", 200, "4"},
		{"192.0.2.200:5", "", 200, "3"},
		{"192.0.3.1:6", "", 200, "4"},
	})
}

// hostileCostSite has a requests limit and a tokens limit on the user,
// with the cost from the X-Cost header.
const hostileCostSite = `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		tier free {
			user 100 1/1h
			user 1000 1/1h tokens
		}
		cost {http.request.header.X-Cost}
		on_redis_error deny
	}
	respond "ok"`

// TestHostileCosts: after a charge of 7 tokens, every cost that is not an
// integer from 0 to 2^53-1 (negative, fractional, exponent, hex, signs,
// other scripts' digits, above 2^53-1, far above 2^64) is answered 400
// invalid_cost and leaves both of the user's buckets byte for byte as
// they were: the requests bucket is not charged either. Leading zeros are
// allowed ("0…07" is 7). A cost of 2^53-1 on a bucket that holds that many
// is allowed.
func TestHostileCosts(t *testing.T) {
	g := startGateway(t, hostileCostSite)
	k := bucket.NewKeyer("rl:", "")
	if r := hostileGet(t, g.url, "/", "X-User", "alice", "X-Cost", "7"); r.status != http.StatusOK {
		t.Fatalf("cost 7: status %d", r.status)
	}
	reqKey, tokKey := k.Key("user", "alice", ""), k.Key("user", "alice", UnitTokens)
	before := map[string]string{reqKey: g.value(reqKey), tokKey: g.value(tokKey)}
	requestsLeft, _ := decodeTokens(t, before[reqKey])
	tokensLeft, _ := decodeTokens(t, before[tokKey])
	if requestsLeft != 99 || tokensLeft != 993 {
		t.Fatalf("after cost 7: %d requests and %d tokens left, want 99 and 993", requestsLeft, tokensLeft)
	}
	const want = `{"error":"invalid_cost","message":"the request's cost must be an integer from 0 to 9007199254740991"}` + "\n"
	for _, cost := range []string{
		"-1", "-0", "-9007199254740991", "1.5", "0.0", "7.", ".7", "1e3", "1E3", "0x10", "0b1", "0o7", "+7", "7a", "a7",
		"1_000", "1,000", "1 000", "٣", "５", "७", "Infinity", "NaN", "null", "true", "[7]", "\"7\"",
		"9007199254740992", "9007199254740993", "18446744073709551615", "18446744073709551616",
		"99999999999999999999999999999999999999", strings.Repeat("9", 4096),
	} {
		r := hostileGet(t, g.url, "/", "X-User", "alice", "X-Cost", cost)
		if r.status != http.StatusBadRequest || r.body != want {
			t.Errorf("cost %.40q: %d %q, want 400 invalid_cost", cost, r.status, r.body)
		}
	}
	for key, v := range before {
		if got := g.value(key); got != v {
			t.Errorf("invalid costs changed %s: %q, then %q", key, v, got)
		}
	}
	if keys := hostileKeys(t, g); len(keys) != 2 {
		t.Errorf("keys %q, want only alice's two", keys)
	}
	// Leading zeros are still a decimal integer: 7 more tokens.
	if r := hostileGet(t, g.url, "/", "X-User", "alice", "X-Cost", strings.Repeat("0", 40)+"7"); r.status != http.StatusOK {
		t.Errorf("cost 0…07: status %d, want 200", r.status)
	}
	if got, _ := decodeTokens(t, g.value(tokKey)); got != 986 {
		t.Errorf("after cost 0…07: %d tokens left, want 986", got)
	}

	g.load(`
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		tier free {
			user 9007199254740991 1000000/s tokens
		}
		cost {http.request.header.X-Cost}
		on_redis_error deny
	}
	respond "ok"`)
	if r := hostileGet(t, g.url, "/", "X-User", "max", "X-Cost", "9007199254740991"); r.status != http.StatusOK || r.header.Get("X-RateLimit-Remaining") != "0" {
		t.Errorf("cost 2^53-1 on a bucket of 2^53-1: %d, remaining %q; want 200, 0", r.status, r.header.Get("X-RateLimit-Remaining"))
	}
	if r := hostileGet(t, g.url, "/", "X-User", "max2", "X-Cost", "9007199254740992"); r.status != http.StatusBadRequest {
		t.Errorf("cost 2^53: status %d, want 400", r.status)
	}
	if v := g.value(k.Key("user", "max2", UnitTokens)); v != "" {
		t.Errorf("cost 2^53 wrote %q", v)
	}
}

// TestHostileTierNames: a tier_from value that names no tier exactly (case,
// spaces inside, braces, a path, a repeated header, 8 KB) gets the default
// tier's limits, never another tier's: the body names the tier and the
// stored bucket has the default limit's scale (free: 1 token a minute,
// 6·10^7 units a token; gold: 1 an hour, 3.6·10^9). Then, with a free tier
// of 1 token an hour, a tier_from that is empty or names no tier (case
// matters) gets default_tier's RateLimit-Policy, never a tier of its
// choosing.
func TestHostileTierNames(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension user {http.request.header.X-User}
		tier_from {http.request.header.X-Tier}
		default_tier free
		tier gold {
			user 100 1/1h
		}
		tier free {
			user 3 1/1m
		}
		on_redis_error deny
	}
	respond "{http.token_bucket.tier}"`)
	k := bucket.NewKeyer("rl:", "")
	for i, tc := range []struct {
		tiers []string
		want  string
	}{
		{[]string{"gold"}, "gold"},
		{[]string{"  gold  "}, "gold"}, // field values are trimmed
		{[]string{"GOLD"}, "free"},
		{[]string{"gold\tgold"}, "free"},
		{[]string{"{tier}"}, "free"},
		{[]string{"{http.request.header.X-Tier}"}, "free"},
		{[]string{"../gold"}, "free"},
		{[]string{"gold", "gold"}, "free"}, // joined: "gold,gold"
		{[]string{"gold,"}, "free"},
		{[]string{"платина"}, "free"},
		{[]string{strings.Repeat("g", 8<<10)}, "free"},
		{nil, "free"},
	} {
		user := "tier-user-" + strconv.Itoa(i)
		headers := []string{"X-User", user}
		for _, v := range tc.tiers {
			headers = append(headers, "X-Tier", v)
		}
		r := hostileGet(t, g.url, "/", headers...)
		if r.status != http.StatusOK || r.body != tc.want {
			t.Errorf("X-Tier %.40q: %d %q, want 200 %q", tc.tiers, r.status, r.body, tc.want)
			continue
		}
		_, scale, _, err := storedBucket(g.value(k.Key("user", user, "")))
		wantScale := map[string]int64{"gold": 3_600_000_000, "free": 60_000_000}[tc.want]
		if err != nil || scale != wantScale {
			t.Errorf("X-Tier %.40q: stored scale %d (%v), want %d (tier %s)", tc.tiers, scale, err, wantScale, tc.want)
		}
	}

	// A raw header is the tier source only to drive the test; see tier_from.
	g.load(`
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		tier_from {http.request.header.X-Tier}
		default_tier free
		tier gold {
			user 100 1/1h
		}
		tier free {
			user 3 1/1h
		}
	}
	respond "{http.token_bucket.tier}"`)
	for i, tc := range []struct {
		header []string
		tier   string
		policy string
	}{
		{[]string{"X-Tier", "gold"}, "gold", `"user";q=100;w=360000`},
		{[]string{"X-Tier", "free"}, "free", `"user";q=3;w=10800`},
		{[]string{"X-Tier", "platinum"}, "free", `"user";q=3;w=10800`},
		{[]string{"X-Tier", "GOLD"}, "free", `"user";q=3;w=10800`},
		{[]string{"X-Tier", ""}, "free", `"user";q=3;w=10800`},
		{nil, "free", `"user";q=3;w=10800`},
	} {
		r := g.get(append([]string{"X-User", "user-" + strconv.Itoa(i)}, tc.header...)...)
		what := fmt.Sprintf("tier header %q", tc.header)
		if r.status != http.StatusOK || r.body != tc.tier {
			t.Errorf("%s: %d %q, want 200 %q", what, r.status, r.body, tc.tier)
		}
		wantHeaders(t, what, r.header, "RateLimit-Policy", tc.policy)
	}
}

// TestThousandConnectionsSpendExactlyCapacity opens 1,000 connections at
// once, each from a goroutine with its own Transport, for one identity at
// a bucket of 100 that refills 1 token a day: exactly 100 × 200 and 900 ×
// 429, no transport error, and the bucket left with no whole token.
// Then 200 requests at once on the gateway's one client, for one identity
// at a bucket of 50 that refills 1 token a day: the script's atomicity lets
// exactly 50 through. on_redis_error deny makes a Redis failure show as 503
// rather than as a local allow.
func TestThousandConnectionsSpendExactlyCapacity(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 30s
		}
		dimension user {http.request.header.X-User}
		tier free {
			user 100 1/1d
		}
		on_redis_error deny
	}
	respond "ok"`)
	// 1,000 clients, each on a connection of its own.
	const n = 1000
	counts := concurrentStatuses(t, n, func() (int, error) {
		tr := &http.Transport{DisableKeepAlives: true}
		defer tr.CloseIdleConnections()
		client := &http.Client{Transport: tr, Timeout: 2 * time.Minute}
		req, _ := http.NewRequest(http.MethodGet, g.url, nil)
		req.Header.Set("X-User", "swarm")
		res, err := client.Do(req)
		if err != nil {
			return 0, err
		}
		defer res.Body.Close()
		_, err = io.Copy(io.Discard, res.Body)
		return res.StatusCode, err
	})
	t.Logf("1,000 connections: %d × 200, %d × 429", counts[200], counts[429])
	if counts[200] != 100 || counts[429] != 900 || len(counts) != 2 {
		t.Errorf("statuses %v, want exactly 100 × 200 and 900 × 429", counts)
	}
	key := bucket.NewKeyer("rl:", "").Key("user", "swarm", "")
	hostileWantKeys(t, "swarm", hostileKeys(t, g), g.value, map[string]int64{key: 0})

	// 200 requests of one client over the gateway's shared connections.
	g.load(userLimit("user 50 1/1d", "on_redis_error deny") + "\nrespond \"ok\"")
	counts = concurrentStatuses(t, 200, func() (int, error) {
		r, err := g.tryGet("X-User", "agent-007")
		return r.status, err
	})
	if counts[200] != 50 || counts[429] != 150 || len(counts) != 2 {
		t.Errorf("statuses %v, want exactly 50 × 200 and 150 × 429", counts)
	}
}

// concurrentStatuses runs do n times at once, released together, and
// counts the statuses; any error fails the test.
func concurrentStatuses(t *testing.T, n int, do func() (int, error)) map[int]int {
	t.Helper()
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		counts = map[int]int{}
		errs   []error
		start  = make(chan struct{})
	)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			status, err := do()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			counts[status]++
		}()
	}
	close(start)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d of %d requests failed, first: %v", len(errs), n, errs[0])
	}
	return counts
}

// TestRepeatedIdentityHeader: a header field sent on several lines is
// identified by its first line, in a lone placeholder and in a template
// of several: the line the upstream authenticates with (Go's Header.Get,
// Node, Starlette). Caddy's placeholder joins the lines with ",", and a
// client that added a second line of its choosing used to get a new,
// full bucket per request for the same API key.
func TestRepeatedIdentityHeader(t *testing.T) {
	g := startGateway(t, `
	token_bucket {
		redis redis://REDIS_ADDR {
			timeout 10s
		}
		dimension api_key {http.request.header.Authorization}
		dimension team {http.request.header.X-Org}/{http.request.header.X-Team}
		tier free {
			api_key 3 1/1h
			team 10 1/1h
		}
	}
	respond 200`)
	send := func(i int, auth, org []string) int {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, g.url, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header["Authorization"] = auth
		req.Header["X-Org"] = org
		req.Header.Set("X-Team", "t1")
		r, err := readResponse(g.client.Do(req))
		if err != nil {
			t.Fatal(err)
		}
		return r.status
	}
	for i := range 3 {
		if st := send(i, []string{"Bearer sk-v"}, []string{"acme"}); st != http.StatusOK {
			t.Fatalf("request %d: status %d, want 200", i+1, st)
		}
	}
	for i := range 4 {
		junk := "junk" + strconv.Itoa(i)
		if st := send(i, []string{"Bearer sk-v", junk}, []string{"acme", junk}); st != http.StatusTooManyRequests {
			t.Errorf("request with a second line %q: status %d, want 429", junk, st)
		}
	}
	k := bucket.NewKeyer("rl:", "")
	apiKey, team := k.Key("api_key", "Bearer sk-v", ""), k.Key("team", "acme/t1", "")
	got := g.keys()
	sort.Strings(got)
	want := []string{apiKey, team}
	sort.Strings(want)
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("Redis holds %q, want the one API key's and the one team's buckets %q", got, want)
	}
	if n := storedTokens(t, g.rdb, team); n != 7 {
		t.Errorf("team bucket holds %d, want 7 (3 allowed requests, the denied ones charge nothing)", n)
	}
}
