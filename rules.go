package tokenbucket

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// The range rules of the configuration, each written once: validate
// checks the JSON form's values against them (naming the JSON field), and
// the Caddyfile parser checks the values it read (naming the
// subdirective and the token). Each returns nil, or what the value must
// be. A JSON field whose zero value means "the default" is checked only
// when set; in the Caddyfile the default is had by leaving the
// subdirective out, so an explicit zero is checked like any value.

var (
	errPositive = errors.New("must be a whole number > 0")
	errDuration = errors.New("must be a duration > 0")
	errShare    = errors.New("must be a fraction > 0 and ≤ 1")
	errMaxBody  = fmt.Errorf("must be a size from 1B to 1GiB (%d bytes)", int64(MaxEstimateBody))
	errBudget   = fmt.Errorf("must be an integer from 1 to %d", int64(MaxCost))
	errCapacity = fmt.Errorf("must be an integer from 1 to %d", int64(MaxCost))
)

// capacityRule: a bucket's capacity, 1 to MaxCost tokens.
func capacityRule(n int64) error {
	if n < 1 || n > MaxCost {
		return errCapacity
	}
	return nil
}

// prefixRule: an address prefix of 1 to bits bits.
func prefixRule(n, bits int) error {
	if n < 1 || n > bits {
		return fmt.Errorf("must be from 1 to %d", bits)
	}
	return nil
}

// positiveRule: a count of at least 1 (local_buckets, audit_buckets,
// deny_cache).
func positiveRule(n int64) error {
	if n < 1 {
		return errPositive
	}
	return nil
}

// durationRule: a duration > 0.
func durationRule(d time.Duration) error {
	if d <= 0 {
		return errDuration
	}
	return nil
}

// quotaZoneRule: quota_timezone, an IANA time zone name, not "Local":
// Go's name for the host's own zone, with which gateways on hosts in other
// zones would count their quotas in other windows, each reading the
// others' as another window's and resetting it.
func quotaZoneRule(name string) error {
	if name == "Local" {
		return errors.New("the host's own zone; name an IANA time zone, the same on every gateway")
	}
	if _, err := time.LoadLocation(name); err != nil {
		return fmt.Errorf("not an IANA time zone name: %v", err)
	}
	return nil
}

// MaxPoolSize bounds redis.pool_size: Redis's own default maxclients.
// (go-redis sizes its pool's bookkeeping by it, and panics above 2^31-1.)
const MaxPoolSize = 10000

// poolSizeRule: redis.pool_size, from 0 (go-redis's default) to
// MaxPoolSize.
func poolSizeRule(n int) error {
	if n < 0 || n > MaxPoolSize {
		return fmt.Errorf("must be a whole number from 0 (the default) to %d", MaxPoolSize)
	}
	return nil
}

// millisRule: a duration that Redis counts in milliseconds, at least 1ms:
// concurrency_lease, and demote's within and for (a PX of 0 is an error,
// a PEXPIRE of 0 a deletion).
func millisRule(d time.Duration) error {
	if d < time.Millisecond {
		return errors.New("must be a duration of at least 1ms")
	}
	return nil
}

// maxWaitRule: max_wait, 1ms to MaxMaxWait.
func maxWaitRule(d time.Duration) error {
	if d < time.Millisecond || d > MaxMaxWait {
		return fmt.Errorf("must be a duration from 1ms to %v", MaxMaxWait)
	}
	return nil
}

// shareRule: local_share, 0 < share ≤ 1.
func shareRule(f float64) error {
	if math.IsNaN(f) || f <= 0 || f > 1 {
		return errShare
	}
	return nil
}

// maxBodyRule: estimate.max_body, 1 byte to 1 GiB.
func maxBodyRule(n int64) error {
	if n < 1 || n > MaxEstimateBody {
		return errMaxBody
	}
	return nil
}

// countRule: demote's denials, 1 to MaxCost: a count that a JSON number
// holds exactly, so that a Caddyfile and its adapted JSON agree.
func countRule(n int64) error {
	if n < 1 || n > MaxCost {
		return fmt.Errorf("must be an integer from 1 to %d", int64(MaxCost))
	}
	return nil
}

// budgetRule: estimate.default_max_tokens, 1 to MaxCost tokens.
func budgetRule(n int64) error {
	if n < 1 || n > MaxCost {
		return errBudget
	}
	return nil
}

// nonNegativeRule: a count where 0 means the default (redis db,
// pool_size, breaker_failures).
func nonNegativeRule(n int) error {
	if n < 0 {
		return errNonNegative
	}
	return nil
}

var errNonNegative = errors.New("must be a whole number ≥ 0 (0: the default)")
