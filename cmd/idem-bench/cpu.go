package main

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"time"
)

// cpuSnap is a reading of the CPU time used so far.
type cpuSnap struct {
	client      time.Duration // this process, user and system
	busy, total time.Duration // the whole machine (Linux /proc/stat), all CPUs
	ok          bool          // the machine figures are known
}

// cpuUsage is the CPU time spent between two readings.
type cpuUsage struct {
	client, busy, total time.Duration
	ok                  bool
	// server is the CPU time of the PostgreSQL backends of the benchmark's
	// own connections (serverOK false when they could not be read).
	server   time.Duration
	serverOK bool
}

func readCPU() cpuSnap {
	s := cpuSnap{client: processCPU()}
	s.busy, s.total, s.ok = machineCPU()
	return s
}

func (s cpuSnap) since(prev cpuSnap) cpuUsage {
	return cpuUsage{
		client: s.client - prev.client,
		busy:   s.busy - prev.busy,
		total:  s.total - prev.total,
		ok:     s.ok && prev.ok,
	}
}

func (u cpuUsage) add(v cpuUsage) cpuUsage {
	first := u.total == 0 && u.client == 0 && u.server == 0
	return cpuUsage{
		client: u.client + v.client, busy: u.busy + v.busy, total: u.total + v.total,
		ok:     v.ok && (u.ok || first),
		server: u.server + v.server, serverOK: v.serverOK && (u.serverOK || first),
	}
}

// machineCPU reads the busy and total CPU time of all CPUs from /proc/stat,
// in clock ticks of 10 ms (USER_HZ is 100 on every Linux in practice).
func machineCPU() (busy, total time.Duration, ok bool) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	if !sc.Scan() {
		return 0, 0, false
	}
	fields := strings.Fields(sc.Text())
	if len(fields) < 9 || fields[0] != "cpu" {
		return 0, 0, false
	}
	var v [8]int64
	for i := range v {
		v[i], err = strconv.ParseInt(fields[i+1], 10, 64)
		if err != nil {
			return 0, 0, false
		}
	}
	// user nice system idle iowait irq softirq steal
	const tick = 10 * time.Millisecond
	b := v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
	return time.Duration(b) * tick, time.Duration(b+v[3]+v[4]) * tick, true
}

// backendCPU returns the CPU time the processes pids have run so far, from
// /proc/<pid>/schedstat (nanoseconds), for the PostgreSQL backends that
// serve the benchmark's connections when the server runs on this machine.
// Processes that are gone are left out.
func backendCPU(pids []int32) map[int32]time.Duration {
	out := make(map[int32]time.Duration, len(pids))
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/schedstat")
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			continue
		}
		ns, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		out[pid] = time.Duration(ns)
	}
	return out
}

// serverDelta sums the CPU time of the backends present in both readings.
func serverDelta(before, after map[int32]time.Duration) (time.Duration, bool) {
	var d time.Duration
	n := 0
	for pid, t1 := range after {
		if t0, ok := before[pid]; ok {
			d += t1 - t0
			n++
		}
	}
	return d, n > 0
}
