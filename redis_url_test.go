package tokenbucket

import (
	"context"
	"crypto/tls"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/token-bucket/token_bucket/internal/redistest"
)

// wantOpts is what resolve must make of a redis configuration: the nodes,
// the topology and the credentials, the database and TLS. tls is "" for
// no TLS, else the ServerName to verify ("*" for the host dialed).
type wantOpts struct {
	addrs                  []string
	cluster                bool
	master                 string
	sentinelUser, sentinel string // the Sentinels' username and password
	user, password         string
	db                     int
	tls                    string
}

// TestRedisURLTopologies resolves redis URLs of one server, of Sentinels and
// of Cluster seeds with go-redis's parsers, and the fields that override
// their parts: one REDIS_URL serves every topology.
func TestRedisURLTopologies(t *testing.T) {
	t.Setenv("TB_TEST_REDIS_URL", "redis://:spw@10.0.0.1:26379?master_name=mymaster&addr=10.0.0.2:26379")
	for _, tc := range []struct {
		name string
		rc   RedisConfig
		want wantOpts
	}{
		{"default", RedisConfig{}, wantOpts{addrs: []string{"127.0.0.1:6379"}}},
		{"one_server", RedisConfig{URL: "redis://alice:pw@10.0.0.1:6380/2"},
			wantOpts{addrs: []string{"10.0.0.1:6380"}, user: "alice", password: "pw", db: 2}},
		{"one_server_default_port", RedisConfig{URL: "redis://cache"}, wantOpts{addrs: []string{"cache:6379"}}},
		{"one_server_ipv6", RedisConfig{URL: "redis://[::1]:6380"}, wantOpts{addrs: []string{"[::1]:6380"}}},
		{"one_server_db_parameter", RedisConfig{URL: "redis://cache:6380?db=5"}, wantOpts{addrs: []string{"cache:6380"}, db: 5}},
		{"one_server_tls", RedisConfig{URL: "rediss://:pw@cache.internal:6380"},
			wantOpts{addrs: []string{"cache.internal:6380"}, password: "pw", tls: "cache.internal"}},
		{"one_server_overrides", RedisConfig{URL: "redis://alice:pw@cache:6380/2", Username: "bob", Password: "pw2", DB: 3},
			wantOpts{addrs: []string{"cache:6380"}, user: "bob", password: "pw2", db: 3}},

		{"sentinel_master_name", RedisConfig{
			URL: "redis://sentinel-user:spw@s1:26379/3?master_name=mymaster&addr=s2:26379&addr=s3:26380&username=app&password=mpw"},
			wantOpts{addrs: []string{"s1:26379", "s2:26379", "s3:26380"}, master: "mymaster",
				sentinelUser: "sentinel-user", sentinel: "spw", user: "app", password: "mpw", db: 3}},
		{"sentinel_db_parameter", RedisConfig{URL: "redis://s1:26379?master_name=m&db=4"},
			wantOpts{addrs: []string{"s1:26379"}, master: "m", db: 4}},
		{"sentinel_default_port", RedisConfig{URL: "redis://s1?master_name=m"},
			wantOpts{addrs: []string{"s1:6379"}, master: "m"}},
		{"sentinel_field_names_master", RedisConfig{URL: "redis://s1:26379?addr=s2:26379", Sentinel: "mymaster"},
			wantOpts{addrs: []string{"s1:26379", "s2:26379"}, master: "mymaster"}},
		{"sentinel_fields_override", RedisConfig{URL: "redis://:spw@s1:26379?master_name=a&password=mpw",
			Sentinel: "b", SentinelPassword: "spw2", Password: "mpw2", Username: "app"},
			wantOpts{addrs: []string{"s1:26379"}, master: "b", sentinel: "spw2", user: "app", password: "mpw2"}},
		{"sentinel_tls", RedisConfig{URL: "rediss://s1:26379?master_name=m&addr=s2:26379"},
			wantOpts{addrs: []string{"s1:26379", "s2:26379"}, master: "m", tls: "*"}},
		{"sentinel_tls_server_name", RedisConfig{URL: "rediss://s1:26379?master_name=m", TLSServerName: "redis.internal"},
			wantOpts{addrs: []string{"s1:26379"}, master: "m", tls: "redis.internal"}},
		{"sentinel_env_placeholder", RedisConfig{URL: "{env.TB_TEST_REDIS_URL}"},
			wantOpts{addrs: []string{"10.0.0.1:26379", "10.0.0.2:26379"}, master: "mymaster", sentinel: "spw"}},

		{"cluster", RedisConfig{URL: "redis://u:pw@n1:7000?addr=n2:7001&addr=n3:7002", Cluster: true},
			wantOpts{addrs: []string{"n1:7000", "n2:7001", "n3:7002"}, cluster: true, user: "u", password: "pw"}},
		{"cluster_one_seed_db_0", RedisConfig{URL: "redis://n1:7000/0", Cluster: true},
			wantOpts{addrs: []string{"n1:7000"}, cluster: true}},
		{"cluster_tls", RedisConfig{URL: "rediss://:pw@n1:7000?addr=n2:7000", Cluster: true},
			wantOpts{addrs: []string{"n1:7000", "n2:7000"}, cluster: true, password: "pw", tls: "*"}},
		{"cluster_password_field", RedisConfig{URL: "redis://n1:7000?addr=n2:7000", Cluster: true, Password: "pw"},
			wantOpts{addrs: []string{"n1:7000", "n2:7000"}, cluster: true, password: "pw"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.rc.validate(); err != nil {
				t.Fatalf("validate: %v", err)
			}
			r, err := tc.rc.resolve()
			if err != nil {
				t.Fatalf("resolve: %v", err)
			}
			o := &r.opt
			got := wantOpts{addrs: o.Addrs, cluster: r.cluster, master: o.MasterName, sentinelUser: o.SentinelUsername,
				sentinel: o.SentinelPassword, user: o.Username, password: o.Password, db: o.DB}
			if o.TLSConfig != nil {
				got.tls = o.TLSConfig.ServerName
				if got.tls == "" {
					got.tls = "*"
				}
				if o.TLSConfig.MinVersion != tls.VersionTLS12 {
					t.Errorf("TLS MinVersion %#x, want TLS 1.2", o.TLSConfig.MinVersion)
				}
			}
			if !slices.Equal(got.addrs, tc.want.addrs) || got.cluster != tc.want.cluster || got.master != tc.want.master ||
				got.sentinelUser != tc.want.sentinelUser || got.sentinel != tc.want.sentinel || got.user != tc.want.user ||
				got.password != tc.want.password || got.db != tc.want.db || got.tls != tc.want.tls {
				t.Errorf("resolved\n%+v\nwant\n%+v", got, tc.want)
			}
			if o.MaxRetries != -1 {
				t.Errorf("MaxRetries %d: retries must stay off whatever the URL says", o.MaxRetries)
			}
		})
	}
}

// TestRedisURLErrors: a URL that does not fit its topology is an error
// that says why, and no error ever shows a password of the URL, whether
// it stands before the host or in a password parameter.
func TestRedisURLErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		rc   RedisConfig
		want string
	}{
		{"cluster_with_master_name", RedisConfig{URL: "redis://:s3cret@n1:7000?master_name=m", Cluster: true},
			"redis.url: master_name names a Sentinel master, not with cluster"},
		{"cluster_db", RedisConfig{URL: "redis://:s3cret@n1:7000/3", Cluster: true},
			`redis.url: database "3": Redis Cluster has only db 0`},
		{"cluster_db_parameter", RedisConfig{URL: "redis://:s3cret@n1:7000?db=3", Cluster: true},
			"redis.url: redis: unexpected option: db"},
		{"addr_without_topology", RedisConfig{URL: "redis://:s3cret@n1:7000?addr=n2:7000"},
			"redis.url: addr names more nodes: set cluster for Cluster seeds, or add master_name for Sentinels"},
		{"master_name_empty", RedisConfig{URL: "redis://:s3cret@s1:26379?master_name="},
			"redis.url: master_name is empty"},
		{"scheme", RedisConfig{URL: "http://:s3cret@cache:6379"}, `redis.url: scheme "http": must be redis or rediss`},
		{"sentinel_password_without_sentinels", RedisConfig{URL: "redis://cache:6379", SentinelPassword: "s3cret"},
			"redis.sentinel_password: only with Sentinels (sentinel, or a url with master_name)"},
		{"unix_socket", RedisConfig{URL: "unix:///run/redis.sock"}, `redis.url: scheme "unix": must be redis or rediss`},
		{"unknown_option", RedisConfig{URL: "redis://:s3cret@cache:6379?dial_timeout=1s&s3cret=1"},
			"redis.url: redis: unexpected option: xxxxx"},
		{"sentinel_addr_holds_password", RedisConfig{URL: "redis://:s3cret@s1:26379?master_name=m&addr=s3cret"},
			"redis.url: redis: unable to parse addr param: xxxxx"},
		{"sentinel_password_parameter", RedisConfig{URL: "redis://s1:26379?master_name=m&password=s3cret&addr=s3cret"},
			"redis.url: redis: unable to parse addr param: xxxxx"},
		{"cluster_addr_holds_password", RedisConfig{URL: "redis://user:s3cret@n1:7000?addr=s3cret:", Cluster: true},
			"redis.url: redis: unable to parse addr param: xxxxx:"},
		{"sentinel_bad_db", RedisConfig{URL: "redis://:s3cret@s1:26379/x?master_name=m"},
			`redis.url: redis: invalid database number: "x"`},
		{"unparsable", RedisConfig{URL: "redis://alice:s3cret@cache:port/0"}, `redis.url: invalid port ":port" after host`},
		{"negative_db", RedisConfig{URL: "redis://:s3cret@cache:6379/-2"}, "redis.url: database -2: must be a whole number ≥ 0"},
		{"negative_db_parameter", RedisConfig{URL: "redis://:s3cret@cache:6379?db=-1"}, "redis.url: database -1: must be a whole number ≥ 0"},
		{"sentinel_negative_db", RedisConfig{URL: "redis://:s3cret@s1:26379/-3?master_name=m"}, "redis.url: database -3: must be a whole number ≥ 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.rc.validate(); err != nil {
				t.Fatalf("validate: %v; the URL is checked when it is resolved", err)
			}
			_, err := tc.rc.resolve()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("resolve error %v\nwant it to contain %s", err, tc.want)
			}
			if strings.Contains(err.Error(), "s3cret") {
				t.Errorf("the error shows the password: %v", err)
			}
		})
	}
}

// TestRedisURLValidate: a URL goes with cluster or sentinel (it carries the
// nodes), never with address; an error about a literal URL hides its
// passwords.
func TestRedisURLValidate(t *testing.T) {
	for _, rc := range []RedisConfig{
		{URL: "redis://n1:7000?addr=n2:7000", Cluster: true},
		{URL: "redis://s1:26379?addr=s2:26379", Sentinel: "mymaster"},
		{URL: "{env.REDIS_URL}", Cluster: true},
	} {
		if err := rc.validate(); err != nil {
			t.Errorf("%+v: %v", rc, err)
		}
	}
	for _, tc := range []struct {
		rc   RedisConfig
		want string
	}{
		{RedisConfig{Cluster: true}, "redis.address: cluster and sentinel need at least one address"},
		{RedisConfig{Sentinel: "m"}, "redis.address: cluster and sentinel need at least one address"},
		{RedisConfig{URL: "redis://u:s3cret@s1:26379?master_name=m&password=s3cret2", Address: []string{"s2:26379"}},
			`redis: url "redis://u:xxxxx@s1:26379?master_name=m&password=xxxxx" and address ["s2:26379"]: set one, not both`},
	} {
		err := tc.rc.validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v\nwant it to contain %s", tc.rc, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "s3cret") {
			t.Errorf("the error shows a password: %v", err)
		}
	}
}

// TestRedisURLCaddyfile: the Caddyfile takes a Cluster or Sentinel URL on
// the redis line, with cluster or sentinel in its block.
func TestRedisURLCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		redis string
		want  RedisConfig
	}{
		{"redis {env.REDIS_URL} {\n\t\tcluster\n\t}", RedisConfig{URL: "{env.REDIS_URL}", Cluster: true}},
		{"redis redis://s1:26379?addr=s2:26379 {\n\t\tsentinel mymaster\n\t}",
			RedisConfig{URL: "redis://s1:26379?addr=s2:26379", Sentinel: "mymaster"}},
		{"redis redis://s1:26379?master_name=mymaster&addr=s2:26379", RedisConfig{URL: "redis://s1:26379?master_name=mymaster&addr=s2:26379"}},
	} {
		h := new(Handler)
		d := caddyfile.NewTestDispenser("token_bucket {\n\t" + tc.redis +
			"\n\tdimension user {http.request.header.X-User}\n\ttier free {\n\t\tuser 10 1/s\n\t}\n}")
		if err := h.UnmarshalCaddyfile(d); err != nil {
			t.Errorf("%s: %v", tc.redis, err)
			continue
		}
		if h.Redis == nil || h.Redis.URL != tc.want.URL || h.Redis.Cluster != tc.want.Cluster || h.Redis.Sentinel != tc.want.Sentinel {
			t.Errorf("%s: redis %+v, want %+v", tc.redis, h.Redis, tc.want)
		}
	}
}

// TestRedisURLDecides runs a real Redis Cluster and a real Sentinel group
// and names each with one REDIS_URL only: the handler decides through it,
// and the bucket lands where the topology puts it (the Cluster node of its
// slot, the master the Sentinels name).
func TestRedisURLDecides(t *testing.T) {
	redistest.SkipShort(t)
	const capacity = 2
	decide := func(t *testing.T, rc *RedisConfig) *Handler {
		t.Helper()
		h := provisionHandler(t, foHandler(rc, PolicyDeny, capacity))
		foWantRedis(t, "request 1", serveUser(h, "alice"), http.StatusOK, 1)
		foWantRedis(t, "request 2", serveUser(h, "alice"), http.StatusOK, 0)
		foWantRedis(t, "request 3", serveUser(h, "alice"), http.StatusTooManyRequests, 0)
		return h
	}

	t.Run("cluster", func(t *testing.T) {
		cluster := redistest.StartCluster(t, 3)
		a := cluster.Addrs()
		t.Setenv("REDIS_URL", "redis://"+a[0]+"?addr="+a[1]+"&addr="+a[2])
		h := decide(t, &RedisConfig{URL: "{env.REDIS_URL}", Cluster: true, Timeout: caddy.Duration(foTimeout)})
		key := h.keyer.Key("user", "alice", "")
		node := cluster.NodeOf(t, key)
		if n, err := node.Client(t).Exists(context.Background(), key).Result(); err != nil || n != 1 {
			t.Errorf("EXISTS %s on the node of its slot (%s) = %d, %v; want the bucket there", key, node.Addr, n, err)
		}
	})

	t.Run("sentinel", func(t *testing.T) {
		master := redistest.Start(t)
		sentinels := redistest.StartSentinels(t, master, 0, 2, redistest.SentinelConfig{
			MasterName: "tbmaster", Quorum: 1, DownAfter: 5 * time.Second, FailoverTimeout: 10 * time.Second})
		t.Setenv("REDIS_URL", "redis://"+sentinels[0].Addr+"/0?master_name=tbmaster&addr="+sentinels[1].Addr)
		h := decide(t, &RedisConfig{URL: "{env.REDIS_URL}", Timeout: caddy.Duration(foTimeout)})
		key := h.keyer.Key("user", "alice", "")
		if n, err := master.Client(t).Exists(context.Background(), key).Result(); err != nil || n != 1 {
			t.Errorf("EXISTS %s on the master = %d, %v; want the bucket there", key, n, err)
		}
	})
}

// TestSentinelUnknownMaster: Sentinels that answer but do not know the
// master name are reported as such at load, naming the master, rather
// than as unreachable Sentinels.
func TestSentinelUnknownMaster(t *testing.T) {
	master := redistest.Start(t)
	sentinels := redistest.StartSentinels(t, master, 0, 1, redistest.SentinelConfig{
		MasterName: "tbmaster", Quorum: 1, DownAfter: 5 * time.Second, FailoverTimeout: 10 * time.Second})
	r, err := (&RedisConfig{Address: []string{sentinels[0].Addr}, Sentinel: "nosuchmaster", Timeout: caddy.Duration(foTimeout)}).resolve()
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	_, key, err := acquire(context.Background(), r, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	defer conns.Delete(key)
	entries := logs.All()
	if len(entries) != 1 || entries[0].Message != "the sentinels do not know this master_name; on_redis_error applies until they do" ||
		entries[0].ContextMap()["master_name"] != "nosuchmaster" {
		t.Errorf("load-time warnings: %+v; want one saying the sentinels do not know master_name nosuchmaster", entries)
	}
}

// TestRedisAddressPlaceholderUnset: an address whose placeholder is unset
// fails at load, naming it, instead of going to go-redis's default,
// localhost:6379.
func TestRedisAddressPlaceholderUnset(t *testing.T) {
	_, err := (&RedisConfig{Address: []string{"{env.TB_TEST_UNSET_ADDR}"}}).resolve()
	if err == nil || !strings.Contains(err.Error(), `redis.address "{env.TB_TEST_UNSET_ADDR}"`) {
		t.Errorf("resolve: %v; want an error naming the address", err)
	}
}

// TestAcquirePanicFails: options go-redis panics on (validation keeps them
// out; this is the guard behind it) fail acquire with an error, every time:
// a panic inside the shared pool's constructor would leave its entry
// locked, and the next config load with the same settings waiting on it
// for good.
func TestAcquirePanicFails(t *testing.T) {
	r, err := (&RedisConfig{Address: []string{"127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}, PoolSize: 1 << 40}).resolve()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if _, _, err := acquire(context.Background(), r, zap.NewNop()); err == nil || !strings.Contains(err.Error(), "redis: creating the client") {
			t.Fatalf("acquire %d: %v; want the client's creation to fail", i+1, err)
		}
	}
}
