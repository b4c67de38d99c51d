package idem_test

import (
	"regexp"
	"strings"
	"testing"

	"github.com/pgidem/idem"
)

// uuidV8 is the canonical form of an RFC 9562 version 8 UUID.
var uuidV8 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestEventID(t *testing.T) {
	t.Parallel()
	s := idem.Scope{Actor: "alice", Operation: "order.create"}
	const key = "9b1d2c6e-0d0f-4a57-8a1e-3b5f1c2d4e6f"
	id := idem.EventID(s, key, "order.placed")

	// Stable across processes and releases: consumers remember these ids.
	// (Computed independently: SHA-256 over "idem.event.v1", actor,
	// operation, key and name, each prefixed with its length as 8 bytes
	// big-endian; the first 16 bytes with version 8 and variant 10 set.)
	if want := "a5d02993-20b9-812e-a8b9-e1ffdf548ba1"; id != want {
		t.Fatalf("EventID = %s, want %s", id, want)
	}
	if !uuidV8.MatchString(id) {
		t.Fatalf("%s is not a version 8 UUID", id)
	}
	if strings.Contains(id, key[:8]) {
		t.Fatal("the id holds the key")
	}

	// Every part counts, and parts do not run into each other.
	seen := map[string]string{id: "base"}
	for name, other := range map[string]string{
		"actor":     idem.EventID(idem.Scope{Actor: "bob", Operation: "order.create"}, key, "order.placed"),
		"operation": idem.EventID(idem.Scope{Actor: "alice", Operation: "order.cancel"}, key, "order.placed"),
		"key":       idem.EventID(s, key+"x", "order.placed"),
		"name":      idem.EventID(s, key, "stock.reserved"),
		"boundary1": idem.EventID(idem.Scope{Actor: "ab", Operation: "c"}, "k", "n"),
		"boundary2": idem.EventID(idem.Scope{Actor: "a", Operation: "bc"}, "k", "n"),
		"empty":     idem.EventID(idem.Scope{}, "", ""),
	} {
		if !uuidV8.MatchString(other) {
			t.Fatalf("%s: %s is not a version 8 UUID", name, other)
		}
		if prev, dup := seen[other]; dup {
			t.Fatalf("%s and %s share the id %s", name, prev, other)
		}
		seen[other] = name
	}
	if idem.EventID(s, key, "order.placed") != id {
		t.Fatal("EventID is not deterministic")
	}
}
