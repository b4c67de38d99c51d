package idemhttp_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// The review's tests: a hostile sender, a hostile network and a busy relay.

// A 3xx is a failure whatever the Client: with a Client of the caller's
// (which follows redirects by default), a 302 would turn the signed POST
// into a GET without the payload, and the 2xx of the URL it points to would
// count as delivered though the endpoint never got the event. Standard
// Webhooks: 3xx is a failure; update the endpoint's URL instead.
func TestWebhookSenderFollowsNoRedirect(t *testing.T) {
	ctx := context.Background()
	var elsewhere atomic.Int64
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		elsewhere.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(other.Close)
	clients := map[string]*http.Client{"NewClient": fastClient(), "plain": {}, "Transport": {Transport: &idemhttp.Transport{}}}
	for _, status := range []int{301, 302, 303, 307, 308} {
		s := newEndpointScript(t, scriptAnswer{status: status, header: map[string]string{"Location": other.URL}})
		for name, client := range clients {
			err := idemhttp.WebhookSender{Client: client, Endpoint: endpointOf(s.srv.URL, oldSecret)}.Send(ctx, delivery("evt-moved", `{}`))
			var werr *idemhttp.WebhookError
			if !errors.As(err, &werr) || werr.StatusCode != status || idem.IsPermanent(err) {
				t.Errorf("%d, %s Client: %v; want a retryable WebhookError %d", status, name, err, status)
			}
		}
	}
	if n := elsewhere.Load(); n != 0 {
		t.Fatalf("the redirect was followed %d times", n)
	}
	if client := clients["plain"]; client.CheckRedirect != nil {
		t.Fatal("the caller's Client was changed")
	}
}
