#!/bin/sh
# What share of a GPU two saturating CUDA processes get for their channel groups' timeslices,
# set by each process itself (SET_TIMESLICE needs no privilege): the control law's lever, and
# what a tenant gains by raising its own (docs/real-gpu.md). No gpud; run as root:
#
#   tests/gpu/timeslice-split.sh CARRY_DIR OUT_DIR
#
# Phases of 15 s after a 10 s warm-up: a 3,000 / b 1,000 µs; 8,000 / 500; 1,000,000 / 1,024
# (a tenant's 1 s against the default). Output: OUT_DIR/loop-a.jsonl, loop-b.jsonl.
set -u
C=$1
OUT=$2
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
run() { # $1 name, $2 schedule
	NVSNIFF_OUT="/tmp/ts-$1.log" LD_PRELOAD="$C/nv-ioctl-sniffer.so" PYTHONPATH="$HERE" \
		TS_SCHEDULE="$2" RUN_SECS=58 timeout 120 python3 "$HERE/timeslice_loop.py" >"$OUT/loop-$1.jsonl" 2>&1 &
}
run a "10:3000,25:8000,40:1000000"
A=$!
run b "10:1000,25:500,40:1024"
B=$!
wait $A $B
