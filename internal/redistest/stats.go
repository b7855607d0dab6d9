package redistest

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// CommandStat is one command's line of INFO commandstats: the calls the
// server counted since it started or since the last CONFIG RESETSTAT, and
// those of them that failed (for EVALSHA: NOSCRIPT, an error in the
// script).
type CommandStat struct {
	Calls, Failed int64
}

// CommandStats reads INFO commandstats from the server at c, by command
// name as Redis writes it (lower case; a subcommand as "config|resetstat").
// A malformed line fails the test.
func CommandStats(t testing.TB, c *redis.Client) map[string]CommandStat {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatalf("INFO commandstats: %v", err)
	}
	stats := map[string]CommandStat{}
	for _, line := range strings.Split(info, "\n") {
		name, fields, ok := strings.Cut(strings.TrimSpace(line), ":")
		if name, ok = strings.CutPrefix(name, "cmdstat_"); !ok {
			continue
		}
		var s CommandStat
		for _, kv := range strings.Split(fields, ",") {
			k, v, _ := strings.Cut(kv, "=")
			var dst *int64
			switch k {
			case "calls":
				dst = &s.Calls
			case "failed_calls":
				dst = &s.Failed
			default:
				continue
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("INFO commandstats line %q: %v", line, err)
			}
			*dst = n
		}
		stats[name] = s
	}
	return stats
}

// Calls returns how many times the server at c ran command (e.g.
// "evalsha"), failed calls included; 0 when it never did.
func Calls(t testing.TB, c *redis.Client, command string) int64 {
	t.Helper()
	return CommandStats(t, c)[command].Calls
}

// ScriptRuns returns how many scripts the server at c ran to the end:
// EVAL and EVALSHA calls, less the failed ones (NOSCRIPT).
func ScriptRuns(t testing.TB, c *redis.Client) int64 {
	t.Helper()
	stats := CommandStats(t, c)
	n := int64(0)
	for _, name := range []string{"eval", "evalsha"} {
		n += stats[name].Calls - stats[name].Failed
	}
	return n
}
