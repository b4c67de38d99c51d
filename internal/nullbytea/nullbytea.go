// Package nullbytea holds the type that database/sql's generated queries
// (internal/dbsql) read a stored response's body into.
package nullbytea

import (
	"database/sql/driver"
	"errors"
)

// Bytes is a bytea column as database/sql reads it: nil only for NULL, an
// empty value as empty bytes. A []byte would not tell them apart on every
// driver: lib/pq, when the server sends bytea in the escape format
// (bytea_output = escape), hands an empty value over as a nil []byte, which
// database/sql copies into a nil slice; a Scanner still sees it as a
// []byte, where NULL is nil.
type Bytes []byte

// Scan implements sql.Scanner.
func (b *Bytes) Scan(src any) error {
	switch v := src.(type) {
	case nil:
		*b = nil
	case []byte:
		*b = append(Bytes{}, v...)
	case string:
		*b = Bytes(v)
	default:
		return errors.New("bytea column holds neither bytes nor text")
	}
	return nil
}

// Value implements driver.Valuer: the bytes, NULL for nil.
func (b Bytes) Value() (driver.Value, error) {
	if b == nil {
		return nil, nil
	}
	return []byte(b), nil
}
