package tokenbucket

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-json-experiment/json/jsontext"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/token-bucket/token_bucket/bucket"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// handlers are the provisioned token_bucket handlers for the admin API,
// ordered by key_prefix and then by the rest of their configuration (see
// adminOrder), so that a handler's id, its place in the list, is the same
// after every load of the same configuration: Caddy provisions the servers
// of a config in no fixed order (a map's), and an id by provisioning order
// could name another site's handler after a reload. Handlers of the same
// configuration are interchangeable: they decide the same buckets. A
// handler joins at the end of its Provision and leaves in its Cleanup, so
// after a config load finishes the list holds the new config's handlers
// only (during the load, briefly, the old ones too). The list is copied on
// write, so a reader may keep the slice it read after unlocking.
var handlers struct {
	sync.RWMutex
	list []*Handler
}

// adminOrder returns h's place in the order of the handlers' list: its
// key_prefix, then its configuration as JSON.
func adminOrder(h *Handler) string {
	cfg, _ := json.Marshal(h) // the configuration's fields marshal without error
	return h.KeyPrefix + "\x00" + string(cfg)
}

func registerHandler(h *Handler) {
	h.adminOrder = adminOrder(h)
	handlers.Lock()
	defer handlers.Unlock()
	// After every handler of the same order: provisioning order among equals.
	i := slices.IndexFunc(handlers.list, func(e *Handler) bool { return e.adminOrder > h.adminOrder })
	if i < 0 {
		i = len(handlers.list)
	}
	handlers.list = slices.Insert(slices.Clip(handlers.list), i, h)
}

func unregisterHandler(h *Handler) {
	handlers.Lock()
	defer handlers.Unlock()
	if i := slices.Index(handlers.list, h); i >= 0 {
		handlers.list = slices.Concat(handlers.list[:i], handlers.list[i+1:])
	}
}

// AdminAPI is the admin.api.token_bucket module: endpoints on Caddy's admin
// endpoint (never on a site) to see the configured limits and inspect or
// reset one identity's bucket. Caddy mounts it on the admin endpoint
// whenever the module is compiled in; it has no configuration.
//
//	GET    /token_bucket/handlers        the handlers, each with its id
//	GET    /token_bucket/bucket?...      one bucket's state, charging nothing
//	POST   /token_bucket/bucket          the same, parameters in a JSON body
//	DELETE /token_bucket/bucket?...      reset the bucket to full
//	POST   /token_bucket/bucket/reset    the same, query or JSON body
//
// The bucket parameters are handler (an id from /token_bucket/handlers;
// may be left out when there is one handler), tier (default: the default
// tier), dimension, unit (requests, the default, or tokens), and either
// identity (the raw identity, hashed here as the handler hashes it) or id
// (the hashed identity, as audit entries show it). Caddy's admin log
// records request URIs: to keep a raw API key out of it, send identity in
// a POST body, or send id.
//
// A reset deletes the bucket's key, so the next request finds it full, and
// drops it from the deny caches of this Caddy's handlers. Other Caddy
// instances sharing the Redis may still answer the client from their deny
// cache until the wait they gave lapses: reset there too. Demotion state
// and on_redis_error's in-memory buckets are left alone.
type AdminAPI struct {
	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.token_bucket",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Provision sets up the module.
func (a *AdminAPI) Provision(ctx caddy.Context) error {
	// Caddy provisions admin modules outside any module's context, where
	// ctx.Logger() would not know the module: name it, as admin.api.pki
	// does.
	a.logger = ctx.Logger(a)
	return nil
}

// Routes returns the module's admin routes.
func (a *AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/token_bucket/", Handler: caddy.AdminHandlerFunc(a.serve)}}
}

func (a *AdminAPI) serve(w http.ResponseWriter, r *http.Request) error {
	switch strings.TrimSuffix(r.URL.Path, "/") {
	case "/token_bucket/handlers":
		if r.Method != http.MethodGet {
			return methodNotAllowed(r, "GET")
		}
		return writeAdminJSON(w, map[string]any{"handlers": listHandlers()})
	case "/token_bucket/bucket":
		switch r.Method {
		case http.MethodGet, http.MethodPost:
			return a.bucket(w, r, false)
		case http.MethodDelete:
			return a.bucket(w, r, true)
		}
		return methodNotAllowed(r, "GET, POST, DELETE")
	case "/token_bucket/bucket/reset":
		if r.Method != http.MethodPost {
			return methodNotAllowed(r, "POST")
		}
		return a.bucket(w, r, true)
	}
	return apiError(http.StatusNotFound, "no such token_bucket endpoint: see /token_bucket/handlers and /token_bucket/bucket")
}

// handlerInfo describes a handler in GET /token_bucket/handlers.
type handlerInfo struct {
	ID           int         `json:"id"`
	KeyPrefix    string      `json:"key_prefix"`
	Dimensions   []Dimension `json:"dimensions"`
	TierFrom     string      `json:"tier_from,omitempty"`
	DefaultTier  string      `json:"default_tier"`
	OnRedisError string      `json:"on_redis_error"`
	Tiers        []tierInfo  `json:"tiers"`
}

type tierInfo struct {
	Name   string      `json:"name"`
	Limits []limitInfo `json:"limits"`
}

type limitInfo struct {
	Dimension  string   `json:"dimension"`
	Capacity   int64    `json:"capacity"`
	RefillRate float64  `json:"refill_rate"`
	Unit       string   `json:"unit"`
	Period     string   `json:"period,omitempty"`
	Models     []string `json:"models,omitempty"`
	Shadow     bool     `json:"shadow,omitempty"`
}

func listHandlers() []handlerInfo {
	handlers.RLock()
	defer handlers.RUnlock()
	out := make([]handlerInfo, 0, len(handlers.list))
	for i, h := range handlers.list {
		hi := handlerInfo{ID: i, KeyPrefix: h.KeyPrefix, Dimensions: h.Dimensions, TierFrom: h.TierFrom,
			DefaultTier: h.deflt.name, OnRedisError: h.OnRedisError, Tiers: make([]tierInfo, 0, len(h.Tiers))}
		if hi.Dimensions == nil {
			hi.Dimensions = []Dimension{}
		}
		for _, t := range h.Tiers {
			ti := tierInfo{Name: t.Name, Limits: make([]limitInfo, 0, len(t.Limits))}
			for _, l := range t.Limits {
				ti.Limits = append(ti.Limits, limitInfo{Dimension: l.Dimension, Capacity: l.Capacity, RefillRate: l.RefillRate, Unit: l.unit(),
					Period: l.Period, Models: l.Models, Shadow: l.Shadow || h.Shadow})
			}
			hi.Tiers = append(hi.Tiers, ti)
		}
		out = append(out, hi)
	}
	return out
}

// bucketParams are the parameters of the bucket endpoints.
type bucketParams struct {
	Handler   *int   `json:"handler,omitempty"`
	Tier      string `json:"tier,omitempty"`
	Dimension string `json:"dimension"`
	Unit      string `json:"unit,omitempty"`
	// Model picks a limit scoped by models: the first whose globs match
	// it, and its bucket for this model. Without it, the unscoped limit.
	Model string `json:"model,omitempty"`
	// Period picks a calendar quota ("day", "week", "month") of the
	// dimension and unit rather than its bucket.
	Period string `json:"period,omitempty"`
	// Shadow picks the limit in shadow (its own bucket) rather than the
	// enforced one of the same dimension and unit; implied when the
	// handler puts every limit in shadow.
	Shadow   bool   `json:"shadow,omitempty"`
	Identity string `json:"identity,omitempty"`
	ID       string `json:"id,omitempty"`
}

// bucketState is the answer of the bucket endpoints.
type bucketState struct {
	Handler   int    `json:"handler"`
	Tier      string `json:"tier"`
	Dimension string `json:"dimension"`
	Unit      string `json:"unit"`
	Model     string `json:"model,omitempty"`
	ID        string `json:"id"`
	Key       string `json:"key"`
	// Period is a calendar quota's ("day", "week", "month").
	Period string `json:"period,omitempty"`
	// Tokens is what the bucket holds; for a concurrency limit, its free
	// slots (capacity minus the requests in flight); for a quota, what is
	// left of it in the current window.
	Tokens int64 `json:"tokens"`
	// Used is a quota's use in the current window.
	Used *int64 `json:"used,omitempty"`
	// ResetsAt is when a quota's window ends (RFC 3339, in
	// quota_timezone).
	ResetsAt   string  `json:"resets_at,omitempty"`
	Capacity   int64   `json:"capacity"`
	RefillRate float64 `json:"refill_rate"`
	// MSUntilFull is the time until the bucket is full, rounded up to the
	// millisecond; 0 for a full bucket.
	MSUntilFull int64 `json:"ms_until_full"`
	// TTLMS is the key's remaining time to live; 0 when there is no key
	// (a full bucket).
	TTLMS  int64 `json:"ttl_ms"`
	Exists bool  `json:"exists"`
	// Deleted says, for a reset, whether there was a key to delete.
	Deleted *bool `json:"deleted,omitempty"`
}

// bucketTarget is a bucket resolved from bucketParams.
type bucketTarget struct {
	index int
	h     *Handler
	tier  *tier
	limit *limit
	rate  float64
	key   string
	model string // the model of a scoped limit's bucket
}

// take is a peek (cost 0) at the target's bucket.
func (bt *bucketTarget) take() bucket.Take {
	t := bucket.Take{Spec: bt.limit.spec}
	switch {
	case bt.limit.concurrent:
		t.Lease = bt.h.leaseMS
	case bt.limit.period != 0:
		t.Window = bt.h.quotaWindows(bt.limit.period, bt.h.now())
	}
	return t
}

// bucket answers a lookup, or a reset when reset is set.
func (a *AdminAPI) bucket(w http.ResponseWriter, r *http.Request, reset bool) error {
	p, err := readBucketParams(w, r)
	if err != nil {
		return err
	}
	bt, err := resolveBucket(p)
	if err != nil {
		return err
	}
	c := bt.h.conn
	if c.hold() { // a reload must not close the client under the call
		defer c.release()
	}
	var deleted *bool
	if reset {
		var n int64
		err := c.probe(r.Context(), func(ctx context.Context) (err error) {
			n, err = c.client.Del(ctx, bt.key).Result()
			return err
		})
		if err != nil {
			return apiError(http.StatusServiceUnavailable, "redis: deleting the bucket: "+err.Error())
		}
		d := n > 0
		deleted = &d
		forgetDenials(bt.key)
		a.logger.Info("bucket reset", zap.Int("handler", bt.index), zap.String("tier", bt.tier.name),
			zap.String("dimension", bt.limit.dimension), zap.String("key", bt.key), zap.Bool("deleted", d))
	}
	var st bucketState
	err = c.probe(r.Context(), func(ctx context.Context) (err error) {
		st, err = peek(ctx, c, bt.key, bt.take())
		return err
	})
	if err != nil {
		return apiError(http.StatusServiceUnavailable, "redis: reading the bucket: "+err.Error())
	}
	st.Handler, st.Tier, st.Dimension, st.Unit, st.Model = bt.index, bt.tier.name, bt.limit.dimension, unitName(bt.limit), bt.model
	if l := bt.limit; l.period != 0 {
		used := l.spec.Capacity - st.Tokens
		st.Period, st.Used = l.period.String(), &used
		st.ResetsAt = bt.h.now().Add(time.Duration(st.MSUntilFull) * time.Millisecond).In(bt.h.quotaLoc).Truncate(time.Second).Format(time.RFC3339)
	}
	st.ID, st.Key, st.Capacity, st.RefillRate, st.Deleted = keyID(bt.key), bt.key, bt.limit.spec.Capacity, bt.rate, deleted
	return writeAdminJSON(w, st)
}

// forgetDenials drops key from every handler's deny cache in this process,
// so that the reset bucket serves its client at once here. Other Caddy
// instances sharing the Redis keep their cached denial until its wait
// lapses: reset there too.
func forgetDenials(key string) {
	handlers.RLock()
	defer handlers.RUnlock()
	for _, h := range handlers.list {
		if h.denials != nil {
			h.denials.Forget(key)
		}
	}
}

// repeatedMember returns a member of the JSON object raw (already decoded
// once) whose name, in any case, comes twice, or "". encoding/json matches
// names in any case and keeps the last: "identity" then "Identity" would
// name another bucket than the first, where a parameter given twice in the
// query string is refused.
func repeatedMember(raw []byte) string {
	dec := jsontext.NewDecoder(bytes.NewReader(raw), jsontext.AllowDuplicateNames(true))
	if _, err := dec.ReadToken(); err != nil { // '{'
		return ""
	}
	seen := make(map[string]bool, len(bucketParamNames))
	for dec.PeekKind() == '"' {
		tok, err := dec.ReadToken()
		if err != nil {
			return ""
		}
		name := strings.ToLower(tok.String())
		if seen[name] {
			return tok.String()
		}
		seen[name] = true
		if err := dec.SkipValue(); err != nil {
			return ""
		}
	}
	return ""
}

// bucketParamNames are the query parameters of a bucket, bucketParams'
// JSON fields.
var bucketParamNames = []string{"handler", "tier", "dimension", "unit", "model", "period", "shadow", "identity", "id"}

// maxParamsBody bounds a POST's JSON body of bucket parameters.
const maxParamsBody = 64 << 10

// readBucketParams reads the parameters from a POST's JSON body, or else
// from the query string. An unknown parameter, a parameter given twice,
// parameters in both, or a body with another method than POST (which would
// otherwise be ignored, and a DELETE reset the query's bucket, or none) is
// 400; a body over maxParamsBody is 413.
func readBucketParams(w http.ResponseWriter, r *http.Request) (bucketParams, error) {
	var p bucketParams
	if r.Method != http.MethodPost && r.ContentLength != 0 {
		return p, apiError(http.StatusBadRequest, fmt.Sprintf("parameters: a JSON body only with POST; a %s takes them in the query string (POST /token_bucket/bucket/reset resets with a body)", r.Method))
	}
	if r.Method == http.MethodPost && r.ContentLength != 0 {
		if r.URL.RawQuery != "" {
			return p, apiError(http.StatusBadRequest, "parameters: in the query string or in the JSON body, not both")
		}
		raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxParamsBody))
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return p, apiError(http.StatusRequestEntityTooLarge, fmt.Sprintf("reading the JSON body: larger than %d bytes (64 KiB)", tooLarge.Limit))
		}
		if err != nil {
			return p, apiError(http.StatusBadRequest, "reading the JSON body: "+err.Error())
		}
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return p, apiError(http.StatusBadRequest, "reading the JSON body: "+err.Error())
		}
		if _, err := dec.Token(); err != io.EOF {
			return p, apiError(http.StatusBadRequest, "reading the JSON body: one object, and nothing after it")
		}
		if name := repeatedMember(raw); name != "" {
			return p, apiError(http.StatusBadRequest, fmt.Sprintf("reading the JSON body: member %q given twice (names match in any case)", name))
		}
		return p, nil
	}
	q := r.URL.Query()
	for name, vs := range q {
		// As the JSON body refuses an unknown field: a typo ("peroid")
		// must not reset another bucket than the one meant.
		if !slices.Contains(bucketParamNames, name) {
			return p, apiError(http.StatusBadRequest, fmt.Sprintf("query parameter %q: unknown; the parameters are %s", name, strings.Join(bucketParamNames, ", ")))
		}
		if len(vs) > 1 {
			return p, apiError(http.StatusBadRequest, fmt.Sprintf("query parameter %q: given %d times", name, len(vs)))
		}
	}
	if v := q.Get("handler"); v != "" {
		i, err := strconv.Atoi(v)
		if err != nil {
			return p, apiError(http.StatusBadRequest, fmt.Sprintf("handler %q: must be a handler id from /token_bucket/handlers", v))
		}
		p.Handler = &i
	}
	p.Tier, p.Dimension, p.Unit, p.Model, p.Period = q.Get("tier"), q.Get("dimension"), q.Get("unit"), q.Get("model"), q.Get("period")
	p.Identity, p.ID = q.Get("identity"), q.Get("id")
	switch v := q.Get("shadow"); v {
	case "", "false":
	case "true":
		p.Shadow = true
	default:
		return p, apiError(http.StatusBadRequest, fmt.Sprintf("shadow %q: must be true or false", v))
	}
	return p, nil
}

// resolveBucket finds the handler, tier and limit that p names and the
// key of its bucket. The raw identity is never part of an error.
func resolveBucket(p bucketParams) (*bucketTarget, error) {
	handlers.RLock()
	list := handlers.list
	handlers.RUnlock()
	bt := &bucketTarget{}
	switch {
	case p.Handler != nil:
		bt.index = *p.Handler
	case len(list) != 1:
		return nil, apiError(http.StatusBadRequest, fmt.Sprintf("handler: required with %d token_bucket handlers; see /token_bucket/handlers", len(list)))
	}
	if bt.index < 0 || bt.index >= len(list) {
		return nil, apiError(http.StatusNotFound, fmt.Sprintf("handler %d: no such token_bucket handler (%d configured); see /token_bucket/handlers", bt.index, len(list)))
	}
	h := list[bt.index]
	bt.h = h
	if bt.tier = h.deflt; p.Tier != "" {
		if bt.tier = h.tiers[p.Tier]; bt.tier == nil {
			return nil, apiError(http.StatusNotFound, fmt.Sprintf("tier %q: handler %d has no such tier", p.Tier, bt.index))
		}
	}
	if p.Dimension == "" {
		return nil, apiError(http.StatusBadRequest, "dimension: required")
	}
	if !slices.ContainsFunc(h.Dimensions, func(d Dimension) bool { return d.Name == p.Dimension }) {
		return nil, apiError(http.StatusNotFound, fmt.Sprintf("dimension %q: handler %d has no such dimension", p.Dimension, bt.index))
	}
	unit := p.Unit
	switch unit {
	case "":
		unit = UnitRequests
	case UnitRequests, UnitTokens, UnitConcurrent:
	default:
		return nil, apiError(http.StatusBadRequest, fmt.Sprintf("unit %q: must be requests, tokens or concurrent", p.Unit))
	}
	for i := range bt.tier.limits {
		l := &bt.tier.limits[i]
		if l.dimension != p.Dimension || unitName(l) != unit || l.shadow != (p.Shadow || h.Shadow) || periodName(l) != p.Period {
			continue
		}
		if p.Model == "" && l.scope == 0 || p.Model != "" && l.scope != 0 && l.matches(p.Model) {
			bt.limit = l
			break
		}
	}
	if bt.limit == nil && p.Period != "" {
		return nil, apiError(http.StatusNotFound, fmt.Sprintf("tier %q has no %s quota per %s on dimension %q", bt.tier.name, unit, p.Period, p.Dimension))
	}
	if bt.limit == nil && p.Model != "" {
		return nil, apiError(http.StatusNotFound, fmt.Sprintf("tier %q has no %s limit on dimension %q for model %q", bt.tier.name, unit, p.Dimension, p.Model))
	}
	if bt.limit == nil {
		return nil, apiError(http.StatusNotFound, fmt.Sprintf("tier %q has no %s limit on dimension %q", bt.tier.name, unit, p.Dimension))
	}
	bt.model = p.Model
	bt.rate = bt.limit.rate
	return bt, bt.setKey(p)
}

// setKey sets the bucket's key from the raw identity or the hashed id.
func (bt *bucketTarget) setKey(p bucketParams) error {
	h := bt.h
	switch {
	case (p.Identity == "") == (p.ID == ""):
		return apiError(http.StatusBadRequest, "identity or id: give exactly one")
	case p.Identity != "":
		bt.key = bt.keyOf(h.normalizeIdentity(p.Identity))
		return nil
	}
	if len(p.ID) != bucket.IDLength || strings.IndexFunc(p.ID, notBase64URL) >= 0 {
		// Not echoed: a raw API key sent as id by mistake would reach the
		// answer and Caddy's admin log.
		return apiError(http.StatusBadRequest, fmt.Sprintf("id: must be a hashed identity of %d base64url characters, as in a bucket key (a raw identity goes in identity)", bucket.IDLength))
	}
	// Any key of the limit has the same layout: swap in the id.
	k := bt.keyOf("")
	end := strings.LastIndexByte(k, '}')
	bt.key = k[:end-bucket.IDLength] + p.ID + k[end:]
	return nil
}

// keyOf returns the key of identity's bucket of the target's limit, as
// bucketsOf builds it.
func (bt *bucketTarget) keyOf(identity string) string {
	l, k := bt.limit, bt.h.keyer
	if l.scope != 0 {
		return k.Key(l.dimension, identity, l.keyScope+k.ID(bt.model))
	}
	return k.Key(l.dimension, identity, l.keyUnit)
}

func notBase64URL(r rune) bool {
	return !(r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '_')
}

func periodName(l *limit) string {
	if l.period == 0 {
		return ""
	}
	return l.period.String()
}

func unitName(l *limit) string {
	if l.unit == "" {
		return UnitRequests
	}
	return l.unit
}

// peek reads a bucket as the limiter sees it now, charging nothing: the
// limiter's own store with cost 0 (a peek: the script on the Redis clock,
// nothing written), then the key's PTTL.
func peek(ctx context.Context, c *conn, key string, take bucket.Take) (bucketState, error) {
	d, err := c.store.Take(ctx, []string{key}, []bucket.Take{take})
	if err != nil {
		return bucketState{}, err
	}
	ttl, err := c.client.PTTL(ctx, key).Result()
	if err != nil {
		return bucketState{}, err
	}
	st := bucketState{Tokens: d.Buckets[0].Remaining, MSUntilFull: d.Buckets[0].FullMS}
	if ttl > 0 {
		st.TTLMS, st.Exists = ttl.Milliseconds(), true
	} else if ttl == -1 {
		st.Exists = true // a key without a TTL: not one the script wrote
	}
	return st, nil
}

func writeAdminJSON(w http.ResponseWriter, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, append(b, '\n'))
}

func apiError(status int, msg string) error {
	return caddy.APIError{HTTPStatus: status, Err: errors.New(msg), Message: msg}
}

func methodNotAllowed(r *http.Request, allow string) error {
	return apiError(http.StatusMethodNotAllowed, fmt.Sprintf("method %s not allowed; use %s", r.Method, allow))
}

// Interface guards
var (
	_ caddy.Provisioner = (*AdminAPI)(nil)
	_ caddy.AdminRouter = (*AdminAPI)(nil)
)
