//go:build !race

package tokenbucket

// foRace is true under the race detector; see failover_race_test.go.
const foRace = false
