// Package ent is the code ent generates for the examples' schema
// (./schema), committed. Regenerate with go generate ./ent in the examples
// module.
package ent

//go:generate env GOWORK=off go run -mod=mod entgo.io/ent/cmd/ent generate ./schema
