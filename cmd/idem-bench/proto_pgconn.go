package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem"
)

// pgconnDo is a prototype of Do's fresh path written against pgconn
// instead of pgx.Batch: the statements of p-do-sp (SAVEPOINT, claim,
// SAVEPOINT | fn | completion, RELEASE) as prepared statements in a
// pgconn.Batch, parameters encoded into one reused buffer. It exists to
// count the allocations such a core would make; it handles only the fresh
// path.
type pgconnDo struct {
	claim, complete, spClaim, spFn, release *pgconn.StatementDescription

	buf    []byte
	params [][]byte
}

// Formats of the parameters: text, except the bytea ones (binary).
var (
	claimFormats    = []int16{0, 0, 0, 1, 0}
	completeFormats = []int16{0, 0, 0, 0, 0, 1}
)

func preparePgconnDo(ctx context.Context, conn *pgx.Conn) (*pgconnDo, error) {
	p := &pgconnDo{}
	for _, s := range []struct {
		dst       **pgconn.StatementDescription
		name, sql string
	}{
		{&p.claim, "idem_bench_p_claim", protoClaim},
		{&p.complete, "idem_bench_p_complete", twoTxComplete},
		{&p.spClaim, "idem_bench_p_sp_claim", "SAVEPOINT idem_claim"},
		{&p.spFn, "idem_bench_p_sp_fn", "SAVEPOINT idem_fn"},
		{&p.release, "idem_bench_p_release", "RELEASE SAVEPOINT idem_claim"},
	} {
		sd, err := conn.Prepare(ctx, s.name, s.sql)
		if err != nil {
			return nil, err
		}
		*s.dst = sd
	}
	return p, nil
}

// encode lays out values in p.buf and points p.params at them.
func (p *pgconnDo) encode(values ...[]byte) [][]byte {
	p.buf = p.buf[:0]
	for _, v := range values {
		p.buf = append(p.buf, v...)
	}
	p.params = p.params[:0]
	off := 0
	for _, v := range values {
		p.params = append(p.params, p.buf[off:off+len(v):off+len(v)])
		off += len(v)
	}
	return p.params
}

func (p *pgconnDo) do(ctx context.Context, tx pgx.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(context.Context, pgx.Tx) (idem.Response, error)) error {
	pg := tx.Conn().PgConn()
	var num [20]byte
	var bt pgconn.Batch
	bt.ExecStatement(p.spClaim, nil, nil, nil)
	bt.ExecStatement(p.claim, p.encode([]byte(scope.Actor), []byte(scope.Operation), []byte(key), fp[:],
		strconv.AppendInt(num[:0], ttlMicros, 10)), claimFormats, nil)
	bt.ExecStatement(p.spFn, nil, nil, nil)
	claimed, err := readBatch(pg.ExecBatch(ctx, &bt), 1)
	if err != nil {
		return err
	}
	if !claimed {
		return fmt.Errorf("%w: fresh key %s already claimed", errUnexpected, key)
	}

	resp, err := fn(ctx, tx)
	if err != nil {
		return err
	}
	hdr, err := json.Marshal(resp.Header)
	if err != nil {
		return err
	}
	bt = pgconn.Batch{}
	bt.ExecStatement(p.complete, p.encode([]byte(scope.Actor), []byte(scope.Operation), []byte(key),
		strconv.AppendInt(num[:0], int64(resp.Status), 10), hdr, resp.Body), completeFormats, nil)
	bt.ExecStatement(p.release, nil, nil, nil)
	_, err = readBatch(pg.ExecBatch(ctx, &bt), -1)
	return err
}

// readBatch reads every result of a batch and reports whether the result
// numbered rowsOf returned a row.
func readBatch(mrr *pgconn.MultiResultReader, rowsOf int) (bool, error) {
	got := false
	for i := 0; mrr.NextResult(); i++ {
		rr := mrr.ResultReader()
		for rr.NextRow() {
			if i == rowsOf {
				got = true
			}
		}
		if _, err := rr.Close(); err != nil {
			_ = mrr.Close()
			return false, err
		}
	}
	if err := mrr.Close(); err != nil {
		return false, err
	}
	return got, nil
}

// pgxBatchDo is the same prototype with pgx.Batch, as the core sends its
// statements today, for comparison.
func pgxBatchDo(ctx context.Context, tx pgx.Tx, scope idem.Scope, key string, fp idem.Fingerprint,
	fn func(context.Context, pgx.Tx) (idem.Response, error)) error {
	bt := &pgx.Batch{}
	bt.Queue("SAVEPOINT idem_claim")
	bt.Queue(protoClaim, scope.Actor, scope.Operation, key, fp[:], ttlMicros)
	bt.Queue("SAVEPOINT idem_fn")
	br := tx.SendBatch(ctx, bt)
	_, err := br.Exec()
	var expires pgtype.Timestamptz
	if err == nil {
		err = br.QueryRow().Scan(&expires)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		err = fmt.Errorf("%w: fresh key %s already claimed", errUnexpected, key)
	}
	err = closeBatch(br, err)
	if err != nil {
		return err
	}
	resp, err := fn(ctx, tx)
	if err != nil {
		return err
	}
	hdr, err := json.Marshal(resp.Header)
	if err != nil {
		return err
	}
	bt = &pgx.Batch{}
	bt.Queue(twoTxComplete, scope.Actor, scope.Operation, key, resp.Status, hdr, resp.Body)
	bt.Queue("RELEASE SAVEPOINT idem_claim")
	return tx.SendBatch(ctx, bt).Close()
}
