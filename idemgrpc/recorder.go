package idemgrpc

import (
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// recorder is the grpc.ServerTransportStream of one run of the handler: it
// keeps the headers and trailers the handler sets (grpc.SetHeader,
// grpc.SendHeader, grpc.SetTrailer) instead of sending them, so that only
// the last run's reach the client, after the commit, and the chosen ones
// can be stored.
type recorder struct {
	method string

	mu      sync.Mutex
	header  metadata.MD
	trailer metadata.MD
}

var _ grpc.ServerTransportStream = (*recorder)(nil)

func (r *recorder) Method() string { return r.method }

func (r *recorder) SetHeader(md metadata.MD) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.header = metadata.Join(r.header, md)
	return nil
}

// SendHeader keeps md like SetHeader: the headers go out with the reply.
func (r *recorder) SendHeader(md metadata.MD) error { return r.SetHeader(md) }

func (r *recorder) SetTrailer(md metadata.MD) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.trailer = metadata.Join(r.trailer, md)
	return nil
}

// forward sets what the handler set on the call's own stream (nil outside a
// server).
func (r *recorder) forward(stream grpc.ServerTransportStream) {
	if stream == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.header) > 0 {
		_ = stream.SetHeader(r.header) // as the handler's own call: it fails only after headers went out
	}
	if len(r.trailer) > 0 {
		_ = stream.SetTrailer(r.trailer)
	}
}
