// Package testlog holds what tests need to read a logger's output.
package testlog

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer safe for the concurrent writes of a logger (for
// example slog.NewTextHandler(&buf, nil)) and for reading while they go on.
// The zero value is ready to use.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p to the buffer.
func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what has been written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
