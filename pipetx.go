package idem

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pipeTx is the pgx.Tx that InTx and DoInTx run on a *pgxpool.Pool or a
// *pgx.Conn. It holds BEGIN back until the first statement and sends it in
// the same round trip (pgx's Batch.BeginTx). In DoInTx (fold set) Do also
// sends COMMIT in its last round trip, so the library's own transaction
// costs no round trip for BEGIN or COMMIT.
//
// Once BEGIN is sent, everything goes through the pgx transaction it made,
// so nested Begin (savepoints) and LargeObjects behave as in pgx.
type pipeTx struct {
	conn *pgx.Conn
	opts pgx.TxOptions
	fold bool // Do may end the transaction in its last round trip

	inner     pgx.Tx // nil until BEGIN is sent
	done      bool   // committed or rolled back
	committed bool
	fnDepth   int // > 0 while Do's fn runs: a Do nested in fn must not commit
}

var _ pgx.Tx = (*pipeTx)(nil)

// ownTx returns tx as a *pipeTx whose transaction Do may commit in its last
// round trip (DoInTx's own), or nil.
func ownTx(tx pgx.Tx) *pipeTx {
	pt, ok := tx.(*pipeTx)
	if !ok || !pt.fold || pt.done || pt.inner == nil || pt.fnDepth > 0 {
		return nil
	}
	return pt
}

// isOwnTx reports whether tx is DoInTx's own transaction as seen by its
// outermost Do, whatever state the transaction is in.
func isOwnTx(tx pgx.Tx) bool {
	pt, ok := tx.(*pipeTx)
	return ok && pt.fold && pt.fnDepth == 0
}

// reopen lets a DoInTx transaction that claim committed after reading the
// key (it had written nothing) run again: the next statement sends a new
// BEGIN. Other transactions are left alone.
func reopen(tx pgx.Tx) {
	if pt, ok := tx.(*pipeTx); ok && pt.fold && pt.committed {
		pt.inner, pt.done, pt.committed = nil, false, false
	}
}

// commitResult records the result of a COMMIT that Do queued in a batch.
func (t *pipeTx) commitResult(tag pgconn.CommandTag, err error) error {
	// Whatever the result, the server has ended the transaction.
	t.done = true
	if err != nil {
		return err
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	t.committed = true
	return nil
}

// tx returns the pgx transaction, sending BEGIN on its own if it is still
// held back.
func (t *pipeTx) tx(ctx context.Context) (pgx.Tx, error) {
	if t.done {
		return nil, pgx.ErrTxClosed
	}
	if t.inner == nil {
		inner, err := t.conn.BeginTx(ctx, t.opts)
		if err != nil {
			return nil, err
		}
		t.inner = inner
	}
	return t.inner, nil
}

func (t *pipeTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.done {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	if t.inner != nil {
		return t.inner.SendBatch(ctx, b)
	}
	nb := &pgx.Batch{}
	nb.BeginTx(t.opts)
	nb.QueuedQueries = append(nb.QueuedQueries, b.QueuedQueries...)
	br := t.conn.SendBatch(ctx, nb)
	t.inner = br.Tx()
	if _, err := br.Exec(); err != nil { // BEGIN's own result
		_ = br.Close()
		t.inner, t.done = nil, true
		return pgx.FailedBatchResults(b, err)
	}
	return br
}

// batchable reports whether a statement with args can be sent in a batch
// with BEGIN: it has arguments (without them pgx uses the simple protocol,
// which allows several statements in sql; those cannot join a batch) and
// none of the per-query options that batches ignore (exec mode, result
// formats; a QueryRewriter such as pgx.NamedArgs works in a batch).
func batchable(args []any) bool {
	if len(args) == 0 {
		return false
	}
	for _, arg := range args { // the options come first
		switch arg.(type) {
		case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
			return false
		case pgx.QueryRewriter:
		default:
			return true
		}
	}
	return true
}

func (t *pipeTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.inner == nil && !t.done && batchable(args) {
		// BEGIN and the statement in one round trip.
		b := &pgx.Batch{}
		b.Queue(sql, args...)
		br := t.SendBatch(ctx, b)
		tag, err := br.Exec()
		return tag, closeBatch(br, err)
	}
	tx, err := t.tx(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return tx.Exec(ctx, sql, args...)
}

func (t *pipeTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	tx, err := t.tx(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Query(ctx, sql, args...)
}

func (t *pipeTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.inner == nil && !t.done && (len(args) == 0 || batchable(args)) {
		b := &pgx.Batch{}
		b.Queue(sql, args...)
		return &batchRow{br: t.SendBatch(ctx, b)}
	}
	tx, err := t.tx(ctx)
	if err != nil {
		return errRow{err}
	}
	return tx.QueryRow(ctx, sql, args...)
}

func (t *pipeTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	tx, err := t.tx(ctx)
	if err != nil {
		return 0, err
	}
	return tx.CopyFrom(ctx, table, columns, src)
}

func (t *pipeTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	tx, err := t.tx(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Prepare(ctx, name, sql)
}

func (t *pipeTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.tx(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Begin(ctx)
}

// LargeObjects returns the large objects API of the transaction. If BEGIN is
// still held back it is sent first; if that fails the returned value's
// methods fail with pgx.ErrTxClosed.
func (t *pipeTx) LargeObjects() pgx.LargeObjects {
	tx, err := t.tx(context.Background())
	if err != nil {
		return closedTx.LargeObjects()
	}
	return tx.LargeObjects()
}

// closedTx is a closed pgx transaction, whose methods fail with
// pgx.ErrTxClosed.
var closedTx = pgx.FailedBatchResults(func() *pgx.Batch { b := &pgx.Batch{}; b.BeginTx(pgx.TxOptions{}); return b }(),
	pgx.ErrTxClosed).Tx()

func (t *pipeTx) Conn() *pgx.Conn { return t.conn }

func (t *pipeTx) Commit(ctx context.Context) error {
	switch {
	case t.committed:
		return nil // Do committed in its last round trip
	case t.done:
		return pgx.ErrTxClosed
	case t.inner == nil:
		t.done, t.committed = true, true // nothing ran: nothing to commit
		return nil
	}
	t.done = true
	err := t.inner.Commit(ctx)
	t.committed = err == nil
	return err
}

func (t *pipeTx) Rollback(ctx context.Context) error {
	switch {
	case t.done:
		return pgx.ErrTxClosed
	case t.inner == nil:
		t.done = true // nothing ran: nothing to roll back
		return nil
	}
	t.done = true
	return t.inner.Rollback(ctx)
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// batchRow is a Row read from a one-statement batch.
type batchRow struct{ br pgx.BatchResults }

func (r *batchRow) Scan(dest ...any) error {
	return closeBatch(r.br, r.br.QueryRow().Scan(dest...))
}

// connFor returns a connection of db for a pipeTx and a function that gives
// it back, or ok false when db is neither a pool nor a connection.
func connFor(ctx context.Context, db Beginner) (conn *pgx.Conn, release func(), ok bool, err error) {
	switch d := db.(type) {
	case *pgxpool.Pool:
		pc, err := d.Acquire(ctx)
		if err != nil {
			return nil, nil, true, err
		}
		return pc.Conn(), pc.Release, true, nil
	case *pgx.Conn:
		if d.PgConn().TxStatus() != 'I' {
			// BEGIN would only warn, and COMMIT would end the caller's
			// transaction.
			return nil, nil, true, fmt.Errorf("%w: the connection is in a transaction; pass that pgx.Tx instead", ErrInvalidArgument)
		}
		return d, func() {}, true, nil
	}
	return nil, nil, false, nil
}
