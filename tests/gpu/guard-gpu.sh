#!/bin/sh
# The scheduler guard on a real GPU (as root; docs/real-gpu.md, "The scheduler guard"):
#
#   tests/gpu/guard-gpu.sh CARRY_DIR OUT_DIR
#
# CARRY_DIR as tests/gpu/prepare-carry.sh makes it. Starts a private bus and gpud with the default
# guard (enforce), runs a CUDA matmul loop (the victim) in cgroup guard-a and, in cgroup guard-b,
# tests/gpu/sched_facts.py: from its own CUDA client it sets its channel group's timeslice to
# several values, each read back with GET_TIMESLICE (clamped to 2,048 µs where gpud may rewrite
# it), the same on the legacy path (bit 15), and disables the victim's channels for 4 s (refused
# where gpud may refuse or rewrite: the victim's products per second then do not fall). Where
# the kernel allows neither a pre-driver hook nor bpf_probe_write_user (tracepoints only under
# lockdown: the GPU cloud VMs), gpud reacts and restores: the timeslice is set back to the
# allowance right after the call and the victim's channels enabled again (its rate recovers within
# milliseconds); guard_react_action = "report" here so the tenant survives its foreign disable and
# the script goes on (the default "kill" would end it there). `SchedulerGuard`, the events
# (`restored`) and the metrics say so. Also checks that CUDA contexts come
# up under the guard (libcuda's own SET_TIMESLICE and GPFIFO_SCHEDULE at context creation).
# Output: OUT_DIR/report.txt (status, the tenant's JSON lines, the victim's rate, gpud's events
# and counters) and gpud.log.
set -u
C=$1
OUT=$2
. "$(dirname "$0")/common.sh"
log() { echo "== $*" | tee -a "$R"; }

log "kernel $(uname -r), driver $(head -1 /proc/driver/nvidia/version)"
mountpoint -q /sys/kernel/security || mount -t securityfs none /sys/kernel/security 2>/dev/null
log "lockdown: $(cat /sys/kernel/security/lockdown 2>&1); lsm: $(cat /sys/kernel/security/lsm 2>&1)"
start_bus
start_gpud <<CONF
[metrics]
listen = "127.0.0.1:9464"
[enforcement]
scheduler_guard = "enforce"
guard_react_action = "report"
CONF
ctl status >>"$R"
ctl events --json --type SchedulerControlGuarded >/tmp/guard-events.jsonl 2>&1 &
EV=$!

L=/tmp/guard
rm -rf "$L"
mkdir -p "$L" "$CG/guard-a" "$CG/guard-b"
log "victim matmul loop in guard-a, tenant in guard-b"
sh -c "echo \$\$ > $CG/guard-a/cgroup.procs; RUN_SECS=24 NVSNIFF_OUT=$L/victim.log \
	LD_PRELOAD=$C/nv-ioctl-sniffer.so exec timeout 60 python3 $HERE/matmul_loop.py" >"$L/victim.jsonl" 2>&1 &
V=$!
sleep 6
sh -c "echo \$\$ > $CG/guard-b/cgroup.procs; VICTIM_LOG=$L/victim.log NVSNIFF_OUT=$L/tenant.log \
	LD_PRELOAD=$C/nv-ioctl-sniffer.so PYTHONPATH=$HERE exec timeout 90 python3 $HERE/sched_facts.py" >>"$R" 2>&1
echo "tenant exit status $?" >>"$R"
wait $V
echo "victim exit status $?" >>"$R"
log "victim products per second"
cat "$L/victim.jsonl" >>"$R"
log "gpud's SchedulerControlGuarded signals"
kill $EV 2>/dev/null
cat /tmp/guard-events.jsonl >>"$R"
log "gpud's counters"
curl -s http://127.0.0.1:9464/metrics 2>/dev/null | grep -E "scheduler_guard|sched_guarded" >>"$R" ||
	ctl status --json | grep -E "sched_guarded|scheduler_guard" >>"$R"
log "gpud's log lines of the guard"
grep -E "scheduler guard|scheduling control" "$OUT/gpud.log" >>"$R"
kill $GPUD $DBUS 2>/dev/null
wait $GPUD 2>/dev/null
rmdir "$CG/guard-a" "$CG/guard-b" 2>/dev/null
log "done"
