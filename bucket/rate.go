package bucket

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"regexp"
	"strings"
	"time"
)

// Rate is an exact refill rate in tokens per second, held as a reduced
// fraction so that "10/1m" is exactly 1/6 token per second and never a
// rounded float. The zero Rate is invalid.
type Rate struct {
	num, den int64 // tokens per second = num/den; both > 0, coprime
}

// ParseRate reads a refill rate written as <amount>/<period> or as a bare
// <amount> (tokens per second). The amount is a decimal number ("10", "0.5",
// "2.5e3"); the period is "s", "m", "h" or "d" alone (one of that unit), or a
// duration such as "1m", "90s", "1h30m", "500ms" or "7d". Examples: "10/1m",
// "25/s", "600/1h", "0.5/s", "3". It returns an error for a rate that is not
// strictly positive and finite, and for one whose fraction does not fit in
// 64 bits.
func ParseRate(s string) (Rate, error) {
	amountText, periodText, hasPeriod := strings.Cut(strings.TrimSpace(s), "/")
	amount, err := parseAmount(amountText)
	if err != nil {
		return Rate{}, err
	}
	period := big.NewRat(1, 1)
	if hasPeriod {
		if period, err = parsePeriod(periodText); err != nil {
			return Rate{}, err
		}
	}
	return rateFromRat(new(big.Rat).Quo(amount, period))
}

// RateFromFloat returns the simplest fraction that rounds to f, so the float
// form of a rate in a JSON config (0.16666666666666666 for 10/1m) is read back
// as the exact rate it was written from (1/6). f must be finite and > 0.
func RateFromFloat(f float64) (Rate, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) || f <= 0 {
		return Rate{}, fmt.Errorf("refill rate %v must be a finite number > 0", f)
	}
	exact := new(big.Rat).SetFloat64(f)
	// Walk the continued-fraction convergents of the exact binary value and
	// stop at the first one that rounds to the same float64.
	x := new(big.Rat).Set(exact)
	p0, q0 := big.NewInt(0), big.NewInt(1)
	p1, q1 := big.NewInt(1), big.NewInt(0)
	for i := 0; i < 100; i++ {
		a := new(big.Int).Quo(x.Num(), x.Denom())
		p0, p1 = p1, new(big.Int).Add(new(big.Int).Mul(a, p1), p0)
		q0, q1 = q1, new(big.Int).Add(new(big.Int).Mul(a, q1), q0)
		cand := new(big.Rat).SetFrac(p1, q1)
		if v, _ := cand.Float64(); v == f {
			return rateFromRat(cand)
		}
		frac := new(big.Rat).Sub(x, new(big.Rat).SetInt(a))
		if frac.Sign() == 0 {
			break
		}
		x = frac.Inv(frac)
	}
	return rateFromRat(exact)
}

// Float64 returns the rate in tokens per second, rounded to the nearest float.
func (r Rate) Float64() float64 {
	f, _ := big.NewRat(r.num, r.den).Float64()
	return f
}

// Fraction returns the rate as tokens per second = num/den, reduced.
func (r Rate) Fraction() (num, den int64) { return r.num, r.den }

// IsZero reports whether r is the invalid zero Rate.
func (r Rate) IsZero() bool { return r.den == 0 }

// String formats the rate as "<num>/s" or "<num>/<den>s".
func (r Rate) String() string {
	if r.den == 1 {
		return fmt.Sprintf("%d/s", r.num)
	}
	return fmt.Sprintf("%d/%ds", r.num, r.den)
}

// decimalRE is a plain decimal number: no hex, fraction, NaN or Inf (a
// minus sign is read, to be refused as not positive). The exponent has at
// most 3 digits: big.Rat would otherwise expand "1e999999" into a
// million-digit number, seconds of work for a 9-byte token, and no rate
// that fits in 64 bits needs more.
var decimalRE = regexp.MustCompile(`^-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]{1,3})?$`)

// The range of a Rate: num and den fit in an int64.
var (
	maxRate = new(big.Rat).SetInt64(math.MaxInt64)
	minRate = big.NewRat(1, math.MaxInt64)
)

// rateFromRat returns q as a Rate. Its errors state the range and leave the
// value to the caller, which has it as written (a rate such as 1e400 would
// otherwise fill the message with its digits).
func rateFromRat(q *big.Rat) (Rate, error) {
	if q.Sign() <= 0 {
		return Rate{}, errors.New("refill rate must be > 0")
	}
	if !q.Num().IsInt64() || !q.Denom().IsInt64() {
		switch {
		case q.Cmp(maxRate) > 0:
			return Rate{}, fmt.Errorf("refill rate too large: at most %d tokens per second", int64(math.MaxInt64))
		case q.Cmp(minRate) < 0:
			return Rate{}, fmt.Errorf("refill rate too small: at least 1/%d token per second", int64(math.MaxInt64))
		}
		return Rate{}, errors.New("refill rate too fine-grained to hold exactly: as tokens per second, its reduced fraction must have a numerator and denominator below 2^63")
	}
	return Rate{num: q.Num().Int64(), den: q.Denom().Int64()}, nil
}

func parseAmount(s string) (*big.Rat, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, errors.New("missing refill amount")
	}
	// big.Rat accepts "a/b" too; the slash is already split off, so a
	// leftover one is a syntax error. It rejects NaN and Inf. The pattern
	// is checked first, to bound the exponent SetString expands.
	if !decimalRE.MatchString(s) {
		return nil, fmt.Errorf("refill amount %q is not a number", s)
	}
	amount, ok := new(big.Rat).SetString(s)
	if !ok {
		return nil, fmt.Errorf("refill amount %q is not a number", s)
	}
	if amount.Sign() <= 0 {
		return nil, fmt.Errorf("refill amount %q must be > 0", s)
	}
	return amount, nil
}

// parsePeriod returns the period in seconds.
func parsePeriod(s string) (*big.Rat, error) {
	s = strings.TrimSpace(s)
	switch s {
	case "s":
		return big.NewRat(1, 1), nil
	case "m":
		return big.NewRat(60, 1), nil
	case "h":
		return big.NewRat(3600, 1), nil
	case "d":
		return big.NewRat(86400, 1), nil
	}
	if days, ok := strings.CutSuffix(s, "d"); ok {
		if !decimalRE.MatchString(days) {
			return nil, fmt.Errorf("refill period %q is not a duration", s)
		}
		n, valid := new(big.Rat).SetString(days)
		if !valid || n.Sign() <= 0 {
			return nil, fmt.Errorf("refill period %q is not a duration", s)
		}
		return n.Mul(n, big.NewRat(86400, 1)), nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return nil, fmt.Errorf("refill period %q is not a duration", s)
	}
	if d <= 0 {
		return nil, fmt.Errorf("refill period %q must be > 0", s)
	}
	return big.NewRat(int64(d), int64(time.Second)), nil
}

// ScaledSpec returns the Spec of capacity tokens refilled at rate·share,
// for a limit that one of several gateways enforces alone (local_share).
// share, 0 < share ≤ 1, is read as its simplest fraction (0.33 as 33/100,
// the float nearest 1/3 as 1/3). The Spec is exact when the product can be
// held exactly (see Limit.Spec); else its rate is the closest below
// rate·share of two candidates that a Spec holds: an approximation from
// the continued fraction (belowByConvergents), and the finest scale the
// capacity leaves room for with the refill rounded down (short by less
// than one unit a microsecond). So the scaled limit never refills faster
// than its share.
func ScaledSpec(capacity int64, rate Rate, share float64) (Spec, error) {
	sh, err := RateFromFloat(share)
	if err != nil {
		return Spec{}, fmt.Errorf("share %v: %w", share, err)
	}
	target := new(big.Rat).SetFrac64(rate.num, rate.den)
	target.Mul(target, new(big.Rat).SetFrac64(sh.num, sh.den))
	if r, err := rateFromRat(target); err == nil {
		if s, err := (Limit{Capacity: capacity, Rate: r}).Spec(); err == nil {
			return s, nil
		}
	}
	if capacity <= 0 {
		return Spec{}, fmt.Errorf("capacity %d must be > 0", capacity)
	}
	// Units per microsecond = target / 10^6 = n/d. The scale may go up to
	// MaxExact/capacity (capacity × scale ≤ 2^53) and to what keeps
	// refill·1000 ≤ 2^53, that is MaxExact·d / (1000·n).
	n := new(big.Int).Set(target.Num())
	d := new(big.Int).Mul(target.Denom(), big.NewInt(1_000_000))
	scale := big.NewInt(MaxExact / capacity)
	if byRefill := new(big.Int).Quo(new(big.Int).Mul(big.NewInt(MaxExact), d), new(big.Int).Mul(n, big.NewInt(1000))); byRefill.Cmp(scale) < 0 {
		scale = byRefill
	}
	best, found := belowByConvergents(capacity, target)
	if refill := new(big.Int).Quo(new(big.Int).Mul(n, scale), d); refill.Sign() > 0 { // rounded down
		g := new(big.Int).GCD(nil, nil, refill, scale)
		s := Spec{Capacity: capacity, Scale: new(big.Int).Quo(scale, g).Int64(), Refill: new(big.Int).Quo(refill, g).Int64()}
		// s's rate is above best's when s.Refill/s.Scale > best.Refill/best.Scale.
		if !found || new(big.Int).Mul(big.NewInt(s.Refill), big.NewInt(best.Scale)).Cmp(new(big.Int).Mul(big.NewInt(best.Refill), big.NewInt(s.Scale))) > 0 {
			best, found = s, true
		}
	}
	if !found {
		return Spec{}, fmt.Errorf("capacity %d refilled at %s × %v cannot be held: under one unit a microsecond at the finest scale it leaves room for", capacity, rate, share)
	}
	return best, nil
}

// belowByConvergents returns the largest rate below target, among the
// continued fraction's approximations from below, that a Spec of capacity
// holds; false when none is found. The search is a heuristic: whether a
// Spec holds a rate depends on its factors, not its size.
func belowByConvergents(capacity int64, target *big.Rat) (Spec, bool) {
	spec := func(p, q *big.Int) (Spec, bool) {
		r, err := rateFromRat(new(big.Rat).SetFrac(p, q))
		if err != nil {
			return Spec{}, false
		}
		s, err := Limit{Capacity: capacity, Rate: r}.Spec()
		return s, err == nil
	}
	// The convergents p/q of target's continued fraction alternate below
	// and above it; between two below it lie the semiconvergents
	// (p₋₂ + k·p₋₁)/(q₋₂ + k·q₋₁), k = 1..a, also below and rising with k.
	// Take the largest k that a Spec holds at the first convergent below
	// that it cannot hold whole.
	var best Spec
	found := false
	x := new(big.Rat).Set(target)
	p0, q0 := big.NewInt(0), big.NewInt(1) // p₋₂/q₋₂
	p1, q1 := big.NewInt(1), big.NewInt(0) // p₋₁/q₋₁
	semi := func(k int64) (p, q *big.Int) {
		kb := big.NewInt(k)
		return new(big.Int).Add(p0, new(big.Int).Mul(kb, p1)), new(big.Int).Add(q0, new(big.Int).Mul(kb, q1))
	}
	for i := 0; i < 100; i++ {
		a := new(big.Int).Quo(x.Num(), x.Denom())
		if i%2 == 0 && a.IsInt64() { // this convergent is below target
			if p, q := semi(a.Int64()); p.Sign() > 0 {
				if s, ok := spec(p, q); ok {
					best, found = s, true
				} else {
					lo, hi := int64(0), a.Int64() // spec holds at lo (or lo is 0), not at hi
					for hi-lo > 1 {
						mid := lo + (hi-lo)/2
						if p, q := semi(mid); p.Sign() > 0 {
							if s, ok := spec(p, q); ok {
								best, found, lo = s, true, mid
								continue
							}
						}
						hi = mid
					}
					break
				}
			}
		}
		p0, p1 = p1, new(big.Int).Add(new(big.Int).Mul(a, p1), p0)
		q0, q1 = q1, new(big.Int).Add(new(big.Int).Mul(a, q1), q0)
		frac := new(big.Rat).Sub(x, new(big.Rat).SetInt(a))
		if frac.Sign() == 0 {
			break
		}
		x = frac.Inv(frac)
	}
	return best, found
}

// ScaledCapacity returns ⌊capacity·share⌋, at least 1, with share (0 <
// share ≤ 1) read as its simplest fraction, as in ScaledSpec: 3000 × the
// float nearest 1/3 is 1000, not 999.
func ScaledCapacity(capacity int64, share float64) int64 {
	sh, err := RateFromFloat(share)
	if err != nil {
		return capacity
	}
	c := new(big.Int).Mul(big.NewInt(capacity), big.NewInt(sh.num))
	c.Quo(c, big.NewInt(sh.den))
	return max(1, min(c.Int64(), capacity))
}
