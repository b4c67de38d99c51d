package idemgrpc_test

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// What follows stands in for the code protoc-gen-go and protoc-gen-go-grpc
// generate from
//
//	syntax = "proto3";
//	package example.orders.v1;
//	import "google/protobuf/wrappers.proto";
//	service Orders {
//	  rpc PlaceOrder(google.protobuf.StringValue) returns (google.protobuf.Int64Value);
//	}
//
// (the item to order in, the order's id out): the file descriptor registered
// in protoregistry.GlobalFiles, RegisterOrdersServer and the client's
// PlaceOrder.
func init() {
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
}

const placeOrderMethod = "/example.orders.v1.Orders/PlaceOrder"

// registerOrdersServer registers placeOrder as example.orders.v1.Orders.
func registerOrdersServer(srv *grpc.Server, placeOrder func(context.Context, *wrapperspb.StringValue) (*wrapperspb.Int64Value, error)) {
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "example.orders.v1.Orders",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "PlaceOrder",
			Handler: func(_ any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
				in := &wrapperspb.StringValue{}
				if err := dec(in); err != nil {
					return nil, err
				}
				handler := func(ctx context.Context, req any) (any, error) {
					return placeOrder(ctx, req.(*wrapperspb.StringValue))
				}
				return interceptor(ctx, in, &grpc.UnaryServerInfo{FullMethod: placeOrderMethod}, handler)
			},
		}},
		Metadata: "example/orders/v1/orders.proto",
	}, nil)
}

// placeOrder is the client's call.
func placeOrder(ctx context.Context, conn *grpc.ClientConn, item *wrapperspb.StringValue, opts ...grpc.CallOption) (*wrapperspb.Int64Value, error) {
	out := &wrapperspb.Int64Value{}
	if err := conn.Invoke(ctx, placeOrderMethod, item, out, opts...); err != nil {
		return nil, err
	}
	return out, nil
}
