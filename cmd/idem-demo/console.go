package main

import (
	"errors"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/idemui"
)

// consolePrefix is where serve mounts the operator's console.
const consolePrefix = "/idem"

// newConsole returns the operator's console (package idemui) for the
// demo's operator: "Authorization: Bearer operator" as the operator routes
// take it (the operator is then named "operator"), or, in a browser, any
// user name with the password "operator" (the name goes into the audit
// trail). A request with no credentials gets a basic-authentication
// challenge, which makes a browser ask for them.
func newConsole(pool *pgxpool.Pool) http.Handler {
	h, err := idemui.New(idemui.Options{DB: pool, Prefix: consolePrefix, Authorize: consoleOperator})
	if err != nil {
		panic(err) // the options are fixed
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") == "" {
			idemui.SetSecurityHeaders(w.Header())
			w.Header().Set("WWW-Authenticate", `Basic realm="idem demo console", charset="UTF-8"`)
			http.Error(w, "the console needs the operator's token: Bearer "+demoOperator+
				", or any user name with the password "+demoOperator, http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// consoleOperator is the console's Authorize: the demo's operator may do
// everything the console offers.
func consoleOperator(r *http.Request, _ idemui.Action) (string, error) {
	if r.Header.Get("Authorization") == "Bearer "+demoOperator {
		return demoOperator, nil
	}
	if user, password, ok := r.BasicAuth(); ok && user != "" && password == demoOperator {
		return user, nil
	}
	return "", errors.New("not the demo's operator")
}
