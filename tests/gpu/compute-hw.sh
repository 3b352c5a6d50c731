#!/bin/sh
# Compute shares and priority classes under gpud on a real GPU, measured by the tenants' own
# progress (issue 29; docs/real-gpu.md, "Hardware controls"): tenants of tests/gpu/hw_tenant.cu
# in cgroups, two of each queue shape (sync: 10 kernels then a synchronize; deep: 1,024 kernels
# of 2 ms kept queued) under caps 30 / 70 and weights 1 : 3, then an LC tenant beside a
# deep-queue BE tenant with and without `priority` set through gpud. Run as root:
#
#   tests/gpu/compute-hw.sh CARRY_DIR OUT_DIR
#
# Output under OUT_DIR: report.txt, shares.json, lcbe.json, gpud.log, tenant-*.txt.
set -u
C=$1
OUT=$2
. "$(dirname "$0")/common.sh"
build_tenant || exit 1
start_bus
GPUD_LOG=${GPUD_LOG:-gpud=debug} start_compute_gpud
ctl status >"$OUT/status.txt" 2>&1
GPUDCTL="$C/gpudctl --bus-address $BUS" PYTHONUNBUFFERED=1 \
	python3 "$HERE/hw_controls.py" "$C" "$OUT" /tmp/hw_tenant shares lcbe 2>&1 | tee -a "$R"
kill -TERM $GPUD
wait $GPUD
kill $DBUS
grep -E "firmware|lever|GPU stops|no lever|cannot control" "$OUT/gpud.log" | head -20
