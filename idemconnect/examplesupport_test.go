package idemconnect_test

import (
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
)

// placeOrderSchema stands in for what protoc-gen-go and
// protoc-gen-connect-go generate from
//
//	syntax = "proto3";
//	package example.orders.v1;
//	import "google/protobuf/wrappers.proto";
//	service Orders {
//	  rpc PlaceOrder(google.protobuf.StringValue) returns (google.protobuf.Int64Value);
//	}
//
// (the item to order in, the order's id out): the file descriptor
// registered in protoregistry.GlobalFiles, and the method descriptor that
// the generated handler passes to connect.WithSchema.
var placeOrderSchema = func() protoreflect.MethodDescriptor {
	fdp := &descriptorpb.FileDescriptorProto{
		Name:       proto.String("example/orders/v1/orders.proto"),
		Package:    proto.String("example.orders.v1"),
		Syntax:     proto.String("proto3"),
		Dependency: []string{"google/protobuf/wrappers.proto"},
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Orders"),
			Method: []*descriptorpb.MethodDescriptorProto{{
				Name:       proto.String("PlaceOrder"),
				InputType:  proto.String(".google.protobuf.StringValue"),
				OutputType: proto.String(".google.protobuf.Int64Value"),
			}},
		}},
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	if err == nil {
		err = protoregistry.GlobalFiles.RegisterFile(fd)
	}
	if err != nil {
		panic(err)
	}
	return fd.Services().ByName("Orders").Methods().ByName("PlaceOrder")
}()

const placeOrderProcedure = "/example.orders.v1.Orders/PlaceOrder"
