package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/core"
	"github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver/pgxdriver"
	"github.com/pgidem/idem/internal/outbox"
)

// DefaultSchedule returns the relay's default schedule, Standard Webhooks'
// (https://www.standardwebhooks.com): an attempt at once, then retries 5
// seconds, 5 minutes, 30 minutes, 2 hours, 5 hours, 10 hours and 10 hours
// after each failure; eight attempts over about a day and a day and a half.
func DefaultSchedule() []time.Duration {
	return []time.Duration{0, 5 * time.Second, 5 * time.Minute, 30 * time.Minute,
		2 * time.Hour, 5 * time.Hour, 10 * time.Hour, 10 * time.Hour}
}

// RelayOptions configure a Relay. Zero fields take their defaults; a field
// out of range makes NewRelay return an error wrapping ErrInvalidConfig.
type RelayOptions struct {
	// Sender sends each event (required).
	Sender Sender
	// Schedule has one entry per attempt: the delay before it, counted
	// from the previous attempt's failure, each delay varied by up to ±10%
	// (jitter) so that events that failed together are not retried
	// together. A Sender's error with a RetryAfter() time.Duration method
	// (idemhttp.WebhookError: the answer's Retry-After) lengthens the
	// delay to what the destination asked, up to the schedule's longest. The first entry must be 0: the first attempt is made as
	// soon as a relay sees the event. After the last attempt fails, the
	// event is failed. Default: DefaultSchedule(). At most 100 entries,
	// none negative.
	Schedule []time.Duration
	// BatchSize is how many due events one claim takes (default 100, at
	// most 10000). The relay claims again when fewer than Workers of its
	// claimed events are left to send.
	BatchSize int
	// Workers is how many events are sent at once (default 10, at most
	// 1000).
	Workers int
	// AttemptTimeout bounds one call of the Sender (default 30s): its ctx
	// ends then, and the attempt counts as failed.
	AttemptTimeout time.Duration
	// Lease is how long a claim holds an event (default 2m, at least twice
	// AttemptTimeout): no other relay claims it meanwhile. A relay never
	// calls the Sender past its lease (it shortens the attempt's timeout,
	// and leaves an event whose lease is nearly over to the next claim), so
	// two relays never send one event at the same time. When a relay dies,
	// its claimed events are sent by another relay once the lease runs out.
	// Claimed events wait for a free worker, so keep BatchSize / Workers ×
	// AttemptTimeout well under Lease.
	Lease time.Duration
	// PollInterval is how often the relay looks for due events when no
	// notification wakes it (default 1s; at least 1ms). Retries are found
	// by polling: a retry is due up to PollInterval late.
	PollInterval time.Duration
	// PollOnly turns off LISTEN: the relay only polls. Set it when db is a
	// pool behind PgBouncer in transaction mode (or another transaction
	// pooler), where notifications are lost. Without it, a relay whose db
	// is a *pgxpool.Pool listens on EventsChannel on a connection of its
	// own (opened with the pool's configuration, outside the pool) and
	// sends a published event as soon as its transaction commits; other
	// Beginners poll.
	PollOnly bool
	// TTL is how long a delivered event stays in the outbox, for
	// LookupEvent and deduplication of Publish (default 72h). FailedTTL is
	// how long a failed event stays (default 30 days): after it, the event
	// is deleted unsent. The relay prunes both.
	TTL, FailedTTL time.Duration
	// Logger receives a record per failed claim, recording or prune (Warn)
	// and per event marked failed (Warn). Default: slog.Default().
	Logger *slog.Logger
}

// Limits of RelayOptions.
const (
	maxSchedule  = 100
	maxBatchSize = 10000
	maxWorkers   = 1000
	// pruneBatch is how many events one prune statement deletes at most.
	pruneBatch = 1000
	// stopGrace bounds the recording of the attempts that Run's end cut.
	stopGrace = 5 * time.Second
	// fastBound is how long a fast batch holds its transaction (and its
	// events' row locks) for its sends; the sends still running then get
	// a lease. See Run.
	fastBound = 100 * time.Millisecond
	// slowPause is how long a relay claims with leases only after a fast
	// batch's send outlived fastBound.
	slowPause = 30 * time.Second
)

// Relay sends the events that Publish wrote, from the outbox to their
// destinations through a Sender. Several relays (in one process or many)
// share the work: each claims due events with FOR UPDATE SKIP LOCKED,
// giving them a lease and a fencing token, sends them outside any
// transaction, and records each attempt and the event's new state guarded
// by the token, so a relay that stalled past its lease cannot overwrite a
// newer claim's outcome. The records of the attempts that finished go with
// the next claim, in one pipeline of statements (one round trip and one
// commit on a pool). With fast senders, on a *pgxpool.Pool of PostgreSQL,
// a batch is claimed by row locks only, sent, and recorded in one
// transaction (see fastCycle): the sends still running after fastBound
// get a lease there, and go on as above.
//
// Delivery is at least once: when a relay dies between a send and its
// record (or the database cannot record it), the event is sent again after
// the lease. The receiver deduplicates by Event.ID (Inbox,
// idemhttp.WebhookHandler). With no failure, each event is sent once.
type Relay struct {
	db      Beginner
	pool    *pgxpool.Pool // set when the relay listens
	opts    RelayOptions
	log     *slog.Logger
	running atomic.Bool
	citus   atomic.Int32 // 0: not known yet; 1: PostgreSQL; 2: Citus
	// fastBound is fastBound, but for tests.
	fastBound time.Duration
}

// NewRelay returns a relay that sends the outbox of db's database with
// opts. db is typically a *pgxpool.Pool (see RelayOptions.PollOnly); Run
// uses it from several goroutines at once (claims, records, pruning), so a
// single connection (*pgx.Conn, *pgxpool.Conn, pgx.Tx) cannot serve it. A nil db, or one
// of those, is ErrInvalidArgument; options out of range ErrInvalidConfig.
func NewRelay(db Beginner, opts RelayOptions) (*Relay, error) {
	if db == nil {
		return nil, core.Errorf("idem: new relay: %w: nil db", ErrInvalidArgument)
	}
	switch db.(type) {
	case *pgx.Conn, pgx.Tx, *pgxpool.Conn:
		return nil, core.Errorf("idem: new relay: %w: a %T is one connection, which Run would use from several goroutines "+
			"at once (claims, records, pruning): give it a *pgxpool.Pool", ErrInvalidArgument, db)
	}
	if err := opts.fill(); err != nil {
		return nil, core.Errorf("idem: new relay: %w: %s", ErrInvalidConfig, err.Error())
	}
	r := &Relay{db: db, opts: opts, log: opts.Logger, fastBound: fastBound}
	if p, ok := db.(*pgxpool.Pool); ok && !opts.PollOnly {
		r.pool = p
	}
	return r, nil
}

// fill sets the defaults and checks the ranges.
func (o *RelayOptions) fill() error {
	if o.Sender == nil {
		return errors.New("nil Sender")
	}
	if o.Schedule == nil {
		o.Schedule = DefaultSchedule()
	} else {
		o.Schedule = append([]time.Duration(nil), o.Schedule...)
	}
	switch {
	case len(o.Schedule) == 0 || len(o.Schedule) > maxSchedule:
		return fmt.Errorf("the Schedule has %d entries, want 1 to %d", len(o.Schedule), maxSchedule)
	case o.Schedule[0] != 0:
		return fmt.Errorf("the Schedule's first entry is %v: the first attempt is immediate (0)", o.Schedule[0])
	}
	for i, d := range o.Schedule {
		if d < 0 {
			return fmt.Errorf("entry %d of the Schedule is negative (%v)", i, d)
		}
	}
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.AttemptTimeout, 30*time.Second)
	def(&o.Lease, max(2*time.Minute, 2*o.AttemptTimeout))
	def(&o.PollInterval, time.Second)
	def(&o.TTL, 72*time.Hour)
	def(&o.FailedTTL, 30*24*time.Hour)
	if o.BatchSize == 0 {
		o.BatchSize = 100
	}
	if o.Workers == 0 {
		o.Workers = 10
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	switch {
	case o.BatchSize < 0 || o.BatchSize > maxBatchSize:
		return fmt.Errorf("BatchSize %d out of 1..%d", o.BatchSize, maxBatchSize)
	case o.Workers < 0 || o.Workers > maxWorkers:
		return fmt.Errorf("the Workers %d are out of 1..%d", o.Workers, maxWorkers)
	case o.AttemptTimeout < time.Millisecond:
		return fmt.Errorf("AttemptTimeout %v under 1ms", o.AttemptTimeout)
	case o.Lease < 2*o.AttemptTimeout:
		return fmt.Errorf("the Lease %v is under twice AttemptTimeout (%v)", o.Lease, o.AttemptTimeout)
	case o.PollInterval < time.Millisecond:
		return fmt.Errorf("PollInterval %v under 1ms", o.PollInterval)
	case o.TTL < 0 || o.FailedTTL < 0:
		return fmt.Errorf("negative TTL (%v) or FailedTTL (%v)", o.TTL, o.FailedTTL)
	}
	return nil
}

// claimed is an event a relay claimed, and what became of its attempt.
type claimed struct {
	ev         Event
	attempt    int    // its number, from 1
	position   int    // its place in the schedule, from 1
	claim      int64  // the claim's token
	version    string // the row version (ctid) the claim left, where EventRecord finds it
	leaseEnd   time.Time
	started    time.Time
	duration   time.Duration
	err        error
	sent       bool // the Sender was called
	stoppedRun bool // Run's end cut the attempt
	// fast: claimed by a row lock only (EventLock), in the transaction of
	// batch, which records the attempt; no lease written, the attempt not
	// counted yet. Cleared when the send outlived fastBound and its lease
	// was written.
	fast     bool
	batch    *fastBatch
	state    atomic.Int32 // queued, sending, finished, leased or dropped
	lostLock bool         // batch's transaction failed while the send ran: the send was cut
}

// The states of a claimed event with the workers. An event of the lease
// path goes from queued to sending, and back on results. An event of a
// fast batch that a worker took ends finished (its batch reads it) or,
// when fastBound passed first, leased (back on results, as the lease
// path's); one that no worker took by then is dropped.
const (
	queued   int32 = iota // in a work, not taken yet
	sending               // a worker took it
	finished              // a fast batch's send ended within fastBound
	leased                // a fast batch's send outlived fastBound: it got a lease
	dropped               // a fast batch gave it up before any worker took it
)

// work is a claimed batch handed to the workers as one slice: each worker
// that receives it takes its events one at a time, by next, until none is
// left, so a batch costs a channel send per worker rather than per event.
type work struct {
	items []*claimed
	next  atomic.Int32
}

// fastBatch is the events a fast batch locked: ctx ends when the batch's
// transaction fails (cutting the sends still running) or when every send
// ended; done is closed when every event's send ended (or it was dropped).
type fastBatch struct {
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
	left   atomic.Int32 // sends not yet ended (or dropped)
}

// Run sends events until ctx ends, then returns ctx's error once the
// attempts in flight are cut and recorded (each as failed and due again at
// once, for the next relay). It returns early only with ErrInvalidArgument,
// when the relay is running already. Failures of the database are logged
// and retried every PollInterval; they never end Run.
//
// One loop talks to the database: each cycle records the attempts that
// finished since the last one and claims the next batch, in one statement
// pipeline (one round trip and one commit on a pool), while the workers
// send. It claims when fewer than Workers claimed events are left to send.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return core.Errorf("idem: relay: %w: Run is running already", ErrInvalidArgument)
	}
	defer r.running.Store(false)

	wake := make(chan struct{}, 1)
	signal := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	// results holds every claimed event at once (at most BatchSize plus
	// Workers - 1), jobs at most Workers copies of each batch and so no more
	// than its events: neither the loop nor a worker ever blocks on them.
	capacity := r.opts.BatchSize + r.opts.Workers
	jobs := make(chan *work, capacity)
	results := make(chan *claimed, capacity)
	unsent := 0 // claimed, not yet back from a worker
	var wg sync.WaitGroup
	if r.pool != nil {
		wg.Go(func() { r.listen(ctx, signal) })
	}
	wg.Go(func() { r.prune(ctx) })
	var workers sync.WaitGroup
	for range r.opts.Workers {
		workers.Go(func() {
			for w := range jobs {
				for {
					i := int(w.next.Add(1)) - 1
					if i >= len(w.items) {
						break
					}
					c := w.items[i]
					if c.state.CompareAndSwap(queued, sending) {
						r.send(ctx, c)
						// A fast batch reads its finished sends itself; a
						// send it gave a lease comes back as the lease
						// path's.
						if c.batch == nil || !c.state.CompareAndSwap(sending, finished) {
							results <- c
							signal()
						}
					}
					if c.batch != nil && c.batch.left.Add(-1) == 0 {
						close(c.batch.done)
						c.batch.cancel()
					}
				}
			}
		})
	}

	// Finished attempts wait in done for the next claim, which records
	// them in its pipeline; when no claim comes (every worker busy), they
	// are recorded on their own once the oldest has waited recordDelay.
	recordDelay := min(r.opts.PollInterval, 100*time.Millisecond)
	poll := time.NewTimer(0)
	defer poll.Stop()
	var done []*claimed
	var oldest time.Time
	var slowUntil time.Time // claim with leases only until then
	for ctx.Err() == nil {
		before := len(done)
		done = drain(results, done)
		unsent -= len(done) - before
		if before == 0 && len(done) > 0 {
			oldest = time.Now()
		}
		n := 0
		if unsent < r.opts.Workers {
			n = r.opts.BatchSize
		}
		wait := r.opts.PollInterval
		if n > 0 && unsent == 0 && r.fastPath(ctx) && time.Now().After(slowUntil) {
			full, out, err := r.fastCycle(ctx, done, n, jobs, results)
			if err != nil && ctx.Err() == nil {
				r.log.Warn("idem: relay: claim failed", "err", err)
			}
			done = done[:0]
			unsent += out
			if out > 0 {
				slowUntil = time.Now().Add(slowPause)
			}
			if full && err == nil {
				continue // more may be due
			}
		} else if n > 0 || len(done) > 0 && time.Since(oldest) >= recordDelay {
			batch, err := r.cycle(ctx, done, n)
			if err != nil && ctx.Err() == nil {
				r.log.Warn("idem: relay: claim failed", "err", err)
			}
			done = done[:0]
			unsent += len(batch)
			handOut(jobs, batch, r.opts.Workers)
			if n > 0 && len(batch) == n && err == nil {
				continue // more may be due
			}
		} else if len(done) > 0 {
			wait = recordDelay - time.Since(oldest)
		}
		poll.Reset(wait)
		select {
		case <-ctx.Done():
		case <-wake:
		case <-poll.C:
		}
	}
	close(jobs)
	workers.Wait()
	close(results)
	if done = drain(results, done); len(done) > 0 {
		if _, err := r.cycle(ctx, done, 0); err != nil {
			r.log.Warn("idem: relay: recording attempts failed; the events are sent again after their lease",
				"events", len(done), "err", err)
		}
	}
	wg.Wait()
	return ctx.Err()
}

// handOut gives batch to up to workers workers, as one work.
func handOut(jobs chan<- *work, batch []*claimed, workers int) {
	if len(batch) == 0 {
		return
	}
	w := &work{items: batch}
	for range min(workers, len(batch)) {
		jobs <- w
	}
}

// drain appends to done the results waiting in results, without blocking.
func drain(results <-chan *claimed, done []*claimed) []*claimed {
	for {
		select {
		case c, ok := <-results:
			if !ok {
				return done
			}
			done = append(done, c)
		default:
			return done
		}
	}
}

// cycle records the attempts of done and claims up to n due events, in one
// statement pipeline (see pipeline). When it fails with a claim in it, the
// records are sent again alone; when they fail too, that is logged, and
// the events are sent again once their lease runs out.
func (r *Relay) cycle(ctx context.Context, done []*claimed, n int) ([]*claimed, error) {
	if len(done) == 0 && n == 0 {
		return nil, nil
	}
	// The records must land whatever ctx does (Run's end records the
	// attempts it cut): only a pipeline with a claim ends with ctx.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), max(stopGrace, r.opts.AttemptTimeout))
	defer cancel()
	if n > 0 {
		defer context.AfterFunc(ctx, cancel)()
	}
	citus, err := r.onCitus(pctx)
	if err != nil {
		return nil, err
	}
	var b pgx.Batch
	if err := r.queueRecords(&b, done, citus, false); err != nil {
		return nil, err
	}
	records := b.Len()
	if n > 0 {
		claim := db.EventClaim
		if citus {
			claim = db.EventClaimCitus
		}
		b.Queue(claim, r.opts.Lease.Microseconds(), int32(n))
	}
	if b.Len() == 0 {
		return nil, nil
	}
	start := time.Now()
	var rows []db.EventClaimRow
	err = r.pipeline(pctx, &b, func(br pgx.BatchResults) error {
		for range records {
			if _, err := br.Exec(); err != nil {
				return err
			}
		}
		if n == 0 {
			return nil
		}
		qr, err := br.Query()
		if err != nil {
			return err
		}
		rows, err = pgx.CollectRows(qr, func(row pgx.CollectableRow) (db.EventClaimRow, error) {
			var c db.EventClaimRow
			err := row.Scan(&c.Destination, &c.ID, &c.Topic, &c.Payload, &c.Header, &c.Attempts, &c.RetryFrom, &c.Claim, &c.RowVersion)
			return c, err
		})
		return err
	})
	if err != nil {
		if records > 0 && n > 0 {
			if _, rerr := r.cycle(ctx, done, 0); rerr != nil {
				r.log.Warn("idem: relay: recording attempts failed; the events are sent again after their lease",
					"events", len(done), "err", rerr)
			}
		}
		return nil, err
	}
	out := make([]*claimed, 0, len(rows))
	for _, row := range rows {
		header, err := outbox.DecodeHeader(row.Header)
		c := &claimed{
			ev:      Event{ID: row.ID, Topic: row.Topic, Destination: row.Destination, Payload: row.Payload, Header: header},
			attempt: int(row.Attempts), position: int(row.Attempts - row.RetryFrom), claim: row.Claim,
			version: row.RowVersion,
			// Measured from before the claim was sent: never later than
			// the database's.
			leaseEnd: start.Add(r.opts.Lease),
		}
		if err != nil {
			c.err = Permanent(fmt.Errorf("stored header: %w", err))
		}
		out = append(out, c)
	}
	return out, nil
}

// fastPath reports whether the relay may claim with row locks only (see
// fastCycle): on a *pgxpool.Pool of PostgreSQL (Citus refuses FOR UPDATE
// over a distributed table).
func (r *Relay) fastPath(ctx context.Context) bool {
	if _, ok := r.db.(*pgxpool.Pool); !ok {
		return false
	}
	citus, err := r.onCitus(ctx)
	return err == nil && !citus
}

// fastCycle is the path for fast senders, while every send ends within
// fastBound. On a connection of its own, one transaction for up to two
// batches: it records the attempts of done and locks up to n due events
// (EventLock: no write; other relays skip them), hands them to the
// workers, and once every send ended records their attempts (one write
// per event) and commits. While the batches are full and their sends end
// in time, the database works while the workers send: the first batch's
// sends run while the next batch is locked in the same transaction, and
// the second batch's while the first's attempts are recorded; then the
// second's records, the COMMIT and the next transaction's lock go in one
// pipeline. When fastBound passes with sends still running, it gives them
// a lease (EventLeaseLocked) and commits: they go on under the lease, and
// an event no worker took yet (or of a batch locked ahead) is left
// unwritten, due again at once. It returns whether more events may be due
// and how many sends are still out with the workers (their results come
// back on results, to be recorded as the lease path records them).
//
// When a transaction fails (its connection broke: the locks are gone), the
// sends still running are cut (their ctx ends) and awaited, and the
// attempts are recorded on their own, each written only while its event
// still carries the token the lock read.
func (r *Relay) fastCycle(ctx context.Context, done []*claimed, n int, jobs chan<- *work, results <-chan *claimed) (bool, int, error) {
	// The locks end with ctx; the records land whatever ctx does.
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	recordAlone := func(recs []*claimed) {
		if len(recs) == 0 {
			return
		}
		if _, err := r.cycle(ctx, recs, 0); err != nil {
			r.log.Warn("idem: relay: recording attempts failed; the events are sent again",
				"events", len(recs), "err", err)
		}
	}
	conn, err := r.db.(*pgxpool.Pool).Acquire(lctx)
	if err != nil {
		recordAlone(done)
		return false, 0, err
	}
	open := false // a transaction is open on conn
	released := false
	// release gives conn back (before a record on its own, which takes
	// another connection of the pool).
	release := func() {
		if released {
			return
		}
		released = true
		if open {
			// A failed statement leaves the transaction open (aborted):
			// roll it back, or the pool drops a broken connection.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			_ = conn.Conn().PgConn().Exec(rctx, "ROLLBACK").Close()
			cancel()
		}
		conn.Release()
	}
	defer release()
	// send sends q on conn and returns the reading of its results, which
	// must come before anything else is sent on conn.
	send := func(q *fastPipeline) func() error {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), max(stopGrace, r.opts.AttemptTimeout))
		stop := func() bool { return false }
		if q.lock && !q.ahead {
			// The records land whatever ctx does, the lock ends with it;
			// not the lock ahead, sent while the first batch's sends run:
			// cut, it would break the connection under them, where its
			// answer read to the end lets the transaction end as usual.
			stop = context.AfterFunc(lctx, cancel)
		}
		open = true
		br := q.send(pctx, conn)
		return func() error {
			err := q.read(br)
			stop()
			cancel()
			return err
		}
	}

	var p fastPipeline
	p.begin(r, done, n)
	var fb *fastBatch      // the batch being sent
	var earlier []*claimed // the attempts recorded in the open transaction by the pipelines read already
	var running []*claimed // the sends of fb that outlived fastBound
	// lost ends the cycle when the open transaction failed: its locks,
	// records and leases are gone. It cuts the sends still running, waits
	// for them (before any new claim, which would number its attempt as
	// theirs), and records them all on their own, with every attempt of
	// the transaction.
	lost := func(err error, recs []*claimed) (bool, int, error) {
		if fb != nil {
			fb.cancel()
		}
		recs = append(append([]*claimed(nil), earlier...), recs...)
		for range running {
			recs = append(recs, <-results)
		}
		release()
		recordAlone(recs)
		return false, 0, err
	}
	for {
		start := time.Now()
		err := send(&p)()
		if !p.committed {
			// The open transaction's COMMIT did not land.
			running = p.running
			return lost(err, append(p.landing, p.inTx...))
		}
		earlier = p.inTx
		if fb != nil {
			for _, c := range p.running {
				if l, found := p.leased[[2]string{c.ev.Destination, c.ev.ID}]; found {
					c.claim, c.version, c.fast = l.Claim, l.RowVersion, false
				}
			}
		}
		if err != nil {
			release()
			recordAlone(p.inTx)
			return false, len(p.running), err
		}
		if !p.lock {
			open = false
			return p.full, len(p.running), nil
		}

		// The batches of the open transaction: the one p locked, and the
		// one locked ahead while its sends ran.
		events := p.events
		second := false
		var records func() error // reads the first batch's records, sent during the second's sends
		var recorded []*claimed  // their attempts
		for {
			locked := len(events)
			if locked == 0 {
				p.end(r, nil, nil)
				break
			}
			fb = &fastBatch{done: make(chan struct{})}
			fb.ctx, fb.cancel = context.WithCancel(ctx)
			fb.left.Store(int32(locked))
			batch := make([]*claimed, locked)
			for i := range events {
				c := &events[i]
				c.fast, c.batch = true, fb
				// The lease written for a send that outlives fastBound
				// (now() of the transaction plus Lease) ends later than
				// this: start was read before the BEGIN was sent.
				c.leaseEnd = start.Add(r.opts.Lease)
				batch[i] = c
			}
			handOut(jobs, batch, r.opts.Workers)
			var ahead *fastPipeline
			var lockAhead func() error
			if !second && locked == n && ctx.Err() == nil {
				ahead = &fastPipeline{}
				ahead.lockAhead(n, batch)
				lockAhead = send(ahead)
			}

			// Wait for the sends, up to fastBound, then sort them: a send
			// that ended is recorded, one still running gets a lease, an
			// event no worker took is dropped (left unwritten: due again
			// at once).
			bound := time.NewTimer(r.fastBound)
			select {
			case <-fb.done:
			case <-bound.C:
			}
			bound.Stop()
			recs := make([]*claimed, 0, len(batch))
			running = nil
			all := true // every event was sent (or refused) within the bound
			for _, c := range batch {
				for {
					st := c.state.Load()
					if st == finished {
						recs = append(recs, c)
					} else if st == queued && c.state.CompareAndSwap(queued, dropped) {
						all = false
					} else if st == sending && c.state.CompareAndSwap(sending, leased) {
						running = append(running, c)
						all = false
					} else {
						continue // it moved on meanwhile
					}
					break
				}
			}
			if records != nil {
				err := records()
				records = nil
				if err != nil {
					return lost(err, append(recorded, recs...))
				}
				earlier = append(earlier[:len(earlier):len(earlier)], recorded...) // not into done's array
			}
			if lockAhead != nil {
				if err := lockAhead(); err != nil {
					return lost(err, recs)
				}
			}
			more := locked == n // more events may be due
			if ahead != nil {
				more = len(ahead.events) > 0
			}
			if all && ctx.Err() == nil && ahead != nil && len(ahead.events) > 0 {
				// Record this batch while the next one's sends run.
				var q fastPipeline
				q.reset()
				if q.records(r, recs, true); q.b.Len() > 0 {
					recorded, records = recs, send(&q)
				}
				// start stays the transaction's: the leases EventLeaseLocked
				// writes for this batch too count from its now().
				events, second = ahead.events, true
				continue
			}
			if all && ctx.Err() == nil && more && ahead == nil {
				p.chain(r, recs, n)
			} else {
				p.end(r, recs, running)
				p.full = more
			}
			break
		}
	}
}

// fastPipeline is one round trip of fastCycle: the end of the open
// transaction (the records of its batch, the leases of its sends still
// running, COMMIT), then, when lock is set, the next transaction's start
// (BEGIN, records, EventLock).
type fastPipeline struct {
	b             pgx.Batch
	steps         []int      // what each statement of b is
	landing, inTx []*claimed // the attempts recorded before COMMIT, after BEGIN
	running       []*claimed // the sends given a lease before COMMIT
	lock          bool       // ends with EventLock
	ahead         bool       // the lock is EventLockAhead's, in a transaction with sends running
	full          bool       // the last lock took n events
	committed     bool       // after run: the COMMIT landed (true when there was none)
	n             int        // EventLock's limit
	events        []claimed  // what EventLock locked, in one allocation
	leased        map[[2]string]db.EventLeaseLockedRow
}

// Steps of a fastPipeline.
const (
	stepExec = iota
	stepCommit
	stepLease
	stepLock
)

func (p *fastPipeline) reset() {
	*p = fastPipeline{committed: true}
}

func (p *fastPipeline) queue(step int, sql string, args ...any) {
	p.b.Queue(sql, args...)
	p.steps = append(p.steps, step)
}

// records queues the records of recs; queueRecords fails only when the
// attempts cannot be encoded, which they always can. locked: the fast
// events of recs are locked by the transaction the records go in.
func (p *fastPipeline) records(r *Relay, recs []*claimed, locked bool) {
	before := p.b.Len()
	_ = r.queueRecords(&p.b, recs, false, locked)
	for range p.b.Len() - before {
		p.steps = append(p.steps, stepExec)
	}
}

// begin is the first pipeline: BEGIN, the records of done, EventLock.
func (p *fastPipeline) begin(r *Relay, done []*claimed, n int) {
	p.reset()
	p.queue(stepExec, "BEGIN")
	p.records(r, done, false)
	p.inTx = done
	p.queue(stepLock, db.EventLock, int32(n))
	p.lock, p.n = true, n
}

// end ends the open transaction: the records of recs, the leases of
// running, COMMIT.
func (p *fastPipeline) end(r *Relay, recs, running []*claimed) {
	p.reset()
	p.records(r, recs, true)
	p.landing, p.running = recs, running
	if len(running) > 0 {
		versions := make([]string, len(running))
		for i, c := range running {
			versions[i] = c.version
		}
		p.queue(stepLease, db.EventLeaseLocked, r.opts.Lease.Microseconds(), versions)
	}
	p.queue(stepCommit, "COMMIT")
}

// chain ends the open transaction with the records of recs and starts the
// next one, with EventLock.
func (p *fastPipeline) chain(r *Relay, recs []*claimed, n int) {
	p.end(r, recs, nil)
	p.queue(stepExec, "BEGIN")
	p.queue(stepLock, db.EventLock, int32(n))
	p.lock, p.n = true, n
}

// lockAhead is a pipeline of EventLockAhead alone, in the open
// transaction, which holds the locks of batch.
func (p *fastPipeline) lockAhead(n int, batch []*claimed) {
	p.reset()
	skip := make([]string, len(batch))
	for i, c := range batch {
		skip[i] = c.version
	}
	p.queue(stepLock, db.EventLockAhead, skip, int32(n))
	p.lock, p.ahead, p.n = true, true, n
}

// send sends the pipeline on conn; read reads its results, before anything
// else is sent on conn.
func (p *fastPipeline) send(ctx context.Context, conn *pgxpool.Conn) pgx.BatchResults {
	for _, s := range p.steps {
		if s == stepCommit {
			p.committed = false
		}
	}
	p.leased = map[[2]string]db.EventLeaseLockedRow{}
	return conn.SendBatch(ctx, &p.b)
}

// read reads the results of the pipeline that send sent.
func (p *fastPipeline) read(br pgx.BatchResults) error {
	return readBatch(br, func(br pgx.BatchResults) error {
		for _, s := range p.steps {
			switch s {
			case stepExec:
				if _, err := br.Exec(); err != nil {
					return err
				}
			case stepCommit:
				tag, err := br.Exec()
				if err != nil {
					return err
				}
				if tag.String() != "COMMIT" {
					return fmt.Errorf("the fast batch's transaction ended with %s", tag.String())
				}
				p.committed = true
			case stepLease:
				qr, err := br.Query()
				if err != nil {
					return err
				}
				for qr.Next() {
					var l db.EventLeaseLockedRow
					if err := qr.Scan(&l.Destination, &l.ID, &l.Claim, &l.RowVersion); err != nil {
						qr.Close()
						return err
					}
					p.leased[[2]string{l.Destination, l.ID}] = l
				}
				qr.Close()
				if err := qr.Err(); err != nil {
					return err
				}
			case stepLock:
				qr, err := br.Query()
				if err != nil {
					return err
				}
				// Scanned straight into the batch's events: room for a
				// whole batch up to 128 at the first row (none at idle),
				// grown by copying beyond (none is handed out yet).
				p.events = nil
				k := 0
				var row db.EventLockRow
				for qr.Next() {
					if k == len(p.events) {
						grown := make([]claimed, min(p.n, max(128, 2*k)))
						if k == len(grown) {
							qr.Close()
							return fmt.Errorf("EventLock returned more than %d events", p.n)
						}
						copy(grown, p.events)
						p.events = grown
					}
					if err := qr.Scan(&row.Destination, &row.ID, &row.Topic, &row.Payload, &row.Header, &row.Attempts, &row.RetryFrom,
						&row.Claim, &row.RowVersion); err != nil {
						qr.Close()
						return err
					}
					c := &p.events[k]
					c.ev = Event{ID: row.ID, Topic: row.Topic, Destination: row.Destination, Payload: row.Payload}
					c.attempt, c.position, c.claim, c.version = int(row.Attempts), int(row.Attempts-row.RetryFrom), row.Claim, row.RowVersion
					header, err := outbox.DecodeHeader(row.Header)
					c.ev.Header = header
					if err != nil {
						c.err = Permanent(fmt.Errorf("stored header: %w", err))
					}
					row.Payload = nil // a new one for the next row
					k++
				}
				qr.Close()
				if err := qr.Err(); err != nil {
					return err
				}
				p.events = p.events[:k]
			}
		}
		return nil
	})
}

// readBatch reads br's results with read, then closes it.
func readBatch(br pgx.BatchResults, read func(pgx.BatchResults) error) error {
	err := read(br)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// pipeline sends b on the relay's db and reads its results with read: on a
// *pgxpool.Pool in one round trip, as one implicit transaction; on another
// Beginner in a transaction begun on it.
func (r *Relay) pipeline(ctx context.Context, b *pgx.Batch, read func(pgx.BatchResults) error) error {
	run := func(sb batchSender) error {
		br := sb.SendBatch(ctx, b)
		err := read(br)
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		return err
	}
	if sb, ok := r.db.(batchSender); ok {
		return run(sb)
	}
	return pgx.BeginFunc(ctx, r.db, func(tx pgx.Tx) error { return run(tx) })
}

// batchSender sends a pipeline of statements (*pgxpool.Pool, pgx.Tx).
type batchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// send makes one attempt at c, unless its lease is nearly over or Run ended.
func (r *Relay) send(ctx context.Context, c *claimed) {
	if c.err != nil || ctx.Err() != nil {
		return
	}
	// Stop the attempt a tenth of the lease before it runs out, so that it
	// never overlaps the next claim's.
	deadline := time.Now().Add(r.opts.AttemptTimeout)
	if end := c.leaseEnd.Add(-r.opts.Lease / 10); end.Before(deadline) {
		deadline = end
	}
	if time.Until(deadline) < r.opts.AttemptTimeout/10 {
		return // left to the next claim
	}
	parent := ctx
	if c.batch != nil {
		parent = c.batch.ctx // ends with ctx, or when the batch's transaction failed
	}
	sctx, cancel := context.WithDeadline(parent, deadline)
	defer cancel()
	c.sent, c.started = true, time.Now()
	c.err = r.opts.Sender.Send(sctx, Delivery{Event: c.ev, Attempt: c.attempt})
	c.duration = time.Since(c.started)
	switch {
	case c.err == nil:
	case ctx.Err() != nil:
		c.stoppedRun = true
	case c.batch != nil && c.batch.ctx.Err() != nil:
		c.lostLock = true
	}
}

// queueRecords queues in b the statements that record the attempts of
// done: one for every attempt, and one per claimed event that was not
// attempted (given back, due at once). locked: b runs in the transaction
// that holds the locks of done's fast events, so their deliveries are
// written without a guard's log (EventRecordLocked).
func (r *Relay) queueRecords(b *pgx.Batch, done []*claimed, citus, locked bool) error {
	var attempts []recordedAttempt
	var del db.EventRecordDeliveriesParams // the deliveries, as arrays
	var lk db.EventRecordLockedParams      // the deliveries of locked events
	for _, c := range done {
		if !c.sent && c.err == nil {
			// Not attempted: due again at once, for any relay (a lock
			// alone is released with its transaction).
			if !c.fast {
				b.Queue(db.EventRelease, c.ev.Destination, c.ev.ID, c.claim)
			}
			continue
		}
		if c.err == nil && locked && c.fast {
			if lk.RowVersions == nil {
				lk.RowVersions, lk.Claims, lk.Attempts = make([]string, 0, len(done)), make([]int64, 0, len(done)), make([]int32, 0, len(done))
				lk.StartedAt, lk.DurationMicros = make([]pgtype.Timestamptz, 0, len(done)), make([]int64, 0, len(done))
			}
			lk.RowVersions, lk.Claims, lk.Attempts = append(lk.RowVersions, c.version), append(lk.Claims, c.claim), append(lk.Attempts, int32(c.attempt))
			lk.StartedAt = append(lk.StartedAt, pgtype.Timestamptz{Time: c.started, Valid: true})
			lk.DurationMicros = append(lk.DurationMicros, c.duration.Microseconds())
			continue
		}
		status, delay := r.outcome(c)
		a := recordedAttempt{Destination: c.ev.Destination, ID: c.ev.ID, Claim: c.claim, RowVersion: c.version, Attempt: c.attempt,
			StartedAt: c.started, DurationMicros: c.duration.Microseconds(), Permanent: IsPermanent(c.err),
			Status: string(status), DelayMicros: delay.Microseconds(), TTLMicros: r.opts.TTL.Microseconds()}
		if !c.sent {
			a.StartedAt = time.Now()
		}
		if c.err != nil {
			msg := errorText(c.err)
			switch {
			case c.stoppedRun:
				msg = "relay stopped: " + msg
			case c.lostLock:
				msg = "relay lost its claim: " + msg
			}
			a.Error = &msg
		}
		if status == EventFailed {
			a.TTLMicros = r.opts.FailedTTL.Microseconds()
			r.log.Warn("idem: relay: event failed", "id", c.ev.ID, "destination", c.ev.Destination,
				"attempt", c.attempt, "err", c.err)
		}
		if !citus && status == EventDelivered {
			del.Destinations, del.Ids = append(del.Destinations, a.Destination), append(del.Ids, a.ID)
			del.Claims, del.RowVersions = append(del.Claims, a.Claim), append(del.RowVersions, a.RowVersion)
			del.Attempts = append(del.Attempts, int32(a.Attempt))
			del.StartedAt = append(del.StartedAt, pgtype.Timestamptz{Time: a.StartedAt, Valid: true})
			del.DurationMicros = append(del.DurationMicros, a.DurationMicros)
			continue
		}
		if citus {
			// One statement per attempt, each routed to its worker.
			var errText pgtype.Text
			if a.Error != nil {
				errText = pgtype.Text{String: *a.Error, Valid: true}
			}
			b.Queue(db.EventRecordOne, a.Status, a.DelayMicros, int32(a.Attempt),
				pgtype.Timestamptz{Time: a.StartedAt, Valid: true}, a.DurationMicros, errText, a.TTLMicros,
				a.Destination, a.ID, a.Claim, a.Permanent)
			continue
		}
		attempts = append(attempts, a)
	}
	if len(attempts) > 0 {
		js, err := json.Marshal(attempts)
		if err != nil {
			return err
		}
		b.Queue(db.EventRecord, string(js))
	}
	if len(del.Ids) > 0 {
		b.Queue(db.EventRecordDeliveries, del.Destinations, del.Ids, del.Claims, del.RowVersions, del.Attempts, del.StartedAt,
			del.DurationMicros, r.opts.TTL.Microseconds())
	}
	if len(lk.RowVersions) > 0 {
		b.Queue(db.EventRecordLocked, lk.RowVersions, lk.Claims, lk.Attempts, lk.StartedAt, lk.DurationMicros, r.opts.TTL.Microseconds())
	}
	return nil
}

// recordedAttempt is one attempt as EventRecord reads it.
type recordedAttempt struct {
	Destination    string    `json:"destination"`
	ID             string    `json:"id"`
	Claim          int64     `json:"claim"`
	RowVersion     string    `json:"row_version"`
	Attempt        int       `json:"attempt"`
	StartedAt      time.Time `json:"started_at"`
	DurationMicros int64     `json:"duration_micros"`
	Error          *string   `json:"error"`
	Permanent      bool      `json:"permanent"`
	Status         string    `json:"status"`
	DelayMicros    int64     `json:"delay_micros"`
	TTLMicros      int64     `json:"ttl_micros"`
}

// outcome is the state an attempt leaves its event in, and the delay
// before the next attempt when it stays pending.
func (r *Relay) outcome(c *claimed) (EventStatus, time.Duration) {
	switch {
	case c.err == nil:
		return EventDelivered, 0
	case c.stoppedRun || c.lostLock:
		return EventPending, 0
	case IsPermanent(c.err) || c.position >= len(r.opts.Schedule):
		return EventFailed, 0
	}
	d := r.opts.Schedule[c.position]
	if d > 0 {
		d += time.Duration(rand.Int64N(int64(d/5)+1)) - d/10 // ±10%
	}
	// The destination asked for a longer wait (Retry-After, through an
	// error such as *idemhttp.WebhookError): wait that long, up to the
	// schedule's longest delay, so that no answer parks an event beyond it.
	var asked interface{ RetryAfter() time.Duration }
	if errors.As(c.err, &asked) {
		d = max(d, min(asked.RetryAfter(), slices.Max(r.opts.Schedule)))
	}
	return EventPending, d
}

// listen wakes the relay on every notification of EventsChannel, on a
// connection of its own, until ctx ends; when the connection fails it
// reconnects after PollInterval (the relay polls meanwhile).
func (r *Relay) listen(ctx context.Context, wake func()) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		r.log.Warn("idem: relay: LISTEN connection failed; polling until it is back", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(r.opts.PollInterval):
		}
	}
}

// listenOnce listens on one connection until it fails or ctx ends.
func (r *Relay) listenOnce(ctx context.Context, wake func()) error {
	conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+EventsChannel); err != nil {
		return err
	}
	wake() // events published while nobody listened
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		wake()
	}
}

// prune deletes the finished events past their TTL, at the start and then
// every minute (or TTL, when shorter), until ctx ends.
func (r *Relay) prune(ctx context.Context) {
	every := max(r.opts.PollInterval, min(time.Minute, r.opts.TTL, r.opts.FailedTTL))
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for ctx.Err() == nil {
			n, err := r.pruneBatch(ctx)
			if err != nil && ctx.Err() == nil {
				r.log.Warn("idem: relay: prune failed", "err", err)
			}
			if err != nil || n < pruneBatch {
				break
			}
		}
		t.Reset(every)
	}
}

// pruneBatch deletes up to pruneBatch finished events past their expiry,
// and their attempt logs, in one transaction.
func (r *Relay) pruneBatch(ctx context.Context) (int64, error) {
	citus, err := r.onCitus(ctx)
	if err != nil {
		return 0, err
	}
	tx, err := r.db.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var n int64
	if citus {
		// READ COMMITTED whatever the database's default (EventPruneCitus).
		if _, err = tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"); err == nil {
			n, err = dbQueries.EventPruneCitus(ctx, tx, pruneBatch)
		}
	} else {
		n, err = dbQueries.EventPrune(ctx, tx, pruneBatch)
	}
	if err != nil {
		return 0, err
	}
	return n, tx.Commit(ctx)
}

// onCitus reports whether the relay's database runs Citus, asking it (in
// a transaction of its own) the first time: Citus refuses FOR UPDATE over
// a distributed table, so the claim and the prune take statements of
// their own there.
func (r *Relay) onCitus(ctx context.Context) (bool, error) {
	switch r.citus.Load() {
	case 1:
		return false, nil
	case 2:
		return true, nil
	}
	var citus bool
	err := pgx.BeginFunc(ctx, r.db, func(tx pgx.Tx) error {
		var err error
		citus, err = pgxdriver.HasCitus(ctx, tx)
		return err
	})
	if err != nil {
		return false, err
	}
	if citus {
		r.citus.Store(2)
	} else {
		r.citus.Store(1)
	}
	return citus, nil
}

// maxErrorText bounds the error text an attempt records, in bytes.
const maxErrorText = 4096

// errorText is err's message as an attempt records it: valid UTF-8 without
// NUL (jsonb and text refuse it), at most maxErrorText bytes.
func errorText(err error) string {
	msg := strings.ReplaceAll(strings.ToValidUTF8(err.Error(), "\uFFFD"), "\x00", "")
	if len(msg) > maxErrorText {
		msg = strings.ToValidUTF8(msg[:maxErrorText], "")
	}
	return msg
}
