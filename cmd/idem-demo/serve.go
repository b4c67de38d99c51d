package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/demo/draw"
	"github.com/pgidem/idem/internal/testkit/pgserver"
)

// The users serve knows: the bearer token is the user name.
var demoUsers = []struct {
	name   string
	points int64
}{{draw.SeedUser, draw.SeedPoints}, {"bob", 300}}

// serveConfig is what the serve flags set.
type serveConfig struct {
	addr     string
	database string
	seed     uint64
	// keep: a restart, on the tables of the last run or serve.
	keep bool
	// lease and resumeWithin are the payments' (see payments).
	lease, resumeWithin time.Duration
}

func parseServeFlags(args []string, errOut io.Writer) (serveConfig, error) {
	var cfg serveConfig
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(errOut)
	fs.StringVar(&cfg.addr, "addr", "127.0.0.1:8080", "loopback `address` to listen on (port 0 picks a free one)")
	fs.StringVar(&cfg.database, "db", defaultDatabase, "`name` of the demo's database: created if missing, its tables reset (idem, then [a-z0-9_])")
	fs.Uint64Var(&cfg.seed, "seed", 0, "seed for the prize picks, for repeatable sessions (0: random)")
	fs.BoolVar(&cfg.keep, "keep", false, "keep the tables of the last run or serve (payments in doubt, the gateway's charges) instead of resetting them: a restart")
	fs.DurationVar(&cfg.lease, "lease", defaultPaymentLease, "the `lease` of a payment: how long it may take before it counts as stuck")
	fs.DurationVar(&cfg.resumeWithin, "resume-within", defaultResumeWithin,
		"the `window` in which a payment in doubt resumes by itself (the gateway remembers keys 24h); 0: none, an operator settles it")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return cfg, err
		}
		return cfg, usageError{"serve: " + err.Error()}
	}
	if fs.NArg() > 0 {
		return cfg, usageError{fmt.Sprintf("serve: unexpected argument %q", fs.Arg(0))}
	}
	switch {
	case cfg.lease < time.Millisecond:
		return cfg, usageError{fmt.Sprintf("serve: -lease %s: at least 1ms", cfg.lease)}
	case cfg.resumeWithin != 0 && (cfg.resumeWithin < cfg.lease || cfg.resumeWithin > gatewayKeyTTL):
		return cfg, usageError{fmt.Sprintf("serve: -resume-within %s: 0, or from the lease (%s) to the %s the gateway remembers keys",
			cfg.resumeWithin, cfg.lease, gatewayKeyTTL)}
	}
	if err := checkLoopback(cfg.addr); err != nil {
		return cfg, usageError{err.Error()}
	}
	return cfg, checkDatabaseName(cfg.database)
}

// checkLoopback refuses addresses other than loopback ones: the demo's
// bearer tokens are user names, fine on one's own machine only.
func checkLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("serve: -addr %q: %w", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("serve: -addr %q: the demo listens on a loopback address only (127.0.0.1, ::1, localhost)", addr)
	}
	return nil
}

// serve prepares the demo database (see openDatabase), seeds it, and runs
// the draw API over HTTP, and the payments' recovery worker, until ctx is
// done; then it shuts the server down and returns nil. A payment that asks
// to crash after the charge (X-Demo-Crash: after-charge) kills the process
// there (SIGKILL; exit status 3 where there is none).
func serve(ctx context.Context, out io.Writer, cfg serveConfig) error {
	srv, err := pgserver.Resolve(ctx)
	if err != nil {
		return err
	}
	defer srv.Close()
	db, err := openDatabase(ctx, srv, cfg.database, out, cfg.keep)
	if err != nil {
		return err
	}
	defer db.Close()
	pool := db.pool
	for _, u := range demoUsers[1:] {
		if err := draw.AddWallet(ctx, pool, u.name, u.points); err != nil {
			return err
		}
	}
	if err := setupPayments(ctx, pool); err != nil {
		return err
	}

	ln, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	log := slog.New(slog.NewTextHandler(out, nil))
	pay := newPayments(pool, newGateway(pool))
	defer pay.gw.close()
	pay.lease, pay.resumeWithin = cfg.lease, cfg.resumeWithin
	pay.stop = func() {
		fmt.Fprintln(out, "Killed after the charge, before Complete, as asked (X-Demo-Crash: after-charge). Start again with -keep.")
		killSelf()
	}
	api := newAPI(pool, pay, newPicker(cfg.seed), log)
	httpSrv := &http.Server{Handler: api, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- httpSrv.Serve(ln) }()
	workerCtx, stopWorker := context.WithCancel(ctx)
	worker := make(chan struct{})
	go func() { defer close(worker); pay.recoverLoop(workerCtx, log) }()
	defer func() { stopWorker(); <-worker }()
	// The payments' events, delivered as webhooks to the demo's receiver.
	rc, err := newReceiver(ctx, pool)
	if err != nil {
		return err
	}
	defer rc.close()
	stopRelay, err := startRelay(ctx, pool, rc)
	if err != nil {
		return err
	}
	defer stopRelay()

	base := "http://" + ln.Addr().String()
	tables := "its tables reset"
	if cfg.keep {
		tables = "its tables kept"
	}
	fmt.Fprintf(out, "PostgreSQL from %s; database %s (%s)\n", srv.Source, cfg.database, tables)
	fmt.Fprintf(out, "Serving the draw API on %s (Ctrl-C to stop)\n\n", base)
	fmt.Fprintf(out, "Users (the bearer token is the name): %s; box %d costs %d points a draw.\n\n",
		userList(), draw.SeedBoxID, draw.SeedPrice)
	fmt.Fprintf(out, "Draw twice (run it again: the same response, with Idempotent-Replayed: true):\n"+
		"  curl -si %s/v1/draws -H 'Authorization: Bearer alice' \\\n"+
		"    -H 'Idempotency-Key: %s' -H 'Content-Type: application/json' \\\n"+
		"    -d '{\"box_id\":1,\"quantity\":2}'\n", base, newKey())
	fmt.Fprintf(out, "A duplicate of a draw still running (add -H '%s: 6s' to the first) gets 202 Accepted and a %s URL to poll.\n",
		headerDelay, statusPath)
	fmt.Fprintf(out, "See the wallet:\n  curl -s %s/v1/wallets/alice -H 'Authorization: Bearer alice'\n\n", base)
	fmt.Fprintf(out, "Pay through the card gateway (add -H 'X-Demo-Gateway: reply-lost', timeout-after-charge or unavailable\n"+
		"for a gateway that misbehaves, -H 'X-Demo-Crash: after-charge' to stop this process dead after the charge):\n"+
		"  curl -si %s/v1/payments -H 'Authorization: Bearer alice' \\\n"+
		"    -H 'Idempotency-Key: %s' -H 'Content-Type: application/json' \\\n"+
		"    -d '{\"customerId\":\"cus-1\",\"amountCents\":12000,\"currency\":\"KRW\"}'\n", base, newKey())
	fmt.Fprintf(out, "Each payment publishes payment.succeeded; a relay delivers it as a webhook to the demo's receiver on %s\n"+
		"(processed once per webhook-id; see them with: idem events list -destination %s).\n", rc.srv.URL, billingDestination)
	if cfg.resumeWithin > 0 {
		fmt.Fprintf(out, "A payment in doubt resumes for %s (the gateway remembers keys 24h): the client's retry with the same key,\n"+
			"or the recovery worker once its %s lease has run out (after a crash: start again with -keep), sends it again.\n", cfg.resumeWithin, cfg.lease)
	}
	fmt.Fprintf(out, "Reconcile unknown payments (operator):\n  curl -s %s/v1/admin/unknown -H 'Authorization: Bearer operator'\n"+
		"  curl -s %s/v1/admin/resolve -H 'Authorization: Bearer operator' -d '{\"actor\":\"alice\",\"key\":\"<key>\"}'\n"+
		"  or in a browser, the operator's console: %s%s/ (any user name, the password operator)\n\n", base, base, base, consolePrefix)

	select {
	case err := <-served:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	fmt.Fprintln(out, "Shutting down.")
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := httpSrv.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("serve: shutdown: %w", err)
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}

func userList() string {
	var parts []string
	for _, u := range demoUsers {
		parts = append(parts, fmt.Sprintf("%s (%d points)", u.name, u.points))
	}
	return strings.Join(parts, ", ")
}

// newKey returns a random UUID (version 4), the kind of key a client sends.
func newKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// newPicker returns the intn function the draws pick prizes with: seeded
// and safe for concurrent use, or math/rand/v2's IntN for seed 0.
func newPicker(seed uint64) func(int) int {
	if seed == 0 {
		return mrand.IntN
	}
	var mu sync.Mutex
	r := mrand.New(mrand.NewPCG(seed, seed))
	return func(n int) int {
		mu.Lock()
		defer mu.Unlock()
		return r.IntN(n)
	}
}

// bearerUser is the demo's authentication: "Authorization: Bearer <user>"
// for a known user.
func bearerUser(r *http.Request) (string, error) {
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return "", errors.New("no bearer token")
	}
	for _, u := range demoUsers {
		if token == u.name {
			return token, nil
		}
	}
	return "", errors.New("unknown token")
}

// statusPath is the status URL of the draws: a duplicate of a draw still
// running gets 202 Accepted with its Location.
const statusPath = "/v1/idempotency"

// headerDelay names the request header that makes a draw hold its key
// before it answers (a Go duration up to maxDelay): time to send a
// duplicate and see 202 Accepted.
const (
	headerDelay = "X-Demo-Delay"
	maxDelay    = 10 * time.Second
)

// newAPI returns the draw API:
//
//	POST /v1/draws           {"box_id":1,"quantity":2}, with Idempotency-Key
//	                         (and X-Demo-Delay: a duration, to keep it running)
//	GET  /v1/idempotency     ?key=K&operation=O: idemhttp's status URL
//	GET  /v1/wallets/{user}  the user's points and prizes (own wallet only)
//
// the payment routes of registerPayments (pay's), and the operator's
// console under /idem/ (newConsole). Every error but the console's is
// application/problem+json, including the 404 and 405 of requests that match
// no route.
func newAPI(pool *pgxpool.Pool, pay *payments, intn func(int) int, log *slog.Logger) http.Handler {
	idempotent := idemhttp.Middleware(pool, idemhttp.Options{Actor: bearerUser, Logger: log, StatusURL: statusPath})
	mux := http.NewServeMux()
	mux.Handle("GET "+statusPath, idemhttp.StatusHandler(pool, idemhttp.StatusOptions{Actor: bearerUser, Logger: log}))
	mux.Handle("POST /v1/draws", idempotent(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, _ := bearerUser(r) // the middleware has authenticated the request
		delay, ok := demoDelay(r.Header)
		if !ok {
			idemhttp.Invalid(r.Context())
			writeResponse(w, draw.Problem(http.StatusBadRequest, draw.CodeInvalidRequest,
				fmt.Sprintf("%s must be a duration from 1ms to %s, such as 6s.", headerDelay, maxDelay)))
			return
		}
		body, _ := io.ReadAll(r.Body)
		req, err := draw.ParseRequest(body)
		if err != nil {
			// Not stored: the client corrects the body and sends it
			// again with the same key, and the draw runs.
			idemhttp.Invalid(r.Context())
			reason := "The body is not a valid draw request."
			if invalid, ok := errors.AsType[*draw.RequestError](err); ok {
				reason = invalid.Reason
			}
			writeResponse(w, draw.Problem(http.StatusUnprocessableEntity, draw.CodeInvalidRequest, reason))
			return
		}
		// A refusal comes back as its 4xx response; the middleware then
		// rolls back what Attempt wrote and stores the refusal.
		resp, err := draw.Attempt(r.Context(), idemhttp.Tx(r.Context()), user, req, intn)
		if err == nil && delay > 0 {
			// The key stays claimed, uncommitted, meanwhile.
			select {
			case <-time.After(delay):
			case <-r.Context().Done():
				err = r.Context().Err()
			}
		}
		if err != nil {
			log.Error("draw failed", "error", err)
			writeResponse(w, draw.Problem(http.StatusInternalServerError, "INTERNAL_ERROR", "The draw failed; nothing was charged."))
			return
		}
		writeResponse(w, resp)
	})))
	mux.HandleFunc("GET /v1/wallets/{user}", func(w http.ResponseWriter, r *http.Request) {
		user, err := bearerUser(r)
		switch {
		case err != nil:
			writeResponse(w, draw.Problem(http.StatusUnauthorized, "UNAUTHENTICATED", "Send Authorization: Bearer <user>."))
			return
		case user != r.PathValue("user"):
			writeResponse(w, draw.Problem(http.StatusForbidden, "FORBIDDEN", "You can only read your own wallet."))
			return
		}
		wallet, err := draw.ReadWallet(r.Context(), pool, user)
		if err != nil {
			log.Error("read wallet failed", "error", err)
			writeResponse(w, draw.Problem(http.StatusServiceUnavailable, "STORE_UNAVAILABLE", "The wallet could not be read."))
			return
		}
		body, _ := json.Marshal(wallet)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(body)
	})
	registerPayments(mux, pay, log)
	mux.Handle(consolePrefix+"/", newConsole(pool))
	return unroutedProblems(mux)
}

// demoDelay reads the X-Demo-Delay header: 0 when it is absent, false
// when it is not a duration from 1ms to maxDelay.
func demoDelay(h http.Header) (time.Duration, bool) {
	v := h.Get(headerDelay)
	if v == "" {
		return 0, true
	}
	d, err := time.ParseDuration(v)
	return d, err == nil && d >= time.Millisecond && d <= maxDelay
}

// unroutedProblems answers the requests that match no route of mux with a
// problem (404 NOT_FOUND, or 405 METHOD_NOT_ALLOWED with mux's Allow
// header) instead of mux's text/plain ones.
func unroutedProblems(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, pattern := mux.Handler(r)
		if pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		// Let mux's own answer tell 404 from 405, and which methods the
		// path takes.
		var probe statusProbe
		h.ServeHTTP(&probe, r)
		if probe.status == http.StatusMethodNotAllowed {
			allow := probe.header.Get("Allow")
			w.Header().Set("Allow", allow)
			writeResponse(w, draw.Problem(http.StatusMethodNotAllowed, "METHOD_NOT_ALLOWED",
				fmt.Sprintf("%s does not take %s; it takes %s.", r.URL.Path, r.Method, allow)))
			return
		}
		writeResponse(w, draw.Problem(http.StatusNotFound, "NOT_FOUND", "No such endpoint."))
	})
}

// statusProbe is a ResponseWriter that keeps the status and header of a
// response and drops its body.
type statusProbe struct {
	header http.Header
	status int
}

func (p *statusProbe) Header() http.Header {
	if p.header == nil {
		p.header = http.Header{}
	}
	return p.header
}

func (p *statusProbe) WriteHeader(status int) {
	if p.status == 0 {
		p.status = status
	}
}

func (p *statusProbe) Write(b []byte) (int, error) {
	p.WriteHeader(http.StatusOK)
	return len(b), nil
}

func writeResponse(w http.ResponseWriter, resp idem.Response) {
	for name, values := range resp.Header {
		w.Header()[name] = values
	}
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
}
