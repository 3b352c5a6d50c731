"""What CUDA, PyTorch and NVML ask the driver when they report a GPU's memory size and free
memory (docs/real-gpu.md, "memory view"). Run under nv-ioctl-sniffer.so: each step writes a
MARK line into the sniffer's log before it runs, so the RM controls between two marks are that
step's. Prints one JSON line per step with what the API returned.

    MEMFACTS=cuda|torch|nvml python3 mem_facts.py
"""
import ctypes, json, os, sys

sniff = ctypes.CDLL(os.environ["LD_PRELOAD"]) if os.environ.get("LD_PRELOAD") else None


def mark(what):
    if sniff:
        sniff.nvsniff_mark(what.encode())


def say(step, **kv):
    print(json.dumps({"step": step, **kv}), flush=True)


what = os.environ.get("MEMFACTS", "cuda")
if what == "cuda":
    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    mark("cuInit")
    assert cu.cuInit(0) == 0
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    mark("cuDeviceTotalMem")
    cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
    say("cuDeviceTotalMem", total=total.value)
    mark("cuCtxCreate")
    assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    for i in range(3):
        mark(f"cuMemGetInfo-{i}")
        rc = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        say(f"cuMemGetInfo-{i}", rc=rc, free=free.value, total=total.value)
    ptr = ctypes.c_uint64()
    mark("cuMemAlloc-1GiB")
    rc = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30))
    say("cuMemAlloc-1GiB", rc=rc)
    mark("cuMemGetInfo-after-alloc")
    rc = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    say("cuMemGetInfo-after-alloc", rc=rc, free=free.value, total=total.value)
    mark("cuDeviceTotalMem-in-context")
    cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
    say("cuDeviceTotalMem-in-context", total=total.value)
    mark("end")
elif what == "torch":
    mark("torch-import")
    import torch
    mark("torch-init")
    torch.cuda.init()
    x = torch.zeros(1, device="cuda")
    for i in range(2):
        mark(f"mem_get_info-{i}")
        f, t = torch.cuda.mem_get_info()
        say(f"mem_get_info-{i}", free=f, total=t)
    mark("get_device_properties")
    say("get_device_properties", total_memory=torch.cuda.get_device_properties(0).total_memory)
    mark("end")
elif what == "nvml":
    import pynvml as n
    mark("nvmlInit")
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    mark("nvmlDeviceGetMemoryInfo-v1")
    m = n.nvmlDeviceGetMemoryInfo(h)
    say("nvmlDeviceGetMemoryInfo-v1", total=m.total, free=m.free, used=m.used)
    mark("nvmlDeviceGetMemoryInfo-v2")
    try:
        m = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        say("nvmlDeviceGetMemoryInfo-v2", total=m.total, free=m.free, used=m.used, reserved=m.reserved)
    except Exception as e:
        say("nvmlDeviceGetMemoryInfo-v2", error=str(e))
    mark("nvmlDeviceGetMemoryInfo-v1-again")
    m = n.nvmlDeviceGetMemoryInfo(h)
    say("nvmlDeviceGetMemoryInfo-v1-again", total=m.total, free=m.free, used=m.used)
    mark("end")
