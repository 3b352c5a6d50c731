#!/bin/sh
# Real-GPU check of gpud (run on a machine with an NVIDIA GPU, as root; see docs/real-gpu.md).
#
#   tests/gpu/real-gpu.sh CARRY_DIR OUT_DIR
#
# CARRY_DIR holds what was built elsewhere (`tests/gpu/prepare-carry.sh` makes it): gpud,
# gpudctl, dbus-daemon with its libraries, and nv-ioctl-sniffer.so. The script starts a private
# bus and gpud with the default enforcement (auto tier, kill action), runs a PyTorch workload in
# a cgroup of its own, records what gpud, NVML (nvidia-smi) and PyTorch report, then sets a 1 GiB
# limit and runs the workload again to see what happens to the allocation that crosses it.
# Output: OUT_DIR/report.txt, gpud.log, sniff-*.log (every NVIDIA ioctl of the workloads).
set -u
C=$1
OUT=$2
. "$(dirname "$0")/common.sh"
DEMO="$CG/gpud-demo"
log() { echo "== $*" | tee -a "$R"; }

log "kernel $(uname -r), driver $(head -1 /proc/driver/nvidia/version)"
start_bus
GPUD_LOG=gpud=debug start_gpud </dev/null
ctl status >>"$R"

mkdir -p "$DEMO"
run_workload() { # $1: name, $2: hold seconds
	sh -c "echo \$\$ > $DEMO/cgroup.procs; HOLD_SECS=$2 NVSNIFF_OUT=$OUT/sniff-$1.log \
		LD_PRELOAD=$C/nv-ioctl-sniffer.so exec python3 $HERE/alloc_workload.py" \
		>"/tmp/workload-$1.txt" 2>&1 &
	WL=$!
}
wait_phase() { # $1: name, $2: phase
	for _ in $(seq 300); do grep -q "\"$2\"" "/tmp/workload-$1.txt" && return; sleep 0.1; done
}

log "workload without a limit"
run_workload free 8
wait_phase free holding
log "while holding 1.25 GiB: gpud (eBPF bytes per cgroup, and NVML's figures joined in)"
ctl --json get /gpud-demo >>"$R"
sleep 2
ctl --json list >>"$R"
ctl status >>"$R"
log "while holding: NVML (nvidia-smi) pid, used MiB"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits >>"$R"
log "while holding: control-file descriptors of the workload"
ls -l /proc/$WL/fd 2>/dev/null | grep -c nvidiactl >>"$R"
ls -l /proc/$WL/fd 2>/dev/null | grep nvidiactl | awk '{print $9}' | tr '\n' ' ' >>"$R"
echo >>"$R"
wait $WL
log "workload output (exit status $?)"
cat /tmp/workload-free.txt >>"$R"
sleep 1
log "after the workload exited: gpud"
ctl --json get /gpud-demo >>"$R"

log "workload with memory_max = 1 GiB"
ctl set /gpud-demo --memory-max 1Gi
run_workload limited 0
wait $WL
log "workload output (exit status $?)"
cat /tmp/workload-limited.txt >>"$R"
sleep 1
ctl --json get /gpud-demo >>"$R"
ctl --json status >>"$R"

kill -TERM $GPUD
wait $GPUD
kill $DBUS
rmdir "$DEMO" 2>/dev/null
cat "$R"
grep -E "WARN|ERROR|control file|limit" "$OUT/gpud.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -20
