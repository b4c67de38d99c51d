package idemhttp

import (
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"testing"

	"github.com/pgidem/idem"
)

// FuzzResponseWriter runs a sequence of ResponseWriter calls, decoded from
// the fuzzer's bytes, on the buffering writer a covered handler gets and on
// an httptest.ResponseRecorder, and checks that the buffer captures what the
// recorder saw: the status, the body, the header as of WriteHeader (and so
// the stored headers) and the errors of Write; and that what is sent to the
// client is that response with a Content-Length. The recorder is driven as
// net/http's server behaves where the two differ: 1xx codes are
// informational (the buffer drops them, as nothing reaches the client before
// the commit), a Write without WriteHeader is a 200 (the server, not the
// buffer, sniffs a Content-Type), a body (not an empty write) is refused
// after 204 and 304, an
// invalid code panics even after WriteHeader; and the buffer refuses a body
// over its limit.
func FuzzResponseWriter(f *testing.F) {
	f.Add([]byte{0, 0, 1, 4, 2, 3, 5, 4, 7, 0})
	f.Add([]byte{40, 3, 0, 3, 4, 4, 3, 1, 1, 2, 6, 0, 4, 5})
	f.Add([]byte{255, 3, 6, 4, 3, 0, 2, 4, 9, 1})
	f.Add([]byte{3, 4, 7, 4, 7, 4, 7, 5, 2})
	f.Add([]byte{10, 0, 1, 2, 3, 12, 4, 7, 6, 1, 0, 0, 3, 19})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) == 0 {
			return
		}
		limit := int(ops[0])
		base := http.Header{"X-Base": {"base"}, "Content-Type": {"text/plain"}}
		buf := newBufferWriter(base, limit)
		rec := httptest.NewRecorder()
		maps.Copy(rec.Header(), base.Clone())

		names := []string{"Content-Type", "Location", "X-A", "x-lower", "Content-Encoding", "X-Base"}
		codes := []int{200, 201, 204, 304, 100, 103, 101, 199, 302, 400, 422, 500, 599, 600, 999, 0, 42, 1000, -1}
		body := []byte("0123456789abcdefghijklmnopqrstuvwxyz")
		arg := func(i *int, n int) int {
			*i++
			if *i < len(ops) {
				return int(ops[*i]) % n
			}
			return 0
		}
		status, written, tooBig := 0, 0, false // the model
		for i := 1; i < len(ops); i++ {
			switch op := ops[i] % 8; op {
			case 0, 1:
				name, value := names[arg(&i, len(names))], "v"+strconv.Itoa(arg(&i, 3))
				if op == 0 {
					buf.Header().Set(name, value)
					rec.Header().Set(name, value)
				} else {
					buf.Header().Add(name, value)
					rec.Header().Add(name, value)
				}
			case 2:
				name := names[arg(&i, len(names))]
				buf.Header().Del(name)
				rec.Header().Del(name)
			case 3:
				code := codes[arg(&i, len(codes))]
				// An invalid code panics, even after the header was
				// written, as in net/http's server.
				invalid := code < 100 || code > 999
				if panicked := panics(func() { buf.WriteHeader(code) }); panicked != invalid {
					t.Fatalf("WriteHeader(%d): panicked %t", code, panicked)
				}
				if invalid {
					return // a panic ends the handler
				}
				if code >= 200 { // 1xx: informational
					rec.WriteHeader(code)
					if status == 0 {
						status = code
					}
				}
			case 4, 5:
				p := body[:arg(&i, len(body))]
				var n int
				var err error
				if op == 4 {
					n, err = buf.Write(p)
				} else {
					n, err = buf.WriteString(string(p)) // the io.StringWriter path
				}
				if status == 0 {
					status = 200
					rec.WriteHeader(200)
				}
				var want error
				switch {
				case tooBig:
					want = idem.ErrResponseTooLarge // sticky
				case len(p) == 0:
					// as net/http: no error, whatever the status
				case !bodyAllowedForStatus(status):
					want = http.ErrBodyNotAllowed
				case tooBig || written+len(p) > limit:
					tooBig, want = true, idem.ErrResponseTooLarge
				default:
					written += len(p)
					if _, err := rec.Write(p); err != nil {
						t.Fatal(err)
					}
				}
				if want == nil && (err != nil || n != len(p)) || want != nil && (!errors.Is(err, want) || n != 0) {
					t.Fatalf("Write of %d bytes = %d, %v; want %v", len(p), n, err, want)
				}
			case 6:
				// Change a value in place, as a handler holding the slice can.
				name := names[arg(&i, len(names))]
				if v := buf.Header()[name]; len(v) > 0 {
					v[0] = "changed"
				}
				if v := rec.Header()[name]; len(v) > 0 {
					v[0] = "changed"
				}
			case 7:
				// Set a header by a key that is not canonical.
				buf.Header()["x-raw"] = []string{"raw"}
				rec.Header()["x-raw"] = []string{"raw"}
			}
		}

		gotStatus, gotHeader := buf.result()
		res := rec.Result()
		if gotStatus != res.StatusCode {
			t.Fatalf("status %d, recorder %d", gotStatus, res.StatusCode)
		}
		if !slices.Equal(buf.body.Bytes(), rec.Body.Bytes()) {
			t.Fatalf("body %q, recorder %q", buf.body.Bytes(), rec.Body.Bytes())
		}
		if !maps.EqualFunc(gotHeader, res.Header, slices.Equal) {
			t.Fatalf("header %v, recorder %v", gotHeader, res.Header)
		}
		m := &middleware{stored: append(slices.Clone(defaultStoredHeaders), "X-A")}
		if stored, want := m.storedHeader(gotHeader, base), m.storedHeader(res.Header, base); !maps.EqualFunc(stored, want, slices.Equal) {
			t.Fatalf("stored header %v, recorder %v", stored, want)
		}
		if fmt.Sprint(base) != fmt.Sprint(http.Header{"X-Base": {"base"}, "Content-Type": {"text/plain"}}) {
			t.Fatalf("the handler changed the base header: %v", base)
		}
		if buf.tooBig != tooBig {
			t.Fatalf("tooBig %t, want %t", buf.tooBig, tooBig)
		}

		// What the client gets: the captured response with a
		// Content-Length.
		out := httptest.NewRecorder()
		writeBuffered(out, buf, "")
		wantHeader := res.Header.Clone()
		if bodyAllowedForStatus(res.StatusCode) {
			wantHeader.Set("Content-Length", strconv.Itoa(rec.Body.Len()))
		} else {
			wantHeader.Del("Content-Length")
		}
		if out.Code != res.StatusCode || !slices.Equal(out.Body.Bytes(), rec.Body.Bytes()) ||
			!maps.EqualFunc(out.Result().Header, wantHeader, slices.Equal) {
			t.Fatalf("sent %d %v %q; want %d %v %q", out.Code, out.Result().Header, out.Body.Bytes(),
				res.StatusCode, wantHeader, rec.Body.Bytes())
		}
	})
}

func bodyAllowedForStatus(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

func panics(fn func()) (panicked bool) {
	defer func() {
		if recover() != nil {
			panicked = true
		}
	}()
	fn()
	return false
}
