package loghash

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"sync"
	"testing"
)

func TestSum(t *testing.T) {
	h := New([]byte("secret"))
	m := hmac.New(sha256.New, []byte("secret"))
	m.Write([]byte("key-1"))
	want := hex.EncodeToString(m.Sum(nil)[:8])
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				if got := h.Sum("key-1"); got != want {
					t.Errorf("Sum = %s, want %s", got, want)
					return
				}
			}
		})
	}
	wg.Wait()
	if a, b := New(nil), New(nil); a.Sum("key-1") == b.Sum("key-1") {
		t.Error("two random secrets hash alike")
	}
	if New([]byte("other")).Sum("key-1") == want {
		t.Error("another secret hashes alike")
	}
}
