"""tests/gpu/matmul_loop.py that changes the timeslice of its own channel groups on a schedule
(TS_SCHEDULE="SECS:US,SECS:US,..."), with SET_TIMESLICE through its own CUDA client (run under
nv-ioctl-sniffer.so). Prints one JSON line per second with products per second and the
timeslice in force, so that two such loops show the split the GPU gives their timeslices."""
import ctypes, json, os, struct, time

import torch

import nvsniff

n = 4096
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
(a @ b).sum().item()
tsgs = [(c, h) for c, _, h, k in nvsniff.allocations(os.environ["NVSNIFF_OUT"], os.getpid()) if k == 0xA06C]
schedule = sorted((float(s), int(us)) for s, us in (p.split(":") for p in os.environ.get("TS_SCHEDULE", "").split(",") if p))
start = time.time()
end = start + float(os.environ.get("RUN_SECS", "60"))
buf = ctypes.create_string_buffer(8)
slice_us = None
tick, done = time.time(), 0
while time.time() < end:
    while schedule and time.time() - start >= schedule[0][0]:
        _, slice_us = schedule.pop(0)
        for c, h in tsgs:
            buf.raw = struct.pack("<Q", slice_us)
            st = nvsniff.control(c, h, 0xA06C0103, buf)
            if st:
                print(json.dumps({"set_timeslice_status": st, "tsg": hex(h)}), flush=True)
    for _ in range(10):
        c_ = a @ b
    torch.cuda.synchronize()
    done += 10
    now = time.time()
    if now - tick >= 1.0:
        print(json.dumps({"t": round(now, 3), "pid": os.getpid(), "products_per_s": round(done / (now - tick), 1), "timeslice_us": slice_us, "tsgs": len(tsgs)}), flush=True)
        tick, done = now, 0
