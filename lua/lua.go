// Package lua holds the Redis script that decides a request's buckets.
// The contract (KEYS, ARGV, reply, units) is the header comment of
// token_bucket.lua.
package lua

import (
	_ "embed"
	"strings"

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

// mainReturn ends token_bucket.lua: the entry that decides every key.
const mainReturn = "\nlocal reply = decide(0, 0, #KEYS)\nreturn reply\n"

// core is token_bucket.lua without its main entry: the clock and the
// functions that read, refill and decide buckets, which the other scripts
// share.
var core = func() string {
	c, ok := strings.CutSuffix(Source, mainReturn)
	if !ok {
		panic("lua: token_bucket.lua does not end with its main entry")
	}
	return c + "\n"
}()

//go:embed demote.lua
var demoteEntry string

// DemoteSource is token_bucket.lua with demote.lua's entry in place of its
// own: the same decision, plus counting denials and demoting.
var DemoteSource = core + demoteEntry

// Demote is the script for handlers with a demotion rule.
var Demote = redis.NewScript(DemoteSource)

//go:embed refund.lua
var refundEntry string

// RefundSource is token_bucket.lua's core with refund.lua's entry.
var RefundSource = core + refundEntry

// Refund gives back what TokenBucket charged, for a request denied by a
// bucket on another Redis Cluster slot.
var Refund = redis.NewScript(RefundSource)

//go:embed settle.lua
var settleEntry string

// SettleSource is token_bucket.lua's core with settle.lua's entry.
var SettleSource = core + settleEntry

// Settle charges or gives back the difference between a request's
// estimated and actual LLM tokens, once per request.
var Settle = redis.NewScript(SettleSource)

// ClockLine is the one line of Source that reads the Redis clock. Tests that
// drive time replace it; nothing else may.
const ClockLine = "local clock = redis.call('TIME')"
