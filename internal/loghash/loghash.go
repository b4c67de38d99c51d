// Package loghash gives the keyed hashes that idem's and idemhttp's logs
// carry instead of idempotency keys and actors: the first 16 hex digits of
// HMAC-SHA256 under a secret, so the same key can be followed across log
// records (and across instances that share the secret) while its value
// cannot be recovered from the logs, not even by trying likely keys.
package loghash

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"sync"
)

// Hasher hashes values under one secret. It is safe for concurrent use.
type Hasher struct {
	macs sync.Pool // of hash.Hash, HMAC-SHA256 under the secret
}

// New returns a Hasher for secret; an empty secret means a random one.
func New(secret []byte) *Hasher {
	if len(secret) == 0 {
		secret = NewSecret()
	}
	secret = append([]byte(nil), secret...)
	h := &Hasher{}
	h.macs.New = func() any { return hmac.New(sha256.New, secret) }
	return h
}

// Default returns this process's random 32-byte secret, made once: the
// secret of the fronts (idemhttp's middleware, status and webhook
// handlers, the RPC interceptors) whose Config has no LogHashKey, so that
// all of them in one process hash a key alike.
func Default() []byte {
	defaultOnce.Do(func() { defaultSecret = NewSecret() })
	return defaultSecret
}

var (
	defaultOnce   sync.Once
	defaultSecret []byte
)

// NewSecret returns a random 32-byte secret.
func NewSecret() []byte {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // crypto/rand does not fail on supported platforms
	return b
}

// Sum returns the hash of s: 16 lowercase hex digits.
func (h *Hasher) Sum(s string) string {
	m := h.macs.Get().(hash.Hash)
	m.Reset()
	_, _ = m.Write([]byte(s))
	var buf [sha256.Size]byte
	sum := m.Sum(buf[:0])
	h.macs.Put(m)
	return hex.EncodeToString(sum[:8])
}
