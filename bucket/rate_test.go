package bucket

import (
	"math/big"
	"testing"
)

// TestScaledSpec: a rate times a share is exact when it can be held: 500/1m
// × 0.33 is 2.75 tokens a second, 50/s × 1/3 is 50/3 (the share read as
// its simplest fraction, not its binary value). When it cannot (1/s ×
// 0.123456789 with 123456 tokens: 10^15 units a token), the rate is the
// closest below that can, within 10^-5 of it here.
func TestScaledSpec(t *testing.T) {
	perSecond := func(s Spec) *big.Rat { // tokens a second: Refill·10^6 / Scale
		return new(big.Rat).SetFrac(big.NewInt(s.Refill*1_000_000), big.NewInt(s.Scale))
	}
	for _, tc := range []struct {
		capacity int64
		rate     string
		share    float64
		want     *big.Rat
	}{
		{165, "500/1m", 0.33, big.NewRat(11, 4)},
		{1000, "50/s", 1.0 / 3, big.NewRat(50, 3)},
		{40000, "200000/1m", 0.2, big.NewRat(2000, 3)},
		{99, "5/s", 0.33, big.NewRat(33, 20)},
	} {
		r, err := ParseRate(tc.rate)
		if err != nil {
			t.Fatal(err)
		}
		s, err := ScaledSpec(tc.capacity, r, tc.share)
		if err != nil {
			t.Fatalf("%s × %v: %v", tc.rate, tc.share, err)
		}
		if got := perSecond(s); got.Cmp(tc.want) != 0 || s.Capacity != tc.capacity {
			t.Errorf("%s × %v: %d tokens at %s a second, want %d at %s", tc.rate, tc.share, s.Capacity, got.RatString(), tc.capacity, tc.want.RatString())
		}
	}

	r, _ := ParseRate("1/s")
	s, err := ScaledSpec(123456, r, 0.123456789)
	if err != nil {
		t.Fatal(err)
	}
	target := big.NewRat(123456789, 1_000_000_000)
	got := perSecond(s)
	if got.Cmp(target) > 0 {
		t.Errorf("%s tokens a second, above the share's %s", got.RatString(), target.RatString())
	}
	gap, _ := new(big.Rat).Quo(new(big.Rat).Sub(target, got), target).Float64()
	if gap > 1e-5 {
		t.Errorf("%s tokens a second, %.2g below the share's %s", got.RatString(), gap, target.RatString())
	}
	if s.Capacity*s.Scale > MaxExact {
		t.Errorf("%+v: capacity × scale over 2^53", s)
	}

	// A capacity near 2^53/100 at 10^6 tokens a second leaves room for a
	// scale of at most about 140: no convergent of 0.6999993·10^6 is held,
	// and the finest scale, its refill rounded down, is within 1% below.
	r, _ = ParseRate("1000000/s")
	capacity := ScaledCapacity(MaxExact/100, 0.6999993)
	s, err = ScaledSpec(capacity, r, 0.6999993)
	if err != nil {
		t.Fatalf("capacity %d: %v", capacity, err)
	}
	target = big.NewRat(6999993, 10)
	got = perSecond(s)
	gap, _ = new(big.Rat).Quo(new(big.Rat).Sub(target, got), target).Float64()
	if got.Cmp(target) > 0 || gap > 0.01 || s.Capacity*s.Scale > MaxExact {
		t.Errorf("capacity %d: %+v, %s tokens a second, %.2g below the share's %s", capacity, s, got.RatString(), gap, target.RatString())
	}
}
