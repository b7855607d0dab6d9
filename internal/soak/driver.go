package soak

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"
)

// Config is a soak run.
type Config struct {
	Repo         string        // the module's directory
	Duration     time.Duration // how long the load runs (default 3m)
	RedisRestart time.Duration // how often Redis is killed and restarted on its port (default 30s)
	RedisDown    time.Duration // how long Redis stays down each time (default 2s)
	Reload       time.Duration // how often the config is reloaded through the admin API (default 10s)
	Warmup       time.Duration // load before the start sample (default 15s)
	Workers      int           // load goroutines (default 16)
	RPS          int           // steady request rate (default 400)

	// Bounds on growth from the start sample to the end sample.
	MaxGoroutineGrowth   int     // default 50
	MaxRedisClientGrowth int     // default 5
	MaxHeapRatio         float64 // default 2

	Out io.Writer // progress and the figures table (default os.Stdout)
}

func (c *Config) defaults() {
	set := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	set(&c.Duration, 3*time.Minute)
	set(&c.RedisRestart, 30*time.Second)
	set(&c.RedisDown, 2*time.Second)
	set(&c.Reload, 10*time.Second)
	set(&c.Warmup, 15*time.Second)
	if c.Workers <= 0 {
		c.Workers = 16
	}
	if c.RPS <= 0 {
		c.RPS = 400
	}
	if c.MaxGoroutineGrowth <= 0 {
		c.MaxGoroutineGrowth = 50
	}
	if c.MaxRedisClientGrowth <= 0 {
		c.MaxRedisClientGrowth = 5
	}
	if c.MaxHeapRatio <= 0 {
		c.MaxHeapRatio = 2
	}
	if c.Out == nil {
		c.Out = os.Stdout
	}
	if c.Repo == "" {
		c.Repo = "."
	}
}

// soakCaddyfile is the gateway under soak: two tiers, a user and an IP
// dimension, costs from a header, on_redis_error local (so Redis restarts
// show as local decisions, never as errors). GENERATION is replaced on
// each reload so that the driver can see the new config answer. The Redis
// pool is bounded so that the number of connections one healthy client
// holds is known: more than that is a leaked client.
const soakCaddyfile = `{
	admin 127.0.0.1:%[1]d
	persist_config off
	auto_https off
	skip_install_trust
	default_bind 127.0.0.1
	http_port %[2]d
	grace_period 2s
	log {
		level WARN
	}
}
:%[2]d {
	handle /healthz {
		respond "ok"
	}
	handle {
		token_bucket {
			redis redis://127.0.0.1:%[3]d {
				timeout 100ms
				breaker_cooldown 1s
				pool_size %[4]d
			}
			dimension user {http.request.header.X-User}
			dimension ip {client_ip}
			tier_from {http.request.header.X-Tier}
			default_tier free
			tier free {
				user 20 2/s
				user 400 40/s tokens
				ip 100000 10000/s
			}
			tier pro {
				user 100 10/s
				user 2000 200/s tokens
				ip 100000 10000/s
			}
			cost {http.request.header.X-Cost}
			on_redis_error local
		}
		respond "gen GENERATION"
	}
}
`

// soakPoolSize is the gateway's Redis pool_size: one client holds at most
// that many connections, however bursty the load.
const soakPoolSize = 8

// Sample is what the driver measures of the gateway at one moment, with
// the load paused.
type Sample struct {
	Goroutines   int
	RedisClients int // connected clients, the sampler's own excluded
	HeapAlloc    uint64
	HeapInuse    uint64
	RSS          uint64 // bytes
	FDs          int
}

// Counts are the load's outcomes.
type Counts struct {
	Requests, OK, Limited, Other, Errors int64
	FirstError                           atomic.Value
}

// Report is the outcome of a soak run.
type Report struct {
	Start, End     Sample
	Counts         *Counts
	RedisRestarts  int
	Reloads        int
	ReloadsSeen    int // reloads whose config answered a probe
	LateReloads    int // reloads whose first probe still met the old server
	HandoverProbes int // probes answered by the old server or reset, in all
	Elapsed        time.Duration
	Failures       []string
	Dir            string
	GatewayLogPath string
}

// Run builds Caddy with the plugin (cached), starts Redis and one Caddy,
// drives a steady load while restarting Redis and reloading the config,
// samples the gateway after the warm-up and at the end, and checks the
// growth against the bounds. It stops by itself after the duration.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.defaults()
	dir, err := os.MkdirTemp("", "token_bucket_soak")
	if err != nil {
		return nil, err
	}
	r := &soakRun{cfg: cfg, rep: &Report{Dir: dir, Counts: &Counts{}}}
	defer r.stop()
	if err := r.setup(ctx); err != nil {
		return r.rep, err
	}
	return r.rep, r.loop(ctx)
}

// soakRun is one soak run's processes and state.
type soakRun struct {
	cfg        Config
	rep        *Report
	redis      *redisSupervisor
	gw         *Process
	base       string // the gateway's URL
	admin      string // its admin endpoint
	configJSON string // the adapted config, with the GENERATION marker
}

// setup builds Caddy and starts Redis and the gateway.
func (r *soakRun) setup(ctx context.Context) error {
	bin, err := BuildCaddy(ctx, r.cfg.Repo, r.cfg.Out)
	if err != nil {
		return err
	}
	var ports [3]int
	for i := range ports {
		if ports[i], err = FreePort(); err != nil {
			return err
		}
	}
	adminPort, httpPort, redisPort := ports[0], ports[1], ports[2]
	r.redis = &redisSupervisor{dir: r.rep.Dir, port: redisPort}
	if err := r.redis.start(ctx); err != nil {
		return err
	}
	caddyfile := fmt.Sprintf(soakCaddyfile, adminPort, httpPort, redisPort, soakPoolSize)
	if r.configJSON, err = adapt(ctx, bin, r.rep.Dir, caddyfile); err != nil {
		return err
	}
	if r.gw, err = StartCaddy(bin, r.rep.Dir, "gateway", strings.Replace(caddyfile, "GENERATION", "0", 1)); err != nil {
		return err
	}
	r.rep.GatewayLogPath = r.gw.Log
	r.base = "http://127.0.0.1:" + strconv.Itoa(httpPort)
	r.admin = "http://127.0.0.1:" + strconv.Itoa(adminPort)
	readyCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := r.gw.WaitHTTP(readyCtx, r.base+"/healthz"); err != nil {
		return err
	}
	fmt.Fprintf(r.cfg.Out, "soak: gateway %s (admin %s, pid %d), redis 127.0.0.1:%d; %s of load at %d req/s; Redis restart every %s, reload every %s\n",
		r.base, r.admin, r.gw.Pid(), redisPort, r.cfg.Duration, r.cfg.RPS, r.cfg.RedisRestart, r.cfg.Reload)
	return nil
}

// stop stops the gateway, then Redis.
func (r *soakRun) stop() {
	r.gw.Stop(10 * time.Second)
	if r.redis != nil {
		r.redis.stop()
	}
}

// loop runs the load and the chaos until the duration is over, taking the
// start sample after the warm-up and the end sample last.
func (r *soakRun) loop(ctx context.Context) error {
	cfg, rep := r.cfg, r.rep
	load := newLoad(r.base, cfg.Workers, cfg.RPS, rep.Counts)
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	loadDone := load.run(loadCtx)

	start := time.Now()
	deadline := start.Add(cfg.Duration)
	warm, end := time.NewTimer(cfg.Warmup), time.NewTimer(cfg.Duration)
	restart, reload, progress := time.NewTicker(cfg.RedisRestart), time.NewTicker(cfg.Reload), time.NewTicker(30*time.Second)
	defer restart.Stop()
	defer reload.Stop()
	defer progress.Stop()
	for done := false; !done; {
		var err error
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-warm.C:
			if rep.Start, err = load.paused(r.sample); err != nil {
				return fmt.Errorf("start sample: %w", err)
			}
		case <-restart.C:
			if time.Until(deadline) < cfg.RedisRestart/2 {
				continue // leave Redis up for a while before the end sample
			}
			if err := r.redis.restart(ctx, cfg.RedisDown); err != nil {
				return err
			}
			rep.RedisRestarts++
		case <-reload.C:
			rep.Reloads++
			extra, err := reloadConfig(r.admin, r.base, r.configJSON, rep.Reloads)
			rep.HandoverProbes += extra
			if extra > 0 {
				rep.LateReloads++
			}
			if err != nil {
				rep.Failures = append(rep.Failures, err.Error())
			} else {
				rep.ReloadsSeen++
			}
		case <-progress.C:
			r.progress(time.Since(start))
		case <-end.C:
			done = true
		}
	}
	end.Stop()
	if rep.Start.Goroutines == 0 {
		rep.Failures = append(rep.Failures, "the run ended before the warm-up sample; give a duration longer than the warm-up")
	}
	var err error
	if rep.End, err = load.paused(r.sample); err != nil {
		return fmt.Errorf("end sample: %w", err)
	}
	stopLoad()
	<-loadDone
	rep.Elapsed = time.Since(start)
	rep.check(cfg)
	return nil
}

func (r *soakRun) sample() (Sample, error) { return sample(r.admin, r.redis.port, r.gw.Pid()) }

func (r *soakRun) progress(elapsed time.Duration) {
	c := r.rep.Counts
	fmt.Fprintf(r.cfg.Out, "soak: %s: %d requests (%d × 200, %d × 429, %d other, %d errors), %d Redis restarts, %d reloads\n",
		elapsed.Round(time.Second), atomic.LoadInt64(&c.Requests), atomic.LoadInt64(&c.OK), atomic.LoadInt64(&c.Limited),
		atomic.LoadInt64(&c.Other), atomic.LoadInt64(&c.Errors), r.rep.RedisRestarts, r.rep.Reloads)
}

// check records every bound the run broke.
func (rep *Report) check(cfg Config) {
	s, e, c := rep.Start, rep.End, rep.Counts
	if e.Goroutines > s.Goroutines+cfg.MaxGoroutineGrowth {
		rep.Failures = append(rep.Failures, fmt.Sprintf("goroutines grew from %d to %d (bound +%d)", s.Goroutines, e.Goroutines, cfg.MaxGoroutineGrowth))
	}
	// The pool opens connections up to pool_size as bursts come, so the
	// start sample may hold fewer than the end: the bound is on top of a
	// full pool.
	if e.RedisClients > max(s.RedisClients, soakPoolSize)+cfg.MaxRedisClientGrowth {
		rep.Failures = append(rep.Failures, fmt.Sprintf("Redis clients grew from %d to %d (bound: max(start, pool_size %d) + %d)",
			s.RedisClients, e.RedisClients, soakPoolSize, cfg.MaxRedisClientGrowth))
	}
	if float64(e.HeapAlloc) > cfg.MaxHeapRatio*float64(s.HeapAlloc) {
		rep.Failures = append(rep.Failures, fmt.Sprintf("heap grew from %d to %d bytes (bound %.1f×)", s.HeapAlloc, e.HeapAlloc, cfg.MaxHeapRatio))
	}
	if c.Errors > 0 {
		rep.Failures = append(rep.Failures, fmt.Sprintf("%d requests failed, first: %v", c.Errors, c.FirstError.Load()))
	}
	if c.Other > 0 {
		rep.Failures = append(rep.Failures, fmt.Sprintf("%d answers were neither 200 nor 429", c.Other))
	}
	if c.OK == 0 || c.Limited == 0 {
		rep.Failures = append(rep.Failures, fmt.Sprintf("the load saw %d × 200 and %d × 429; want both", c.OK, c.Limited))
	}
}

// Print writes the figures table.
func (rep *Report) Print(w io.Writer, cfg Config) {
	cfg.defaults()
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	mb := func(b uint64) string { return strconv.FormatFloat(float64(b)/(1<<20), 'f', 1, 64) }
	fmt.Fprintln(tw, "figure\tstart\tend\tbound\t")
	fmt.Fprintf(tw, "goroutines\t%d\t%d\t≤ start+%d\t\n", rep.Start.Goroutines, rep.End.Goroutines, cfg.MaxGoroutineGrowth)
	fmt.Fprintf(tw, "redis clients\t%d\t%d\t≤ max(start, pool %d)+%d\t\n", rep.Start.RedisClients, rep.End.RedisClients, soakPoolSize, cfg.MaxRedisClientGrowth)
	fmt.Fprintf(tw, "heap alloc after GC (MB)\t%s\t%s\t≤ %.1f× start\t\n", mb(rep.Start.HeapAlloc), mb(rep.End.HeapAlloc), cfg.MaxHeapRatio)
	fmt.Fprintf(tw, "heap in use (MB)\t%s\t%s\t-\t\n", mb(rep.Start.HeapInuse), mb(rep.End.HeapInuse))
	fmt.Fprintf(tw, "caddy RSS (MB)\t%s\t%s\t-\t\n", mb(rep.Start.RSS), mb(rep.End.RSS))
	fmt.Fprintf(tw, "caddy open fds\t%d\t%d\t-\t\n", rep.Start.FDs, rep.End.FDs)
	tw.Flush()
	c := rep.Counts
	fmt.Fprintf(w, "load: %d requests in %s (%.0f/s): %d × 200, %d × 429, %d other, %d errors\n",
		c.Requests, rep.Elapsed.Round(time.Second), float64(c.Requests)/rep.Elapsed.Seconds(), c.OK, c.Limited, c.Other, c.Errors)
	fmt.Fprintf(w, "chaos: %d Redis restarts (same port), %d config reloads (%d answered with the new config; %d needed more than one probe, %d extra probes met the old server or a reset)\n",
		rep.RedisRestarts, rep.Reloads, rep.ReloadsSeen, rep.LateReloads, rep.HandoverProbes)
}

// redisSupervisor runs redis-server on a fixed port and restarts it there.
type redisSupervisor struct {
	dir  string
	port int
	p    *Process
}

func (r *redisSupervisor) start(ctx context.Context) error {
	p, err := StartRedis(ctx, r.dir, r.port)
	r.p = p
	return err
}

// restart kills Redis (as a crash would), keeps it down for down, and
// starts it again on the same port, empty.
func (r *redisSupervisor) restart(ctx context.Context, down time.Duration) error {
	r.p.Kill()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(down):
	}
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return r.start(startCtx)
}

func (r *redisSupervisor) stop() {
	if r.p != nil {
		r.p.Kill()
	}
}

// adapt turns the Caddyfile into JSON with `caddy adapt`, keeping the
// GENERATION marker for reloadConfig to replace.
func adapt(ctx context.Context, bin, dir, caddyfile string) (string, error) {
	path := filepath.Join(dir, "adapt.Caddyfile")
	if err := os.WriteFile(path, []byte(caddyfile), 0o644); err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "adapt", "--config", path, "--adapter", "caddyfile")
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("caddy adapt: %v: %s", err, stderr.String())
	}
	if !strings.Contains(stdout.String(), "gen GENERATION") {
		return "", errors.New("caddy adapt: the adapted config lost the GENERATION marker")
	}
	return stdout.String(), nil
}

// reloadConfig posts generation gen of the config to /load and waits (up
// to 5 s) until a new connection is answered by it. For a moment after
// /load returns, a new connection can still reach the old server, whose
// listener shares the port until it has shut down, and be answered by the
// old config or reset: that is Caddy's handover, not the plugin, and it is
// reported as the number of extra probes, not as a failure.
func reloadConfig(admin, base, configJSON string, gen int) (extraProbes int, err error) {
	body := strings.Replace(configJSON, "gen GENERATION", "gen "+strconv.Itoa(gen), 1)
	client := &http.Client{Timeout: 30 * time.Second}
	res, err := client.Post(admin+"/load", "application/json", strings.NewReader(body))
	if err != nil {
		return 0, fmt.Errorf("reload %d: %v", gen, err)
	}
	msg, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("reload %d: status %d: %s", gen, res.StatusCode, msg)
	}
	want := "gen " + strconv.Itoa(gen)
	var last string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); extraProbes++ {
		if last = probe(base, gen); last == want {
			return extraProbes, nil
		}
		time.Sleep(20 * time.Millisecond) // polling for the handover, not timing a result
	}
	return extraProbes, fmt.Errorf("reload %d: the gateway still answers %s, want 200 %q", gen, last, want)
}

// probe sends one request on a connection of its own and describes the
// answer: the body of a 200, else the status or the error.
func probe(base string, gen int) string {
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	req, _ := http.NewRequest(http.MethodGet, base+"/probe", nil)
	req.Header.Set("X-User", "probe-"+strconv.Itoa(gen))
	req.Header.Set("X-Tier", "pro")
	req.Header.Set("X-Cost", "1")
	res, err := (&http.Client{Transport: tr, Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return "error " + err.Error()
	}
	defer res.Body.Close()
	got, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		return "status " + strconv.Itoa(res.StatusCode)
	}
	return string(got)
}

// load is the steady request stream: each worker keeps one keep-alive
// connection of its own, so the gateway holds a known number of client
// connections (and their goroutines) whatever the timing.
type load struct {
	base    string
	workers int
	rps     int
	counts  *Counts
	gate    sync.RWMutex // workers hold it shared per request; a sample holds it exclusively
}

func newLoad(base string, workers, rps int, counts *Counts) *load {
	return &load{base: base, workers: workers, rps: rps, counts: counts}
}

// run starts the workers; the channel closes when they have stopped.
func (l *load) run(ctx context.Context) <-chan struct{} {
	done := make(chan struct{})
	ticks := make(chan struct{}, l.workers)
	go func() { // the pacer: rps tickets a second, dropped when no worker is free
		t := time.NewTicker(time.Second / time.Duration(l.rps))
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				close(ticks)
				return
			case <-t.C:
				select {
				case ticks <- struct{}{}:
				default:
				}
			}
		}
	}()
	var wg sync.WaitGroup
	for w := 0; w < l.workers; w++ {
		wg.Add(1)
		go func(seed uint64) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, 7))
			tr := &http.Transport{MaxConnsPerHost: 1, IdleConnTimeout: time.Hour}
			defer tr.CloseIdleConnections()
			client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
			for range ticks {
				l.gate.RLock()
				l.one(client, r)
				l.gate.RUnlock()
			}
		}(uint64(w))
	}
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// one sends a request for one of 60 users (a third of them pro), so that
// each user sends more than its refill and sees both 200s and 429s.
func (l *load) one(client *http.Client, r *rand.Rand) {
	u := r.IntN(60)
	req, _ := http.NewRequest(http.MethodGet, l.base+"/v1/chat/completions", nil)
	req.Header.Set("X-User", "user-"+strconv.Itoa(u))
	if u%3 == 0 {
		req.Header.Set("X-Tier", "pro")
	}
	req.Header.Set("X-Cost", strconv.Itoa(1+r.IntN(40)))
	atomic.AddInt64(&l.counts.Requests, 1)
	res, err := client.Do(req)
	if err != nil {
		atomic.AddInt64(&l.counts.Errors, 1)
		l.counts.FirstError.CompareAndSwap(nil, err.Error())
		return
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	switch res.StatusCode {
	case http.StatusOK:
		atomic.AddInt64(&l.counts.OK, 1)
	case http.StatusTooManyRequests:
		atomic.AddInt64(&l.counts.Limited, 1)
	default:
		atomic.AddInt64(&l.counts.Other, 1)
	}
}

// paused runs f with no request in flight.
func (l *load) paused(f func() (Sample, error)) (Sample, error) {
	l.gate.Lock()
	defer l.gate.Unlock()
	return f()
}

// sample reads the gateway's goroutines and heap from its admin endpoint
// (pprof, with a GC first), its RSS and open files from /proc, and the
// clients connected to Redis from CLIENT LIST.
func sample(admin string, redisPort, pid int) (Sample, error) {
	var s Sample
	client := &http.Client{Timeout: 30 * time.Second}
	get := func(path string) (string, error) {
		res, err := client.Get(admin + path)
		if err != nil {
			return "", err
		}
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		if res.StatusCode != http.StatusOK {
			return "", fmt.Errorf("GET %s: status %d", path, res.StatusCode)
		}
		return string(b), err
	}
	heap, err := get("/debug/pprof/heap?gc=1&debug=1")
	if err != nil {
		return s, err
	}
	s.HeapAlloc = uint64(memstat(heap, "HeapAlloc"))
	s.HeapInuse = uint64(memstat(heap, "HeapInuse"))
	g, err := get("/debug/pprof/goroutine?debug=1")
	if err != nil {
		return s, err
	}
	if _, err := fmt.Sscanf(g, "goroutine profile: total %d", &s.Goroutines); err != nil {
		return s, fmt.Errorf("reading the goroutine profile: %v", err)
	}
	out, err := exec.Command("redis-cli", "-p", strconv.Itoa(redisPort), "CLIENT", "LIST").Output()
	if err != nil {
		return s, fmt.Errorf("redis-cli CLIENT LIST: %v", err)
	}
	s.RedisClients = strings.Count(strings.TrimSpace(string(out)), "\n") // lines less redis-cli's own
	s.RSS = RSS(pid)
	if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
		s.FDs = len(fds)
	}
	return s, nil
}

// memstat reads "# <name> = <n>" from a debug=1 heap profile.
func memstat(profile, name string) int64 {
	sc := bufio.NewScanner(strings.NewReader(profile))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	prefix := "# " + name + " = "
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), prefix); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// RSS returns the resident set of process pid in bytes, from VmRSS in
// /proc/<pid>/status; 0 when unknown.
func RSS(pid int) uint64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}
