// Package relay is an in-process TCP relay between a PostgreSQL client and
// server, for tests and benchmarks: it adds latency and injects connection
// faults on the loopback interface.
//
// A relay listens on 127.0.0.1 on a free port and, for every connection it
// accepts, dials the target and copies bytes both ways. Options add a fixed
// one-way delay and a fault that cuts a connection after a COMMIT has been
// acknowledged by the server but before the client receives the
// acknowledgement (the commit happened; the client cannot know).
//
// To recognise that acknowledgement the relay follows the PostgreSQL wire
// protocol (version 3) in the server-to-client direction: the replies to
// SSLRequest / GSSENCRequest (one byte each), then typed messages (a type
// byte and a length). A connection that negotiates TLS or GSS encryption is
// relayed as opaque bytes, and the commit fault never fires on it; use
// sslmode=disable (the relay is loopback only anyway).
package relay

import (
	"encoding/binary"
	"errors"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Options configure a Relay. The zero value relays bytes unchanged.
type Options struct {
	// Delay is added to every chunk of bytes in each direction: a chunk
	// read at time t is written at t+Delay. Chunks are not serialized
	// behind each other's delay (latency, not bandwidth), so a round trip
	// through the relay costs about 2*Delay more. Zero forwards at once.
	Delay time.Duration

	// DropAfterCommit, if set, is consulted each time the server sends a
	// CommandComplete message with the tag "COMMIT" (the acknowledgement
	// of a successful COMMIT or END). If it returns true, the relay
	// forwards the bytes that came before that message, then closes both
	// sides of the connection: the server has committed, the client never
	// sees the acknowledgement (nor any part of it) and gets a connection
	// error instead. It is called from the relay's goroutines, possibly
	// concurrently for different connections.
	DropAfterCommit func() bool
}

// Relay is a running relay. Its methods are safe for concurrent use.
type Relay struct {
	ln     net.Listener
	target string
	opts   Options

	mu     sync.Mutex
	links  map[*link]struct{}
	closed bool
	wg     sync.WaitGroup

	commitsCut atomic.Int64
	accepted   atomic.Int64
}

// Start listens on 127.0.0.1 on a free port and relays every connection it
// accepts to target (host:port) until Close.
func Start(target string, opts Options) (*Relay, error) {
	if opts.Delay < 0 {
		return nil, errors.New("relay: negative Delay")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &Relay{ln: ln, target: target, opts: opts, links: map[*link]struct{}{}}
	r.wg.Add(1)
	go r.accept()
	return r, nil
}

// Addr is the address the relay listens on, as host:port.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

// CommitsCut is the number of connections cut by DropAfterCommit so far.
func (r *Relay) CommitsCut() int64 { return r.commitsCut.Load() }

// Accepted is the number of client connections accepted so far.
func (r *Relay) Accepted() int64 { return r.accepted.Load() }

// CutAll closes every connection relayed at this moment, both sides, without
// forwarding bytes still delayed. The relay keeps accepting new ones.
func (r *Relay) CutAll() {
	r.mu.Lock()
	links := make([]*link, 0, len(r.links))
	for l := range r.links {
		links = append(links, l)
	}
	r.mu.Unlock()
	for _, l := range links {
		l.close()
	}
}

// Close stops listening, cuts every connection and waits until all the
// relay's goroutines have returned. Calling it again does nothing.
func (r *Relay) Close() error {
	r.mu.Lock()
	was := r.closed
	r.closed = true
	r.mu.Unlock()
	var err error
	if !was {
		err = r.ln.Close()
	}
	r.CutAll()
	r.wg.Wait()
	return err
}

func (r *Relay) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return // listener closed
		}
		r.accepted.Add(1)
		r.wg.Add(1)
		go r.serve(c)
	}
}

// serve dials the target for client c and relays until either side ends.
func (r *Relay) serve(client net.Conn) {
	defer r.wg.Done()
	server, err := net.DialTimeout("tcp", r.target, 10*time.Second)
	if err != nil {
		_ = client.Close()
		return
	}
	l := &link{client: client, server: server, done: make(chan struct{})}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		l.close()
		return
	}
	r.links[l] = struct{}{}
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.links, l)
		r.mu.Unlock()
	}()

	var negotiation atomic.Int32 // one-byte replies the server owes
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		up := &clientParser{negotiation: &negotiation}
		r.pump(l, client, server, func(p []byte) ([]byte, bool) {
			up.feed(p)
			return p, false
		})
	}()
	go func() {
		defer wg.Done()
		down := &serverParser{negotiation: &negotiation}
		r.pump(l, server, client, func(p []byte) ([]byte, bool) {
			if r.opts.DropAfterCommit == nil {
				return p, false
			}
			out, cut := down.feed(p, r.opts.DropAfterCommit)
			if cut {
				r.commitsCut.Add(1)
			}
			return out, cut
		})
	}()
	wg.Wait()
}

// chunk is a piece of the byte stream on its way through the relay.
type chunk struct {
	data []byte
	due  time.Time
	cut  bool // close the link once data is written
}

// pump copies src to dst through filter, which returns the bytes to forward
// and whether to cut the link after them. With a Delay, a second goroutine
// writes each chunk when it is due. When src ends, the bytes already read
// are still delivered, then the whole link closes.
func (r *Relay) pump(l *link, src, dst net.Conn, filter func([]byte) ([]byte, bool)) {
	delay := r.opts.Delay
	var queue chan chunk
	var writer sync.WaitGroup
	if delay > 0 {
		queue = make(chan chunk, 1024)
		writer.Add(1)
		go func() {
			defer writer.Done()
			defer l.close()
			for c := range queue {
				if d := time.Until(c.due); d > 0 {
					select {
					case <-time.After(d):
					case <-l.done:
						return
					}
				}
				if len(c.data) > 0 {
					if _, err := dst.Write(c.data); err != nil {
						return
					}
				}
				if c.cut {
					return
				}
			}
		}()
	}

	buf := make([]byte, 32*1024)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			out, cut := filter(buf[:n])
			if queue == nil {
				if len(out) > 0 {
					if _, werr := dst.Write(out); werr != nil {
						break
					}
				}
				if cut {
					break
				}
			} else {
				c := chunk{data: append([]byte(nil), out...), due: time.Now().Add(delay), cut: cut}
				select {
				case queue <- c:
				case <-l.done:
				}
				if cut {
					break
				}
			}
		}
		if err != nil {
			break
		}
	}
	if queue != nil {
		close(queue)
		writer.Wait()
	}
	l.close()
}

// link is one relayed connection: the client side and the server side.
type link struct {
	client, server net.Conn
	once           sync.Once
	done           chan struct{}
}

func (l *link) close() {
	l.once.Do(func() {
		close(l.done)
		_ = l.client.Close()
		_ = l.server.Close()
	})
}

// Codes of the untyped requests a client may send before its startup
// message; the server answers each with a single byte.
const (
	sslRequestCode    = 80877103
	gssencRequestCode = 80877104
)

// clientParser follows the client's untyped startup-phase messages and
// counts the SSLRequest and GSSENCRequest messages, each of which the server
// answers with a single byte that is not a typed message. It stops at the
// first other message (the startup message or a cancel request).
type clientParser struct {
	negotiation *atomic.Int32
	done        bool
	head        [8]byte
	n           int
}

func (c *clientParser) feed(p []byte) {
	for len(p) > 0 && !c.done {
		k := copy(c.head[c.n:], p)
		c.n += k
		p = p[k:]
		if c.n < len(c.head) {
			return
		}
		length := binary.BigEndian.Uint32(c.head[0:4])
		code := binary.BigEndian.Uint32(c.head[4:8])
		if length != 8 || (code != sslRequestCode && code != gssencRequestCode) {
			c.done = true
			return
		}
		c.negotiation.Add(1)
		c.n = 0
	}
}

// serverParser splits the server's byte stream into messages and finds the
// CommandComplete messages tagged COMMIT. Bytes of a CommandComplete are
// held back until the message is complete, so a cut never lets part of an
// acknowledgement through.
type serverParser struct {
	negotiation *atomic.Int32
	opaque      bool    // encrypted: no longer parsed
	head        [5]byte // type byte and length of the current message
	n           int     // bytes of head filled
	remain      int     // body bytes of the current message still to come
	held        []byte  // a CommandComplete in progress
	out         []byte
}

var commitTag = []byte("COMMIT\x00")

// feed consumes p and returns the bytes to forward now and whether to cut
// the connection after them (drop said so for a COMMIT acknowledgement).
func (s *serverParser) feed(p []byte, drop func() bool) ([]byte, bool) {
	if s.opaque {
		return p, false
	}
	s.out = s.out[:0]
	for len(p) > 0 {
		if s.opaque {
			s.out = append(s.out, p...)
			break
		}
		if s.n == 0 && s.remain == 0 && s.negotiation.Load() > 0 {
			// A reply to SSLRequest or GSSENCRequest: 'S' or 'G' means
			// encryption follows; 'N' means go on in plain text.
			s.negotiation.Add(-1)
			if p[0] != 'N' {
				s.opaque = true
			}
			s.out = append(s.out, p[0])
			p = p[1:]
			continue
		}
		if s.n < len(s.head) {
			k := copy(s.head[s.n:], p)
			s.emit(p[:k])
			s.n += k
			p = p[k:]
			if s.n < len(s.head) {
				break
			}
			length := int(int32(binary.BigEndian.Uint32(s.head[1:5])))
			if length < 4 {
				s.opaque = true // not a protocol we understand: stop looking
				s.out = append(s.out, s.held...)
				s.held = s.held[:0]
				continue
			}
			s.remain = length - 4
		} else {
			k := min(s.remain, len(p))
			s.emit(p[:k])
			s.remain -= k
			p = p[k:]
		}
		if s.remain > 0 {
			continue
		}
		// One whole message has passed.
		s.n = 0
		if s.head[0] != 'C' {
			continue
		}
		isCommit := len(s.held) == len(s.head)+len(commitTag) && string(s.held[len(s.head):]) == string(commitTag)
		if isCommit && drop() {
			s.held = s.held[:0]
			s.opaque = true
			return s.out, true
		}
		s.out = append(s.out, s.held...)
		s.held = s.held[:0]
	}
	return s.out, false
}

// emit routes bytes of the current message: held back if it is a
// CommandComplete, forwarded otherwise.
func (s *serverParser) emit(b []byte) {
	if s.head[0] == 'C' {
		s.held = append(s.held, b...)
	} else {
		s.out = append(s.out, b...)
	}
}

// Target returns the host:port of the server a PostgreSQL connection string
// (URL or key=value form) points at, to pass to Start.
func Target(connString string) (string, error) {
	cfg, err := pgconn.ParseConfig(connString)
	if err != nil {
		return "", err
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), nil
}

// ConnString returns connString (a postgres:// URL with one host) pointed at
// the relay instead of its server, with sslmode=disable so that the relay
// can follow the protocol.
func (r *Relay) ConnString(connString string) (string, error) {
	u, err := url.Parse(connString)
	if err != nil {
		return "", err
	}
	if (u.Scheme != "postgres" && u.Scheme != "postgresql") || strings.Contains(u.Host, ",") {
		return "", errors.New("relay: ConnString needs a postgres:// URL with one host")
	}
	u.Host = r.Addr()
	q := u.Query()
	q.Set("sslmode", "disable")
	u.RawQuery = q.Encode()
	return u.String(), nil
}
