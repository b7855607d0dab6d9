package tokenbucket

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/token-bucket/token_bucket/bucket"
)

// Defaults of the audit log.
const (
	DefaultAuditWindow  = 10 * time.Second
	DefaultAuditBuckets = 10000
)

// AuditLogger is the name of the logger of audit entries, to route them
// with Caddy's log include/exclude.
const AuditLogger = "http.handlers.token_bucket.audit"

// AuditOptions configure the audit log: one structured entry (logger
// http.handlers.token_bucket.audit, level INFO, message "request denied")
// per denied request, with fields tier, dimension, unit, id (the hashed
// identity, as in the bucket key: never the raw identity or API key), key,
// reason, cost, retry_after_ms, degraded, client_ip and suppressed, and
// period for a calendar quota and shadow (true) for a limit in shadow,
// whose would-be denials are logged too. So that
// a client in a tight retry loop cannot flood the log, a bucket gets at
// most one entry per audit_window: its later denials in the window are only
// counted, and its next entry carries that count as suppressed.
type AuditOptions struct {
	// Audit turns the audit log on or off (default on: true).
	Audit *bool `json:"audit,omitempty"`

	// AuditWindow is the shortest time between two audit entries of one
	// bucket (default 10s). A client denied continuously gets one entry
	// per window.
	AuditWindow caddy.Duration `json:"audit_window,omitempty"`

	// AuditClientIP puts the client's IP address (as Caddy determines it,
	// trusted_proxies included) in each entry as client_ip (default true).
	AuditClientIP *bool `json:"audit_client_ip,omitempty"`

	// AuditBuckets bounds the buckets whose window the audit log
	// remembers (default 10000, about 1.5 MB); the least recently denied is
	// forgotten first, and its next denial is logged at once.
	AuditBuckets int `json:"audit_buckets,omitempty"`
}

func (a AuditOptions) validate() error {
	if err := durationRule(time.Duration(a.AuditWindow)); a.AuditWindow != 0 && err != nil {
		return fmt.Errorf("audit_window %v: %v", time.Duration(a.AuditWindow), err)
	}
	if err := positiveRule(int64(a.AuditBuckets)); a.AuditBuckets != 0 && err != nil {
		return fmt.Errorf("audit_buckets %d: %v", a.AuditBuckets, err)
	}
	return nil
}

// auditor writes the audit entries of one handler, at most one per bucket
// per window. A nil *auditor writes nothing.
type auditor struct {
	logger   *zap.Logger
	window   time.Duration
	clientIP bool
	now      func() time.Time

	mu      sync.Mutex
	windows *simplelru.LRU[string, *auditWindow]
}

// auditWindow is one bucket's current window.
type auditWindow struct {
	start      time.Time
	suppressed int64 // denials not logged since start
}

// newAuditor returns the handler's auditor, nil when audit is off.
func (h *Handler) newAuditor() *auditor {
	if h.Audit != nil && !*h.Audit {
		return nil
	}
	a := &auditor{
		logger:   h.logger.Named("audit"),
		window:   time.Duration(h.AuditWindow),
		clientIP: h.AuditClientIP == nil || *h.AuditClientIP,
		now:      h.now,
	}
	if a.window <= 0 {
		a.window = DefaultAuditWindow
	}
	if a.now == nil {
		a.now = time.Now
	}
	size := h.AuditBuckets
	if size <= 0 {
		size = DefaultAuditBuckets
	}
	a.windows, _ = simplelru.NewLRU[string, *auditWindow](size, nil) // errors only for size ≤ 0
	return a
}

// admit says whether a denial of the bucket at key is logged now, and if
// so how many of its denials were suppressed since its last entry.
func (a *auditor) admit(key string) (suppressed int64, ok bool) {
	now := a.now()
	a.mu.Lock()
	defer a.mu.Unlock()
	w, found := a.windows.Get(key)
	if !found {
		a.windows.Add(key, &auditWindow{start: now})
		return 0, true
	}
	if now.Sub(w.start) < a.window {
		w.suppressed++
		return 0, false
	}
	suppressed = w.suppressed
	w.start, w.suppressed = now, 0
	return suppressed, true
}

// denied writes the audit entry of the denial of a request by its bucket
// i (the deciding one, or a shadow bucket that would have denied it, with
// "shadow":true), unless the bucket had one in the current window.
func (a *auditor) denied(r *http.Request, t *tier, req *request, d *bucket.Decision, i int, degraded bool) {
	if a == nil || !a.logger.Core().Enabled(zapcore.InfoLevel) {
		return
	}
	key := req.keys[i]
	suppressed, ok := a.admit(key)
	if !ok {
		return
	}
	ce := a.logger.Check(zapcore.InfoLevel, "request denied")
	if ce == nil {
		return
	}
	l, b := req.limits[i], &d.Buckets[i]
	unit := unitName(l)
	fields := make([]zap.Field, 0, 12)
	fields = append(fields,
		zap.String("tier", t.name),
		zap.String("dimension", l.dimension),
		zap.String("unit", unit),
		zap.String("id", keyID(key)),
		zap.String("key", key),
		zap.String("reason", b.Reason.String()),
		zap.Int64("cost", req.takes[i].Cost),
		zap.Int64("retry_after_ms", b.RetryAfterMS),
		zap.Bool("degraded", degraded),
	)
	if l.period != 0 {
		fields = append(fields, zap.String("period", l.period.String())) // a calendar quota
	}
	if b.Shadow {
		fields = append(fields, zap.Bool("shadow", true))
	}
	if a.clientIP {
		fields = append(fields, zap.String("client_ip", clientIP(r)))
	}
	fields = append(fields, zap.Int64("suppressed", suppressed))
	ce.Write(fields...)
}

// keyID returns the hashed identity in a bucket key,
// <prefix>{<dimension>:<id>}[:<unit>] (see bucket.Keyer): the IDLength
// characters before the last '}'.
func keyID(key string) string {
	end := strings.LastIndexByte(key, '}')
	if end < bucket.IDLength {
		return ""
	}
	return key[end-bucket.IDLength : end]
}

// clientIP returns the client's address as Caddy determined it (after
// trusted_proxies), else the connection's.
func clientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}
