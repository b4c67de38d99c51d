package sqldriver

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/pgidem/idem/internal/dbsql"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// Statements that are not table queries (as pgx's driver sends them).
const (
	sqlSavepoint = "SAVEPOINT idem_do"
	sqlRelease   = "RELEASE SAVEPOINT idem_do"
	// sqlUndo undoes the claim and fn's writes and drops the savepoint; a
	// statement without arguments goes as one simple-protocol message, so
	// both commands cost one round trip (and a transaction fn left aborted
	// accepts it).
	sqlUndo        = "ROLLBACK TO SAVEPOINT idem_do; RELEASE SAVEPOINT idem_do"
	sqlIndexLookup = "SET LOCAL enable_seqscan = off"
	// sqlWaitDefault ends a Citus claim's bound on waiting.
	sqlWaitDefault = "SET LOCAL lock_timeout TO DEFAULT"
)

// SavepointSpan is Do's span in the caller's transaction tx.
func (d *Driver) SavepointSpan(tx *sql.Tx) driver.Span[*sql.Tx] { return &span{d: d, tx: tx} }

// OwnSpan is DoInTx's span on db: a transaction of its own per round (on
// a connection database/sql takes at BEGIN and gives back at its end). It
// refuses a nil *sql.DB. Concurrent DoInTx calls on a *sql.DB are not
// coalesced (no flight): they meet at the primary key.
func (d *Driver) OwnSpan(db *sql.DB) (driver.Span[*sql.Tx], any, error) {
	if db == nil {
		return nil, nil, errNilDB
	}
	return &span{d: d, db: db}, nil, nil
}

// span is where one call claims its key, runs fn and stores the outcome:
// Do's savepoint in the caller's transaction (db nil), or DoInTx's own
// transactions begun on db, one per round.
type span struct {
	d    *Driver
	tx   *sql.Tx // Do: the caller's; DoInTx: the current own transaction
	db   *sql.DB
	lost bool // a ROLLBACK of DoInTx's found the connection gone
	// The TTL (µs) the last claim wrote, which the completion writes
	// again: TTLFor is read once a claim, and may answer otherwise later.
	ttl int64
}

// Claim sends SAVEPOINT (or BEGIN), then the claim, which bounds its own
// wait (on Citus: SET LOCAL lock_timeout before it and back to its default
// after it, each a round trip), and returns the transaction it runs in.
func (s *span) Claim(ctx context.Context, c driver.Claim) (tx *sql.Tx, claimed, begun bool, err error) {
	if s.db != nil {
		s.tx, s.lost = nil, false
		tx, err := s.db.BeginTx(ctx, s.d.txOptions)
		if err != nil { // nothing to undo
			return nil, false, false, fmt.Errorf("begin: %w", err)
		}
		s.tx = tx
	} else if _, err := s.tx.ExecContext(ctx, sqlSavepoint); err != nil {
		return s.tx, false, false, fmt.Errorf("claim: %w", err)
	}
	s.ttl = s.d.ttl.TTL(c.Key.Operation)
	claimed, err = s.d.claim(ctx, s.tx, c, s.ttl)
	if err != nil {
		return s.tx, false, true, fmt.Errorf("claim: %w", err)
	}
	return s.tx, claimed, true, nil
}

// claim claims c.Key in tx for ttl µs. claimed is false when a committed
// row holds the key.
func (d *Driver) claim(ctx context.Context, tx *sql.Tx, c driver.Claim, ttl int64) (claimed bool, err error) {
	k, fp := c.Key, c.Fingerprint[:]
	switch {
	case d.citus:
		if _, err := tx.ExecContext(ctx, d.sqlSetWait); err != nil {
			return false, err
		}
		if c.TakeOver {
			claimed, err = queries.KeyTakeOverCitus(ctx, tx, dbsql.KeyTakeOverCitusParams{Actor: k.Actor, Operation: k.Operation,
				IdemKey: k.Key, Fingerprint: fp, TtlMicros: ttl, BodyTtlMicros: d.ttl.BodyTTL(k.Operation, ttl)})
		} else {
			claimed, err = queries.KeyClaimCitus(ctx, tx, dbsql.KeyClaimCitusParams{Actor: k.Actor, Operation: k.Operation,
				IdemKey: k.Key, Fingerprint: fp, TtlMicros: ttl, BodyTtlMicros: d.ttl.BodyTTL(k.Operation, ttl)})
		}
		if err == nil || errors.Is(err, sql.ErrNoRows) {
			if _, waitErr := tx.ExecContext(ctx, sqlWaitDefault); waitErr != nil {
				return false, waitErr
			}
		}
	case c.TakeOver:
		claimed, err = queries.KeyTakeOver(ctx, tx, dbsql.KeyTakeOverParams{Actor: k.Actor, Operation: k.Operation,
			IdemKey: k.Key, Fingerprint: fp, TtlMicros: ttl, BodyTtlMicros: d.ttl.BodyTTL(k.Operation, ttl), LockTimeout: d.lockTimeout})
	default:
		claimed, err = queries.KeyClaim(ctx, tx, dbsql.KeyClaimParams{Actor: k.Actor, Operation: k.Operation,
			IdemKey: k.Key, Fingerprint: fp, TtlMicros: ttl, BodyTtlMicros: d.ttl.BodyTTL(k.Operation, ttl), LockTimeout: d.lockTimeout})
	}
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return claimed, err
}

// Complete stores the outcome, then sends RELEASE (or COMMIT): unlike
// pgx's, the completion has run when the end finds the transaction ended.
func (s *span) Complete(ctx context.Context, out driver.Outcome) error {
	k, r := out.Key, out.Reply
	p := dbsql.KeyCompleteParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: out.Fingerprint[:],
		Status: out.Status, TtlMicros: s.ttl, ResponseStatus: r.Status,
		ResponseHeaders: sql.NullString{String: r.Headers, Valid: r.HasHeaders}, ResponseBody: r.Body,
	}
	var err error
	if s.d.citus {
		err = queries.KeyCompleteCitus(ctx, s.tx, dbsql.KeyCompleteCitusParams(p))
	} else {
		err = queries.KeyComplete(ctx, s.tx, p)
	}
	if err != nil {
		return fmt.Errorf("store response: %w", dberr.Interpret(err))
	}
	if s.db != nil {
		// After the completion ran: sql.ErrTxDone when fn ended the
		// transaction, or when ctx ended meanwhile and database/sql
		// rolled it back (ctx's error when it has not yet): the core
		// tells them apart by looking for a claim fn's COMMIT orphaned
		// (Orphaned). A COMMIT sent and not answered is in doubt
		// (driver.ErrCommitInDoubt); so that one never sent is not
		// taken for it, none is sent once ctx has ended (database/sql
		// would refuse it with ctx's error, which pgx's stdlib also
		// returns when ctx ends during the COMMIT).
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("commit: %w", err)
		}
		if err := s.tx.Commit(); err != nil {
			return fmt.Errorf("commit: %w", dberr.CommitError(err))
		}
		return nil
	}
	if _, err := s.tx.ExecContext(ctx, sqlRelease); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}

// Read reads the committed row that holds k as an index lookup, then leaves
// the span: ROLLBACK TO and RELEASE in one message (or ROLLBACK), which end
// the planner setting.
func (s *span) Read(ctx context.Context, k driver.Key) (row driver.Row, found bool, err error) {
	_, err = s.tx.ExecContext(ctx, sqlIndexLookup)
	var r dbsql.KeyGetRow
	if err == nil {
		r, err = queries.KeyGet(ctx, s.tx, dbsql.KeyGetParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
		found = err == nil
		if errors.Is(err, sql.ErrNoRows) {
			err = nil
		}
	}
	if err == nil && s.db != nil {
		err = s.rollback()
	} else if err == nil {
		_, err = s.tx.ExecContext(ctx, sqlUndo)
	}
	if err != nil {
		return row, false, fmt.Errorf("read key: %w", err)
	}
	if !found {
		return row, false, nil
	}
	row = driver.Row{Fingerprint: r.Fingerprint, Status: r.Status, Stored: stored(r.ResponseStatus, r.ResponseHeaders, r.ResponseBody)}
	row.Judge(driver.KeyTimes{Now: r.Now, ExpiresAt: r.ExpiresAt, LeaseExpiresAt: r.LeaseExpiresAt.Time,
		BodyExpiresAt: r.BodyExpiresAt.Time})
	return row, found, nil
}

// stored is a response as read from its columns.
func stored(status sql.NullInt32, headers, body []byte) driver.Stored {
	return driver.Stored{Valid: status.Valid, Status: status.Int32, Headers: headers, Body: body}
}

// storedOrGone is stored with a row's body_gone: a gone body keeps only
// its status.
func storedOrGone(status sql.NullInt32, headers, body []byte, gone bool) driver.Stored {
	if gone {
		return driver.Stored{Valid: status.Valid, Status: status.Int32, Gone: true}
	}
	return stored(status, headers, body)
}

// Undo undoes the span, even when ctx is done: Do rolls the caller's
// transaction back to its savepoint and drops it; DoInTx rolls its own
// transaction back, and says when it had ended already (sql.ErrTxDone: fn
// committed or rolled it back, or its context ended).
func (s *span) Undo(ctx context.Context) error {
	if s.db != nil {
		if s.tx != nil {
			if err := s.tx.Rollback(); errors.Is(err, sql.ErrTxDone) {
				return fmt.Errorf("rollback: %w", err)
			} else if err != nil {
				s.lost = s.lost || dberr.Unavailable(err)
			}
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), driver.CleanupTimeout)
	defer cancel()
	if _, err := s.tx.ExecContext(ctx, sqlUndo); err != nil {
		return fmt.Errorf("undo: %w", err)
	}
	return nil
}

// rollback rolls DoInTx's transaction back and remembers whether the
// connection was gone.
func (s *span) rollback() error {
	if s.tx == nil {
		return nil
	}
	err := rollback(s.tx)
	s.lost = s.lost || err != nil && dberr.Unavailable(err)
	return err
}

// rollback rolls tx back, whatever the context: database/sql sends
// ROLLBACK regardless (a Tx whose context ended was rolled back already, and
// answers sql.ErrTxDone).
func rollback(tx *sql.Tx) error {
	err := tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return err
}

// Orphaned turns the row a committed claim left without an outcome
// unknown, in a statement of its own on DoInTx's *sql.DB, and reads
// the row when it marked none.
func (s *span) Orphaned(ctx context.Context, k driver.Key, fp [32]byte, reason string) (int64, driver.Record, error) {
	if s.db == nil {
		return 0, driver.Record{}, errors.New("a savepoint has no connection of its own")
	}
	n, err := markUnknown(ctx, s.db, k, fp, reason)
	if err != nil || n == 1 {
		return n, driver.Record{}, err
	}
	row, err := queries.KeyLookup(ctx, s.db, dbsql.KeyLookupParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	return 0, record(row.IdemKey), noRows(err)
}

// markUnknown runs KeyMarkUnknown on q.
func markUnknown(ctx context.Context, q dbsql.DBTX, k driver.Key, fp [32]byte, reason string) (int64, error) {
	return queries.KeyMarkUnknown(ctx, q, dbsql.KeyMarkUnknownParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: fp[:], Reason: reason,
	})
}

// Enclosing finds none: a *sql.Tx is never a savepoint of another
// transaction (database/sql has no nested transactions, and its Commit is
// COMMIT), so a transaction that fn ended is over on its connection.
func (s *span) Enclosing(context.Context, driver.Key, [32]byte) (driver.Enclosing, error) {
	return driver.NoEnclosing, nil
}

// Lost reports whether a ROLLBACK of DoInTx's found the connection gone.
func (s *span) Lost() bool { return s.lost }

// Close does nothing: database/sql gives the connection back at the end
// of each transaction.
func (s *span) Close() {}
