// Package lua holds the Redis script that decides a request's buckets.
// The contract (KEYS, ARGV, reply, units) is the header comment of
// token_bucket.lua.
package lua

import (
	_ "embed"
	"regexp"
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

// mainEntry is the line of token_bucket.lua after its prelude (header,
// clock and locals): what follows is its own entry, which decides every
// key.
const mainEntry = "\nlocal ko, ao, n = 0, 0, #KEYS\n"

// prelude is token_bucket.lua up to its own entry: the clock and the
// locals that the other scripts' entries use.
var prelude = func() string {
	p, _, ok := strings.Cut(Source, mainEntry)
	if !ok {
		panic("lua: token_bucket.lua has no main entry line")
	}
	return p + "\n"
}()

// blocks are token_bucket.lua's shared blocks by name: the text between a
// line "--[[block NAME]]" and a line "--[[end NAME]]". Blocks nest; the
// marker lines of an inner block stay in the outer one as comments.
var blocks = func() map[string]string {
	type open struct {
		name string
		at   int
	}
	var stack []open
	m := map[string]string{}
	for at := 0; at < len(Source); {
		line, _, _ := strings.Cut(Source[at:], "\n")
		next := at + len(line) + 1
		marker := strings.TrimSpace(line)
		if name, ok := strings.CutPrefix(marker, "--[[block "); ok {
			stack = append(stack, open{strings.TrimSuffix(name, "]]"), next})
		} else if name, ok := strings.CutPrefix(marker, "--[[end "); ok {
			name = strings.TrimSuffix(name, "]]")
			if len(stack) == 0 || stack[len(stack)-1].name != name {
				panic("lua: token_bucket.lua ends block " + name + " that is not open")
			}
			if _, dup := m[name]; dup {
				panic("lua: token_bucket.lua has two blocks named " + name)
			}
			m[name] = Source[stack[len(stack)-1].at:at]
			stack = stack[:len(stack)-1]
		}
		at = next
	}
	if len(stack) > 0 {
		panic("lua: token_bucket.lua leaves block " + stack[len(stack)-1].name + " open")
	}
	return m
}()

// useLine is an entry's line that asks for a block.
var useLine = regexp.MustCompile(`(?m)^[ \t]*--\[\[use (\w+)\]\]\n`)

// use pastes token_bucket.lua's blocks into an entry in place of its lines
// "--[[use NAME]]". An unknown name, or a use line left over (one not on a
// line of its own, or ending in CRLF), is a programming error.
func use(entry string) string {
	out := useLine.ReplaceAllStringFunc(entry, func(line string) string {
		name := useLine.FindStringSubmatch(line)[1]
		b, ok := blocks[name]
		if !ok {
			panic("lua: no block " + name + " in token_bucket.lua")
		}
		return b
	})
	if strings.Contains(out, "--[[use ") {
		panic("lua: a use line is not on a line of its own")
	}
	return out
}

//go:embed demote.lua
var demoteEntry string

// DemoteSource is token_bucket.lua's prelude with demote.lua's entry, which
// uses its decide block: the same decision, plus counting denials and
// demoting.
var DemoteSource = prelude + use(demoteEntry)

// Demote is the script for handlers with a demotion rule.
var Demote = redis.NewScript(DemoteSource)

//go:embed refund.lua
var refundEntry string

// RefundSource is token_bucket.lua's prelude with refund.lua's entry, which
// uses its load and full blocks.
var RefundSource = prelude + use(refundEntry)

// Refund gives back what TokenBucket charged, for a request denied by a
// bucket on another Redis Cluster slot.
var Refund = redis.NewScript(RefundSource)

//go:embed settle.lua
var settleEntry string

// SettleSource is token_bucket.lua's prelude with settle.lua's entry, which
// uses its load and full blocks.
var SettleSource = prelude + use(settleEntry)

// Settle charges or gives back the difference between a request's
// estimated and actual LLM tokens, once per request.
var Settle = redis.NewScript(SettleSource)

//go:embed batch.lua
var batchEntry string

// BatchSource is token_bucket.lua's prelude with batch.lua's entry, which
// decides several requests with its decide block, one after another.
var BatchSource = prelude + use(batchEntry)

// Batch decides several requests in one call: what TokenBucket replies to
// each, in order (see batch.lua). A gateway sends its concurrent requests'
// TokenBucket calls this way (bucket.Batched).
var Batch = redis.NewScript(BatchSource)

//go:embed lease.lua
var leaseEntry string

// LeaseSource is token_bucket.lua's prelude with lease.lua's entry.
var LeaseSource = prelude + leaseEntry

// Lease renews or releases a request's leases on its concurrency limits.
var Lease = redis.NewScript(LeaseSource)

// ClockLine is the one line of Source that reads the Redis clock. Tests that
// drive time replace it; nothing else may.
const ClockLine = "local clock = redis.call('TIME')"
