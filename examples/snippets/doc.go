// Package snippets holds the files that Go blocks of the repository's
// README.md and docs/ belong to, and the test that compiles every such block
// (TestDocsCompile).
//
// A Go block in the docs either is a whole file (it begins with its package
// clause, such as a full program) and compiles as it is, or names on its
// first line the file of this folder it belongs to:
//
//	// in: examples/snippets/http.go
//
// and compiles as part of that file, with its imports and helpers: as
// declarations when it holds only declarations, otherwise as the body of a
// function. The files here carry a build constraint that keeps them out of
// every build: each is compiled only by the test, once on its own and once
// with each block that names it, so their helpers (a pool, an authenticator)
// can have the names the docs use without colliding.
package snippets
