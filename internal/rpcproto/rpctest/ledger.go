// Package rpctest is the test harness that idemgrpc's and idemconnect's
// tests share: a test service built without protoc (idemtest.v1.Ledger,
// its file descriptor registered in protoregistry.GlobalFiles as generated
// code registers it), the databases a suite runs on (a pgx pool, and
// database/sql with pgx's stdlib driver and lib/pq), and Run, one suite of
// the behaviour both interceptors promise, written once against a
// Transport and run by each package for each driver.
package rpctest

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	_ "github.com/lib/pq"              // the "postgres" database/sql driver
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/pgidem/idem"
)

// Transfer is the procedure of the test service, as the interceptors see
// it ("/pkg.Service/Method").
const Transfer = "/idemtest.v1.Ledger/Transfer"

// Unlisted is a procedure that no file descriptor declares: served under
// it, Transfer's handler has no schema, and the interceptors find the
// reply's type by its stored name only.
const Unlisted = "/idemtest.v1.Unlisted/Transfer"

// File is idemtest/v1/ledger.proto, registered in
// protoregistry.GlobalFiles:
//
//	message TransferRequest { string request_id = 1; string note = 2; int64 amount = 3; }
//	service Ledger { rpc Transfer(TransferRequest) returns (google.rpc.ResourceInfo); }
//
// The reply is a generated type (errdetails.ResourceInfo: resource_type
// "transfer", resource_name "transfers/<id>", owner, description the
// note), as a service's replies are: protobuf-go marshals those in field
// number order, so a decoded reply goes out with the same bytes. (A
// dynamicpb message goes out with its fields in a random order.)
var File = func() protoreflect.FileDescriptor {
	fd := file("idemtest/v1/ledger.proto", "TransferRequest", &descriptorpb.ServiceDescriptorProto{
		Name: proto.String("Ledger"),
		Method: []*descriptorpb.MethodDescriptorProto{{
			Name: proto.String("Transfer"), InputType: proto.String(".idemtest.v1.TransferRequest"),
			OutputType: proto.String(".google.rpc.ResourceInfo"),
		}},
	})
	if err := protoregistry.GlobalFiles.RegisterFile(fd); err != nil {
		panic(err)
	}
	return fd
}()

// Method is Transfer's method descriptor, the schema a handler can have.
var Method = File.Services().ByName("Ledger").Methods().ByName("Transfer")

// RequestDesc is TransferRequest's descriptor.
var RequestDesc = File.Messages().ByName("TransferRequest")

// receiptDesc is a message registered nowhere (idemtest.v1.Receipt, with
// the fields of TransferRequest): a reply of this type cannot be replayed.
var receiptDesc = file("idemtest/v1/receipt.proto", "Receipt", nil).Messages().ByName("Receipt")

// file builds a file of package idemtest.v1 with one message of the
// fields of TransferRequest, and service.
func file(name, message string, service *descriptorpb.ServiceDescriptorProto) protoreflect.FileDescriptor {
	field := func(name string, n int32, typ descriptorpb.FieldDescriptorProto_Type) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(n), Type: typ.Enum(),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), JsonName: proto.String(name)}
	}
	fdp := &descriptorpb.FileDescriptorProto{
		Name:       proto.String(name),
		Package:    proto.String("idemtest.v1"),
		Syntax:     proto.String("proto3"),
		Dependency: []string{"google/rpc/error_details.proto"},
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String(message), Field: []*descriptorpb.FieldDescriptorProto{
			field("request_id", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING),
			field("note", 2, descriptorpb.FieldDescriptorProto_TYPE_STRING),
			field("amount", 3, descriptorpb.FieldDescriptorProto_TYPE_INT64),
		}}},
	}
	if service != nil {
		fdp.Service = []*descriptorpb.ServiceDescriptorProto{service}
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	if err != nil {
		panic(err)
	}
	return fd
}

// Request returns a TransferRequest.
func Request(note string, amount int64) *dynamicpb.Message {
	m := dynamicpb.NewMessage(RequestDesc)
	m.Set(RequestDesc.Fields().ByName("note"), protoreflect.ValueOfString(note))
	m.Set(RequestDesc.Fields().ByName("amount"), protoreflect.ValueOfInt64(amount))
	return m
}

// WithID returns m with its request_id set to id.
func WithID(m *dynamicpb.Message, id string) *dynamicpb.Message {
	m.Set(RequestDesc.Fields().ByName("request_id"), protoreflect.ValueOfString(id))
	return m
}

// Reply returns the reply for transfer id.
func Reply(id int64, note string) *errdetails.ResourceInfo {
	return &errdetails.ResourceInfo{ResourceType: "transfer", ResourceName: fmt.Sprintf("transfers/%d", id),
		Owner: "ledger", Description: note}
}

// Note and Amount read the fields of a TransferRequest.
func Note(m proto.Message) string { return field(m, "note").String() }

func Amount(m proto.Message) int64 { return field(m, "amount").Int() }

func field(m proto.Message, name protoreflect.Name) protoreflect.Value {
	r := m.ProtoReflect()
	return r.Get(r.Descriptor().Fields().ByName(name))
}

// Migrate installs idem's table and the transfers the handlers write.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := idem.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE transfers (id bigserial PRIMARY KEY, note text NOT NULL, amount bigint NOT NULL)`)
	return err
}

// Driver is a way to reach the database: a pgx pool, or database/sql with
// a driver.
type Driver struct {
	Name string // "pgx", "pgx/stdlib", "lib/pq"
	sql  string // the database/sql driver's name; "" for a pgx pool
}

// Drivers are the drivers every suite runs on.
var Drivers = []Driver{{Name: "pgx"}, {Name: "pgx/stdlib", sql: "pgx"}, {Name: "lib/pq", sql: "postgres"}}

// DB is the database of one test, as a driver reaches it.
type DB struct {
	Driver Driver
	Pgx    idem.Beginner // the interceptor's handle with the pgx driver
	SQL    *sql.DB       // the interceptor's handle with a database/sql driver
}

// sqlDB is a *sql.DB that is never used: database/sql connects lazily.
var sqlDB = func() *sql.DB {
	db, err := sql.Open("pgx", "postgres://127.0.0.1:1/never")
	if err != nil {
		panic(err)
	}
	return db
}()

// UsesSQL reports whether the interceptor runs on SQL (its SQL form).
func (db DB) UsesSQL() bool { return db.Driver.sql != "" }

// Open returns the database at url through d, closed with the test.
func (d Driver) Open(t testing.TB, url string) DB {
	t.Helper()
	db := DB{Driver: d}
	if d.sql == "" {
		pool, err := pgxpool.New(context.Background(), url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		db.Pgx = pool
		return db
	}
	h, err := sql.Open(d.sql, url)
	if err != nil {
		t.Fatal(err)
	}
	h.SetMaxOpenConns(16)
	t.Cleanup(func() { _ = h.Close() })
	db.SQL = h
	return db
}

// Tx is the call's transaction as a test handler writes in it, whatever
// its type.
type Tx interface {
	// Insert writes a transfer and returns its id.
	Insert(ctx context.Context, note string, amount int64) (int64, error)
	// Exec runs a statement.
	Exec(ctx context.Context, sql string) error
	// Commit commits the transaction (a handler's bug: the interceptor's
	// transaction is not the handler's to end).
	Commit(ctx context.Context) error
}

// TxOf is the Tx of a handler's context: the one of pgxTx and sqlTx that
// is not nil (an interceptor's Tx and TxSQL), or nil.
func TxOf(pgxTx pgx.Tx, sqlTx *sql.Tx) Tx {
	switch {
	case pgxTx != nil:
		return pgxWriter{pgxTx}
	case sqlTx != nil:
		return sqlWriter{sqlTx}
	}
	return nil
}

const insertTransfer = `INSERT INTO transfers (note, amount) VALUES ($1, $2) RETURNING id`

type pgxWriter struct{ tx pgx.Tx }

func (w pgxWriter) Insert(ctx context.Context, note string, amount int64) (id int64, err error) {
	return id, w.tx.QueryRow(ctx, insertTransfer, note, amount).Scan(&id)
}

func (w pgxWriter) Exec(ctx context.Context, sql string) error {
	_, err := w.tx.Exec(ctx, sql)
	return err
}

func (w pgxWriter) Commit(ctx context.Context) error { return w.tx.Commit(ctx) }

type sqlWriter struct{ tx *sql.Tx }

func (w sqlWriter) Insert(ctx context.Context, note string, amount int64) (id int64, err error) {
	return id, w.tx.QueryRowContext(ctx, insertTransfer, note, amount).Scan(&id)
}

func (w sqlWriter) Exec(ctx context.Context, sql string) error {
	_, err := w.tx.ExecContext(ctx, sql)
	return err
}

func (w sqlWriter) Commit(context.Context) error { return w.tx.Commit() }
