package idem_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/pgidem/idem"
)

// callKeyOf is the call key of step for (actor, operation, key).
func callKeyOf(actor, operation, key, step string) string {
	return idem.Reservation{Scope: idem.Scope{Actor: actor, Operation: operation}, Key: key}.CallKey(step)
}

// A derived call key depends on the scope, the key and the step only: the
// same for every attempt (token, lease, replayed result), different for
// any other part, a valid key, and free of the parts it was made from.
func TestCallKeyDerivation(t *testing.T) {
	t.Parallel()
	base := idem.Reservation{Scope: idem.Scope{Actor: "alice", Operation: "payment.create"}, Key: "pay-0001"}
	// Pinned, and computed independently (SHA-256 over the namespace and
	// the length-prefixed parts, version and variant bits set): receivers
	// remember derived keys, so the derivation must never change.
	const want = "bbf4bef9-8266-85bf-af4c-334c6e2545c2"
	got := base.CallKey("charge")
	if got != want {
		t.Fatalf("CallKey(charge) = %q, want %q", got, want)
	}
	if err := idem.ValidateKey(got); err != nil || len(got) != 36 {
		t.Fatalf("call key %q: %v", got, err)
	}
	if got[14] != '8' || !strings.ContainsAny(got[19:20], "89ab") {
		t.Errorf("call key %q is not a version 8 UUID of the RFC variant", got)
	}

	// Every attempt of the request derives the same key.
	other := base
	other.Token, other.Replayed = 42, true
	if other.CallKey("charge") != got {
		t.Error("the key depends on the attempt")
	}
	// Any other part gives another key; so does moving bytes between parts.
	seen := map[string]string{got: "base"}
	for name, k := range map[string]string{
		"step":      base.CallKey("refund"),
		"key":       callKeyOf("alice", "payment.create", "pay-0002", "charge"),
		"actor":     callKeyOf("bob", "payment.create", "pay-0001", "charge"),
		"operation": callKeyOf("alice", "payment.refund", "pay-0001", "charge"),
		"shift1":    callKeyOf("alic", "epayment.create", "pay-0001", "charge"),
		"shift2":    callKeyOf("alice", "payment.create", "pay-000", "1charge"),
		"shift3":    callKeyOf("alice", "payment.createpay-0001", "x", "charge"),
	} {
		if k == "" || seen[k] != "" {
			t.Errorf("%s: key %q (also %q)", name, k, seen[k])
		}
		seen[k] = name
	}
	for _, part := range []string{"alice", "pay-0001", "payment", "charge"} {
		if strings.Contains(got, part) {
			t.Errorf("call key %q reveals %q", got, part)
		}
	}
}

// An unusable step, or a reservation without a key or scope, has no call
// key; idem's clients refuse the empty key (idemhttp's tests prove that).
func TestCallKeyRefusesBadSteps(t *testing.T) {
	t.Parallel()
	r := idem.Reservation{Scope: idem.Scope{Actor: "alice", Operation: "payment.create"}, Key: "pay-0001"}
	for name, step := range map[string]string{
		"empty":    "",
		"newline":  "charge\n",
		"nul":      "a\x00b",
		"tab":      "a\tb",
		"del":      "a\x7fb",
		"c1":       "a\u0085b",
		"too long": strings.Repeat("s", idem.MaxStepLength+1),
		"not utf8": "\xff",
	} {
		if k := r.CallKey(step); k != "" {
			t.Errorf("%s: CallKey(%q) = %q, want \"\"", name, step, k)
		}
	}
	for name, step := range map[string]string{"longest": strings.Repeat("s", idem.MaxStepLength), "space": "charge card", "unicode": "결제"} {
		if k := r.CallKey(step); idem.ValidateKey(k) != nil {
			t.Errorf("%s: CallKey(%q) = %q", name, step, k)
		}
	}
	if k := (idem.Reservation{}).CallKey("charge"); k != "" {
		t.Errorf("zero reservation: %q", k)
	}
	if k := callKeyOf("", "payment.create", "pay-1", "charge"); k != "" {
		t.Errorf("no actor: %q", k)
	}
}

func TestCallKeyContext(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	if k, ok := idem.CallKeyFrom(ctx); ok || k != "" {
		t.Fatalf("empty context: %q %t", k, ok)
	}
	a, b := idem.NewCallKey(), idem.NewCallKey()
	if a == b || idem.ValidateKey(a) != nil || len(a) != 36 {
		t.Fatalf("NewCallKey: %q %q", a, b)
	}
	if k, ok := idem.CallKeyFrom(idem.WithCallKey(ctx, a)); !ok || k != a {
		t.Fatalf("CallKeyFrom: %q %t", k, ok)
	}
	if k, ok := idem.CallKeyFrom(idem.WithCallKey(ctx, "")); !ok || k != "" {
		t.Fatalf("an empty call key is there, to be refused: %q %t", k, ok)
	}
}

func TestRetryPolicyValidate(t *testing.T) {
	t.Parallel()
	if err := (idem.RetryPolicy{}).Validate(); err != nil {
		t.Fatal(err)
	}
	for name, p := range map[string]idem.RetryPolicy{
		"MaxAttempts":    {MaxAttempts: -1},
		"MaxElapsed":     {MaxElapsed: -1},
		"BaseDelay":      {BaseDelay: -1},
		"MaxDelay":       {MaxDelay: -1},
		"AttemptTimeout": {AttemptTimeout: -1},
	} {
		err := p.Validate()
		if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "RetryPolicy."+name) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestCallError(t *testing.T) {
	t.Parallel()
	cause := errors.New("EOF")
	err := error(&idem.CallError{Key: "k-123", Attempts: 3, Err: cause})
	if !errors.Is(err, idem.ErrOutcomeUnknown) || !errors.Is(err, cause) {
		t.Fatalf("chain: %v", err)
	}
	msg := err.Error()
	for _, want := range []string{"may have been processed", "retry later with the same idempotency key", "3 attempt", "EOF"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
	if strings.Contains(msg, "k-123") {
		t.Errorf("message %q holds the key", msg)
	}
	var ce *idem.CallError
	if !errors.As(err, &ce) || ce.Key != "k-123" {
		t.Fatalf("As: %v", ce)
	}
}
