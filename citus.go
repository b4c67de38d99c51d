package idem

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/driver/pgxdriver"
)

// Citus (a distributed PostgreSQL) shards idem_keys by actor: Distribute
// makes it so, and every call then goes through the coordinator, which
// routes each statement to the worker that holds the actor's shard. Where
// Citus needs statements of its own (the claim's bounded wait, Prune and
// ExpireLeases without SKIP LOCKED, ReadStats's sizes), the driver picks
// them per connection: a Client learns whether a database runs Citus on its
// first call there.

// ErrUnsupported means the database refused one of idem's statements as a
// feature it does not support (SQLSTATE 0A000, as Citus answers statements
// it cannot distribute), or the database is not set up the way the call
// needs: Distribute on a database without the citus extension, or a
// connection to a Citus worker instead of the coordinator. Nothing was
// stored. It is a deployment error, not a request's (HTTP 500).
var ErrUnsupported = core.ErrUnsupported

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
		return core.Errorf("idem: %w: nil pool", ErrInvalidArgument)
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
			return core.Errorf("idem: %w: citus.propagate_set_commands is %q: set it to 'local' (postgresql.conf, "+
				"ALTER DATABASE or ALTER ROLE), or Config.Wait cannot bound a wait on the workers", ErrUnsupported, propagate)
		}
		var column string
		err = conn.QueryRow(ctx, sqlDistributionColumn).Scan(&column)
		switch {
		case err == nil && column == DistributionColumn:
			return nil
		case err == nil:
			return core.Errorf("idem: %w: idem_keys is a Citus table distributed by %q, not by %s",
				ErrUnsupported, column, DistributionColumn)
		case !errors.Is(err, pgx.ErrNoRows):
			return err
		}
		_, err = conn.Exec(ctx, sqlDistribute)
		return err
	})
	if err != nil {
		return core.Errorf("idem: distribute: %w", core.UnsupportedIf(err))
	}
	return nil
}

// Statements of Distribute. They are not sqlc queries: sqlc's catalog knows
// PostgreSQL's functions and views, not the ones the citus extension adds.
const (
	sqlIsCoordntr = "SELECT citus_is_coordinator()"
	// Whether SET LOCAL reaches the workers (Config.Wait needs it).
	sqlPropagateSet = "SELECT current_setting('citus.propagate_set_commands')"
	// The distribution column of idem_keys, no row when it is not a Citus
	// table ('<none>' for a reference table).
	sqlDistributionColumn = "SELECT distribution_column::text FROM citus_tables WHERE table_name = 'idem_keys'::regclass"
	sqlDistribute         = "SELECT create_distributed_table('idem_keys', '" + DistributionColumn + "')"
)

// errWorker is the error of a call made on a Citus worker.
var errWorker = core.Errorf("idem: %w: connected to a Citus worker; connect to the coordinator", ErrUnsupported)

// checkNotWorker returns errWorker when pool is connected to a Citus
// worker; a database without Citus passes.
func checkNotWorker(ctx context.Context, pool *pgxpool.Pool) error {
	return pool.AcquireFunc(ctx, func(conn *pgxpool.Conn) error {
		citus, err := pgxdriver.HasCitus(ctx, conn)
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
	citus, err := pgxdriver.HasCitus(ctx, conn)
	if err != nil {
		return false, err
	}
	if !citus {
		return false, core.Errorf("idem: %w: the citus extension is not installed in this database", ErrUnsupported)
	}
	var coordinator bool
	err = conn.QueryRow(ctx, sqlIsCoordntr).Scan(&coordinator)
	return coordinator, err
}
