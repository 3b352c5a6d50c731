#!/bin/sh
# Captures, on a machine with an NVIDIA GPU (as root), the driver facts that the memory view
# and the scheduler guard rest on (docs/real-gpu.md); needs no gpud:
#
#   tests/gpu/driver-facts.sh CARRY_DIR OUT_DIR
#
# CARRY_DIR holds nv-ioctl-sniffer.so and write-user-probe (tests/gpu/prepare-carry.sh builds
# both). Output: OUT_DIR/report.txt (what each API returned, JSON lines, and the sniffer's RM
# controls between the steps' marks) and OUT_DIR/logs.tar.gz (every sniffer log).
set -u
C=$1
OUT=$2
. "$(dirname "$0")/common.sh"
L=/tmp/facts
rm -rf "$L"
mkdir -p "$L"
log() { echo "== $*" | tee -a "$R"; }
sniffed() { # $1: log name, rest: command
	n=$1
	shift
	env NVSNIFF_OUT="$L/$n.log" LD_PRELOAD="$C/nv-ioctl-sniffer.so" "$@"
}
controls() { grep -E "MARK|RM_CONTROL|VID_HEAP|INJECTED" "$L/$1.log" | sed 's/ | RM_CONTROL[^|]*psize=[0-9]* | / | /' >>"$R"; }

log "kernel $(uname -r); $(head -1 /proc/driver/nvidia/version)"
mountpoint -q /sys/kernel/security || mount -t securityfs none /sys/kernel/security 2>/dev/null
log "lockdown: $(cat /sys/kernel/security/lockdown 2>&1); lsm: $(cat /sys/kernel/security/lsm 2>&1)"
"$C/write-user-probe" >>"$R" 2>&1
nvidia-smi >>"$R" 2>&1

for w in cuda torch nvml; do
	log "memory: $w"
	sniffed "mem-$w" env MEMFACTS=$w timeout 120 python3 "$HERE/mem_facts.py" >>"$R" 2>&1
	controls "mem-$w"
done
log "memory: the same with gpud's view rule applied in user space (limit 8 GiB, usage 1 GiB)"
for w in cuda torch nvml; do
	sniffed "view-$w" env NVSNIFF_VIEW=8589934592:1073741824 MEMFACTS=$w timeout 120 python3 "$HERE/mem_facts.py" >>"$R" 2>&1
done
sniffed view-smi env NVSNIFF_VIEW=8589934592:1073741824 nvidia-smi --query-gpu=memory.total,memory.free,memory.used,memory.reserved --format=csv >>"$R" 2>&1
log "memory: nvidia-smi --query-gpu"
sniffed mem-smi nvidia-smi --query-gpu=memory.total,memory.free,memory.used,memory.reserved --format=csv >>"$R" 2>&1
controls mem-smi
log "memory: nvidia-smi -q -d MEMORY"
sniffed mem-smi-q nvidia-smi -q -d MEMORY >>"$R" 2>&1
controls mem-smi-q

log "scheduler: victim matmul loop in cgroup facts-a, tenant in facts-b"
mkdir -p "$CG/facts-a" "$CG/facts-b"
sh -c "echo \$\$ > $CG/facts-a/cgroup.procs; RUN_SECS=24 NVSNIFF_OUT=$L/victim.log \
	LD_PRELOAD=$C/nv-ioctl-sniffer.so exec timeout 60 python3 $HERE/matmul_loop.py" >"$L/victim.jsonl" 2>&1 &
V=$!
sleep 6
log "nvidia-smi from inside cgroup facts-b while the victim runs"
sh -c "echo \$\$ > $CG/facts-b/cgroup.procs; exec nvidia-smi" >>"$R" 2>&1
sh -c "echo \$\$ > $CG/facts-b/cgroup.procs; exec nvidia-smi --query-compute-apps=pid,used_memory --format=csv" >>"$R" 2>&1
sh -c "echo \$\$ > $CG/facts-b/cgroup.procs; VICTIM_LOG=$L/victim.log NVSNIFF_OUT=$L/tenant.log \
	LD_PRELOAD=$C/nv-ioctl-sniffer.so PYTHONPATH=$HERE exec timeout 90 python3 $HERE/sched_facts.py" >>"$R" 2>&1
wait $V
log "victim products per second"
cat "$L/victim.jsonl" >>"$R"
log "scheduling controls the victim's libcuda issued"
grep -E "cmd=0x(a06c|a06f|c86f|906f|2080110|20801115|20800194)" "$L/victim.log" | sed 's/ | RM_CONTROL[^|]*psize=[0-9]* | / | /' >>"$R"
log "tenant's controls"
controls tenant

for mode in EPERM RMERR; do
	log "libcuda under $mode for SET_TIMESLICE (GPFIFO_SCHEDULE refused: 2026-11-27, CUDA fails)"
	sniffed "inject-$mode" env "NVSNIFF_$mode=a06c0103" \
		RUN_SECS=3 timeout 60 python3 "$HERE/matmul_loop.py" >>"$R" 2>&1
	echo "exit status $?" >>"$R"
	grep -c INJECTED "$L/inject-$mode.log" >>"$R"
	grep INJECTED "$L/inject-$mode.log" | head -5 >>"$R"
done
rmdir "$CG/facts-a" "$CG/facts-b" 2>/dev/null
tar -C /tmp -czf "$OUT/logs.tar.gz" facts
log "done"
