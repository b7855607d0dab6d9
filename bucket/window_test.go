package bucket

import (
	"math/rand/v2"
	"testing"
	"time"
)

// instant parses an RFC 3339 time (any offset) for a table.
func instant(t *testing.T, s string) time.Time {
	t.Helper()
	tm, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		t.Fatalf("time %q: %v", s, err)
	}
	return tm
}

// zone loads a time zone from the system database.
func zone(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatalf("time zone %s: %v", name, err)
	}
	return loc
}

// windowsOf returns the windows whose starts are the given instants.
func windowsOf(t *testing.T, starts [4]string) Windows {
	t.Helper()
	var w Windows
	for i, s := range starts {
		w[i] = instant(t, s).UnixMicro()
	}
	return w
}

// fmtWindows prints windows as UTC instants, for messages.
func fmtWindows(w Windows) string {
	s := ""
	for i, v := range w {
		if i > 0 {
			s += " "
		}
		s += time.UnixMicro(v).UTC().Format(time.RFC3339Nano)
	}
	return s
}

// TestWindowsAt: the four window starts of a day, a week (from Monday
// 00:00) and a month, in UTC, America/New_York and Europe/Berlin, given
// as UTC instants worked out by hand from each zone's offsets (EST -5,
// EDT -4, CET +1, CEST +2), with each window's length in hours: months of
// 28, 29, 30 and 31 days, the 23- and 25-hour days of the daylight-saving
// changes and the 167- and 169-hour weeks that hold them, a Sunday and a
// Monday input, and inputs a microsecond either side of a boundary (given
// in UTC, on the other calendar day than the zone's).
func TestWindowsAt(t *testing.T) {
	utc, ny, berlin := time.UTC, zone(t, "America/New_York"), zone(t, "Europe/Berlin")
	for _, c := range []struct {
		name  string
		p     Period
		loc   *time.Location
		at    string
		want  [4]string
		hours [3]int64 // w1-w0, w2-w1, w3-w2
	}{
		// Days.
		{"utc day, last microsecond", Day, utc, "2026-01-31T23:59:59.999999Z",
			[4]string{"2026-01-30T00:00:00Z", "2026-01-31T00:00:00Z", "2026-02-01T00:00:00Z", "2026-02-02T00:00:00Z"}, [3]int64{24, 24, 24}},
		{"utc day, first microsecond", Day, utc, "2026-02-01T00:00:00Z",
			[4]string{"2026-01-31T00:00:00Z", "2026-02-01T00:00:00Z", "2026-02-02T00:00:00Z", "2026-02-03T00:00:00Z"}, [3]int64{24, 24, 24}},
		{"utc day, leap day", Day, utc, "2028-02-29T12:00:00Z",
			[4]string{"2028-02-28T00:00:00Z", "2028-02-29T00:00:00Z", "2028-03-01T00:00:00Z", "2028-03-02T00:00:00Z"}, [3]int64{24, 24, 24}},
		{"new york 23h day", Day, ny, "2026-03-08T12:00:00-04:00",
			[4]string{"2026-03-07T05:00:00Z", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z", "2026-03-10T04:00:00Z"}, [3]int64{24, 23, 24}},
		{"new york 23h day, its last microsecond", Day, ny, "2026-03-09T03:59:59.999999Z",
			[4]string{"2026-03-07T05:00:00Z", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z", "2026-03-10T04:00:00Z"}, [3]int64{24, 23, 24}},
		{"new york 23h day, its first microsecond (UTC)", Day, ny, "2026-03-08T05:00:00Z",
			[4]string{"2026-03-07T05:00:00Z", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z", "2026-03-10T04:00:00Z"}, [3]int64{24, 23, 24}},
		{"new york the day before the 23h day", Day, ny, "2026-03-08T04:59:59.999999Z",
			[4]string{"2026-03-06T05:00:00Z", "2026-03-07T05:00:00Z", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z"}, [3]int64{24, 24, 23}},
		{"new york the day after the 23h day", Day, ny, "2026-03-09T04:00:00Z",
			[4]string{"2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z", "2026-03-10T04:00:00Z", "2026-03-11T04:00:00Z"}, [3]int64{23, 24, 24}},
		{"new york 25h day", Day, ny, "2026-11-01T12:00:00-05:00",
			[4]string{"2026-10-31T04:00:00Z", "2026-11-01T04:00:00Z", "2026-11-02T05:00:00Z", "2026-11-03T05:00:00Z"}, [3]int64{24, 25, 24}},
		{"new york 25h day, in its second 1 am", Day, ny, "2026-11-01T01:30:00-05:00",
			[4]string{"2026-10-31T04:00:00Z", "2026-11-01T04:00:00Z", "2026-11-02T05:00:00Z", "2026-11-03T05:00:00Z"}, [3]int64{24, 25, 24}},
		{"new york 25h day, its last microsecond", Day, ny, "2026-11-02T04:59:59.999999Z",
			[4]string{"2026-10-31T04:00:00Z", "2026-11-01T04:00:00Z", "2026-11-02T05:00:00Z", "2026-11-03T05:00:00Z"}, [3]int64{24, 25, 24}},
		{"berlin 23h day", Day, berlin, "2026-03-29T12:00:00Z",
			[4]string{"2026-03-27T23:00:00Z", "2026-03-28T23:00:00Z", "2026-03-29T22:00:00Z", "2026-03-30T22:00:00Z"}, [3]int64{24, 23, 24}},
		{"berlin 23h day, first microsecond (the UTC day before)", Day, berlin, "2026-03-28T23:00:00Z",
			[4]string{"2026-03-27T23:00:00Z", "2026-03-28T23:00:00Z", "2026-03-29T22:00:00Z", "2026-03-30T22:00:00Z"}, [3]int64{24, 23, 24}},
		{"berlin 25h day", Day, berlin, "2026-10-25T12:00:00Z",
			[4]string{"2026-10-23T22:00:00Z", "2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z", "2026-10-26T23:00:00Z"}, [3]int64{24, 25, 24}},
		{"berlin 25h day, its last microsecond", Day, berlin, "2026-10-25T22:59:59.999999Z",
			[4]string{"2026-10-23T22:00:00Z", "2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z", "2026-10-26T23:00:00Z"}, [3]int64{24, 25, 24}},

		// Weeks: from Monday 00:00.
		{"utc week, sunday", Week, utc, "2026-03-01T23:59:59.999999Z",
			[4]string{"2026-02-16T00:00:00Z", "2026-02-23T00:00:00Z", "2026-03-02T00:00:00Z", "2026-03-09T00:00:00Z"}, [3]int64{168, 168, 168}},
		{"utc week, monday", Week, utc, "2026-03-02T00:00:00Z",
			[4]string{"2026-02-23T00:00:00Z", "2026-03-02T00:00:00Z", "2026-03-09T00:00:00Z", "2026-03-16T00:00:00Z"}, [3]int64{168, 168, 168}},
		{"utc week across a new year (thursday)", Week, utc, "2026-01-01T08:00:00Z",
			[4]string{"2025-12-22T00:00:00Z", "2025-12-29T00:00:00Z", "2026-01-05T00:00:00Z", "2026-01-12T00:00:00Z"}, [3]int64{168, 168, 168}},
		{"new york 167h week, sunday", Week, ny, "2026-03-08T12:00:00-04:00",
			[4]string{"2026-02-23T05:00:00Z", "2026-03-02T05:00:00Z", "2026-03-09T04:00:00Z", "2026-03-16T04:00:00Z"}, [3]int64{168, 167, 168}},
		{"new york 167h week, monday", Week, ny, "2026-03-02T00:00:00-05:00",
			[4]string{"2026-02-23T05:00:00Z", "2026-03-02T05:00:00Z", "2026-03-09T04:00:00Z", "2026-03-16T04:00:00Z"}, [3]int64{168, 167, 168}},
		{"new york the monday after the 167h week", Week, ny, "2026-03-09T04:00:00Z",
			[4]string{"2026-03-02T05:00:00Z", "2026-03-09T04:00:00Z", "2026-03-16T04:00:00Z", "2026-03-23T04:00:00Z"}, [3]int64{167, 168, 168}},
		{"new york 169h week, sunday", Week, ny, "2026-11-01T12:00:00-05:00",
			[4]string{"2026-10-19T04:00:00Z", "2026-10-26T04:00:00Z", "2026-11-02T05:00:00Z", "2026-11-09T05:00:00Z"}, [3]int64{168, 169, 168}},
		{"new york 169h week, its last microsecond (a UTC monday)", Week, ny, "2026-11-02T04:59:59.999999Z",
			[4]string{"2026-10-19T04:00:00Z", "2026-10-26T04:00:00Z", "2026-11-02T05:00:00Z", "2026-11-09T05:00:00Z"}, [3]int64{168, 169, 168}},
		{"new york 169h week, monday", Week, ny, "2026-10-26T00:00:00-04:00",
			[4]string{"2026-10-19T04:00:00Z", "2026-10-26T04:00:00Z", "2026-11-02T05:00:00Z", "2026-11-09T05:00:00Z"}, [3]int64{168, 169, 168}},
		{"berlin 167h week, sunday", Week, berlin, "2026-03-29T12:00:00Z",
			[4]string{"2026-03-15T23:00:00Z", "2026-03-22T23:00:00Z", "2026-03-29T22:00:00Z", "2026-04-05T22:00:00Z"}, [3]int64{168, 167, 168}},
		{"berlin 169h week, monday (a UTC sunday)", Week, berlin, "2026-10-18T22:00:00Z",
			[4]string{"2026-10-11T22:00:00Z", "2026-10-18T22:00:00Z", "2026-10-25T23:00:00Z", "2026-11-01T23:00:00Z"}, [3]int64{168, 169, 168}},
		{"berlin 169h week, sunday", Week, berlin, "2026-10-25T22:59:59.999999Z",
			[4]string{"2026-10-11T22:00:00Z", "2026-10-18T22:00:00Z", "2026-10-25T23:00:00Z", "2026-11-01T23:00:00Z"}, [3]int64{168, 169, 168}},

		// Months.
		{"utc month, last microsecond of january", Month, utc, "2026-01-31T23:59:59.999999Z",
			[4]string{"2025-12-01T00:00:00Z", "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z"}, [3]int64{31 * 24, 31 * 24, 28 * 24}},
		{"utc month, first microsecond of february (28 days)", Month, utc, "2026-02-01T00:00:00Z",
			[4]string{"2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z", "2026-04-01T00:00:00Z"}, [3]int64{31 * 24, 28 * 24, 31 * 24}},
		{"utc month, february of a leap year (29 days)", Month, utc, "2028-02-29T23:59:59.999999Z",
			[4]string{"2028-01-01T00:00:00Z", "2028-02-01T00:00:00Z", "2028-03-01T00:00:00Z", "2028-04-01T00:00:00Z"}, [3]int64{31 * 24, 29 * 24, 31 * 24}},
		{"utc month, april (30 days)", Month, utc, "2026-04-30T23:59:59.999999Z",
			[4]string{"2026-03-01T00:00:00Z", "2026-04-01T00:00:00Z", "2026-05-01T00:00:00Z", "2026-06-01T00:00:00Z"}, [3]int64{31 * 24, 30 * 24, 31 * 24}},
		{"utc month, december into a new year", Month, utc, "2026-12-31T23:59:59Z",
			[4]string{"2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z", "2027-02-01T00:00:00Z"}, [3]int64{30 * 24, 31 * 24, 31 * 24}},
		{"new york february, last microsecond (a UTC march 1)", Month, ny, "2026-03-01T04:59:59.999999Z",
			[4]string{"2026-01-01T05:00:00Z", "2026-02-01T05:00:00Z", "2026-03-01T05:00:00Z", "2026-04-01T04:00:00Z"}, [3]int64{31 * 24, 28 * 24, 31*24 - 1}},
		{"new york march (743h)", Month, ny, "2026-03-01T05:00:00Z",
			[4]string{"2026-02-01T05:00:00Z", "2026-03-01T05:00:00Z", "2026-04-01T04:00:00Z", "2026-05-01T04:00:00Z"}, [3]int64{28 * 24, 31*24 - 1, 30 * 24}},
		{"new york november (721h)", Month, ny, "2026-11-15T12:00:00-05:00",
			[4]string{"2026-10-01T04:00:00Z", "2026-11-01T04:00:00Z", "2026-12-01T05:00:00Z", "2027-01-01T05:00:00Z"}, [3]int64{31 * 24, 30*24 + 1, 31 * 24}},
		{"berlin march (743h), last microsecond", Month, berlin, "2026-03-31T21:59:59.999999Z",
			[4]string{"2026-01-31T23:00:00Z", "2026-02-28T23:00:00Z", "2026-03-31T22:00:00Z", "2026-04-30T22:00:00Z"}, [3]int64{28 * 24, 31*24 - 1, 30 * 24}},
		{"berlin april, first microsecond", Month, berlin, "2026-03-31T22:00:00Z",
			[4]string{"2026-02-28T23:00:00Z", "2026-03-31T22:00:00Z", "2026-04-30T22:00:00Z", "2026-05-31T22:00:00Z"}, [3]int64{31*24 - 1, 30 * 24, 31 * 24}},
		{"berlin october (745h)", Month, berlin, "2026-10-25T12:00:00Z",
			[4]string{"2026-08-31T22:00:00Z", "2026-09-30T22:00:00Z", "2026-10-31T23:00:00Z", "2026-11-30T23:00:00Z"}, [3]int64{30 * 24, 31*24 + 1, 30 * 24}},
		{"berlin february of a leap year (29 days)", Month, berlin, "2028-02-15T00:00:00+01:00",
			[4]string{"2027-12-31T23:00:00Z", "2028-01-31T23:00:00Z", "2028-02-29T23:00:00Z", "2028-03-31T22:00:00Z"}, [3]int64{31 * 24, 29 * 24, 31*24 - 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := WindowsAt(c.p, c.loc, instant(t, c.at))
			want := windowsOf(t, c.want)
			if got != want {
				t.Fatalf("WindowsAt(%s, %s, %s)\n got  %s\n want %s", c.p, c.loc, c.at, fmtWindows(got), fmtWindows(want))
			}
			for i, h := range c.hours {
				if d := got[i+1] - got[i]; d != h*3_600_000_000 {
					t.Errorf("window %d is %d µs long, want %d h", i, d, h)
				}
			}
			// The input is in the window that holds it.
			at := instant(t, c.at).UnixMicro()
			if start, end := got.At(at); start != got[1] || end != got[2] {
				t.Errorf("At(input) = [%d, %d), want the second window [%d, %d)", start, end, got[1], got[2])
			}
		})
	}
}

// TestWindowsAtIgnoresInputZone: the windows depend on the instant and the
// quota's zone, not on the zone the gateway's time is expressed in.
func TestWindowsAtIgnoresInputZone(t *testing.T) {
	ny, berlin := zone(t, "America/New_York"), zone(t, "Europe/Berlin")
	tm := instant(t, "2026-11-02T04:30:00Z")
	for _, p := range []Period{Day, Week, Month} {
		for _, loc := range []*time.Location{time.UTC, ny, berlin} {
			want := WindowsAt(p, loc, tm)
			for _, in := range []*time.Location{time.UTC, ny, berlin, time.FixedZone("x", 13*3600)} {
				if got := WindowsAt(p, loc, tm.In(in)); got != want {
					t.Errorf("%s in %s, input in %s: %s, want %s", p, loc, in, fmtWindows(got), fmtWindows(want))
				}
			}
		}
	}
}

// TestWindowsAtSteps: at every hour (and the microsecond before it) of
// 2026 to 2028, in each zone, the windows are four consecutive calendar
// windows: each starts at 00:00 local (a Monday for weeks, the 1st for
// months), the second holds the input, and each is as long as the
// calendar has it (23 to 25 hours a day, 167 to 169 a week, 28 to 31 days
// a month, ±1 hour).
func TestWindowsAtSteps(t *testing.T) {
	for _, name := range []string{"UTC", "America/New_York", "Europe/Berlin"} {
		loc := zone(t, name)
		start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		checked := map[Windows]bool{}
		for tm := start; tm.Year() < 2029; tm = tm.Add(time.Hour) {
			for _, at := range []time.Time{tm, tm.Add(-time.Microsecond)} {
				for _, p := range []Period{Day, Week, Month} {
					w := WindowsAt(p, loc, at)
					if us := at.UnixMicro(); us < w[1] || us >= w[2] {
						t.Fatalf("%s %s at %s: %s does not hold the input in its second window", name, p, at, fmtWindows(w))
					}
					if checked[w] {
						continue
					}
					checked[w] = true
					for i, v := range w {
						local := time.UnixMicro(v).In(loc)
						if h, m, s := local.Clock(); h != 0 || m != 0 || s != 0 || local.Nanosecond() != 0 {
							t.Fatalf("%s %s at %s: window %d starts at %s, not 00:00", name, p, at, i, local)
						}
						if p == Week && local.Weekday() != time.Monday {
							t.Fatalf("%s week at %s: window %d starts on %s", name, at, i, local.Weekday())
						}
						if p == Month && local.Day() != 1 {
							t.Fatalf("%s month at %s: window %d starts on day %d", name, at, i, local.Day())
						}
						if i == 0 {
							continue
						}
						prev := time.UnixMicro(w[i-1]).In(loc)
						days := map[Period]int{Day: 1, Week: 7}[p]
						if p == Month {
							days = time.Date(prev.Year(), prev.Month()+1, 0, 12, 0, 0, 0, time.UTC).Day()
						}
						if y, m, d := prev.AddDate(0, 0, days).Date(); local.Year() != y || local.Month() != m || local.Day() != d {
							t.Fatalf("%s %s at %s: window %d starts %s, want the day %d days after %s", name, p, at, i, local, days, prev)
						}
						if got, want := w[i]-w[i-1], int64(days)*86_400_000_000; name == "UTC" && got != want ||
							got < want-3_600_000_000 || got > want+3_600_000_000 {
							t.Fatalf("%s %s at %s: window %d is %d µs long, want %d ± 1 h", name, p, at, i-1, got, want)
						}
					}
				}
			}
		}
	}
}

// TestWindowsAtPicks: Windows.At picks the window that holds now among the
// first three, the first for any time before it and the third for any
// time at or past its end (a clock off by more than a window), exactly at
// each boundary.
func TestWindowsAtPicks(t *testing.T) {
	w := windowsOf(t, [4]string{"2026-02-01T05:00:00Z", "2026-03-01T05:00:00Z", "2026-04-01T04:00:00Z", "2026-05-01T04:00:00Z"})
	if got := WindowsAt(Month, zone(t, "America/New_York"), instant(t, "2026-03-15T00:00:00Z")); got != w {
		t.Fatalf("windows %s, want %s", fmtWindows(got), fmtWindows(w))
	}
	first, second, third := [2]int64{w[0], w[1]}, [2]int64{w[1], w[2]}, [2]int64{w[2], w[3]}
	for _, c := range []struct {
		name string
		now  int64
		want [2]int64
	}{
		{"a year before", w[0] - 365*86_400_000_000, first},
		{"just before the first", w[0] - 1, first},
		{"start of the first", w[0], first},
		{"end of the first", w[1] - 1, first},
		{"start of the second", w[1], second},
		{"end of the second", w[2] - 1, second},
		{"start of the third", w[2], third},
		{"end of the third", w[3] - 1, third},
		{"start of the fourth", w[3], third},
		{"a year after", w[3] + 365*86_400_000_000, third},
	} {
		if start, end := w.At(c.now); [2]int64{start, end} != c.want {
			t.Errorf("%s: At(%d) = [%d, %d), want [%d, %d)", c.name, c.now, start, end, c.want[0], c.want[1])
		}
	}
}

// chargedFullMS is what the script reports as full_ms when it charges a
// quota of windows w at Redis time now: the milliseconds, rounded up, to
// the end of the window it picks, at least 1.
func chargedFullMS(w Windows, now int64) int64 {
	_, end := w.At(now)
	return max(1, ceilDiv(end-now, 1000))
}

// TestChargedIn: the gateway finds the window a decision charged from its
// own clock at the decision and the decision's FullMS, when Redis's clock
// is an hour ahead of or behind it across a window boundary: month, day
// and week quotas, in New York across the 23- and 25-hour days.
func TestChargedIn(t *testing.T) {
	ny := zone(t, "America/New_York")
	const hour = 3_600_000_000
	for _, c := range []struct {
		name    string
		p       Period
		gateway string // the gateway's clock: the windows and decidedAt
		skew    int64  // Redis's clock minus the gateway's, µs
		want    string // the start of the window Redis charged
	}{
		{"month, same clock, last hour of january", Month, "2026-01-31T23:30:00-05:00", 0, "2026-01-01T05:00:00Z"},
		{"month, redis an hour ahead into february", Month, "2026-01-31T23:30:00-05:00", hour, "2026-02-01T05:00:00Z"},
		{"month, redis an hour behind, still january", Month, "2026-01-31T23:30:00-05:00", -hour, "2026-01-01T05:00:00Z"},
		{"month, gateway in february, redis an hour behind in january", Month, "2026-02-01T00:30:00-05:00", -hour, "2026-01-01T05:00:00Z"},
		{"month, gateway in february, redis an hour ahead", Month, "2026-02-01T00:30:00-05:00", hour, "2026-02-01T05:00:00Z"},
		{"month, gateway's last microsecond of january, redis ahead", Month, "2026-01-31T23:59:59.999999-05:00", 1, "2026-02-01T05:00:00Z"},
		{"day, 23h day, redis an hour ahead into it", Day, "2026-03-07T23:30:00-05:00", hour, "2026-03-08T05:00:00Z"},
		{"day, end of the 23h day, redis an hour ahead", Day, "2026-03-08T23:30:00-04:00", hour, "2026-03-09T04:00:00Z"},
		{"day, start of the day after the 23h day, redis an hour behind", Day, "2026-03-09T00:30:00-04:00", -hour, "2026-03-08T05:00:00Z"},
		{"day, 25h day, redis an hour behind", Day, "2026-11-02T00:30:00-05:00", -hour, "2026-11-01T04:00:00Z"},
		{"day, end of the 25h day, redis an hour ahead", Day, "2026-11-01T23:30:00-05:00", hour, "2026-11-02T05:00:00Z"},
		{"day, 25h day's second 1 am, redis an hour ahead", Day, "2026-11-01T01:30:00-05:00", hour, "2026-11-01T04:00:00Z"},
		{"week, 169h week, redis an hour ahead into the next", Week, "2026-11-01T23:30:00-05:00", hour, "2026-11-02T05:00:00Z"},
		{"week, 167h week's first hour, redis an hour behind", Week, "2026-03-02T00:30:00-05:00", -hour, "2026-02-23T05:00:00Z"},
	} {
		t.Run(c.name, func(t *testing.T) {
			gw := instant(t, c.gateway)
			w := WindowsAt(c.p, ny, gw)
			redisNow := gw.UnixMicro() + c.skew
			want := instant(t, c.want).UnixMicro()
			start, end := w.At(redisNow)
			if start != want {
				t.Fatalf("At(redis) = %d, want %d: the case is wrong", start, want)
			}
			full := chargedFullMS(w, redisNow)
			if got, gotEnd := w.ChargedIn(gw.UnixMicro(), full); got != want || gotEnd != end {
				t.Errorf("ChargedIn(%s, %d ms) = %s, %s; want %s, %s", c.gateway, full, time.UnixMicro(got).UTC(),
					time.UnixMicro(gotEnd).UTC(), c.want, time.UnixMicro(end).UTC())
			}
		})
	}
}

// TestChargedInSkews: for random gateway times over three years, in each
// zone and period, and any clock skew below half of the shortest window
// (11.5 h: a 23-hour day), ChargedIn names the window the script picked.
func TestChargedInSkews(t *testing.T) {
	const maxSkew = 11*3_600_000_000 + 30*60_000_000 - 1_000 // under 11.5 h, with the ms rounding
	r := rand.New(rand.NewPCG(7, 11))
	from := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()
	to := time.Date(2029, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()
	locs := []*time.Location{time.UTC, zone(t, "America/New_York"), zone(t, "Europe/Berlin")}
	for i := 0; i < 50_000; i++ {
		gw := from + r.Int64N(to-from)
		p := []Period{Day, Week, Month}[r.IntN(3)]
		loc := locs[r.IntN(len(locs))]
		skew := r.Int64N(2*maxSkew+1) - maxSkew
		if r.IntN(4) == 0 { // near a boundary: a gateway a little either side of one
			w := WindowsAt(p, loc, time.UnixMicro(gw))
			gw = w[1+r.IntN(2)] + r.Int64N(2*3_600_000_000) - 3_600_000_000
		}
		w := WindowsAt(p, loc, time.UnixMicro(gw))
		redisNow := gw + skew
		start, end := w.At(redisNow)
		if got, gotEnd := w.ChargedIn(gw, chargedFullMS(w, redisNow)); got != start || gotEnd != end {
			t.Fatalf("%s %s, gateway %d, skew %d µs: ChargedIn %d–%d, script charged %d–%d", loc, p, gw, skew, got, gotEnd, start, end)
		}
	}
}

// TestWindowsAtMidnightGap: in a zone whose clocks spring forward at
// midnight (America/Santiago on 2026-09-06, America/Havana on
// 2026-03-08), 00:00 does not exist; the day starts where the gap ends,
// at 01:00 in the new offset, so the day before keeps its 24 hours and
// the day of the change has 23. The input is in the second window.
func TestWindowsAtMidnightGap(t *testing.T) {
	santiago, havana := zone(t, "America/Santiago"), zone(t, "America/Havana")
	for _, c := range []struct {
		name  string
		loc   *time.Location
		at    string
		want  [4]string
		hours [3]int64
	}{
		{"santiago, the evening before", santiago, "2026-09-05T23:30:00-04:00",
			[4]string{"2026-09-04T04:00:00Z", "2026-09-05T04:00:00Z", "2026-09-06T04:00:00Z", "2026-09-07T03:00:00Z"}, [3]int64{24, 24, 23}},
		{"santiago, the day of the change", santiago, "2026-09-06T12:00:00-03:00",
			[4]string{"2026-09-05T04:00:00Z", "2026-09-06T04:00:00Z", "2026-09-07T03:00:00Z", "2026-09-08T03:00:00Z"}, [3]int64{24, 23, 24}},
		{"havana, the evening before", havana, "2026-03-07T23:30:00-05:00",
			[4]string{"2026-03-06T05:00:00Z", "2026-03-07T05:00:00Z", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z"}, [3]int64{24, 24, 23}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := WindowsAt(Day, c.loc, instant(t, c.at))
			if want := windowsOf(t, c.want); got != want {
				t.Errorf("WindowsAt(day, %s, %s)\n got  %s\n want %s", c.loc, c.at, fmtWindows(got), fmtWindows(want))
			}
			for i, h := range c.hours {
				if d := got[i+1] - got[i]; d != h*3_600_000_000 {
					t.Errorf("window %d is %d µs long, want %d h", i, d, h)
				}
			}
			if at := instant(t, c.at).UnixMicro(); at < got[1] || at >= got[2] {
				t.Errorf("the input is not in the second window")
			}
		})
	}
}
