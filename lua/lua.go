// Package lua holds the Redis script that decides a request's buckets.
// The contract (KEYS, ARGV, reply, units) is the header comment of
// token_bucket.lua.
package lua

import (
	_ "embed"

	"github.com/redis/go-redis/v9"
)

// Source is the text of token_bucket.lua.
//
//go:embed token_bucket.lua
var Source string

// TokenBucket is the script, shared by every handler: go-redis runs it with
// EVALSHA and falls back to EVAL on NOSCRIPT (after a Redis restart, a
// failover or SCRIPT FLUSH), which loads it again.
var TokenBucket = redis.NewScript(Source)

// RefundSource is the text of refund.lua.
//
//go:embed refund.lua
var RefundSource string

// Refund gives back what TokenBucket charged, for a request denied by a
// bucket on another Redis Cluster slot.
var Refund = redis.NewScript(RefundSource)

// SettleSource is the text of settle.lua.
//
//go:embed settle.lua
var SettleSource string

// Settle charges or gives back the difference between a request's
// estimated and actual LLM tokens, once per request.
var Settle = redis.NewScript(SettleSource)

// ClockLine is the one line of Source that reads the Redis clock. Tests that
// drive time replace it; nothing else may.
const ClockLine = "local clock = redis.call('TIME')"
