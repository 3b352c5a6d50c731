//! Benchmark: gpud at scale, end to end. Drives the real `gpud` binary (next to this one, so a
//! `--release` build measures the release daemon) on a private dbus-daemon with real cgroups and
//! processes issuing ioctls on a stand-in device file (listed in `devices.extra_paths`; the probes
//! count them exactly as on `/dev/nvidiactl`, without a driver behind them), and prints one
//! `BENCH JSON: {…}` line with:
//!
//! - `idle`: daemon CPU (percent of one core) and RSS/HWM after settling, nothing happening;
//! - `attribution_us`: a new process in a new cgroup issues its first ioctl; from reading its
//!   "done" line (written right after the ioctl returned) to the cgroup's ioctl showing in
//!   `GetCgroup` (polled back to back);
//! - `limit_change_us`: from calling `SetLimits` to the value being in the kernel's pinned
//!   `LIMITS` map (what the probes enforce), polled back to back;
//! - `dbus_us`: with `--cgroups` attributed cgroups (each with a live process) and `--clients`
//!   concurrent connections calling `ListCgroups`, `GetCgroup`, `ListLimits` and a property `Get`
//!   in turn for `--seconds`, back to back: per-method p50/p99/max and calls/s (throughput; with
//!   many clients the latency is mostly queueing behind the others);
//! - `dbus_paced_us`: the same clients and mix, each calling once every `--pace-ms` (1,000 by
//!   default: 100 monitoring agents polling once a second), starts spread over the period;
//!   Each D-Bus run also says where the CPU went (`cpu_percent`: daemon, bus daemon, clients);
//! - `bus_ceiling_us`: the back-to-back run against a service on the same bus, in a process of
//!   its own, that replays gpud's replies from memory: what the bus daemon and the clients allow
//!   here without gpud's work;
//! - `list_cgroups_parts_us`: one client, `ListCgroups` 200 times in a row: the round trip to the
//!   reply's arrival, and the client's decoding of it, apart;
//! - `targets`: each goal with its limit, the figure and whether it is met;
//! - `load`: daemon CPU and RSS while those processes issue about `--rate` matched ioctls/s spread
//!   over all cgroups (achieved rate from the kernel's own counter);
//! - `events`: ring-buffer events (process fork/exit of tracked processes) consumed per second
//!   with none lost, and the same burst with the daemon stopped (SIGSTOP): the ring fills, the
//!   kernel counts the loss (`events_lost`), and the daemon reports it once resumed.
//!
//! `gpud-scalebench [--cgroups N] [--clients N] [--trials N] [--seconds S] [--rate R]
//! [--pace-ms MS] [--ring-kib KIB]` (`--ring-kib`: the daemon's `probes.events_ring_kib`;
//! `--help` lists the defaults). (`gpud-scalebench forker FILE N` is its own event generator.)

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use gpud_api::BUS_NAME;
use gpud_tests::{Cgroup, Manager1Proxy, Rig, connect_builder};
use serde_json::{Value, json};

/// RM_ALLOC as CUDA encodes it: a matched, classified ioctl.
const RM_ALLOC: &str = "0xc030462b";

/// gpud at scale, end to end; prints one `BENCH JSON: {…}` line (see the module docs).
#[derive(Parser)]
#[command(name = "gpud-scalebench")]
struct Opts {
    /// Attributed cgroups, each with a live process.
    #[arg(long, default_value_t = 1000)]
    cgroups: usize,
    /// Concurrent D-Bus clients.
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Attribution-latency trials.
    #[arg(long, default_value_t = 200)]
    trials: usize,
    /// Length of each measured phase.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Matched ioctls per second under load.
    #[arg(long, default_value_t = 10_000)]
    rate: u64,
    /// Each paced client's period (0 counts as 1).
    #[arg(long, default_value_t = 1000)]
    pace_ms: u64,
    /// The daemon's `probes.events_ring_kib`.
    #[arg(long, default_value_t = u64::from(gpud_common::EVENTS_BYTES / 1024))]
    ring_kib: u64,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(Subcommand)]
enum Sub {
    /// Its own event generator (see [`forker`]).
    #[command(hide = true)]
    Forker { file: String, n: u64 },
    /// The replaying service of [`bus_ceiling`], in a process of its own.
    #[command(hide = true)]
    Replay { bus: String, path: String },
}

/// p50, p99, max of microsecond samples.
fn dist(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return json!(null);
    }
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    json!({"n": v.len(), "p50": q(0.5), "p99": q(0.99), "max": v[v.len() - 1]})
}

/// CPU time (user + system, seconds) and RSS/HWM (KiB) of `pid`.
fn usage(pid: u32) -> anyhow::Result<(f64, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces) closing parenthesis.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = (f.get(11).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0))
        // SAFETY: sysconf has no preconditions.
        / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Ok((ticks, kib("VmRSS:"), kib("VmHWM:")))
}

/// Daemon CPU (percent of one core) over `window`, and its RSS/HWM at the end.
fn cpu_over(pid: u32, window: Duration) -> anyhow::Result<Value> {
    let (c0, _, _) = usage(pid)?;
    let t = Instant::now();
    std::thread::sleep(window);
    let (c1, rss, hwm) = usage(pid)?;
    Ok(json!({
        "cpu_percent": (c1 - c0) / t.elapsed().as_secs_f64() * 100.0,
        "rss_kib": rss, "hwm_kib": hwm, "window_s": window.as_secs_f64(),
    }))
}

/// The goals (issue "performance at scale"), each with its limit, the figure measured and
/// whether it is met, so that a script can check a run: `{name: {limit, measured, met}}`.
/// Latencies in µs, throughput in calls/s, memory in KiB.
fn targets(report: &serde_json::Map<String, Value>) -> Value {
    let at = |path: &[&str]| -> Option<f64> {
        let mut v = report.get(path[0])?;
        for k in &path[1..] {
            v = v.get(k)?;
        }
        v.as_f64()
    };
    // (name, figure, limit, at most (true) or at least)
    let goals: [(&str, &[&str], f64, bool); 11] = [
        (
            "dbus_calls_per_s",
            &["dbus_us", "calls_per_s"],
            10_000.0,
            false,
        ),
        (
            "dbus_GetCgroup_p99_us",
            &["dbus_us", "GetCgroup", "p99"],
            5_000.0,
            true,
        ),
        (
            "dbus_Get_p99_us",
            &["dbus_us", "Get(Version)", "p99"],
            2_000.0,
            true,
        ),
        (
            "dbus_ListCgroups_p99_us",
            &["dbus_us", "ListCgroups", "p99"],
            50_000.0,
            true,
        ),
        (
            "paced_ListCgroups_p99_us",
            &["dbus_paced_us", "ListCgroups", "p99"],
            3_000.0,
            true,
        ),
        (
            "paced_GetCgroup_p99_us",
            &["dbus_paced_us", "GetCgroup", "p99"],
            5_000.0,
            true,
        ),
        (
            "attribution_p99_us",
            &["attribution_us", "p99"],
            860.0,
            true,
        ),
        (
            "limit_change_p99_us",
            &["limit_change_us", "p99"],
            1_050.0,
            true,
        ),
        ("load_hwm_kib", &["load", "hwm_kib"], 64.0 * 1024.0, true),
        ("idle_rss_kib", &["idle", "rss_kib"], 16.0 * 1024.0, true),
        (
            "events_lost_running",
            &["events", "lost_running"],
            0.0,
            true,
        ),
    ];
    let mut out = serde_json::Map::new();
    for (name, path, limit, at_most) in goals {
        let measured = at(path);
        let met = measured.is_some_and(|m| if at_most { m <= limit } else { m >= limit });
        out.insert(
            name.into(),
            json!({"limit": limit, "at_most": at_most, "measured": measured, "met": met}),
        );
    }
    Value::Object(out)
}

/// A service on the same bus that answers the bench's four calls with replies it holds ready
/// (the very records gpud returned), doing nothing else.
struct Replay {
    cgroups: Arc<Vec<gpud_api::CgroupRecord>>,
    one: gpud_api::CgroupRecord,
    limits: Arc<Vec<gpud_api::LimitRecord>>,
}

#[zbus::interface(name = "dev.gpud.Manager1")]
impl Replay {
    #[zbus(property)]
    async fn version(&self) -> String {
        "replay".into()
    }

    async fn list_cgroups(&self) -> Arc<Vec<gpud_api::CgroupRecord>> {
        self.cgroups.clone()
    }

    async fn get_cgroup(&self, _path: &str) -> gpud_api::CgroupRecord {
        self.one.clone()
    }

    async fn list_limits(&self) -> Arc<Vec<gpud_api::LimitRecord>> {
        self.limits.clone()
    }
}

/// The name [`bus_ceiling`]'s replaying service owns.
const REPLAY_NAME: &str = "dev.gpud.ScalebenchReplay";

/// The replaying service: takes gpud's replies once, serves them until killed ("READY" on
/// stdout once it owns its name).
async fn replay(bus: &str, path: &str) -> anyhow::Result<()> {
    let gpud = connect_builder(bus).build().await?;
    let proxy = Manager1Proxy::new(&gpud).await?;
    let service = Replay {
        cgroups: Arc::new(proxy.list_cgroups().await?),
        one: proxy.get_cgroup(path).await?,
        limits: Arc::new(proxy.list_limits().await?),
    };
    let _service = connect_builder(bus)
        .name(REPLAY_NAME)
        .serve_at(gpud_api::OBJECT_PATH, service)
        .build()
        .await?;
    println!("READY");
    std::future::pending::<()>().await;
    Ok(())
}

/// The same clients and mix back to back against [`Replay`] in a process of its own: what the
/// bus daemon and the clients allow on this machine with gpud's work taken away (the ceiling
/// for `dbus_us`). `cpu_percent.daemon` is the replaying process's.
async fn bus_ceiling(bus: &str, bus_pid: u32, paths: &[String], o: &Opts) -> anyhow::Result<Value> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["replay", bus, &paths[0]])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("replay stdout")?).read_line(&mut line)?;
    if line.trim() != "READY" {
        let _ = child.kill();
        bail!("the replaying service did not start: {line:?}");
    }
    let cpu = CpuSplit::start(child.id(), bus_pid)?;
    let run = dbus_clients(bus, REPLAY_NAME, paths, o.clients, o.seconds, None).await;
    let cpu = cpu.end();
    let _ = child.kill();
    let _ = child.wait();
    let mut out = run?;
    out["cpu_percent"] = cpu?;
    Ok(out)
}

/// One client calling `ListCgroups` 200 times in a row, nothing else running: the round trip
/// up to the reply's arrival (the daemon's work, the bus daemon's copy and checks, both sockets)
/// apart from the client's decoding of the reply into records, which is the client's own cost.
async fn listing_parts(conn: &zbus::Connection) -> anyhow::Result<Value> {
    let (mut trip, mut decode) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    for _ in 0..200 {
        let t = Instant::now();
        let reply = conn
            .call_method(
                Some(gpud_api::BUS_NAME),
                gpud_api::OBJECT_PATH,
                Some(gpud_api::MANAGER_INTERFACE),
                "ListCgroups",
                &(),
            )
            .await?;
        trip.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let records: Vec<gpud_api::CgroupRecord> = reply.body().deserialize()?;
        decode.push(t.elapsed().as_secs_f64() * 1e6);
        bytes = reply.data().len();
        std::hint::black_box(records);
    }
    Ok(json!({"round_trip": dist(trip), "client_decode": dist(decode), "reply_bytes": bytes}))
}

/// Where the CPU went during a D-Bus run (percent of one core each): the daemon, the bus daemon,
/// and this process (the clients: their calls, replies' deserialization, bookkeeping). The
/// machine's total is 100 per CPU; what is left of it was idle or other processes'.
struct CpuSplit {
    pids: [(&'static str, u32); 3],
    start: [f64; 3],
    at: Instant,
}

impl CpuSplit {
    fn start(daemon: u32, bus: u32) -> anyhow::Result<Self> {
        let pids = [
            ("daemon", daemon),
            ("bus", bus),
            ("clients", std::process::id()),
        ];
        let mut start = [0.0; 3];
        for (i, (_, pid)) in pids.iter().enumerate() {
            start[i] = usage(*pid)?.0;
        }
        Ok(Self {
            pids,
            start,
            at: Instant::now(),
        })
    }

    fn end(self) -> anyhow::Result<Value> {
        let secs = self.at.elapsed().as_secs_f64();
        let mut out = serde_json::Map::new();
        for (i, (name, pid)) in self.pids.iter().enumerate() {
            let used = usage(*pid)?.0 - self.start[i];
            out.insert((*name).into(), json!(used / secs * 100.0));
        }
        Ok(Value::Object(out))
    }
}

/// A held `gpud-ioctl` in a cgroup; each line written to it re-issues its ioctls.
struct Holder {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<std::process::ChildStdout>,
}

impl Holder {
    fn spawn(cg: &Path, file: &Path, per_line: u64) -> anyhow::Result<Self> {
        let mut child = Command::new(exe_dir().join("gpud-ioctl"))
            .arg("--cgroup")
            .arg(cg)
            .arg("--file")
            .arg(file)
            .args(["--ioctl", &format!("{RM_ALLOC}:{per_line}"), "--hold"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("spawn gpud-ioctl")?;
        let stdin = child.stdin.take().context("stdin")?;
        let out = BufReader::new(child.stdout.take().context("stdout")?);
        let mut h = Self { child, stdin, out };
        h.done()?;
        Ok(h)
    }

    /// Waits for its `DONE` line.
    fn done(&mut self) -> anyhow::Result<()> {
        let mut line = String::new();
        self.out.read_line(&mut line)?;
        if !line.starts_with("DONE") {
            bail!("gpud-ioctl said {line:?}");
        }
        Ok(())
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The directory of this binary, where cargo put the daemon and the fixtures of the same build.
fn exe_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_default()
}

fn pinned_limit(bpffs: &Path, cgroup_id: u64) -> Option<u64> {
    use libbpf_rs::MapCore as _;
    let path = bpffs
        .join("gpud")
        .join(format!("v{}", gpud_common::ABI_VERSION))
        .join(gpud_common::maps::LIMITS);
    let map = libbpf_rs::MapHandle::from_pinned_path(path).ok()?;
    let key = gpud_common::UsageKey {
        cgroup_id,
        gpu: gpud_common::GPU_ALL,
        ..Default::default()
    };
    // SAFETY: UsageKey is repr(C) plain data; the slice covers exactly its bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&key as *const gpud_common::UsageKey).cast::<u8>(),
            size_of::<gpud_common::UsageKey>(),
        )
    };
    let v = map.lookup(bytes, libbpf_rs::MapFlags::ANY).ok()??;
    (v.len() >= size_of::<gpud_common::KernelLimit>()).then(|| {
        // SAFETY: the length was checked; KernelLimit is plain data.
        unsafe { std::ptr::read_unaligned(v.as_ptr().cast::<gpud_common::KernelLimit>()) }.max
    })
}

fn cgroup_id(dir: &Path) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    Ok(std::fs::metadata(dir)?.ino())
}

/// `forker FILE N`: opens FILE (a tracked device file), issues one ioctl, then forks N children
/// that exit at once (a PROC_NEW and a PROC_EXIT event each); prints the seconds it took.
fn forker(file: &str, n: u64) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd as _;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)?;
    let mut buf = [0u8; 48];
    // SAFETY: ioctl on our own descriptor with a buffer of the size the command encodes.
    unsafe { libc::ioctl(f.as_raw_fd(), 0xc030462b_u32 as _, buf.as_mut_ptr()) };
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: the child only calls _exit, which is async-signal-safe.
        match unsafe { libc::fork() } {
            0 => unsafe { libc::_exit(0) },
            pid if pid > 0 => {
                let mut status = 0;
                // SAFETY: reaping our own child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
            }
            _ => bail!("fork failed: {}", std::io::Error::last_os_error()),
        }
    }
    println!("{}", t.elapsed().as_secs_f64());
    Ok(())
}

fn run_forker(cg: &Path, file: &Path, n: u64) -> anyhow::Result<f64> {
    let me = std::env::current_exe()?;
    let cg = cg.to_owned();
    let mut cmd = Command::new(me);
    cmd.arg("forker").arg(file).arg(n.to_string());
    // SAFETY: only writes its own pid into cgroup.procs between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt as _;
        cmd.pre_exec(move || std::fs::write(cg.join("cgroup.procs"), "0"));
    }
    let out = cmd.output()?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("forker output")
}

async fn stats(p: &Manager1Proxy<'_>) -> anyhow::Result<BTreeMap<String, u64>> {
    Ok(p.get_kernel_stats().await?)
}

/// `clients` connections calling `ListCgroups`, `GetCgroup`, `ListLimits` and a property `Get`
/// in turn for `seconds`: back to back (`pace` None: the daemon's and bus's throughput, latency
/// is then queueing behind the other clients), or each once per `pace`, starts spread over one
/// period (latency at a stated load). Per-method p50/p99/max in µs and the calls per second.
async fn dbus_clients(
    bus: &str,
    service: &'static str,
    paths: &[String],
    clients: usize,
    seconds: u64,
    pace: Option<Duration>,
) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let bus = bus.to_owned();
        let paths = paths.to_vec();
        tasks.push(tokio::spawn(async move {
            let conn = connect_builder(&bus).build().await?;
            let p = Manager1Proxy::builder(&conn)
                .destination(service)
                .cache_properties(zbus::proxy::CacheProperties::No)
                .build()
                .await?;
            let mut tick = pace.map(|period| {
                let offset = period.mul_f64(c as f64 / clients as f64);
                let mut t = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                t
            });
            let mut lat: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
            let mut k = c;
            while Instant::now() < deadline {
                if let Some(t) = tick.as_mut() {
                    t.tick().await;
                }
                let t = Instant::now();
                let name = match k % 4 {
                    0 => {
                        p.list_cgroups().await?;
                        "ListCgroups"
                    }
                    1 => {
                        p.get_cgroup(&paths[k % paths.len()]).await?;
                        "GetCgroup"
                    }
                    2 => {
                        p.list_limits().await?;
                        "ListLimits"
                    }
                    _ => {
                        p.version().await?;
                        "Get(Version)"
                    }
                };
                lat.entry(name)
                    .or_default()
                    .push(t.elapsed().as_secs_f64() * 1e6);
                k += 1;
            }
            anyhow::Ok(lat)
        }));
    }
    let mut all: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for t in tasks {
        for (k, v) in t.await?? {
            all.entry(k).or_default().extend(v);
        }
    }
    let calls: usize = all.values().map(Vec::len).sum();
    let mut out = serde_json::Map::new();
    out.insert(
        "all".into(),
        dist(all.values().flatten().copied().collect()),
    );
    for (k, v) in all {
        out.insert(k.into(), dist(v));
    }
    out.insert("calls_per_s".into(), json!(calls as f64 / seconds as f64));
    Ok(Value::Object(out))
}

fn main() -> anyhow::Result<()> {
    let mut o = Opts::parse();
    match &o.command {
        Some(Sub::Forker { file, n }) => return forker(file, *n),
        Some(Sub::Replay { bus, path }) => {
            return tokio::runtime::Runtime::new()?.block_on(replay(bus, path));
        }
        None => {}
    }
    o.pace_ms = o.pace_ms.max(1);
    if std::env::var_os("GPUD_BIN").is_none() {
        // SAFETY: no other thread runs yet (the runtime starts below).
        unsafe { std::env::set_var("GPUD_BIN", exe_dir().join("gpud")) };
    }
    tokio::runtime::Runtime::new()?.block_on(bench(o))
}

async fn bench(o: Opts) -> anyhow::Result<()> {
    let mut rig = Rig::new("scalebench");
    let standin = rig.stand_in("standin");
    let config = rig
        .config()
        .extra_paths([&standin])
        // NVML off: this measures attribution and the API; sweep at the default pace.
        .nvml_off()
        .set("attribution.sweep_interval_secs", 10)
        // As deployed: no per-event debug lines, pins kept.
        .log("info")
        .keep_pinned(true)
        .set("probes.events_ring_kib", i64::try_from(o.ring_kib)?);
    rig.start(config).await;
    let pid = rig.pid().context("daemon pid")?;
    let bpffs = rig.path().join("bpffs");
    let conn = connect_builder(&rig.bus.address).build().await?;
    let proxy = Manager1Proxy::new(&conn).await?;
    let mut report = serde_json::Map::new();
    report.insert(
        "opts".into(),
        json!({"cgroups": o.cgroups, "clients": o.clients,
        "trials": o.trials, "seconds": o.seconds, "rate": o.rate,
        "pace_ms": o.pace_ms, "ring_kib": o.ring_kib}),
    );

    eprintln!("scalebench: idle");
    tokio::time::sleep(Duration::from_secs(3)).await;
    report.insert(
        "idle".into(),
        tokio::task::block_in_place(|| cpu_over(pid, Duration::from_secs(o.seconds * 2)))?,
    );

    eprintln!("scalebench: attribution latency ({} trials)", o.trials);
    let mut attr = Vec::new();
    for i in 0..o.trials {
        let cg = Cgroup::new(&format!("sb-attr-{i}"));
        let h = tokio::task::block_in_place(|| Holder::spawn(&cg.dir, &standin, 1))?;
        let t0 = Instant::now();
        loop {
            if let Ok(r) = proxy.get_cgroup(&cg.rel).await
                && r.ioctls.values().sum::<u64>() >= 1
            {
                break;
            }
            if t0.elapsed() > Duration::from_secs(5) {
                bail!("cgroup {} never became visible", cg.rel);
            }
        }
        attr.push(t0.elapsed().as_secs_f64() * 1e6);
        drop(h);
    }
    report.insert("attribution_us".into(), dist(attr));

    eprintln!("scalebench: limit-change latency ({} trials)", o.trials);
    let lim_cg = Cgroup::new("sb-limit");
    let id = cgroup_id(&lim_cg.dir)?;
    let mut lim = Vec::new();
    for i in 0..o.trials as u64 {
        let want = (64 << 20) + i * 4096;
        let limits = BTreeMap::from([("memory_max", zbus::Variant::from(want))]);
        let t0 = Instant::now();
        proxy.set_limits(&lim_cg.rel, "all", limits).await?;
        while pinned_limit(&bpffs, id) != Some(want) {
            if t0.elapsed() > Duration::from_secs(5) {
                bail!("limit {want} never reached the kernel map");
            }
        }
        lim.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    proxy.clear_limits(&lim_cg.rel, "all", &[]).await?;
    report.insert("limit_change_us".into(), dist(lim));

    eprintln!("scalebench: {} cgroups with a live process each", o.cgroups);
    // Per line, each holder issues this many ioctls: the load loop writes lines.
    let per_line = 10u64;
    let mut cgroups = Vec::with_capacity(o.cgroups);
    let mut holders = Vec::with_capacity(o.cgroups);
    for i in 0..o.cgroups {
        let cg = Cgroup::new(&format!("sb-{i}"));
        holders.push(tokio::task::block_in_place(|| {
            Holder::spawn(&cg.dir, &standin, per_line)
        })?);
        cgroups.push(cg);
    }
    let listed = proxy.list_cgroups().await?.len();
    report.insert("attributed_cgroups".into(), json!(listed));

    let paths: Vec<String> = cgroups.iter().map(|c| c.rel.clone()).collect();
    eprintln!(
        "scalebench: D-Bus, {} clients back to back for {} s",
        o.clients, o.seconds
    );
    let cpu = CpuSplit::start(pid, rig.bus.pid())?;
    let mut saturated = dbus_clients(
        &rig.bus.address,
        BUS_NAME,
        &paths,
        o.clients,
        o.seconds,
        None,
    )
    .await?;
    saturated["cpu_percent"] = cpu.end()?;
    report.insert("dbus_us".into(), saturated);
    let pace = Duration::from_millis(o.pace_ms);
    eprintln!(
        "scalebench: D-Bus, {} clients each calling every {} ms for {} s",
        o.clients, o.pace_ms, o.seconds
    );
    let cpu = CpuSplit::start(pid, rig.bus.pid())?;
    let mut paced = dbus_clients(
        &rig.bus.address,
        BUS_NAME,
        &paths,
        o.clients,
        o.seconds,
        Some(pace),
    )
    .await?;
    paced["cpu_percent"] = cpu.end()?;
    report.insert("dbus_paced_us".into(), paced);

    eprintln!("scalebench: the bus's own ceiling (a service replaying gpud's replies)");
    let ceiling = bus_ceiling(&rig.bus.address, rig.bus.pid(), &paths, &o).await?;
    report.insert("bus_ceiling_us".into(), ceiling);

    eprintln!("scalebench: one ListCgroups at a time, its parts");
    report.insert("list_cgroups_parts_us".into(), listing_parts(&conn).await?);

    eprintln!(
        "scalebench: ~{} matched ioctls/s over {} cgroups",
        o.rate, o.cgroups
    );
    let before = stats(&proxy).await?["matched_ioctls"];
    let lines_per_s = (o.rate / per_line).max(1);
    let tick = Duration::from_millis(10);
    let per_tick = (lines_per_s as f64 * tick.as_secs_f64()).ceil() as usize;
    let (c0, _, _) = usage(pid)?;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(o.seconds);
    let mut next = 0usize;
    let mut interval = tokio::time::interval(tick);
    while Instant::now() < end {
        interval.tick().await;
        for _ in 0..per_tick {
            let n = holders.len();
            let h = &mut holders[next % n];
            writeln!(h.stdin)?;
            h.stdin.flush()?;
            next += 1;
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let (c1, rss, hwm) = usage(pid)?;
    // Let the holders finish their lines before reading the counter.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = stats(&proxy).await?["matched_ioctls"];
    report.insert(
        "load".into(),
        json!({
            "ioctls_per_s": (after - before) as f64 / elapsed,
            "cpu_percent": (c1 - c0) / elapsed * 100.0,
            "rss_kib": rss, "hwm_kib": hwm, "window_s": elapsed,
        }),
    );
    drop(holders);
    drop(cgroups);

    eprintln!("scalebench: ring-buffer events");
    let ev_cg = Cgroup::new("sb-events");
    let forks = 20_000u64;
    let lost0 = stats(&proxy).await?["events_lost"];
    let secs = tokio::task::block_in_place(|| run_forker(&ev_cg.dir, &standin, forks))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lost1 = stats(&proxy).await?["events_lost"];
    // The same burst with the daemon stopped: nothing drains the ring.
    rig.signal(libc::SIGSTOP);
    let stopped = tokio::task::block_in_place(|| run_forker(&ev_cg.dir, &standin, forks));
    rig.signal(libc::SIGCONT);
    let stopped_secs = stopped?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let lost2 = stats(&proxy).await?["events_lost"];
    // The daemon reports growth of the counter at its next sweep (every 10 s here).
    let t = Instant::now();
    let mut reported = false;
    while !reported && t.elapsed() < Duration::from_secs(12) {
        reported = rig.log_text().contains("kernel events lost");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    report.insert(
        "events".into(),
        json!({
            // A fork and an exit event per child.
            "events_per_s_running": (2 * forks) as f64 / secs,
            "lost_running": lost1 - lost0,
            "events_per_s_stopped": (2 * forks) as f64 / stopped_secs,
            "lost_while_stopped": lost2 - lost1,
            "loss_logged": reported,
        }),
    );
    drop(ev_cg);

    let targets = targets(&report);
    report.insert("targets".into(), targets);
    println!("BENCH JSON: {}", Value::Object(report));
    drop(conn);
    drop(rig);
    Ok(())
}
