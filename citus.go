package idem

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/driver/dberr"
	"github.com/pgidem/idem/internal/driver/pgxdriver"
)

// Citus (a distributed PostgreSQL) shards idem_keys by actor, the audit
// trail (idem_audit) by actor co-located with it, and the outbox
// (idem_events, idem_event_attempts) by destination: Distribute makes it so,
// and every call then goes through the coordinator, which routes each
// statement to the worker that holds the actor's shard. Where Citus needs
// statements of its own (the claim's bounded wait, Prune and ExpireLeases
// without SKIP LOCKED, ReadStats's sizes), the driver picks them per
// connection: a Client learns whether a database runs Citus on its first
// call there.

// ErrUnsupported means the database refused one of idem's statements as a
// feature it does not support (SQLSTATE 0A000, as Citus answers statements
// it cannot distribute), or the database is not set up the way the call
// needs: Distribute on a database without the citus extension or with
// idem's tables distributed otherwise, or a connection to a Citus worker
// instead of the coordinator. Nothing was stored. It is a deployment error, not a request's (HTTP 500).
var ErrUnsupported = errors.New("idem: not supported by this database")

// DistributionColumn is the column Distribute shards idem_keys and
// idem_audit by: the tenant column. Co-locate the service's tables with
// idem_keys (distributed by their own actor column, colocate_with =>
// 'idem_keys') so that a request touches one worker.
const DistributionColumn = "actor"

// Distribute makes idem_keys a Citus distributed table, sharded by actor
// (DistributionColumn), and idem_audit, the operators' audit trail
// (migration 00005), a distributed table sharded by actor co-located with
// it, so that a change to a key and its audit row commit on one worker;
// and it creates idem's function idem_refuse (migration 00008) on every
// worker, where the statements that raise idem's SQLSTATEs run. The
// database of pool must be the Citus coordinator's. Run it after Migrate:
// it distributes what is not distributed yet and does nothing to a table
// distributed as it would do it, so running it again, or after a Migrate
// that added idem_audit to an idem_keys distributed before, is safe (a
// database migrated below 00005 has no idem_audit: the keys alone are
// distributed). Rows the tables hold already are copied into the shards
// (create_distributed_table copies a local table's rows; writes to the
// table wait until the copy is done), and the coordinator's original rows
// stay on disk until truncate_local_data_after_distributing_table removes
// them (docs/citus.md). The outbox (migration 00007: idem_events and its
// attempt log idem_event_attempts) is distributed by destination
// (EventsDistributionColumn), the log co-located with the events; an
// outbox table distributed by another column is ErrUnsupported.
//
// A database without the citus extension, a Citus worker, a session whose
// citus.propagate_set_commands is not 'local' (SET LOCAL statements must
// reach the workers: that is how Config.Wait bounds a wait there), a
// database without idem_keys (Migrate first), an idem_keys distributed
// otherwise (by another column, or as a reference table), or an idem_audit
// distributed otherwise (by another column, as a reference table, or not
// co-located with idem_keys) gives an error wrapping ErrUnsupported, and
// nothing changes: both tables are distributed in one transaction.
// Migrate keeps working on the distributed tables: Citus applies idem's
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
		return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			keys, err := distribution(ctx, tx, "idem_keys")
			switch {
			case err != nil:
				return err
			case !keys.exists:
				return core.Errorf("idem: %w: idem_keys does not exist: run Migrate first", ErrUnsupported)
			case !keys.citus:
				if _, err := tx.Exec(ctx, sqlDistribute); err != nil {
					return err
				}
			case keys.column != DistributionColumn:
				return core.Errorf("idem: %w: idem_keys is a Citus table distributed by %q, not by %s",
					ErrUnsupported, keys.column, DistributionColumn)
			}
			// idem_refuse (migration 00008) on every worker, where the
			// statements that call it run: Citus creates a function there
			// by itself only when its extension was there first.
			if _, err := tx.Exec(ctx, sqlDistributeRefuse); err != nil {
				return err
			}
			if err := distributeEvents(ctx, tx); err != nil {
				return err
			}
			audit, err := distribution(ctx, tx, "idem_audit")
			switch {
			case err != nil || !audit.exists:
				return err
			case !audit.citus:
				_, err := tx.Exec(ctx, sqlDistributeAudit)
				return err
			case audit.column != DistributionColumn:
				return core.Errorf("idem: %w: idem_audit is a Citus table distributed by %q, not by %s",
					ErrUnsupported, audit.column, DistributionColumn)
			case !audit.colocated:
				return core.Errorf("idem: %w: idem_audit is distributed by %s but not co-located with idem_keys "+
					"(SELECT update_distributed_table_colocation('idem_audit', colocate_with => 'idem_keys'))",
					ErrUnsupported, DistributionColumn)
			}
			return nil
		})
	})
	if err != nil {
		return core.Errorf("idem: distribute: %w", core.UnsupportedIf(dberr.Interpret(err)))
	}
	return nil
}

// EventsDistributionColumn is the column Distribute shards the outbox by
// (idem_events and its attempt log idem_event_attempts, co-located): an
// event, its claim and its attempts live on one worker.
const EventsDistributionColumn = "destination"

// distributeEvents distributes the outbox (migration 00007) by destination,
// the attempt log co-located with the events; a database migrated below
// 00007 has no outbox, and a distributed one is left as it is when it is
// distributed so.
func distributeEvents(ctx context.Context, tx pgx.Tx) error {
	for _, table := range [...]struct{ name, stmt string }{
		{"idem_events", sqlDistributeEvents}, {"idem_event_attempts", sqlDistributeAttempts},
	} {
		t, err := distribution(ctx, tx, table.name)
		switch {
		case err != nil || !t.exists:
			return err
		case !t.citus:
			if _, err := tx.Exec(ctx, table.stmt); err != nil {
				return err
			}
		case t.column != EventsDistributionColumn:
			return core.Errorf("idem: %w: %s is a Citus table distributed by %q, not by %s",
				ErrUnsupported, table.name, t.column, EventsDistributionColumn)
		}
	}
	return nil
}

// citusTable is what Distribute reads of one of idem's tables.
type citusTable struct {
	exists    bool   // the table exists
	citus     bool   // it is a Citus table
	column    string // its distribution column ('<none>' for a reference table)
	colocated bool   // it is in idem_keys' co-location group
}

// distribution reads how table is distributed.
func distribution(ctx context.Context, tx pgx.Tx, table string) (citusTable, error) {
	var t citusTable
	var column *string
	err := tx.QueryRow(ctx, sqlDistribution, table).Scan(&t.exists, &column, &t.colocated)
	if column != nil {
		t.citus, t.column = true, *column
	}
	return t, err
}

// Statements of Distribute. They are not sqlc queries: sqlc's catalog knows
// PostgreSQL's functions and views, not the ones the citus extension adds.
const (
	sqlIsCoordntr = "SELECT citus_is_coordinator()"
	// Whether SET LOCAL reaches the workers (Config.Wait needs it).
	sqlPropagateSet = "SELECT current_setting('citus.propagate_set_commands')"
	// Whether the table $1 exists, its distribution column (NULL when it is
	// not a Citus table, '<none>' for a reference or Citus local table), and
	// whether it is in idem_keys' co-location group. It reads Citus's
	// metadata table rather than the citus_tables view, which asks every
	// worker for its shards' sizes.
	sqlDistribution = `SELECT r IS NOT NULL,
		CASE WHEN p.logicalrelid IS NOT NULL THEN coalesce(column_to_column_name(p.logicalrelid, p.partkey), '<none>') END,
		coalesce(p.colocationid = (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = to_regclass('idem_keys')), false)
		FROM to_regclass($1) r LEFT JOIN pg_dist_partition p ON p.logicalrelid = r`
	sqlDistribute         = "SELECT create_distributed_table('idem_keys', '" + DistributionColumn + "')"
	sqlDistributeAudit    = "SELECT create_distributed_table('idem_audit', '" + DistributionColumn + "', colocate_with => 'idem_keys')"
	sqlDistributeEvents   = "SELECT create_distributed_table('idem_events', '" + EventsDistributionColumn + "')"
	sqlDistributeAttempts = "SELECT create_distributed_table('idem_event_attempts', '" + EventsDistributionColumn + "', colocate_with => 'idem_events')"
	// idem_refuse on the workers (and on workers added later), when the
	// database has it (migrated to 00008).
	// (The name is looked up by to_regprocedure, which gives NULL where it
	// is missing: a literal cast to regprocedure fails at planning time,
	// before any WHERE is read.)
	sqlDistributeRefuse = "SELECT create_distributed_function(f) " +
		"FROM to_regprocedure('idem_refuse(text,text)') f WHERE f IS NOT NULL"
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
