"""Driver of tests/gpu/hw-controls.sh (run there as root, no gpud): which channel-group control
stops a tenant's queued GPU work, and what a priority class's timeslices do for a
latency-critical tenant, measured by the tenants' own progress (tests/gpu/hw_tenant.cu), not
NVML. Measurement tooling for docs/real-gpu.md, not part of gpud.

  python3 hw_controls.py CARRY_DIR OUT_DIR TENANT_BINARY [controls|lcbe|all]

controls: for a tenant of each queue shape (sync: 10 kernels then a synchronize; deep: about
1,024 kernels of ~2 ms kept queued), with a gated neighbour beside it, gpud-hwcontrols applies
each candidate through gpud's Controls (OUT/hw-<shape>.jsonl, bins in OUT/hw-<shape>/), while a
thread logs NVML's device utilization samples and per-process samples (OUT/nvml-<shape>.jsonl),
to check what the firmware probe can see.
lcbe: an LC tenant (Poisson requests of 3 kernels of ~1 ms at 30 % load, each synchronized) alone,
then beside a deep-queue BE tenant with the timeslices as CUDA sets them, then with LC's groups
at 16,384 µs and BE's at 128 µs (set through gpud's Controls): OUT/lcbe.json.
"""
import json, os, subprocess, sys, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nvsniff  # noqa: E402

C, OUT, TENANT = sys.argv[1], sys.argv[2], sys.argv[3]
WHAT = sys.argv[4] if len(sys.argv) > 4 else "all"
os.makedirs(OUT, exist_ok=True)
TOOL = os.path.join(C, "gpud-hwcontrols")


def say(**kv):
    print(json.dumps(kv), flush=True)


class Proc:
    """A tenant under the ioctl sniffer; READY parsed from its output."""

    def __init__(self, name, mode, secs, arg=None, env=None):
        self.name = name
        self.log = f"/tmp/sniff-{name}.log"
        self.out = open(os.path.join(OUT, f"tenant-{name}.txt"), "w")
        e = dict(os.environ, NVSNIFF_OUT=self.log, LD_PRELOAD=os.path.join(C, "nv-ioctl-sniffer.so"))
        e.update(env or {})
        args = [TENANT, mode, str(secs)] + ([str(arg)] if arg is not None else [])
        self.p = subprocess.Popen(args, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.ready = None
        self.lines = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.out.write(line)
            self.out.flush()
            self.lines.append(line.rstrip("\n"))
            if line.startswith("READY "):
                self.ready = dict(kv.split("=", 1) for kv in line.split()[1:])

    def wait_ready(self, timeout=60):
        end = time.time() + timeout
        while self.ready is None and time.time() < end and self.p.poll() is None:
            time.sleep(0.05)
        if self.ready is None:
            raise RuntimeError(f"{self.name} never got ready: {self.lines[-5:]}")
        return self

    def spec(self):
        pid = self.p.pid
        objs = nvsniff.allocations(self.log, pid)
        groups = {}
        for c, _, h, k in objs:
            if k == 0xA06C:
                groups.setdefault(c, []).append(h)
        client = max(groups, key=lambda c: len(groups[c]))
        chans = [h for c, _, h, k in objs if c == client and (k & 0xFF) == 0x6F and k >= 0xC36F]
        subdev = [h for c, _, h, k in objs if c == client and k == 0x2080]
        return {
            "pid": pid,
            "progress": int(self.ready["progress"], 16),
            "gate": int(self.ready["gate"], 16),
            "client": client,
            "subdevice": subdev[0],
            "groups": groups[client],
            "channels": chans,
        }

    def finish(self, timeout=120):
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.t.join(5)
        check = [l for l in self.lines if l.startswith(("CHECK", "CUDA_ERROR"))]
        return {"name": self.name, "rc": self.p.returncode, "check": check, "ready": self.ready}

    def rates(self, t0, t1):
        """Mean kernels per second over its per-second lines inside [t0, t1]."""
        v = []
        for l in self.lines:
            if l.startswith("{"):
                d = json.loads(l)
                if t0 + 1 <= d["t"] <= t1:
                    v.append(d["kernels_per_s"])
        return sum(v) / len(v) if v else None


class NvmlLog:
    """NVML's device utilization samples and per-process samples, with their timestamps."""

    def __init__(self, path):
        self.f = open(path, "w")
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        try:
            import pynvml as n
        except ImportError as e:
            self.f.write(json.dumps({"error": str(e)}) + "\n")
            return
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        last_dev = last_proc = 0
        while not self.stop:
            rec = {"t": round(time.time(), 3)}
            try:
                _, samples = n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, last_dev)
                rec["dev"] = [[s.timeStamp, s.sampleValue.uiVal] for s in samples if s.timeStamp > last_dev]
                if samples:
                    last_dev = max(last_dev, max(s.timeStamp for s in samples))
            except n.NVMLError as e:
                rec["dev_error"] = str(e)
            try:
                procs = n.nvmlDeviceGetProcessUtilization(h, last_proc)
                rec["proc"] = [[p.pid, p.timeStamp, p.smUtil] for p in procs]
                if procs:
                    last_proc = max(last_proc, max(p.timeStamp for p in procs))
            except n.NVMLError as e:
                rec["proc_error"] = str(e)
            rec["clock_us"] = int(time.time() * 1e6)
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
            time.sleep(0.05)

    def close(self):
        self.stop = True
        self.t.join(5)
        self.f.close()


def controls(shape):
    arg = 1024 if shape == "deep" else None
    nv = NvmlLog(os.path.join(OUT, f"nvml-{shape}.jsonl"))
    t = Proc(f"{shape}-tenant", shape, 25, arg).wait_ready()
    n = Proc(f"{shape}-neighbour", "gated", 40).wait_ready()
    time.sleep(2)
    ts, ns = t.spec(), n.spec()
    say(step=f"controls-{shape}", tenant=ts, neighbour=ns)
    r = subprocess.run([TOOL, "sequence", "--tenant", json.dumps(ts), "--neighbour", json.dumps(ns),
                        "--out", os.path.join(OUT, f"hw-{shape}")], capture_output=True, text=True, timeout=120)
    with open(os.path.join(OUT, f"hw-{shape}.jsonl"), "w") as f:
        f.write(r.stdout + r.stderr)
    print(r.stdout + r.stderr, flush=True)
    say(step=f"controls-{shape}-end", tenant=t.finish(), neighbour=n.finish())
    nv.close()


def latency(path):
    lat = sorted(float(l.split()[1]) for l in open(path) if l.strip())
    if not lat:
        return {}
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    return {"n": len(lat), "p50_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99), "mean_us": sum(lat) / len(lat)}


def lcbe():
    res = {}
    lc_env = {"KERNEL_MS": "1", "LC_LOAD": "0.3"}
    env = dict(lc_env, LC_OUT=os.path.join(OUT, "lc-solo.txt"))
    lc = Proc("lc-solo", "lc", 15, 3, env).wait_ready()
    fin = lc.finish()
    kernel_us = float(lc.ready["kernel_us"])
    res["lc_solo"] = dict(latency(os.path.join(OUT, "lc-solo.txt")), kernel_us=kernel_us, check=fin["check"])
    be = Proc("be-solo", "deep", 8, 1024).wait_ready()
    t0 = time.time()
    fin = be.finish()
    res["be_solo"] = {"kernels_per_s": be.rates(t0, time.time()), "check": fin["check"]}
    for phase, ts in [("lc_be_default", None), ("lc_be_timeslices", (16384, 128))]:
        be = Proc(f"be-{phase}", "deep", 22, 1024).wait_ready()
        env = dict(lc_env, LC_OUT=os.path.join(OUT, f"{phase}.txt"))
        lc = Proc(f"lc-{phase}", "lc", 15, 3, env).wait_ready()
        set_out = []
        if ts:
            for p, us in [(lc, ts[0]), (be, ts[1])]:
                r = subprocess.run([TOOL, "timeslice", "--tenant", json.dumps(p.spec()), "--us", str(us)],
                                   capture_output=True, text=True, timeout=30)
                set_out.append((r.returncode, r.stdout.strip(), r.stderr.strip()))
        t0 = time.time()
        lfin = lc.finish()
        t1 = time.time()
        bfin = be.finish()
        res[phase] = dict(latency(os.path.join(OUT, f"{phase}.txt")), be_kernels_per_s=be.rates(t0, t1),
                          set=set_out, check=[lfin["check"], bfin["check"]])
    solo = res["lc_solo"]
    busy = solo.get("n", 0) * 3 * kernel_us / 1e6 / 15
    res["lc_busy_fraction"] = busy
    for phase in ["lc_be_default", "lc_be_timeslices"]:
        r = res[phase]
        if solo.get("p99_us") and r.get("p99_us"):
            r["p99_vs_solo"] = round(r["p99_us"] / solo["p99_us"], 2)
        if res["be_solo"]["kernels_per_s"] and r.get("be_kernels_per_s"):
            r["be_share_of_idle"] = round(r["be_kernels_per_s"] / res["be_solo"]["kernels_per_s"] / max(1e-9, 1 - busy), 3)
    with open(os.path.join(OUT, "lcbe.json"), "w") as f:
        json.dump(res, f, indent=1)
    say(step="lcbe", **res)


if WHAT in ("controls", "all"):
    for shape in ["sync", "deep"]:
        try:
            controls(shape)
        except Exception as e:  # one shape failing must not lose the other's figures
            say(step=f"controls-{shape}", error=repr(e))
if WHAT in ("lcbe", "all"):
    try:
        lcbe()
    except Exception as e:
        say(step="lcbe", error=repr(e))
