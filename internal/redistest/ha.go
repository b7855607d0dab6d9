package redistest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// infoField returns field of INFO section from the server at addr.
func infoField(ctx context.Context, c *redis.Client, section, field string) (string, error) {
	info, err := c.Info(ctx, section).Result()
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("INFO %s has no %s", section, field)
}

// StartReplica runs a replica of master and waits until its link to the
// master is up.
func StartReplica(t testing.TB, master *Server, extra ...string) *Server {
	t.Helper()
	host, port, _ := strings.Cut(master.Addr, ":")
	r := Start(t, append([]string{"--replicaof", host, port}, extra...)...)
	c := r.Client(t)
	WaitFor(t, 10*time.Second, "the replica's link to its master", func() error {
		v, err := infoField(context.Background(), c, "replication", "master_link_status")
		if err == nil && v != "up" {
			err = fmt.Errorf("master_link_status:%s", v)
		}
		return err
	})
	return r
}

// SentinelConfig is the monitoring configuration of StartSentinels.
type SentinelConfig struct {
	MasterName      string
	Quorum          int
	DownAfter       time.Duration
	FailoverTimeout time.Duration
}

// StartSentinels runs n Sentinels monitoring master and waits until each
// knows the others and the master's replicas (want of them), so that a
// failover can be authorized from then on.
func StartSentinels(t testing.TB, master *Server, replicas, n int, conf SentinelConfig) []*Server {
	t.Helper()
	return StartSentinelsAt(t, master.Addr, replicas, n, conf)
}

// StartSentinelsAt is StartSentinels for a master the Sentinels reach,
// and name to clients, at addr: a Proxy in front of it, say.
func StartSentinelsAt(t testing.TB, addr string, replicas, n int, conf SentinelConfig) []*Server {
	t.Helper()
	host, port, _ := strings.Cut(addr, ":")
	sentinels := make([]*Server, n)
	for i := range sentinels {
		sentinels[i] = startWith(t, nil, func(s *Server) []string {
			file := filepath.Join(s.Dir, "sentinel.conf")
			text := fmt.Sprintf("sentinel monitor %s %s %s %d\n"+
				"sentinel down-after-milliseconds %s %d\n"+
				"sentinel failover-timeout %s %d\n"+
				"sentinel parallel-syncs %s 1\n",
				conf.MasterName, host, port, conf.Quorum,
				conf.MasterName, conf.DownAfter.Milliseconds(),
				conf.MasterName, conf.FailoverTimeout.Milliseconds(), conf.MasterName)
			if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
				t.Fatal(err)
			}
			return []string{file, "--sentinel", "--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1",
				"--dir", s.Dir, "--daemonize", "no", "--logfile", "", "--loglevel", "warning"}
		})
	}
	for _, s := range sentinels {
		c := s.Client(t)
		WaitFor(t, 15*time.Second, "sentinel "+s.Addr+" to discover its peers and replicas", func() error {
			m, err := c.Do(context.Background(), "SENTINEL", "MASTER", conf.MasterName).Result()
			if err != nil {
				return err
			}
			fields := flatMap(m)
			if fields["num-other-sentinels"] != strconv.Itoa(n-1) || fields["num-slaves"] != strconv.Itoa(replicas) {
				return fmt.Errorf("num-other-sentinels %s, num-slaves %s", fields["num-other-sentinels"], fields["num-slaves"])
			}
			return nil
		})
	}
	return sentinels
}

// MasterAddr asks a Sentinel for the address of the master it knows.
func MasterAddr(ctx context.Context, sentinel *Server, name string) (string, error) {
	c := redis.NewSentinelClient(&redis.Options{Addr: sentinel.Addr, MaxRetries: -1})
	defer c.Close()
	a, err := c.GetMasterAddrByName(ctx, name).Result()
	if err != nil {
		return "", err
	}
	return a[0] + ":" + a[1], nil
}

// flatMap turns a RESP2 flat array or a RESP3 map of strings into a map.
func flatMap(v any) map[string]string {
	out := map[string]string{}
	switch m := v.(type) {
	case []any:
		for i := 0; i+1 < len(m); i += 2 {
			out[fmt.Sprint(m[i])] = fmt.Sprint(m[i+1])
		}
	case map[any]any:
		for k, v := range m {
			out[fmt.Sprint(k)] = fmt.Sprint(v)
		}
	}
	return out
}

// Cluster is a Redis Cluster of masters without replicas.
type Cluster struct {
	Nodes []*Server
}

// StartClusterNode runs a redis-server with cluster mode on and its
// cluster bus on another free port, not yet part of any cluster.
func StartClusterNode(t testing.TB, extra ...string) *Server {
	t.Helper()
	return Start(t, append([]string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-port", strconv.Itoa(FreePort(t)), "--cluster-node-timeout", "5000"}, extra...)...)
}

// StartCluster runs n masters (each with the extra arguments), joins them
// with redis-cli --cluster create (the slots split evenly) and waits until
// every node reports cluster_state:ok and knows every other node.
func StartCluster(t testing.TB, n int, extra ...string) *Cluster {
	t.Helper()
	c := &Cluster{}
	args := []string{"--cluster", "create"}
	for i := 0; i < n; i++ {
		s := StartClusterNode(t, extra...)
		c.Nodes = append(c.Nodes, s)
		args = append(args, s.Addr)
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	c.WaitOK(t)
	return c
}

// WaitOK waits until every node reports cluster_state:ok, knows every
// node and sees every slot assigned.
func (c *Cluster) WaitOK(t testing.TB) {
	t.Helper()
	for _, s := range c.Nodes {
		cl := s.Client(t)
		WaitFor(t, 15*time.Second, "cluster state on "+s.Addr, func() error {
			info, err := cl.ClusterInfo(context.Background()).Result()
			if err != nil {
				return err
			}
			for _, want := range []string{"cluster_state:ok", "cluster_slots_ok:16384",
				"cluster_known_nodes:" + strconv.Itoa(len(c.Nodes))} {
				if !strings.Contains(info, want+"\r\n") {
					return fmt.Errorf("no %s in CLUSTER INFO:\n%s", want, info)
				}
			}
			return nil
		})
	}
}

// Addrs returns the nodes' addresses.
func (c *Cluster) Addrs() []string {
	a := make([]string, len(c.Nodes))
	for i, s := range c.Nodes {
		a[i] = s.Addr
	}
	return a
}

// Client returns a cluster client (no retries), closed at the end of the
// test.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1})
	t.Cleanup(func() { cc.Close() })
	return cc
}

// NodeOf returns the node that serves key, by CLUSTER SLOTS on the first
// node.
func (c *Cluster) NodeOf(t testing.TB, key string) *Server {
	t.Helper()
	ctx := context.Background()
	cl := c.Nodes[0].Client(t)
	slot, err := cl.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	slots, err := cl.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range slots {
		if int64(r.Start) <= slot && slot <= int64(r.End) {
			for _, s := range c.Nodes {
				if s.Addr == r.Nodes[0].Addr {
					return s
				}
			}
		}
	}
	t.Fatalf("no node serves slot %d of %q", slot, key)
	return nil
}

// AddReplica runs a cluster node (with the extra arguments), has it join
// the cluster as a replica of master and waits until its link to master is
// up and every node knows it. It is then in Nodes.
func (c *Cluster) AddReplica(t testing.TB, master *Server, extra ...string) *Server {
	t.Helper()
	ctx := context.Background()
	r := StartClusterNode(t, extra...)
	rc := r.Client(t)
	host, port, _ := strings.Cut(master.Addr, ":")
	bus, err := master.Client(t).ConfigGet(ctx, "cluster-port").Result()
	if err != nil {
		t.Fatalf("CONFIG GET cluster-port: %v", err)
	}
	if err := rc.Do(ctx, "CLUSTER", "MEET", host, port, bus["cluster-port"]).Err(); err != nil {
		t.Fatalf("CLUSTER MEET: %v", err)
	}
	id := NodeID(t, master)
	WaitFor(t, 15*time.Second, "the new node to replicate "+master.Addr, func() error {
		return rc.ClusterReplicate(ctx, id).Err() // fails until the node knows master
	})
	WaitFor(t, 15*time.Second, "the replica's link to its master", func() error {
		v, err := infoField(ctx, rc, "replication", "master_link_status")
		if err == nil && v != "up" {
			err = fmt.Errorf("master_link_status:%s", v)
		}
		return err
	})
	c.Nodes = append(c.Nodes, r)
	c.WaitOK(t)
	return r
}

// NodeID returns the node's cluster id.
func NodeID(t testing.TB, s *Server) string {
	t.Helper()
	id, err := s.Client(t).Do(context.Background(), "CLUSTER", "MYID").Text()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// MigrateSlot moves slot, with its keys, from one node to another as
// redis-cli --cluster reshard does: IMPORTING, MIGRATING, MIGRATE of every
// key, then SETSLOT NODE on every node.
func (c *Cluster) MigrateSlot(t testing.TB, slot int64, from, to *Server) {
	t.Helper()
	ctx := context.Background()
	src, dst := from.Client(t), to.Client(t)
	fromID, toID := NodeID(t, from), NodeID(t, to)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("migrating slot %d: %v", slot, err)
		}
	}
	must(dst.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", fromID).Err())
	must(src.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", toID).Err())
	host, port, _ := strings.Cut(to.Addr, ":")
	for {
		keys, err := src.ClusterGetKeysInSlot(ctx, int(slot), 100).Result()
		must(err)
		if len(keys) == 0 {
			break
		}
		args := []any{"MIGRATE", host, port, "", 0, 5000, "KEYS"}
		for _, k := range keys {
			args = append(args, k)
		}
		must(src.Do(ctx, args...).Err())
	}
	for _, s := range []*Server{to, from} {
		must(s.Client(t).Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", toID).Err())
	}
	for _, s := range c.Nodes {
		if s != from && s != to {
			must(s.Client(t).Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", toID).Err())
		}
	}
}
