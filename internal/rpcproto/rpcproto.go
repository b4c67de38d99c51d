// Package rpcproto is the protobuf half of what idemgrpc and idemconnect
// share (rpcidem is the half without protobuf): the key in a request field,
// the deterministic marshalling of requests and replies, the type of a
// stored reply and how a replay finds it, google.rpc.Status for refusals and
// for the interceptor's own errors, and Serve, the whole run of a covered
// call over a Transport. It is a module of its own, so that the library's
// module needs no protobuf. Each interceptor keeps only its transport's
// glue: where the key travels, how the handler runs and what it set, and
// how a status becomes its error.
//
//	idemgrpc, idemconnect   a Transport: metadata, headers, status errors
//	   │  Serve
//	internal/rpcproto        this package
//	   │  rpcidem.Core: Key, Scope, Do, Stored
//	internal/rpcidem         keys, scope, outcome, stored form
//	   │  front.Store: DoInTx
//	internal/front           idem (pgx) or idemsql (database/sql)
package rpcproto

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/rpcidem"
)

// Server is the configured interceptor, whatever its transport.
type Server struct {
	core     *rpcidem.Core
	keyField protoreflect.Name
	types    sync.Map // protoreflect.FullName -> protoreflect.MessageType, of stored replies registered in GlobalTypes
	dynamic  sync.Map // procedure -> protoreflect.MessageType, dynamicpb, of the procedure's reply type
}

// New returns the Server of an interceptor with opts, whose store open
// returns (see rpcidem.New), or the error of invalid options.
func New(opts rpcidem.Options, open front.Open) (*Server, error) {
	core, err := rpcidem.New(opts, open)
	if err != nil {
		return nil, err
	}
	s := &Server{core: core, keyField: protoreflect.Name(opts.KeyField)}
	if s.keyField != "" && !s.keyField.IsValid() {
		return nil, fmt.Errorf("%s: Options.KeyField: %q is not a field name", opts.Name, opts.KeyField)
	}
	return s, nil
}

// Core is the transport-neutral part of s.
func (s *Server) Core() *rpcidem.Core { return s.core }

// Request is a covered call as its transport received it.
type Request struct {
	Procedure string                        // "/pkg.Service/Method"
	Keys      []string                      // the values of the key's metadata entry or header
	Message   any                           // the request message
	Schema    protoreflect.MethodDescriptor // the procedure's, when the transport knows it; nil otherwise
}

// Replay is a stored outcome, to answer with.
type Replay struct {
	// Header and Trailer are the stored headers and trailers: lower-case
	// names, binary ("-bin") values base64 as stored, or raw for a
	// transport that hands them over raw (rpcidem.Options.RawBinary).
	Header, Trailer map[string][]string

	// Reply is the stored reply, decoded into its type (see Serve); nil
	// for a refusal, whose status is Status.
	Reply  proto.Message
	Status *spb.Status
}

// Transport is one covered call as an interceptor's transport serves it,
// R being what its handlers return.
type Transport[R any] interface {
	// Pass runs the handler as if the interceptor were not there.
	Pass(ctx context.Context) (R, error)

	// Scope returns the call's scope (Options.Scope), and AsIs, for an
	// error of it, that error when it carries the transport's own status
	// (it then goes to the client as it is), or nil.
	Scope(ctx context.Context) (idem.Scope, error)
	AsIs(err error) error

	// Fail is the error that answers f.
	Fail(f *rpcidem.Failure) error

	// Handle runs the handler once, in the transaction that ctx carries,
	// keeps its answer and what it set, and returns its error; Code is the
	// status code of such an error.
	Handle(ctx context.Context) error
	Code(err error) uint32

	// Reply is the last run's reply message and the stored form of the
	// headers and trailers it set (rpcidem.Core.Stored). Refusal is the
	// status of err, the last run's error, and the stored form of the
	// metadata that goes with it.
	Reply() (msg any, stored map[string][]string)
	Refusal(err error) (*spb.Status, map[string][]string)

	// Replay answers with a stored outcome; Own with the last run's own
	// answer, with everything it set.
	Replay(ctx context.Context, r Replay) (R, error)
	Own() (R, error)
}

// Serve runs a covered call: it reads the key (the request field
// Options.KeyField, or req.Keys), passes a call without one to the
// handler, checks the scope, and runs the call with the fingerprint of the
// request in rpcidem.Core.Do, then answers with the stored outcome, the
// handler's own answer, or the failure.
//
// A reply is stored with its type's full name; it is stored only when a
// replay can decode it: its type is registered in
// protoregistry.GlobalTypes (generated code registers every message), or it
// is the reply type of req.Schema or of the procedure's method in
// protoregistry.GlobalFiles (decoded as a dynamicpb message). Otherwise the
// call fails with UNIMPLEMENTED (the method cannot be served idempotently
// until its reply type is registered), saying which type, and nothing
// commits. A stored reply without its type (stored by an earlier version)
// is decoded as the reply type of the procedure's method; when that is not
// known either, the call fails with UNIMPLEMENTED too.
func Serve[R any](ctx context.Context, s *Server, t Transport[R], req Request) (R, error) {
	var none R
	msg, isProto := req.Message.(proto.Message)
	key, f := s.core.Key(req.Keys, keyField(msg, s.keyField))
	if f != nil {
		return none, t.Fail(f)
	}
	if key == "" {
		return t.Pass(ctx)
	}
	// fail answers f, an INTERNAL one logged (Do logs its own).
	fail := func(f *rpcidem.Failure) error {
		s.core.LogInternal(ctx, req.Procedure, key, f)
		return t.Fail(f)
	}
	if !isProto {
		return none, fail(s.internal("the request of %s is a %T, not a protobuf message", req.Procedure, req.Message))
	}
	scope, err := t.Scope(ctx)
	if asIs := t.AsIs(err); err != nil && asIs != nil {
		return none, asIs
	}
	if f := s.core.Scope(scope, err); f != nil {
		return none, fail(f)
	}
	b, err := Marshal(msg)
	if err != nil {
		return none, fail(s.internal("marshal the request: %v", err))
	}
	stored, replayed, f := s.core.Do(ctx, req.Procedure, scope, key, rpcidem.Fingerprint(req.Procedure, b), call[R]{s, t, req})
	if f == nil && replayed {
		var r Replay
		if r, f = s.decode(stored, req); f != nil {
			return none, fail(f)
		}
		return t.Replay(ctx, r)
	}
	if f != nil {
		return none, t.Fail(f)
	}
	return t.Own()
}

// Marshal is protobuf's deterministic marshal of m, the form that
// fingerprints and stored outcomes use.
func Marshal(m proto.Message) ([]byte, error) {
	return proto.MarshalOptions{Deterministic: true}.Marshal(m)
}

// keyField returns the value of msg's string field name, or "" (no
// name, no such field, or not set).
func keyField(msg proto.Message, name protoreflect.Name) string {
	if name == "" || msg == nil {
		return ""
	}
	m := msg.ProtoReflect()
	if fd := m.Descriptor().Fields().ByName(name); fd != nil && fd.Kind() == protoreflect.StringKind && !fd.IsList() {
		return m.Get(fd).String()
	}
	return ""
}

// RequestIDField is the request field that carries a call's key by
// AIP-155's convention.
const RequestIDField protoreflect.Name = "request_id"

// RequestID returns the key that msg, a client's request, carries in its
// string field request_id (AIP-155), or "" for none: msg is not a protobuf
// message, has no such field, leaves it empty, or holds a value that
// idem.ValidateKey refuses. A client interceptor sends it as the call's
// key, so that a server that takes the key from that field
// (Options.KeyField) finds the same key in both places.
func RequestID(msg any) string {
	m, ok := msg.(proto.Message)
	if !ok || m == nil || !m.ProtoReflect().IsValid() {
		return ""
	}
	if id := keyField(m, RequestIDField); id != "" && idem.ValidateKey(id) == nil {
		return id
	}
	return ""
}

// call is a Transport as rpcidem.Core.Do runs it.
type call[R any] struct {
	s   *Server
	t   Transport[R]
	req Request
}

func (c call[R]) Handle(ctx context.Context) error { return c.t.Handle(ctx) }

func (c call[R]) Code(err error) uint32 { return c.t.Code(err) }

func (c call[R]) Reply() (map[string][]string, []byte, error) {
	msg, stored := c.t.Reply()
	m, ok := msg.(proto.Message)
	if !ok {
		return nil, nil, fmt.Errorf("%s: the reply of %s is a %T, not a protobuf message", c.s.core.Name(), c.req.Procedure, msg)
	}
	name := m.ProtoReflect().Descriptor().FullName()
	if _, err := c.s.replyType(name, c.req); err != nil {
		return nil, nil, &rpcidem.FailureError{Failure: unimplemented(err)}
	}
	body, err := Marshal(m)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: marshal the reply: %w", c.s.core.Name(), err)
	}
	if stored == nil {
		stored = make(map[string][]string, 1)
	}
	stored[rpcidem.ReplyType] = []string{string(name)}
	return stored, body, nil
}

func (c call[R]) Refusal(err error) (map[string][]string, []byte, error) {
	st, stored := c.t.Refusal(err)
	body, err := Marshal(st)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: marshal the status: %w", c.s.core.Name(), err)
	}
	return stored, body, nil
}

// replyType returns the type that a stored reply of type name (none: an
// earlier version stored it) decodes into, for a call of req: the type
// registered under name in protoregistry.GlobalTypes, or else a dynamicpb
// type of the reply type of the procedure's method, when that is name.
// Only the former holds for every procedure: the latter is cached under
// the procedure, so that another procedure returning the same
// unregistered type is refused, as its replay after a restart would be.
func (s *Server) replyType(name protoreflect.FullName, req Request) (protoreflect.MessageType, error) {
	if t, ok := s.types.Load(name); ok {
		return t.(protoreflect.MessageType), nil
	}
	if t, ok := s.dynamic.Load(req.Procedure); ok {
		if t := t.(protoreflect.MessageType); name == "" || t.Descriptor().FullName() == name {
			return t, nil
		}
	}
	method := req.Schema
	if method == nil {
		d, _ := protoregistry.GlobalFiles.FindDescriptorByName(
			protoreflect.FullName(strings.ReplaceAll(strings.TrimPrefix(req.Procedure, "/"), "/", ".")))
		method, _ = d.(protoreflect.MethodDescriptor)
	}
	if name == "" {
		if method == nil {
			return nil, fmt.Errorf("%s: the stored reply of %s names no type, and the procedure has no schema and is not in protoregistry.GlobalFiles: its reply type is needed to replay",
				s.core.Name(), req.Procedure)
		}
		name = method.Output().FullName()
	}
	t, err := protoregistry.GlobalTypes.FindMessageByName(name)
	switch {
	case err == nil:
		s.types.Store(name, t)
	case method != nil && method.Output().FullName() == name:
		t = dynamicpb.NewMessageType(method.Output())
		s.dynamic.Store(req.Procedure, t)
	default:
		return nil, fmt.Errorf("%s: the reply of %s is a %s, which is neither registered in protoregistry.GlobalTypes nor the reply type of the procedure's schema: a retry could not replay it (import the message's generated package, or give the handler its schema)",
			s.core.Name(), req.Procedure, name)
	}
	return t, nil
}

// decode returns the stored outcome to replay, or the failure to answer.
func (s *Server) decode(stored idem.Response, req Request) (Replay, *rpcidem.Failure) {
	var r Replay
	var name string
	r.Header, r.Trailer, name = rpcidem.Entries(stored.Header)
	for _, md := range []map[string][]string{r.Header, r.Trailer} {
		if err := s.core.Raw(md); err != nil {
			return r, s.internal("%v", err)
		}
	}
	if stored.Status != rpcidem.StatusReply {
		r.Status = &spb.Status{}
		if err := proto.Unmarshal(stored.Body, r.Status); err != nil {
			return r, s.internal("stored status: %v", err)
		}
		return r, nil
	}
	t, err := s.replyType(protoreflect.FullName(name), req)
	if err != nil {
		return r, unimplemented(err)
	}
	r.Reply = t.New().Interface()
	if err := proto.Unmarshal(stored.Body, r.Reply); err != nil {
		return r, s.internal("stored reply: %v", err)
	}
	return r, nil
}

// unimplemented is the UNIMPLEMENTED failure of a reply whose type err
// says cannot be found: the method cannot be served idempotently (a reply
// stored, or to store, could not be replayed) until the server knows the
// type.
func unimplemented(err error) *rpcidem.Failure {
	return &rpcidem.Failure{Code: rpcidem.CodeUnimplemented, Message: err.Error(), Cause: err}
}

// internal is an INTERNAL failure with the message format, args after the
// interceptor's name.
func (s *Server) internal(format string, args ...any) *rpcidem.Failure {
	err := fmt.Errorf(s.core.Name()+": "+format, args...)
	return &rpcidem.Failure{Code: rpcidem.CodeInternal, Message: err.Error(), Cause: err}
}

// Status is the google.rpc.Status of f: its code and message, and for the
// interceptor's own errors (a Reason) an ErrorInfo detail (domain
// rpcidem.ErrorDomain) and, when f asks for one, a RetryInfo.
func Status(f *rpcidem.Failure) *spb.Status {
	st := &spb.Status{Code: int32(f.Code), Message: f.Message}
	if f.Reason == "" {
		return st
	}
	details := []proto.Message{&errdetails.ErrorInfo{Reason: f.Reason, Domain: rpcidem.ErrorDomain}}
	if f.Retry {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(f.RetryDelay)})
	}
	for _, d := range details {
		if a, err := anypb.New(d); err == nil {
			st.Details = append(st.Details, a)
		}
	}
	return st
}

// RetryInfo is what rpcidem.Judge reads of a status's RetryInfo detail
// info (nil: none).
func RetryInfo(info *errdetails.RetryInfo) *rpcidem.RetryInfo {
	if info == nil {
		return nil
	}
	if d := info.GetRetryDelay(); d != nil {
		return &rpcidem.RetryInfo{Delay: d.AsDuration(), HasDelay: true}
	}
	return &rpcidem.RetryInfo{}
}
