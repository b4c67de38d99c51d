package idemui

import (
	"fmt"
	"time"

	"github.com/pgidem/idem"
)

// chart is a bar chart of one outcome over the last 24 hours, one bar an
// hour, oldest on the left, drawn as SVG by the template.
type chart struct {
	Status    idem.Status
	Title     string
	Class     string
	Total     int64
	Max       int64
	Estimated bool
	Bars      []bar
	Width     int
	Height    int
	Base      int // the y of the baseline
}

// bar is one hour of a chart.
type bar struct {
	X, Y, W, H int
	Label      string
}

// Chart geometry, in SVG units.
const (
	barWidth    = 12
	barGap      = 3
	chartHeight = 90
	chartTop    = 8
)

// charts draws the outcomes of the last 24 hours of o, one chart for each,
// each with its own scale: an outcome that is rare is still visible.
func charts(o overview) []chart {
	var out []chart
	for _, s := range []struct {
		status idem.Status
		title  string
		class  string
	}{
		{idem.StatusSucceeded, "Succeeded", "succeeded"},
		{idem.StatusRejected, "Rejected", "rejected"},
		{idem.StatusFailedRetryable, "Failed, retryable", "retryable"},
		{idem.StatusUnknown, "Unknown outcomes", "unknown"},
	} {
		hours := o.Hourly[s.status]
		c := chart{Status: s.status, Title: s.title, Class: s.class, Estimated: o.SamplePercent < 100,
			Width: 24 * (barWidth + barGap), Height: chartHeight + 4, Base: chartHeight}
		for _, n := range hours {
			c.Total += n
			c.Max = max(c.Max, n)
		}
		for i := range 24 {
			hoursAgo := 23 - i
			n := hours[hoursAgo]
			h := 0
			if c.Max > 0 {
				h = int(int64(chartHeight-chartTop) * n / c.Max)
			}
			if n > 0 && h < 2 {
				h = 2 // a few still show
			}
			from := o.Now.Add(-time.Duration(hoursAgo+1) * time.Hour).UTC()
			to := from.Add(time.Hour)
			approx := ""
			if c.Estimated {
				approx = "≈ "
			}
			c.Bars = append(c.Bars, bar{X: i * (barWidth + barGap), Y: chartHeight - h, W: barWidth, H: h,
				Label: fmt.Sprintf("%s–%s UTC: %s%s", from.Format("15:04"), to.Format("15:04"), approx, formatInt(n))})
		}
		out = append(out, c)
	}
	return out
}
