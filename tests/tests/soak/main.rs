//! Churn soak: the real gpud on a private bus, the fake NVIDIA device, and a random but seeded
//! stream of cgroups and processes coming and going: processes open the device, allocate and free
//! video memory of random sizes through every call form, fork children that allocate (in their
//! own or another cgroup) and exit, exit or are killed with memory still allocated, close and
//! reopen the device; pass it to a process in another cgroup over a unix socket (SCM_RIGHTS)
//! and exit, leaving the receiver to allocate and free under their client; daemonize (a double
//! fork whose grandchild carries on with the file); limits are set (react action `kill`, so crossings kill) and cleared;
//! cgroups are removed, some while memory charged to them is still held by a process elsewhere.
//!
//! At every checkpoint the per-cgroup and per-GPU figures must equal the fake driver's ground
//! truth; at the end, after every process and cgroup is gone and the daemon's sweep ran, every
//! accounting map in the daemon's bpffs (OBJECTS, USAGE, ANCESTRY, LIMITS, PROCS,
//! CGROUPS) must be empty and ListProcesses / ListCgroups must track nothing.
//!
//! `cargo test` runs it twice for 30 s each: on an otherwise idle machine, and with every CPU
//! kept busy by spinning threads the test starts and stops itself (the release races showed only
//! there). `cargo xtask soak --minutes N` runs longer (`GPUD_SOAK_SECS`); `GPUD_SOAK_SEED`
//! replays a run; `GPUD_SOAK_RUNS=N` repeats it N times (loop mode), each on a fresh rig, and
//! reports how many passed. Each run prints `SOAK SUMMARY: {…}`.

mod churn;
mod model;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::maps::{Map, MapData};
use gpud_common::{
    Ancestry, CgroupUsage, IoctlCounts, KernelLimit, ObjEntry, ObjKey, ProcEntry, UsageKey, maps,
};
use gpud_tests::{
    Cgroup, Daemon, Manager1Proxy, Rig, RmProcess,
    fakenv::{FakeNv, Snapshot},
};
use serde_json::{Value, json};

use churn::*;
use model::*;

const MIB: u64 = 1 << 20;
const GPUS: u32 = 2;
const MAX_CGROUPS: usize = 6;
const MAX_PROCS: usize = 10;
const CHECKPOINT_EVERY: Duration = Duration::from_secs(8);
/// How long the daemon may take to settle after a quiesce (sweep interval 1 s).
const SETTLE: Duration = Duration::from_secs(20);

/// What one reply of the read path must show whatever churn goes on, since it comes from one
/// view of the daemon: paths ordered and unique, no process in two cgroups, `all` present and
/// no GPU's bytes above it, and a cgroup's limits and bytes on the GPUs it is limited on.
fn whole(records: &[gpud_api::CgroupRecord]) -> Result<(), String> {
    let mut pids = HashSet::new();
    for w in records.windows(2) {
        if w[0].path >= w[1].path {
            return Err(format!(
                "paths out of order: {:?} {:?}",
                w[0].path, w[1].path
            ));
        }
    }
    for r in records {
        let all = *r
            .memory_current
            .get("all")
            .ok_or_else(|| format!("{}: no `all` in {:?}", r.path, r.memory_current))?;
        if let Some((g, b)) = r.memory_current.iter().find(|(_, b)| **b > all) {
            return Err(format!("{}: GPU {g} holds {b} > all {all}", r.path));
        }
        for pid in &r.pids {
            if !pids.insert(*pid) {
                return Err(format!("process {pid} listed twice (again in {})", r.path));
            }
        }
    }
    Ok(())
}

/// Reads through D-Bus (`ListCgroups`, `GetCgroup` of what it lists) and `gpudctl list` until
/// `stop`, checking each reply with [`whole`]; returns how many replies it checked.
async fn read_during_churn(
    proxy: Manager1Proxy<'static>,
    bus: String,
    parent: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<u64, String> {
    let mut checked = 0;
    let mut round = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        round += 1;
        let list = proxy
            .list_cgroups()
            .await
            .map_err(|e| format!("ListCgroups: {e}"))?;
        whole(&list).map_err(|e| format!("ListCgroups: {e}"))?;
        checked += 1;
        for r in list.iter().filter(|r| r.path.starts_with(&parent)).take(8) {
            match proxy.get_cgroup(&r.path).await {
                Ok(one) => whole(std::slice::from_ref(&one))
                    .map_err(|e| format!("GetCgroup {}: {e}", r.path))?,
                // Removed by the churn since it was listed.
                Err(e) if e.to_string().contains("no cgroup") => continue,
                Err(e) => return Err(format!("GetCgroup {}: {e}", r.path)),
            }
            checked += 1;
        }
        if round.is_multiple_of(5) {
            let out = tokio::process::Command::new(gpud_tests::gpudctl_bin())
                .args(["--bus-address", &bus, "list", "--json"])
                .output()
                .await
                .map_err(|e| format!("gpudctl: {e}"))?;
            if !out.status.success() {
                return Err(format!("gpudctl list failed: {out:?}"));
            }
            let listed: Vec<gpud_api::CgroupRecord> =
                serde_json::from_slice::<Vec<Value>>(&out.stdout)
                    .map_err(|e| format!("gpudctl JSON: {e}"))?
                    .into_iter()
                    .filter_map(|v| serde_json::from_value(v).ok())
                    .collect();
            whole(&listed).map_err(|e| format!("gpudctl list: {e}"))?;
            checked += 1;
        }
        // Close enough that most reads fall between the churn's steps, each of which changes the
        // state (so nearly every read makes the daemon build a new view): about 100 replies a
        // second. This pace found the release race of `release_closed_files`.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(checked)
}

/// Polls `f` until it is `Ok`, for at most [`SETTLE`]; its last error otherwise.
async fn settle<F, Fut>(mut f: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + SETTLE;
    loop {
        let r = f().await;
        if r.is_ok() || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One soak at a time: two would share the machine's CPUs and the fake devices' names.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Threads that keep every CPU busy until dropped (or, whatever happens, until `limit`): the
/// load of a busy GPU node (a build, data loading), under which the daemon is preempted
/// between any two steps of its own.
struct Spinners {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<u64>>,
}

impl Spinners {
    fn start(limit: Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cpus = std::thread::available_parallelism().map_or(2, usize::from);
        let deadline = Instant::now() + limit;
        let threads = (0..cpus)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut spins = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        spins = std::hint::black_box(spins.wrapping_add(1));
                        if spins.is_multiple_of(1 << 20) && Instant::now() > deadline {
                            break;
                        }
                    }
                    spins
                })
            })
            .collect();
        eprintln!("soak: {cpus} spinning threads keep every CPU busy");
        Self { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// `GPUD_SOAK_SECS` (default 30), `GPUD_SOAK_SEED` (default: new for each run) and
/// `GPUD_SOAK_RUNS` (default 1: loop mode for local use, e.g. replaying a seed 20 times). Each run
/// has a fresh rig; every run is made, and the test fails if any did, naming their seeds.
async fn soak_runs(busy: bool) {
    let _serial = SERIAL.lock().await;
    let var = |name: &str| std::env::var(name).ok();
    let secs: u64 = var("GPUD_SOAK_SECS").map_or(30, |v| v.parse().expect("GPUD_SOAK_SECS"));
    let seed: Option<u64> = var("GPUD_SOAK_SEED").map(|v| v.parse().expect("GPUD_SOAK_SEED"));
    let runs: u32 = var("GPUD_SOAK_RUNS").map_or(1, |v| v.parse().expect("GPUD_SOAK_RUNS"));
    let label = if busy { "every CPU busy" } else { "idle" };
    let mut failed = Vec::new();
    for run in 1..=runs {
        let seed = seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        eprintln!("soak run {run} of {runs} ({label}): {secs} s, GPUD_SOAK_SEED={seed}");
        let spinners = busy.then(|| Spinners::start(Duration::from_secs(secs + 600)));
        let outcome = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
            soak_once(secs, seed),
        ))
        .await;
        drop(spinners);
        let verdict = if outcome.is_ok() { "passed" } else { "FAILED" };
        eprintln!("soak run {run} of {runs} ({label}, GPUD_SOAK_SEED={seed}): {verdict}");
        if outcome.is_err() {
            failed.push(seed);
        }
    }
    println!(
        "SOAK LOOP ({label}): {} of {runs} runs passed; failed seeds: {failed:?}",
        runs as usize - failed.len()
    );
    assert!(
        failed.is_empty(),
        "soak ({label}) failed with seeds {failed:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn churn_soak_leaks_nothing_and_matches_the_driver() {
    soak_runs(false).await;
}

/// The same churn while spinning threads keep every CPU busy: the daemon, the probes' programs
/// and the churning processes are preempted anywhere, which is how a GPU node runs. Races of
/// the release rules showed only here (docs/design.md, "Release rule").
#[tokio::test(flavor = "multi_thread")]
async fn churn_soak_holds_with_every_cpu_busy() {
    soak_runs(true).await;
}

async fn soak_once(secs: u64, seed: u64) {
    // Limits name GPUs 0 and 1: gpud checks them against NVML's inventory.
    let Some(mut rig) = Rig::new("soak").fake_gpus(GPUS).fake_device(GPUS) else {
        return;
    };
    let config = rig
        .config()
        .log("gpud=info,gpud::attribution=debug")
        .react_action("kill");
    rig.start(config).await;
    rig.wait_for_gpus(GPUS).await;
    let base = rig.pins();
    let (conn, proxy) = rig.proxy().await;
    let parent = Cgroup::new("soak");
    let root = gpud_tests::cgroup2_root();
    let ancestors: HashSet<u64> = parent
        .dir
        .ancestors()
        .skip(1)
        .take_while(|d| d.starts_with(&root))
        .map(|d| std::fs::metadata(d).expect("stat cgroup").ino())
        .collect();
    let mut soak = Soak {
        ancestors,
        rng: Rng(seed | 1),
        fake: rig.fake(),
        ctl: rig.ctl(),
        parent_dir: parent.dir.clone(),
        parent_rel: parent.rel.clone(),
        sockets: rig.path().to_owned(),
        parent: Some(parent),
        cgroups: Vec::new(),
        next_cg: 0,
        owner: HashMap::new(),
        n: Counts::default(),
        proxy,
        _conn: conn,
    };
    let mut max_entries: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut note = |m: BTreeMap<&'static str, usize>| {
        for (k, v) in m {
            let e = max_entries.entry(k).or_default();
            *e = (*e).max(v);
        }
    };
    // Readers during the churn, on a connection of their own.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (reader_conn, reader_proxy) = rig.proxy().await;
    let reader = tokio::spawn(read_during_churn(
        reader_proxy,
        rig.bus.address.clone(),
        soak.parent_rel.clone(),
        stop.clone(),
    ));
    let started = Instant::now();
    let mut next_checkpoint = started + CHECKPOINT_EVERY;
    while started.elapsed() < Duration::from_secs(secs) {
        soak.step().await;
        note(map_entries(&base));
        if Instant::now() >= next_checkpoint {
            soak.checkpoint(&rig, &base).await;
            next_checkpoint = Instant::now() + CHECKPOINT_EVERY;
        }
    }
    soak.checkpoint(&rig, &base).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let replies_checked = match reader.await.expect("reader task") {
        Ok(n) => n,
        Err(e) => panic!("read path under churn: {e}\n{}", rig.log_text()),
    };
    drop(reader_conn);

    // Wind down: every process and cgroup goes; then nothing may remain anywhere.
    while !soak.cgroups.is_empty() {
        soak.remove_cgroup(0).await;
    }
    let parent_rel = soak.parent_rel.clone();
    drop(soak.parent.take());
    let settled = settle(|| soak.leftovers(&base, &parent_rel)).await;
    let summary = json!({
        "seed": seed,
        "seconds": started.elapsed().as_secs(),
        "iterations": soak.n.iterations,
        "cgroups_created": soak.n.cgroups_created,
        "cgroups_removed": soak.n.cgroups_removed,
        "processes": soak.n.processes,
        "forks": soak.n.forks,
        "exits": soak.n.exits,
        "kills": soak.n.kills,
        "killed_by_limit": soak.n.killed_by_limit,
        "allocations": soak.n.allocations,
        "refused_allocations": soak.n.refused,
        "frees": soak.n.frees,
        "reopens": soak.n.reopens,
        "fd_passes": soak.n.passes,
        "double_forks": soak.n.double_forks,
        "limits_set": soak.n.limits_set,
        "limits_cleared": soak.n.limits_cleared,
        "checkpoints": soak.n.checkpoints,
        "read_replies_checked": replies_checked,
        "max_map_entries": max_entries,
        "leaks": settled.as_ref().map_or_else(|l| l.split(", ").count(), |()| 0),
    });
    println!("SOAK SUMMARY: {summary}");
    if let Err(leaks) = settled {
        panic!("leaked after the churn: {leaks}\n{}", rig.log_text());
    }
    assert!(rig.running(), "gpud died:\n{}", rig.log_text());
}
