package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// order is a typed outcome with a field encoding/json leaves out.
type order struct {
	ID     int64     `json:"id"`
	Items  []string  `json:"items"`
	At     time.Time `json:"at"`
	secret string
}

// placeOrder is a typed fn that writes one effects row; calls counts its
// executions.
func placeOrder(calls *atomic.Int64, key string) func(ctx context.Context, tx pgx.Tx) (order, error) {
	return func(ctx context.Context, tx pgx.Tx) (order, error) {
		calls.Add(1)
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO effects (key) VALUES ($1) RETURNING id`, key).Scan(&id); err != nil {
			return order{}, err
		}
		return order{ID: id, Items: []string{"goose"}, At: time.Now(), secret: "not stored"}, nil
	}
}

func TestDoJSONFirstCallThenReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client, err := idem.New(idem.Config{TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64

	// In the caller's transaction, with the package defaults.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	first, replayed, err := idem.DoJSON(ctx, tx, scope, "typed-1", fpA, placeOrder(&calls, "typed-1"))
	if err != nil || replayed {
		t.Fatalf("first: %+v, %v, %v", first, replayed, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if first.secret != "" || first.At.IsZero() || len(first.Items) != 1 {
		t.Fatalf("first call did not return the decoded JSON: %#v", first)
	}
	// Replays, in a transaction of its own and with a configured Client,
	// return the same value.
	for _, call := range []func() (order, bool, error){
		func() (order, bool, error) {
			return idem.DoInTxJSON(ctx, pool, scope, "typed-1", fpA, placeOrder(&calls, "typed-1"))
		},
		func() (order, bool, error) {
			return idem.DoInTxJSONWith(ctx, client, pool, scope, "typed-1", fpA, placeOrder(&calls, "typed-1"))
		},
		func() (order, bool, error) {
			var (
				v        order
				replayed bool
			)
			err := client.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				var err error
				v, replayed, err = idem.DoJSONWith(ctx, client, tx, scope, "typed-1", fpA, placeOrder(&calls, "typed-1"))
				return err
			})
			return v, replayed, err
		},
	} {
		again, replayed, err := call()
		if err != nil || !replayed {
			t.Fatalf("replay: %v, %v", replayed, err)
		}
		if !reflect.DeepEqual(again, first) {
			t.Fatalf("replay differs:\n got %#v\nwant %#v", again, first)
		}
	}
	if calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("fn ran %d times, %d effects; want 1", calls.Load(), effects(t, pool))
	}
	// Stored as the JSON of the value, status 0.
	var status int
	var body []byte
	if err := pool.QueryRow(ctx, `SELECT response_status, response_body FROM idem_keys`).Scan(&status, &body); err != nil {
		t.Fatal(err)
	}
	if want, _ := json.Marshal(first); status != 0 || string(body) != string(want) {
		t.Fatalf("stored %d %s, want 0 %s", status, body, want)
	}

	// A new key and DoInTxJSON on a fresh call.
	v, replayed, err := idem.DoInTxJSON(ctx, pool, scope, "typed-2", fpA, placeOrder(&calls, "typed-2"))
	if err != nil || replayed || v.ID == first.ID {
		t.Fatalf("typed-2: %+v, %v, %v", v, replayed, err)
	}
	// Different fingerprint: ErrKeyReused, fn does not run.
	if _, _, err := idem.DoInTxJSON(ctx, pool, scope, "typed-2", fpB, placeOrder(&calls, "typed-2")); !errors.Is(err, idem.ErrKeyReused) {
		t.Fatalf("err = %v, want ErrKeyReused", err)
	}
	if calls.Load() != 2 {
		t.Fatalf("fn ran %d times, want 2", calls.Load())
	}
}

// insufficient is a typed refusal.
type insufficient struct {
	Need int `json:"need"`
	Have int `json:"have"`
}

func TestDoJSONRejectIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (order, error) {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ('rej', 'must be undone')`); err != nil {
			return order{}, err
		}
		return order{}, fmt.Errorf("order: %w", idem.RejectJSON(402, insufficient{Need: 100, Have: 40}))
	}
	check := func(v order, replayed, wantReplayed bool, err error) {
		t.Helper()
		var rej *idem.RejectedError
		if !errors.As(err, &rej) || rej.Status != 402 || string(rej.Body) != `{"need":100,"have":40}` {
			t.Fatalf("err = %v, want a *RejectedError 402", err)
		}
		if replayed != wantReplayed || !reflect.DeepEqual(v, order{}) {
			t.Fatalf("value %+v, replayed %v; want zero, %v", v, replayed, wantReplayed)
		}
		var got insufficient
		if err := rej.Decode(&got); err != nil || got != (insufficient{Need: 100, Have: 40}) {
			t.Fatalf("Decode: %+v, %v", got, err)
		}
		var wrong struct{ Need string }
		if err := rej.Decode(&wrong); !errors.Is(err, idem.ErrStoredValue) {
			t.Fatalf("Decode into the wrong type: %v, want ErrStoredValue", err)
		}
	}

	// In the caller's transaction: the refusal is an outcome, committed
	// with the caller's own writes; fn's writes are undone.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	v, replayed, err := idem.DoJSON(ctx, tx, scope, "rej", fpA, fn)
	check(v, replayed, false, err)
	if _, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ('caller', 'kept')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	v, replayed, err = idem.DoInTxJSON(ctx, pool, scope, "rej", fpA, fn)
	check(v, replayed, true, err)

	// DoInTxJSON commits the refusal it returns.
	v, replayed, err = idem.DoInTxJSON(ctx, pool, scope, "rej-2", fpA, fn)
	check(v, replayed, false, err)
	v, replayed, err = idem.DoInTxJSON(ctx, pool, scope, "rej-2", fpA, fn)
	check(v, replayed, true, err)

	if calls.Load() != 2 || count(t, pool, `SELECT count(*) FROM effects WHERE key = 'rej'`) != 0 || effects(t, pool) != 1 {
		t.Fatalf("calls %d, effects %d; want 2 calls and only the caller's write", calls.Load(), effects(t, pool))
	}

	// Plain Reject works too, with a status; under Do, RejectJSON is a
	// Response with that status and the JSON body.
	plain := func(context.Context, pgx.Tx) (order, error) {
		return order{}, idem.Reject(idem.Response{Status: 409, Body: []byte(`"busy"`)})
	}
	_, _, err = idem.DoInTxJSON(ctx, pool, scope, "rej-plain", fpA, plain)
	var rej *idem.RejectedError
	if !errors.As(err, &rej) || rej.Status != 409 || string(rej.Body) != `"busy"` {
		t.Fatalf("plain Reject: %v", err)
	}
	res, err := idem.DoInTx(ctx, pool, scope, "rej-do", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{}, idem.RejectJSON(422, map[string]string{"title": "no"})
	})
	if err != nil || res.Status != 422 || string(res.Body) != `{"title":"no"}` {
		t.Fatalf("RejectJSON under Do: %+v, %v", res, err)
	}
}

// Every unstorable outcome undoes fn's writes and the claim, stores nothing,
// leaves the caller's transaction usable and the key free.
func TestDoJSONUnstorableUndoesEverything(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	write := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (key, note) VALUES ('bad', 'must be undone')`)
		return err
	}
	type withChan struct{ C chan int }
	cases := []struct {
		name string
		run  func(tx pgx.Tx) error
		as   any // an error type the chain must hold, or nil
	}{
		{"channel", func(tx pgx.Tx) error {
			_, _, err := idem.DoJSON(ctx, tx, scope, "bad", fpA, func(ctx context.Context, tx pgx.Tx) (withChan, error) {
				return withChan{C: make(chan int)}, write(ctx, tx)
			})
			return err
		}, new(*json.UnsupportedTypeError)},
		{"NaN", func(tx pgx.Tx) error {
			_, _, err := idem.DoJSON(ctx, tx, scope, "bad", fpA, func(ctx context.Context, tx pgx.Tx) (float64, error) {
				return math.NaN(), write(ctx, tx)
			})
			return err
		}, new(*json.UnsupportedValueError)},
		{"does not decode back", func(tx pgx.Tx) error {
			_, _, err := idem.DoJSON(ctx, tx, scope, "bad", fpA, func(ctx context.Context, tx pgx.Tx) (oneWay, error) {
				return oneWay{N: 7}, write(ctx, tx)
			})
			return err
		}, new(*json.UnmarshalTypeError)},
		{"RejectJSON of a channel", func(tx pgx.Tx) error {
			_, _, err := idem.DoJSON(ctx, tx, scope, "bad", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
				if err := write(ctx, tx); err != nil {
					return 0, err
				}
				return 0, idem.RejectJSON(402, make(chan int))
			})
			return err
		}, new(*json.UnsupportedTypeError)},
		{"RejectJSON status 0", func(tx pgx.Tx) error {
			_, _, err := idem.DoJSON(ctx, tx, scope, "bad", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
				if err := write(ctx, tx); err != nil {
					return 0, err
				}
				return 0, idem.RejectJSON(0, "x")
			})
			return err
		}, nil},
		{"Reject status 0", func(tx pgx.Tx) error {
			_, _, err := idem.DoJSON(ctx, tx, scope, "bad", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
				if err := write(ctx, tx); err != nil {
					return 0, err
				}
				return 0, idem.Reject(idem.Response{Body: []byte(`"x"`)})
			})
			return err
		}, nil},
		{"RejectJSON status 1000", func(tx pgx.Tx) error {
			_, _, err := idem.DoJSON(ctx, tx, scope, "bad", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
				if err := write(ctx, tx); err != nil {
					return 0, err
				}
				return 0, idem.RejectJSON(1000, "x")
			})
			return err
		}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			err = c.run(tx)
			if !errors.Is(err, idem.ErrInvalidResponse) {
				t.Fatalf("err = %v, want ErrInvalidResponse", err)
			}
			if c.as != nil && !errors.As(err, c.as) {
				t.Fatalf("err = %v, want %T in the chain", err, c.as)
			}
			// The transaction is usable and holds nothing of fn's.
			var n int
			if err := tx.QueryRow(ctx, `SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_keys)`).Scan(&n); err != nil || n != 0 {
				t.Fatalf("after the failure: %d rows, %v", n, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			// The key is free: a storable outcome runs and is stored.
			v, replayed, err := idem.DoInTxJSON(ctx, pool, scope, "bad", fpA, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
			if err != nil || replayed || v != 1 {
				t.Fatalf("key not free: %v, %v, %v", v, replayed, err)
			}
			if _, err := pool.Exec(ctx, `DELETE FROM idem_keys`); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// oneWay marshals to a string but decodes from a number only.
type oneWay struct{ N int }

func (o oneWay) MarshalJSON() ([]byte, error) { return json.Marshal(fmt.Sprint(o.N)) }

func (o *oneWay) UnmarshalJSON(b []byte) error {
	var n int
	if err := json.Unmarshal(b, &n); err != nil {
		return err
	}
	o.N = n
	return nil
}

// A stored outcome that does not decode into T is an error, not a zero
// value, and fn does not run.
func TestDoJSONStoredValueDoesNotDecode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	type v1 struct {
		Total string `json:"total"`
	}
	type v2 struct {
		Total int `json:"total"`
	}
	if _, _, err := idem.DoInTxJSON(ctx, pool, scope, "evolved", fpA, func(context.Context, pgx.Tx) (v1, error) {
		return v1{Total: "12.50"}, nil
	}); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	got, replayed, err := idem.DoInTxJSON(ctx, pool, scope, "evolved", fpA, func(context.Context, pgx.Tx) (v2, error) {
		calls.Add(1)
		return v2{Total: 1}, nil
	})
	var typeErr *json.UnmarshalTypeError
	if !errors.Is(err, idem.ErrStoredValue) || !errors.As(err, &typeErr) || got != (v2{}) || replayed || calls.Load() != 0 {
		t.Fatalf("got %+v, %v, %v, calls %d; want ErrStoredValue and a zero value", got, replayed, err, calls.Load())
	}
	// A key stored by Do with bytes that are not JSON.
	if _, err := idem.DoInTx(ctx, pool, scope, "bytes", fpA, func(context.Context, pgx.Tx) (idem.Response, error) {
		return idem.Response{Body: []byte("plain text")}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := idem.DoInTxJSON(ctx, pool, scope, "bytes", fpA, func(context.Context, pgx.Tx) (string, error) {
		calls.Add(1)
		return "", nil
	}); !errors.Is(err, idem.ErrStoredValue) || calls.Load() != 0 {
		t.Fatalf("err = %v, calls %d; want ErrStoredValue", err, calls.Load())
	}
}

func TestDoJSONBadInputTouchesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	var calls atomic.Int64
	fn := placeOrder(&calls, "bad")
	cases := []struct {
		name string
		run  func() error
		want error
	}{
		{"nil fn", func() error { _, _, err := idem.DoInTxJSON[order](ctx, pool, scope, "k", fpA, nil); return err }, idem.ErrInvalidArgument},
		{"nil client", func() error { _, _, err := idem.DoInTxJSONWith(ctx, nil, pool, scope, "k", fpA, fn); return err }, idem.ErrInvalidArgument},
		{"nil db", func() error { _, _, err := idem.DoInTxJSON(ctx, nil, scope, "k", fpA, fn); return err }, idem.ErrInvalidArgument},
		{"nil tx", func() error { _, _, err := idem.DoJSON(ctx, nil, scope, "k", fpA, fn); return err }, idem.ErrInvalidArgument},
		{"nil client, tx", func() error {
			_, _, err := idem.DoJSONWith(ctx, nil, nil, scope, "k", fpA, fn)
			return err
		}, idem.ErrInvalidArgument},
		{"bad key", func() error { _, _, err := idem.DoInTxJSON(ctx, pool, scope, "a b", fpA, fn); return err }, idem.ErrInvalidKey},
		{"long key", func() error {
			_, _, err := idem.DoInTxJSON(ctx, pool, scope, strings.Repeat("k", 256), fpA, fn)
			return err
		}, idem.ErrInvalidKey},
		{"bad scope", func() error {
			_, _, err := idem.DoInTxJSON(ctx, pool, idem.Scope{Actor: "a"}, "k", fpA, fn)
			return err
		}, idem.ErrInvalidScope},
	}
	for _, c := range cases {
		if err := c.run(); !errors.Is(err, c.want) {
			t.Fatalf("%s: err = %v, want %v", c.name, err, c.want)
		}
	}
	var nilPool *pgxpool.Pool
	if _, _, err := idem.DoInTxJSON(ctx, nilPool, scope, "k", fpA, fn); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Fatalf("nil pool: %v", err)
	}
	if calls.Load() != 0 || keyRows(t, pool) != 0 || effects(t, pool) != 0 {
		t.Fatal("bad input ran fn or wrote rows")
	}
}

// Concurrent duplicates from separate Clients (as from separate processes)
// run fn once and all get the same value.
func TestDoJSONConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	const n = 8
	var calls atomic.Int64
	slow := func(ctx context.Context, tx pgx.Tx) (order, error) {
		time.Sleep(50 * time.Millisecond) // hold the claim so the others wait
		return placeOrder(&calls, "storm")(ctx, tx)
	}
	values := make([]order, n)
	replayed := make([]bool, n)
	errs := make([]error, n)
	runTogether(n, func(i int) {
		client, err := idem.New(idem.Config{})
		if err != nil {
			errs[i] = err
			return
		}
		values[i], replayed[i], errs[i] = idem.DoInTxJSONWith(ctx, client, pool, scope, "storm", fpA, slow)
	})
	fresh := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if !replayed[i] {
			fresh++
		}
		if !reflect.DeepEqual(values[i], values[0]) {
			t.Fatalf("call %d got %+v, call 0 got %+v", i, values[i], values[0])
		}
	}
	if fresh != 1 || calls.Load() != 1 || effects(t, pool) != 1 {
		t.Fatalf("fresh %d, calls %d, effects %d; want 1 each", fresh, calls.Load(), effects(t, pool))
	}
}

// A typed outcome whose body has outlived Config.BodyTTL: fn does not run,
// the error wraps ErrResponseGone, and replayed is true (as Do's
// Result.Replayed and Inbox's duplicate are): the operation happened.
func TestDoJSONResponseGoneIsAReplay(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := newPool(t)
	const life = 200 * time.Millisecond
	client, err := idem.New(idem.Config{TTL: time.Hour, BodyTTL: life})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	doInTx := func(key string) (order, bool, error) {
		return idem.DoInTxJSONWith(ctx, client, pool, scope, key, fpA, placeOrder(&calls, key))
	}
	do := func(key string) (o order, replayed bool, err error) {
		txErr := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			o, replayed, err = idem.DoJSONWith(ctx, client, tx, scope, key, fpA, placeOrder(&calls, key))
			return nil
		})
		if txErr != nil {
			t.Fatal(txErr)
		}
		return o, replayed, err
	}
	calls2 := map[string]func(string) (order, bool, error){"gone-intx": doInTx, "gone-do": do}
	for key, run := range calls2 {
		if _, replayed, err := run(key); err != nil || replayed {
			t.Fatalf("%s first: %v, %v", key, replayed, err)
		}
	}
	time.Sleep(life + 100*time.Millisecond)
	ran := calls.Load()
	for key, run := range calls2 {
		o, replayed, err := run(key)
		if !errors.Is(err, idem.ErrResponseGone) || !replayed || !reflect.DeepEqual(o, order{}) {
			t.Errorf("%s past BodyTTL: %+v, replayed %t, %v; want a zero order, replayed, ErrResponseGone", key, o, replayed, err)
		}
	}
	if n := calls.Load(); n != ran {
		t.Fatalf("fn ran %d more times past BodyTTL", n-ran)
	}
}

// Decode's error for a body that does not decode names idem once, as
// every error of idem does.
func TestRejectedErrorDecodeNamesIdemOnce(t *testing.T) {
	t.Parallel()
	rej := &idem.RejectedError{Status: 409, Body: []byte(`{"need":"all"}`)}
	var v struct {
		Need int `json:"need"`
	}
	err := rej.Decode(&v)
	if !errors.Is(err, idem.ErrStoredValue) {
		t.Fatalf("Decode: %v, want ErrStoredValue", err)
	}
	if n := strings.Count(err.Error(), "idem"); n != 1 {
		t.Errorf("Decode: %q names idem %d times", err, n)
	}
}

// Decode given something other than a non-nil pointer is the caller's
// mistake, not a stored value that does not decode: ErrInvalidArgument.
func TestRejectedErrorDecodeNeedsAPointer(t *testing.T) {
	t.Parallel()
	rej := &idem.RejectedError{Status: 409, Body: []byte(`{"need":100}`)}
	var v struct {
		Need int `json:"need"`
	}
	var nilPtr *struct{}
	for name, arg := range map[string]any{"nil": nil, "value": v, "nil pointer": nilPtr} {
		if err := rej.Decode(arg); !errors.Is(err, idem.ErrInvalidArgument) || errors.Is(err, idem.ErrStoredValue) {
			t.Errorf("Decode(%s): %v; want ErrInvalidArgument, not ErrStoredValue", name, err)
		}
	}
	if err := rej.Decode(&v); err != nil || v.Need != 100 {
		t.Errorf("Decode(&v): %+v, %v", v, err)
	}
}
