"""Helpers for test programs run under nv-ioctl-sniffer.so: marks in its log, RM controls issued
as the process's own CUDA client (nvsniff_control), and the objects a sniffer log shows
allocated. Measurement tooling for docs/real-gpu.md, not part of gpud."""
import ctypes, os, re

_lib = None


def _sniffer():
    """The preloaded sniffer (loaded on first use: allocations() needs none)."""
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(os.environ["LD_PRELOAD"])
        _lib.nvsniff_control.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32]
    return _lib

_ALLOC = re.compile(r"RM_ALLOC\d+ client=(0x[0-9a-f]+) parent=(0x[0-9a-f]+) new=(0x[0-9a-f]+) class=(0x[0-9a-f]+).*status=0(?:x0)?$")


def mark(what):
    _sniffer().nvsniff_mark(what.encode())


def control(client, obj, cmd, buf):
    """RM status of control `cmd` on (client, obj) with `buf` (a ctypes buffer) as params."""
    return _sniffer().nvsniff_control(client, obj, cmd, ctypes.addressof(buf), len(buf))


def allocations(path, pid=None):
    """(client, parent, handle, class) of every successful RM_ALLOC in a sniffer log."""
    out = []
    for line in open(path, errors="replace"):
        if pid is not None and not line.startswith(f"{pid} "):
            continue
        m = _ALLOC.search(line.rstrip("\n").split(" | ")[-1])
        if m:
            out.append(tuple(int(g, 16) for g in m.groups()))
    return out
