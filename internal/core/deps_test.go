package core

import (
	"crypto/sha256"
	"os/exec"
	"strings"
	"testing"

	"github.com/google/uuid"
)

// The core speaks no database: neither it nor anything it imports is pgx,
// pgconn, lib/pq or a database/sql package. Drivers translate the errors
// (Driver.Interpret, package driver's faults).
func TestImportsNoDatabasePackage(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if strings.HasPrefix(pkg, "database/sql") || strings.Contains(pkg, "jackc/") || strings.Contains(pkg, "lib/pq") {
			t.Errorf("internal/core depends on %s", pkg)
		}
	}
}

// hashUUID makes the UUIDs github.com/google/uuid's NewHash makes (version
// 8, SHA-256), which CallKey made before: the keys of every release agree.
func TestHashUUIDIsGoogleUUIDs(t *testing.T) {
	space := uuid.UUID(callKeySpace)
	if space.String() != "249c946d-56e2-43ff-a5b0-cabd9168bf49" {
		t.Fatalf("namespace %s", space)
	}
	for _, data := range []string{"", "a", "idem call key/1 alice order k charge", strings.Repeat("x", 1000)} {
		want := uuid.NewHash(sha256.New(), space, []byte(data), 8).String()
		if got := hashUUID(callKeySpace, []byte(data)); got != want {
			t.Errorf("hashUUID(%q) = %s, want %s", data, got, want)
		}
	}
}
