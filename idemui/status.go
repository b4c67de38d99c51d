package idemui

import (
	"context"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	store "github.com/pgidem/idem/internal/db"
)

// Lists of the records of one status across actors ({prefix}/status and
// api/status). Each page reads a bounded part of an index, whatever the
// table holds: the failed records walk their partial index
// (idem_keys_failed_idx, migration 10), newest outcome first; the other
// statuses walk idem_keys_expires_at_idx, the latest expiry first, reading
// at most statusScanRows rows a page, so that a rare status gives short (even
// empty) pages with a next position rather than one slow page. The
// records that need a person have their own list ({prefix}/unknown).

// statusScanRows bounds the rows a page of a status other than failed
// reads.
const statusScanRows = 5000

type statusCursor struct {
	At        time.Time `json:"t"`
	Actor     string    `json:"a"`
	Operation string    `json:"o"`
	Key       string    `json:"k"`
}

func (cur *statusCursor) check() error {
	if !cursorTime(cur.At) || !cursorName(cur.Actor) || !cursorName(cur.Operation) || !cursorName(cur.Key) {
		return errDamagedCursor()
	}
	return nil
}

// readStatus reads a page of the records of status across actors, after
// the position after ("" for the first page). next is the position of the
// next page ("" at the end); walked is true when the page's walk stopped
// at its bound rather than at the page's size (a status other than
// failed).
func readStatus(ctx context.Context, db idem.Beginner, status idem.Status, after string, limit int) (items []scopeItem, next string, walked bool, err error) {
	var cur statusCursor
	if after != "" {
		if err := decodeCursor(after, &cur); err != nil {
			return nil, "", false, err
		}
	}
	now := time.Now()
	item := func(actor, operation, key, st string, token int64, created, completed, expires, lease pgtype.Timestamptz, lastError string) scopeItem {
		return scopeItem{Actor: actor, Operation: operation, Key: key, Status: st, Token: token,
			CreatedAt: created.Time, CompletedAt: timePtr(completed), ExpiresAt: expires.Time,
			LeaseExpiresAt: timePtr(lease), LastError: lastError,
			LeaseRanOut: st == string(idem.StatusProcessing) && lease.Valid && !lease.Time.After(now)}
	}
	err = audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		if status == idem.StatusFailedRetryable {
			arg := store.ConsoleFailedKeysParams{BeforeCompletedAt: pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true}, MaxRows: int32(limit + 1)}
			if after != "" {
				arg.BeforeCompletedAt = pgtype.Timestamptz{Time: cur.At, Valid: true}
				arg.BeforeActor, arg.BeforeOperation, arg.BeforeKey = cur.Actor, cur.Operation, cur.Key
			}
			rows, err := queries.ConsoleFailedKeys(ctx, q, arg)
			if err != nil {
				return err
			}
			for i, r := range rows {
				if i == limit {
					last := rows[i-1]
					next = encodeCursor(statusCursor{At: last.CompletedAt.Time, Actor: last.Actor, Operation: last.Operation, Key: last.IdemKey})
					break
				}
				items = append(items, item(r.Actor, r.Operation, r.IdemKey, r.Status, r.Token, r.CreatedAt, r.CompletedAt, r.ExpiresAt, r.LeaseExpiresAt, r.LastError.String))
			}
			return nil
		}
		arg := store.ConsoleStatusKeysParams{BeforeExpiresAt: pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true},
			ScanRows: statusScanRows, Status: string(status), MaxRows: int32(limit + 1)}
		if after != "" {
			arg.BeforeExpiresAt = pgtype.Timestamptz{Time: cur.At, Valid: true}
			arg.BeforeActor, arg.BeforeOperation, arg.BeforeKey = cur.Actor, cur.Operation, cur.Key
		}
		rows, err := queries.ConsoleStatusKeys(ctx, q, arg)
		if err != nil {
			return err
		}
		var edge *store.ConsoleStatusKeysRow
		for i := range rows {
			r := &rows[i]
			if r.Edge {
				edge = r
			}
			if !r.Match {
				continue
			}
			if len(items) == limit {
				last := items[len(items)-1]
				next = encodeCursor(statusCursor{At: last.ExpiresAt, Actor: last.Actor, Operation: last.Operation, Key: last.Key})
				continue
			}
			items = append(items, item(r.Actor, r.Operation, r.IdemKey, r.Status, r.Token, r.CreatedAt, r.CompletedAt, r.ExpiresAt, r.LeaseExpiresAt, r.LastError.String))
		}
		if next == "" && edge != nil && edge.WalkedRows >= statusScanRows {
			next = encodeCursor(statusCursor{At: edge.ExpiresAt.Time, Actor: edge.Actor, Operation: edge.Operation, Key: edge.IdemKey})
			walked = true
		}
		return nil
	})
	return items, next, walked, err
}

type statusView struct {
	Status  idem.Status
	Items   []scopeItem
	NextURL string
	// Walked: the page stopped after reading its bound of keys, not after
	// filling up: the next page goes on from there.
	Walked   bool
	ScanRows int64
	Failed   bool
}

// statusQuery reads the status and position of a list by status.
func statusQuery(vs url.Values) (idem.Status, string, error) {
	s, err := one(vs, "status")
	if err != nil {
		return "", "", err
	}
	status := idem.Status(s)
	if !slices.Contains(statuses, status) {
		return "", "", badRequest("invalid_status", "Give a status: unknown, processing, succeeded, rejected or failed_retryable.")
	}
	after, err := one(vs, "after")
	return status, after, err
}

func (q *request) statusPage() {
	status, after, err := statusQuery(q.r.URL.Query())
	if err != nil {
		q.fail(err)
		return
	}
	items, next, walked, err := readStatus(q.r.Context(), q.c.opts.DB, status, after, pageSize)
	if err != nil {
		q.fail(err)
		return
	}
	v := statusView{Status: status, Items: items, Walked: walked, ScanRows: statusScanRows,
		Failed: status == idem.StatusFailedRetryable}
	if next != "" {
		v.NextURL = q.url("/status", url.Values{"status": {string(status)}, "after": {next}})
	}
	q.page(http.StatusOK, "status", "Keys: "+string(status), "overview", v, nil)
}

func (q *request) statusAPI() {
	vs := q.r.URL.Query()
	limit, err := limitFrom(vs, pageSize)
	if err != nil {
		q.fail(err)
		return
	}
	status, after, err := statusQuery(vs)
	if err != nil {
		q.fail(err)
		return
	}
	items, next, walked, err := readStatus(q.r.Context(), q.c.opts.DB, status, after, limit)
	if err != nil {
		q.fail(err)
		return
	}
	if items == nil {
		items = []scopeItem{}
	}
	out := map[string]any{"keys": items, "walked": walked}
	if next != "" {
		out["next"] = next
	}
	q.ok(out)
}
