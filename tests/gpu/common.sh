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
# gpud on the private bus (start_bus first): state in /tmp/gpud-state, log filter GPUD_LOG
# (default gpud=info), and the TOML sections on standard input added to its configuration; its
# log in OUT/gpud.log; waited for until it answers. GPUD: its pid.
start_gpud() {
	{
		printf '[daemon]\nstate_dir = "/tmp/gpud-state"\nlog = "%s"\n[dbus]\nbus = "%s"\n' \
			"${GPUD_LOG:-gpud=info}" "$BUS"
		cat
	} >/tmp/gpud.toml
	"$C/gpud" --config /tmp/gpud.toml >"$OUT/gpud.log" 2>&1 &
	GPUD=$!
	for _ in $(seq 50); do ctl status >/dev/null 2>&1 && break; sleep 0.2; done
}
# start_gpud as the compute checks use it: 100 ms NVML samples and control periods.
start_compute_gpud() {
	start_gpud <<CONF
[nvml]
sample_interval_ms = 100
[compute]
period_ms = 100
CONF
}
# tests/gpu/hw_tenant.cu built for this GPU's architecture into /tmp/hw_tenant (with the host's
# own libraries, not the carried ones).
build_tenant() {
	ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
	env -u LD_LIBRARY_PATH nvcc -O2 -arch="sm_${ARCH:-90}" -o /tmp/hw_tenant "$HERE/hw_tenant.cu"
}
