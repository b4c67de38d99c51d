package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"reflect"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// idemsql.Client has every method of idem.Client, by name.
func TestClientMethods(t *testing.T) {
	t.Parallel()
	sqlClient := reflect.TypeFor[*idemsql.Client]()
	pgxClient := reflect.TypeFor[*idem.Client]()
	for i := range pgxClient.NumMethod() {
		name := pgxClient.Method(i).Name
		if _, ok := sqlClient.MethodByName(name); !ok {
			t.Errorf("idemsql.Client has no %s", name)
		}
	}
}

// The checks and ReadStats of a Client use its own configuration.
func TestClientChecks(t *testing.T) {
	t.Parallel()
	c, err := idemsql.New(idem.Config{MinKeyLength: 8})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ValidateKey("short"); !errors.Is(err, idem.ErrInvalidKey) {
		t.Errorf("ValidateKey under MinKeyLength: %v", err)
	}
	if err := c.ValidateKey("long-enough"); err != nil {
		t.Errorf("ValidateKey: %v", err)
	}
	if err := c.ValidateScope(idem.Scope{Actor: "a"}); !errors.Is(err, idem.ErrInvalidScope) {
		t.Errorf("ValidateScope without operation: %v", err)
	}
	if err := c.ValidateScope(scope); err != nil {
		t.Errorf("ValidateScope: %v", err)
	}
	if _, err := c.ReadStats(t.Context(), nil); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("ReadStats nil db: %v", err)
	}
	if key, err := c.InboxKey("short"); err != nil || key == "short" {
		t.Errorf("InboxKey of an id under MinKeyLength: %q, %v (want its hash)", key, err)
	}
}

// Inbox and InboxInTx record a message as idem.Inbox does: a delivery
// processed through either package is a duplicate for the other.
func TestInbox(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, driver string) {
		ctx := t.Context()
		db, pool := migrated(t, driver)
		c, err := idemsql.New(idem.Config{})
		if err != nil {
			t.Fatal(err)
		}
		runs := 0
		fn := func(ctx context.Context, tx *sql.Tx) error {
			runs++
			_, err := tx.ExecContext(ctx, "SELECT 1")
			return err
		}
		for i := range 2 {
			dup, err := c.InboxInTx(ctx, db, "billing", "msg-1", []byte("p"), fn)
			if err != nil || dup != (i == 1) {
				t.Fatalf("InboxInTx %d: %v, %v", i, dup, err)
			}
		}
		dup, err := idem.InboxInTx(ctx, pool, "billing", "msg-1", []byte("p"), func(context.Context, pgxTx) error {
			t.Error("idem.InboxInTx ran fn for a message idemsql processed")
			return nil
		})
		if err != nil || !dup {
			t.Fatalf("idem.InboxInTx after idemsql: %v, %v", dup, err)
		}
		if _, err := c.InboxInTx(ctx, db, "billing", "msg-1", []byte("other"), fn); !errors.Is(err, idem.ErrKeyReused) {
			t.Fatalf("InboxInTx with another payload: %v", err)
		}
		err = c.InTx(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
			dup, err := c.Inbox(ctx, tx, "billing", "an id with spaces", []byte("p"), fn)
			if err == nil && dup {
				err = errors.New("a new message is a duplicate")
			}
			return err
		})
		if err != nil {
			t.Fatalf("Inbox: %v", err)
		}
		key, err := idemsql.InboxKey("an id with spaces")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := idemsql.Lookup(ctx, db, idem.Scope{Actor: "billing", Operation: idem.InboxOperation}, key); err != nil {
			t.Fatalf("Lookup of the message's record: %v", err)
		}
		if runs != 2 {
			t.Fatalf("fn ran %d times, want 2", runs)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		for _, bad := range []struct {
			name string
			err  error
			want error
		}{
			{"empty id", second(c.Inbox(ctx, tx, "billing", "", []byte("p"), fn)), idem.ErrInvalidKey},
			{"nil fn", second(c.Inbox(ctx, tx, "billing", "m", []byte("p"), nil)), idem.ErrInvalidArgument},
			{"bad consumer", second(c.InboxInTx(ctx, db, "", "m", []byte("p"), fn)), idem.ErrInvalidScope},
			{"nil tx", second(c.Inbox(ctx, nil, "billing", "m", []byte("p"), fn)), idem.ErrInvalidArgument},
		} {
			if !errors.Is(bad.err, bad.want) {
				t.Errorf("%s: %v, want %v", bad.name, bad.err, bad.want)
			}
		}
		if n := keyCount(t, pool); n != 2 {
			t.Fatalf("%d keys, want 2", n)
		}
	})
}
