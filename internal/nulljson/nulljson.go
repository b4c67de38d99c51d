// Package nulljson holds the type that database/sql's generated queries
// (internal/dbsql) read jsonb columns into.
package nulljson

import (
	"database/sql/driver"
	"errors"
)

// JSON is a jsonb column as database/sql reads it: its bytes, nil for NULL
// (a json.RawMessage would refuse NULL).
type JSON []byte

// Scan implements sql.Scanner.
func (j *JSON) Scan(src any) error {
	switch v := src.(type) {
	case nil:
		*j = nil
	case []byte:
		*j = append(JSON(nil), v...)
	case string:
		*j = JSON(v)
	default:
		return errors.New("jsonb column holds neither text nor bytes")
	}
	return nil
}

// Value implements driver.Valuer: the JSON as text, NULL for nil.
func (j JSON) Value() (driver.Value, error) {
	if j == nil {
		return nil, nil
	}
	return string(j), nil
}
