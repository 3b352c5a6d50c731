"""A steady CUDA workload for the real-GPU compute-share check (tests/gpu/compute-gpu.sh):
4096x4096 bf16 matrix products in a loop; every second prints one JSON line with the products
completed in that second, so throughput per cgroup can be compared."""
import json, os, sys, time

import torch

n = 4096
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
end = time.time() + float(os.environ.get("RUN_SECS", "60"))
tick, done = time.time(), 0
while time.time() < end:
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize()
    done += 10
    now = time.time()
    if now - tick >= 1.0:
        print(json.dumps({"t": round(now, 3), "pid": os.getpid(), "products_per_s": round(done / (now - tick), 1)}), flush=True)
        tick, done = now, 0
