package tokenbucket

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
	"github.com/token-bucket/token_bucket/internal/redistest"
	"github.com/token-bucket/token_bucket/internal/soak"
)

// gwSite is the Caddyfile of an out-of-process gateway on port: the global
// options every gateway process of the tests has (admin, "admin off" or
// "admin <host:port>"; nothing saved; every listener on 127.0.0.1; errors
// only in its log), GET /healthz, and routes, the site's other handlers.
func gwSite(port int, admin, routes string) string {
	return fmt.Sprintf(`{
	%[2]s
	persist_config off
	auto_https off
	skip_install_trust
	default_bind 127.0.0.1
	http_port %[1]d
	grace_period 1s
	log {
		level ERROR
	}
}
:%[1]d {
	handle /healthz {
		respond "ok"
	}
	handle {
%[3]s
	}
}
`, port, admin, routes)
}

// gwRoutes are the routes of each gateway of gwStart (see gwSite): two
// tiers whose user buckets refill 1 token an hour (so, over the test, never
// a whole token: the count of 200s per bucket is exact), and an org bucket
// of tokens so large that it never denies, which records the sum of the
// costs it was charged. A raw header names the tier only to drive the test
// (see tier_from). %[1]s Redis, %[2]d gateway number.
const gwRoutes = `
		token_bucket {
			redis redis://%[1]s {
				timeout 10s
			}
			dimension user {http.request.header.X-User}
			dimension org {http.request.header.X-Org}
			tier_from {http.request.header.X-Tier}
			default_tier free
			tier free {
				user 40 1/1h
				org 1000000 1/1h tokens
			}
			tier pro {
				user 70 1/1h
				org 1000000 1/1h tokens
			}
			cost {http.request.header.X-Cost}
			on_redis_error deny
		}
		respond "gateway %[2]d"`

// gwOrgCapacity is the org buckets' capacity in gwRoutes.
const gwOrgCapacity = 1_000_000

// gwCaddy returns a Caddy binary with the plugin, built with xcaddy and
// cached under ./bin by a hash of the sources (soak.BuildCaddy).
func gwCaddy(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bin, err := soak.BuildCaddy(ctx, ".", os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// gwStart starts n Caddy processes with gwRoutes on free ports, sharing
// the Redis at redisAddr, and returns their base URLs. They are stopped at
// the end of the test.
func gwStart(t *testing.T, bin, redisAddr string, n int) []string {
	t.Helper()
	urls, _ := gwStartWith(t, bin, "gateway", n, func(port, i int) string {
		return gwSite(port, "admin off", fmt.Sprintf(gwRoutes, redisAddr, i))
	})
	return urls
}

// gwStartWith starts n Caddy processes of bin, process i with the
// Caddyfile config(port, i) on a free port (it must answer /healthz), and
// returns their base URLs and processes, stopped at the end of the test.
func gwStartWith(t *testing.T, bin, name string, n int, config func(port, i int) string) ([]string, []*soak.Process) {
	t.Helper()
	dir := t.TempDir()
	urls := make([]string, n)
	procs := make([]*soak.Process, n)
	t.Cleanup(func() {
		for _, p := range procs {
			p.Stop(10 * time.Second)
		}
	})
	for i := range procs {
		port := redistest.FreePort(t)
		p, err := soak.StartCaddy(bin, dir, fmt.Sprintf("%s%d", name, i), config(port, i))
		if err != nil {
			t.Fatal(err)
		}
		procs[i] = p
		urls[i] = "http://127.0.0.1:" + strconv.Itoa(port)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i, p := range procs {
		if err := p.WaitHTTP(ctx, urls[i]+"/healthz"); err != nil {
			b, _ := os.ReadFile(p.Log)
			t.Fatalf("%v\n%s", err, b)
		}
	}
	return urls, procs
}

// gwUser is one identity of the load: its tier, org and bucket capacity.
type gwUser struct {
	name, tier, org string
	capacity        int
	requests        int
}

// gwJob is one request of the load and what came of it.
type gwJob struct {
	user    *gwUser
	gateway int
	cost    int64
	status  int
	userR   int64 // the user bucket's r in the RateLimit header
	body    string
	err     error
}

var gwUserRemaining = regexp.MustCompile(`"user";r=(\d+);t=\d+`)

// TestGatewaysShareOneRedisExactly builds Caddy with the plugin, runs three
// gateway processes on one Redis and fires thousands of requests at all
// three at once from 48 goroutines: 12 users in two tiers, 3 orgs, random
// costs. Each user bucket (capacity 40 or 70, 1 token an hour) lets exactly
// its capacity through across the gateways, the remaining counts its 200s
// report are each of capacity-1 … 0 exactly once (no two gateways saw the
// same state), and each org's tokens bucket is short by exactly the sum of
// the costs of its allowed requests (denied requests charged nothing).
func TestGatewaysShareOneRedisExactly(t *testing.T) {
	bin := gwCaddy(t)
	srv := redistest.Start(t)
	urls := gwStart(t, bin, srv.Addr, 3)

	users := gwUsers()
	jobs := gwJobs(users, len(urls))
	gwRun(t, urls, jobs, 48)

	byUser := map[*gwUser][]*gwJob{}
	perGateway := make([]int, len(urls))
	orgCharged := map[string]int64{}
	for _, j := range jobs {
		if j.err != nil {
			t.Fatalf("request for %s to gateway %d: %v", j.user.name, j.gateway, j.err)
		}
		if j.status != http.StatusOK && j.status != http.StatusTooManyRequests {
			t.Fatalf("request for %s to gateway %d: status %d %q, want 200 or 429", j.user.name, j.gateway, j.status, j.body)
		}
		byUser[j.user] = append(byUser[j.user], j)
		perGateway[j.gateway]++
		if j.status == http.StatusOK {
			orgCharged[j.user.org] += j.cost
			if want := fmt.Sprintf("gateway %d", j.gateway); j.body != want {
				t.Errorf("200 from gateway %d: body %q, want %q", j.gateway, j.body, want)
			}
		} else if !strings.HasSuffix(j.body, `,"tier":"`+j.user.tier+`","dimension":"user"}`+"\n") {
			t.Errorf("429 for %s: body %q, want a denial by the user bucket in tier %s", j.user.name, j.body, j.user.tier)
		}
	}

	ctx := context.Background()
	rdb := srv.Client(t)
	keyer := bucket.NewKeyer("rl:", "")
	t.Logf("%-8s %-5s %8s %8s %8s %8s", "bucket", "tier", "capacity", "200s", "429s", "requests")
	for _, u := range users {
		allowed, denied := 0, 0
		seen := map[int64]bool{}
		for _, j := range byUser[u] {
			if j.status != http.StatusOK {
				denied++
				continue
			}
			allowed++
			if j.userR < 0 || j.userR >= int64(u.capacity) || seen[j.userR] {
				t.Errorf("%s: a 200 reported remaining %d (twice, or out of 0..%d)", u.name, j.userR, u.capacity-1)
			}
			seen[j.userR] = true
		}
		t.Logf("%-8s %-5s %8d %8d %8d %8d", u.name, u.tier, u.capacity, allowed, denied, u.requests)
		if allowed != u.capacity || denied != u.requests-u.capacity {
			t.Errorf("%s (%s): %d × 200 and %d × 429, want exactly %d and %d", u.name, u.tier, allowed, denied, u.capacity, u.requests-u.capacity)
		}
		if got := storedTokens(t, rdb, keyer.Key("user", u.name, "")); got != 0 {
			t.Errorf("%s: user bucket holds %d whole tokens, want 0", u.name, got)
		}
	}
	for _, org := range []string{"org-a", "org-b", "org-c"} {
		want := gwOrgCapacity - orgCharged[org]
		got := storedTokens(t, rdb, keyer.Key("org", org, UnitTokens))
		t.Logf("%-8s tokens: %d allowed cost charged, %d left (want %d)", org, orgCharged[org], got, want)
		if got != want {
			t.Errorf("%s: tokens bucket holds %d, want %d - %d = %d", org, got, gwOrgCapacity, orgCharged[org], want)
		}
	}
	if n, err := rdb.DBSize(ctx).Result(); err != nil || n != int64(len(users)+3) {
		t.Errorf("Redis holds %d keys (%v), want %d: one per user and org", n, err, len(users)+3)
	}
	for i, n := range perGateway {
		if n != len(jobs)/len(urls) {
			t.Errorf("gateway %d answered %d requests, want %d", i, n, len(jobs)/len(urls))
		}
	}
	t.Logf("%d requests, %d per gateway", len(jobs), len(jobs)/len(urls))
}

// gwUsers returns 6 free users (capacity 40) and 6 pro users (capacity 70)
// in 3 orgs, each sending several times its capacity.
func gwUsers() []*gwUser {
	var users []*gwUser
	orgs := []string{"org-a", "org-b", "org-c"}
	for i := 0; i < 12; i++ {
		u := &gwUser{name: "free-" + strconv.Itoa(i), tier: "free", capacity: 40, requests: 250 + 5*i, org: orgs[i%3]}
		if i%2 == 1 {
			u.name, u.tier, u.capacity, u.requests = "pro-"+strconv.Itoa(i), "pro", 70, 330+5*i
		}
		users = append(users, u)
	}
	return users
}

// gwJobs returns every user's requests, shuffled, spread evenly over the
// gateways, with costs from 1 to 50.
func gwJobs(users []*gwUser, gateways int) []*gwJob {
	r := rand.New(rand.NewPCG(2026, 11))
	var jobs []*gwJob
	for _, u := range users {
		for k := 0; k < u.requests; k++ {
			jobs = append(jobs, &gwJob{user: u, cost: 1 + r.Int64N(50)})
		}
	}
	r.Shuffle(len(jobs), func(i, j int) { jobs[i], jobs[j] = jobs[j], jobs[i] })
	jobs = jobs[:len(jobs)/gateways*gateways]
	for i, j := range jobs {
		j.gateway = i % gateways
	}
	// Trim the users' request counts to the jobs kept.
	for _, u := range users {
		u.requests = 0
	}
	for _, j := range jobs {
		j.user.requests++
	}
	return jobs
}

// gwRun sends the jobs from workers goroutines, all released at once.
func gwRun(t *testing.T, urls []string, jobs []*gwJob, workers int) {
	t.Helper()
	tr := &http.Transport{MaxIdleConnsPerHost: workers, MaxConnsPerHost: workers}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	queue := make(chan *gwJob, len(jobs))
	for _, j := range jobs {
		queue <- j
	}
	close(queue)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for j := range queue {
				gwDo(client, urls[j.gateway], j)
			}
		}()
	}
	close(start)
	wg.Wait()
}

func gwDo(client *http.Client, url string, j *gwJob) {
	req, err := http.NewRequest(http.MethodGet, url+"/v1/chat/completions", nil)
	if err != nil {
		j.err = err
		return
	}
	req.Header.Set("X-User", j.user.name)
	req.Header.Set("X-Org", j.user.org)
	req.Header.Set("X-Tier", j.user.tier)
	req.Header.Set("X-Cost", strconv.FormatInt(j.cost, 10))
	res, err := client.Do(req)
	if err != nil {
		j.err = err
		return
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	j.status, j.body, j.err = res.StatusCode, string(b), err
	j.userR = -1
	if m := gwUserRemaining.FindStringSubmatch(res.Header.Get("RateLimit")); m != nil {
		j.userR, _ = strconv.ParseInt(m[1], 10, 64)
	}
}

var storedTextRE = regexp.MustCompile(`^-?[0-9]+ [0-9]+ [0-9]+$`)

// storedBucket decodes a bucket's value as the Lua script writes it: the
// text "<units> <scale> <last_us>", or 24 bytes of three little-endian
// doubles (struct.pack('<ddd', ...)).
func storedBucket(v string) (units, scale, last int64, err error) {
	if storedTextRE.MatchString(v) {
		f := strings.Fields(v)
		var n [3]int64
		for i := range f {
			if n[i], err = strconv.ParseInt(f[i], 10, 64); err != nil {
				return 0, 0, 0, fmt.Errorf("bucket value %q: %v", v, err)
			}
		}
		return n[0], n[1], n[2], nil
	}
	if len(v) == 24 {
		var n [3]int64
		for i := range n {
			f := math.Float64frombits(binary.LittleEndian.Uint64([]byte(v[8*i : 8*i+8])))
			if f != math.Trunc(f) || math.Abs(f) > 1<<53 {
				return 0, 0, 0, fmt.Errorf("bucket value %q: %v is not an exact integer", v, f)
			}
			n[i] = int64(f)
		}
		return n[0], n[1], n[2], nil
	}
	return 0, 0, 0, fmt.Errorf("bucket value %q: neither \"<units> <scale> <last_us>\" nor 24 bytes", v)
}

// inprocHandler provisions h as Caddy would and cleans it up at the end of
// the test. A non-nil now replaces the handler's clock.
func inprocHandler(t *testing.T, h *Handler, now func() time.Time) *Handler {
	t.Helper()
	h.now = now
	return provisionHandler(t, h)
}

// inprocUserHandler is a handler with one user dimension (from the X-User
// header) limited to capacity at 1 token an hour, deciding in the Redis at
// addr; poolSize makes handlers use distinct clients.
func inprocUserHandler(addr string, capacity int64, poolSize int) *Handler {
	return &Handler{
		Redis:        &RedisConfig{URL: "redis://" + addr, Timeout: caddy.Duration(10 * time.Second), PoolSize: poolSize},
		Dimensions:   []Dimension{{Name: "user", Identity: "{http.request.header.X-User}"}},
		Tiers:        []Tier{{Name: "free", Limits: []Limit{{Dimension: "user", Capacity: capacity, RefillRate: 1.0 / 3600}}}},
		OnRedisError: PolicyDeny,
	}
}

// TestSkewedGatewayClocksDecideAlike: two handlers on one Redis, one whose
// clock runs an hour ahead (an hour refills a whole token here), take turns
// on the same bucket. Redis TIME decides, so together they admit exactly
// the capacity, the remaining counts go down by one whatever the handler,
// both deny alike with the same Retry-After, and the stored timestamp is
// the Redis clock's, not the skewed one.
func TestSkewedGatewayClocksDecideAlike(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	const capacity = 10
	ahead := inprocHandler(t, inprocUserHandler(srv.Addr, capacity, 3), func() time.Time { return time.Now().Add(time.Hour) })
	onTime := inprocHandler(t, inprocUserHandler(srv.Addr, capacity, 4), nil)
	handlers := []*Handler{onTime, ahead}

	before, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < capacity; i++ {
		h := handlers[i%2]
		w := serveFrom(h, "192.0.2.1:1234", "X-User", "alice")
		if w.err != nil {
			t.Fatalf("ServeHTTP: %v", w.err)
		}
		want := strconv.Itoa(capacity - 1 - i)
		if w.status != http.StatusOK || w.header.Get("X-RateLimit-Remaining") != want {
			t.Fatalf("request %d (handler %d): %d, remaining %q; want 200, %s", i+1, i%2, w.status, w.header.Get("X-RateLimit-Remaining"), want)
		}
	}
	after, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	var denials []string
	for i, h := range []*Handler{ahead, onTime, ahead, onTime} {
		w := serveFrom(h, "192.0.2.1:1234", "X-User", "alice")
		if w.err != nil {
			t.Fatalf("ServeHTTP: %v", w.err)
		}
		if w.status != http.StatusTooManyRequests {
			t.Fatalf("denial %d: status %d, want 429", i+1, w.status)
		}
		denials = append(denials, w.header.Get("Retry-After")+" "+w.header.Get("X-RateLimit-Remaining")+" "+w.header.Get("RateLimit-Policy"))
	}
	for i, d := range denials {
		if d != `3600 0 "user";q=10;w=36000` {
			t.Errorf("denial %d: Retry-After, remaining, policy = %q; want 3600 0 \"user\";q=10;w=36000", i+1, d)
		}
	}
	v, err := rdb.Get(ctx, bucket.NewKeyer("rl:", "").Key("user", "alice", "")).Result()
	if err != nil {
		t.Fatal(err)
	}
	units, scale, last, err := storedBucket(v)
	if err != nil {
		t.Fatal(err)
	}
	if units/scale != 0 || last < before.UnixMicro() || last > after.UnixMicro() {
		t.Errorf("stored %d units (scale %d) at %d µs; want 0 whole tokens at a Redis time in [%d, %d]",
			units, scale, last, before.UnixMicro(), after.UnixMicro())
	}
	if onTime.conn == ahead.conn {
		t.Errorf("the handlers share one Redis client; the test wants two")
	}
	keys := make([]string, 0, 1)
	iter := rdb.Scan(ctx, 0, "*", 100).Iterator()
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	sort.Strings(keys)
	if len(keys) != 1 {
		t.Errorf("keys %q, want the one user bucket", keys)
	}
}
