package idemui

import (
	"bytes"
	"encoding/json"
	"fmt"
	"html/template"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
)

// funcs are the templates' functions.
var funcs = template.FuncMap{
	"ts":       formatTime,
	"ago":      ago,
	"num":      formatInt,
	"bytes":    formatBytes,
	"count":    formatCount,
	"status":   statusLabel,
	"sclass":   statusClass,
	"statuses": func() []idem.Status { return statuses },
	"rfc3339":  func(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) },
	"keyurl": func(prefix, actor, operation, key string) string {
		return prefix + keyURL(idem.Scope{Actor: actor, Operation: operation}, key, "")
	},
	"deref": func(t *time.Time) time.Time {
		if t == nil {
			return time.Time{}
		}
		return *t
	},
	"entries": func(prefix string, entries []audit.Entry, showKey bool) entryTable {
		return entryTable{Prefix: prefix, Entries: entries, ShowKey: showKey}
	},
	"action":   actionText,
	"eventref": eventRef,
	"detail":   newDetailView,
	"ref": func(actor, operation, key string, token int64) string {
		return targetRef(idem.Scope{Actor: actor, Operation: operation}, key, token)
	},
}

// detailView is an audit row's detail as the trail shows it: a summary,
// the copy of a forgotten record, and the JSON, indented.
type detailView struct {
	Summary string
	Copy    *audit.RecordCopy
	JSON    string
}

// newDetailView is the view of e's detail; nil when it has none.
func newDetailView(e audit.Entry) *detailView {
	if e.Detail == nil {
		return nil
	}
	v := &detailView{Summary: "Detail", JSON: string(e.Detail)}
	var indented bytes.Buffer
	if json.Indent(&indented, e.Detail, "", "  ") == nil {
		v.JSON = indented.String()
	}
	switch e.Action {
	case audit.ActionForget:
		var d struct {
			Forgotten *audit.RecordCopy `json:"forgotten"`
		}
		if json.Unmarshal(e.Detail, &d) == nil && d.Forgotten != nil {
			v.Summary, v.Copy = "Copy of the deleted record", d.Forgotten
		}
	case audit.ActionExpireLeases:
		v.Summary = "Filter and cutoff"
	case audit.ActionResolve:
		v.Summary = "Stored response"
	case audit.ActionPrune:
		v.Summary = "Bounds"
	case audit.ActionRetryEvent:
		v.Summary = "Event sent again"
	}
	return v
}

// entryTable is what the "entries" template shows: rows of the trail.
type entryTable struct {
	Prefix  string
	Entries []audit.Entry
	ShowKey bool
}

// formatTime is t in UTC to the second, for people.
func formatTime(t time.Time) string {
	if t.IsZero() {
		return "—"
	}
	return t.UTC().Format("2006-01-02 15:04:05 UTC")
}

// ago says how long ago t was (or how long until it comes).
func ago(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	d := time.Since(t)
	if d < 0 {
		return "in " + span(-d)
	}
	return span(d) + " ago"
}

// span is d in the two largest units that matter.
func span(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%d s", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%d min", int(d.Minutes()))
	case d < 24*time.Hour:
		return fmt.Sprintf("%d h %d min", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%d d %d h", int(d.Hours())/24, int(d.Hours())%24)
}

// formatInt is n with thousands separated by commas.
func formatInt(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var sb strings.Builder
	for i, r := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			sb.WriteByte(',')
		}
		sb.WriteRune(r)
	}
	if neg {
		return "-" + sb.String()
	}
	return sb.String()
}

// formatCount is a count for people: "≈ 2,900,000", "1,000+" or "12".
func formatCount(c count) string {
	switch {
	case c.Estimated:
		return "≈ " + formatInt(roundish(c.N))
	case c.AtLeast:
		return formatInt(c.N) + "+"
	}
	return formatInt(c.N)
}

// roundish rounds an estimate to three significant digits: the sample says
// no more.
func roundish(n int64) int64 {
	p := int64(1)
	for n/p >= 1000 {
		p *= 10
	}
	return (n + p/2) / p * p
}

// formatBytes is n in KB, MB or GB.
func formatBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.0f KB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d bytes", n)
}

// statusLabel is a status (idem.Status or its string) for people.
func statusLabel(v any) string {
	s := idem.Status(fmt.Sprint(v))
	switch s {
	case idem.StatusUnknown:
		return "Unknown outcome"
	case idem.StatusProcessing:
		return "Processing"
	case idem.StatusSucceeded:
		return "Succeeded"
	case idem.StatusRejected:
		return "Rejected"
	case idem.StatusFailedRetryable:
		return "Failed, retryable"
	}
	return string(s)
}

// statusClass is the style of a status (idem.Status or its string).
func statusClass(v any) string {
	s := idem.Status(fmt.Sprint(v))
	switch s {
	case idem.StatusUnknown:
		return "unknown"
	case idem.StatusProcessing:
		return "processing"
	case idem.StatusSucceeded:
		return "succeeded"
	case idem.StatusRejected:
		return "rejected"
	case idem.StatusFailedRetryable:
		return "retryable"
	}
	return "other"
}
