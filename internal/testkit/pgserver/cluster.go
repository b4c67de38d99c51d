package pgserver

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
)

// ErrNoBinaries is wrapped by the error StartTempCluster returns when the
// PostgreSQL server binaries cannot be found.
var ErrNoBinaries = errors.New("PostgreSQL server binaries (initdb, postgres) not found")

// binarySearchGlobs are the places, after PATH, where findServerBinaries
// looks for initdb and postgres. Globs with a version in them are tried
// newest version first.
var binarySearchGlobs = []string{
	"/usr/lib/postgresql/*/bin",                          // Debian, Ubuntu
	"/usr/pgsql-*/bin",                                   // RHEL, Fedora (PGDG)
	"/usr/local/pgsql/bin",                               // source builds
	"/usr/local/bin",                                     // Alpine, misc
	"/usr/bin",                                           // Arch, Alpine
	"/opt/homebrew/bin",                                  // Homebrew (Apple silicon)
	"/opt/homebrew/opt/postgresql@*/bin",                 // Homebrew versioned formulae
	"/usr/local/opt/postgresql@*/bin",                    // Homebrew (Intel)
	"/opt/local/lib/postgresql*/bin",                     // MacPorts
	"/Applications/Postgres.app/Contents/Versions/*/bin", // Postgres.app
}

// findServerBinaries returns a directory holding both initdb and postgres
// (after resolving symlinks, since the two must be of the same build).
func findServerBinaries() (string, error) {
	var dirs []string
	if p, err := exec.LookPath("initdb"); err == nil {
		dirs = append(dirs, filepath.Dir(p))
	}
	for _, pattern := range binarySearchGlobs {
		matches, _ := filepath.Glob(pattern)
		sort.SliceStable(matches, func(i, j int) bool {
			return versionOf(matches[i]) > versionOf(matches[j])
		})
		dirs = append(dirs, matches...)
	}
	for _, dir := range dirs {
		initdb, err := filepath.EvalSymlinks(filepath.Join(dir, "initdb"))
		if err != nil || !isExecutable(initdb) {
			continue
		}
		real := filepath.Dir(initdb)
		if isExecutable(filepath.Join(real, "postgres")) {
			return real, nil
		}
	}
	return "", ErrNoBinaries
}

// versionOf extracts the first number in path ("/usr/lib/postgresql/15/bin"
// gives 15), or -1 if there is none.
func versionOf(path string) int {
	start := -1
	for i, r := range path {
		isDigit := r >= '0' && r <= '9'
		switch {
		case isDigit && start < 0:
			start = i
		case !isDigit && start >= 0:
			n, _ := strconv.Atoi(path[start:i])
			return n
		}
	}
	if start >= 0 {
		n, _ := strconv.Atoi(path[start:])
		return n
	}
	return -1
}

// isExecutable reports whether path is a regular file with an execute bit.
func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}
