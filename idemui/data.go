package idemui

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"mime"
	"slices"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	store "github.com/pgidem/idem/internal/db"
)

// queries runs the console's generated statements.
var queries = store.New()

// Bounds of the console's reads.
const (
	// openCap bounds the open reservations the overview walks for its
	// counts: beyond it they are shown as "at least", with the sample's
	// estimate.
	openCap = 1000
	// countCap bounds the count of the records a filter matches.
	countCap = 1000
	// samplePages is about how many pages of idem_keys the overview's
	// sample reads.
	samplePages = 500
	// pageSize is the rows of a list page.
	pageSize = 50
)

// count is a number the console counted: exact, at least N (a count that
// stopped at its cap), or estimated from a sample.
type count struct {
	N         int64 `json:"n"`
	AtLeast   bool  `json:"at_least,omitempty"`
	Estimated bool  `json:"estimated,omitempty"`
}

// statuses lists idem's statuses in the console's order.
var statuses = []idem.Status{idem.StatusUnknown, idem.StatusProcessing, idem.StatusSucceeded, idem.StatusRejected, idem.StatusFailedRetryable}

// overview is what the overview shows.
type overview struct {
	Now               time.Time                 `json:"now"`
	NeedsPerson       count                     `json:"needs_person"`
	Unknown           count                     `json:"unknown"`
	LeaseRanOut       count                     `json:"lease_ran_out"`
	InFlight          count                     `json:"in_flight"`
	Resuming          count                     `json:"resuming"` // in doubt inside their window: not a person's
	OldestNeedsPerson *time.Time                `json:"oldest_needs_person,omitempty"`
	OldestInFlight    *time.Time                `json:"oldest_in_flight,omitempty"`
	Keys              map[idem.Status]count     `json:"keys"`
	TotalKeys         count                     `json:"total_keys"`
	TableBytes        int64                     `json:"table_bytes"`
	IndexBytes        int64                     `json:"index_bytes"`
	SamplePercent     float64                   `json:"sample_percent"`
	Hourly            map[idem.Status][24]int64 `json:"hourly"` // [0] is the last hour
}

// readOverview reads the overview: the open reservations through their
// index (up to openCap), the sizes, and a sample of about samplePages pages
// for the statuses and the last 24 hours (the whole table when it is
// smaller: then every count is exact).
func readOverview(ctx context.Context, db idem.Beginner) (overview, error) {
	var o overview
	err := audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		size, err := tableSize(ctx, q)
		if err != nil {
			return err
		}
		o.TableBytes, o.IndexBytes = size.TableBytes, size.IndexBytes
		open, err := queries.ConsoleOpen(ctx, q, openCap)
		if err != nil {
			return err
		}
		o.Now = open.Now.Time
		capped := open.Scanned >= openCap
		o.Unknown = count{N: open.Unknown, AtLeast: capped}
		o.LeaseRanOut = count{N: open.LeaseRanOut, AtLeast: capped}
		o.InFlight = count{N: open.InFlight, AtLeast: capped}
		o.Resuming = count{N: open.Resuming, AtLeast: capped}
		o.NeedsPerson = count{N: open.Unknown + open.LeaseRanOut, AtLeast: capped}
		o.OldestNeedsPerson = timePtr(open.OldestNeedsPerson)
		o.OldestInFlight = timePtr(open.OldestInFlight)

		o.SamplePercent = 100
		if size.Pages > samplePages {
			o.SamplePercent = 100 * float64(samplePages) / float64(size.Pages)
		}
		rows, err := queries.ConsoleSample(ctx, q, o.SamplePercent)
		if err != nil {
			return err
		}
		scale := 100 / o.SamplePercent
		estimated := o.SamplePercent < 100
		o.Keys = make(map[idem.Status]count)
		o.Hourly = make(map[idem.Status][24]int64)
		raw := make(map[idem.Status]int64)
		for _, r := range rows {
			s := idem.Status(r.Status)
			raw[s] += r.Keys
			if r.HoursAgo >= 0 && r.HoursAgo < 24 {
				h := o.Hourly[s]
				h[r.HoursAgo] += int64(math.Round(float64(r.Keys) * scale))
				o.Hourly[s] = h
			}
		}
		for s, n := range raw {
			o.Keys[s] = count{N: int64(math.Round(float64(n) * scale)), Estimated: estimated}
		}
		// Below the cap, the open reservations were counted exactly.
		if !capped {
			o.Keys[idem.StatusProcessing] = count{N: open.InFlight + open.LeaseRanOut + open.Resuming - open.ResumingUnknown}
			o.Keys[idem.StatusUnknown] = count{N: open.Unknown + open.ResumingUnknown}
		}
		var total int64
		for s, c := range o.Keys {
			if c.N == 0 {
				delete(o.Keys, s)
			}
			total += c.N
		}
		o.TotalKeys = count{N: total, Estimated: estimated}
		return nil
	})
	return o, err
}

// Citus keeps the rows of a distributed idem_keys in its shards; the
// coordinator's table is an empty shell. sqlHasCitus says whether the
// extension is there; sqlCitusSize then reads the sizes over the shards, and
// no row when idem_keys is not Citus's.
const (
	sqlHasCitus  = "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
	sqlCitusSize = `SELECT citus_table_size('idem_keys')::bigint,
		(citus_total_relation_size('idem_keys') - citus_table_size('idem_keys'))::bigint,
		(citus_relation_size('idem_keys') / current_setting('block_size')::bigint)::bigint
		WHERE EXISTS (SELECT FROM citus_tables WHERE table_name = 'idem_keys'::regclass)`
)

// tableSize reads the size of idem_keys, over its shards when Citus
// distributes it (so that the sample reads a part of the rows there too).
func tableSize(ctx context.Context, q audit.Planned) (store.ConsoleTableSizeRow, error) {
	var size store.ConsoleTableSizeRow
	var citus bool
	if err := q.QueryRow(ctx, sqlHasCitus).Scan(&citus); err != nil {
		return size, err
	}
	if citus {
		err := q.QueryRow(ctx, sqlCitusSize).Scan(&size.TableBytes, &size.IndexBytes, &size.Pages)
		if !errors.Is(err, pgx.ErrNoRows) {
			return size, err
		}
	}
	return queries.ConsoleTableSize(ctx, q)
}

func timePtr(t pgtype.Timestamptz) *time.Time {
	if !t.Valid {
		return nil
	}
	v := t.Time
	return &v
}

// needsPersonItem is one row of the list of records that need a person.
type needsPersonItem struct {
	Actor          string    `json:"actor"`
	Operation      string    `json:"operation"`
	Key            string    `json:"key"`
	Status         string    `json:"status"`
	LeaseRanOut    bool      `json:"lease_ran_out"`
	Token          int64     `json:"token"`
	CreatedAt      time.Time `json:"created_at"`
	LeaseExpiresAt time.Time `json:"lease_expires_at"`
	LastError      string    `json:"last_error,omitempty"`
}

// needsPersonPage is a page of that list, with the count of what the
// filter matches, the positions of the pages before and after it ("" at
// either end), and the place of its first record in the list (1 for the
// first; 0 when the address's position predates it).
type needsPersonPage struct {
	Items   []needsPersonItem `json:"records"`
	Matched count             `json:"matched"`
	Next    string            `json:"next,omitempty"`
	Prev    string            `json:"prev,omitempty"`
	First   int64             `json:"first,omitempty"`
}

// Orders of the list.
const (
	orderOldest = "oldest"
	orderNewest = "newest"
)

// readNeedsPerson reads a page of the records that need a person, in
// order (oldest or newest first), after the position after or before the
// position before (neither: the first page).
func readNeedsPerson(ctx context.Context, db idem.Beginner, f audit.Filter, order, after, before string, limit int) (needsPersonPage, error) {
	var p needsPersonPage
	if after != "" && before != "" {
		return p, badRequest("invalid_cursor", "Give a page's position after or before, not both.")
	}
	var cur needsPersonCursor
	if pos := after + before; pos != "" {
		if err := decodeCursor(pos, &cur); err != nil {
			return p, err
		}
	}
	forward := before == ""
	asc := (order != orderNewest) == forward
	var rows []needsPersonItem
	err := audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		n, err := queries.ConsoleNeedsPersonCount(ctx, q, store.ConsoleNeedsPersonCountParams{
			Actor: f.Actor, Operation: f.Operation, MinAgeMicros: f.MinAgeMicros(), ErrorText: f.ErrorText, State: f.State, CapRows: countCap,
		})
		if err != nil {
			return err
		}
		p.Matched = count{N: n, AtLeast: n >= countCap}
		if asc {
			arg := store.ConsoleNeedsPersonParams{
				Actor: f.Actor, Operation: f.Operation, MinAgeMicros: f.MinAgeMicros(), ErrorText: f.ErrorText, State: f.State,
				AfterCreatedAt: pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true},
				MaxRows:        int32(limit + 1),
			}
			if after+before != "" {
				arg.AfterCreatedAt = pgtype.Timestamptz{Time: cur.CreatedAt, Valid: true}
				arg.AfterActor, arg.AfterOperation, arg.AfterKey = cur.Actor, cur.Operation, cur.Key
			}
			rs, err := queries.ConsoleNeedsPerson(ctx, q, arg)
			for _, r := range rs {
				rows = append(rows, needsPersonItem{Actor: r.Actor, Operation: r.Operation, Key: r.IdemKey, Status: r.Status, LeaseRanOut: r.LeaseRanOut,
					Token: r.Token, CreatedAt: r.CreatedAt.Time, LeaseExpiresAt: r.LeaseExpiresAt.Time, LastError: r.LastError.String})
			}
			return err
		}
		arg := store.ConsoleNeedsPersonNewestParams{
			Actor: f.Actor, Operation: f.Operation, MinAgeMicros: f.MinAgeMicros(), ErrorText: f.ErrorText, State: f.State,
			BeforeCreatedAt: pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true},
			MaxRows:         int32(limit + 1),
		}
		if after+before != "" {
			arg.BeforeCreatedAt = pgtype.Timestamptz{Time: cur.CreatedAt, Valid: true}
			arg.BeforeActor, arg.BeforeOperation, arg.BeforeKey = cur.Actor, cur.Operation, cur.Key
		}
		rs, err := queries.ConsoleNeedsPersonNewest(ctx, q, arg)
		for _, r := range rs {
			rows = append(rows, needsPersonItem{Actor: r.Actor, Operation: r.Operation, Key: r.IdemKey, Status: r.Status, LeaseRanOut: r.LeaseRanOut,
				Token: r.Token, CreatedAt: r.CreatedAt.Time, LeaseExpiresAt: r.LeaseExpiresAt.Time, LastError: r.LastError.String})
		}
		return err
	})
	if err != nil {
		return p, err
	}
	more := len(rows) > limit
	if more {
		rows = rows[:limit]
	}
	if !forward {
		slices.Reverse(rows)
	}
	p.Items = rows
	if len(rows) == 0 {
		return p, nil
	}
	switch {
	case forward:
		p.First = cur.N + 1
		if after == "" {
			p.First = 1
		} else if cur.N == 0 {
			p.First = 0
		}
	case !more:
		p.First = 1 // back at the start
	case cur.N > 0:
		p.First = max(cur.N-int64(len(rows)), 1)
	}
	position := func(i int) int64 {
		if p.First == 0 {
			return 0
		}
		return p.First + int64(i)
	}
	at := func(i int) string {
		it := rows[i]
		return encodeCursor(needsPersonCursor{CreatedAt: it.CreatedAt, Actor: it.Actor, Operation: it.Operation, Key: it.Key, N: position(i)})
	}
	if (forward && more) || !forward {
		p.Next = at(len(rows) - 1)
	}
	if (forward && after != "") || (!forward && more) {
		p.Prev = at(0)
	}
	return p, nil
}

// scopeItem is one key of a scope listing.
type scopeItem struct {
	Actor          string     `json:"actor"`
	Operation      string     `json:"operation"`
	Key            string     `json:"key"`
	Status         string     `json:"status"`
	Token          int64      `json:"token"`
	CreatedAt      time.Time  `json:"created_at"`
	CompletedAt    *time.Time `json:"completed_at,omitempty"`
	ExpiresAt      time.Time  `json:"expires_at"`
	LeaseExpiresAt *time.Time `json:"lease_expires_at,omitempty"`
	LeaseRanOut    bool       `json:"lease_ran_out"`
	LastError      string     `json:"last_error,omitempty"`
}

type scopeCursor struct {
	Operation string `json:"o"`
	Key       string `json:"k"`
}

func (cur *scopeCursor) check() error {
	if !cursorName(cur.Operation) || !cursorName(cur.Key) {
		return errDamagedCursor()
	}
	return nil
}

// readScope reads a page of the keys of an actor (and operation), in key
// order, after the position after ("" for the first page).
func readScope(ctx context.Context, db idem.Beginner, scope idem.Scope, after string, limit int) ([]scopeItem, string, error) {
	arg := store.ConsoleScopeKeysParams{Actor: scope.Actor, Operation: scope.Operation, MaxRows: int32(limit + 1)}
	if after != "" {
		var cur scopeCursor
		if err := decodeCursor(after, &cur); err != nil {
			return nil, "", err
		}
		arg.AfterOperation, arg.AfterKey = cur.Operation, cur.Key
	}
	var items []scopeItem
	var next string
	now := time.Now()
	err := audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		rows, err := queries.ConsoleScopeKeys(ctx, q, arg)
		if err != nil {
			return err
		}
		for i, r := range rows {
			if i == limit {
				last := items[len(items)-1]
				next = encodeCursor(scopeCursor{Operation: last.Operation, Key: last.Key})
				break
			}
			items = append(items, scopeItem{
				Actor: r.Actor, Operation: r.Operation, Key: r.IdemKey, Status: r.Status, Token: r.Token,
				CreatedAt: r.CreatedAt.Time, CompletedAt: timePtr(r.CompletedAt), ExpiresAt: r.ExpiresAt.Time,
				LeaseExpiresAt: timePtr(r.LeaseExpiresAt), LastError: r.LastError.String,
				LeaseRanOut: r.Status == string(idem.StatusProcessing) && r.LeaseExpiresAt.Valid && !r.LeaseExpiresAt.Time.After(now),
			})
		}
		return nil
	})
	return items, next, err
}

type auditCursor struct {
	At time.Time `json:"t"`
	ID int64     `json:"i"`
}

func (cur *auditCursor) check() error {
	if !cursorTime(cur.At) || cur.ID <= 0 {
		return errDamagedCursor()
	}
	return nil
}

// readAudit reads a page of the trail, newest first, before the position
// before ("" for the first page).
func readAudit(ctx context.Context, db idem.Beginner, f audit.ListFilter, before string) ([]audit.Entry, string, error) {
	if before != "" {
		var cur auditCursor
		if err := decodeCursor(before, &cur); err != nil {
			return nil, "", err
		}
		f.BeforeAt, f.BeforeID = cur.At, cur.ID
	}
	limit := f.Limit
	f.Limit++
	var entries []audit.Entry
	err := audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		var err error
		entries, err = audit.List(ctx, q, f)
		return err
	})
	if err != nil {
		return nil, "", err
	}
	var next string
	if len(entries) > limit {
		entries = entries[:limit]
		last := entries[limit-1]
		next = encodeCursor(auditCursor{At: last.At, ID: last.ID})
	}
	return entries, next, nil
}

// recordJSON is a record as the API shows it.
type recordJSON struct {
	Actor       string      `json:"actor"`
	Operation   string      `json:"operation"`
	Key         string      `json:"key"`
	Status      idem.Status `json:"status"`
	NeedsPerson bool        `json:"needs_person"`
	LeaseRanOut bool        `json:"lease_ran_out"`
	// Resumable: in doubt inside its window (ReserveOptions.ResumeWithin),
	// which a recovery worker or the next request resumes; not a person's.
	Resumable      bool       `json:"resumable"`
	Fingerprint    string     `json:"fingerprint"`
	Token          int64      `json:"token"`
	CreatedAt      time.Time  `json:"created_at"`
	CompletedAt    *time.Time `json:"completed_at,omitempty"`
	ExpiresAt      time.Time  `json:"expires_at"`
	LeaseExpiresAt *time.Time `json:"lease_expires_at,omitempty"`
	ResumeUntil    *time.Time `json:"resume_until,omitempty"`
	// UnknownAt: when the attempt became unknown (Record.UnknownAt); kept
	// after a verdict.
	UnknownAt *time.Time `json:"unknown_at,omitempty"`
	// BodyExpiresAt: when the stored body and headers are dropped
	// (Record.BodyExpiresAt, Config.BodyTTL); absent when they live as
	// long as the key, or were dropped.
	BodyExpiresAt *time.Time    `json:"body_expires_at,omitempty"`
	LastError     string        `json:"last_error,omitempty"`
	ResolveReason string        `json:"resolve_reason,omitempty"`
	Response      *responseJSON `json:"response,omitempty"`
	// ResponseGone: the stored body and headers were dropped after
	// Config.BodyTTL; the status is kept, and a retry gets ErrResponseGone.
	ResponseGone bool `json:"response_gone,omitempty"`
}

type responseJSON struct {
	Status     int                 `json:"status"`
	Header     map[string][]string `json:"header,omitempty"`
	Body       *string             `json:"body,omitempty"`        // when the body is valid UTF-8
	BodyBase64 *string             `json:"body_base64,omitempty"` // otherwise
}

// leaseRanOut reports whether rec is a reservation whose lease ran out
// before it recorded an outcome, by the clock now.
func leaseRanOut(rec idem.Record, now time.Time) bool {
	return rec.Status == idem.StatusProcessing && !rec.LeaseExpiresAt.IsZero() && !rec.LeaseExpiresAt.After(now)
}

func newRecordJSON(rec idem.Record, now time.Time) recordJSON {
	out := recordJSON{
		Actor: rec.Scope.Actor, Operation: rec.Scope.Operation, Key: rec.Key, Status: rec.Status,
		LeaseRanOut: leaseRanOut(rec, now), Fingerprint: rec.Fingerprint.String(), Token: rec.Token,
		CreatedAt: rec.CreatedAt, ExpiresAt: rec.ExpiresAt, LastError: rec.LastError, ResolveReason: rec.ResolveReason,
	}
	inDoubt := rec.Status == idem.StatusUnknown || out.LeaseRanOut
	out.Resumable = inDoubt && rec.ResumeUntil.After(now)
	out.NeedsPerson = inDoubt && !out.Resumable
	if !rec.ResumeUntil.IsZero() {
		t := rec.ResumeUntil
		out.ResumeUntil = &t
	}
	if !rec.CompletedAt.IsZero() {
		t := rec.CompletedAt
		out.CompletedAt = &t
	}
	if !rec.UnknownAt.IsZero() {
		t := rec.UnknownAt
		out.UnknownAt = &t
	}
	if !rec.BodyExpiresAt.IsZero() {
		t := rec.BodyExpiresAt
		out.BodyExpiresAt = &t
	}
	if !rec.LeaseExpiresAt.IsZero() {
		t := rec.LeaseExpiresAt
		out.LeaseExpiresAt = &t
	}
	out.ResponseGone = rec.ResponseGone
	if r := rec.Response; r != nil {
		out.Response = &responseJSON{Status: r.Status, Header: r.Header}
		if rec.ResponseGone {
			return out
		}
		if utf8.Valid(r.Body) {
			s := string(r.Body)
			out.Response.Body = &s
		} else {
			s := base64.StdEncoding.EncodeToString(r.Body)
			out.Response.BodyBase64 = &s
		}
	}
	return out
}

// bodyView is a stored body as the record page shows it: always as text.
type bodyView struct {
	Kind      string // "empty", "json" (pretty-printed), "text" or "binary" (hex)
	Text      string
	Size      int64
	Truncated bool
}

// maxShownBody bounds the part of a body the page shows.
const maxShownBody = 64 << 10

// newBodyView shows body as text: pretty-printed when it is JSON, as it is
// when it is other text, as hex when it is not text. It is never rendered
// as HTML: the template escapes it like every other value.
func newBodyView(header map[string][]string, body []byte) bodyView {
	v := bodyView{Size: int64(len(body))}
	if len(body) == 0 {
		v.Kind = "empty"
		return v
	}
	shown := body
	if len(shown) > maxShownBody {
		shown, v.Truncated = shown[:maxShownBody], true
	}
	switch {
	case !v.Truncated && json.Valid(body) && isJSONType(header):
		var buf bytes.Buffer
		if json.Indent(&buf, body, "", "  ") == nil {
			v.Kind, v.Text = "json", buf.String()
			return v
		}
		fallthrough
	case utf8.Valid(shown):
		v.Kind, v.Text = "text", string(shown)
	default:
		v.Kind, v.Text = "binary", hexLines(shown)
	}
	return v
}

// isJSONType reports whether the stored Content-Type says JSON, or there
// is none (a body that parses as JSON is then shown as JSON).
func isJSONType(header map[string][]string) bool {
	var ct string
	for name, vs := range header {
		if strings.EqualFold(name, "Content-Type") && len(vs) > 0 {
			ct = vs[0]
		}
	}
	if ct == "" {
		return true
	}
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && (mt == "application/json" || strings.HasSuffix(mt, "+json"))
}

// hexLines is b as hex, 32 bytes a line.
func hexLines(b []byte) string {
	var sb strings.Builder
	for i := 0; i < len(b); i += 32 {
		end := min(i+32, len(b))
		fmt.Fprintf(&sb, "%08x  %s\n", i, hex.EncodeToString(b[i:end]))
	}
	return sb.String()
}

// headerView is one stored header, in name order.
type headerView struct{ Name, Value string }

func headerViews(h map[string][]string) []headerView {
	var out []headerView
	for name, vs := range h {
		for _, v := range vs {
			out = append(out, headerView{name, v})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// readShape is the status and content type of a succeeded record of scope
// (among its first keys): how the operation answers, which the verdict
// form offers as its default. ok is false when none is known.
func readShape(ctx context.Context, db idem.Beginner, scope idem.Scope) (status int, contentType string, ok bool, err error) {
	err = audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		rows, err := queries.ConsoleScopeShape(ctx, q, store.ConsoleScopeShapeParams{Actor: scope.Actor, Operation: scope.Operation})
		if err != nil || len(rows) == 0 {
			return err
		}
		status, contentType, ok = int(rows[0].Status), rows[0].ContentType, true
		return nil
	})
	return status, contentType, ok, err
}

// nextNeedsPerson is the oldest record that needs a person other than
// (scope, key); ok is false when there is none.
func nextNeedsPerson(ctx context.Context, db idem.Beginner, scope idem.Scope, key string) (item needsPersonItem, ok bool, err error) {
	err = audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		rows, err := queries.ConsoleNeedsPerson(ctx, q, store.ConsoleNeedsPersonParams{
			AfterCreatedAt: pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}, MaxRows: 2,
		})
		for _, r := range rows {
			if r.Actor == scope.Actor && r.Operation == scope.Operation && r.IdemKey == key {
				continue
			}
			item, ok = needsPersonItem{Actor: r.Actor, Operation: r.Operation, Key: r.IdemKey}, true
			break
		}
		return err
	})
	return item, ok, err
}
