package bucket

import (
	"fmt"
	"time"
)

// Period is the length of a calendar quota's window.
type Period uint8

// Periods of a calendar quota. Windows start at 00:00 in the quota's time
// zone: every day, every Monday (ISO 8601 weeks), every 1st of the month.
const (
	Day Period = iota + 1
	Week
	Month
)

// ParsePeriod reads "day", "week" or "month".
func ParsePeriod(s string) (Period, error) {
	switch s {
	case "day":
		return Day, nil
	case "week":
		return Week, nil
	case "month":
		return Month, nil
	}
	return 0, fmt.Errorf("period %q: must be day, week or month", s)
}

// String returns the period as the configuration names it.
func (p Period) String() string {
	switch p {
	case Day:
		return "day"
	case Week:
		return "week"
	case Month:
		return "month"
	}
	return "none"
}

// Windows are the starts of four consecutive windows of a quota, in
// microseconds since the Unix epoch: the window before the one that holds
// the gateway's clock, that one, and the next two. The script picks the
// window that holds the Redis clock among the first three (Redis decides
// the time; the gateway only knows the calendar), so a gateway whose clock
// is off by less than a window decides as one whose clock is right.
type Windows [4]int64

// WindowsAt returns the windows of period p in loc around t. A day is
// 23 or 25 hours long across a daylight-saving change, as the calendar
// has it; a month has its 28 to 31 days.
func WindowsAt(p Period, loc *time.Location, t time.Time) Windows {
	t = t.In(loc)
	y, m, d := t.Date()
	// start returns the start of the window k windows from t's.
	var start func(k int) time.Time
	switch p {
	case Week:
		back := (int(t.Weekday()) + 6) % 7 // days since Monday
		start = func(k int) time.Time { return time.Date(y, m, d-back+7*k, 0, 0, 0, 0, loc) }
	case Month:
		start = func(k int) time.Time { return time.Date(y, m+time.Month(k), 1, 0, 0, 0, 0, loc) }
	default:
		start = func(k int) time.Time { return time.Date(y, m, d+k, 0, 0, 0, 0, loc) }
	}
	var w Windows
	for i := range w {
		s := start(i - 1)
		if s.Hour() > 12 {
			// 00:00 fell in a daylight-saving gap (clocks that spring
			// forward at midnight, as in America/Santiago): time.Date gave
			// the hour before it; the day starts where the gap ends.
			_, s = s.ZoneBounds()
		}
		w[i] = s.UnixMicro()
	}
	return w
}

// At returns the start and end of the window that holds now (µs): among
// the first three, the nearest when now is outside them (a clock off by
// more than a window), as the script picks it.
func (w Windows) At(now int64) (start, end int64) {
	switch {
	case now >= w[2]:
		return w[2], w[3]
	case now >= w[1]:
		return w[1], w[2]
	}
	return w[0], w[1]
}

// ChargedIn returns the start and end of the window that a decision charged, from
// its FullMS (the milliseconds the script saw left in that window) and
// the gateway's clock at the decision (µs): the window whose end is
// nearest to decidedAt + FullMS. Window ends are at least 23 hours apart,
// so the answer is the script's own for any clock skew under half the
// shortest window (11.5 hours).
func (w Windows) ChargedIn(decidedAt, fullMS int64) (start, end int64) {
	at := decidedAt + fullMS*1000
	best := 1
	for k := 2; k <= 3; k++ {
		if abs(w[k]-at) < abs(w[best]-at) {
			best = k
		}
	}
	return w[best-1], w[best]
}

func abs(n int64) int64 {
	if n < 0 {
		return -n
	}
	return n
}
