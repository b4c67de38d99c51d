// Package idemhttp is net/http middleware that makes POST and PATCH
// requests idempotent by their Idempotency-Key header
// (draft-ietf-httpapi-idempotency-key-header), with the handler's own
// database writes in the same PostgreSQL transaction as the key and the
// stored response.
//
//	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: userFromToken})
//	mux.Handle("POST /v1/orders", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
//		tx := idemhttp.Tx(r.Context()) // writes here commit with the key and the response
//		...
//	})))
//
// A client sends a new key (a UUID, say) with each new intent and the same
// key with every retry of it. The first request runs the handler; the
// response is written to the client only after everything committed. A
// retry gets the stored response back with Idempotent-Replayed: true and the
// handler does not run; the same key with a different body gets 422, and a
// retry that arrives while the first request still runs waits briefly, then
// gets 409 with Retry-After. 2xx and 3xx responses commit the handler's
// writes; 4xx refusals are stored but undo the handler's writes; 5xx and
// panics store nothing, so a retry runs again. See Middleware for the
// details and Options for the knobs.
//
// A request the handler refuses as invalid before acting on it (a body that
// does not parse or validate) is not stored either, when the handler says
// so with Invalid: the client corrects the request and sends it again with
// the same key, and it runs.
//
//	req, err := parseOrder(body)
//	if err != nil {
//		idemhttp.Invalid(r.Context()) // not stored: the key stays free
//		http.Error(w, "The order needs an item.", http.StatusBadRequest)
//		return
//	}
//
// A duplicate of a request in flight can get 202 Accepted instead of 409,
// with Retry-After and the Location of a status URL (Options.StatusURL),
// which StatusHandler serves: 202 while the request runs, then its stored
// response, and only ever to the actor who sent it.
//
//	mux.Handle("GET /v1/idempotency", idemhttp.StatusHandler(pool, idemhttp.StatusOptions{Actor: userFromToken}))
//	mw := idemhttp.Middleware(pool, idemhttp.Options{Actor: userFromToken, StatusURL: "/v1/idempotency"})
//
// Services on database/sql (pgx's stdlib driver, lib/pq, or an ORM over
// them) use MiddlewareSQL and StatusHandlerSQL on a *sql.DB instead: the
// same requests, outcomes and answers, kept by package idemsql, with the
// handler's transaction a *sql.Tx from TxSQL.
//
//	mw := idemhttp.MiddlewareSQL(db, idemhttp.Options{Actor: userFromToken})
//	mux.Handle("POST /v1/orders", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
//		tx := idemhttp.TxSQL(r.Context()) // *sql.Tx
//		...
//	})))
//
// The layers a request goes through:
//
//	idemhttp               this package: keys, bodies, answers (an adapter)
//	idem, idemsql          the public fronts: DoInTx on a pgx pool or a *sql.DB
//	the core               the protocol (claim, store, replay) and its drivers
//
// The middleware asks the front, never the database, and never holds the
// handler's transaction: the front puts it in the request's context, where
// only Tx or TxSQL read it.
//
// The client side is Transport, an http.RoundTripper: it sends one
// Idempotency-Key with every attempt of a call (the context's call key,
// idem.WithCallKey, or one it mints once per call) and retries what another
// attempt may fix (see docs/calling.md in the repository).
//
// Run idem.Migrate (or idemsql.Migrate) once before use.
package idemhttp
