package pgxdriver

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"sync"
	"time"
	"weak"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// Statements that are not table queries. idem_do is the savepoint that Do
// runs the claim and fn in.
const (
	sqlSavepoint = "SAVEPOINT idem_do"
	sqlRelease   = "RELEASE SAVEPOINT idem_do"
	// sqlUndo undoes the claim and fn's writes and drops the savepoint. It
	// is sent as one simple-protocol message: a transaction that fn left
	// aborted accepts ROLLBACK TO, but would refuse to prepare the next
	// statement of a pipeline.
	sqlUndo       = "ROLLBACK TO SAVEPOINT idem_do; RELEASE SAVEPOINT idem_do"
	sqlRollbackTo = "ROLLBACK TO SAVEPOINT idem_do"
	// sqlIndexLookup makes KeyGet an index lookup in every plan, also the
	// generic plan pgx's statement cache keeps for the life of a
	// connection, even when idem_keys was analyzed while empty. It ends
	// with the savepoint (Do) or the transaction (DoInTx).
	sqlIndexLookup = "SET LOCAL enable_seqscan = off"
)

// SavepointSpan is Do's span in the caller's transaction tx.
func (d *Driver) SavepointSpan(tx pgx.Tx) driver.Span[pgx.Tx] {
	return &span{d: d, tx: tx}
}

// OwnSpan is DoInTx's span on a pool or a connection: BEGIN goes with the
// claim, COMMIT with the completion. On a pool, the claim acquires a
// connection and the COMMIT gives it back, as a pgxpool.Tx would; the
// pool names the call's flight. On a pgx.Tx or another Beginner there is
// none. It refuses what CheckDB(db, false) refuses.
func (d *Driver) OwnSpan(db Beginner) (driver.Span[pgx.Tx], any, error) {
	switch h := db.(type) {
	case *pgxpool.Pool:
		if h == nil {
			return nil, nil, errNilDB
		}
		return &span{d: d, pool: h}, h, nil
	case *pgx.Conn:
		if err := d.CheckDB(h, false); err != nil {
			return nil, nil, err
		}
		return &span{d: d, conn: h}, nil, nil
	}
	return nil, nil, d.CheckDB(db, false)
}

// span is where one call claims its key, runs fn and stores the outcome:
// Do's savepoint in the caller's transaction (pool and conn nil), or
// DoInTx's own transactions on conn, one per round, each begun with
// txOptions by the claim's batch.
type span struct {
	d  *Driver
	tx pgx.Tx // Do: the caller's; DoInTx: the current own transaction
	// DoInTx: the connection of its transactions; on a pool (pool), the
	// one the claim acquired (pooled), nil once given back.
	conn   *pgx.Conn
	pool   *pgxpool.Pool
	pooled *pgxpool.Conn
	// The batch of every round trip in turn, with room for the longest,
	// and the fingerprint the statements take: kept here, a call allocates
	// them with the span, once.
	batch pgx.Batch
	queue [4]*pgx.QueuedQuery
	fp    [32]byte
	citus bool // the last claim's form, which the completion follows
	// The TTL (µs) the last claim wrote, which the completion writes
	// again: TTLFor is read once a claim, and may answer otherwise later.
	ttl int64
}

// own reports whether the span is DoInTx's, in transactions of its own.
func (s *span) own() bool { return s.pool != nil || s.conn != nil }

// Claim begins the span and claims the key, and returns the transaction
// it runs in. The round trips it takes:
//   - DoInTx: BEGIN and the claim, on a connection acquired from the pool
//     first when the span holds none. Whatever pgx prepares or describes
//     before sending them runs outside any transaction, and so does the
//     question whether the database is Citus (on a new connection for this
//     Client): when that fails, or BEGIN does, begun is false and there is
//     nothing to undo.
//   - Do where pgx prepares nothing before a claim: once whether the
//     database is Citus is known (to the connection or the Client), in
//     the exec modes exec and simple_protocol, and in cache_statement and
//     cache_describe when the last claim batch of the same form (Citus or
//     not, fresh claim or take-over) succeeded on this connection, so pgx
//     has its statements cached: SAVEPOINT and the claim. Before them pgx
//     prepares (cache_statement) or describes (cache_describe) the
//     statement SAVEPOINT itself, in a round trip of its own in the
//     caller's transaction, when it has not cached it: on the first such
//     Do on a connection, and on the first such Do after a claim failed
//     there. SAVEPOINT reads no table and takes no lock, so nothing there
//     waits; a cancellation or a broken connection in that round trip
//     fails in the caller's transaction, and Do then answers with an error
//     that is no refusal (begun is false).
//   - Do otherwise: the SAVEPOINT alone first (in the simple protocol:
//     nothing to prepare), then inside it the question whether the
//     database is Citus, if not known yet, and the claim, with whatever pgx
//     prepares or describes first. So a lock wait or a cancelled statement
//     there fails inside the savepoint, which Do undoes, and never in the
//     caller's transaction outside it.
//
// pgx drops every statement of a batch that failed from its caches (the
// failed claim, but also one refused after a lock wait or cancelled), so a
// claim batch that fails makes its form cold again on the connection (see
// connState.sent). What this cannot see is pgx evicting the statements from
// a full cache (StatementCacheCapacity, DescriptionCacheCapacity): pgx then
// prepares them again before the batch, in the caller's transaction, and a
// failure there is an error that is no refusal.
func (s *span) Claim(ctx context.Context, c driver.Claim) (tx pgx.Tx, claimed, begun bool, err error) {
	s.fp = c.Fingerprint
	b := s.reset()
	if s.own() {
		if s.conn == nil {
			if s.pooled, err = s.pool.Acquire(ctx); err != nil {
				return nil, false, false, fmt.Errorf("begin: %w", err)
			}
			s.conn = s.pooled.Conn()
		}
		st, citus, err := s.d.connCitus(ctx, s.conn)
		if err != nil {
			return nil, false, false, fmt.Errorf("claim: %w", err)
		}
		b.BeginTx(s.d.txOptions)
		s.ttl = s.d.queueClaim(b, c, s.fp[:], citus)
		return s.sendClaim(ctx, s.conn, st, s.d.claimForm(citus, c), true, citus)
	}

	var st *connState
	warm, citus := true, false
	if conn := s.tx.Conn(); conn != nil { // (a pgx.Tx of another making may have none: plain PostgreSQL)
		// A closed transaction's connection may serve another call by
		// now: its state is read under its lock, and the batch that
		// finds the transaction closed changes nothing (connState.sent).
		st = s.d.state(conn)
		var known, formWarm bool
		citus, known, formWarm = s.d.claimState(st, c)
		warm = known && (!st.prepares || formWarm)
	}
	if warm {
		b.Queue(sqlSavepoint)
		s.ttl = s.d.queueClaim(b, c, s.fp[:], citus)
		return s.sendClaim(ctx, s.tx, st, s.d.claimForm(citus, c), true, citus)
	}

	if _, err := s.tx.Exec(ctx, sqlSavepoint, pgx.QueryExecModeSimpleProtocol); err != nil {
		return s.tx, false, false, fmt.Errorf("claim: %w", err)
	}
	if citus, err = s.d.isCitus(ctx, st, s.tx); err != nil {
		return s.tx, false, true, fmt.Errorf("claim: %w", err)
	}
	s.ttl = s.d.queueClaim(b, c, s.fp[:], citus)
	return s.sendClaim(ctx, s.tx, st, s.d.claimForm(citus, c), false, citus)
}

// batchSender sends a batch: a connection or a transaction.
type batchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// sendClaim sends the span's batch, a claim of form, on q, and reads it;
// opens: the batch begins with BEGIN or SAVEPOINT, and begun says whether
// that ran. Whether the batch succeeded goes to st (see connState.sent).
func (s *span) sendClaim(ctx context.Context, q batchSender, st *connState, form string, opens, citus bool) (tx pgx.Tx, claimed, begun bool, err error) {
	s.citus = citus
	br := q.SendBatch(ctx, &s.batch)
	if s.own() {
		s.tx = br.Tx()
	}
	begun = true
	if opens {
		_, err = br.Exec()
		begun = err == nil
	}
	if begun {
		claimed, err = readClaim(br, citus)
	}
	err = closeBatch(br, err)
	st.sent(form, err)
	if !begun { // nothing to undo
		return s.tx, false, false, fmt.Errorf("claim: %w", err)
	}
	return s.tx, claimed, true, claimError(err)
}

// connCitus is state and isCitus for conn, in one call: DoInTx's claim
// reads both before it sends anything.
func (d *Driver) connCitus(ctx context.Context, conn *pgx.Conn) (*connState, bool, error) {
	st := d.state(conn)
	citus, err := d.isCitus(ctx, st, conn)
	return st, citus, err
}

// sent records that a claim batch of form was sent on st's connection and
// ended with err. pgx keeps the statements of a batch that succeeded in its
// cache, and drops every statement of a batch that failed, whatever failed
// (a lock wait that ran out, a cancellation, SAVEPOINT or BEGIN): so the
// form is warm exactly when its last batch succeeded. The claim's
// statements go in claim batches only (see Driver.sqlClaimWait), so no
// other batch's failure drops them. A batch refused because its
// transaction was closed (pgx.ErrTxClosed) was never sent, on a connection
// that may serve another call by now: it changes nothing. st is nil for a
// pgx.Tx without a connection.
func (st *connState) sent(form string, err error) {
	if st == nil || !st.caches || errors.Is(err, pgx.ErrTxClosed) {
		return
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if warm := err == nil; warm != st.warm[form] {
		if warm {
			st.warm[form] = true
		} else {
			delete(st.warm, form)
		}
	}
}

// claimForm names the claim batch of c (Driver.claimForms).
func (d *Driver) claimForm(citus bool, c driver.Claim) string {
	return d.claimForms[b2i(citus)][b2i(c.TakeOver)]
}

// claimError labels the failure of a claim.
func claimError(err error) error {
	if err != nil {
		return fmt.Errorf("claim: %w", err)
	}
	return nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// reset empties the span's batch for the next round trip, keeping the room
// of its queue (the queued statements of a sent batch are no longer read
// once its results are closed).
func (s *span) reset() *pgx.Batch {
	s.batch = pgx.Batch{QueuedQueries: s.queue[:0]}
	return &s.batch
}

// queueClaim queues the claim of c.Key in b, bounded by the Client's Wait:
// a fresh claim, or the take-over of a row that is over. On PostgreSQL the
// bound is set, and the caller's lock_timeout restored, by the statement
// itself (see KeyClaim). On Citus the wait happens on the worker, which
// only SET LOCAL statements reach: lock_timeout is set to Wait before the
// claim and back to its default after it. The statements are sqlc's (their
// text and the order of their arguments: internal/db's KeyClaim,
// KeyTakeOver, KeyClaimCitus, KeyTakeOverCitus), queued here rather than
// through the generated methods, so that a call reads its round trips in
// this file (docs/development.md, the walk of a call);
// TestQueuedStatementsAreSqlcs holds them to the generated methods. It
// returns the TTL (µs) it queued, which the span's completion writes again
// (TTLFor may answer otherwise by then: TestTTLForChangingMidCall).
func (d *Driver) queueClaim(b *pgx.Batch, c driver.Claim, fp []byte, citus bool) (ttl int64) {
	k := c.Key
	ttl, body := d.ttlOf(k.Operation)
	switch {
	case citus && c.TakeOver:
		b.Queue(d.sqlClaimWait)
		b.Queue(db.KeyTakeOverCitus, k.Actor, k.Operation, k.Key, fp, ttl, body)
		b.Queue(sqlWaitDefault)
	case citus:
		b.Queue(d.sqlClaimWait)
		b.Queue(db.KeyClaimCitus, k.Actor, k.Operation, k.Key, fp, ttl, body)
		b.Queue(sqlWaitDefault)
	case c.TakeOver:
		b.Queue(db.KeyTakeOver, k.Actor, k.Operation, k.Key, fp, ttl, body, d.lockTimeout)
	default:
		b.Queue(db.KeyClaim, k.Actor, k.Operation, k.Key, fp, ttl, body, d.lockTimeout)
	}
	return ttl
}

// ttlOf is the TTL of operation's keys in microseconds, and the life of
// the body its claim stores (0: the key's), as Settings.TTL and
// Settings.BodyTTL give them (TestTTLOfIsSettingsTTL), spelled out here so
// that a call's round trips read in this file.
func (d *Driver) ttlOf(operation string) (ttl, body int64) {
	ttl = d.ttl.TTLMicros
	if d.ttl.TTLFor != nil {
		if t := d.ttl.TTLFor(operation).Microseconds(); t > 0 {
			ttl = t
		}
	}
	body = d.ttl.BodyTTLMicros
	if d.ttl.BodyTTLFor != nil {
		if t := d.ttl.BodyTTLFor(operation).Microseconds(); t > 0 {
			body = t
		}
	}
	if body >= ttl {
		body = 0
	}
	return ttl, body
}

// readClaim reads the results of what queueClaim queued: whether the key is
// now claimed by this transaction. (All four claims return the same single
// column.)
func readClaim(br pgx.BatchResults, citus bool) (claimed bool, err error) {
	if citus {
		if _, err = br.Exec(); err != nil {
			return false, err
		}
	}
	err = br.QueryRow().Scan(&claimed)
	if errors.Is(err, pgx.ErrNoRows) {
		claimed, err = false, nil
	}
	if err == nil && citus {
		_, err = br.Exec()
	}
	return claimed, err
}

// Complete stores the outcome and ends the span, in one round trip: the
// completion, then RELEASE (Do) or COMMIT (DoInTx), which does not run
// when the completion fails. DoInTx's pooled connection goes back to the
// pool when the COMMIT succeeded.
func (s *span) Complete(ctx context.Context, out driver.Outcome) error {
	b := s.reset()
	s.d.queueComplete(b, out, s.fp[:], s.ttl, s.citus)
	if !s.own() {
		b.Queue(sqlRelease)
	} else {
		b.Queue("COMMIT")
	}
	br := s.tx.SendBatch(ctx, b)
	_, err := br.Exec()
	if err != nil {
		err = fmt.Errorf("store response: %w", dberr.Interpret(err))
	} else {
		err = s.ended(br.Exec())
	}
	if err = closeBatch(br, err); err == nil {
		s.Close()
	}
	return err
}

// queueComplete queues the completion of out in b, with the TTL (µs) of
// the claim: internal/db's KeyComplete, or KeyCompleteCitus on Citus (their
// text and the order of their arguments, as queueClaim's;
// TestQueuedStatementsAreSqlcs), read in Complete.
func (d *Driver) queueComplete(b *pgx.Batch, out driver.Outcome, fp []byte, ttl int64, citus bool) {
	k, r := out.Key, out.Reply
	sql := db.KeyComplete
	if citus {
		sql = db.KeyCompleteCitus
	}
	b.Queue(sql, k.Actor, k.Operation, k.Key, fp, out.Status, ttl,
		r.Status, pgtype.Text{String: r.Headers, Valid: r.HasHeaders}, r.Body)
}

// ended checks the result of the statement that ends the span: RELEASE, or
// COMMIT (whose tag says ROLLBACK when the transaction was aborted).
func (s *span) ended(tag pgconn.CommandTag, err error) error {
	if !s.own() {
		if err != nil {
			return fmt.Errorf("release: %w", err)
		}
		return nil
	}
	if err == nil && tag.String() == "ROLLBACK" {
		err = pgx.ErrTxCommitRollback
	}
	if err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// Read reads the committed row that holds k and ends the span, in one
// round trip: the planner setting and the read, then ROLLBACK TO and
// RELEASE (Do) or COMMIT (DoInTx), which undo the setting and the claim's
// lock_timeout. DoInTx's pooled connection goes back to the pool when the
// COMMIT succeeded.
func (s *span) Read(ctx context.Context, k driver.Key) (row driver.Row, found bool, err error) {
	b := s.reset()
	b.Queue(sqlIndexLookup)
	_, _ = queries.KeyGet(context.Background(), queuer{b},
		db.KeyGetParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	if !s.own() {
		b.Queue(sqlRollbackTo)
		b.Queue(sqlRelease)
	} else {
		b.Queue("COMMIT")
	}
	br := s.tx.SendBatch(ctx, b)
	_, err = br.Exec()
	var r db.KeyGetRow
	if err == nil {
		r, err = queries.KeyGet(context.Background(), batchRead{br}, db.KeyGetParams{})
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if err == nil && !s.own() {
		if _, err = br.Exec(); err == nil {
			_, err = br.Exec()
		}
	} else if err == nil {
		err = s.ended(br.Exec())
	}
	if err = closeBatch(br, err); err != nil {
		return row, false, fmt.Errorf("read key: %w", err)
	}
	s.Close()
	if !found {
		return row, false, nil
	}
	row = driver.Row{Fingerprint: r.Fingerprint, Status: r.Status, Stored: stored(r.ResponseStatus, r.ResponseHeaders, r.ResponseBody)}
	row.Judge(driver.KeyTimes{Now: r.Now.Time, ExpiresAt: timeOf(r.ExpiresAt), LeaseExpiresAt: timeOf(r.LeaseExpiresAt),
		BodyExpiresAt: timeOf(r.BodyExpiresAt)})
	return row, found, nil
}

// timeOf is a time KeyGet read, for Row.Judge: PostgreSQL's infinities
// (which idem never writes, an operator might) as times beyond any clock,
// as PostgreSQL compares them; NULL as the zero time.
func timeOf(t pgtype.Timestamptz) time.Time {
	switch t.InfinityModifier {
	case pgtype.Infinity:
		return time.Date(294276, 1, 1, 0, 0, 0, 0, time.UTC)
	case pgtype.NegativeInfinity:
		return time.Date(-4713, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	return t.Time
}

// stored is a response as read from its columns.
func stored(status pgtype.Int4, headers, body []byte) driver.Stored {
	return driver.Stored{Valid: status.Valid, Status: status.Int32, Headers: headers, Body: body}
}

// storedOrGone is stored with a row's body_gone: a gone body keeps only
// its status.
func storedOrGone(status pgtype.Int4, headers, body []byte, gone bool) driver.Stored {
	if gone {
		return driver.Stored{Valid: status.Valid, Status: status.Int32, Gone: true}
	}
	return stored(status, headers, body)
}

// Undo undoes the span, even when ctx is done: Do rolls the caller's
// transaction back to its savepoint and drops it; DoInTx rolls its own
// transaction back (none when it did not begin), and says when fn had
// ended it already (pgx.ErrTxClosed).
func (s *span) Undo(ctx context.Context) error {
	if s.own() {
		if s.tx != nil && rollback(ctx, s.tx) == pgx.ErrTxClosed {
			return fmt.Errorf("rollback: %w", pgx.ErrTxClosed)
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), driver.CleanupTimeout)
	defer cancel()
	if _, err := s.tx.Exec(ctx, sqlUndo); err != nil {
		return fmt.Errorf("undo: %w", err)
	}
	return nil
}

// rollback rolls tx back, even when ctx is done. A transaction that a
// batch already ended answers with a warning only; one that was committed
// or rolled back through tx answers pgx.ErrTxClosed, and is the only error
// returned.
func rollback(ctx context.Context, tx pgx.Tx) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), driver.CleanupTimeout)
	defer cancel()
	if err := tx.Rollback(ctx); errors.Is(err, pgx.ErrTxClosed) {
		return pgx.ErrTxClosed
	}
	return nil
}

// Orphaned turns the row a committed claim left without an outcome
// unknown, in a statement of its own on DoInTx's own connection (on a
// pool, the one the span holds, or else one of the pool's), and reads the
// row when it marked none.
func (s *span) Orphaned(ctx context.Context, k driver.Key, fp [32]byte, reason string) (int64, driver.Record, error) {
	if !s.own() {
		return 0, driver.Record{}, errors.New("a savepoint has no connection of its own")
	}
	var q db.DBTX = s.pool
	if s.conn != nil {
		q = s.conn
	}
	n, err := markUnknown(ctx, q, k, fp, reason)
	if err != nil || n == 1 {
		return n, driver.Record{}, err
	}
	row, err := queries.KeyLookup(ctx, planned{q}, db.KeyLookupParams{Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key})
	return 0, record(row.IdemKey), noRows(err)
}

// markUnknown runs KeyMarkUnknown on q.
func markUnknown(ctx context.Context, q db.DBTX, k driver.Key, fp [32]byte, reason string) (int64, error) {
	return queries.KeyMarkUnknown(ctx, planned{q}, db.KeyMarkUnknownParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: fp[:], Reason: reason,
	})
}

// Enclosing makes sure that a transaction enclosing Do's savepoint, which
// fn ended, cannot commit the claim (see driver.Span): when tx was a
// savepoint of a transaction still open on its connection, KeyAbortIfClaimed
// runs in that transaction, and aborts it when the claim is there. The
// connection is read only when it is still the caller's (callersConn); a
// pgx.Tx of another making is not read (EnclosingNotRead).
func (s *span) Enclosing(ctx context.Context, k driver.Key, fp [32]byte) (driver.Enclosing, error) {
	if s.own() {
		return driver.NoEnclosing, nil
	}
	conn, read := callersConn(s.tx)
	switch {
	case !read:
		return driver.EnclosingNotRead, nil
	case conn == nil:
		return driver.NoEnclosing, nil
	}
	switch conn.PgConn().TxStatus() {
	case 'T':
	case 'E': // aborted already: it cannot commit
		return driver.EnclosingUnknown, nil
	default: // idle: tx was the connection's transaction itself
		return driver.NoEnclosing, nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), driver.CleanupTimeout)
	defer cancel()
	_, err := queries.KeyAbortIfClaimed(ctx, planned{conn}, db.KeyAbortIfClaimedParams{
		Actor: k.Actor, Operation: k.Operation, IdemKey: k.Key, Fingerprint: fp[:],
	})
	switch {
	case err == nil:
		return driver.EnclosingUsable, nil
	case errors.Is(dberr.Interpret(err), driver.ErrClaimReleased):
		return driver.EnclosingAborted, nil
	}
	return driver.EnclosingUnknown, fmt.Errorf("abort the enclosing transaction: %w", err)
}

// The import paths of pgx's own transactions and pgxpool's.
var (
	pgxPackage     = reflect.TypeFor[pgx.Conn]().PkgPath()
	pgxpoolPackage = reflect.TypeFor[pgxpool.Pool]().PkgPath()
)

// callersConn returns the connection of tx, ended by fn, when the caller
// still holds it: tx is one of pgx's own transactions (a *pgx.Conn's, or a
// savepoint begun on a pgx.Tx), which give nothing back when they end. A
// *pgxpool.Tx, never a savepoint, gives its connection back to the pool
// when it ends (nil). read is false for a pgx.Tx of another making, which
// may have been a savepoint and may have given its connection back too:
// that connection may serve another call by now, and is never read.
func callersConn(tx pgx.Tx) (conn *pgx.Conn, read bool) {
	t := reflect.TypeOf(tx)
	if t == nil || t.Kind() != reflect.Pointer {
		return nil, false
	}
	switch t.Elem().PkgPath() {
	case pgxPackage:
		return tx.Conn(), true
	case pgxpoolPackage:
		return nil, true
	}
	return nil, false
}

// Lost reports whether DoInTx's connection is closed: the server went away
// or the connection broke.
// (A span that gave its connection back is not lost: the core asks only
// while the span holds it.)
func (s *span) Lost() bool { return s.conn != nil && s.conn.IsClosed() }

// Close gives back the pooled connection of DoInTx on a pool, if the span
// holds one.
func (s *span) Close() {
	if s.pooled != nil {
		s.pooled.Release()
		s.pooled, s.conn, s.tx = nil, nil, nil
	}
}

// sqlHasCitus asks whether the database has the citus extension.
const sqlHasCitus = "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"

// Querier runs a query: a connection, a pool's connection or a
// transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// HasCitus reports whether the citus extension is installed in the
// database of q. The statement goes in the simple protocol: nothing to
// prepare.
func HasCitus(ctx context.Context, q Querier) (bool, error) {
	var citus bool
	err := q.QueryRow(ctx, sqlHasCitus, pgx.QueryExecModeSimpleProtocol).Scan(&citus)
	return citus, err
}

// closeBatch closes br and returns err, or the error of closing when err is
// nil: the first error of the batch.
func closeBatch(br pgx.BatchResults, err error) error {
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	return err
}

// What the driver knows of a connection: the span reads
// it before each claim and records what the claim batch left in pgx's
// caches.

// connState is what the driver knows of one connection: made once per
// connection, then read on every call. It is safe for concurrent use: Do
// on a caller's transaction reads the state of the transaction's connection
// before it knows whether the transaction is still open, and a pool's
// transaction that was committed or rolled back has given its connection to
// other calls already (pgxpool.Tx.Conn still returns it).
type connState struct {
	db citusKey
	// prepares: pgx prepares or describes a batch's statements that it has
	// not cached in a round trip of its own before the batch (its exec
	// modes cache_statement, cache_describe, describe_exec); caches: and
	// keeps them (not describe_exec).
	prepares, caches bool

	mu    sync.Mutex
	known bool // citus is known
	citus bool
	// warm names the claim batches (Driver.claimForms) whose last run on
	// this connection succeeded: their statements are in pgx's cache
	// unless it evicted them since (see sent).
	warm map[string]bool
}

// citusKnown returns whether the connection's database runs Citus, and
// whether that is known.
func (st *connState) citusKnown() (citus, known bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.citus, st.known
}

// learn records whether the connection's database runs Citus.
func (st *connState) learn(citus bool) {
	st.mu.Lock()
	st.known, st.citus = true, citus
	st.mu.Unlock()
}

// claimState reports, under one lock, whether the connection's database
// runs Citus, whether that is known (from this connection, or else from
// d's Client-wide knowledge, which it then learns), and whether the claim
// batch of c was warm on the connection then.
func (d *Driver) claimState(st *connState, c driver.Claim) (citus, known, warm bool) {
	st.mu.Lock()
	citus, known = st.citus, st.known
	if known {
		warm = st.warm[d.claimForm(citus, c)]
	}
	st.mu.Unlock()
	if known {
		return citus, true, warm
	}
	v, ok := d.citus.Load(st.db)
	if !ok {
		return false, false, false
	}
	citus = v.(bool)
	st.mu.Lock()
	defer st.mu.Unlock()
	st.known, st.citus = true, citus
	return citus, true, st.warm[d.claimForm(citus, c)]
}

// conns holds the state of every connection the driver has seen (of every
// Client: what pgx caches is the connection's), by a weak pointer to its
// pgconn.PgConn. An entry goes when its connection is garbage collected.
// A sync.Map: every call reads it, and its keys live as long as their
// connections, the case sync.Map reads without a lock.
var conns sync.Map // weak.Pointer[pgconn.PgConn] -> *connState

// state returns what the driver knows of conn, sending nothing. It reads
// nothing of conn that changes while another call uses it.
func (d *Driver) state(conn *pgx.Conn) *connState {
	pc := conn.PgConn()
	k := weak.Make(pc)
	v, ok := conns.Load(k)
	if !ok {
		var loaded bool
		v, loaded = conns.LoadOrStore(k, newConnState(conn))
		if !loaded {
			runtime.AddCleanup(pc, forgetConn, k)
		}
	}
	return v.(*connState)
}

// newConnState is the state of a connection the driver has not seen yet.
func newConnState(conn *pgx.Conn) *connState {
	cfg := conn.Config() // a copy: once per connection
	st := &connState{db: citusKey{host: cfg.Host, port: cfg.Port, database: cfg.Database}, warm: map[string]bool{}}
	switch cfg.DefaultQueryExecMode {
	case pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe:
		st.prepares, st.caches = true, true
	case pgx.QueryExecModeDescribeExec:
		st.prepares = true
	}
	return st
}

// forgetConn drops the state of a connection that was garbage collected.
func forgetConn(k weak.Pointer[pgconn.PgConn]) { conns.Delete(k) }

// isCitus reports whether the database of st's connection has the citus
// extension, asking q (the connection, or a transaction on it) when neither
// the connection nor this Client knows.
func (d *Driver) isCitus(ctx context.Context, st *connState, q Querier) (bool, error) {
	if citus, known := st.citusKnown(); known {
		return citus, nil
	}
	if citus, ok := d.citus.Load(st.db); ok {
		st.learn(citus.(bool))
		return citus.(bool), nil
	}
	citus, err := HasCitus(ctx, q)
	if err != nil {
		return false, err
	}
	d.citus.Store(st.db, citus)
	st.learn(citus)
	return citus, nil
}
