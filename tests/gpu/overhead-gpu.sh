#!/bin/sh
# End-to-end overhead of gpud on a CUDA workload (run on a machine with an NVIDIA GPU, as root;
# results in docs/benchmarks.md, "Real GPU"):
#
#   tests/gpu/overhead-gpu.sh CARRY_DIR OUT_DIR [ROUNDS]
#
# ROUNDS times (default 3), alternately without gpud (no daemon, nothing attached: keep_pinned =
# false and the pins checked gone) and with gpud (default configuration otherwise, real NVML, the
# workload's cgroup under a 64 GiB memory limit so every allocation goes through the limit
# check), tests/gpu/overhead_workload.py runs in the same cgroup and reports CUDA context
# creation time, matmul, allocation and synchronize rates. Each round also times 4 million
# one-byte read/write syscalls of dd (the host-wide tax of syscall tracepoints) and, with gpud,
# the daemon's CPU time over the workload. Output: OUT_DIR/report.txt (one JSON line per run),
# gpud-N.log.
set -u
C=$1
OUT=$2
ROUNDS=${3:-3}
. "$(dirname "$0")/common.sh"
W="$CG/gpud-overhead"
note() { echo "$*" | tee -a "$R"; }

note "# kernel $(uname -r), driver $(head -1 /proc/driver/nvidia/version | sed 's/.*Kernel Module *//')"
note "# $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader), $(nproc) CPUs"
start_bus
cat >/tmp/gpud-overhead.toml <<CONF
[daemon]
state_dir = "/tmp/gpud-state-overhead"
[dbus]
bus = "$BUS"
[probes]
keep_pinned = false
CONF
mkdir -p "$W"

# Prints the ns per syscall of `dd` copying 2M one-byte blocks (one read and one write each).
syscall_ns() {
	s=$(date +%s%N)
	dd if=/dev/zero of=/dev/null bs=1 count=2000000 2>/dev/null
	e=$(date +%s%N)
	echo $(((e - s) / 4000000))
}
cpu_ticks() { if [ -n "$1" ]; then awk '{ print $14 + $15 }' "/proc/$1/stat"; else echo 0; fi; }

run() { # $1: off|on, $2: round
	tax=$(syscall_ns)
	t0=$(cpu_ticks "$GPUD")
	line=$(sh -c "echo \$\$ > $W/cgroup.procs; PHASE_SECS=5 exec python3 $HERE/overhead_workload.py" 2>"$OUT/workload-$1-$2.err")
	t1=$(cpu_ticks "$GPUD")
	note "{\"gpud\": \"$1\", \"round\": $2, \"dd_ns_per_syscall\": $tax, \"gpud_cpu_ticks\": $((t1 - t0)), \"workload\": ${line:-null}}"
}

for i in $(seq "$ROUNDS"); do
	GPUD=
	left=$(find /sys/fs/bpf/gpud -type f 2>/dev/null | head -3)
	[ -n "$left" ] && note "# round $i: pins left behind: $left"
	run off "$i"
	"$C/gpud" --config /tmp/gpud-overhead.toml >"$OUT/gpud-$i.log" 2>&1 &
	GPUD=$!
	for _ in $(seq 100); do ctl status >/dev/null 2>&1 && break; sleep 0.1; done
	[ "$i" = 1 ] && { ctl status | head -8 | sed 's/^/# /' >>"$R"; ctl set /gpud-overhead --memory-max 64Gi >>"$R" 2>&1; }
	run on "$i"
	ctl --json get /gpud-overhead | python3 -c '
import json, sys
e = json.load(sys.stdin)
print("# gpud saw: ioctls=%s memory_current=%s memory_max=%s" % (e.get("ioctls"), e.get("memory_current"), e.get("memory_max")))' >>"$R" 2>&1
	kill -TERM "$GPUD"
	wait "$GPUD"
done
ctl status >/dev/null 2>&1 && note "# a gpud still answers"
kill "$DBUS"
python3 - "$R" <<'PY' | tee -a "$R"
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"workload": {' in l]
def side(key, gpud):
    return [r["workload"][key] if key in r["workload"] else r[key] for r in runs if r["gpud"] == gpud]
print("# %d rounds; median (min-max) without gpud | with gpud | ratio of medians with/without" % len(side("ctx_s", "on")))
for key in ("ctx_s", "matmul_per_s", "alloc_per_s", "sync_per_s", "dd_ns_per_syscall"):
    off, on = side(key, "off"), side(key, "on")
    m0, m1 = statistics.median(off), statistics.median(on)
    print("# %-17s %10.4g (%.4g-%.4g) | %10.4g (%.4g-%.4g) | %.3f" % (key, m0, min(off), max(off), m1, min(on), max(on), m1 / m0))
runs[0]["workload"]  # fails loudly if no run produced a result
PY
