package idemsql

import (
	"context"
	"database/sql"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/sqldriver"
)

// Client is the database/sql form of idem.Client: the same configuration
// (idem.Config), the same calls, on *sql.DB and *sql.Tx. It holds no
// connections. A Client is safe for concurrent use.
type Client struct {
	c *core.Client[*sql.Tx, *sql.DB]
}

// New returns a Client for cfg, with zero fields replaced by their
// defaults (see idem.New). A field out of range gives an error wrapping
// idem.ErrInvalidConfig.
func New(cfg idem.Config) (*Client, error) { return newClient(cfg, false) }

// NewCitus is New for a database that is a Citus coordinator, with
// idem_keys distributed by actor (idem.Distribute): the Client's statements
// take the forms Citus accepts (the claim's wait bounded by SET LOCAL
// lock_timeout statements that reach the workers, Prune and ExpireLeases
// without SKIP LOCKED, ReadStats's sizes summed over the shards). A *sql.Tx
// does not say which database it is on, so this is a setting of the Client,
// not a question asked on its calls: use a NewCitus Client for a Citus
// coordinator, and New's for PostgreSQL (a NewCitus Client works there too,
// with a few more round trips per claim). The package-level functions use
// New's.
func NewCitus(cfg idem.Config) (*Client, error) { return newClient(cfg, true) }

func newClient(cfg idem.Config, citus bool) (*Client, error) {
	c, err := core.New(coreConfig(cfg), "idemsql", func(s driver.Settings) driver.Driver[*sql.Tx, *sql.DB] {
		return sqldriver.New(s, citus)
	})
	if err != nil {
		return nil, publicErr(err)
	}
	return &Client{c}, nil
}

// Config returns the client's configuration with defaults filled in.
func (c *Client) Config() idem.Config { return config(c.c.Config()) }

var defaultClient = func() *Client {
	c, err := New(idem.Config{})
	if err != nil {
		panic(err)
	}
	return c
}()

// InTx runs fn in a transaction begun on db and commits it when fn returns
// nil; when fn returns an error or panics the transaction is rolled back
// and the error (or panic) is passed on.
//
// After a serialization failure (40001) or a deadlock (40P01), anywhere in
// fn or at commit, the whole transaction is rolled back and run again, up
// to Config.MaxRetries times with jittered exponential backoff, so fn must
// be safe to run again. Both drivers' errors are recognized (pgx's
// *pgconn.PgError through its stdlib driver, lib/pq's *pq.Error).
//
// fn's errors are returned as they are, except when the store failed under
// them (the connection broke, or the server answered that it cannot serve:
// see idem.Unavailable): then InTx returns an error that wraps both
// idem.ErrUnavailable and fn's error. Failures to begin or commit because
// the server cannot be reached are idem.ErrUnavailable too. fn must not
// commit or roll back tx: InTx then returns idem.ErrInvalidArgument (after
// a COMMIT, fn's writes are durable). When ctx ends before the COMMIT,
// database/sql has rolled tx back and the error wraps ctx's.
//
// InTx uses the package defaults; see Client.InTx.
func InTx(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return defaultClient.InTx(ctx, db, fn)
}

// InTx is the package-level InTx with this client's isolation level and
// retry budget.
func (c *Client) InTx(ctx context.Context, db *sql.DB, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return publicErr(c.c.InTx(ctx, db, fn))
}

// ValidateKey is idem.Client.ValidateKey: whether key is a valid
// idempotency key under this client's key length bounds (ErrInvalidKey).
func (c *Client) ValidateKey(key string) error { return publicErr(c.c.ValidateKey(key)) }

// ValidateScope is idem.ValidateScope (ErrInvalidScope): a scope's limits
// do not depend on the client's Config.
func (c *Client) ValidateScope(scope idem.Scope) error { return idem.ValidateScope(scope) }
