package main

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pgidem/idem/idemui"
)

// The environment variables that hold the console's credentials.
const (
	envUIToken    = "IDEM_UI_TOKEN"
	envUIUser     = "IDEM_UI_USER"
	envUIPassword = "IDEM_UI_PASSWORD"
)

// uiCommand is "idem ui": the operator's console, served on its own.
var uiCommand = command{
	usage: "ui [--listen ADDR] [--prefix /PATH] [--read-only] [--operator NAME] [--tls-cert FILE --tls-key FILE]",
	help: "Serves the operator's console (package idemui) against the database, until interrupted. It\n" +
		"needs credentials from the environment and refuses to start without them:\n" +
		"  " + envUIToken + "     a bearer token: \"Authorization: Bearer <token>\" for scripts (the operator is\n" +
		"                  --operator), or, in a browser, any user name with the token as password: the\n" +
		"                  operator is then that name marked as given with the token, \"dana" + tokenMark + "\"\n" +
		"  " + envUIUser + " and " + envUIPassword + "\n" +
		"                  basic authentication for one operator, named " + envUIUser + "\n" +
		"Each secret must be at least " + minSecretText + " bytes long. After " + failuresAllowedText + " failed sign-ins, a client\n" +
		"address is answered 429 for a while, longer at each further failure. Every change it makes is\n" +
		"written to the audit trail (idem audit list). Serve it on a loopback address, or with TLS\n" +
		"(--tls-cert and --tls-key): basic authentication sends the password with every request, and\n" +
		"idem ui warns when it listens beyond loopback without TLS.",
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		var o uiFlags
		fs.StringVar(&o.listen, "listen", "127.0.0.1:8081", "listen on the address `ADDR`")
		fs.StringVar(&o.prefix, "prefix", "", "serve the console under the `path` (such as /idem) instead of /")
		fs.BoolVar(&o.readOnly, "read-only", false, "show records, change nothing")
		fs.StringVar(&o.tlsCert, "tls-cert", "", "serve HTTPS with the certificate (PEM) in `FILE`; needs --tls-key")
		fs.StringVar(&o.tlsKey, "tls-key", "", "the private key (PEM) of --tls-cert, in `FILE`")
		operatorFlag(fs, &o.operator)
		return func(ctx context.Context, e *env, args []string) error { return serveUI(ctx, e, args, o) }
	},
}

type uiFlags struct {
	listen, prefix, operator string
	tlsCert, tlsKey          string
	readOnly                 bool
}

// minSecret is the shortest IDEM_UI_TOKEN or IDEM_UI_PASSWORD idem ui
// takes: a secret that anyone can guess protects nothing.
const (
	minSecret     = 16
	minSecretText = "16"
)

// checkSecret refuses a secret that is too short, or blank.
func checkSecret(name, v string) error {
	switch {
	case strings.TrimSpace(v) == "":
		return usagef("%s is blank: set a random secret of at least %d bytes (openssl rand -base64 24)", name, minSecret)
	case len(v) < minSecret:
		return usagef("%s is %d bytes long: it must be at least %d, or it can be guessed (openssl rand -base64 24 makes one)",
			name, len(v), minSecret)
	}
	return nil
}

// credentials are what idem ui accepts, from the environment.
type credentials struct {
	token          []byte // sha256 of IDEM_UI_TOKEN; nil when unset
	user, password []byte // sha256 of IDEM_UI_USER and IDEM_UI_PASSWORD; nil when unset
	userName       string
	tokenOperator  string // the operator of a bearer token
}

// credentialsFromEnv reads the credentials, and refuses to go on without
// any.
func credentialsFromEnv(tokenOperator string) (*credentials, error) {
	c := &credentials{tokenOperator: tokenOperator}
	token, user, password := os.Getenv(envUIToken), os.Getenv(envUIUser), os.Getenv(envUIPassword)
	if token != "" {
		if err := checkSecret(envUIToken, token); err != nil {
			return nil, err
		}
		c.token = digest(token)
	}
	switch {
	case user != "" && password != "":
		if err := checkSecret(envUIPassword, password); err != nil {
			return nil, err
		}
		c.user, c.password, c.userName = digest(user), digest(password), user
	case user != "" || password != "":
		return nil, usagef("set both %s and %s, or neither", envUIUser, envUIPassword)
	}
	if c.token == nil && c.user == nil {
		return nil, usagef("the console changes records: set %s (a bearer token), or %s and %s (basic authentication), first",
			envUIToken, envUIUser, envUIPassword)
	}
	if c.token != nil && strings.TrimSpace(tokenOperator) == "" {
		return nil, usagef("--operator is required with %s (the name of the user running idem is unknown): scripts that use the token act as it", envUIToken)
	}
	return c, nil
}

func digest(s string) []byte {
	d := sha256.Sum256([]byte(s))
	return d[:]
}

// equal reports whether s has the digest a (nil: unset, never equal), in
// time that does not depend on where they differ.
func equal(a []byte, s string) bool {
	return a != nil && subtle.ConstantTimeCompare(a, digest(s)) == 1
}

// tokenMark follows the name a person gives with the token in a browser:
// anyone with the token can give any name (IDEM_UI_USER's too), so the
// audit trail says the name was only claimed, under the token.
const tokenMark = " (token)"

// operator authenticates r and returns the operator's name, or "" when the
// request carries no valid credentials. Every comparison of a secret is
// made, whatever the others found, so that the time taken says nothing of
// which part was wrong.
func (c *credentials) operator(r *http.Request) string {
	if token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
		if equal(c.token, token) {
			return c.tokenOperator
		}
		return ""
	}
	user, password, ok := r.BasicAuth()
	if !ok || user == "" {
		return ""
	}
	userOK, passwordOK, tokenOK := equal(c.user, user), equal(c.password, password), equal(c.token, password)
	switch {
	case userOK && passwordOK:
		return c.userName
	case tokenOK:
		return user + tokenMark // a person in a browser, who names themself and gives the token
	}
	return ""
}

// operatorKey carries the authenticated operator to Authorize.
type operatorKey struct{}

// authenticate answers a request without valid credentials with 401 and a
// basic authentication challenge (which makes a browser ask for them), and
// passes the others on with their operator. A client address that failed
// too often is answered 429 until its wait is over (see failures). Every
// answer carries the console's security headers.
func (c *credentials) authenticate(next http.Handler, f *failures) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		idemui.SetSecurityHeaders(w.Header())
		addr := clientAddress(r)
		if wait := f.wait(addr, time.Now()); wait > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(int((wait+time.Second-1)/time.Second)))
			http.Error(w, "too many failed sign-ins from this address: try again later", http.StatusTooManyRequests)
			return
		}
		op := c.operator(r)
		if op == "" {
			if r.Header.Get("Authorization") != "" {
				f.fail(addr, time.Now())
			}
			w.Header().Set("WWW-Authenticate", `Basic realm="idem console", charset="UTF-8"`)
			http.Error(w, "authentication required", http.StatusUnauthorized)
			return
		}
		f.forget(addr)
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), operatorKey{}, op)))
	})
}

// clientAddress is the address a request came from (its TCP peer; a
// forwarding header is not trusted), as failures counts it: an IPv6
// address by its /64, the block one client usually holds whole (counted
// one by one, its addresses would each have their own failures).
func clientAddress(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	ip = ip.Unmap()
	if ip.Is4() {
		return ip.String()
	}
	return netip.PrefixFrom(ip.WithZone(""), 64).Masked().String()
}

// failures counts the failed sign-ins of each client address: after
// failuresAllowed of them, each further failure makes the address wait,
// twice as long as the last time, up to maxFailureWait. A sign-in that
// succeeds clears the address; one that is not tried (no credentials at
// all, as a browser's first request) counts nothing.
type failures struct {
	mu sync.Mutex
	m  map[string]*failure
}

type failure struct {
	n     int
	until time.Time // no request before this
	last  time.Time
}

const (
	failuresAllowed     = 5
	failuresAllowedText = "5"
	firstFailureWait    = time.Second
	maxFailureWait      = 5 * time.Minute
	// maxFailureAddresses bounds the memory: past it, the addresses not
	// held back are dropped first (see evict).
	maxFailureAddresses = 10000
)

func newFailures() *failures { return &failures{m: map[string]*failure{}} }

// wait is how long addr must still wait at now; 0 when it need not.
func (f *failures) wait(addr string, now time.Time) time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	if e, ok := f.m[addr]; ok && e.until.After(now) {
		return e.until.Sub(now)
	}
	return 0
}

// fail counts a failed sign-in of addr at now.
func (f *failures) fail(addr string, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	e, ok := f.m[addr]
	if !ok {
		if len(f.m) >= maxFailureAddresses {
			f.evict(now)
		}
		e = &failure{}
		f.m[addr] = e
	}
	if now.Sub(e.last) > maxFailureWait*2 {
		e.n = 0 // a long quiet: start again
	}
	e.n++
	e.last = now
	if e.n > failuresAllowed {
		wait := firstFailureWait << min(e.n-failuresAllowed-1, 20)
		e.until = now.Add(min(wait, maxFailureWait))
	}
}

// forget clears addr after a sign-in that succeeded.
func (f *failures) forget(addr string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.m, addr)
}

// evict makes room, down to half of maxFailureAddresses: it drops first
// the addresses not held back now, those with the fewest recent failures
// first, and only then, when every address is held back, those whose wait
// ends first. Failures from many addresses cannot push out one that is
// held back.
func (f *failures) evict(now time.Time) {
	type entry struct {
		addr string
		e    *failure
	}
	all := make([]entry, 0, len(f.m))
	for addr, e := range f.m {
		all = append(all, entry{addr, e})
	}
	recent := func(e *failure) int {
		if now.Sub(e.last) > maxFailureWait*2 {
			return 0 // a long quiet: fail starts again
		}
		return e.n
	}
	slices.SortFunc(all, func(a, b entry) int {
		ha, hb := a.e.until.After(now), b.e.until.After(now)
		switch {
		case ha != hb && ha:
			return 1
		case ha != hb:
			return -1
		case ha:
			return a.e.until.Compare(b.e.until)
		}
		if c := cmp.Compare(recent(a.e), recent(b.e)); c != 0 {
			return c
		}
		return a.e.last.Compare(b.e.last)
	})
	for _, x := range all[:max(len(all)-maxFailureAddresses/2, 0)] {
		delete(f.m, x.addr)
	}
}

// exposedWarning is what idem ui prints when it serves the console without
// TLS on an address other than loopback: "" when it does not.
func exposedWarning(addr net.Addr, tls bool) string {
	tcp, ok := addr.(*net.TCPAddr)
	if tls || !ok || tcp.IP.IsLoopback() {
		return ""
	}
	return fmt.Sprintf("warning: idem ui listens on %s, beyond loopback, without TLS: passwords and tokens cross the network in clear. "+
		"Serve it with --tls-cert and --tls-key, or on 127.0.0.1 behind a TLS proxy.\n", addr)
}

// authorize lets every authenticated operator do everything the console
// offers.
func authorize(r *http.Request, _ idemui.Action) (string, error) {
	op, _ := r.Context().Value(operatorKey{}).(string)
	if op == "" {
		return "", errors.New("not authenticated")
	}
	return op, nil
}

func serveUI(ctx context.Context, e *env, args []string, o uiFlags) error {
	if err := wantArgs(args, 0, "no arguments"); err != nil {
		return err
	}
	creds, err := credentialsFromEnv(o.operator)
	if err != nil {
		return err
	}
	var tlsConfig *tls.Config
	switch {
	case (o.tlsCert == "") != (o.tlsKey == ""):
		return usagef("--tls-cert and --tls-key go together")
	case o.tlsCert != "":
		cert, err := tls.LoadX509KeyPair(o.tlsCert, o.tlsKey)
		if err != nil {
			return usagef("--tls-cert and --tls-key: %v", err)
		}
		tlsConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	h, err := idemui.New(idemui.Options{DB: pool, Client: operatorClient, Prefix: o.prefix, ReadOnly: o.readOnly, Authorize: authorize})
	if err != nil {
		return usageError{err.Error()}
	}
	mux := http.NewServeMux()
	mux.Handle(o.prefix+"/", h)
	if o.prefix != "" {
		mux.Handle("/{$}", http.RedirectHandler(o.prefix+"/", http.StatusFound))
	}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: creds.authenticate(mux, newFailures()), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute,
		TLSConfig: tlsConfig}
	scheme := "http"
	if tlsConfig != nil {
		scheme = "https"
		ln = tls.NewListener(ln, tlsConfig)
	}
	fmt.Fprintf(e.stderr, "idem console on %s://%s%s/ (read-only: %v); interrupt to stop\n", scheme, ln.Addr(), o.prefix, o.readOnly)
	fmt.Fprint(e.stderr, exposedWarning(ln.Addr(), tlsConfig != nil))
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	return srv.Shutdown(shutdown)
}
