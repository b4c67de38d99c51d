package idemhttp

import (
	"net/http"
	"strconv"
	"testing"
	"time"

	"context"
	"github.com/jackc/pgx/v5"
)

// The spec's published vector (the Standard Webhooks library's
// TestWebhookSign): the sender signs it so, and the handler verifies it, at
// the vector's own time.
func TestWebhookSignatureVector(t *testing.T) {
	const (
		secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
		id     = "msg_p5jXN8AQM9LWM0D4loKWxJek"
		want   = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
	)
	at := time.Unix(1614265330, 0)
	payload := []byte(`{"test": 2432232314}`)
	keys, err := parseSecrets([]string{secret})
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	if err := signWebhook(h, keys, id, at, payload); err != nil {
		t.Fatal(err)
	}
	if got := h.Get(HeaderWebhookSignature); got != want {
		t.Fatalf("signature %q, want %q", got, want)
	}
	if h.Get(HeaderWebhookID) != id || h.Get(HeaderWebhookTimestamp) != "1614265330" {
		t.Fatalf("headers %v", h)
	}

	wh, err := newWebhookHandler(noDB{}, WebhookOptions{Secrets: []string{"whsec_" + "AAAAAAAAAAAAAAAAAAAAAAAA", secret}},
		func(context.Context, pgx.Tx, Webhook) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	hook, code, err := wh.verify(h, payload, at.Add(DefaultWebhookTolerance))
	if err != nil || hook.ID != id || !hook.Timestamp.Equal(at) || string(hook.Body) != string(payload) {
		t.Fatalf("verify: %+v %s %v", hook, code, err)
	}
	// One second past the tolerance, either way: stale.
	for _, now := range []time.Time{at.Add(DefaultWebhookTolerance + time.Second), at.Add(-DefaultWebhookTolerance - time.Second)} {
		if _, code, err := wh.verify(h, payload, now); code != CodeWebhookStale || err == nil {
			t.Fatalf("verify at %s: %s %v, want %s", now.Sub(at), code, err, CodeWebhookStale)
		}
	}
	// A signature under the wrong secret, or a timestamp that is not a
	// number: unverified.
	bad := h.Clone()
	bad.Set(HeaderWebhookSignature, "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=")
	notNumber := h.Clone()
	notNumber.Set(HeaderWebhookTimestamp, strconv.Quote("1614265330"))
	for _, hh := range []http.Header{bad, notNumber} {
		if _, code, err := wh.verify(hh, payload, at); code != CodeWebhookUnverified || err == nil {
			t.Fatalf("verify %v: %s %v, want %s", hh, code, err, CodeWebhookUnverified)
		}
	}
}

// noDB is a database handle that verify never uses.
type noDB struct{}

func (noDB) Begin(context.Context) (pgx.Tx, error) { panic("noDB") }
