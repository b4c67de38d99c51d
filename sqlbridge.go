package idem

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem/internal/bridge"
	store "github.com/pgidem/idem/internal/db"
)

// The core that package idemsql (database/sql) shares with this package:
// see internal/bridge. Each field adapts an unexported function of this
// package to the bridge's driver-neutral rows; nothing here decides
// anything of its own.
func init() {
	bridge.Core = bridge.Funcs[*Client, Result, Response, Record]{
		Judge: func(c *Client, row bridge.Row, found bool, fp [32]byte, k bridge.Key) (Result, bridge.Next, error) {
			res, nx, err := c.judge(bridgeKeyRow(row), found, fp, rowKey{actor: k.Actor, operation: k.Operation, key: k.Key})
			switch nx {
			case nextClaim:
				return res, bridge.Claim, err
			case nextTakeOver:
				return res, bridge.TakeOver, err
			}
			return res, bridge.Done, err
		},
		Resolvable: func(status string, token, want int64, leased bool, leaseLeftMs int64) error {
			return resolvable(Status(status), token, want, leased, leaseLeftMs)
		},
		Forgettable: func(c *Client, status string, leaseRanOut bool) error {
			return c.forgettable(Status(status), leaseRanOut)
		},
		Inbox: func(c *Client, consumer, messageID string, payload []byte, nilFn bool) (bridge.Key, [32]byte, error) {
			scope, key, fp, err := c.inboxTarget(consumer, messageID, payload, nilFn)
			return bridge.Key{Actor: scope.Actor, Operation: scope.Operation, Key: key}, fp, err
		},
		Decide: func(c *Client, resp Response, fnErr error) (bridge.Outcome[Response], error) {
			out, err := c.decide(resp, fnErr)
			return bridge.Outcome[Response]{Status: string(out.status), Response: out.resp,
				Headers: out.headers.String, HasHeaders: out.headers.Valid}, err
		},
		Encode: func(c *Client, resp Response) (string, bool, error) {
			h, err := c.encodeResponse(resp)
			return h.String, h.Valid, err
		},
		Result: func(out bridge.Outcome[Response]) Result {
			return outcome{status: Status(out.Status), resp: out.Response}.result()
		},
		Record: func(r bridge.RecordRow) (Record, error) {
			row := bridgeKeyRow(r.Row)
			k := store.IdemKey{
				Actor: r.Actor, Operation: r.Operation, IdemKey: r.Key.Key,
				Fingerprint: row.Fingerprint, Status: row.Status, ResponseStatus: row.ResponseStatus,
				ResponseHeaders: row.ResponseHeaders, ResponseBody: row.ResponseBody,
				Token: r.Token, LastError: pgtype.Text{String: r.LastError, Valid: r.LastError != ""},
				ResolveReason:  pgtype.Text{String: r.ResolveReason, Valid: r.ResolveReason != ""},
				CreatedAt:      pgtype.Timestamptz{Time: r.CreatedAt, Valid: true},
				CompletedAt:    pgtype.Timestamptz{Time: r.CompletedAt, Valid: !r.CompletedAt.IsZero()},
				ExpiresAt:      pgtype.Timestamptz{Time: r.ExpiresAt, Valid: true},
				LeaseExpiresAt: pgtype.Timestamptz{Time: r.LeaseExpiresAt, Valid: !r.LeaseExpiresAt.IsZero()},
			}
			return newRecord(k)
		},
		InProgress: func(c *Client, k bridge.Key) error {
			if k == (bridge.Key{}) {
				return c.inProgress()
			}
			return c.inProgressOn(rowKey{actor: k.Actor, operation: k.Operation, key: k.Key})
		},
		JSONResponse: jsonResponse,
		DecodeInto:   decodeInto,
		CheckCursor:  checkCursor,
		CheckReason:  checkReason,
		Retryable:    isRetryable,
		Backoff:      backoff,
		Observe: func(c *Client, ctx context.Context, name, spanName string, k bridge.Key) (context.Context, bridge.Call[Result]) {
			ctx, cl := c.obs.begin(ctx, name, spanName, Scope{Actor: k.Actor, Operation: k.Operation}, k.Key)
			return ctx, &bridgeCall{cl}
		},
		CountEnd: func(c *Client, ctx context.Context, call, operation string, err error, event string) {
			c.countEnd(ctx, call, Scope{Operation: operation}, err, event)
		},
		PreparedStatementsLost: preparedStatementsLost,
		Migrate: func(ctx context.Context, db *sql.DB) error {
			return withSQLProvider(db, func(p *goose.Provider) error {
				_, err := p.Up(ctx)
				return err
			})
		},
		Count: func(c *Client, ctx context.Context, event, call, operation string, n int64) {
			c.obs.count(ctx, event, call, operation, n)
		},
	}
}

// bridgeKeyRow is a bridge.Row as judge reads it.
func bridgeKeyRow(r bridge.Row) keyRow {
	return keyRow{
		Fingerprint: r.Fingerprint, Status: r.Status,
		ResponseStatus:  pgtype.Int4{Int32: r.ResponseStatus, Valid: r.HasResponse},
		ResponseHeaders: r.ResponseHeaders, ResponseBody: r.ResponseBody,
		Expired: r.Expired, Leased: r.Leased, LeaseLeftMs: r.LeaseLeftMs,
	}
}

// bridgeCall is a call as bridge.Call.
type bridgeCall struct{ cl call }

func (b *bridgeCall) TimeFn(f func())                                { b.cl.timeFn(f) }
func (b *bridgeCall) Rejected()                                      { b.cl.rejected = true }
func (b *bridgeCall) End(ctx context.Context, res Result, err error) { b.cl.end(ctx, res, err) }
func (b *bridgeCall) EndIfPanicking(ctx context.Context)             { b.cl.endIfPanicking(ctx) }
