// Package examples shows idem's database/sql form (package idemsql) under
// the ORMs Go services use, each running idemsql.Do and idemsql.DoInTx on
// the ORM's own transaction: GORM, Bun, sqlx and ent. It is a module of its
// own, so that the ORMs stay out of the library's go.mod; its tests run in
// CI against a real PostgreSQL, and a service can copy the functions.
//
// The pattern is the same for every ORM: idemsql hands fn a *sql.Tx, and
// the ORM is put on it (Bun and sqlx wrap it, GORM opens a session on it,
// ent builds a client over it); or the ORM begins the transaction, and its
// *sql.Tx is given to idemsql.Do.
package examples
