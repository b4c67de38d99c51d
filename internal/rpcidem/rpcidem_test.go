package rpcidem

import (
	"bytes"
	"testing"

	"github.com/pgidem/idem"
)

// A refusal's stored status is never the reply's, whatever its code.
func TestHTTPStatusNeverReply(t *testing.T) {
	for code := uint32(0); code < 32; code++ {
		if s := HTTPStatus(code); s == StatusReply || s < 400 || s > 599 {
			t.Errorf("HTTPStatus(%d) = %d", code, s)
		}
	}
	if HTTPStatus(3) != 400 || HTTPStatus(5) != 404 || HTTPStatus(10) != 409 || HTTPStatus(14) != 503 {
		t.Error("HTTPStatus does not follow google.rpc.Code's mapping")
	}
}

// Binary values come back as they went in, from the padded form gRPC's
// side stores and the unpadded form connect-go sends.
func TestBinaryRoundTrip(t *testing.T) {
	for _, raw := range []string{"", "\x00", "\x00\xff", "\x00\xff\n", "any bytes \x01\x02"} {
		for _, stored := range []string{EncodeBinary(raw), stripPadding(EncodeBinary(raw))} {
			got, err := DecodeBinary(stored)
			if err != nil || got != raw {
				t.Errorf("DecodeBinary(%q) = %q, %v; want %q", stored, got, err, raw)
			}
		}
	}
	if _, err := DecodeBinary("not base64!"); err == nil {
		t.Error("DecodeBinary accepted a value that is not base64")
	}
	if !IsBinary("X-Trace-Bin") || IsBinary("x-binary") {
		t.Error("IsBinary")
	}
}

func stripPadding(s string) string { return string(bytes.TrimRight([]byte(s), "=")) }

// The fingerprint binds the version, the procedure and the request, each
// part apart from the others.
func TestFingerprint(t *testing.T) {
	a := Fingerprint("/p.S/M", []byte("req"))
	if a != idem.FingerprintParts([]byte("idemrpc/1"), []byte("/p.S/M"), []byte("req")) {
		t.Error("the fingerprint is not FingerprintParts(version, procedure, request)")
	}
	if a == Fingerprint("/p.S/Mr", []byte("eq")) || a == Fingerprint("/p.S/N", []byte("req")) || a == Fingerprint("/p.S/M", []byte("reQ")) {
		t.Error("fingerprints of different calls are equal")
	}
}
