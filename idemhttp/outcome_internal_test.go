package idemhttp

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/pgidem/idem"
)

// A fenced reservation is a bug or a race in the handler, not the store:
// 500, not 503.
func TestFencedIs500(t *testing.T) {
	if got := storeStatus(fmt.Errorf("complete: %w", idem.ErrFenced)); got != http.StatusInternalServerError {
		t.Fatalf("storeStatus(ErrFenced) = %d, want 500", got)
	}
}
