package relay

import (
	"bytes"
	"encoding/binary"
	"sync/atomic"
	"testing"
)

func msg(typ byte, body string) []byte {
	b := []byte{typ, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], uint32(4+len(body)))
	return append(b, body...)
}

// The parser finds the COMMIT acknowledgement wherever the stream is split,
// forwards everything before it and nothing of it.
func TestServerParserSplits(t *testing.T) {
	before := bytes.Join([][]byte{
		{'N'}, // reply to SSLRequest
		msg('R', "\x00\x00\x00\x00"),
		msg('Z', "I"),
		msg('C', "INSERT 0 1\x00"),
		msg('C', "COMMIT PREPARED\x00"),
		msg('D', "COMMIT\x00"), // a data row that looks like the tag
		msg('Z', "T"),
	}, nil)
	stream := append(append(append([]byte(nil), before...), msg('C', "COMMIT\x00")...), msg('Z', "I")...)
	for split := 1; split <= len(stream); split++ {
		var neg atomic.Int32
		neg.Store(1)
		p := &serverParser{negotiation: &neg}
		calls := 0
		var out []byte
		cut := false
		for rest := stream; len(rest) > 0 && !cut; {
			k := min(split, len(rest))
			var o []byte
			o, cut = p.feed(rest[:k], func() bool { calls++; return true })
			out = append(out, o...)
			rest = rest[k:]
		}
		if !cut || calls != 1 {
			t.Fatalf("split %d: cut %v after %d calls", split, cut, calls)
		}
		if !bytes.Equal(out, before) {
			t.Fatalf("split %d: forwarded %q, want %q", split, out, before)
		}
	}
}

// Not dropping forwards the stream unchanged; TLS accepted makes the rest
// opaque.
func TestServerParserPassThrough(t *testing.T) {
	stream := bytes.Join([][]byte{msg('C', "COMMIT\x00"), msg('Z', "I"), msg('C', "COMMIT\x00")}, nil)
	var neg atomic.Int32
	p := &serverParser{negotiation: &neg}
	calls := 0
	var out []byte
	for _, b := range stream {
		o, cut := p.feed([]byte{b}, func() bool { calls++; return false })
		if cut {
			t.Fatal("cut without being asked")
		}
		out = append(out, o...)
	}
	if !bytes.Equal(out, stream) || calls != 2 {
		t.Fatalf("forwarded %q with %d calls", out, calls)
	}

	neg.Store(1)
	p = &serverParser{negotiation: &neg}
	tls := append([]byte{'S'}, msg('C', "COMMIT\x00")...)
	o, cut := p.feed(tls, func() bool { t.Fatal("consulted inside TLS"); return true })
	if cut || !bytes.Equal(o, tls) {
		t.Fatalf("TLS stream: cut %v, forwarded %q", cut, o)
	}
}

func TestClientParserCountsNegotiation(t *testing.T) {
	req := func(code uint32) []byte {
		b := make([]byte, 8)
		binary.BigEndian.PutUint32(b, 8)
		binary.BigEndian.PutUint32(b[4:], code)
		return b
	}
	startup := []byte{0, 0, 0, 9, 0, 3, 0, 0, 0}
	stream := bytes.Join([][]byte{req(gssencRequestCode), req(sslRequestCode), startup, req(sslRequestCode)}, nil)
	var neg atomic.Int32
	c := &clientParser{negotiation: &neg}
	for _, b := range stream {
		c.feed([]byte{b})
	}
	if neg.Load() != 2 {
		t.Fatalf("counted %d negotiation requests, want 2 (none after startup)", neg.Load())
	}
}
