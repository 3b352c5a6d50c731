"""What the GPU's firmware does with the channel-group scheduling controls a tenant may issue
(docs/real-gpu.md, "scheduler guard"). Run under nv-ioctl-sniffer.so while another CUDA process
(the victim, its sniffer log in VICTIM_LOG) runs tests/gpu/matmul_loop.py. Through the
sniffer's nvsniff_control this process issues, as its own CUDA client:
  1. GET_TIMESLICE on its channel groups, then SET_TIMESLICE of several values each read back;
  2. the same SET_TIMESLICE with bit 15 of the command set (the GSS-legacy path);
  3. FIFO_DISABLE_CHANNELS on its own subdevice naming the victim's channels, held 4 s, then
     re-enabled; the victim's products per second tell whether its work stopped.
Prints one JSON line per step (with wall-clock time, to set beside the victim's lines).
"""
import ctypes, json, os, struct, time

import torch

from nvsniff import allocations, control, mark


def say(step, **kv):
    print(json.dumps({"t": round(time.time(), 3), "step": step, **kv}), flush=True)


mark("context")
a = torch.randn(1024, 1024, device="cuda")
(a @ a).sum().item()
mine = allocations(os.environ["NVSNIFF_OUT"], os.getpid())
say("own-classes", classes=sorted({hex(c) for *_, c in mine}))
subdevs = [(c, h) for c, _, h, k in mine if k == 0x2080]
tsgs = [(c, h) for c, _, h, k in mine if k == 0xA06C]
say("own-objects", subdevices=[[hex(c), hex(h)] for c, h in subdevs], tsgs=[[hex(c), hex(h)] for c, h in tsgs])

ts = ctypes.create_string_buffer(8)
for c, h in tsgs[:8]:
    ts.raw = bytes(8)
    st = control(c, h, 0xA06C0104, ts)
    say("get-timeslice", tsg=hex(h), status=st, us=struct.unpack("<Q", ts.raw)[0])
if tsgs:
    c, h = tsgs[0]
    for want in [1024, 0, 1, 100, 2_000_000, 1 << 32, 1024]:
        ts.raw = struct.pack("<Q", want)
        mark(f"set-timeslice {want}")
        st = control(c, h, 0xA06C0103, ts)
        ts.raw = bytes(8)
        gst = control(c, h, 0xA06C0104, ts)
        say("set-timeslice", tsg=hex(h), asked=want, status=st, get_status=gst, now=struct.unpack("<Q", ts.raw)[0])
    ts.raw = struct.pack("<Q", 5000)
    mark("set-timeslice bit15")
    st = control(c, h, 0xA06C0103 | 0x8000, ts)
    ts.raw = bytes(8)
    gst = control(c, h, 0xA06C0104, ts)
    say("set-timeslice-bit15", asked=5000, status=st, now=struct.unpack("<Q", ts.raw)[0], get_status=gst)
    ts.raw = struct.pack("<Q", 1024)
    control(c, h, 0xA06C0103, ts)

victim = allocations(os.environ["VICTIM_LOG"])
say("victim-classes", classes=sorted({hex(k) for *_, k in victim}))
chans = [(c, h) for c, _, h, k in victim if (k & 0xFF) == 0x6F and k >= 0xC36F][:64]
say("victim-channels", n=len(chans), channels=[[hex(c), hex(h)] for c, h in chans])
if subdevs and chans:
    c, h = subdevs[0]
    p = ctypes.create_string_buffer(536)

    def disable(flag):
        p.raw = bytes(536)
        struct.pack_into("<BxxxI", p, 0, flag, len(chans))
        for i, (vc, vh) in enumerate(chans):
            struct.pack_into("<I", p, 24 + 4 * i, vc)
            struct.pack_into("<I", p, 280 + 4 * i, vh)
        return control(c, h, 0x2080110B, p)

    mark("disable-victim")
    say("disable-victim-channels", status=disable(1))
    time.sleep(4)
    mark("enable-victim")
    say("enable-victim-channels", status=disable(0))
    time.sleep(3)
say("done")
