//go:build race

package tokenbucket

// foRace is true under the race detector, which makes the local store's
// million-identity fill ten times slower; the memory figure does not need
// the detector, so it runs a smaller fill then.
const foRace = true
