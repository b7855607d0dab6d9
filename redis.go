package tokenbucket

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
)

// Defaults of the Redis connection.
const (
	DefaultTimeout         = 50 * time.Millisecond
	DefaultBreakerFailures = 5
	DefaultBreakerCooldown = 2 * time.Second
)

// RedisConfig says how to reach Redis: one server (the default), the master
// of a Sentinel group, or a Cluster.
type RedisConfig struct {
	// URL is a redis:// or rediss:// (TLS) URL, read by go-redis's own
	// parsers, so that one URL (e.g. "{env.REDIS_URL}"; placeholders work)
	// can name any topology:
	//
	//   - one server: redis://[user:password@]host:port[/db]
	//     (redis.ParseURL);
	//   - Sentinels, when the URL has a master_name parameter or sentinel
	//     is set: redis://[sentinel_user:sentinel_password@]host:port[/db]
	//     ?master_name=<name>&addr=<host:port>&addr=...[&username=<user>]
	//     [&password=<password>] (redis.ParseFailoverURL). As in go-redis,
	//     the user and password before the host authenticate to the
	//     Sentinels and the username and password parameters to the
	//     master;
	//   - Cluster seeds, when cluster is set: redis://[user:password@]
	//     host:port?addr=<host:port>&addr=... (redis.ParseClusterURL); no
	//     master_name, no db but 0.
	//
	// Each addr parameter adds a node to the one before the path. With
	// rediss:// and several nodes, each connection verifies the host it
	// dials (or tls_server_name), not the URL's first host. Of the other
	// query parameters go-redis accepts, none is used: the timeout, pool
	// size and breaker are the fields below, and retries are always off.
	// The fields below override the URL's parts. Not with address. The
	// URL's passwords never appear in an error or a log.
	URL string `json:"url,omitempty"`
	// Address is host:port: of the server (default "127.0.0.1:6379"), of
	// the Sentinels with sentinel, or of some Cluster nodes (seeds) with
	// cluster. Placeholders work. Not with url.
	Address []string `json:"address,omitempty"`
	// Cluster means the addresses (or the url's nodes) are Redis Cluster
	// seeds. A request whose buckets fall on several slots is decided per
	// slot and refunded where another slot denied; see bucket.Sharded.
	Cluster bool `json:"cluster,omitempty"`
	// Sentinel is the master name to ask the Sentinels at Address (or the
	// url's nodes) for; the client follows failovers. It overrides the
	// url's master_name.
	Sentinel string `json:"sentinel,omitempty"`
	// SentinelPassword authenticates to the Sentinels (placeholders work).
	// It overrides the password of a Sentinel url's user information.
	SentinelPassword string `json:"sentinel_password,omitempty"`
	// Username is the ACL user (Redis 6+) of the server, the master or the
	// Cluster nodes. Placeholders work.
	Username string `json:"username,omitempty"`
	// Password for AUTH to the server, the master or the Cluster nodes.
	// Placeholders work, e.g. "{env.REDIS_PASSWORD}"; it is never logged.
	Password string `json:"password,omitempty"`
	// DB is the database number (default 0; Cluster has only 0).
	DB int `json:"db,omitempty"`
	// TLS turns on TLS, verified against the system's roots or TLSCA.
	TLS bool `json:"tls,omitempty"`
	// TLSCA is a PEM file of the CA certificates to trust instead of the
	// system's; it implies tls.
	TLSCA string `json:"tls_ca,omitempty"`
	// TLSServerName is the name to verify in the server's certificate
	// (default: the host of the address).
	TLSServerName string `json:"tls_server_name,omitempty"`
	// Timeout is the budget of one limiter call: dial, write and read
	// (default 50ms). When it runs out, on_redis_error decides.
	Timeout caddy.Duration `json:"timeout,omitempty"`
	// PoolSize is the most connections to keep per node, ≥ 0 (default and
	// 0: go-redis's, 10 per CPU).
	PoolSize int `json:"pool_size,omitempty"`
	// BreakerFailures is how many limiter calls in a row must fail before
	// the circuit breaker opens, ≥ 0 (default and 0: 5). While it is open, no request
	// waits on Redis: on_redis_error decides at once. With pipeline, the
	// calls of one batch that failed together (a lost connection, a
	// timeout) count as one failure.
	BreakerFailures int `json:"breaker_failures,omitempty"`
	// BreakerCooldown is how long the breaker stays open before it lets one
	// call through to probe Redis (default 2s). The probe's success closes
	// it; its failure opens it again for another cooldown.
	BreakerCooldown caddy.Duration `json:"breaker_cooldown,omitempty"`
	// Pipeline batches the script calls of concurrent requests (default
	// on): the calls that arrive while one batch is under way go together
	// as the next, one pipeline (one write, one read) on one connection,
	// instead of one round trip each; a call that finds no batch under way
	// goes at once, alone. Each call is still sent once and never again
	// (see bucket.Batched), and each request keeps its own timeout. false
	// sends every call on its own.
	Pipeline *bool `json:"pipeline,omitempty"`
}

// DefaultPipeline is whether the script calls of concurrent requests are
// batched when RedisConfig.Pipeline is not set.
const DefaultPipeline = true

func (c *RedisConfig) validate() error {
	if c == nil {
		return nil
	}
	switch {
	case c.URL != "" && len(c.Address) > 0:
		return fmt.Errorf("redis: url %q and address %q: set one, not both", redactURL(c.URL), c.Address)
	case c.Cluster && c.Sentinel != "":
		return fmt.Errorf("redis: cluster and sentinel %q: choose one", c.Sentinel)
	case (c.Cluster || c.Sentinel != "") && len(c.Address) == 0 && c.URL == "":
		return errors.New("redis.address: cluster and sentinel need at least one address")
	case !c.Cluster && c.Sentinel == "" && len(c.Address) > 1:
		return fmt.Errorf("redis.address %q: one address for a single server (or set cluster or sentinel)", c.Address)
	case c.Cluster && c.DB != 0:
		return fmt.Errorf("redis.db %d: Redis Cluster has only db 0", c.DB)
	case nonNegativeRule(c.DB) != nil:
		return fmt.Errorf("redis.db %d: %v", c.DB, errNonNegative)
	case c.Timeout != 0 && durationRule(time.Duration(c.Timeout)) != nil:
		return fmt.Errorf("redis.timeout %v: %v", time.Duration(c.Timeout), errDuration)
	case slices.Contains(c.Address, ""):
		return fmt.Errorf("redis.address %q: an address is empty", c.Address)
	case poolSizeRule(c.PoolSize) != nil:
		return fmt.Errorf("redis.pool_size %d: %v; the default is go-redis's, 10 per CPU", c.PoolSize, poolSizeRule(c.PoolSize))
	case nonNegativeRule(c.BreakerFailures) != nil:
		return fmt.Errorf("redis.breaker_failures %d: %v; the default is %d", c.BreakerFailures, errNonNegative, DefaultBreakerFailures)
	case c.BreakerCooldown != 0 && durationRule(time.Duration(c.BreakerCooldown)) != nil:
		return fmt.Errorf("redis.breaker_cooldown %v: %v", time.Duration(c.BreakerCooldown), errDuration)
	}
	return nil
}

// redactURL returns a redis URL for an error message, its passwords (of
// the user information and of a password parameter) replaced by "xxxxx".
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(unparsable)"
	}
	if q := u.Query(); q.Has("password") {
		q.Set("password", "xxxxx")
		u.RawQuery = q.Encode()
	}
	return u.Redacted()
}

// parseURL reads the redis URL s into o with go-redis's parser for its
// topology: Cluster seeds with cluster, Sentinels with sentinel or a
// master_name parameter, else one server. Only the nodes, credentials,
// database, master name and TLS are taken from it.
func (c *RedisConfig) parseURL(s string, o *redis.UniversalOptions) error {
	u, err := url.Parse(s)
	if err != nil {
		return urlError(err, nil)
	}
	secrets := urlSecrets(u)
	if u.Scheme != "redis" && u.Scheme != "rediss" {
		return fmt.Errorf("redis.url: scheme %q: must be redis or rediss", u.Scheme)
	}
	q := u.Query()
	switch {
	case c.Cluster:
		if q.Has("master_name") {
			return errors.New("redis.url: master_name names a Sentinel master, not with cluster")
		}
		if db := strings.Trim(u.Path, "/"); db != "" && db != "0" {
			return fmt.Errorf("redis.url: database %q: Redis Cluster has only db 0", db)
		}
		p, err := redis.ParseClusterURL(s)
		if err != nil {
			return urlError(err, secrets)
		}
		o.Addrs, o.Username, o.Password, o.TLSConfig = p.Addrs, p.Username, p.Password, p.TLSConfig
	case c.Sentinel != "" || q.Has("master_name"):
		p, err := redis.ParseFailoverURL(s)
		if err != nil {
			return urlError(err, secrets)
		}
		if p.MasterName == "" && c.Sentinel == "" {
			return errors.New("redis.url: master_name is empty: name the master the Sentinels monitor")
		}
		o.Addrs, o.MasterName, o.SentinelUsername, o.SentinelPassword = p.SentinelAddrs, p.MasterName, p.SentinelUsername, p.SentinelPassword
		o.Username, o.Password, o.DB, o.TLSConfig = p.Username, p.Password, p.DB, p.TLSConfig
	default:
		if q.Has("addr") {
			return errors.New("redis.url: addr names more nodes: set cluster for Cluster seeds, or add master_name for Sentinels")
		}
		p, err := redis.ParseURL(s)
		if err != nil {
			return urlError(err, secrets)
		}
		o.Addrs, o.Username, o.Password, o.DB, o.TLSConfig = []string{p.Addr}, p.Username, p.Password, p.DB, p.TLSConfig
		return nil
	}
	// go-redis names the URL's first host as the one to verify on every
	// connection; Sentinels, their master and Cluster nodes are other
	// hosts, so each connection verifies the host it dials.
	if o.TLSConfig != nil {
		o.TLSConfig.ServerName = ""
		o.TLSConfig.MinVersion = max(o.TLSConfig.MinVersion, tls.VersionTLS12)
	}
	return nil
}

// urlSecrets returns the passwords a redis URL holds, as written and
// decoded: of its user information and of its password parameter.
func urlSecrets(u *url.URL) []string {
	var out []string
	if p, ok := u.User.Password(); ok && p != "" {
		out = append(out, p, url.QueryEscape(p), url.PathEscape(p))
	}
	for _, p := range u.Query()["password"] {
		if p != "" {
			out = append(out, p, url.QueryEscape(p))
		}
	}
	return out
}

// urlError is a parse error of redis.url without the URL's passwords: a
// url.Error, which would echo the whole URL, is unwrapped, and any
// password the message still holds is replaced by "xxxxx".
func urlError(err error, secrets []string) error {
	if ue := (*url.Error)(nil); errors.As(err, &ue) {
		err = ue.Err
	}
	msg := err.Error()
	for _, s := range secrets {
		msg = strings.ReplaceAll(msg, s, "xxxxx")
	}
	return fmt.Errorf("redis.url: %s", msg)
}

// resolved is a RedisConfig with placeholders replaced and defaults set.
type resolved struct {
	opt      redis.UniversalOptions
	cluster  bool
	pipeline bool // batch the script calls (bucket.Batched)
	failures int
	cooldown time.Duration
	ca       string // the PEM of tls_ca: another CA, or new contents, is another client
}

// resolve replaces placeholders ({env.*}, {file.*}) and builds go-redis
// options. Retries are off: a script replayed after a timeout would charge
// twice. MOVED and ASK redirects are still followed: a redirected script
// did not run.
func (c *RedisConfig) resolve() (*resolved, error) {
	if c == nil {
		c = &RedisConfig{}
	}
	repl := caddy.NewReplacer()
	r := &resolved{cluster: c.Cluster, pipeline: DefaultPipeline, failures: c.BreakerFailures, cooldown: time.Duration(c.BreakerCooldown)}
	if c.Pipeline != nil {
		r.pipeline = *c.Pipeline
	}
	o := &r.opt
	o.Addrs = []string{"127.0.0.1:6379"}
	if c.URL != "" {
		u, err := repl.ReplaceOrErr(c.URL, true, true)
		if err != nil {
			return nil, fmt.Errorf("redis.url: %v", err)
		}
		if err := c.parseURL(u, o); err != nil {
			return nil, err
		}
		if o.DB < 0 { // go-redis selects only a db > 0: -1 would mean db 0
			return nil, fmt.Errorf("redis.url: database %d: %v", o.DB, errNonNegative)
		}
	}
	if len(c.Address) > 0 {
		o.Addrs = make([]string, len(c.Address))
		for i, a := range c.Address {
			// An empty address would be go-redis's default, localhost:6379:
			// an unset variable must not send the limits to whatever Redis
			// listens there.
			addr, err := repl.ReplaceOrErr(a, true, true)
			if err != nil {
				return nil, fmt.Errorf("redis.address %q: %v", a, err)
			}
			o.Addrs[i] = addr
		}
	}
	if c.Sentinel != "" {
		o.MasterName = c.Sentinel
	}
	if c.SentinelPassword != "" {
		if o.MasterName == "" {
			return nil, errors.New("redis.sentinel_password: only with Sentinels (sentinel, or a url with master_name)")
		}
		o.SentinelPassword = repl.ReplaceKnown(c.SentinelPassword, "")
	}
	if c.Username != "" {
		o.Username = repl.ReplaceKnown(c.Username, "")
	}
	if c.Password != "" {
		o.Password = repl.ReplaceKnown(c.Password, "")
	}
	if c.DB != 0 {
		o.DB = c.DB
	}
	ca, err := c.tlsConfig(o)
	if err != nil {
		return nil, err
	}
	r.ca = ca
	timeout := time.Duration(c.Timeout)
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = timeout, timeout, timeout
	o.ContextTimeoutEnabled = true
	o.MaxRetries = -1
	// A refused dial fails at once: go-redis's default of 5 dials 100ms
	// apart outlasts the timeout, so every call during an outage would
	// wait out the whole timeout and report it instead of the cause.
	o.DialerRetries = 1
	o.PoolSize = c.PoolSize
	if r.failures == 0 {
		r.failures = DefaultBreakerFailures
	}
	if r.cooldown == 0 {
		r.cooldown = DefaultBreakerCooldown
	}
	return r, nil
}

// tlsConfig sets up TLS and returns the PEM of tls_ca.
func (c *RedisConfig) tlsConfig(o *redis.UniversalOptions) (string, error) {
	if !c.TLS && c.TLSCA == "" && c.TLSServerName == "" {
		return "", nil
	}
	if o.TLSConfig == nil {
		o.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	o.TLSConfig.ServerName = c.TLSServerName
	if c.TLSCA != "" {
		pem, err := os.ReadFile(c.TLSCA)
		if err != nil {
			return "", fmt.Errorf("redis.tls_ca: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return "", fmt.Errorf("redis.tls_ca %q: no PEM certificate in it", c.TLSCA)
		}
		o.TLSConfig.RootCAs = pool
		return string(pem), nil
	}
	return "", nil
}

func (r *resolved) timeout() time.Duration { return r.opt.ReadTimeout }

// key identifies a resolved configuration in the pool. It holds the
// password, so it stays in memory and is never logged.
func (r *resolved) key() string {
	o := &r.opt
	var serverName string
	var roots, skipVerify bool
	if o.TLSConfig != nil {
		serverName, roots, skipVerify = o.TLSConfig.ServerName, o.TLSConfig.RootCAs != nil, o.TLSConfig.InsecureSkipVerify
	}
	k, _ := json.Marshal([]any{o.Addrs, r.cluster, o.MasterName, o.SentinelUsername, o.SentinelPassword, o.Username, o.Password, o.DB,
		o.TLSConfig != nil, serverName, roots, skipVerify, r.ca, o.ReadTimeout, o.PoolSize, r.failures, r.cooldown, r.pipeline})
	return string(k)
}

// conn is a Redis client shared by every handler with the same resolved
// configuration, across config reloads, with its circuit breaker.
type conn struct {
	client  redis.UniversalClient
	store   store
	breaker *gobreaker.CircuitBreaker[struct{}]
	timeout time.Duration
	// cooldown is how long the breaker stays open (redis.breaker_cooldown,
	// or its default): how long a refused call waits before it is tried
	// again.
	cooldown time.Duration
	// users counts what holds the client: 1 for the pool while any handler
	// has this configuration, plus 1 per request under way. The client is
	// closed when it falls to 0, so a config reload that drops this
	// configuration never closes the client under a decision or a
	// settlement that started before it (a stream can outlive its config
	// by minutes).
	users atomic.Int64
	// loggers are the loggers of the configs that hold the conn, oldest
	// first; it logs to the newest. A config being loaded takes the conn
	// before the one it replaces lets go of it, and one whose load fails
	// lets go again.
	loggersMu sync.Mutex
	loggers   []*zap.Logger
}

// addLogger adds the logger of a config that takes the conn.
func (c *conn) addLogger(l *zap.Logger) {
	c.loggersMu.Lock()
	defer c.loggersMu.Unlock()
	c.loggers = append(c.loggers, l)
}

// dropLogger removes the logger of a config that lets go of the conn.
func (c *conn) dropLogger(l *zap.Logger) {
	c.loggersMu.Lock()
	defer c.loggersMu.Unlock()
	if i := slices.Index(c.loggers, l); i >= 0 {
		c.loggers = slices.Delete(c.loggers, i, i+1)
	}
}

// log returns the logger of the newest config that holds the conn.
func (c *conn) log() *zap.Logger {
	c.loggersMu.Lock()
	defer c.loggersMu.Unlock()
	if len(c.loggers) == 0 {
		return zap.NewNop()
	}
	return c.loggers[len(c.loggers)-1]
}

// hold counts a request as a user of the client; it returns false when the
// client is closed already, and then the request must not release.
func (c *conn) hold() bool {
	for {
		n := c.users.Load()
		if n <= 0 {
			return false
		}
		if c.users.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// release ends a use of the client; the last one closes it.
func (c *conn) release() {
	if c.users.Add(-1) == 0 {
		_ = c.client.Close()
	}
}

// Destruct drops the pool's hold when the last handler using this
// configuration is cleaned up; requests under way keep the client open
// until they end.
func (c *conn) Destruct() error {
	c.release()
	return nil
}

// conns shares one conn per distinct Redis configuration.
var conns = caddy.NewUsagePool()

// acquire returns the shared conn for r; release it with c.dropLogger and
// conns.Delete(key). The conn logs (its breaker's changes) to logger from
// now on: to the newest config that holds it. A conn made here pings Redis once and warns
// when Redis does not answer; one that other handlers share already is not
// pinged again, so that a config of many handlers loads in one timeout
// when Redis stalls, not one per handler.
func acquire(ctx context.Context, r *resolved, logger *zap.Logger) (*conn, string, error) {
	key := r.key()
	v, loaded, err := conns.LoadOrNew(key, func() (c caddy.Destructor, err error) {
		// A panic here would leave the pool's entry locked, and the next
		// load of the same settings (holding Caddy's config lock) waiting
		// on it for good: go-redis panics on options it cannot take.
		defer func() {
			if p := recover(); p != nil {
				c, err = nil, fmt.Errorf("redis: creating the client: %v", p)
			}
		}()
		return newConn(r), nil
	})
	if err != nil {
		return nil, "", err
	}
	c := v.(*conn)
	c.addLogger(logger)
	if loaded {
		return c, key, nil
	}
	if err := c.ping(ctx); err != nil {
		msg := "redis is not answering yet; on_redis_error applies until it does"
		if r.opt.MasterName != "" && errors.Is(err, redis.Nil) {
			msg = "the sentinels do not know this master_name; on_redis_error applies until they do"
		}
		logger.Warn(msg, zap.Strings("address", r.opt.Addrs), zap.String("master_name", r.opt.MasterName), zap.Error(err))
	}
	return c, key, nil
}

func newConn(r *resolved) *conn {
	c := &conn{timeout: r.timeout(), cooldown: r.cooldown}
	c.users.Store(1)
	switch {
	case r.cluster:
		co := r.opt.Cluster()
		co.ClusterStateReloadInterval = clusterStateReload
		cc := redis.NewClusterClient(co)
		cc.AddHook(bucket.NoRetry{}) // MaxRetries -1 does not stop its retries
		c.client = cc
	case r.opt.MasterName != "":
		c.client = redis.NewFailoverClient(r.opt.Failover())
	default:
		c.client = redis.NewClient(r.opt.Simple())
	}
	// The scripts go through sc: the client, or the batcher over it.
	var sc bucket.ShardedClient = c.client
	if r.pipeline {
		sc = bucket.NewBatched(c.client, bucket.BatchOptions{})
	}
	if r.cluster {
		c.store = bucket.Sharded{Client: sc}
	} else {
		c.store = bucket.Redis{Client: sc}
	}
	failures := uint32(r.failures)
	c.breaker = gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: 1,
		Timeout:     r.cooldown,
		ReadyToTrip: func(n gobreaker.Counts) bool { return n.ConsecutiveFailures >= failures },
		// A client that went away says nothing about Redis; a batch that
		// failed (a lost connection, a timeout) is one failure, counted
		// for the first of its calls only.
		IsExcluded: func(err error) bool { return errors.Is(err, context.Canceled) || bucket.IsShared(err) },
		// Runs inside the breaker's lock: it must not call the breaker.
		OnStateChange: func(_ string, from, to gobreaker.State) {
			breakerChanged(to)
			logger := c.log()
			addrs := zap.Strings("address", r.opt.Addrs)
			switch to {
			case gobreaker.StateOpen:
				logger.Warn("redis circuit breaker opened: degraded, on_redis_error decides every request until redis answers",
					zap.String("from", breakerState(from)), addrs, zap.Duration("probe_in", r.cooldown))
			case gobreaker.StateHalfOpen:
				logger.Info("redis circuit breaker half-open: probing redis with one request", addrs)
			case gobreaker.StateClosed:
				logger.Warn("redis circuit breaker closed: degraded mode over, redis decides again",
					zap.String("from", breakerState(from)), addrs)
			}
		},
	})
	return c
}

// call runs one call to Redis: fn with a deadline of the timeout
// (redis.timeout: one budget for pool wait, dial, write and read), through the circuit breaker (while
// it is open, call fails at once with gobreaker.ErrOpenState and fn does
// not run), its duration observed in redis_call_duration_seconds and its
// failure counted in redis_errors_total, by kind. Every
// call of the request path goes through it: decisions, demotions and
// settlements; probe is the same without the breaker.
func (c *conn) call(ctx context.Context, fn func(context.Context) error) error {
	_, err := c.breaker.Execute(func() (struct{}, error) {
		return struct{}{}, c.probe(ctx, fn)
	})
	if err != nil {
		countRedisError(err)
	}
	return err
}

// probe runs fn as call does but past the circuit breaker, for the calls
// that must tell Redis's own state even while the breaker is open: the
// readiness probe and the admin API's reads and resets. Their outcome does
// not move the breaker.
func (c *conn) probe(ctx context.Context, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	defer observeRedisCall(time.Now())
	return fn(ctx)
}

// take decides a request in Redis.
func (c *conn) take(ctx context.Context, keys []string, takes []bucket.Take) (d bucket.Decision, err error) {
	err = c.call(ctx, func(ctx context.Context) error {
		d, err = c.store.Take(ctx, keys, takes)
		return err
	})
	return d, err
}

// settler is a store that can settle.
type settler interface {
	Settle(ctx context.Context, id string, keys []string, adj []bucket.Adjust) (bool, error)
}

// settle settles a request's buckets in Redis, once per request id.
func (c *conn) settle(ctx context.Context, id string, keys []string, adj []bucket.Adjust) error {
	s, ok := c.store.(settler)
	if !ok {
		return nil
	}
	return c.call(ctx, func(ctx context.Context) error {
		_, err := s.Settle(ctx, id, keys, adj)
		return err
	})
}

// leaser is a store that holds concurrency leases: bucket.Redis and
// bucket.Sharded.
type leaser interface {
	Renew(ctx context.Context, keys []string, id string, lease int64) (int64, error)
	Release(ctx context.Context, keys []string, id string) (int64, error)
}

// lease extends the lease id on the concurrency keys to lease ms (> 0) and
// returns how many keys still held it; lease 0 releases it and returns
// the slots given back. Like settle, one call through the breaker.
func (c *conn) lease(ctx context.Context, keys []string, id string, lease int64) (held int64, err error) {
	l, ok := c.store.(leaser)
	if !ok {
		return 0, nil
	}
	err = c.call(ctx, func(ctx context.Context) error {
		if lease > 0 {
			held, err = l.Renew(ctx, keys, id, lease)
		} else {
			held, err = l.Release(ctx, keys, id)
		}
		return err
	})
	return held, err
}

// refunder is a store that gives back what a decision charged:
// bucket.Redis and bucket.Sharded.
type refunder interface {
	Refund(ctx context.Context, keys []string, takes []bucket.Take) (int64, error)
}

// refund gives back what an allowed decision charged on keys.
func (c *conn) refund(ctx context.Context, keys []string, takes []bucket.Take) error {
	r, ok := c.store.(refunder)
	if !ok {
		return nil
	}
	return c.call(ctx, func(ctx context.Context) error {
		_, err := r.Refund(ctx, keys, takes)
		return err
	})
}

// clusterStateReload is how old a Redis Cluster client's map of slots to
// nodes may get before a request reloads it (in the background, with
// CLUSTER SLOTS). go-redis reloads it at once after MOVED, ASK or READONLY,
// but a master that died answers nothing: its slots would go on failing
// for go-redis's default of 60 s after a replica took them over.
const clusterStateReload = time.Second

// ping checks that Redis answers within the timeout, whatever the
// breaker's state. On a Redis Cluster every master must answer and report
// cluster_state:ok: one that does not fails the requests of its slots.
func (c *conn) ping(ctx context.Context) error {
	return c.probe(ctx, func(ctx context.Context) error {
		cc, ok := c.client.(*redis.ClusterClient)
		if !ok {
			return c.client.Ping(ctx).Err()
		}
		return cc.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			info, err := m.ClusterInfo(ctx).Result()
			if err != nil {
				return fmt.Errorf("%s: %w", m.Options().Addr, err)
			}
			if !strings.Contains(info, "cluster_state:ok\r\n") {
				return fmt.Errorf("%s: the cluster is down (CLUSTER INFO says no cluster_state:ok)", m.Options().Addr)
			}
			return nil
		})
	})
}

// breakerState names a breaker state as the metrics, logs and the
// readiness probe report it.
func breakerState(s gobreaker.State) string {
	switch s {
	case gobreaker.StateOpen:
		return "open"
	case gobreaker.StateHalfOpen:
		return "half_open"
	default:
		return "closed"
	}
}
