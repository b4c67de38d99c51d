package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Citus (a distributed PostgreSQL) shards idem_keys by actor: Distribute
// makes it so, and every call then goes through the coordinator, which
// routes each statement to the worker that holds the actor's shard.
//
// The statements are the same on both engines wherever Citus accepts them
// at no cost to PostgreSQL. Where they differ, the call says so and picks
// one with Client.isCitus, which asks each database once per Client:
//   - Do and DoInTx's claim: Citus waits for a twin on the worker, which
//     set_config never reaches; SET LOCAL lock_timeout statements around a
//     plain claim bound the wait there (queueClaim, KeyClaimCitus,
//     KeyTakeOverCitus). Reserve uses that statement on both engines;
//   - Prune and ExpireLeases: Citus refuses FOR UPDATE SKIP LOCKED over a
//     distributed table (KeyPruneCitus, ReserveExpireLeasesCitus);
//   - ReadStats: the sizes come from citus_table_size (asked on every call:
//     ReadStats is a package function and off the request path).

// ErrUnsupported means the database refused one of idem's statements as a
// feature it does not support (SQLSTATE 0A000, as Citus answers statements
// it cannot distribute), or the database is not set up the way the call
// needs: Distribute on a database without the citus extension, or a
// connection to a Citus worker instead of the coordinator. Nothing was
// stored. It is a deployment error, not a request's (HTTP 500).
var ErrUnsupported = errors.New("idem: not supported by this database")

// DistributionColumn is the column Distribute shards idem_keys by: the
// tenant column. Co-locate the service's tables with idem_keys (distributed
// by their own actor column, colocate_with => 'idem_keys') so that a request
// touches one worker.
const DistributionColumn = "actor"

// Distribute makes idem_keys a Citus distributed table, sharded by actor
// (DistributionColumn), in the database of pool, which must be the Citus
// coordinator's. Run it once after Migrate; it does nothing when idem_keys
// is distributed by actor already. Keys the table holds already are copied
// into the shards (create_distributed_table copies a local table's rows;
// writes to idem_keys wait until the copy is done), and the coordinator's
// original rows stay on disk until truncate_local_data_after_distributing_table
// removes them (docs/citus.md).
//
// A database without the citus extension, a Citus worker, a session whose
// citus.propagate_set_commands is not 'local' (SET LOCAL statements must
// reach the workers: that is how Config.Wait bounds a wait there), or an
// idem_keys distributed otherwise (by another column, or as a reference
// table) gives an error wrapping ErrUnsupported, and nothing changes.
// Migrate keeps working on the distributed table: Citus applies idem's
// later migrations (columns, indexes built concurrently) to every shard.
//
// A Client learns whether a database runs Citus on its first call there and
// keeps the answer: a process that installs the citus extension after it
// called idem on that database must create its Clients anew (the package
// functions use one Client for the life of the process).
func Distribute(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return fmt.Errorf("%w: nil pool", ErrInvalidArgument)
	}
	err := pool.AcquireFunc(ctx, func(conn *pgxpool.Conn) error {
		coordinator, err := onCoordinator(ctx, conn.Conn())
		if err != nil {
			return err
		}
		if !coordinator {
			return errWorker
		}
		var propagate string
		if err := conn.QueryRow(ctx, sqlPropagateSet).Scan(&propagate); err != nil {
			return err
		}
		if propagate != "local" {
			return fmt.Errorf("%w: citus.propagate_set_commands is %q: set it to 'local' (postgresql.conf, "+
				"ALTER DATABASE or ALTER ROLE), or Config.Wait cannot bound a wait on the workers", ErrUnsupported, propagate)
		}
		var column string
		err = conn.QueryRow(ctx, sqlDistributionColumn).Scan(&column)
		switch {
		case err == nil && column == DistributionColumn:
			return nil
		case err == nil:
			return fmt.Errorf("%w: idem_keys is a Citus table distributed by %q, not by %s",
				ErrUnsupported, column, DistributionColumn)
		case !errors.Is(err, pgx.ErrNoRows):
			return err
		}
		_, err = conn.Exec(ctx, sqlDistribute)
		return err
	})
	if err != nil {
		return fmt.Errorf("idem: distribute: %w", unsupportedIf(err))
	}
	return nil
}

// Statements of Distribute and of the Citus side of ReadStats. They are not
// sqlc queries: sqlc's catalog knows PostgreSQL's functions and views, not
// the ones the citus extension adds.
const (
	sqlHasCitus   = "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
	sqlIsCoordntr = "SELECT citus_is_coordinator()"
	// Whether SET LOCAL reaches the workers (Config.Wait needs it).
	sqlPropagateSet = "SELECT current_setting('citus.propagate_set_commands')"
	// The distribution column of idem_keys, no row when it is not a Citus
	// table ('<none>' for a reference table).
	sqlDistributionColumn = "SELECT distribution_column::text FROM citus_tables WHERE table_name = 'idem_keys'::regclass"
	sqlDistribute         = "SELECT create_distributed_table('idem_keys', '" + DistributionColumn + "')"
	// The sizes of a distributed idem_keys: the sum over its shards on the
	// workers (the coordinator's own idem_keys is an empty shell).
	sqlCitusTableSize = "SELECT citus_table_size('idem_keys')::bigint, " +
		"(citus_total_relation_size('idem_keys') - citus_table_size('idem_keys'))::bigint"
	// Whether idem_keys is a Citus table (distributed or not), whose size
	// citus_table_size knows.
	sqlIsCitusTable = "SELECT EXISTS (SELECT FROM citus_tables WHERE table_name = 'idem_keys'::regclass)"
)

// errWorker is the error of a call made on a Citus worker.
var errWorker = fmt.Errorf("%w: connected to a Citus worker; connect to the coordinator", ErrUnsupported)

// hasCitus reports whether the citus extension is installed in the
// database of q.
func hasCitus(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (bool, error) {
	var citus bool
	err := q.QueryRow(ctx, sqlHasCitus).Scan(&citus)
	return citus, err
}

// isCitus reports whether the database of conn has the citus extension. It
// asks each database once per Client (by host, port and database name of
// conn's configuration), and each connection then keeps the answer in its
// pgconn CustomData: on every later call on that connection it costs a map
// lookup, no allocation and no statement.
func (c *Client) isCitus(ctx context.Context, conn *pgx.Conn) (bool, error) {
	if conn == nil { // a pgx.Tx of another making that has no *pgx.Conn: plain PostgreSQL
		return false, nil
	}
	data := conn.PgConn().CustomData()
	if citus, ok := data[citusData].(bool); ok {
		return citus, nil
	}
	cfg := conn.Config() // a copy: once per connection
	key := citusKey{host: cfg.Host, port: cfg.Port, database: cfg.Database}
	var citus bool
	if known, ok := c.citus.Load(key); ok {
		citus = known.(bool)
	} else {
		var err error
		if citus, err = hasCitus(ctx, conn); err != nil {
			return false, err
		}
		c.citus.Store(key, citus)
	}
	data[citusData] = citus
	return citus, nil
}

// citusData is the key of isCitus's answer in a connection's CustomData.
const citusData = "github.com/pgidem/idem.citus"

// citusKey names a database for Client.isCitus.
type citusKey struct {
	host     string
	port     uint16
	database string
}

// isCitusTable reports whether idem_keys is a Citus table in the database
// of tx.
func isCitusTable(ctx context.Context, tx pgx.Tx) (bool, error) {
	citus, err := hasCitus(ctx, tx)
	if err != nil || !citus {
		return false, err
	}
	err = tx.QueryRow(ctx, sqlIsCitusTable).Scan(&citus)
	return citus, err
}

// checkNotWorker returns errWorker when pool is connected to a Citus
// worker; a database without Citus passes.
func checkNotWorker(ctx context.Context, pool *pgxpool.Pool) error {
	return pool.AcquireFunc(ctx, func(conn *pgxpool.Conn) error {
		citus, err := hasCitus(ctx, conn)
		if err != nil || !citus {
			return err
		}
		coordinator, err := onCoordinator(ctx, conn.Conn())
		if err == nil && !coordinator {
			err = errWorker
		}
		return err
	})
}

// onCoordinator reports whether conn is connected to a Citus coordinator; a
// database without the citus extension is an ErrUnsupported error.
func onCoordinator(ctx context.Context, conn *pgx.Conn) (bool, error) {
	citus, err := hasCitus(ctx, conn)
	if err != nil {
		return false, err
	}
	if !citus {
		return false, fmt.Errorf("%w: the citus extension is not installed in this database", ErrUnsupported)
	}
	var coordinator bool
	err = conn.QueryRow(ctx, sqlIsCoordntr).Scan(&coordinator)
	return coordinator, err
}

// unsupportedIf wraps err with ErrUnsupported when the server refused one
// of idem's statements as a feature it does not support (0A000: Citus
// refuses statements it cannot distribute that way), or when the token
// sequence is missing: the connection is to a Citus worker, where idem's
// sequence does not exist (only the coordinator's tables are distributed).
// Use it only on errors of idem's own statements, never on fn's.
func unsupportedIf(err error) error {
	var pgErr *pgconn.PgError
	if err == nil || errors.Is(err, ErrUnsupported) || !errors.As(err, &pgErr) {
		return err
	}
	switch {
	case pgErr.Code == pgerrcode.FeatureNotSupported:
		return fmt.Errorf("%w: %w", ErrUnsupported, err)
	case pgErr.Code == pgerrcode.UndefinedTable && strings.Contains(pgErr.Message, "idem_keys_token_seq"):
		return fmt.Errorf("%w (on Citus, connect to the coordinator; otherwise run idem.Migrate): %w", ErrUnsupported, err)
	}
	return err
}
