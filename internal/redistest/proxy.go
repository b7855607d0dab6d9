package redistest

import (
	"bytes"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy is a TCP proxy on a free loopback port that forwards to a target
// and can be told to lose one reply, as a network or a middlebox can: the
// request reaches the server (and runs), the reply never reaches the
// client, and the connection closes; or to hold one reply back, as a
// congested network can, past the client's timeout.
type Proxy struct {
	Addr string
	Port int

	ln      net.Listener
	target  atomic.Value // string
	cut     atomic.Value // string: lower-case text of the request whose reply to lose
	cuts    atomic.Int64
	hold    atomic.Value // string: lower-case text of the request whose reply to hold
	holdFor atomic.Int64 // how long, in ns
	holds   atomic.Int64
	mu      sync.Mutex
	conns   []net.Conn
	wg      sync.WaitGroup
}

// StartProxy listens on a free port; set the target with SetTarget before
// the first connection. It closes at the end of the test.
func StartProxy(t testing.TB) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{ln: ln, Addr: ln.Addr().String(), Port: ln.Addr().(*net.TCPAddr).Port}
	p.cut.Store("")
	p.hold.Store("")
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.Close)
	return p
}

// SetTarget sets the address that new connections go to.
func (p *Proxy) SetTarget(addr string) { p.target.Store(addr) }

// LoseReplyTo arms the proxy once: the first request that contains text
// (ignoring case) is forwarded, its reply dropped and the connection
// closed.
func (p *Proxy) LoseReplyTo(text string) { p.cut.Store(strings.ToLower(text)) }

// Lost returns how many replies the proxy dropped.
func (p *Proxy) Lost() int64 { return p.cuts.Load() }

// DelayReplyTo arms the proxy once: the first request that contains text
// (ignoring case) is forwarded at once, and the next bytes the server
// sends back on that connection (its reply, and any other reply that is
// ready by then) are held for d, then passed on if the client is still
// there.
func (p *Proxy) DelayReplyTo(text string, d time.Duration) {
	p.holdFor.Store(int64(d))
	p.hold.Store(strings.ToLower(text))
}

// Disarm cancels a LoseReplyTo or DelayReplyTo that has not met its
// request yet.
func (p *Proxy) Disarm() {
	p.cut.Store("")
	p.hold.Store("")
}

// Armed reports whether a LoseReplyTo or DelayReplyTo still waits for
// its request.
func (p *Proxy) Armed() bool { return p.cut.Load() != "" || p.hold.Load() != "" }

// Delayed returns how many replies the proxy has held for their whole
// delay (and then passed on, or found the client gone).
func (p *Proxy) Delayed() int64 { return p.holds.Load() }

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		target, _ := p.target.Load().(string)
		server, err := net.Dial("tcp", target)
		if err != nil {
			client.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		var armed atomic.Bool
		var held atomic.Int64 // ns to hold the next reply for
		p.wg.Add(2)
		go p.pipe(server, client, func(b []byte) bool { // client → server
			if want := p.cut.Load().(string); want != "" && bytes.Contains(bytes.ToLower(b), []byte(want)) {
				if p.cut.CompareAndSwap(want, "") {
					armed.Store(true)
				}
			}
			if want := p.hold.Load().(string); want != "" && bytes.Contains(bytes.ToLower(b), []byte(want)) {
				if p.hold.CompareAndSwap(want, "") {
					held.Store(p.holdFor.Load())
				}
			}
			return true
		})
		go p.pipe(client, server, func([]byte) bool { // server → client
			if armed.Load() {
				p.cuts.Add(1)
				return false
			}
			if d := held.Swap(0); d > 0 {
				time.Sleep(time.Duration(d)) // the fault being injected
				p.holds.Add(1)
			}
			return true
		})
	}
}

// pipe copies src to dst while pass allows each chunk; when it refuses,
// both connections close.
func (p *Proxy) pipe(dst, src net.Conn, pass func([]byte) bool) {
	defer p.wg.Done()
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !pass(buf[:n]) {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// PortString returns the port as a string, for redis-server arguments.
func (p *Proxy) PortString() string { return strconv.Itoa(p.Port) }
