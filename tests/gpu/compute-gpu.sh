#!/bin/sh
# Real-GPU check of compute shares (run on a machine with an NVIDIA GPU, as root):
#
#   tests/gpu/compute-gpu.sh CARRY_DIR OUT_DIR
#
# Two PyTorch matmul loops (tests/gpu/matmul_loop.py) in two cgroups share the GPU under gpud
# (real NVML, 100 ms samples, 100 ms period): unlimited, then compute_max 30 / 70, then weights
# 1 / 3. Per phase, OUT_DIR/report.txt gets NVML's SM utilization per cgroup and the controller's
# duty and target every second; loop-a/b.jsonl hold each loop's products per second.
set -u
C=$1
OUT=$2
. "$(dirname "$0")/common.sh"
start_bus
start_compute_gpud
mkdir -p "$CG/share-a" "$CG/share-b"
sh -c "echo \$\$ > $CG/share-a/cgroup.procs; RUN_SECS=62 exec python3 $HERE/matmul_loop.py" \
	>"$OUT/loop-a.jsonl" 2>&1 &
LA=$!
sh -c "echo \$\$ > $CG/share-b/cgroup.procs; RUN_SECS=62 exec python3 $HERE/matmul_loop.py" \
	>"$OUT/loop-b.jsonl" 2>&1 &
LB=$!
sleep 12
phase() { # $1 name, $2 seconds
	echo "== $1 $(date +%s)" >>"$R"
	for _ in $(seq "$2"); do
		ctl --json list | python3 -c '
import json, sys
row = []
for e in json.load(sys.stdin):
    if e.get("path", "").startswith("/share-"):
        n = e.get("nvml", {}).get("0", {})
        c = e.get("compute", {})
        row.append("%s sm=%s duty=%.0f target=%.0f" % (e["path"], n.get("sm_util"), c.get("duty", 100), c.get("target", 0)))
print(" | ".join(row))
' >>"$R"
		sleep 1
	done
}
phase unlimited 10
ctl set /share-a --gpu 0 --compute-max 30
ctl set /share-b --gpu 0 --compute-max 70
sleep 3
phase "caps 30/70" 15
ctl clear /share-a --gpu 0
ctl clear /share-b --gpu 0
ctl set /share-a --gpu 0 --compute-weight 1
ctl set /share-b --gpu 0 --compute-weight 3
sleep 3
phase "weights 1:3" 15
wait $LA $LB
kill -TERM $GPUD
wait $GPUD
kill $DBUS
echo "== end $(date +%s)" >>"$R"
cat "$R"
