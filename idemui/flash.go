package idemui

import (
	"crypto/rand"
	"encoding/base64"
	"sync"
	"time"
)

// Flash messages (what an action just did, shown once on the page it
// redirects to) are kept here, on the server, under a random name that the
// redirect's address carries: the address never holds the message, so a
// link cannot make the console claim a success it never had, and a message
// is shown once (a refresh does not repeat it), to the operator who acted
// only: another who opens the address (a link pasted in a chat, a
// proxy's log) is shown nothing, and the message still waits for its own
// operator. A console behind several
// servers shows the message only when the redirect reaches the same one;
// the page shows the change anyway.
type flashes struct {
	mu sync.Mutex
	m  map[string]flashEntry
}

type flashEntry struct {
	f        flash
	operator string // who acted: the only one shown it
	at       time.Time
}

// Bounds of the store: a message not shown within flashTTL is dropped,
// and at most maxFlashes wait.
const (
	flashTTL   = 5 * time.Minute
	maxFlashes = 10000
)

// put keeps f, for operator, and returns its name.
func (s *flashes) put(f flash, operator string) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	id := base64.RawURLEncoding.EncodeToString(b[:])
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]flashEntry{}
	}
	if len(s.m) >= maxFlashes {
		for k, e := range s.m {
			if now.Sub(e.at) > flashTTL || len(s.m) >= maxFlashes {
				delete(s.m, k)
			}
		}
	}
	s.m[id] = flashEntry{f: f, operator: operator, at: now}
	return id
}

// take returns the message named id, kept for operator, and forgets it;
// nil when there is none (never kept, shown already, too old, or kept for
// another operator, for whom it stays).
func (s *flashes) take(id, operator string) *flash {
	if id == "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[id]
	if !ok || e.operator != operator {
		return nil
	}
	delete(s.m, id)
	if time.Since(e.at) > flashTTL {
		return nil
	}
	return &e.f
}
