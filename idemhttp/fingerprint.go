package idemhttp

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"maps"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/pgidem/idem"
)

// DefaultFingerprint is the fingerprint the middleware uses when
// Options.Fingerprint is nil. It binds the request method, the escaped path,
// the query and the body:
//   - a JSON body (Content-Type application/json or any +json type) counts
//     by its canonical form (idem.FingerprintJSON): whitespace, member
//     order, escapes and the spelling of numbers do not matter, every value
//     does, each number by its exact decimal value;
//   - a form body (application/x-www-form-urlencoded) counts by its fields
//     sorted by name, values of one name in the order sent, re-encoded;
//   - any other body, and a JSON or form body that does not parse (for
//     JSON: also invalid UTF-8 or a duplicate member name), counts as its
//     raw bytes. That includes multipart/form-data: a client that
//     encodes the same form again with a new boundary sends a different
//     request (422); give such routes an Options.Fingerprint of their own.
//
// The body counts by the Content-Type the client declared: JSON sent as a
// form (curl -d without -H) is fingerprinted as form fields.
//
// A form whose body was parsed before the middleware read it (an outer
// middleware called r.FormValue or r.ParseMultipartForm, which consume the
// body) counts by the parsed form instead, r.PostForm as above, or
// r.MultipartForm by its fields and files (name, Content-Type, content)
// sorted by name, whatever the boundary: the body the middleware reads is
// then empty. (A multipart body an outer middleware streamed through
// r.MultipartReader, or a parsed file that cannot be opened again, leaves
// nothing to count: such requests share one fingerprint; give that route
// an Options.Fingerprint of its own.)
//
// The query is canonicalized like a form body. Headers, including
// Content-Type beyond the choice above, do not count. DefaultFingerprint
// never fails; the error is there to match Options.Fingerprint.
func DefaultFingerprint(r *http.Request, body []byte) (idem.Fingerprint, error) {
	kind, content := "raw", body
	mediaType, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch {
	case mediaType == "application/json" || strings.HasSuffix(mediaType, "+json"):
		if fp, err := idem.FingerprintJSON(body); err == nil {
			kind, content = "json", fp[:]
		}
	case mediaType == "application/x-www-form-urlencoded" && len(body) == 0 && r.PostForm != nil:
		// Parsed, and so consumed, before the middleware read the body.
		kind, content = "form", []byte(r.PostForm.Encode())
	case mediaType == "application/x-www-form-urlencoded":
		if form, err := url.ParseQuery(string(body)); err == nil {
			kind, content = "form", []byte(form.Encode())
		}
	case mediaType == "multipart/form-data" && len(body) == 0 && r.MultipartForm != nil:
		if fp, err := multipartFingerprint(r.MultipartForm); err == nil {
			kind, content = "multipart", fp[:]
		}
	}
	query := r.URL.RawQuery
	if q, err := url.ParseQuery(query); err == nil {
		query = q.Encode()
	}
	return idem.FingerprintParts(
		[]byte("idemhttp/1"),
		[]byte(r.Method),
		[]byte(r.URL.EscapedPath()),
		[]byte(query),
		[]byte(kind),
		content,
	), nil
}

// multipartFingerprint is the fingerprint of a parsed multipart form: its
// fields and files sorted by name, values and files of one name in the
// order sent, each file by its name, its Content-Type and its content.
func multipartFingerprint(form *multipart.Form) (idem.Fingerprint, error) {
	parts := [][]byte{[]byte("values")}
	for _, name := range slices.Sorted(maps.Keys(form.Value)) {
		values := form.Value[name]
		parts = append(parts, []byte(name), []byte(strconv.Itoa(len(values))))
		for _, v := range values {
			parts = append(parts, []byte(v))
		}
	}
	parts = append(parts, []byte("files"))
	for _, name := range slices.Sorted(maps.Keys(form.File)) {
		files := form.File[name]
		parts = append(parts, []byte(name), []byte(strconv.Itoa(len(files))))
		for _, fh := range files {
			f, err := fh.Open()
			if err != nil {
				return idem.Fingerprint{}, err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			_ = f.Close()
			if err != nil {
				return idem.Fingerprint{}, err
			}
			parts = append(parts, []byte(fh.Filename), []byte(fh.Header.Get("Content-Type")), h.Sum(nil))
		}
	}
	return idem.FingerprintParts(parts...), nil
}

// DefaultOperation is the operation name the middleware uses when
// Options.Operation is nil: the method and the route pattern that
// http.ServeMux matched ("POST /v1/items/{id}"), so every request of one
// route shares a key space and the path itself is part of the fingerprint.
//
// The pattern is known only when the middleware runs inside the mux, that
// is when each route is wrapped (mux.Handle("POST /v1/items",
// mw(handler))). When the middleware wraps the whole mux, r.Pattern is
// empty and the operation is the method and the escaped path instead
// ("POST /v1/items/42"): keys are then separate per path, and a request to
// an unknown path is stored like any other 4xx. An operation over 255 bytes
// is shortened to the method and a SHA-256 of the rest.
func DefaultOperation(r *http.Request) string {
	route := r.Pattern
	if route != "" {
		// A pattern may start with a method ("POST /x"); the request's own
		// method replaces it.
		if i := strings.IndexByte(route, ' '); i >= 0 {
			route = strings.TrimLeft(route[i+1:], " \t")
		}
	} else {
		route = r.URL.EscapedPath()
	}
	op := r.Method + " " + route
	if len(op) > idem.MaxScopeLength || !utf8.ValidString(op) || strings.IndexByte(op, 0) >= 0 {
		sum := sha256.Sum256([]byte(route))
		op = r.Method + " sha256:" + hex.EncodeToString(sum[:])
	}
	return op
}
