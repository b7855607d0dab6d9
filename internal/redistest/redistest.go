// Package redistest starts real redis-server processes for tests, each on a
// free loopback port with persistence off, stopped when the test ends:
// single servers, replicas, Sentinels, Cluster nodes and TLS servers.
package redistest

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Server is a running redis-server (or Sentinel).
type Server struct {
	Addr string
	Port int
	Dir  string
	// TLS is the client configuration that reaches a server started with
	// StartTLS; nil for a plain server.
	TLS *tls.Config

	mu   sync.Mutex
	cmd  *exec.Cmd
	args []string // every argument, for Restart
}

// SkipShort skips a test that needs servers (redis-server, Caddy, Node)
// under go test -short: the short tier runs the unit and table tests
// alone, in seconds; the full suite (make test, CI) runs every test.
func SkipShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts servers: not part of the -short tier")
	}
}

// Start runs redis-server on a free 127.0.0.1 port and stops it at the end
// of the test. A redis-server that is missing or does not start fails the
// test: it is never skipped (but under -short, see SkipShort). extra
// arguments come after the defaults and override them.
func Start(t testing.TB, extra ...string) *Server {
	t.Helper()
	return startWith(t, nil, func(s *Server) []string {
		return append(baseArgs(s, "--port", strconv.Itoa(s.Port)), extra...)
	})
}

// baseArgs are the arguments of every server: loopback only, no
// persistence, logs on stdout (drained) at warning level.
func baseArgs(s *Server, listen ...string) []string {
	return append(listen,
		"--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.Dir,
		"--daemonize", "no", "--logfile", "", "--loglevel", "warning")
}

// startWith picks a free port, builds the arguments with args and starts
// the server, trying other ports if one is taken meanwhile.
func startWith(t testing.TB, tlsConf *tls.Config, args func(*Server) []string) *Server {
	t.Helper()
	SkipShort(t)
	s := &Server{Dir: t.TempDir(), TLS: tlsConf}
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		s.Port = FreePort(t)
		s.Addr = "127.0.0.1:" + strconv.Itoa(s.Port)
		s.args = args(s)
		if err = s.start(); err == nil {
			t.Cleanup(s.Stop)
			return s
		}
	}
	t.Fatalf("starting redis-server: %v", err)
	return nil
}

func (s *Server) start() error {
	path, err := exec.LookPath("redis-server")
	if err != nil {
		return fmt.Errorf("redis-server not found on PATH (install Debian's redis-server): %w", err)
	}
	cmd := exec.Command(path, s.args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() { // drain the log so the server never blocks on it
		sc := bufio.NewScanner(out)
		for sc.Scan() {
		}
	}()
	s.mu.Lock()
	s.cmd = cmd
	s.mu.Unlock()
	return s.waitReady(5 * time.Second)
}

// waitReady polls until the server answers. A Redis error reply (NOAUTH
// from a server with a password) is an answer.
func (s *Server) waitReady(limit time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, TLSConfig: s.TLS, MaxRetries: -1,
		DialTimeout: 100 * time.Millisecond, Protocol: 2})
	defer c.Close()
	deadline := time.Now().Add(limit)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		var rerr redis.Error
		if err == nil || errors.As(err, &rerr) {
			return nil
		}
		if time.Now().After(deadline) {
			s.Stop()
			return fmt.Errorf("redis-server on %s not ready: %w", s.Addr, err)
		}
		time.Sleep(10 * time.Millisecond) // polling for readiness, not timing a result
	}
}

// Stop kills the server (SIGKILL, as a crash) and waits for it to exit.
func (s *Server) Stop() {
	s.mu.Lock()
	cmd := s.cmd
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGCONT) // in case it was paused
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
}

// Restart starts the server again on the same port with the same
// arguments, after Stop. Its data and script cache start empty.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	var err error
	deadline := time.Now().Add(5 * time.Second)
	for {
		if err = s.start(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("restarting redis-server on %s: %v", s.Addr, err)
		}
		time.Sleep(50 * time.Millisecond) // the port may take a moment to free
	}
}

// Pid returns the server's process id, 0 when it is not running.
func (s *Server) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil || s.cmd.Process == nil {
		return 0
	}
	return s.cmd.Process.Pid
}

// Pause stops the server process with SIGSTOP: it keeps its socket, the
// kernel still accepts connections, and nothing answers. Resume undoes it,
// and so does the end of the test.
func (s *Server) Pause(t testing.TB) {
	t.Helper()
	s.signal(t, syscall.SIGSTOP)
	t.Cleanup(func() { s.Resume(t) })
}

// Resume continues a paused server with SIGCONT.
func (s *Server) Resume(t testing.TB) {
	t.Helper()
	s.signal(t, syscall.SIGCONT)
}

func (s *Server) signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	pid := s.Pid()
	if pid == 0 {
		return
	}
	if err := syscall.Kill(pid, sig); err != nil {
		t.Fatalf("signalling redis-server %d: %v", pid, err)
	}
}

// Options returns client options for the server (no retries).
func (s *Server) Options() *redis.Options {
	return &redis.Options{Addr: s.Addr, TLSConfig: s.TLS, MaxRetries: -1}
}

// Client returns a client for the server, closed at the end of the test.
func (s *Server) Client(t testing.TB) *redis.Client {
	c := redis.NewClient(s.Options())
	t.Cleanup(func() { c.Close() })
	return c
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("finding a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// WaitFor polls cond every 20ms until it returns nil or limit passes, then
// fails the test with cond's last error. It is for waiting on servers
// (replication, failover, cluster state), never for timing a result.
func WaitFor(t testing.TB, limit time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting %v for %s: %v", limit, what, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
