package soak

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Process is a child process with its output in a log file.
type Process struct {
	Name string
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// StartProcess runs name with args in dir, with env added to this
// process's environment, its stdout and stderr going to <dir>/<logName>.log
// (appended, so a restarted process keeps one log).
func StartProcess(dir, logName string, env []string, name string, args ...string) (*Process, error) {
	p := &Process{Name: logName, Log: filepath.Join(dir, logName+".log"), done: make(chan struct{})}
	f, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	p.cmd = exec.Command(name, args...)
	p.cmd.Dir = dir
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	if err := p.cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

// Pid returns the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop sends SIGTERM, waits up to grace for the exit, then kills. It is
// safe to call more than once.
func (p *Process) Stop(grace time.Duration) {
	if p == nil || p.Exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// Kill kills the process at once and waits for it.
func (p *Process) Kill() {
	if p == nil || p.Exited() {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// WaitHTTP polls url until it answers 200, the process exits, or the
// context ends. It is a readiness poll: no result is timed by it.
func (p *Process) WaitHTTP(ctx context.Context, url string) error {
	client := &http.Client{Timeout: time.Second}
	for {
		res, err := client.Get(url)
		if err == nil {
			res.Body.Close()
			if res.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("status %d", res.StatusCode)
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited (%v) before %s answered; log %s", p.Name, p.err, url, p.Log)
		case <-ctx.Done():
			return fmt.Errorf("%s: %s not ready: %v (last error %v); log %s", p.Name, url, ctx.Err(), err, p.Log)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// StartRedis runs redis-server on 127.0.0.1:port with persistence off and
// waits until it answers PING.
func StartRedis(ctx context.Context, dir string, port int) (*Process, error) {
	p, err := StartProcess(dir, "redis", nil, "redis-server",
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir,
		"--daemonize", "no", "--loglevel", "warning")
	if err != nil {
		return nil, err
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	for {
		if err := ping(addr); err == nil {
			return p, nil
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("redis-server on %s exited (%v); log %s", addr, p.err, p.Log)
		case <-ctx.Done():
			p.Kill()
			return nil, fmt.Errorf("redis-server on %s not ready: %v", addr, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// ping sends an inline PING and expects +PONG.
func ping(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	buf := make([]byte, 7)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	if string(buf[:n]) != "+PONG\r\n" {
		return errors.New("unexpected PING reply " + strconv.Quote(string(buf[:n])))
	}
	return nil
}

// StartCaddy writes caddyfile to <dir>/<name>.Caddyfile and runs
// `caddy run` on it with its XDG data and config directories inside dir, so
// that nothing is read from or saved to the user's.
func StartCaddy(bin, dir, name, caddyfile string) (*Process, error) {
	cfg := filepath.Join(dir, name+".Caddyfile")
	if err := os.WriteFile(cfg, []byte(caddyfile), 0o644); err != nil {
		return nil, err
	}
	env := []string{"XDG_DATA_HOME=" + filepath.Join(dir, "data"), "XDG_CONFIG_HOME=" + filepath.Join(dir, "config")}
	return StartProcess(dir, name, env, bin, "run", "--config", cfg, "--adapter", "caddyfile")
}
