"""Driver of tests/gpu/hw-controls.sh (run there as root, no gpud): which channel-group control
stops a tenant's queued GPU work, and what a priority class's timeslices do for a
latency-critical tenant, measured by the tenants' own progress (tests/gpu/hw_tenant.cu), not
NVML. Measurement tooling for docs/real-gpu.md, not part of gpud.

  python3 hw_controls.py CARRY_DIR OUT_DIR TENANT_BINARY [controls|lcbe|shares|all]...

controls: for a tenant of each queue shape (sync: 10 kernels then a synchronize; deep: about
1,024 kernels of ~2 ms kept queued), with a gated neighbour beside it, gpud-hwcontrols applies
each candidate through gpud's Controls (OUT/hw-<shape>.jsonl, bins in OUT/hw-<shape>/), while a
thread logs NVML's device utilization samples and per-process samples (OUT/nvml-<shape>.jsonl),
to check what the firmware probe can see.
lcbe: an LC tenant (Poisson requests of 3 kernels of ~1 ms at 30 % load, each synchronized) alone,
then beside a deep-queue BE tenant with the timeslices as CUDA sets them, then with LC's groups
at 16,384 µs and BE's at 128 µs (set through gpud's Controls), or, where gpud runs (GPUDCTL
names its gpudctl command line), in cgroups /lc and /be with `priority` latency-critical and
best-effort set through gpud: OUT/lcbe.json.
shares (gpud running, GPUDCTL set): two tenants of each queue shape in cgroups /share-a and
/share-b: unlimited, caps 30 / 70, weights 1 : 3; kernels per second per phase: OUT/shares.json.
Every kernel does the same work (ITERATIONS from one tenant calibrated alone at the start).
"""
import json, os, subprocess, sys, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nvsniff  # noqa: E402

C, OUT, TENANT = sys.argv[1], sys.argv[2], sys.argv[3]
WHAT = sys.argv[4:] or ["all"]
GPUDCTL = os.environ.get("GPUDCTL", "").split()
CG = next(l.split()[4] for l in open("/proc/self/mountinfo") if l.split(" - ")[1].startswith("cgroup2 "))
ITERATIONS = {}
os.makedirs(OUT, exist_ok=True)
TOOL = os.path.join(C, "gpud-hwcontrols")


def say(**kv):
    print(json.dumps(kv), flush=True)


class Proc:
    """A tenant under the ioctl sniffer; READY parsed from its output."""

    def __init__(self, name, mode, secs, arg=None, env=None, cgroup=None, kernel_ms=2):
        self.name = name
        self.log = f"/tmp/sniff-{name}.log"
        self.out = open(os.path.join(OUT, f"tenant-{name}.txt"), "w")
        e = dict(os.environ, NVSNIFF_OUT=self.log, LD_PRELOAD=os.path.join(C, "nv-ioctl-sniffer.so"))
        if kernel_ms in ITERATIONS:
            e["ITERATIONS"] = str(ITERATIONS[kernel_ms])
        e["KERNEL_MS"] = str(kernel_ms)
        e.update(env or {})
        args = [TENANT, mode, str(secs)] + ([str(arg)] if arg is not None else [])

        def join():
            if cgroup:
                os.makedirs(os.path.join(CG, cgroup.strip("/")), exist_ok=True)
                with open(os.path.join(CG, cgroup.strip("/"), "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        self.p = subprocess.Popen(args, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=join)
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


def latency(path, skip=3.0):
    """Percentiles of the request latencies, leaving out the first `skip` seconds (gpud finds a
    new tenant's channel groups within about a second and a half)."""
    rows = [tuple(map(float, l.split())) for l in open(path) if l.strip()]
    first = min((a for a, _ in rows), default=0)
    lat = sorted(x for a, x in rows if a >= first + skip)
    if not lat:
        return {}
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    return {"n": len(lat), "p50_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99), "mean_us": sum(lat) / len(lat)}


def calibrate():
    """Iterations per kernel of 2 ms and of 1 ms, timed alone."""
    for ms in (2, 1):
        p = Proc(f"calibrate-{ms}ms", "calibrate", 0, kernel_ms=ms).wait_ready()
        p.finish()
        ITERATIONS[ms] = int(p.ready["iterations"])
        ITERATIONS[f"{ms}_us"] = float(p.ready["kernel_us"])
    say(step="calibrate", iterations=ITERATIONS)


def ctl(*args):
    r = subprocess.run(GPUDCTL + list(args), capture_output=True, text=True, timeout=30)
    if r.returncode:
        say(step="gpudctl", args=args, rc=r.returncode, out=r.stdout + r.stderr)
    return r.stdout


def lcbe():
    res = {}
    lc_env = {"LC_LOAD": "0.3", "LC_KERNEL_US": str(ITERATIONS["1_us"])}

    def lc(name, cgroup=None):
        env = dict(lc_env, LC_OUT=os.path.join(OUT, f"{name}.txt"))
        return Proc(f"lc-{name}", "lc", 15, 3, env, cgroup=cgroup, kernel_ms=1).wait_ready()

    p = lc("solo")
    fin = p.finish()
    res["lc_solo"] = dict(latency(os.path.join(OUT, "solo.txt")), check=fin["check"])
    be = Proc("be-solo", "deep", 8, 1024).wait_ready()
    t0 = time.time()
    fin = be.finish()
    res["be_solo"] = {"kernels_per_s": be.rates(t0, time.time()), "check": fin["check"]}
    # Beside gpud, its scheduler guard would set a timeslice another process raises back to
    # the allowance: the timeslices are then gpud's own. LCBE_PHASES (e.g. "default gpud
    # gpud:16"): which, each with BE's kernels in that many waves of shorter blocks.
    kinds = os.environ.get("LCBE_PHASES", "default gpud" if GPUDCTL else "default timeslices").split()
    phases = []
    for k in kinds:
        kind, _, waves = k.partition(":")
        how = {"default": None, "gpud": "gpud", "timeslices": (16384, 128)}[kind]
        phases.append((f"lc_be_{kind}" + (f"_waves{waves}" if waves else ""), how, waves or "1"))
    for phase, how, waves in phases:
        cg = (None, None)
        if how == "gpud":
            cg = ("/lc", "/be")
            for c in cg:
                os.makedirs(os.path.join(CG, c.strip("/")), exist_ok=True)
            ctl("set", "/lc", "--gpu", "0", "--priority", "latency-critical")
            ctl("set", "/be", "--gpu", "0", "--priority", "best-effort")
        b = Proc(f"be-{phase}", "deep", 22, 1024, {"WAVES": waves}, cgroup=cg[1]).wait_ready()
        time.sleep(2 if how == "gpud" else 0)
        l = lc(phase, cgroup=cg[0])
        set_out = []
        if isinstance(how, tuple):
            for p, us in [(l, how[0]), (b, how[1])]:
                r = subprocess.run([TOOL, "timeslice", "--tenant", json.dumps(p.spec()), "--us", str(us)],
                                   capture_output=True, text=True, timeout=30)
                set_out.append((r.returncode, r.stdout.strip(), r.stderr.strip()))
        elif how == "gpud":
            time.sleep(1)
            set_out.append(ctl("--json", "list"))
        t0 = time.time()
        lfin = l.finish()
        t1 = time.time()
        if how == "gpud":
            set_out.append(ctl("--json", "list"))
        bfin = b.finish()
        res[phase] = dict(latency(os.path.join(OUT, f"{phase}.txt")), be_kernels_per_s=b.rates(t0, t1),
                          set=set_out, check=[lfin["check"], bfin["check"]])
        if how == "gpud":
            ctl("clear", "/lc", "--gpu", "0")
            ctl("clear", "/be", "--gpu", "0")
    solo = res["lc_solo"]
    busy = solo.get("n", 0) * 3 * ITERATIONS["1_us"] / 1e6 / (15 - 3)
    res["lc_busy_fraction"] = round(busy, 3)
    for phase, _, _ in phases:
        r = res[phase]
        if solo.get("p99_us") and r.get("p99_us"):
            r["p99_vs_solo"] = round(r["p99_us"] / solo["p99_us"], 2)
        if res["be_solo"]["kernels_per_s"] and r.get("be_kernels_per_s"):
            r["be_share_of_idle"] = round(r["be_kernels_per_s"] / res["be_solo"]["kernels_per_s"] / max(1e-9, 1 - busy), 3)
    with open(os.path.join(OUT, "lcbe.json"), "w") as f:
        json.dump(res, f, indent=1)
    say(step="lcbe", **res)


def shares():
    """Caps 30 / 70 and weights 1 : 3 under gpud, for each queue shape (SHAPES, default
    "deep sync"), SHARES_ROUNDS rounds of both (default 1)."""
    res = {}
    rounds = int(os.environ.get("SHARES_ROUNDS", "1"))
    policies = [("caps-30-70", ["--compute-max", "30"], ["--compute-max", "70"]),
                ("weights-1-3", ["--compute-weight", "1"], ["--compute-weight", "3"])]
    for shape in os.environ.get("SHAPES", "deep sync").split():
        arg = 1024 if shape == "deep" else None
        secs = 8 + 16 * 2 * rounds + 6
        a = Proc(f"share-a-{shape}", shape, secs, arg, cgroup="/share-a").wait_ready()
        b = Proc(f"share-b-{shape}", shape, secs, arg, cgroup="/share-b").wait_ready()
        start = time.time()
        time.sleep(8)
        phases = [("unlimited", start + 2, time.time())]
        for r in range(rounds):
            for name, la, lb in policies:
                ctl("clear", "/share-a", "--gpu", "0")
                ctl("clear", "/share-b", "--gpu", "0")
                ctl("set", "/share-a", "--gpu", "0", *la)
                ctl("set", "/share-b", "--gpu", "0", *lb)
                t0 = time.time()
                time.sleep(16)
                # The first 4 s of a phase are the law's settling (and the probe).
                phases.append((name if rounds == 1 else f"{name}-{r + 1}", t0 + 4, time.time()))
        listing = ctl("--json", "list")
        ctl("clear", "/share-a", "--gpu", "0")
        ctl("clear", "/share-b", "--gpu", "0")
        fa, fb = a.finish(), b.finish()
        out = {"check": [fa["check"], fb["check"]], "list": listing}
        for phase, t0, t1 in phases:
            ra, rb = a.rates(t0, t1), b.rates(t0, t1)
            out[phase] = {"a": ra, "b": rb, "a_pct": round(100 * ra / (ra + rb), 1) if ra and rb else None}
        res[shape] = out
        say(step=f"shares-{shape}", **{k: v for k, v in out.items() if k != "list"})
    with open(os.path.join(OUT, "shares.json"), "w") as f:
        json.dump(res, f, indent=1)


calibrate()
if {"controls", "all"} & set(WHAT):
    for shape in ["sync", "deep"]:
        try:
            controls(shape)
        except Exception as e:  # one shape failing must not lose the other's figures
            say(step=f"controls-{shape}", error=repr(e))
if {"shares", "all"} & set(WHAT) and GPUDCTL:
    try:
        shares()
    except Exception as e:
        say(step="shares", error=repr(e))
if {"lcbe", "all"} & set(WHAT):
    try:
        lcbe()
    except Exception as e:
        say(step="lcbe", error=repr(e))
