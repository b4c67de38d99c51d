package idemhttp

import (
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"

	"github.com/pgidem/idem"
)

// bufferWriter is the http.ResponseWriter a covered handler writes to. It
// keeps the whole response in memory, because the client must see nothing
// until the transaction has committed.
//
// It follows net/http's rules where a handler can tell the difference:
// Write without WriteHeader means 200; only the first WriteHeader counts;
// header changes after WriteHeader are not part of the response; 1xx codes
// are informational (dropped here, since nothing can reach the client
// before the commit); an empty write is no error; a body after 204 or 304
// is refused with http.ErrBodyNotAllowed; a write past the Content-Length
// the handler declared is refused with http.ErrContentLength, and so is
// every write after it; an invalid code panics. It does not implement
// http.Flusher or http.Hijacker, and has no Unwrap, so
// http.ResponseController reports http.ErrNotSupported for Flush, Hijack
// and deadlines instead of letting the handler bypass the buffer.
type bufferWriter struct {
	header http.Header // what the handler sees and changes
	sent   http.Header // header as of the first WriteHeader
	status int         // 0 until WriteHeader
	body   bytes.Buffer
	limit  int  // largest body kept
	tooBig bool // the handler wrote more than limit
	// overLength: a write went past the Content-Length the handler
	// declared; as net/http counts the refused bytes too, every later
	// write is refused.
	overLength bool

	invalid atomic.Bool // the handler called Invalid
}

func newBufferWriter(base http.Header, limit int) *bufferWriter {
	return &bufferWriter{header: base.Clone(), limit: limit}
}

func (w *bufferWriter) Header() http.Header { return w.header }

func (w *bufferWriter) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if w.status != 0 || code < 200 {
		return
	}
	w.status = code
	w.sent = w.header.Clone()
}

func (w *bufferWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.tooBig {
		return 0, fmt.Errorf("%w: the handler wrote more than %d bytes", idem.ErrResponseTooLarge, w.limit)
	}
	if len(p) == 0 {
		return 0, nil // as net/http, whatever the status
	}
	if !bodyAllowed(w.status) {
		return 0, http.ErrBodyNotAllowed
	}
	if n, ok := w.declaredLength(); w.overLength || ok && int64(w.body.Len()+len(p)) > n {
		w.overLength = true
		return 0, http.ErrContentLength // as net/http: no more than the Content-Length it declared
	}
	if w.body.Len()+len(p) > w.limit {
		w.tooBig = true
		return 0, fmt.Errorf("%w: the handler wrote more than %d bytes", idem.ErrResponseTooLarge, w.limit)
	}
	return w.body.Write(p)
}

func (w *bufferWriter) WriteString(s string) (int, error) {
	return w.Write([]byte(s))
}

// declaredLength is the Content-Length the handler set before
// WriteHeader, when it set a valid one.
func (w *bufferWriter) declaredLength() (int64, bool) {
	v := w.sent.Get("Content-Length")
	if v == "" {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	return n, err == nil && n >= 0
}

// result returns the status and header of the response as the handler
// left it (200 if it wrote nothing at all).
func (w *bufferWriter) result() (int, http.Header) {
	if w.status == 0 {
		return http.StatusOK, w.header
	}
	return w.status, w.sent
}

// bodyAllowed reports whether a response with status may carry a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}
