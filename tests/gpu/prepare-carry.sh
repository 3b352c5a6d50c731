#!/bin/sh
# Builds what tests/gpu/real-gpu.sh needs on the GPU machine (which has no network and no
# dbus-daemon) into DIR: release gpud, gpudctl and gpud-hwcontrols, dbus-daemon with the shared libraries ldd
# names, the private-bus config, the ioctl sniffer and the write-user probe.
#
#   tests/gpu/prepare-carry.sh DIR
set -eu
D=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$D/lib"
(cd "$ROOT" && cargo build --release -p gpud --bins)
(cd "$ROOT" && cargo build --release -p gpud-tests --bin gpud-hwcontrols)
cp "$ROOT/target/release/gpud" "$ROOT/target/release/gpudctl" "$ROOT/target/release/gpud-hwcontrols" "$D/"
cp "$(command -v dbus-daemon)" "$D/"
ldd "$(command -v dbus-daemon)" "$D/gpud" "$D/gpud-hwcontrols" | awk '/=> \// { print $3 }' | sort -u | while read -r lib; do
	case "$(basename "$lib")" in libc.so.*|libm.so.*|ld-linux*) ;; *) cp -L "$lib" "$D/lib/" ;; esac
done
cp "$ROOT/tests/fixtures/private-bus.conf" "$D/"
gcc -O2 -shared -fPIC -Wall -o "$D/nv-ioctl-sniffer.so" "$ROOT/tests/gpu/nv-ioctl-sniffer.c" -ldl
gcc -O2 -Wall -o "$D/write-user-probe" "$ROOT/tests/gpu/write-user-probe.c"
