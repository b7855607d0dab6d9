package tokenbucket

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"
)

// DefaultTimeout is the default budget of one limiter call to Redis.
const DefaultTimeout = 50 * time.Millisecond

// RedisConfig says how to reach Redis. Set either URL or Address.
type RedisConfig struct {
	// URL is a redis:// or rediss:// URL,
	// redis://[user:password@]host:port[/db]; the other fields override its
	// parts. Placeholders work, e.g. "{env.REDIS_URL}".
	URL string `json:"url,omitempty"`
	// Address is the host:port of the Redis server. Default
	// "127.0.0.1:6379" when URL is empty too.
	Address []string `json:"address,omitempty"`
	// Username is the ACL user (Redis 6+). Placeholders work.
	Username string `json:"username,omitempty"`
	// Password for AUTH. Placeholders work, e.g. "{env.REDIS_PASSWORD}";
	// it is never logged.
	Password string `json:"password,omitempty"`
	// DB is the database number (default 0).
	DB int `json:"db,omitempty"`
	// TLS turns on TLS with the system's root CAs.
	TLS bool `json:"tls,omitempty"`
	// Timeout is the budget of one limiter call: dial, write and read
	// (default 50ms). When it runs out, on_redis_error decides.
	Timeout caddy.Duration `json:"timeout,omitempty"`
	// PoolSize is the most connections to keep (default: go-redis's, 10 per
	// CPU).
	PoolSize int `json:"pool_size,omitempty"`
}

func (c *RedisConfig) validate() error {
	if c == nil {
		return nil
	}
	if c.URL != "" && len(c.Address) > 0 {
		return fmt.Errorf("redis: url %q and address %q: set one, not both", c.URL, c.Address)
	}
	if len(c.Address) > 1 {
		return fmt.Errorf("redis.address %q: one address for a standalone Redis", c.Address)
	}
	if c.DB < 0 {
		return fmt.Errorf("redis.db %d: must be ≥ 0", c.DB)
	}
	if c.Timeout < 0 {
		return fmt.Errorf("redis.timeout %v: must be > 0", time.Duration(c.Timeout))
	}
	if c.PoolSize < 0 {
		return fmt.Errorf("redis.pool_size %d: must be > 0", c.PoolSize)
	}
	return nil
}

// options resolves placeholders ({env.*}, {file.*}) and returns go-redis
// options. Retries are off: a script replayed after a timeout would charge
// twice.
func (c *RedisConfig) options() (*redis.Options, error) {
	if c == nil {
		c = &RedisConfig{}
	}
	repl := caddy.NewReplacer()
	opt := &redis.Options{Addr: "127.0.0.1:6379"}
	if c.URL != "" {
		u, err := repl.ReplaceOrErr(c.URL, true, true)
		if err != nil {
			return nil, fmt.Errorf("redis.url: %v", err)
		}
		if opt, err = redis.ParseURL(u); err != nil {
			return nil, fmt.Errorf("redis.url: %v", err) // the URL may hold a password: not echoed
		}
	}
	if len(c.Address) == 1 {
		opt.Addr = repl.ReplaceKnown(c.Address[0], "")
	}
	if c.Username != "" {
		opt.Username = repl.ReplaceKnown(c.Username, "")
	}
	if c.Password != "" {
		opt.Password = repl.ReplaceKnown(c.Password, "")
	}
	if c.DB != 0 {
		opt.DB = c.DB
	}
	if c.TLS && opt.TLSConfig == nil {
		opt.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	timeout := time.Duration(c.Timeout)
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout = timeout, timeout, timeout
	opt.ContextTimeoutEnabled = true
	opt.MaxRetries = -1
	if c.PoolSize > 0 {
		opt.PoolSize = c.PoolSize
	}
	return opt, nil
}

// clients shares one go-redis client per distinct Redis configuration
// across handlers and config reloads.
var clients = caddy.NewUsagePool()

type sharedClient struct{ *redis.Client }

// Destruct closes the client when the last handler using it is cleaned up.
func (c sharedClient) Destruct() error { return c.Close() }

// poolKey identifies a resolved configuration. It holds the password, so it
// stays in memory and is never logged.
func poolKey(opt *redis.Options) string {
	k, _ := json.Marshal([]any{opt.Network, opt.Addr, opt.Username, opt.Password, opt.DB,
		opt.TLSConfig != nil, opt.ReadTimeout, opt.PoolSize})
	return string(k)
}

// acquire returns the shared client for opt and the key to release it with.
func acquire(opt *redis.Options) (*redis.Client, string, error) {
	key := poolKey(opt)
	v, _, err := clients.LoadOrNew(key, func() (caddy.Destructor, error) {
		return sharedClient{redis.NewClient(opt)}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(sharedClient).Client, key, nil
}

// ping checks that Redis answers within the timeout.
func ping(ctx context.Context, c redis.UniversalClient, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return c.Ping(ctx).Err()
}
