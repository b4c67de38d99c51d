package rpcproto

import (
	"strings"
	"testing"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/front"
	"github.com/pgidem/idem/internal/rpcidem"
)

// A dynamicpb reply type found for one procedure (its own reply type,
// registered nowhere) is not the answer for another procedure returning
// the same type: that one's reply is refused, the first time as after a
// restart, whatever procedure asked first. A type registered in
// protoregistry.GlobalTypes is found for every procedure.
func TestReplyTypeDynamicPerProcedure(t *testing.T) {
	// rpcprototest.v1: message Receipt {}, message Other {};
	// service A { rpc M(Other) returns (Receipt); }
	// service B { rpc M(Other) returns (Other); }
	// in no registry.
	method := func(out string) []*descriptorpb.MethodDescriptorProto {
		return []*descriptorpb.MethodDescriptorProto{{Name: proto.String("M"),
			InputType: proto.String(".rpcprototest.v1.Other"), OutputType: proto.String(out)}}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:        proto.String("rpcprototest/v1/x.proto"),
		Package:     proto.String("rpcprototest.v1"),
		Syntax:      proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("Receipt")}, {Name: proto.String("Other")}},
		Service: []*descriptorpb.ServiceDescriptorProto{
			{Name: proto.String("A"), Method: method(".rpcprototest.v1.Receipt")},
			{Name: proto.String("B"), Method: method(".rpcprototest.v1.Other")},
		},
	}, new(protoregistry.Files))
	if err != nil {
		t.Fatal(err)
	}
	const receipt = protoreflect.FullName("rpcprototest.v1.Receipt")
	a := Request{Procedure: "/rpcprototest.v1.A/M", Schema: fd.Services().ByName("A").Methods().ByName("M")}
	b := Request{Procedure: "/rpcprototest.v1.B/M", Schema: fd.Services().ByName("B").Methods().ByName("M")}
	bare := Request{Procedure: "/rpcprototest.v1.C/M"} // no schema, in no registry
	newServer := func() *Server {
		s, err := New(rpcidem.Options{Transport: rpcidem.Transport{Name: "rpcprototest"}, ScopeSet: true},
			func(*idem.Client) (front.Store, error) { return nil, nil })
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	refused := func(s *Server, req Request) {
		t.Helper()
		if typ, err := s.replyType(receipt, req); err == nil || !strings.Contains(err.Error(), "neither registered") {
			t.Errorf("%s, a %s: %v, %v; want refused", req.Procedure, receipt, typ, err)
		}
	}
	for _, aFirst := range []bool{true, false} {
		s := newServer()
		if !aFirst {
			refused(s, b)
			refused(s, bare)
		}
		for _, name := range []protoreflect.FullName{receipt, ""} {
			typ, err := s.replyType(name, a)
			if err != nil {
				t.Fatalf("%s, a %q: %v", a.Procedure, name, err)
			}
			if _, ok := typ.New().Interface().(*dynamicpb.Message); !ok || typ.Descriptor().FullName() != receipt {
				t.Errorf("%s, a %q: %v; want a dynamicpb %s", a.Procedure, name, typ, receipt)
			}
		}
		refused(s, b)
		refused(s, bare)
		if typ, err := s.replyType("", b); err != nil || typ.Descriptor().FullName() != "rpcprototest.v1.Other" {
			t.Errorf("%s, no name: %v, %v; want its own reply type", b.Procedure, typ, err)
		}
		if typ, err := s.replyType(receipt, a); err != nil || typ.Descriptor().FullName() != receipt {
			t.Errorf("%s, a %s after B's own: %v, %v", a.Procedure, receipt, typ, err)
		}
		status := (&spb.Status{}).ProtoReflect().Descriptor().FullName()
		for _, req := range []Request{a, b, bare} {
			if typ, err := s.replyType(status, req); err != nil || typ != (&spb.Status{}).ProtoReflect().Type() {
				t.Errorf("%s, a %s: %v, %v; want the generated type", req.Procedure, status, typ, err)
			}
		}
	}
}
