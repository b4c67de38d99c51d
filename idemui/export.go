package idemui

import (
	"encoding/csv"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem/internal/audit"
)

// maxExportRows and maxExportBytes bound an export of the trail: past
// either, the export says it was cut (narrow the time range). The bytes
// are those of the stored text the rows hold (a forget's copy of the
// record holds its response, body included): what the export keeps in
// memory before it writes.
const maxExportRows = 50000

var maxExportBytes = func() *atomic.Int64 {
	var n atomic.Int64
	n.Store(64 << 20)
	return &n
}()

// An export reads the trail exportBatch rows at a time at first (a page
// of the audit page), then as many as hold about exportPageBytes at the
// size of the rows read so far, up to maxExportBatch: what it may read
// past its bound in bytes stays about one page, and small rows are read
// 500 at a time.
const (
	exportBatch     = 50
	maxExportBatch  = 500
	exportPageBytes = 4 << 20
)

// auditExport answers the rows of the trail that the query's filter
// matches (the audit page's filter), newest first, as a CSV or a JSON
// file: audit.csv or audit.json.
func (q *request) auditExport() {
	f, _, err := auditQuery(q.r.URL.Query(), exportBatch)
	if err != nil {
		q.fail(err)
		return
	}
	var entries []audit.Entry
	var size int64
	before, truncated := "", false
	for {
		page, next, err := readAudit(q.r.Context(), q.c.opts.DB, f, before)
		if err != nil {
			q.fail(err)
			return
		}
		var pageSize int64
		for _, e := range page {
			pageSize += int64(len(e.Operator) + len(e.Scope.Actor) + len(e.Scope.Operation) + len(e.Key) + len(e.Reason) + len(e.Detail))
		}
		if len(page) > 0 {
			f.Limit = int(min(max(exportPageBytes/max(pageSize/int64(len(page)), 1), exportBatch), maxExportBatch))
		}
		for _, e := range page {
			if len(entries) >= maxExportRows || size >= maxExportBytes.Load() {
				truncated = true
				break
			}
			entries = append(entries, e)
			size += int64(len(e.Operator) + len(e.Scope.Actor) + len(e.Scope.Operation) + len(e.Key) + len(e.Reason) + len(e.Detail))
		}
		if truncated || next == "" {
			break
		}
		if len(entries) >= maxExportRows || size >= maxExportBytes.Load() {
			truncated = true
			break
		}
		before = next
	}
	h := q.w.Header()
	name := "idem-audit-" + time.Now().UTC().Format("20060102T150405Z")
	if strings.HasSuffix(q.r.URL.Path, ".json") {
		h.Set("Content-Type", "application/json; charset=utf-8")
		h.Set("Content-Disposition", `attachment; filename="`+name+`.json"`)
		writeJSON(q.w, http.StatusOK, map[string]any{"entries": entriesJSON(entries), "truncated": truncated})
		return
	}
	h.Set("Content-Type", "text/csv; charset=utf-8")
	h.Set("Content-Disposition", `attachment; filename="`+name+`.csv"`)
	if truncated {
		h.Set("Idem-Export-Truncated", strconv.Itoa(len(entries)))
	}
	w := csv.NewWriter(q.w)
	_ = w.Write([]string{"id", "at", "operator", "action", "actor", "operation", "key", "token_before", "token_after",
		"status_before", "status_after", "verdict", "reason", "changed", "detail"})
	for _, e := range entries {
		tok := func(has bool, t int64) string {
			if !has {
				return ""
			}
			return strconv.FormatInt(t, 10)
		}
		_ = w.Write([]string{strconv.FormatInt(e.ID, 10), e.At.UTC().Format(time.RFC3339Nano), cell(e.Operator), e.Action,
			cell(e.Scope.Actor), cell(e.Scope.Operation), cell(e.Key), tok(e.HasBefore, e.TokenBefore), tok(e.HasAfter, e.TokenAfter),
			string(e.StatusBefore), string(e.StatusAfter), e.Verdict, cell(e.Reason), strconv.FormatInt(e.Changed, 10), cell(compact(e.Detail))})
	}
	w.Flush()
}

// cell is a stored string as a CSV cell: one that a spreadsheet would take
// for a formula (it starts with = + - @, a tab or a carriage return) gets a
// leading apostrophe, which spreadsheets show as text.
func cell(s string) string {
	if s != "" && strings.ContainsRune("=+-@\t\r", rune(s[0])) {
		return "'" + s
	}
	return s
}

// compact is the JSON of a detail on one line.
func compact(raw json.RawMessage) string {
	if raw == nil {
		return ""
	}
	var b strings.Builder
	enc := json.NewEncoder(&b)
	var v any
	if json.Unmarshal(raw, &v) != nil || enc.Encode(v) != nil {
		return string(raw)
	}
	return strings.TrimSuffix(b.String(), "\n")
}
