"""One measured round of the real-GPU overhead check (tests/gpu/overhead-gpu.sh). Prints one JSON
line with four figures, each from a fresh CUDA process so context creation is counted too:

- ctx_s: process start to the first tensor on the GPU (CUDA context creation: ~500 NVIDIA ioctls);
- matmul_per_s: 4096x4096 bf16 matrix products per second (kernel launches, almost no ioctls);
- alloc_per_s: 64 MiB allocate+free pairs per second with PyTorch's cache emptied after each, so
  every pair is a cudaMalloc/cudaFree (RM_ALLOC + UVM mapping + RM_FREE ioctls, all charged);
- sync_per_s: one-element kernel + synchronize round trips per second (launch latency).
"""
import json, os, time

T0 = time.monotonic()
import torch  # noqa: E402  (import time counts as start-up on purpose: it is what users wait for)

secs = float(os.environ.get("PHASE_SECS", "5"))


def rate(step, seconds):
    """Runs step() for `seconds` after a short warm-up; returns calls per second."""
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        step()
    torch.cuda.synchronize()
    n, start = 0, time.monotonic()
    end = start + seconds
    while time.monotonic() < end:
        step()
        n += 1
    torch.cuda.synchronize()
    return n / (time.monotonic() - start)


x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
ctx_s = time.monotonic() - T0

n = 4096
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)


def matmul():
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()


matmul_per_s = rate(matmul, secs) * 10


def alloc():
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del t
    torch.cuda.empty_cache()


alloc_per_s = rate(alloc, secs)


def sync():
    x.add_(1)
    torch.cuda.synchronize()


sync_per_s = rate(sync, secs)

print(json.dumps({"pid": os.getpid(), "ctx_s": round(ctx_s, 4), "matmul_per_s": round(matmul_per_s, 1),
                  "alloc_per_s": round(alloc_per_s, 1), "sync_per_s": round(sync_per_s, 1)}), flush=True)
