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
//! - `limit_change_flood_us`: the same while a process in another cgroup opens and closes the
//!   control device as fast as it can (two kernel events per open for gpud to handle; its rate
//!   in `opens_per_s`);
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
//!   kernel counts the loss (`events_lost`), and the daemon reports it once resumed;
//! - `start_ms`: the daemon's first start, from exec to its answer on the bus (`first`), and at
//!   the end a restart over the pins it kept (`restart`), each polled every 100 ms.
//!
//! `gpud-scalebench [--cgroups N] [--clients N] [--trials N] [--seconds S] [--rate R]
//! [--pace-ms MS] [--ring-kib KIB]` (`--ring-kib`: the daemon's `probes.events_ring_kib`;
//! `--help` lists the defaults). (`gpud-scalebench forker FILE N` is its own event generator.)

use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use gpud_api::BUS_NAME;
use gpud_tests::{Cgroup, Manager1Proxy, Rig, connect_builder};
use serde_json::{Value, json};

use dbus::{bus_ceiling, dbus_clients, listing_parts, replay};
use figures::{CpuSplit, cpu_over, dist, usage};
use load::{Flood, Holder, cgroup_id, forker, opener, pinned_limit, run_forker};

mod dbus;
mod figures;
mod load;

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
    /// Children the event burst forks (a fork and an exit event each).
    #[arg(long, default_value_t = 20_000)]
    forks: u64,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(Subcommand)]
enum Sub {
    /// Its own event generator (see [`forker`]).
    #[command(hide = true)]
    Forker { file: String, n: u64 },
    /// Opens and closes FILE until standard input closes (see [`opener`]).
    #[command(hide = true)]
    Opener { file: String },
    /// The replaying service of [`bus_ceiling`], in a process of its own.
    #[command(hide = true)]
    Replay { bus: String, path: String },
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

/// The directory of this binary, where cargo put the daemon and the fixtures of the same build.
fn exe_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_default()
}

/// `trials` limit changes on `cg` through `SetLimits`: from the call to the new `memory_max` in
/// the pinned kernel `LIMITS` map, polled back to back, in µs. Clears the limit after.
async fn limit_changes(
    proxy: &Manager1Proxy<'_>,
    bpffs: &Path,
    cg: &Cgroup,
    trials: usize,
) -> anyhow::Result<Vec<f64>> {
    let id = cgroup_id(&cg.dir)?;
    let mut lim = Vec::with_capacity(trials);
    for i in 0..trials as u64 {
        let want = (64 << 20) + i * 4096;
        let limits = BTreeMap::from([("memory_max", zbus::Variant::from(want))]);
        let t0 = Instant::now();
        proxy.set_limits(&cg.rel, "all", limits).await?;
        while pinned_limit(bpffs, id) != Some(want) {
            if t0.elapsed() > Duration::from_secs(5) {
                bail!("limit {want} never reached the kernel map");
            }
        }
        lim.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    proxy.clear_limits(&cg.rel, "all", &[]).await?;
    Ok(lim)
}

async fn stats(p: &Manager1Proxy<'_>) -> anyhow::Result<BTreeMap<String, u64>> {
    Ok(p.get_kernel_stats().await?)
}

fn main() -> anyhow::Result<()> {
    let mut o = Opts::parse();
    match &o.command {
        Some(Sub::Forker { file, n }) => return forker(file, *n),
        Some(Sub::Opener { file }) => return opener(file),
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
    // Exec to answering on the bus: probes loaded and attached, state restored.
    let t_start = Instant::now();
    rig.start(config).await;
    let start_ms = t_start.elapsed().as_secs_f64() * 1e3;
    let pid = rig.pid().context("daemon pid")?;
    let bpffs = rig.path().join("bpffs");
    let conn = connect_builder(&rig.bus.address).build().await?;
    let proxy = Manager1Proxy::new(&conn).await?;
    let mut report = serde_json::Map::new();
    report.insert(
        "opts".into(),
        json!({"cgroups": o.cgroups, "clients": o.clients,
        "trials": o.trials, "seconds": o.seconds, "rate": o.rate,
        "pace_ms": o.pace_ms, "ring_kib": o.ring_kib, "forks": o.forks}),
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
    let lim = limit_changes(&proxy, &bpffs, &lim_cg, o.trials).await?;
    report.insert("limit_change_us".into(), dist(lim));
    eprintln!(
        "scalebench: limit-change latency under an open/close flood ({} trials)",
        o.trials
    );
    let flood_cg = Cgroup::new("sb-flood");
    let flood = Flood::start(&flood_cg.dir, &standin)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lim = limit_changes(&proxy, &bpffs, &lim_cg, o.trials).await;
    let opens_per_s = flood.stop()?;
    let mut flooded = dist(lim?);
    if let Value::Object(m) = &mut flooded {
        m.insert("opens_per_s".into(), json!(opens_per_s));
    }
    report.insert("limit_change_flood_us".into(), flooded);
    drop(flood_cg);

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
    let forks = o.forks;
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
    // The daemon reports growth of the counter at its next sweep (every 10 s here); a burst too
    // small to fill the ring leaves nothing to report.
    let t = Instant::now();
    let mut reported = false;
    while lost2 > lost1 && !reported && t.elapsed() < Duration::from_secs(12) {
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

    eprintln!("scalebench: a restart over the kept pins");
    let t_restart = Instant::now();
    rig.restart().await;
    report.insert(
        "start_ms".into(),
        json!({
            "first": start_ms,
            "restart": t_restart.elapsed().as_secs_f64() * 1e3,
        }),
    );

    let targets = targets(&report);
    report.insert("targets".into(), targets);
    println!("BENCH JSON: {}", Value::Object(report));
    drop(conn);
    drop(rig);
    Ok(())
}
