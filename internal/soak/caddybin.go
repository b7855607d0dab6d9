// Package soak holds what the out-of-process tests share: building Caddy
// with this plugin through xcaddy (cached by a hash of the sources), running
// redis-server and Caddy processes on free loopback ports, and the soak
// driver that cmd/soak runs.
package soak

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// Versions that BuildCaddy pins; they are part of the cache key.
const (
	XcaddyVersion = "v0.4.5"
	CaddyVersion  = "v2.11.9"
	Module        = "github.com/token-bucket/token_bucket"
)

// BuildCaddy returns the path of a Caddy binary with the plugin built from
// the module at repoDir. The binary is cached as <repoDir>/bin/caddy-<hash>,
// where hash covers the plugin's sources, go.mod, go.sum and the pinned
// versions (SourceHash), so a repeated run with unchanged sources reuses it
// and a changed source rebuilds it. Concurrent callers (a test and the soak
// driver) build once, under a lock file. Older cached binaries are removed
// after a build. Progress goes to logw.
func BuildCaddy(ctx context.Context, repoDir string, logw io.Writer) (string, error) {
	repoDir, err := filepath.Abs(repoDir)
	if err != nil {
		return "", err
	}
	sum, err := SourceHash(repoDir)
	if err != nil {
		return "", fmt.Errorf("hashing the plugin sources: %w", err)
	}
	binDir := filepath.Join(repoDir, "bin")
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return "", err
	}
	out := filepath.Join(binDir, "caddy-"+sum)
	unlock, err := lockFile(filepath.Join(binDir, ".caddy-build.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if fi, err := os.Stat(out); err == nil && fi.Mode()&0o111 != 0 {
		return out, nil
	}
	tmp := out + ".tmp"
	logPath := out + ".log"
	logFile, err := os.Create(logPath)
	if err != nil {
		return "", err
	}
	defer logFile.Close()
	fmt.Fprintf(logw, "building %s with xcaddy %s (Caddy %s); log: %s\n", filepath.Base(out), XcaddyVersion, CaddyVersion, logPath)
	start := time.Now()
	// "@v0.0.0=<dir>" builds the work tree; the explicit version keeps Go
	// from asking the module proxy for the module's latest version (see
	// scripts/build-caddy.sh).
	cmd := exec.CommandContext(ctx, "go", "run", "github.com/caddyserver/xcaddy/cmd/xcaddy@"+XcaddyVersion,
		"build", CaddyVersion, "--with", Module+"@v0.0.0="+repoDir, "--output", tmp)
	cmd.Dir = binDir
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Run(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("xcaddy build failed (%v); log: %s\n%s", err, logPath, tail(logPath, 30))
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", err
	}
	fmt.Fprintf(logw, "built %s in %s\n", filepath.Base(out), time.Since(start).Round(time.Second))
	prune(binDir, filepath.Base(out))
	return out, nil
}

// SourceHash returns the cache key of the plugin's sources at repoDir: 16
// hex digits of SHA-256 over the pinned versions, go.mod, go.sum and the
// path and contents of every Go and embedded file of the module's packages
// that the plugin is built from (go list -deps), so that editing a test, a
// script or this driver does not rebuild Caddy. When go list fails, every
// non-test .go and .lua file of the module is hashed instead.
func SourceHash(repoDir string) (string, error) {
	files, err := pluginFiles(repoDir)
	if err != nil {
		if files, err = allSources(repoDir); err != nil {
			return "", err
		}
	}
	files = append(files, filepath.Join(repoDir, "go.mod"), filepath.Join(repoDir, "go.sum"))
	sort.Strings(files)
	h := sha256.New()
	fmt.Fprintf(h, "xcaddy %s caddy %s\n", XcaddyVersion, CaddyVersion)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return "", err
		}
		rel, _ := filepath.Rel(repoDir, f)
		fmt.Fprintf(h, "%s %d\n", rel, len(b))
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// pluginFiles lists the Go and embedded files of the module's packages in
// the dependency graph of the plugin's root package.
func pluginFiles(repoDir string) ([]string, error) {
	format := `{{if .Module}}{{if eq .Module.Path "` + Module + `"}}{{.Dir}}{{"\t"}}{{join .GoFiles " "}} {{join .EmbedFiles " "}}{{end}}{{end}}`
	cmd := exec.Command("go", "list", "-deps", "-f", format, ".")
	cmd.Dir = repoDir
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list: %w", err)
	}
	var files []string
	for _, line := range strings.Split(string(out), "\n") {
		dir, names, ok := strings.Cut(line, "\t")
		if !ok {
			continue
		}
		for _, name := range strings.Fields(names) {
			files = append(files, filepath.Join(dir, name))
		}
	}
	if len(files) == 0 {
		return nil, errors.New("go list: no files in the plugin's packages")
	}
	return files, nil
}

// allSources lists every non-test .go and .lua file of the module.
func allSources(repoDir string) ([]string, error) {
	var files []string
	err := filepath.WalkDir(repoDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != repoDir && (strings.HasPrefix(name, ".") || name == "bin" || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if (strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go")) || strings.HasSuffix(name, ".lua") {
			files = append(files, path)
		}
		return nil
	})
	return files, err
}

// lockFile takes an exclusive flock on path and returns its release.
func lockFile(path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("locking %s: %w", path, err)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// prune removes the cached binaries other than keep (each is about 60 MB)
// that were built more than 10 minutes ago: a younger one may be about to
// run in a test of a concurrent edit.
func prune(binDir, keep string) {
	old, _ := filepath.Glob(filepath.Join(binDir, "caddy-*"))
	for _, p := range old {
		base := filepath.Base(p)
		if base == keep || base == keep+".log" {
			continue
		}
		if fi, err := os.Stat(p); err == nil && time.Since(fi.ModTime()) > 10*time.Minute {
			os.Remove(p)
		}
	}
}

func tail(path string, lines int) string {
	b, _ := os.ReadFile(path)
	all := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}
