package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
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
	usage: "ui [--listen ADDR] [--prefix /PATH] [--read-only] [--operator NAME]",
	help: "Serves the operator's console (package idemui) against the database, until interrupted. It\n" +
		"needs credentials from the environment and refuses to start without them:\n" +
		"  " + envUIToken + "     a bearer token: \"Authorization: Bearer <token>\" for scripts (the operator is\n" +
		"                  --operator), or, in a browser, any user name with the token as password: the\n" +
		"                  operator is then that name marked as given with the token, \"dana" + tokenMark + "\"\n" +
		"  " + envUIUser + " and " + envUIPassword + "\n" +
		"                  basic authentication for one operator, named " + envUIUser + "\n" +
		"Every change it makes is written to the audit trail (idem audit list). Serve it on a loopback\n" +
		"address, or behind TLS: basic authentication sends the password with every request.",
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		var o uiFlags
		fs.StringVar(&o.listen, "listen", "127.0.0.1:8081", "listen on the address `ADDR`")
		fs.StringVar(&o.prefix, "prefix", "", "serve the console under the `path` (such as /idem) instead of /")
		fs.BoolVar(&o.readOnly, "read-only", false, "show records, change nothing")
		operatorFlag(fs, &o.operator)
		return func(ctx context.Context, e *env, args []string) error { return serveUI(ctx, e, args, o) }
	},
}

type uiFlags struct {
	listen, prefix, operator string
	readOnly                 bool
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
		c.token = digest(token)
	}
	switch {
	case user != "" && password != "":
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
// passes the others on with their operator.
func (c *credentials) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		op := c.operator(r)
		if op == "" {
			w.Header().Set("WWW-Authenticate", `Basic realm="idem console", charset="UTF-8"`)
			http.Error(w, "authentication required", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), operatorKey{}, op)))
	})
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
	pool, err := e.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	h, err := idemui.New(idemui.Options{DB: pool, Prefix: o.prefix, ReadOnly: o.readOnly, Authorize: authorize})
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
	srv := &http.Server{Handler: creds.authenticate(mux), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
	fmt.Fprintf(e.stderr, "idem console on http://%s%s/ (read-only: %v); interrupt to stop\n", ln.Addr(), o.prefix, o.readOnly)
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
