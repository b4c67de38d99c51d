package idem_test

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/core"
)

// TestTypesMirrorTheProtocol: every public type has the fields of the
// protocol's, in the same order with the same types (up to the package), so
// that the conversions at the boundary carry every field.
func TestTypesMirrorTheProtocol(t *testing.T) {
	for _, p := range []struct{ public, internal any }{
		{idem.Scope{}, core.Scope{}}, {idem.Response{}, core.Response{}}, {idem.Result{}, core.Result{}},
		{idem.Record{}, core.Record{}}, {idem.Reservation{}, core.Reservation{}},
		{idem.ReserveOptions{}, core.ReserveOptions{}}, {idem.Resolution{}, core.Resolution{}},
		{idem.Stats{}, core.Stats{}}, {idem.PruneOptions{}, core.PruneOptions{}}, {idem.Config{}, core.Config{}},
		{idem.InProgressError{}, core.InProgressError{}}, {idem.RejectedError{}, core.RejectedError{}},
	} {
		pub, in := reflect.TypeOf(p.public), reflect.TypeOf(p.internal)
		var exported []reflect.StructField
		for f := range in.Fields() {
			if f.IsExported() {
				exported = append(exported, f)
			}
		}
		if pub.NumField() != len(exported) {
			t.Errorf("%s has %d fields, %s %d exported", pub, pub.NumField(), in, len(exported))
			continue
		}
		for i, f := range exported {
			g := pub.Field(i)
			if g.Name != f.Name || g.Type.Kind() != f.Type.Kind() || g.Type.Name() != f.Type.Name() && g.Type.String() != "pgx.TxIsoLevel" {
				t.Errorf("%s.%s %s, %s.%s %s", pub, g.Name, g.Type, in, f.Name, f.Type)
			}
		}
	}
}

// TestConstantsMatchTheProtocol: the constants are spelled out in package
// idem, so that go doc shows them; they must be the protocol's.
func TestConstantsMatchTheProtocol(t *testing.T) {
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"DefaultTTL", idem.DefaultTTL, core.DefaultTTL}, {"DefaultWait", idem.DefaultWait, core.DefaultWait},
		{"DefaultMinKeyLength", idem.DefaultMinKeyLength, core.DefaultMinKeyLength},
		{"DefaultMaxKeyLength", idem.DefaultMaxKeyLength, core.DefaultMaxKeyLength},
		{"DefaultMaxResponseBytes", idem.DefaultMaxResponseBytes, core.DefaultMaxResponseBytes},
		{"DefaultMaxRetries", idem.DefaultMaxRetries, core.DefaultMaxRetries},
		{"DefaultLease", idem.DefaultLease, core.DefaultLease},
		{"DefaultPruneBatchSize", idem.DefaultPruneBatchSize, core.DefaultPruneBatchSize},
		{"MaxReasonLength", idem.MaxReasonLength, core.MaxReasonLength},
		{"MaxScopeLength", idem.MaxScopeLength, core.MaxScopeLength},
		{"MaxStepLength", idem.MaxStepLength, core.MaxStepLength},
		{"InboxOperation", idem.InboxOperation, core.InboxOperation},
		{"StatusProcessing", string(idem.StatusProcessing), string(core.StatusProcessing)},
		{"StatusSucceeded", string(idem.StatusSucceeded), string(core.StatusSucceeded)},
		{"StatusRejected", string(idem.StatusRejected), string(core.StatusRejected)},
		{"StatusFailedRetryable", string(idem.StatusFailedRetryable), string(core.StatusFailedRetryable)},
		{"StatusUnknown", string(idem.StatusUnknown), string(core.StatusUnknown)},
	} {
		if c.got != c.want {
			t.Errorf("%s is %v, the protocol's %v", c.name, c.got, c.want)
		}
	}
}

// TestErrorsOfTheProtocolAreIdems: an error of the protocol, however deep in
// a chain, is found by errors.Is with idem's sentinel and by errors.As with
// idem's error types, and keeps its message; an error holding nothing of the
// protocol's comes back as it is.
func TestErrorsOfTheProtocolAreIdems(t *testing.T) {
	pairs := []struct{ public, internal error }{
		{idem.ErrKeyReused, core.ErrKeyReused}, {idem.ErrInProgress, core.ErrInProgress},
		{idem.ErrInvalidKey, core.ErrInvalidKey}, {idem.ErrInvalidScope, core.ErrInvalidScope},
		{idem.ErrInvalidResponse, core.ErrInvalidResponse}, {idem.ErrResponseTooLarge, core.ErrResponseTooLarge},
		{idem.ErrInvalidJSON, core.ErrInvalidJSON}, {idem.ErrInvalidConfig, core.ErrInvalidConfig},
		{idem.ErrUnavailable, core.ErrUnavailable}, {idem.ErrInvalidArgument, core.ErrInvalidArgument},
		{idem.ErrOutcomeUnknown, core.ErrOutcomeUnknown}, {idem.ErrNotFound, core.ErrNotFound},
		{idem.ErrFenced, core.ErrFenced}, {idem.ErrKeyRowChanged, core.ErrKeyRowChanged},
		{idem.ErrTxAborted, core.ErrTxAborted},
		{idem.ErrPreparedStatements, core.ErrPreparedStatements}, {idem.ErrNotResolvable, core.ErrNotResolvable},
		{idem.ErrUnsupported, core.ErrUnsupported}, {idem.ErrStoredValue, core.ErrStoredValue},
		{idem.ErrResponseGone, core.ErrResponseGone},
	}
	// Every sentinel of the protocol has its counterpart here.
	paired := map[error]bool{}
	for _, p := range pairs {
		paired[p.internal] = true
	}
	for name, err := range coreSentinels(t) {
		if !paired[err] {
			t.Errorf("core.%s has no counterpart in package idem (convert.go's sentinels, and this test's pairs)", name)
		}
	}
	for _, p := range pairs {
		if p.public.Error() != p.internal.Error() {
			t.Errorf("%q, the protocol's %q", p.public, p.internal)
		}
		err := idem.PublicErr(fmt.Errorf("idem: %w: detail", p.internal))
		if !errors.Is(err, p.public) || err.Error() != "idem: "+p.internal.Error()+": detail" {
			t.Errorf("%v: errors.Is finds no %v", err, p.public)
		}
		for _, other := range pairs {
			if other.public != p.public && errors.Is(err, other.public) {
				t.Errorf("%v: errors.Is finds %v too", err, other.public)
			}
		}
	}

	var ipe *idem.InProgressError
	bare := idem.PublicErr(&core.InProgressError{RetryAfter: 3 * time.Second})
	if !errors.As(bare, &ipe) || ipe.RetryAfter != 3*time.Second || !errors.Is(bare, idem.ErrInProgress) {
		t.Errorf("%v: not an *idem.InProgressError", bare)
	}
	ipe = nil
	deep := idem.PublicErr(fmt.Errorf("wrapped: %w", &core.InProgressError{RetryAfter: time.Second}))
	if !errors.As(deep, &ipe) || ipe.RetryAfter != time.Second || !errors.Is(deep, idem.ErrInProgress) {
		t.Errorf("%v: no *idem.InProgressError in it", deep)
	}
	var rej *idem.RejectedError
	deep = idem.PublicErr(fmt.Errorf("wrapped: %w", &core.RejectedError{Status: 402, Body: []byte(`"no"`)}))
	var v string
	if !errors.As(deep, &rej) || rej.Status != 402 || rej.Decode(&v) != nil || v != "no" {
		t.Errorf("%v: no *idem.RejectedError in it", deep)
	}

	mine := errors.New("fn's own")
	if got := idem.PublicErr(mine); got != mine {
		t.Errorf("fn's own error came back as %#v", got)
	}
	if idem.PublicErr(nil) != nil {
		t.Error("nil became an error")
	}
}

// coreSentinels are the exported Err variables of internal/core, by name,
// as its source declares them.
func coreSentinels(t *testing.T) map[string]error {
	byName := map[string]error{
		"ErrKeyReused": core.ErrKeyReused, "ErrInProgress": core.ErrInProgress, "ErrInvalidKey": core.ErrInvalidKey,
		"ErrInvalidScope": core.ErrInvalidScope, "ErrInvalidResponse": core.ErrInvalidResponse,
		"ErrResponseTooLarge": core.ErrResponseTooLarge, "ErrInvalidJSON": core.ErrInvalidJSON,
		"ErrInvalidConfig": core.ErrInvalidConfig, "ErrUnavailable": core.ErrUnavailable,
		"ErrInvalidArgument": core.ErrInvalidArgument, "ErrOutcomeUnknown": core.ErrOutcomeUnknown,
		"ErrNotFound": core.ErrNotFound, "ErrFenced": core.ErrFenced, "ErrKeyRowChanged": core.ErrKeyRowChanged,
		"ErrTxAborted":          core.ErrTxAborted,
		"ErrPreparedStatements": core.ErrPreparedStatements, "ErrNotResolvable": core.ErrNotResolvable,
		"ErrUnsupported": core.ErrUnsupported, "ErrStoredValue": core.ErrStoredValue,
		"ErrResponseGone": core.ErrResponseGone,
	}
	files, err := filepath.Glob("internal/core/*.go")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]error{}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.VAR {
				continue
			}
			for _, spec := range g.Specs {
				for _, n := range spec.(*ast.ValueSpec).Names {
					if !n.IsExported() || !strings.HasPrefix(n.Name, "Err") {
						continue
					}
					if byName[n.Name] == nil {
						t.Errorf("core.%s is new: give package idem its counterpart and list it here", n.Name)
						continue
					}
					out[n.Name] = byName[n.Name]
				}
			}
		}
	}
	return out
}
