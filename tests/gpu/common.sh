# Shared set-up of the real-GPU scripts, sourced once C (carry dir) and OUT (output dir) are set:
# the script's own folder (HERE), an empty OUT/report.txt (R), the carried libraries, the cgroup
# v2 root (CG), and a private bus (BUS, started by start_bus; DBUS its pid) with ctl = gpudctl on it.
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
R="$OUT/report.txt"
: >"$R"
export LD_LIBRARY_PATH="$C/lib"
CG=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
BUS="unix:path=/tmp/gpud-bus"
ctl() { "$C/gpudctl" --bus-address "$BUS" "$@"; }
start_bus() {
	sed "s#@SOCKET@#/tmp/gpud-bus#" "$C/private-bus.conf" >/tmp/bus.conf
	"$C/dbus-daemon" --config-file=/tmp/bus.conf --nofork --nopidfile >/dev/null 2>&1 &
	DBUS=$!
	sleep 1
}
# gpud on the private bus (start_bus first) set up as the compute scripts use it: 100 ms NVML
# samples and control periods, log filter GPUD_LOG (default gpud=info), its log in OUT/gpud.log,
# waited for until it answers; GPUD its pid.
start_compute_gpud() {
	cat >/tmp/gpud.toml <<CONF
[daemon]
state_dir = "/tmp/gpud-state-compute"
log = "${GPUD_LOG:-gpud=info}"
[dbus]
bus = "$BUS"
[nvml]
sample_interval_ms = 100
[compute]
period_ms = 100
CONF
	"$C/gpud" --config /tmp/gpud.toml >"$OUT/gpud.log" 2>&1 &
	GPUD=$!
	for _ in $(seq 50); do ctl status >/dev/null 2>&1 && break; sleep 0.2; done
}
# tests/gpu/hw_tenant.cu built for this GPU's architecture into /tmp/hw_tenant (with the host's
# own libraries, not the carried ones).
build_tenant() {
	ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
	env -u LD_LIBRARY_PATH nvcc -O2 -arch="sm_${ARCH:-90}" -o /tmp/hw_tenant "$HERE/hw_tenant.cu"
}
