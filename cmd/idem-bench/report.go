package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"text/tabwriter"
	"time"
)

// report is everything measured in a run.
type report struct {
	o                 options
	settings          string
	commit, roundTrip time.Duration
	order             []string
	slots             map[string][]slot // by workload, one per round
	storms            map[string]*stormStats
	allocs            []allocRow
	expiredLeft       int64
	scans             []string // how the key tables were read
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d.Microseconds())/1000) }

func table(out io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
}

// total sums a workload's slots; its latencies come sorted.
func (r *report) total(name string) slot {
	var t slot
	for _, s := range r.slots[name] {
		t = t.add(s)
	}
	slices.Sort(t.lat)
	slices.Sort(t.prune.lat)
	return t
}

// print prints the report and returns the number of failed correctness
// checks.
func (r *report) print(out io.Writer) (failures int) {
	fmt.Fprintf(out, "\nserver: %s\n", r.settings)
	fmt.Fprintf(out, "a commit that waits for its WAL flush (one-row INSERT): p50 %s ms; a bare round trip (SELECT 1): p50 %s ms\n",
		ms(r.commit), ms(r.roundTrip))

	fmt.Fprintf(out, "\nWorkloads: %d workers, %d rounds of %s each (latency in ms)\n", r.o.workers, r.o.rounds, r.o.round)
	tw := table(out)
	fmt.Fprintln(tw, "workload\ttx/s\tper round\tp50\tp99\terrors\t")
	for _, name := range r.order {
		t := r.total(name)
		lo, hi := math.Inf(1), 0.0
		for _, s := range r.slots[name] {
			lo, hi = min(lo, s.tps()), max(hi, s.tps())
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f..%.0f\t%s\t%s\t%d\t\n", name, t.tps(), lo, hi,
			ms(percentile(t.lat, 50)), ms(percentile(t.lat, 99)), t.errs)
		if t.errs > 0 {
			defer fmt.Fprintf(out, "FAIL %s: %d error(s), first: %v\n", name, t.errs, t.err)
			failures++
		}
		if t.prune.err != nil {
			defer fmt.Fprintf(out, "FAIL %s: prune: %v\n", name, t.prune.err)
			failures++
		}
	}
	tw.Flush()

	fmt.Fprintln(out, "\nKey tables (pg_stat_user_tables; setup included)")
	for _, line := range r.scans {
		fmt.Fprintln(out, "  "+line)
	}

	if len(r.storms) > 0 {
		fmt.Fprintf(out, "\nStorm: %d same-key DoInTx calls at once, each from its own Client (latency in ms)\n", r.o.storm)
		tw = table(out)
		fmt.Fprintln(tw, "business\tkeys\texecutions per key\tbad keys\treplays\tin progress\terrors\tsingle p50\twinner p50\tlosers p99\t")
		for _, name := range []string{"light", "draw"} {
			s := r.storms[name]
			fmt.Fprintf(tw, "%s\t%d\t%d..%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t\n", name, s.keys, s.minExec, s.maxExec, s.badKeys,
				len(s.losers), s.inProgress, s.errs, ms(percentile(sorted(s.single), 50)),
				ms(percentile(sorted(s.winners), 50)), ms(percentile(sorted(s.losers), 99)))
			if s.errs > 0 {
				defer fmt.Fprintf(out, "FAIL storm %s: %d error(s), first: %v\n", name, s.errs, s.err)
			}
		}
		tw.Flush()
	}

	if _, ok := r.slots["scale full+prune"]; ok {
		p := r.total("scale full+prune").prune
		fmt.Fprintf(out, "\nScale: idem.Prune beside the full table deleted %d keys in %d batches of up to 1000 (batch p50 %s ms, p99 %s ms); %d expired keys left\n",
			p.rows, len(p.lat), ms(percentile(p.lat, 50)), ms(percentile(p.lat, 99)), r.expiredLeft)
		if r.expiredLeft == 0 {
			fmt.Fprintln(out, "  Prune ran out of expired keys: part of the full+prune slots ran without it (raise -expired-rows)")
		}
	}

	if len(r.allocs) > 0 {
		fmt.Fprintf(out, "\nAllocations per call, sequential, fn trivial (testing.AllocsPerRun, %d calls)\n", r.o.allocs)
		tw = table(out)
		for _, a := range r.allocs {
			fmt.Fprintf(tw, "%s\t%.0f\t\n", a.name, a.allocs)
		}
		tw.Flush()
	}

	fmt.Fprintln(out, "\nGoals (ratios of throughput: median of the per-round ratios)")
	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "goal\tmeasured\ttarget\t\tdetail")
	for _, g := range r.goals() {
		verdict := map[bool]string{true: "PASS", false: "MISS"}[g.pass]
		switch {
		case g.critical && !g.pass:
			verdict = "FAIL"
			failures++
		case g.target == "":
			verdict = ""
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%s\t%s\t%s\n", g.name, g.value, g.target, verdict, g.detail)
	}
	tw.Flush()
	return failures
}

// ratio is the throughput of workload a over b: the median of the
// per-round ratios (each round's slots ran close together, so load from
// elsewhere on the machine cancels best there), with the range and the
// ratio of the totals.
func (r *report) ratio(a, b string) (median float64, detail string) {
	sa, sb := r.slots[a], r.slots[b]
	var per []float64
	for i := range min(len(sa), len(sb)) {
		if sb[i].tps() > 0 {
			per = append(per, sa[i].tps()/sb[i].tps())
		}
	}
	if len(per) == 0 {
		return 0, "no data"
	}
	slices.Sort(per)
	median = (per[(len(per)-1)/2] + per[len(per)/2]) / 2
	total := r.total(a).tps() / max(r.total(b).tps(), 1e-9)
	return median, fmt.Sprintf("rounds %.2f..%.2f, totals %.2f", per[0], per[len(per)-1], total)
}

// goal is one line of the goals table; no target: printed for comparison.
type goal struct {
	name, target, detail string
	value                float64
	pass, critical       bool
}

func (r *report) goals() []goal {
	var gs []goal
	atLeast := func(a, b string, want float64) {
		v, detail := r.ratio(a, b)
		g := goal{name: a + " / " + b, value: v, detail: detail, pass: true}
		if want > 0 {
			g.target, g.pass = fmt.Sprintf(">= %.2f", want), v >= want
		}
		gs = append(gs, g)
	}
	switch {
	case r.o.stale:
		for _, p := range [][2]string{{"do", "floor"}, {"doInTx", "floor"}, {"doInTx", "two-tx"}, {"replay", "bare"}} {
			fresh, _ := r.ratio("light "+p[0], "light "+p[1])
			den := "light " + p[1] + " stale"
			if p[1] == "bare" {
				den = "light bare"
			}
			stale, detail := r.ratio("light "+p[0]+" stale", den)
			g := goal{name: "stale - fresh: light " + p[0] + " / " + p[1], value: stale - fresh, pass: true,
				detail: fmt.Sprintf("stale %.2f (%s), fresh %.2f", stale, detail, fresh)}
			if p[1] == "two-tx" {
				// two-tx's own completion UPDATE gets a stale plan too.
				g.detail += "; two-tx itself runs on the stale table"
			} else {
				g.target, g.pass = "within 0.03", math.Abs(stale-fresh) <= 0.03
			}
			gs = append(gs, g)
		}
		f, s := r.total("light doInTx"), r.total("light doInTx stale")
		gs = append(gs, goal{name: "p99 light doInTx stale / fresh", value: float64(percentile(s.lat, 99)) / float64(max(percentile(f.lat, 99), 1)),
			detail: ms(percentile(s.lat, 99)) + " / " + ms(percentile(f.lat, 99)) + " ms", pass: true})
		return gs
	case r.o.latency > 0:
		atLeast("light doInTx", "light floor", 1.35)
		atLeast("light do", "light floor", 0.90)
		atLeast("light doInTx", "light two-tx", 0)
		atLeast("draw doInTx", "draw floor", 0)
		atLeast("draw do", "draw floor", 0)
	default:
		atLeast("light doInTx", "light floor", 0.92)
		atLeast("light do", "light floor", 0.80)
		atLeast("light doInTx", "light two-tx", 1.30)
		atLeast("light doInTx+obs", "light doInTx", 0.97)
		atLeast("draw doInTx", "draw floor", 0.97)
		atLeast("draw do", "draw floor", 0)
		atLeast("draw doInTx", "draw two-tx", 0)
	}
	atLeast("light replay", "light bare", 2.5)
	atLeast("draw replay", "draw bare", 0)
	for _, name := range []string{"light", "draw"} {
		s := r.storms[name]
		gs = append(gs, goal{name: "storm " + name + ": executions per key", value: float64(s.maxExec), target: "== 1",
			pass:     s.keys > 0 && s.badKeys == 0 && s.errs == 0 && s.minExec == 1 && s.maxExec == 1,
			critical: true, detail: fmt.Sprintf("%d..%d over %d keys, %d bad", s.minExec, s.maxExec, s.keys, s.badKeys)})
		single, losers := percentile(sorted(s.single), 50), percentile(sorted(s.losers), 99)
		gs = append(gs, goal{name: "storm " + name + ": losers p99 / single p50", pass: true,
			value: float64(losers) / float64(max(single, 1)), detail: ms(losers) + " / " + ms(single) + " ms"})
	}
	if _, ok := r.slots["scale empty"]; ok {
		e, f := percentile(r.total("scale empty").lat, 99), percentile(r.total("scale full+prune").lat, 99)
		v := float64(f) / float64(max(e, 1))
		gs = append(gs, goal{name: "scale: p99 full+prune / p99 empty", value: v, target: "<= 1.50", pass: v <= 1.5,
			detail: fmt.Sprintf("%s / %s ms, doInTx light, %d keys", ms(f), ms(e), r.o.scaleRows)})
	}
	return gs
}
