// Package audit changes idem's records on behalf of an operator and keeps
// the trail of it (the idem_audit table): the console (package idemui) and
// the idem CLI act through it. Each change runs in one transaction with
// its audit row: the change calls idem's public functions (Resolve, Forget,
// Prune) with that transaction, which run in savepoints of it, or runs the
// console's own statement (ExpireLeases with a filter), and the row is
// inserted before the commit. Either both commit or neither does. A refused
// change (an error) writes no row; a change that changed nothing (no lease
// to expire, no key to prune) writes none either. An action over many
// records (ExpireLeases, ResolveMany) writes a row for each record it
// changed and one for the whole action; a forget keeps a copy of the record
// it deleted. Every change waits at most LockTimeout for a row another
// transaction holds (ErrBusy).
package audit

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem"
	store "github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver"
)

// The actions of the trail (idem_audit.action). They are the names of
// idemui's actions that change something.
const (
	ActionResolve      = "resolve"
	ActionForget       = "forget"
	ActionExpireLeases = "expire_leases"
	ActionPrune        = "prune"
	ActionRetryEvent   = "retry_event"
)

// The verdicts of a resolve (idem_audit.verdict).
const (
	VerdictSucceeded = "succeeded"
	VerdictRetryable = "retryable"
)

// LeaseExpiredReason is the last_error that ExpireLeases writes, as
// idem.ExpireLeases does (the test compares the two transitions).
const LeaseExpiredReason = "lease expired before the outcome was recorded"

// MaxOperatorLength bounds an operator's name in bytes.
const MaxOperatorLength = 255

// ErrBusy means another transaction held the record, or a row the change
// needed, for longer than LockTimeout: nothing changed; try again.
var ErrBusy = errors.New("idem: the record is busy: another transaction holds it")

// LockTimeout bounds how long a change waits for a row another
// transaction holds (PostgreSQL's lock_timeout, for the change's
// transaction only) before it gives up with ErrBusy.
const LockTimeout = 3 * time.Second

// MaxReasonLength bounds an operator's reason in bytes, as idem bounds a
// verdict's.
const MaxReasonLength = idem.MaxReasonLength

// BusyError is ErrBusy in a bulk verdict (ResolveMany): Target is the
// record that another transaction held. Nothing changed, on any record.
type BusyError struct {
	Target Target
	Err    error // the ErrBusy of the record's verdict
}

func (e *BusyError) Error() string {
	return fmt.Sprintf("%v: record %q %q %q", e.Err, e.Target.Scope.Actor, e.Target.Scope.Operation, e.Target.Key)
}

func (e *BusyError) Unwrap() error { return e.Err }

// ErrChanged means the record is no longer the attempt the operator looked
// at (Forget's Attempt: another token or another start): nothing changed.
var ErrChanged = errors.New("idem: the record changed since it was read")

// Entry is one row of the trail.
type Entry struct {
	ID       int64
	At       time.Time
	Operator string
	Action   string
	// Scope and Key name the record; empty for an action over many keys.
	Scope idem.Scope
	Key   string
	// TokenBefore and TokenAfter are the record's fencing token before and
	// after the change; HasBefore and HasAfter say whether there was a
	// record (a forgotten key has none after).
	TokenBefore, TokenAfter   int64
	StatusBefore, StatusAfter idem.Status
	HasBefore, HasAfter       bool
	// Verdict is VerdictSucceeded or VerdictRetryable for a resolve.
	Verdict string
	Reason  string
	// Changed is how many records changed.
	Changed int64
	// Detail is JSON: the filter of a bulk action, the stored response's
	// status of a verdict; nil when there is nothing to add.
	Detail json.RawMessage
}

// Filter selects records that need a person: an 'unknown' record, or a
// 'processing' reservation whose lease ran out. The zero Filter matches
// them all.
type Filter struct {
	// Actor and Operation match exactly; empty matches any.
	Actor     string `json:"actor,omitempty"`
	Operation string `json:"operation,omitempty"`
	// MinAge keeps the records whose attempt started at least this long
	// ago; 0 keeps all.
	MinAge time.Duration `json:"min_age,omitempty"`
	// ErrorText keeps the records whose last error holds it, ignoring
	// case; empty keeps all.
	ErrorText string `json:"error_text,omitempty"`
	// State keeps StateUnknown records or StateLapsed ones (a reservation
	// whose lease ran out); empty keeps both.
	State string `json:"state,omitempty"`
}

// The states of Filter.State.
const (
	StateUnknown = "unknown"
	StateLapsed  = "lapsed"
)

// Check validates f: names and error text that PostgreSQL can hold, an
// age that is not negative.
func (f Filter) Check() error {
	for _, v := range [...]struct{ name, v string }{{"actor", f.Actor}, {"operation", f.Operation}, {"error text", f.ErrorText}} {
		if err := checkText(v.v, idem.MaxScopeLength); err != nil {
			return fmt.Errorf("%w: filter %s %v", idem.ErrInvalidArgument, v.name, err)
		}
	}
	if f.MinAge < 0 {
		return fmt.Errorf("%w: filter age %s is negative", idem.ErrInvalidArgument, f.MinAge)
	}
	if f.State != "" && f.State != StateUnknown && f.State != StateLapsed {
		return fmt.Errorf("%w: filter state %q is neither %q nor %q", idem.ErrInvalidArgument, f.State, StateUnknown, StateLapsed)
	}
	return nil
}

// MinAgeMicros is f.MinAge in microseconds, for the statements.
func (f Filter) MinAgeMicros() int64 { return f.MinAge.Microseconds() }

// Attempt names the attempt an operator looked at: its token and when it
// started (Record.Token, Record.CreatedAt). A record Do wrote has token 0,
// and the start tells its attempts apart.
type Attempt struct {
	Token     int64
	CreatedAt time.Time
}

// queries runs the generated statements.
var queries = store.New()

// Planned runs statements with pgx.QueryExecModeExec: each is planned for
// its values when it runs, never with a generic plan a connection cached
// while idem_keys was small (and a value such as an empty filter folds
// away).
type Planned struct{ DB store.DBTX }

func (p Planned) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return p.DB.Exec(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (p Planned) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return p.DB.Query(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (p Planned) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return p.DB.QueryRow(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

// sqlIndexWalk makes the statements after it in its transaction walk
// indexes in their order: no sequential scan, no bitmap scan of every
// matching row, no sort of them, whatever the planner's statistics say
// (gathered while the table was small, or not at all with autovacuum off).
// The settings end with the transaction.
const sqlIndexWalk = `SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),
	set_config('enable_sort', 'off', true)`

// ReadTimeout bounds each statement of a Read transaction.
const ReadTimeout = 10 * time.Second

// Read runs fn in a transaction begun on db with the index-walk settings
// and a statement timeout of ReadTimeout, and rolls it back, even when ctx
// is done (bounded by driver.CleanupTimeout, as idem's own undos): the
// console's pages read through it.
func Read(ctx context.Context, db idem.Beginner, fn func(ctx context.Context, q Planned) error) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), driver.CleanupTimeout)
		defer cancel()
		_ = tx.Rollback(ctx)
	}()
	if _, err := tx.Exec(ctx, sqlIndexWalk+fmt.Sprintf(", set_config('statement_timeout', '%dms', true)", ReadTimeout.Milliseconds())); err != nil {
		return err
	}
	return fn(ctx, Planned{tx})
}

// write runs fn in a transaction of c begun on db, with the index-walk
// settings and a lock_timeout of LockTimeout, and commits it when fn
// returns nil. A lock waited for longer is ErrBusy.
func write(ctx context.Context, c *idem.Client, db idem.Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	err := c.InTx(ctx, db, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlIndexWalk+fmt.Sprintf(", set_config('lock_timeout', '%dms', true)", LockTimeout.Milliseconds())); err != nil {
			return err
		}
		return fn(ctx, tx)
	})
	if pgCode(err) == pgerrcode.LockNotAvailable {
		return fmt.Errorf("%w (waited %s): nothing changed", ErrBusy, LockTimeout)
	}
	return err
}

// Resolve records an operator's verdict on the record of (scope, key) with
// c.Resolve (nil c: the package-level functions' defaults), in one
// transaction with its audit row, and returns the row and the record as
// the verdict left it, read in that transaction (so that a caller that
// shows it needs no second read, which could fail after the commit). The
// errors are
// Resolve's (ErrFenced when res.Token is not the record's token now,
// ErrNotResolvable, ErrNotFound, ErrInvalidArgument, ...), and an operator
// name that is empty, too long or not valid text is ErrInvalidArgument;
// on any error nothing changed and no row was written.
func Resolve(ctx context.Context, db idem.Beginner, c *idem.Client, operator string, scope idem.Scope, key string, res idem.Resolution) (Entry, idem.Record, error) {
	c, err := check(c, db, operator)
	if err != nil {
		return Entry{}, idem.Record{}, err
	}
	e := Entry{Operator: operator, Action: ActionResolve, Scope: scope, Key: key, Reason: res.Reason, Changed: 1,
		Verdict: VerdictRetryable}
	if res.Succeeded != nil {
		e.Verdict = VerdictSucceeded
		e.Detail, _ = json.Marshal(map[string]int{"response_status": res.Succeeded.Status})
	}
	var rec idem.Record
	err = write(ctx, c, db, func(ctx context.Context, tx pgx.Tx) error {
		// Lookup validates the scope and key with c's limits first.
		if _, err := c.Lookup(ctx, tx, scope, key); err != nil {
			return err
		}
		k := store.AuditLockKeyParams{Actor: scope.Actor, Operation: scope.Operation, IdemKey: key}
		before, err := queries.AuditLockKey(ctx, Planned{tx}, k)
		if err != nil {
			return notFound(err)
		}
		if err := c.Resolve(ctx, tx, scope, key, res); err != nil {
			return err
		}
		// The record stays locked by this transaction: this is what commits.
		if rec, err = c.Lookup(ctx, tx, scope, key); err != nil {
			return err
		}
		e.TokenBefore, e.StatusBefore, e.HasBefore = before.Token, idem.Status(before.Status), true
		e.TokenAfter, e.StatusAfter, e.HasAfter = rec.Token, rec.Status, true
		return insert(ctx, tx, &e)
	})
	if err != nil {
		return Entry{}, idem.Record{}, err
	}
	return e, rec, nil
}

// Forget deletes the record of a finished key with c.Forget, in one
// transaction with its audit row, and returns the row, whose Detail keeps
// a copy of the record it deleted ({"forgotten": RecordCopy}): its status,
// stored response, fingerprint, token and times. With want set, it refuses
// with ErrChanged when the record is no longer that attempt. It waits at
// most LockTimeout for a transaction that holds the record (then ErrBusy).
// The other errors are Forget's (ErrOutcomeUnknown, ErrInProgress,
// ErrNotFound, ...) and ErrInvalidArgument for an operator name that is
// empty, too long or not valid text, or a reason that is too long or not
// valid text; on any error nothing changed and no row was written.
func Forget(ctx context.Context, db idem.Beginner, c *idem.Client, operator string, scope idem.Scope, key string, want *Attempt, reason string) (Entry, error) {
	c, err := check(c, db, operator)
	if err != nil {
		return Entry{}, err
	}
	if err := checkReason(reason); err != nil {
		return Entry{}, err
	}
	e := Entry{Operator: operator, Action: ActionForget, Scope: scope, Key: key, Changed: 1, Reason: reason}
	err = write(ctx, c, db, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := c.Lookup(ctx, tx, scope, key); err != nil {
			return err
		}
		before, err := queries.AuditLockKey(ctx, Planned{tx},
			store.AuditLockKeyParams{Actor: scope.Actor, Operation: scope.Operation, IdemKey: key})
		if err != nil {
			return notFound(err)
		}
		// The record as it is deleted: locked by this transaction.
		rec, err := c.Lookup(ctx, tx, scope, key)
		if err != nil {
			return err
		}
		if e.Detail, err = json.Marshal(map[string]RecordCopy{"forgotten": NewRecordCopy(rec)}); err != nil {
			return err
		}
		if want != nil && (before.Token != want.Token || !before.CreatedAt.Time.Equal(want.CreatedAt)) {
			return fmt.Errorf("%w: the record holds token %d, started %s, now (status %s)", ErrChanged,
				before.Token, before.CreatedAt.Time.UTC().Format(time.RFC3339Nano), before.Status)
		}
		if err := c.Forget(ctx, tx, scope, key); err != nil {
			return err
		}
		e.TokenBefore, e.StatusBefore, e.HasBefore = before.Token, idem.Status(before.Status), true
		return insert(ctx, tx, &e)
	})
	if err != nil {
		return Entry{}, err
	}
	return e, nil
}

// ExpireLeases turns into 'unknown' the reservations that needed a person
// at the instant cutoff (or now, when cutoff is later) and that f matches,
// as idem's ExpireLeases does (the token kept: their workers are fenced),
// in one statement and one transaction with its audit rows, and returns
// the row of the whole action (Changed: how many; Detail: the filter and
// the cutoff). Each record it changed gets a row of its own too (Changed
// 1, its token, 'processing' to 'unknown'; Detail: the filter, the
// cutoff, the lease's end and the ID of the action's row), so that the
// record's history shows it. Every condition on time is evaluated at that
// instant: the lease ran out by then, the window to resume (if any) had
// ended by then, and the attempt was at least f.MinAge old then. Given the
// cutoff of ExpirableCount, it acts on at most the reservations that count
// counted: a lease that runs out, a window that ends or an attempt that
// reaches f.MinAge after the count is left alone, and a reservation that
// finished meanwhile stays finished. When none matched, nothing changed
// and no row is written (Changed 0, ID 0). A bad filter or operator name is
// ErrInvalidArgument.
func ExpireLeases(ctx context.Context, db idem.Beginner, c *idem.Client, operator string, f Filter, cutoff time.Time) (Entry, error) {
	c, err := check(c, db, operator)
	if err != nil {
		return Entry{}, err
	}
	if err := f.Check(); err != nil {
		return Entry{}, err
	}
	detail, _ := json.Marshal(struct {
		Filter
		Cutoff time.Time `json:"cutoff"`
	}{f, cutoff.UTC()})
	e := Entry{Operator: operator, Action: ActionExpireLeases, Detail: detail}
	if f.State == StateUnknown {
		return e, nil // an unknown outcome holds no lease to expire
	}
	err = write(ctx, c, db, func(ctx context.Context, tx pgx.Tx) error {
		expired, err := queries.ConsoleExpireLeases(ctx, Planned{tx}, store.ConsoleExpireLeasesParams{
			Reason: LeaseExpiredReason, Cutoff: pgtype.Timestamptz{Time: cutoff, Valid: true},
			Actor: f.Actor, Operation: f.Operation, MinAgeMicros: f.MinAgeMicros(), ErrorText: f.ErrorText,
		})
		if err != nil || len(expired) == 0 {
			return err
		}
		e.Changed = int64(len(expired))
		if err := insert(ctx, tx, &e); err != nil {
			return err
		}
		return insertEach(ctx, tx, e, f, cutoff, expired)
	})
	if err != nil {
		return Entry{}, fmt.Errorf("idem: expire leases: %w", err)
	}
	return e, nil
}

// ExpirableCount counts the reservations whose lease ran out that f
// matches (past their window to resume, if any), and returns the database
// time of the count, at which every condition on time was evaluated:
// ExpireLeases with that cutoff evaluates them at the same instant, and
// acts on these and no others.
func ExpirableCount(ctx context.Context, q Planned, f Filter) (int64, time.Time, error) {
	if err := f.Check(); err != nil {
		return 0, time.Time{}, err
	}
	if f.State == StateUnknown {
		now, err := queries.ConsoleNow(ctx, q)
		return 0, now.Time, err // an unknown outcome holds no lease to expire
	}
	row, err := queries.ConsoleExpirableCount(ctx, q, store.ConsoleExpirableCountParams{
		Actor: f.Actor, Operation: f.Operation, MinAgeMicros: f.MinAgeMicros(), ErrorText: f.ErrorText,
	})
	return row.Leases, row.Cutoff.Time, err
}

// Prune deletes expired finished keys with c.Prune and opts, and drops the
// stored bodies past their time (Config.BodyTTL) as it does, in one
// transaction with its audit row (opts.MaxBatches bounds it; 0 is refused
// here, since one transaction holds every batch), and returns the row
// (Changed: the keys deleted; Detail's bodies_dropped: the bodies dropped;
// Reason: reason) and the bodies dropped. When it did neither, nothing
// changed and no row is written (ID 0). A reason that is too long or not
// valid text is ErrInvalidArgument.
func Prune(ctx context.Context, db idem.Beginner, c *idem.Client, operator string, opts idem.PruneOptions, reason string) (Entry, int64, error) {
	c, err := check(c, db, operator)
	if err != nil {
		return Entry{}, 0, err
	}
	if err := checkReason(reason); err != nil {
		return Entry{}, 0, err
	}
	if opts.DryRun || opts.MaxBatches <= 0 || opts.BatchSize < 0 {
		return Entry{}, 0, fmt.Errorf("%w: an audited prune deletes (no DryRun) at most MaxBatches > 0 batches", idem.ErrInvalidArgument)
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = idem.DefaultPruneBatchSize
	}
	var e Entry
	var dropped int64
	err = write(ctx, c, db, func(ctx context.Context, tx pgx.Tx) error {
		res, err := c.PruneReport(ctx, tx, opts)
		if err != nil || res.KeysDeleted == 0 && res.BodiesDropped == 0 {
			return err
		}
		dropped = res.BodiesDropped
		detail, _ := json.Marshal(map[string]int64{"batch_size": int64(opts.BatchSize), "max_batches": int64(opts.MaxBatches),
			"bodies_dropped": dropped})
		e = Entry{Operator: operator, Action: ActionPrune, Detail: detail, Reason: reason, Changed: res.KeysDeleted}
		return insert(ctx, tx, &e)
	})
	if err != nil {
		return Entry{}, 0, err
	}
	return e, dropped, nil
}

// ListFilter selects rows of the trail: an empty field matches any row.
type ListFilter struct {
	Operator, Action string
	// OperatorPrefix keeps the rows whose operator's name starts with it.
	OperatorPrefix string
	// From and To keep the rows acted at From (included) to To
	// (excluded); zero for no bound.
	From, To time.Time
	Scope    idem.Scope
	Key      string
	BeforeAt time.Time // with BeforeID: the position after which the page starts (zero: newest)
	BeforeID int64
	Limit    int
}

// List returns at most f.Limit rows of the trail, newest first, after the
// position f names (the last row of the previous page).
func List(ctx context.Context, q Planned, f ListFilter) ([]Entry, error) {
	for _, v := range []string{f.Operator, f.OperatorPrefix, f.Action, f.Scope.Actor, f.Scope.Operation, f.Key} {
		if err := checkText(v, 1024); err != nil {
			return nil, fmt.Errorf("%w: audit filter %v", idem.ErrInvalidArgument, err)
		}
	}
	if f.Limit <= 0 {
		return nil, fmt.Errorf("%w: limit %d must be positive", idem.ErrInvalidArgument, f.Limit)
	}
	arg := store.AuditListParams{
		Operator: f.Operator, Action: f.Action, Actor: f.Scope.Actor, Operation: f.Scope.Operation, IdemKey: f.Key,
		OperatorPrefix: f.OperatorPrefix,
		FromAt:         pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true},
		ToAt:           pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true},
		BeforeActedAt:  pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true}, BeforeID: 0,
		MaxRows: int32(min(f.Limit, 10000)),
	}
	if !f.From.IsZero() {
		arg.FromAt = pgtype.Timestamptz{Time: f.From, Valid: true}
	}
	if !f.To.IsZero() {
		arg.ToAt = pgtype.Timestamptz{Time: f.To, Valid: true}
	}
	if !f.BeforeAt.IsZero() {
		arg.BeforeActedAt = pgtype.Timestamptz{Time: f.BeforeAt, Valid: true}
		arg.BeforeID = f.BeforeID
	}
	rows, err := queries.AuditList(ctx, q, arg)
	if err != nil {
		return nil, err
	}
	out := make([]Entry, 0, len(rows))
	for _, r := range rows {
		e := Entry{
			ID: r.ID, At: r.ActedAt.Time, Operator: r.Operator, Action: r.Action,
			Scope: idem.Scope{Actor: r.Actor, Operation: r.Operation}, Key: r.IdemKey,
			TokenBefore: r.TokenBefore.Int64, TokenAfter: r.TokenAfter.Int64,
			HasBefore: r.TokenBefore.Valid, HasAfter: r.TokenAfter.Valid,
			StatusBefore: idem.Status(r.StatusBefore.String), StatusAfter: idem.Status(r.StatusAfter.String),
			Verdict: r.Verdict.String, Reason: r.Reason, Changed: r.Changed,
		}
		if r.Detail != "" {
			e.Detail = json.RawMessage(r.Detail)
		}
		out = append(out, e)
	}
	return out, nil
}

// insert writes e in tx and fills in its ID and time.
func insert(ctx context.Context, tx pgx.Tx, e *Entry) error {
	arg := store.AuditInsertParams{
		Actor: e.Scope.Actor, Operator: e.Operator, Action: e.Action, Operation: e.Scope.Operation, IdemKey: e.Key,
		TokenBefore:  pgtype.Int8{Int64: e.TokenBefore, Valid: e.HasBefore},
		TokenAfter:   pgtype.Int8{Int64: e.TokenAfter, Valid: e.HasAfter},
		StatusBefore: pgtype.Text{String: string(e.StatusBefore), Valid: e.HasBefore},
		StatusAfter:  pgtype.Text{String: string(e.StatusAfter), Valid: e.HasAfter},
		Verdict:      pgtype.Text{String: e.Verdict, Valid: e.Verdict != ""},
		Reason:       e.Reason, Changed: e.Changed,
		Detail: pgtype.Text{String: string(e.Detail), Valid: e.Detail != nil},
	}
	row, err := queries.AuditInsert(ctx, Planned{tx}, arg)
	if err != nil {
		return fmt.Errorf("idem: audit: %w", err)
	}
	e.ID, e.At = row.ID, row.ActedAt.Time
	return nil
}

// RetryEvent sends the failed event (destination, id) of the outbox again,
// as idem.RetryEvent does (pending and due now, its schedule restarting,
// reason recorded in the event), in one transaction with its audit row,
// and wakes listening relays when it commits. The row names no key (actor,
// operation and key empty); its Detail holds the destination and the id.
// An event that is not failed is idem.ErrEventNotFailed, a missing one
// idem.ErrEventNotFound, an empty or invalid reason or operator name
// idem.ErrInvalidArgument; on any error nothing changed and no row was
// written.
func RetryEvent(ctx context.Context, db idem.Beginner, c *idem.Client, operator, id, destination, reason string) (Entry, error) {
	c, err := check(c, db, operator)
	if err != nil {
		return Entry{}, err
	}
	if reason == "" || len(reason) > idem.MaxRetryReason || checkText(reason, idem.MaxRetryReason) != nil {
		return Entry{}, fmt.Errorf("%w: the reason must be 1 to %d bytes of text", idem.ErrInvalidArgument, idem.MaxRetryReason)
	}
	detail, err := json.Marshal(map[string]string{"destination": destination, "id": id,
		"status_before": string(idem.EventFailed), "status_after": string(idem.EventPending)})
	if err != nil {
		return Entry{}, err
	}
	e := Entry{Operator: operator, Action: ActionRetryEvent, Reason: reason, Changed: 1, Detail: detail}
	err = write(ctx, c, db, func(ctx context.Context, tx pgx.Tx) error {
		n, err := queries.EventRetry(ctx, tx, store.EventRetryParams{Destination: destination, ID: id, Reason: reason})
		if err != nil {
			return err
		}
		if n == 0 {
			ev, err := queries.EventLookup(ctx, tx, store.EventLookupParams{Destination: destination, ID: id})
			if errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("%w: %q for %q", idem.ErrEventNotFound, id, destination)
			}
			if err != nil {
				return err
			}
			return fmt.Errorf("%w: %q for %q is %s", idem.ErrEventNotFailed, id, destination, ev.Status)
		}
		if _, err := tx.Exec(ctx, "SELECT pg_notify('"+idem.EventsChannel+"', '')"); err != nil {
			return err
		}
		return insert(ctx, tx, &e)
	})
	if err != nil {
		return Entry{}, err
	}
	return e, nil
}

// defaultClient stands in for a nil *idem.Client: the package-level
// functions' defaults.
var defaultClient = func() *idem.Client {
	c, err := idem.New(idem.Config{})
	if err != nil {
		panic(err) // the zero Config is valid
	}
	return c
}()

// check validates what every change needs and returns the client to use.
func check(c *idem.Client, db idem.Beginner, operator string) (*idem.Client, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: nil database handle", idem.ErrInvalidArgument)
	}
	if err := CheckOperator(operator); err != nil {
		return nil, err
	}
	if c == nil {
		c = defaultClient
	}
	return c, nil
}

// CheckOperator refuses an operator name the trail cannot record
// faithfully (ErrInvalidArgument): empty, longer than MaxOperatorLength
// bytes, not valid text, or holding a character that could forge what a
// terminal or a page shows: a control character (an escape sequence), an
// invisible format character (a zero-width space that makes "dana.kim"
// of another name, a bidi override that reorders it) or a line or
// paragraph separator.
func CheckOperator(operator string) error {
	if operator == "" {
		return fmt.Errorf("%w: no operator name: the audit trail records who acted", idem.ErrInvalidArgument)
	}
	if err := checkText(operator, MaxOperatorLength); err != nil {
		return fmt.Errorf("%w: operator name %v", idem.ErrInvalidArgument, err)
	}
	for i, r := range operator {
		if unicode.IsControl(r) || unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp) {
			return fmt.Errorf("%w: operator name holds the character %U at byte %d: it could forge what a terminal or a page shows", idem.ErrInvalidArgument, r, i)
		}
	}
	return nil
}

// checkText refuses what PostgreSQL's text cannot hold (invalid UTF-8,
// NUL) and what is longer than max bytes.
func checkText(s string, max int) error {
	switch {
	case len(s) > max:
		return fmt.Errorf("is longer than %d bytes", max)
	case !utf8.ValidString(s):
		return errors.New("is not valid UTF-8")
	}
	for _, r := range s {
		if r == 0 {
			return errors.New("holds NUL")
		}
	}
	return nil
}

// notFound maps a lock that found no row to idem.ErrNotFound.
func notFound(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return idem.ErrNotFound
	}
	return err
}

// pgCode is the SQLSTATE of err, or "".
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// RecordCopy is what the trail keeps of a record it deleted (Forget): enough
// to know what the key had answered, and since when.
type RecordCopy struct {
	Status         idem.Status   `json:"status"`
	Token          int64         `json:"token"`
	Fingerprint    string        `json:"fingerprint"`
	CreatedAt      time.Time     `json:"created_at"`
	CompletedAt    *time.Time    `json:"completed_at,omitempty"`
	ExpiresAt      time.Time     `json:"expires_at"`
	LeaseExpiresAt *time.Time    `json:"lease_expires_at,omitempty"`
	LastError      string        `json:"last_error,omitempty"`
	ResolveReason  string        `json:"resolve_reason,omitempty"`
	Response       *ResponseCopy `json:"response,omitempty"`
}

// ResponseCopy is a stored response in a RecordCopy: the body as text when
// it is valid UTF-8, in base64 otherwise.
type ResponseCopy struct {
	Status     int                 `json:"status"`
	Header     map[string][]string `json:"header,omitempty"`
	Body       *string             `json:"body,omitempty"`
	BodyBase64 *string             `json:"body_base64,omitempty"`
	// Gone: the body and headers had been dropped (Config.BodyTTL); the
	// status alone was kept.
	Gone bool `json:"gone,omitempty"`
}

// NewRecordCopy is the copy of rec the trail keeps.
func NewRecordCopy(rec idem.Record) RecordCopy {
	out := RecordCopy{Status: rec.Status, Token: rec.Token, Fingerprint: rec.Fingerprint.String(),
		CreatedAt: rec.CreatedAt.UTC(), ExpiresAt: rec.ExpiresAt.UTC(), LastError: rec.LastError, ResolveReason: rec.ResolveReason}
	if !rec.CompletedAt.IsZero() {
		t := rec.CompletedAt.UTC()
		out.CompletedAt = &t
	}
	if !rec.LeaseExpiresAt.IsZero() {
		t := rec.LeaseExpiresAt.UTC()
		out.LeaseExpiresAt = &t
	}
	if r := rec.Response; r != nil && rec.ResponseGone {
		out.Response = &ResponseCopy{Status: r.Status, Gone: true}
	} else if r != nil {
		rc := &ResponseCopy{Status: r.Status, Header: r.Header}
		if utf8.Valid(r.Body) && !bytesHaveNUL(r.Body) {
			b := string(r.Body)
			rc.Body = &b
		} else {
			b := base64.StdEncoding.EncodeToString(r.Body)
			rc.BodyBase64 = &b
		}
		out.Response = rc
	}
	return out
}

// bytesHaveNUL reports whether b holds a NUL, which jsonb cannot keep in a
// string.
func bytesHaveNUL(b []byte) bool {
	for _, c := range b {
		if c == 0 {
			return true
		}
	}
	return false
}

// ExpiredDetail is the Detail of the row of one record that a bulk expire
// changed.
type ExpiredDetail struct {
	Filter
	Cutoff         time.Time `json:"cutoff"`
	LeaseExpiresAt time.Time `json:"lease_expires_at"`
	BulkID         int64     `json:"bulk_id"`
}

// insertEach writes the row of each record that the bulk expire of row e
// changed.
func insertEach(ctx context.Context, tx pgx.Tx, e Entry, f Filter, cutoff time.Time, expired []store.ConsoleExpireLeasesRow) error {
	type record struct {
		Actor     string        `json:"actor"`
		Operation string        `json:"operation"`
		Key       string        `json:"idem_key"`
		Token     int64         `json:"token"`
		Detail    ExpiredDetail `json:"detail"`
	}
	records := make([]record, 0, len(expired))
	for _, r := range expired {
		records = append(records, record{Actor: r.Actor, Operation: r.Operation, Key: r.IdemKey, Token: r.Token,
			Detail: ExpiredDetail{Filter: f, Cutoff: cutoff.UTC(), LeaseExpiresAt: r.LeaseExpiresAt.Time.UTC(), BulkID: e.ID}})
	}
	b, err := json.Marshal(records)
	if err != nil {
		return err
	}
	n, err := queries.AuditInsertEach(ctx, Planned{tx}, store.AuditInsertEachParams{
		Operator: e.Operator, Action: e.Action, StatusBefore: string(idem.StatusProcessing), StatusAfter: string(idem.StatusUnknown),
		Reason: e.Reason, Records: string(b),
	})
	if err == nil && n != int64(len(expired)) {
		err = fmt.Errorf("idem: audit: %d rows written for %d records", n, len(expired))
	}
	if err != nil {
		return fmt.Errorf("idem: audit: %w", err)
	}
	return nil
}

// checkReason refuses a reason the trail cannot hold.
func checkReason(reason string) error {
	if err := checkText(reason, MaxReasonLength); err != nil {
		return fmt.Errorf("%w: reason %v", idem.ErrInvalidArgument, err)
	}
	return nil
}

// Target names one record of a bulk verdict and the attempt it is about.
type Target struct {
	Scope idem.Scope
	Key   string
	Token int64
}

// MaxBulk bounds how many records one bulk verdict settles.
const MaxBulk = 500

// Bulk is what a bulk verdict did: the row of the whole action (Changed:
// how many records it settled; ID 0 when none), and the records it left
// because their outcome was no longer in doubt, or no longer the attempt
// named (someone else decided, or a new attempt holds the key).
type Bulk struct {
	Entry   Entry
	Skipped []Target
}

// ResolveMany records one verdict (res: Succeeded or Retryable, and the
// Reason; its Token is ignored) on each of targets, about its attempt
// (Target.Token), in one transaction: each as Resolve does, in a savepoint,
// with its own audit row, and then one row for the whole action (action
// resolve, no record; Detail: how the records were chosen, the detail
// argument, and how many were left). A record that is fenced, not in doubt
// any more or gone is left (Bulk.Skipped) and the others go on; any other
// error rolls everything back (a record another transaction holds for
// longer than LockTimeout: a *BusyError, which names it). More than MaxBulk targets, none, or a bad
// verdict is ErrInvalidArgument.
func ResolveMany(ctx context.Context, db idem.Beginner, c *idem.Client, operator string, targets []Target, res idem.Resolution, detail map[string]any) (Bulk, error) {
	c, err := check(c, db, operator)
	if err != nil {
		return Bulk{}, err
	}
	if len(targets) == 0 || len(targets) > MaxBulk {
		return Bulk{}, fmt.Errorf("%w: a bulk verdict settles 1 to %d records, not %d", idem.ErrInvalidArgument, MaxBulk, len(targets))
	}
	if (res.Succeeded == nil) == !res.Retryable || res.Reason == "" {
		return Bulk{}, fmt.Errorf("%w: a bulk verdict needs exactly one of Succeeded and Retryable, and a reason", idem.ErrInvalidArgument)
	}
	var out Bulk
	err = write(ctx, c, db, func(ctx context.Context, tx pgx.Tx) error {
		out = Bulk{}
		for _, t := range targets {
			one := res
			one.Token = t.Token
			_, _, err := Resolve(ctx, tx, c, operator, t.Scope, t.Key, one)
			switch {
			case errors.Is(err, idem.ErrFenced), errors.Is(err, idem.ErrNotResolvable), errors.Is(err, idem.ErrNotFound):
				out.Skipped = append(out.Skipped, t)
				continue
			case errors.Is(err, ErrBusy):
				return &BusyError{Target: t, Err: err}
			case err != nil:
				return err
			}
			out.Entry.Changed++
		}
		if out.Entry.Changed == 0 {
			return nil
		}
		d := map[string]any{"bulk": true, "records": len(targets), "skipped": len(out.Skipped)}
		for k, v := range detail {
			d[k] = v
		}
		if res.Succeeded != nil {
			d["response_status"] = res.Succeeded.Status
		}
		b, err := json.Marshal(d)
		if err != nil {
			return err
		}
		out.Entry = Entry{Operator: operator, Action: ActionResolve, Verdict: VerdictRetryable, Reason: res.Reason,
			Changed: out.Entry.Changed, Detail: b}
		if res.Succeeded != nil {
			out.Entry.Verdict = VerdictSucceeded
		}
		return insert(ctx, tx, &out.Entry)
	})
	if err != nil {
		return Bulk{}, err
	}
	return out, nil
}

// NeedsPersonAt lists the records that needed a person at the instant
// cutoff (or now, when cutoff is later) and that f matches, oldest first,
// at most limit, each with its token now: what a bulk verdict over a
// filter counted.
func NeedsPersonAt(ctx context.Context, q Planned, f Filter, cutoff time.Time, limit int) ([]Target, error) {
	if err := f.Check(); err != nil {
		return nil, err
	}
	rows, err := queries.ConsoleNeedsPersonAt(ctx, q, store.ConsoleNeedsPersonAtParams{
		Cutoff: pgtype.Timestamptz{Time: cutoff, Valid: true}, Actor: f.Actor, Operation: f.Operation,
		MinAgeMicros: f.MinAgeMicros(), ErrorText: f.ErrorText, State: f.State, MaxRows: int32(limit),
	})
	if err != nil {
		return nil, err
	}
	out := make([]Target, 0, len(rows))
	for _, r := range rows {
		out = append(out, Target{Scope: idem.Scope{Actor: r.Actor, Operation: r.Operation}, Key: r.IdemKey, Token: r.Token})
	}
	return out, nil
}

// NeedsPersonCount counts the records that need a person that f matches,
// up to capRows, and returns the database time of the count.
func NeedsPersonCount(ctx context.Context, q Planned, f Filter, capRows int) (int64, time.Time, error) {
	if err := f.Check(); err != nil {
		return 0, time.Time{}, err
	}
	n, err := queries.ConsoleNeedsPersonCount(ctx, q, store.ConsoleNeedsPersonCountParams{
		Actor: f.Actor, Operation: f.Operation, MinAgeMicros: f.MinAgeMicros(), ErrorText: f.ErrorText, State: f.State, CapRows: int32(capRows),
	})
	if err != nil {
		return 0, time.Time{}, err
	}
	now, err := queries.ConsoleNow(ctx, q)
	return n, now.Time, err
}
