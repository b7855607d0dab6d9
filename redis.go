package tokenbucket

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
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
	// URL is a redis:// or rediss:// URL of one server,
	// redis://[user:password@]host:port[/db]; the fields below override its
	// parts. Placeholders work, e.g. "{env.REDIS_URL}". Not with cluster or
	// sentinel.
	URL string `json:"url,omitempty"`
	// Address is host:port: of the server (default "127.0.0.1:6379"), of
	// the Sentinels with sentinel, or of some Cluster nodes (seeds) with
	// cluster. Placeholders work.
	Address []string `json:"address,omitempty"`
	// Cluster means the addresses are Redis Cluster seeds. A request whose
	// buckets fall on several slots is decided per slot and refunded where
	// another slot denied; see bucket.Sharded.
	Cluster bool `json:"cluster,omitempty"`
	// Sentinel is the master name to ask the Sentinels at Address for; the
	// client follows failovers.
	Sentinel string `json:"sentinel,omitempty"`
	// SentinelPassword authenticates to the Sentinels (placeholders work).
	SentinelPassword string `json:"sentinel_password,omitempty"`
	// Username is the ACL user (Redis 6+). Placeholders work.
	Username string `json:"username,omitempty"`
	// Password for AUTH. Placeholders work, e.g. "{env.REDIS_PASSWORD}";
	// it is never logged.
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
	// waits on Redis: on_redis_error decides at once.
	BreakerFailures int `json:"breaker_failures,omitempty"`
	// BreakerCooldown is how long the breaker stays open before it lets one
	// call through to probe Redis (default 2s). The probe's success closes
	// it; its failure opens it again for another cooldown.
	BreakerCooldown caddy.Duration `json:"breaker_cooldown,omitempty"`
}

func (c *RedisConfig) validate() error {
	if c == nil {
		return nil
	}
	switch {
	case c.URL != "" && len(c.Address) > 0:
		return fmt.Errorf("redis: url %q and address %q: set one, not both", redactURL(c.URL), c.Address)
	case c.Cluster && c.Sentinel != "":
		return fmt.Errorf("redis: cluster and sentinel %q: choose one", c.Sentinel)
	case (c.Cluster || c.Sentinel != "") && c.URL != "":
		return fmt.Errorf("redis.url %q: give cluster or sentinel nodes in address", redactURL(c.URL))
	case (c.Cluster || c.Sentinel != "") && len(c.Address) == 0:
		return errors.New("redis.address: cluster and sentinel need at least one address")
	case !c.Cluster && c.Sentinel == "" && len(c.Address) > 1:
		return fmt.Errorf("redis.address %q: one address for a single server (or set cluster or sentinel)", c.Address)
	case c.Cluster && c.DB != 0:
		return fmt.Errorf("redis.db %d: Redis Cluster has only db 0", c.DB)
	case c.DB < 0:
		return fmt.Errorf("redis.db %d: must be ≥ 0", c.DB)
	case c.Timeout < 0:
		return fmt.Errorf("redis.timeout %v: must be > 0", time.Duration(c.Timeout))
	case c.PoolSize < 0:
		return fmt.Errorf("redis.pool_size %d: must be ≥ 0 (0: go-redis's default, 10 per CPU)", c.PoolSize)
	case c.BreakerFailures < 0:
		return fmt.Errorf("redis.breaker_failures %d: must be ≥ 0 (0: the default, %d)", c.BreakerFailures, DefaultBreakerFailures)
	case c.BreakerCooldown < 0:
		return fmt.Errorf("redis.breaker_cooldown %v: must be > 0", time.Duration(c.BreakerCooldown))
	}
	return nil
}

// redactURL returns a redis URL for an error message, its password
// replaced by "xxxxx".
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(unparsable)"
	}
	return u.Redacted()
}

// resolved is a RedisConfig with placeholders replaced and defaults set.
type resolved struct {
	opt      redis.UniversalOptions
	cluster  bool
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
	r := &resolved{cluster: c.Cluster, failures: c.BreakerFailures, cooldown: time.Duration(c.BreakerCooldown)}
	o := &r.opt
	o.Addrs = []string{"127.0.0.1:6379"}
	if c.URL != "" {
		u, err := repl.ReplaceOrErr(c.URL, true, true)
		if err != nil {
			return nil, fmt.Errorf("redis.url: %v", err)
		}
		p, err := redis.ParseURL(u)
		if err != nil {
			// The URL may hold a password: not echoed, and url.Error
			// would echo it.
			if ue := (*url.Error)(nil); errors.As(err, &ue) {
				err = ue.Err
			}
			return nil, fmt.Errorf("redis.url: %v", err)
		}
		o.Addrs, o.Username, o.Password, o.DB, o.TLSConfig = []string{p.Addr}, p.Username, p.Password, p.DB, p.TLSConfig
	}
	if len(c.Address) > 0 {
		o.Addrs = make([]string, len(c.Address))
		for i, a := range c.Address {
			o.Addrs[i] = repl.ReplaceKnown(a, "")
		}
	}
	o.MasterName = c.Sentinel
	o.SentinelPassword = repl.ReplaceKnown(c.SentinelPassword, "")
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
	var roots bool
	if o.TLSConfig != nil {
		serverName, roots = o.TLSConfig.ServerName, o.TLSConfig.RootCAs != nil
	}
	k, _ := json.Marshal([]any{o.Addrs, r.cluster, o.MasterName, o.SentinelPassword, o.Username, o.Password, o.DB,
		o.TLSConfig != nil, serverName, roots, r.ca, o.ReadTimeout, o.PoolSize, r.failures, r.cooldown})
	return string(k)
}

// conn is a Redis client shared by every handler with the same resolved
// configuration, across config reloads, with its circuit breaker.
type conn struct {
	client  redis.UniversalClient
	store   store
	breaker *gobreaker.CircuitBreaker[bucket.Decision]
	timeout time.Duration
	// users counts what holds the client: 1 for the pool while any handler
	// has this configuration, plus 1 per request under way. The client is
	// closed when it falls to 0, so a config reload that drops this
	// configuration never closes the client under a decision or a
	// settlement that started before it (a stream can outlive its config
	// by minutes).
	users atomic.Int64
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

// acquire returns the shared conn for r; release it with conns.Delete(key).
func acquire(r *resolved, logger *zap.Logger) (*conn, string, error) {
	key := r.key()
	v, _, err := conns.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newConn(r, logger), nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(*conn), key, nil
}

func newConn(r *resolved, logger *zap.Logger) *conn {
	c := &conn{timeout: r.timeout()}
	c.users.Store(1)
	switch {
	case r.cluster:
		cc := redis.NewClusterClient(r.opt.Cluster())
		cc.AddHook(bucket.NoRetry{}) // MaxRetries -1 does not stop its retries
		c.client, c.store = cc, bucket.Sharded{Client: cc}
	case r.opt.MasterName != "":
		fc := redis.NewFailoverClient(r.opt.Failover())
		c.client, c.store = fc, bucket.Redis{Client: fc}
	default:
		sc := redis.NewClient(r.opt.Simple())
		c.client, c.store = sc, bucket.Redis{Client: sc}
	}
	failures := uint32(r.failures)
	c.breaker = gobreaker.NewCircuitBreaker[bucket.Decision](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: 1,
		Timeout:     r.cooldown,
		ReadyToTrip: func(n gobreaker.Counts) bool { return n.ConsecutiveFailures >= failures },
		// A client that went away says nothing about Redis.
		IsExcluded: func(err error) bool { return errors.Is(err, context.Canceled) },
		// Runs inside the breaker's lock: it must not call the breaker.
		OnStateChange: func(_ string, from, to gobreaker.State) {
			breakerChanged(to)
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

// take decides a request in Redis, through the circuit breaker: while the
// breaker is open it fails at once with gobreaker.ErrOpenState.
func (c *conn) take(ctx context.Context, keys []string, takes []bucket.Take) (bucket.Decision, error) {
	return c.breaker.Execute(func() (bucket.Decision, error) {
		ctx, cancel := context.WithTimeout(ctx, c.timeout)
		defer cancel()
		defer observeRedisCall(time.Now())
		return c.store.Take(ctx, keys, takes)
	})
}

// contextWithTimeout bounds one limiter call of the request r.
func contextWithTimeout(r *http.Request, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), d)
}

// ping checks that Redis answers within the timeout.
func (c *conn) ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	return c.client.Ping(ctx).Err()
}
