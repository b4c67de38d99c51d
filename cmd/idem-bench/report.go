package main

import (
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// report is everything measured in a run.
type report struct {
	o           options
	order       []string
	series      map[string]*series
	storm       []stormSlot
	calibration []calibration
	sync        syncCost
	allocs      []allocResult
	expiredLeft int
	refillRows  int
	failures    int
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d.Microseconds())/1000) }

func (r *report) print(out io.Writer) {
	fmt.Fprintln(out)
	r.printWorkloads(out)
	r.printCalibration(out)
	r.printStorm(out)
	r.printScale(out)
	r.printAllocs(out)
	r.printGoals(out)
	r.printFailures(out)
}

func newTable(out io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
}

// perOp formats d per operation in µs, or "-".
func perOp(d time.Duration, ops int, ok bool) string {
	if !ok || ops == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", float64(d.Microseconds())/float64(ops))
}

// ownCPU is the CPU time per transaction of the benchmark process and of
// the PostgreSQL backends serving it: the part of the machine's work that
// is the workload's own, whatever else runs on the machine.
func ownCPU(t slot) (time.Duration, bool) {
	if !t.cpu.serverOK || t.ops == 0 {
		return 0, false
	}
	return (t.cpu.client + t.cpu.server) / time.Duration(t.ops), true
}

func (r *report) printWorkloads(out io.Writer) {
	fmt.Fprintf(out, "Throughput and latency: %d workers, %d rounds of %s per workload (ms; CPU in µs per transaction)\n",
		r.o.workers, r.o.rounds, r.o.round)
	tw := newTable(out)
	fmt.Fprintln(tw, "workload\ttx/s\tper round\tp50\tp90\tp99\tmax\terrors\tclient CPU\tserver CPU\town CPU\tmachine CPU\tbusy\t")
	for _, name := range r.order {
		s := r.series[name]
		t := s.total()
		lo, hi := s.tpsRange()
		busy := "-"
		if t.cpu.ok && t.cpu.total > 0 {
			busy = fmt.Sprintf("%.0f%%", 100*float64(t.cpu.busy)/float64(t.cpu.total))
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f..%.0f\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t\n", name, t.tps(), lo, hi,
			ms(percentile(t.lat, 50)), ms(percentile(t.lat, 90)), ms(percentile(t.lat, 99)), ms(percentile(t.lat, 100)),
			t.errs, perOp(t.cpu.client, t.ops, true), perOp(t.cpu.server, t.ops, t.cpu.serverOK),
			perOp(t.cpu.client+t.cpu.server, t.ops, t.cpu.serverOK), perOp(t.cpu.busy, t.ops, t.cpu.ok), busy)
	}
	tw.Flush()
	fmt.Fprintln(out, "  client: this process; server: the PostgreSQL backends of its connections (when on this machine);")
	fmt.Fprintln(out, "  own = client + server; machine and busy count every process, other jobs on the machine included")
}

func (s *series) tpsRange() (lo, hi float64) {
	for i, x := range s.slots {
		v := x.tps()
		if i == 0 || v < lo {
			lo = v
		}
		if i == 0 || v > hi {
			hi = v
		}
	}
	return lo, hi
}

func (r *report) printCalibration(out io.Writer) {
	fmt.Fprintln(out, "\nOne transaction alone on one connection (averages per transaction)")
	tw := newTable(out)
	fmt.Fprintln(tw, "workload\tround trips\tstatements\tprepares\tbytes sent\tbytes received\tp50 ms\t")
	for _, c := range r.calibration {
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t%.0f\t%.0f\t%s\t\n",
			c.name, c.rts, c.stmts, c.prepares, c.sent, c.recv, ms(c.p50))
	}
	tw.Flush()
	s := r.sync
	fmt.Fprintf(out, "  a commit that waits for its WAL flush (one-row INSERT): p50 %s ms; a bare round trip (SELECT 1): p50 %s ms\n",
		ms(s.commit), ms(s.roundTrip))
	fmt.Fprintf(out, "  %s: what a second commit (two-tx) costs depends on it\n", s.settings)
}

// stormTotal sums the storm over the rounds.
type stormTotal struct {
	keys, winners, fnCalls, badKeys, inProgress, errs, minExec, maxExec int
	err                                                                 error
	winnerLat, loserLat, soloLat                                        []time.Duration
	stormTime                                                           time.Duration
	stormCPU                                                            cpuUsage
}

func (r *report) stormTotal() stormTotal {
	var t stormTotal
	first := true
	for _, s := range r.storm {
		t.keys += s.keys
		t.winners += s.winners
		t.fnCalls += s.fnCalls
		t.badKeys += s.badKeys
		t.inProgress += s.inProgress
		t.errs += s.errs
		if t.err == nil {
			t.err = s.err
		}
		for _, e := range s.execs {
			if first {
				t.minExec, t.maxExec, first = e, e, false
			}
			t.minExec, t.maxExec = min(t.minExec, e), max(t.maxExec, e)
		}
		t.stormTime += s.stormTime
		t.stormCPU = t.stormCPU.add(s.stormCPU)
		t.winnerLat = append(t.winnerLat, s.winnerLat...)
		t.loserLat = append(t.loserLat, s.loserLat...)
		t.soloLat = append(t.soloLat, s.soloLat...)
	}
	slices.Sort(t.winnerLat)
	slices.Sort(t.loserLat)
	slices.Sort(t.soloLat)
	return t
}

func (r *report) printStorm(out io.Writer) {
	t := r.stormTotal()
	fmt.Fprintf(out, "\nStorm: %d goroutines send the same key at once; %d keys\n", r.o.storm, t.keys)
	fmt.Fprintf(out, "  executions per key (draws in the database): min %d, max %d; winners %d, fn calls %d, keys with a problem %d\n",
		t.minExec, t.maxExec, t.winners, t.fnCalls, t.badKeys)
	fmt.Fprintf(out, "  replays %d, in progress (gave up waiting) %d, other errors %d\n", len(t.loserLat), t.inProgress, t.errs)
	tw := newTable(out)
	fmt.Fprintln(tw, "latency ms\tcalls\tp50\tp90\tp99\tmax\t")
	for _, row := range []struct {
		name string
		lat  []time.Duration
	}{
		{"single execution, alone", t.soloLat},
		{"storm winner", t.winnerLat},
		{"storm losers (replayed)", t.loserLat},
	} {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t\n", row.name, len(row.lat), ms(percentile(row.lat, 50)),
			ms(percentile(row.lat, 90)), ms(percentile(row.lat, 99)), ms(percentile(row.lat, 100)))
	}
	tw.Flush()
	if t.keys > 0 && t.stormCPU.ok {
		perKey := t.stormCPU.busy / time.Duration(t.keys)
		own := "-"
		if t.stormCPU.serverOK {
			o := (t.stormCPU.client + t.stormCPU.server) / time.Duration(t.keys)
			own = fmt.Sprintf("%s ms (%.0f µs per call)", ms(o), float64(o.Microseconds())/float64(r.o.storm))
		}
		fmt.Fprintf(out, "  per key: %s ms wall; own CPU (client + server) %s; machine CPU %s ms; "+
			"machine CPU / CPUs = %s ms, the least the last call can take\n",
			ms(t.stormTime/time.Duration(t.keys)), own, ms(perKey), ms(perKey/time.Duration(runtime.NumCPU())))
	}
}

func (r *report) printScale(out io.Writer) {
	fmt.Fprintln(out, "\nScale: do against an empty key table, a full one, and the full one while expired keys are pruned")
	tw := newTable(out)
	fmt.Fprintln(tw, "table\ttx/s\tp50\tp99\tp99.9\tpruned rows\tprune batches\tbatch p50\tbatch p99\t")
	for _, name := range []string{"scale-empty", "scale-full", "scale-prune"} {
		s, ok := r.series[name]
		if !ok {
			continue
		}
		t := s.total()
		pr, pb, bp50, bp99 := "-", "-", "-", "-"
		if name == "scale-prune" {
			pr, pb = fmt.Sprint(t.beside.rows), fmt.Sprint(t.beside.batches)
			bp50, bp99 = ms(percentile(t.beside.lat, 50)), ms(percentile(t.beside.lat, 99))
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", name, t.tps(), ms(percentile(t.lat, 50)),
			ms(percentile(t.lat, 99)), ms(percentile(t.lat, 99.9)), pr, pb, bp50, bp99)
	}
	tw.Flush()
	fmt.Fprintf(out, "  full table: %d keys loaded (%d expired); expired keys left unpruned at the end: %d; re-added during the run: %d\n",
		r.o.scaleRows, r.o.pruneRows, r.expiredLeft, r.refillRows)
}

func (r *report) printAllocs(out io.Writer) {
	fmt.Fprintf(out, "\nAllocations per call, sequential, fn trivial (%d calls each)\n", r.o.allocOps)
	tw := newTable(out)
	fmt.Fprintln(tw, "call\tallocs/op\tB/op\tms/op\t")
	for _, a := range r.allocs {
		fmt.Fprintf(tw, "%s\t%.1f\t%.0f\t%s\t\n", a.name, a.allocs, a.bytes, ms(a.wall))
	}
	tw.Flush()
}

// goal is one target of the benchmark.
type goal struct {
	name     string
	value    float64
	detail   string
	target   string
	pass     bool
	critical bool // a correctness check: a miss fails the run
	info     bool // no target: printed for comparison
}

// ratio compares the throughput of workloads a and b: the median of the
// per-round ratios (each round's slots ran close together in time, so
// noise from elsewhere on the machine cancels best there), the ratio of
// the totals, and the range over the rounds.
func (r *report) ratio(a, b string) (median, total, lo, hi float64) {
	sa, sb := r.series[a], r.series[b]
	ta, tb := sa.total(), sb.total()
	if tb.tps() > 0 {
		total = ta.tps() / tb.tps()
	}
	var per []float64
	for i := range min(len(sa.slots), len(sb.slots)) {
		if sb.slots[i].tps() > 0 {
			per = append(per, sa.slots[i].tps()/sb.slots[i].tps())
		}
	}
	if len(per) == 0 {
		return 0, total, 0, 0
	}
	slices.Sort(per)
	median = per[len(per)/2]
	if len(per)%2 == 0 {
		median = (per[len(per)/2-1] + per[len(per)/2]) / 2
	}
	return median, total, per[0], per[len(per)-1]
}

// cpuRatio is the throughput ratio of a to b that their own CPU per
// transaction predicts on a saturated machine: own CPU of b / own CPU of a.
// It is far less noisy than the measured ratio, since other jobs on the
// machine do not change how much CPU a transaction takes.
func (r *report) cpuRatio(a, b string) string {
	ca, oka := ownCPU(r.series[a].total())
	cb, okb := ownCPU(r.series[b].total())
	if !oka || !okb || ca == 0 {
		return ""
	}
	return fmt.Sprintf("; by own CPU %.2f", float64(cb)/float64(ca))
}

func (r *report) goals() []goal {
	var gs []goal
	for _, g := range []struct {
		a, b string
		min  float64
	}{
		{"do", "floor", 0.85},
		{"doInTx", "floor", 0.95},
		{"replay", "bare", 2.0},
		{"do", "two-tx", 1.20},
		{"doInTx", "two-tx", 1.30},
	} {
		v, total, lo, hi := r.ratio(g.a, g.b)
		gs = append(gs, goal{
			name: g.a + " / " + g.b + " (tx/s)", value: v,
			detail: fmt.Sprintf("median of rounds; totals %.2f, rounds %.2f..%.2f%s", total, lo, hi, r.cpuRatio(g.a, g.b)),
			target: fmt.Sprintf(">= %.2f", g.min), pass: v >= g.min,
		})
	}

	if r.o.proto {
		var pairs [][2]string
		for _, name := range r.order {
			if strings.HasPrefix(name, "p-") {
				pairs = append(pairs, [2]string{name, "floor"})
			}
		}
		for _, name := range r.order {
			if strings.HasPrefix(name, "p-") && name != "p-floor-piped" {
				pairs = append(pairs, [2]string{name, "two-tx"})
			}
		}
		for _, g := range pairs {
			v, total, lo, hi := r.ratio(g[0], g[1])
			gs = append(gs, goal{
				name: g[0] + " / " + g[1] + " (tx/s)", value: v,
				detail: fmt.Sprintf("median of rounds; totals %.2f, rounds %.2f..%.2f%s", total, lo, hi, r.cpuRatio(g[0], g[1])),
				target: "prototype", pass: true, info: true,
			})
		}
	}

	st := r.stormTotal()
	gs = append(gs, goal{
		name: "storm: executions per key", value: float64(st.maxExec),
		detail: fmt.Sprintf("min %d max %d over %d keys, %d bad", st.minExec, st.maxExec, st.keys, st.badKeys),
		target: "== 1", pass: st.keys > 0 && st.badKeys == 0 && st.minExec == 1 && st.maxExec == 1, critical: true,
	})
	// "The p50 of a single execution" read two ways: the execution each
	// storm's losers wait for (the winner, slowed by the storm itself), and
	// one execution with nothing else running.
	loser := percentile(st.loserLat, 99)
	for _, ref := range []struct {
		name string
		lat  []time.Duration
	}{{"storm winner", st.winnerLat}, {"alone", st.soloLat}} {
		p50 := percentile(ref.lat, 50)
		var v float64
		if p50 > 0 {
			v = float64(loser) / float64(p50)
		}
		gs = append(gs, goal{
			name: "storm: loser p99 / p50 " + ref.name, value: v,
			detail: fmt.Sprintf("%s ms / %s ms", ms(loser), ms(p50)),
			target: "<= 3.00", pass: v > 0 && v <= 3,
		})
	}

	empty, prune := r.series["scale-empty"].total(), r.series["scale-prune"].total()
	pe, pp := percentile(empty.lat, 99), percentile(prune.lat, 99)
	var scv float64
	if pe > 0 {
		scv = float64(pp) / float64(pe)
	}
	gs = append(gs, goal{
		name: "scale: p99 full+prune / p99 empty", value: scv,
		detail: fmt.Sprintf("%s ms / %s ms", ms(pp), ms(pe)),
		target: "<= 2.00", pass: scv > 0 && scv <= 2,
	})

	for _, a := range r.allocs {
		if strings.HasPrefix(a.name, "Do fresh") {
			gs = append(gs, goal{
				name: "Do fresh allocs/op (fn trivial)", value: a.allocs,
				detail: fmt.Sprintf("%.0f B/op", a.bytes), target: "<= 80", pass: a.allocs <= 80,
			})
		}
	}
	return gs
}

func (r *report) printGoals(out io.Writer) {
	fmt.Fprintln(out, "\nGoals (ratios from this run)")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "goal\tmeasured\ttarget\t\tdetail")
	for _, g := range r.goals() {
		verdict := "PASS"
		if g.info {
			verdict = "-"
		}
		if !g.pass {
			verdict = "MISS"
			if g.critical {
				verdict = "FAIL"
				r.failures++
			}
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%s\t%s\t%s\n", g.name, g.value, g.target, verdict, g.detail)
	}
	tw.Flush()
}

// printFailures lists the correctness problems: any error in a workload is
// one, since every workload's premise (fresh keys execute, completed keys
// replay) leaves no room for errors.
func (r *report) printFailures(out io.Writer) {
	for _, name := range r.order {
		t := r.series[name].total()
		if t.errs > 0 {
			r.failures++
			fmt.Fprintf(out, "FAIL %s: %d error(s), first: %v\n", name, t.errs, t.err)
		}
		if t.beside.err != nil {
			r.failures++
			fmt.Fprintf(out, "FAIL %s: prune: %v\n", name, t.beside.err)
		}
	}
	if st := r.stormTotal(); st.errs > 0 {
		r.failures++
		fmt.Fprintf(out, "FAIL storm: %d error(s), first: %v\n", st.errs, st.err)
	}
}
