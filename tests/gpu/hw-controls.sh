#!/bin/sh
# Which channel-group control stops a tenant's queued GPU work, and what the priority classes'
# timeslices do for a latency-critical tenant beside a deep-queue one, judged by the tenants' own
# progress (issue 29; docs/real-gpu.md, "Hardware controls"). No gpud daemon: the controls go
# through gpud's own code path in gpud-hwcontrols. Run on a machine with an NVIDIA GPU, as root:
#
#   tests/gpu/hw-controls.sh CARRY_DIR OUT_DIR [controls|lcbe|all]
#
# CARRY_DIR as tests/gpu/prepare-carry.sh makes it (gpud-hwcontrols, the sniffer); the tenant
# (tests/gpu/hw_tenant.cu) is built here with nvcc. Output under OUT_DIR: report.txt (every
# summary line), hw-*.jsonl, nvml-*.jsonl, lcbe.json, tenant-*.txt, xid.txt.
set -u
C=$1
OUT=$2
. "$(dirname "$0")/common.sh"
build_tenant || exit 1
dmesg 2>/dev/null | grep -ci xid >/tmp/xid-before || echo 0 >/tmp/xid-before
PYTHONUNBUFFERED=1 python3 "$HERE/hw_controls.py" "$C" "$OUT" /tmp/hw_tenant "${3:-all}" 2>&1 | tee -a "$R"
{
	echo "Xid lines before: $(cat /tmp/xid-before)"
	echo "Xid lines after: $(dmesg 2>/dev/null | grep -ci xid)"
	dmesg 2>/dev/null | grep -i -A2 xid | tail -20
} >"$OUT/xid.txt"
cat "$OUT/xid.txt"
