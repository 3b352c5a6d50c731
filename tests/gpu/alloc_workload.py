"""A small CUDA workload for the real-GPU checks (tests/gpu/real-gpu.sh): allocates and frees
device memory through PyTorch's caching allocator and reports what PyTorch itself sees, so the
figures can be set beside NVML's and gpud's. Prints one JSON line per phase."""
import json, os, sys, time

import torch

def report(phase, **extra):
    torch.cuda.synchronize()
    print(json.dumps({"phase": phase, "pid": os.getpid(),
                      "reserved": torch.cuda.memory_reserved(),
                      "allocated": torch.cuda.memory_allocated(), **extra}), flush=True)

hold = float(os.environ.get("HOLD_SECS", "0"))
torch.cuda.init()
x = torch.zeros(1, device="cuda")
report("context")
a = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
report("alloc-256MiB")
try:
    b = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    report("alloc-1GiB")
except Exception as e:  # what CUDA/PyTorch report when gpud refuses the allocation
    report("alloc-1GiB-failed", error=f"{type(e).__name__}: {e}"[:600])
    b = None
if hold:
    print(json.dumps({"phase": "holding", "secs": hold}), flush=True)
    time.sleep(hold)
del b
torch.cuda.empty_cache()
report("free-1GiB")
del a
torch.cuda.empty_cache()
report("free-all")
