//! An upgrade of gpud across an eBPF ABI change, as `cargo xtask test`'s stage "package:
//! upgrade" runs it: the previous release's package is installed, its gpud (`GPUD_BIN`, the
//! installed `/usr/bin/gpud`) runs over the fake NVIDIA device with tenants holding memory under
//! limits (per GPU and by GPU UUID) and one allocating and freeing all the while; then gpud is
//! stopped, `GPUD_UPGRADE` (`dpkg -i` of this tree's package) replaces the binary, a tenant tries
//! to cross its limit while no gpud runs, and gpud starts again, as the unit is restarted around
//! an upgrade. What must hold: gpud's usage equals the fake driver's ledger before,
//! after the new daemon's first answer and at the end; the crossing tenants are stopped; limits
//! and compute shares are what they were; the new daemon took the old maps over.
//!
//! Without `GPUD_UPGRADE` that test says SKIPPED and passes: it needs two builds of gpud, which
//! the stage makes (`cargo xtask package upgrade --check`). The same scenario runs in every
//! `cargo test` for an upgrade within one ABI (another build's eBPF object attached).

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use gpud_tests::{Cgroup, Rig, RmProcess, eventually, gpudctl_bin, scenario};

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 64 * MIB;

/// A tenant allocating and freeing 4 MiB in a loop on its own thread; the test takes the lock
/// to look at a quiet moment (nothing of the loop's held).
struct Churn {
    tenant: Arc<Mutex<RmProcess>>,
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Churn {
    fn start(tenant: RmProcess, client: u32, device: u32) -> Self {
        let tenant = Arc::new(Mutex::new(tenant));
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let thread = {
            let (tenant, stop, rounds) = (tenant.clone(), stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    {
                        let mut t = tenant.lock().expect("churn lock");
                        let a = t.ok(&format!("alloc {client} {device} {}", 4 * MIB));
                        let h = a["handle"].as_u64().expect("handle");
                        t.ok(&format!("free {client} {h}"));
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        };
        Self {
            tenant,
            stop,
            rounds,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("churn thread");
        }
        self.rounds.load(Ordering::Relaxed)
    }
}

/// Each tenant's cgroup, its process and what gpud must count for it.
struct Tenant<'a> {
    cg: &'a Cgroup,
    pid: u32,
}

/// gpud's `all` figure for each tenant equals what the fake driver holds for its process (at
/// a quiet moment of the churn); panics with both after 10 s.
// The lock held across the awaits pauses the churn's plain thread, which no task waits for.
#[allow(clippy::await_holding_lock)]
async fn counts_match(rig: &Rig, tenants: &[Tenant<'_>], churn: &Churn, when: &str) {
    let _quiet = churn.tenant.lock().expect("churn lock");
    let last = Mutex::new(String::new());
    let matched = eventually(Duration::from_secs(10), || async {
        let snap = rig.fake().snapshot();
        let mut lines = Vec::new();
        let mut all = true;
        for t in tenants {
            let ledger = snap.held_by(&[t.pid]);
            let counted = rig
                .get_cgroup(&t.cg.rel)
                .await
                .memory_current
                .get("all")
                .copied()
                .unwrap_or(0);
            all &= ledger == counted;
            lines.push(format!("{}: gpud {counted}, ledger {ledger}", t.cg.rel));
        }
        *last.lock().expect("last") = lines.join("; ");
        all.then_some(())
    })
    .await;
    let last = last.into_inner().expect("last");
    assert!(
        matched.is_some(),
        "{when}: gpud's usage is not the driver's ledger: {last}\n{}",
        rig.log_text()
    );
    println!("{when}: {last}");
}

/// Prints `gpudctl list --json` (the installed gpudctl in the stage) for the tenants' cgroups,
/// with the fake driver's ledger of their processes beside.
fn print_list(rig: &Rig, tenants: &[Tenant<'_>], when: &str) {
    let out = std::process::Command::new(gpudctl_bin())
        .args(["--bus-address", &rig.bus.address, "list", "--json"])
        .output()
        .expect("run gpudctl");
    assert!(out.status.success(), "gpudctl list failed: {out:?}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("gpudctl JSON");
    let snap = rig.fake().snapshot();
    println!(
        "{when}: $ {} list --json (the tenants' rows)",
        gpudctl_bin().display()
    );
    for t in tenants {
        let row = rows.iter().find(|r| r["path"] == t.cg.rel.as_str());
        let fields = row.map(|r| {
            serde_json::json!({
                "path": r["path"],
                "memory_current": r["memory_current"],
                "memory_max": r["memory_max"],
                "memory_events": r["memory_events"],
            })
        });
        println!(
            "  {}    ledger: {}",
            fields
                .map(|f| f.to_string())
                .unwrap_or_else(|| "(absent)".into()),
            snap.held_by(&[t.pid])
        );
    }
}

/// A tenant of `cg` takes `bytes` past its limit on `gpu`: it must not survive the call.
fn crossing_dies(rig: &Rig, cg: &Cgroup, gpu: u32, bytes: u64, when: &str) {
    let mut attacker = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = attacker.client_device(gpu);
    attacker.killed_in(&format!("alloc {client} {device} {bytes}"), when);
    println!("{when}: the tenant crossing its limit was killed in its call");
}

/// What changes while gpud is stopped for the upgrade.
enum Upgrade {
    /// A shell command that installs the new gpud where `GPUD_BIN` points (`dpkg -i`).
    Install(std::ffi::OsString),
    /// Another build of this ABI left its probes attached: its links' directory is renamed as
    /// another eBPF object's would be named.
    AnotherObject,
}

impl Upgrade {
    fn run(&self, rig: &Rig) {
        match self {
            Self::Install(command) => {
                let out = std::process::Command::new("sh")
                    .arg("-c")
                    .arg(command)
                    .output()
                    .expect("run GPUD_UPGRADE");
                println!(
                    "upgrade: {}\n{}{}",
                    command.to_string_lossy(),
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(
                    out.status.success(),
                    "GPUD_UPGRADE failed: {:?}",
                    out.status
                );
            }
            Self::AnotherObject => {
                let links = rig.pins().join("links");
                for e in std::fs::read_dir(&links).expect("links").flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let (_, rest) = name.split_once('-').expect("<hash>-<mode>…");
                    let other = links.join(format!("0000000000000000-{rest}"));
                    std::fs::rename(e.path(), &other).expect("rename the links");
                    println!(
                        "upgrade: {name} renamed as another object's links: {}",
                        other.display()
                    );
                }
            }
        }
    }
}

/// An upgrade while gpud is stopped: a per-GPU limit with a compute cap, a limit keyed by GPU
/// UUID and a churning tenant before; a crossing while no gpud runs; the checks of the module
/// docs after. `from`: the ABI the new daemon must say it took over.
async fn upgrade_under_load(tag: &str, upgrade: Upgrade, from: impl FnOnce(u32) -> u32) {
    let Some(rig) = Rig::new(tag).fake_device(2) else {
        return;
    };
    let mut rig = rig.fake_gpus(2);
    rig.start(rig.config().react_action("kill").keep_pinned(true))
        .await;
    rig.wait_for_gpus(2).await;
    let (_c, p) = rig.proxy().await;
    let old_abi = p.abi_version().await.expect("AbiVersion");
    let old_version = p.version().await.expect("Version");
    println!("before: gpud {old_version} (ABI {old_abi})");

    // A per-GPU limit with a compute cap, a limit keyed by GPU UUID, and a churning tenant.
    let (cg_a, cg_b, cg_c) = (
        Cgroup::new(&format!("{tag}-a")),
        Cgroup::new(&format!("{tag}-b")),
        Cgroup::new(&format!("{tag}-c")),
    );
    rig.set_limit(&cg_a.rel, "0", "memory_max", LIMIT).await;
    rig.set_limit(&cg_a.rel, "0", "compute_max", 30u32).await;
    rig.set_limit(&cg_b.rel, &scenario::uuid(1), "memory_max", LIMIT)
        .await;
    rig.set_limit(&cg_c.rel, "all", "memory_max", 4 * LIMIT)
        .await;
    let mut a = RmProcess::spawn(Some(&cg_a.dir), &rig.ctl());
    let (ca, da) = a.client_device(0);
    a.ok(&format!("alloc {ca} {da} {}", 48 * MIB));
    let mut b = RmProcess::spawn(Some(&cg_b.dir), &rig.ctl());
    let (cb, db) = b.client_device(1);
    b.ok(&format!("alloc {cb} {db} {}", 32 * MIB));
    b.ok(&format!("alloc {cb} {db} {}", 16 * MIB));
    let mut c = RmProcess::spawn(Some(&cg_c.dir), &rig.ctl());
    let (cc, dc) = c.client_device(0);
    c.ok(&format!("alloc {cc} {dc} {}", 16 * MIB));
    let c_pid = c.pid;
    let churn = Churn::start(c, cc, dc);
    let tenants = [
        Tenant {
            cg: &cg_a,
            pid: a.pid,
        },
        Tenant {
            cg: &cg_b,
            pid: b.pid,
        },
        Tenant {
            cg: &cg_c,
            pid: c_pid,
        },
    ];
    rig.expect_in_force(&cg_b.rel, &[("1", LIMIT)]).await;
    counts_match(&rig, &tenants, &churn, "before").await;
    print_list(&rig, &tenants, "before");
    let limits_before: Vec<_> = [&cg_a, &cg_b, &cg_c]
        .iter()
        .map(|cg| cg.rel.clone())
        .collect();
    let mut before = Vec::new();
    for cg in &limits_before {
        before.push((rig.limits(cg).await, rig.in_force(cg).await));
    }

    let rounds_at_stop = churn.rounds.load(Ordering::Relaxed);
    // The unit is stopped, the package replaces the binary, the unit is started again.
    rig.stop();
    upgrade.run(&rig);
    crossing_dies(&rig, &cg_a, 0, 32 * MIB, "while no gpud runs");
    rig.restart().await;
    let (_c, p) = rig.proxy().await;
    let abi = p.abi_version().await.expect("AbiVersion");
    let version = p.version().await.expect("Version");
    let taken = p.probes_taken_over().await.expect("ProbesTakenOver");
    println!("after: gpud {version} (ABI {abi}); taken over: {taken:?}");
    counts_match(&rig, &tenants, &churn, "at the new daemon's first answer").await;
    let want = from(old_abi);
    assert_eq!(
        taken.get("from_abi"),
        Some(&want.to_string()),
        "the new daemon did not take over ABI {want}'s maps: {taken:?}\n{}",
        rig.log_text()
    );
    assert!(
        !taken.contains_key("unconverted"),
        "something was not converted: {taken:?}"
    );
    crossing_dies(&rig, &cg_a, 0, 32 * MIB, "after the upgrade");
    // Tenant b allocates and frees under the new daemon, within its limit.
    let h = b.ok(&format!("alloc {cb} {db} {}", 8 * MIB))["handle"]
        .as_u64()
        .expect("handle");
    b.ok(&format!("free {cb} {h}"));
    crossing_dies(&rig, &cg_b, 1, 32 * MIB, "after the upgrade, by UUID");
    let rounds = churn.rounds.load(Ordering::Relaxed);
    counts_match(&rig, &tenants, &churn, "at the end").await;
    {
        let _quiet = churn.tenant.lock().expect("churn lock");
        print_list(&rig, &tenants, "after");
    }
    for (cg, (limits, in_force)) in limits_before.iter().zip(&before) {
        assert_eq!(&rig.limits(cg).await, limits, "{cg}: limits changed");
        assert_eq!(
            &rig.in_force(cg).await,
            in_force,
            "{cg}: limits in force changed"
        );
    }
    let churned = churn.finish();
    println!(
        "the churning tenant made {churned} allocate-and-free rounds ({} before the stop, {} by the new daemon's checks)",
        rounds_at_stop, rounds
    );
    drop(a);
    drop(b);
}

/// The previous release's gpud upgraded to this tree's (`cargo xtask package upgrade --check`
/// sets `GPUD_BIN` and `GPUD_UPGRADE`): the previous ABI's maps taken over.
#[tokio::test(flavor = "multi_thread")]
async fn an_upgrade_across_an_abi_change_keeps_every_count_and_limit() {
    let Some(command) = std::env::var_os("GPUD_UPGRADE") else {
        eprintln!("SKIPPED: GPUD_UPGRADE (the command installing the new gpud) is not set");
        return;
    };
    upgrade_under_load("upgrade", Upgrade::Install(command), |old| old).await;
}

/// Another build of the same ABI (a release changing the eBPF code, not its maps) takes the
/// attached one's maps over as it would an older ABI's: no moment without programs, no call
/// counted twice, nothing lost.
#[tokio::test(flavor = "multi_thread")]
async fn another_build_of_the_same_abi_takes_over_without_a_gap() {
    if std::env::var_os("GPUD_UPGRADE").is_some() {
        eprintln!("SKIPPED: GPUD_BIN is the previous release's gpud in this run");
        return;
    }
    upgrade_under_load("upgrade-same", Upgrade::AnotherObject, |_| {
        gpud_common::ABI_VERSION
    })
    .await;
}

/// A take-over that fails before the old programs detach leaves them attached and their pins
/// where they were: here the new daemon is configured for fentry on a kernel that refuses it, so
/// it stops after loading its object beside the old pins; the old programs still count and kill
/// the crossing tenant, and a daemon started as before takes them over.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_take_over_leaves_the_attached_probes_running() {
    if std::env::var_os("GPUD_UPGRADE").is_some() {
        eprintln!("SKIPPED: GPUD_BIN is the previous release's gpud in this run");
        return;
    }
    let Some(rig) = Rig::new("upgrade-fail").fake_device(1) else {
        return;
    };
    let mut rig = rig.fake_gpus(1);
    let config = rig.config().react_action("kill").keep_pinned(true);
    rig.start(config.clone()).await;
    rig.wait_for_gpus(1).await;
    let (_c, p) = rig.proxy().await;
    let caps = p.kernel_capabilities().await.expect("KernelCapabilities");
    if caps.get("fentry").copied().unwrap_or(true) {
        eprintln!("SKIPPED: this kernel offers fentry: a daemon asking for it would not fail");
        return;
    }
    let cg = Cgroup::new("upgrade-fail");
    rig.set_limit(&cg.rel, "all", "memory_max", LIMIT).await;
    let mut tenant = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = tenant.client_device(0);
    tenant.ok(&format!("alloc {client} {device} {}", 48 * MIB));
    rig.stop();
    Upgrade::AnotherObject.run(&rig);
    let links = std::fs::read_dir(rig.pins().join("links"))
        .expect("links")
        .flatten()
        .map(|e| e.file_name())
        .collect::<Vec<_>>();

    let failing = config
        .clone()
        .set("probes.attach", "fentry")
        .write_as("fentry.toml");
    let out = std::process::Command::new(gpud_tests::gpud_bin())
        .args(["--config"])
        .arg(&failing)
        .args(["--bus-address", &rig.bus.address])
        .output()
        .expect("run gpud");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "gpud started on fentry: {log}");
    assert!(
        log.contains("they keep running"),
        "the failed take-over is not said: {log}"
    );
    let after: Vec<_> = std::fs::read_dir(rig.pins().join("links"))
        .unwrap_or_else(|e| panic!("the pins are not back ({e}):\n{log}"))
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(after, links, "the links taken over are not back in place");
    assert!(
        !rig.pins()
            .with_file_name(format!("v{}-replaced", gpud_common::ABI_VERSION))
            .exists()
    );
    println!("the failed take-over left {links:?} attached");
    crossing_dies(&rig, &cg, 0, 32 * MIB, "after the failed take-over");

    rig.restart().await;
    let (_c, p) = rig.proxy().await;
    let taken = p.probes_taken_over().await.expect("ProbesTakenOver");
    assert_eq!(
        taken.get("from_abi"),
        Some(&gpud_common::ABI_VERSION.to_string()),
        "{taken:?}"
    );
    let held = rig.fake().snapshot().held_by(&[tenant.pid]);
    assert_eq!(held, 48 * MIB);
    rig.expect_memory(&cg.rel, &[("0", held), ("all", held)])
        .await;
    crossing_dies(&rig, &cg, 0, 32 * MIB, "after the take-over");
}
