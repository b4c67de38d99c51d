//go:build !unix

package pgserver

import (
	"context"
	"errors"
	"runtime"
)

// StartTempCluster is not supported on this platform.
func StartTempCluster(context.Context) (*Server, error) {
	return nil, errors.New("temp clusters are not supported on " + runtime.GOOS)
}

// StopImmediate is not supported on this platform.
func (s *Server) StopImmediate() error {
	return errors.New("temp clusters are not supported on " + runtime.GOOS)
}

// Restart is not supported on this platform.
func (s *Server) Restart(context.Context) error {
	return errors.New("temp clusters are not supported on " + runtime.GOOS)
}
