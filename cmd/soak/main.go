// Command soak runs the token_bucket soak test: Caddy with the plugin
// (built with xcaddy, cached in ./bin), one Redis, a steady load, Redis
// killed and restarted on its port every 30 s and the config reloaded
// through the admin API every 10 s. It samples the gateway's goroutines,
// heap, RSS and open files and the clients connected to Redis after a
// warm-up and at the end, prints a table of the figures, and exits 1 when
// any grew beyond its bound or a request failed. It stops by itself.
//
//	go run ./cmd/soak -duration 3m
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/token-bucket/token_bucket/internal/soak"
)

func main() {
	var cfg soak.Config
	flag.StringVar(&cfg.Repo, "repo", ".", "the token_bucket module's directory")
	flag.DurationVar(&cfg.Duration, "duration", 3*time.Minute, "how long the load runs")
	flag.DurationVar(&cfg.RedisRestart, "redis-restart", 30*time.Second, "how often Redis is killed and restarted")
	flag.DurationVar(&cfg.RedisDown, "redis-down", 2*time.Second, "how long Redis stays down each time")
	flag.DurationVar(&cfg.Reload, "reload", 10*time.Second, "how often the config is reloaded")
	flag.DurationVar(&cfg.Warmup, "warmup", 15*time.Second, "load before the start sample")
	flag.IntVar(&cfg.Workers, "workers", 16, "load goroutines")
	flag.IntVar(&cfg.RPS, "rps", 400, "requests per second")
	flag.IntVar(&cfg.MaxGoroutineGrowth, "max-goroutine-growth", 50, "bound on the growth of the gateway's goroutines")
	flag.IntVar(&cfg.MaxRedisClientGrowth, "max-redis-client-growth", 5, "bound on the growth of Redis clients")
	flag.Float64Var(&cfg.MaxHeapRatio, "max-heap-ratio", 2, "bound on end heap / start heap")
	flag.Parse()
	cfg.Out = os.Stdout

	// The run ends by itself; a signal or a hung step ends it too.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, cfg.Duration+15*time.Minute) // includes a first xcaddy build
	defer cancel()

	rep, err := soak.Run(ctx, cfg)
	if rep != nil && rep.Elapsed > 0 {
		fmt.Println()
		rep.Print(os.Stdout, cfg)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		if rep != nil {
			fmt.Fprintf(os.Stderr, "soak: logs in %s\n", rep.Dir)
		}
		os.Exit(1)
	}
	if len(rep.Failures) > 0 {
		for _, f := range rep.Failures {
			fmt.Fprintln(os.Stderr, "soak: FAIL:", f)
		}
		fmt.Fprintf(os.Stderr, "soak: logs in %s\n", rep.Dir)
		os.Exit(1)
	}
	os.RemoveAll(rep.Dir)
	fmt.Println("soak: PASS")
}
