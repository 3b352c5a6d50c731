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
