//! Compute shares through the real daemon's whole path: real tenant processes in real cgroups
//! allocate channel groups on the fake control device (so the probes see them at `RM_ALLOC`),
//! the real gpud reads them from its objects map, issues the channel-group controls through a
//! `pidfd_getfd` copy of each tenant's own file (which the fake checks against the client, as
//! the driver does), or freezes the tenants' cgroups, on its actuator's timetable.
//!
//! What stands in for the GPU: each tenant burns CPU as its "GPU work"; the fake NVML reports
//! each one's runnable time (on a CPU or waiting for one) as its SM utilization (and their sum
//! as the device's), and the fake device's `runlist channels` stops a tenant while its channels
//! are disabled, as the H200 does (`runlist stop`: also while its group is off the runlist;
//! `runlist record`: the firmware ignores both). A CPU has no queue to drain, so these
//! tests check the plumbing and that the shares come out of it, not the law's accuracy on
//! queued, time-sliced hardware: that is the simulated GPU's (tests/gpusim, `law` tests and
//! `cargo xtask bench compute`). Shares are measured as the share of the wall time each tenant
//! was let run, within 5 points: where the hardware levers hold it, by the fake device's own
//! record of the wall time it kept the tenant stopped (a GPU runs a context for the wall time it
//! is let run, whatever the host's CPUs do); where the freezer does, by the tenant's CPU clock
//! (runnable: on a CPU or waiting in a run queue), corrected for the time the hypervisor stole
//! from the machine's CPUs, which a task's clock does not count. Either way, what gpud decides,
//! whatever else keeps the machine busy (a build beside the tests only delays the tenants, as it
//! would not a GPU). Each switch of the stand-in costs a few FUSE round trips and signals, a
//! millisecond or so of a 12.5 ms window. The tests run one at a time.

use std::time::{Duration, Instant};

use gpud_common::rm::{sched::DISABLE_CHANNELS, tsg};
use gpud_tests::{Cgroup, Rig, RmProcess, fakenv::Snapshot};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A process of `cgroup` with a client, a device, a subdevice and a channel group of two
/// channels on GPU 0 (what CUDA makes), burning CPU.
struct Tenant {
    p: RmProcess,
    cg: Cgroup,
    group: u32,
}

impl Tenant {
    fn pid(&self) -> u32 {
        self.p.pid
    }
}

fn tenant(rig: &Rig, name: &str) -> Tenant {
    let cg = Cgroup::new(name);
    let mut p = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = p.client_device(0);
    p.handle(&format!("subdevice {client} {device}"));
    let group = p.handle(&format!("channel-group {client} {device}"));
    for _ in 0..2 {
        p.handle(&format!("channel {client} {group}"));
    }
    // Its group put on the runlist, CUDA's last step in making a context.
    p.ok(&format!("schedule {client} {group} 1"));
    p.ok("burn");
    Tenant { p, cg, group }
}

/// The tenant's channels in a snapshot.
fn channels_of<'a>(
    s: &'a Snapshot,
    t: &Tenant,
) -> impl Iterator<Item = &'a gpud_tests::fakenv::ChannelState> {
    let pid = t.pid();
    s.channels.iter().filter(move |c| c.pid == pid)
}

/// The fake NVML's GPU 0 with these processes, each reporting its CPU share as its SM use.
fn scenario(rig: &Rig, tenants: &[&Tenant]) {
    let procs: Vec<(u32, u32)> = tenants.iter().map(|t| (t.pid(), 0)).collect();
    rig.nvml_scenario(&gpud_tests::gpus_with(1, &procs));
}

/// Waits until the daemon has logged `text` (a verdict, a fallback).
async fn logged(rig: &Rig, text: &str) {
    rig.expect_eventually(text, Duration::from_secs(10), || async {
        rig.log_text().contains(text).then_some(())
    })
    .await;
}

/// A rig with the fake device (`runlist` mode) and NVML, gpud started (compute on, 100 ms
/// samples and periods, `hardware` as given); `None` without FUSE.
async fn rig(tag: &str, runlist: &str, hardware: bool) -> Option<Rig> {
    let mut rig = Rig::new(tag).fake_device(1)?.fake_gpus(1);
    rig.fake()
        .inject(&format!("runlist {runlist}"))
        .expect("runlist mode");
    rig.start(rig.config().log("gpud=debug").compute(hardware))
        .await;
    rig.wait_for_gpus(1).await;
    Some(rig)
}

/// [`rig`] and [`tenants`] (`None` without FUSE).
async fn world(
    tag: &str,
    runlist: &str,
    hardware: bool,
    names: &[&str],
) -> Option<(Rig, Vec<Tenant>)> {
    let rig = rig(tag, runlist, hardware).await?;
    let ts = tenants(&rig, names).await;
    Some((rig, ts))
}

/// Tenants started after gpud (whose probes must see their channel groups made), listed by NVML.
async fn tenants(rig: &Rig, names: &[&str]) -> Vec<Tenant> {
    let ts: Vec<Tenant> = names.iter().map(|n| tenant(rig, n)).collect();
    scenario(rig, &ts.iter().collect::<Vec<_>>());
    let (_c, p) = rig.proxy().await;
    let pids: Vec<u32> = ts.iter().map(Tenant::pid).collect();
    rig.expect_eventually(
        "NVML lists the tenants",
        Duration::from_secs(10),
        || async {
            let usage = p.list_nvml_usage().await.ok()?;
            pids.iter()
                .all(|pid| usage.iter().any(|u| u.pids.contains(pid)))
                .then_some(())
        },
    )
    .await;
    ts
}

async fn set(rig: &Rig, t: &Tenant, limits: &[(&str, zbus::Variant<'_>)]) {
    let (_c, p) = rig.proxy().await;
    let m: std::collections::BTreeMap<&str, zbus::Variant<'_>> = limits
        .iter()
        .map(|(k, v)| (*k, v.try_clone().expect("clone")))
        .collect();
    p.set_limits(&t.cg.rel, "0", m).await.expect("SetLimits");
}

/// Time a process's threads ran on a CPU and waited in a run queue for one (ns; `schedstat`'s
/// first two fields).
fn sched_ns(pid: u32) -> (u64, u64) {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .fold((0, 0), |(run, wait), s| {
                    let mut f = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
                    (run + f.next().unwrap_or(0), wait + f.next().unwrap_or(0))
                })
        })
        .unwrap_or((0, 0))
}

/// The machine's CPU time from `/proc/stat`'s `cpu` line, in clock ticks: (stolen by the
/// hypervisor, wanted: stolen or spent on anything but idling).
fn cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    // user nice system idle iowait irq softirq steal
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let field = |i: usize| f.get(i).copied().unwrap_or(0);
    let steal = field(7);
    let busy = field(0) + field(1) + field(2) + field(5) + field(6);
    (steal, busy + steal)
}

/// How a tenant's use of the stand-in GPU is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum By {
    /// The fake device's record of the wall time it kept the tenant stopped (its channels
    /// disabled, or its group off the runlist in `runlist stop`): the hardware levers, read as
    /// a GPU would carry them out, whatever the tenant's CPU did meanwhile.
    Device,
    /// The tenant's CPU clock, for what the fake does not see (the freezer): what it ran and
    /// what it was runnable, each scaled up by the share of the time the machine's CPUs had
    /// work that the hypervisor stole meanwhile (a task's clock does not run while its CPU is
    /// stolen).
    Cpu,
}

/// A tenant's use of the stand-in GPU over a window, in percent of the wall time: what the fake
/// device let it run (`let_run`), and by its CPU clock what it ran and what it was runnable (ran
/// or waited for a CPU), corrected for the hypervisor's steal (`stolen`, percent of the time the
/// machine's CPUs had work). By the clock the time it was let run lies between the two: on an
/// idle host they agree; on a busy one, a stopped tenant must still get a CPU to stop, and that
/// wait reads as runnable.
#[derive(Clone, Copy, Debug)]
struct Share {
    let_run: f64,
    ran: f64,
    runnable: f64,
    stolen: f64,
}

impl Share {
    /// The share read as `by` says: [`By::Device`]'s `let_run`, or [`By::Cpu`]'s `runnable`.
    fn of(&self, by: By) -> f64 {
        match by {
            By::Device => self.let_run,
            By::Cpu => self.runnable,
        }
    }
}

/// Each tenant's [`Share`] over `window`.
fn shares_of(rig: &Rig, tenants: &[&Tenant], window: Duration) -> Vec<Share> {
    let fake0 = rig.fake().held();
    let before: Vec<(u64, u64)> = tenants.iter().map(|t| sched_ns(t.pid())).collect();
    let (steal0, wanted0) = cpu_ticks();
    let t0 = Instant::now();
    std::thread::sleep(window);
    let wall = t0.elapsed().as_nanos() as f64;
    let (steal1, wanted1) = cpu_ticks();
    let fake1 = rig.fake().held();
    // Of the time the CPUs had something to run, the share the hypervisor ran something else:
    // a running tenant's clock stood still for that share of its time.
    let stolen = (steal1.saturating_sub(steal0) as f64
        / wanted1.saturating_sub(wanted0).max(1) as f64)
        .clamp(0.0, 0.9);
    let clock = fake1.clock_ns.saturating_sub(fake0.clock_ns).max(1) as f64;
    tenants
        .iter()
        .zip(before)
        .map(|(t, (run0, wait0))| {
            let pid = t.pid();
            let (run, wait) = sched_ns(pid);
            let ran = run.saturating_sub(run0) as f64 / wall * 100.0 / (1.0 - stolen);
            let waited = wait.saturating_sub(wait0) as f64 / wall * 100.0 / (1.0 - stolen);
            let held = fake1.of(pid).saturating_sub(fake0.of(pid));
            Share {
                let_run: 100.0 * (1.0 - held as f64 / clock),
                ran,
                runnable: ran + waited,
                stolen: stolen * 100.0,
            }
        })
        .collect()
}

/// Each tenant's share of the stand-in GPU over `window`, in percent, read as `by` says: CPU
/// contention and the hypervisor's steal do not read as throttling.
fn shares(rig: &Rig, by: By, tenants: &[&Tenant], window: Duration) -> Vec<f64> {
    shares_of(rig, tenants, window)
        .into_iter()
        .map(|s| s.of(by))
        .collect()
}

/// Measures the tenants' shares over `secs` seconds, read as `by` says, and asserts each is
/// within 5 points of its target. Several tenants dividing the GPU between them (targets summing
/// to 100) are judged by their split: a switch that lands late on a busy host lends both sides
/// the same extra time. A lone tenant passes when its target lies within 5 points of what the
/// device let it run ([`By::Device`]), or of the span from what it ran to what it was runnable
/// ([`By::Cpu`]; one value on an idle host).
fn expect_shares(rig: &Rig, what: &str, by: By, ts: &[Tenant], targets: &[f64], secs: u64) {
    let got = shares_of(
        rig,
        &ts.iter().collect::<Vec<_>>(),
        Duration::from_secs(secs),
    );
    let sum: f64 = got.iter().map(|s| s.of(by)).sum();
    let ok = if ts.len() > 1 && sum > 0.0 {
        got.iter()
            .zip(targets)
            .all(|(g, t)| within(g.of(by) / sum * 100.0, *t, 5.0))
    } else {
        got.iter().zip(targets).all(|(g, t)| match by {
            By::Device => within(g.let_run, *t, 5.0),
            By::Cpu => g.ran - 5.0 <= *t && *t <= g.runnable + 5.0,
        })
    };
    let stolen = got.first().map_or(0.0, |s| s.stolen);
    println!(
        "{what}: {got:.1?} % of the wall time, by {by:?} (targets {targets:?}; the hypervisor \
         stole {stolen:.1} % of the CPUs' busy time)"
    );
    assert!(
        ok,
        "{what}: {got:.1?} % of the wall time, by {by:?}, instead of {targets:?}:\n{}",
        rig.log_text()
    );
}

/// Waits until the fake's channel groups satisfy `pred`.
fn groups_until(rig: &Rig, what: &str, pred: impl Fn(&Snapshot) -> bool) -> Snapshot {
    rig.fake()
        .wait(Duration::from_secs(15), pred)
        .unwrap_or_else(|s| panic!("{what}: {:#?}\n{}", s.channel_groups, rig.log_text()))
}

fn group_of<'a>(s: &'a Snapshot, t: &Tenant) -> &'a gpud_tests::fakenv::ChannelGroupState {
    s.channel_groups
        .iter()
        .find(|g| g.pid == t.pid() && g.handle == t.group)
        .expect("the tenant's channel group")
}

/// NVIDIA files gpud holds open (it must close the tenants' at once).
fn held_files(rig: &Rig) -> Vec<String> {
    let pid = rig.pid().expect("gpud runs");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|p| p.display().to_string())
                .filter(|p| p.contains("nvidiactl"))
                .collect()
        })
        .unwrap_or_default()
}

fn within(x: f64, target: f64, tol: f64) -> bool {
    (x - target).abs() <= tol
}

#[tokio::test(flavor = "multi_thread")]
async fn hardware_windows_set_weights_through_each_tenants_own_file_and_are_undone_at_stop() {
    let _serial = SERIAL.lock().await;
    // As the H200: a group off the runlist runs on, disabled channels stop.
    let Some((mut rig, ts)) = world("compute-hw", "channels", true, &["hw-w1", "hw-w3"]).await
    else {
        return;
    };
    set(
        &rig,
        &ts[0],
        &[("compute_weight", zbus::Variant::from(1u32))],
    )
    .await;
    set(
        &rig,
        &ts[1],
        &[("compute_weight", zbus::Variant::from(3u32))],
    )
    .await;
    // The probe (every tenant held for 600 ms, the device's windows read idle) finds that
    // disabling the channels stops the work.
    logged(&rig, "lever=\"FIFO_DISABLE_CHANNELS\"").await;
    // Both tenants' channels are disabled and enabled, through their own clients: a control
    // through any other file would have been refused (the fake checks the client's file).
    let s = groups_until(&rig, "windows on both tenants", |s| {
        s.control_count(DISABLE_CHANNELS) >= 20
    });
    let refused_before = s.stats.refused;
    std::thread::sleep(Duration::from_secs(1));
    expect_shares(
        &rig,
        "weights 1:3 in hardware windows",
        By::Device,
        &ts,
        &[25.0, 75.0],
        6,
    );
    // No control is refused in steady state (each tenant's file is found once and kept).
    let s = rig.fake().snapshot();
    assert!(
        s.stats.refused <= refused_before + 2,
        "controls refused: {} → {}",
        refused_before,
        s.stats.refused
    );
    // gpud holds a tenant's file only for the control in flight (one at a time, from its
    // actuator), never between controls.
    let most = (0..50)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(7));
            held_files(&rig).len()
        })
        .max();
    assert!(most <= Some(1), "gpud held {most:?} tenant files at once");
    // The statistics show the windows.
    let (_c, p) = rig.proxy().await;
    let stats = p.list_compute().await.expect("ListCompute");
    let of = |t: &Tenant| stats.iter().find(|r| r.cgroup == t.cg.rel).cloned();
    let (a, b) = (of(&ts[0]).expect("listed"), of(&ts[1]).expect("listed"));
    assert!(
        within(a.target, 25.0, 0.5) && within(b.target, 75.0, 0.5),
        "{a:?} {b:?}"
    );
    assert!(a.nr_throttled > 10 && a.throttled_usec > 1_000_000, "{a:?}");
    // Stopping gpud enables every channel and leaves nothing stopped or frozen.
    rig.stop();
    let s = rig.fake().snapshot();
    for t in &ts {
        assert!(
            group_of(&s, t).enabled && channels_of(&s, t).all(|c| c.enabled),
            "{:?} {:?} left held",
            group_of(&s, t),
            channels_of(&s, t).collect::<Vec<_>>()
        );
        assert_ne!(
            gpud_tests::process_state(t.pid()),
            'T',
            "tenant {} left stopped",
            t.pid()
        );
        assert!(!t.cg.frozen(), "{} left frozen", t.cg.rel);
    }
}

/// The driver counts channel disables (docs/real-gpu.md, "Hardware controls": on the H200 a
/// tenant whose channels were disabled twice, when its policy changed mid-window, stayed stopped
/// through every later enable). Policies changed back and forth must never leave a tenant
/// stopped: every switch still gives both their shares.
#[tokio::test(flavor = "multi_thread")]
async fn policies_changed_mid_window_never_leave_a_tenant_held() {
    let _serial = SERIAL.lock().await;
    let Some((rig, ts)) = world("compute-switch", "channels", true, &["sw-a", "sw-b"]).await else {
        return;
    };
    let caps = [("compute_max", 30u32), ("compute_max", 70u32)];
    let weights = [("compute_weight", 1u32), ("compute_weight", 3u32)];
    for (round, (policy, targets)) in [(caps, [30.0, 70.0]), (weights, [25.0, 75.0])]
        .into_iter()
        .cycle()
        .take(4)
        .enumerate()
    {
        let (_c, p) = rig.proxy().await;
        for t in &ts {
            p.clear_limits(&t.cg.rel, "0", &["compute_max", "compute_weight"])
                .await
                .expect("ClearLimits");
        }
        for (t, (key, v)) in ts.iter().zip(policy) {
            set(&rig, t, &[(key, zbus::Variant::from(v))]).await;
        }
        std::thread::sleep(Duration::from_secs(2));
        expect_shares(
            &rig,
            &format!("round {round}: {}", policy[0].0),
            By::Device,
            &ts,
            &targets,
            4,
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_that_exits_under_control_takes_its_file_with_it() {
    let _serial = SERIAL.lock().await;
    let Some((rig, mut ts)) = world("compute-exit", "stop", true, &["ex-a", "ex-b"]).await else {
        return;
    };
    set(&rig, &ts[0], &[("compute_max", zbus::Variant::from(40u32))]).await;
    set(&rig, &ts[1], &[("compute_max", zbus::Variant::from(40u32))]).await;
    groups_until(&rig, "windows", |s| s.control_count(DISABLE_CHANNELS) >= 20);
    // Killed mid-window: the driver frees its clients once the last reference to its file is
    // gone, so gpud must not be holding one.
    let b = ts.remove(1);
    let pid = b.pid();
    drop(b);
    let released = rig.fake().wait(Duration::from_secs(5), |s| {
        s.clients.iter().all(|c| c.pid != pid)
    });
    assert!(
        released.is_ok(),
        "the exited tenant's client lives on:\n{}",
        rig.log_text()
    );
    // The other one is controlled on: alone with its cap.
    std::thread::sleep(Duration::from_secs(2));
    expect_shares(
        &rig,
        "a cap of 40 alone after its neighbour exited",
        By::Device,
        &ts,
        &[40.0],
        3,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cap_alone_holds_in_hardware_and_clearing_it_sets_the_tenant_free() {
    let _serial = SERIAL.lock().await;
    let Some((rig, ts)) = world("compute-cap", "stop", true, &["hw-cap"]).await else {
        return;
    };
    set(&rig, &ts[0], &[("compute_max", zbus::Variant::from(30u32))]).await;
    groups_until(&rig, "windows", |s| s.control_count(DISABLE_CHANNELS) >= 10);
    std::thread::sleep(Duration::from_secs(1));
    expect_shares(
        &rig,
        "compute_max=30 alone, hardware windows",
        By::Device,
        &ts,
        &[30.0],
        5,
    );
    let (_c, p) = rig.proxy().await;
    p.clear_limits(&ts[0].cg.rel, "0", &["compute_max"])
        .await
        .expect("ClearLimits");
    groups_until(&rig, "let go", |s| {
        group_of(s, &ts[0]).enabled && channels_of(s, &ts[0]).all(|c| c.enabled)
    });
    std::thread::sleep(Duration::from_millis(500));
    let s = shares(&rig, By::Device, &[&ts[0]], Duration::from_secs(2))[0];
    assert!(
        s > 95.0,
        "still held back after the cap was cleared: {s:.1} %"
    );
}

/// The restorer's sweep (every group put back on the runlist after tenants' controls, which
/// clears their channels' disables) must never lift a hold of the compute law: a neighbour making
/// controls in a loop brings a sweep every 10 ms while a capped tenant's channels are disabled
/// and enabled by the law, and the cap holds as it does alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_cap_holds_while_a_neighbours_controls_bring_sweeps() {
    let _serial = SERIAL.lock().await;
    let Some((rig, ts)) = world("compute-sweep", "stop", true, &["sweep-cap"]).await else {
        return;
    };
    set(&rig, &ts[0], &[("compute_max", zbus::Variant::from(30u32))]).await;
    groups_until(&rig, "windows", |s| s.control_count(DISABLE_CHANNELS) >= 10);
    let cg = Cgroup::new("sweep-noisy");
    let mut noisy = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    let (client, device) = noisy.client_device(0);
    noisy.handle(&format!("subdevice {client} {device}"));
    let group = noisy.handle(&format!("channel-group {client} {device}"));
    noisy.handle(&format!("channel {client} {group}"));
    noisy.ok(&format!("schedule {client} {group} 1"));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looping = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut calls = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                noisy.ok(&format!("timeslice-loop {client} {group} 2048 200"));
                calls += 200;
            }
            (noisy, calls)
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    expect_shares(
        &rig,
        "compute_max=30 with a neighbour's controls bringing sweeps",
        By::Device,
        &ts,
        &[30.0],
        5,
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (_noisy, calls) = looping.join().expect("the neighbour's loop");
    println!("the neighbour made {calls} controls meanwhile");
    assert!(calls > 1000, "the neighbour made only {calls} controls");
}

#[tokio::test(flavor = "multi_thread")]
async fn where_the_firmware_ignores_the_controls_shares_fall_back_to_the_freezer() {
    let _serial = SERIAL.lock().await;
    // `record`: held with either lever, a tenant runs on; the device's windows stay busy.
    let Some((rig, ts)) = world("compute-ignored", "record", true, &["fb-c30", "fb-c70"]).await
    else {
        return;
    };
    set(&rig, &ts[0], &[("compute_max", zbus::Variant::from(30u32))]).await;
    set(&rig, &ts[1], &[("compute_max", zbus::Variant::from(70u32))]).await;
    logged(&rig, "no lever stops the GPU's queued work").await;
    // Whatever the probes held is let go, and the freezer makes the shares.
    groups_until(&rig, "let go", |s| {
        ts.iter()
            .all(|t| group_of(s, t).enabled && channels_of(s, t).all(|c| c.enabled))
    });
    std::thread::sleep(Duration::from_secs(2));
    expect_shares(
        &rig,
        "caps 30/70 by the freezer",
        By::Cpu,
        &ts,
        &[30.0, 70.0],
        8,
    );
}

/// `cgroup.freeze` has two writers: the memory limit's `freeze` action and the compute law's
/// freezer. A cgroup frozen for its memory must stay frozen while the law, which froze and thawed
/// it for a cap, runs on beside it: no thaw the law had planned may undo the memory freeze.
#[tokio::test(flavor = "multi_thread")]
async fn a_memory_frozen_cgroup_stays_frozen_while_the_compute_law_runs_beside_it() {
    let _serial = SERIAL.lock().await;
    let Some(mut rig) = Rig::new("compute-memfreeze")
        .fake_device(1)
        .map(|r| r.fake_gpus(1))
    else {
        return;
    };
    // NVML samples 3 s apart: the law plans its periods from the last one in between, so it
    // learns of the memory freeze up to 3 s late, as on a host sampling every second or more.
    rig.start(
        rig.config()
            .log("gpud=debug")
            .compute(false)
            .react_action("freeze")
            .set("nvml.sample_interval_ms", 3000),
    )
    .await;
    rig.wait_for_gpus(1).await;
    let ts = tenants(&rig, &["memfreeze-capped"]).await;
    let t = &ts[0];
    // A cap: the freezer freezes and thaws the cgroup every period.
    set(&rig, t, &[("compute_max", zbus::Variant::from(30u32))]).await;
    rig.expect_eventually(
        "the law freezes the capped cgroup",
        Duration::from_secs(10),
        || async { t.cg.frozen().then_some(()) },
    )
    .await;
    // Its memory crosses its limit: frozen for that, until the limit is raised.
    rig.set_limit(&t.cg.rel, "all", "memory_max", 4u64 << 20)
        .await;
    let mut m = RmProcess::spawn(Some(&t.cg.dir), &rig.ctl());
    // Spawned into a cgroup the law may have frozen: it answers once thawed.
    let (c, d) = m.client_device(0);
    m.send(&format!("alloc {c} {d} {} nvos64", 8u64 << 20));
    rig.expect_eventually("the memory freeze", Duration::from_secs(10), || async {
        rig.log_text().contains("action=\"frozen\"").then_some(())
    })
    .await;
    // For 2 s, sampled every 2 ms: never thawed.
    let until = std::time::Instant::now() + Duration::from_secs(2);
    let mut samples = 0;
    while std::time::Instant::now() < until {
        let on = std::fs::read_to_string(t.cg.dir.join("cgroup.freeze")).unwrap_or_default();
        assert_eq!(
            on.trim(),
            "1",
            "a memory-frozen cgroup was thawed after {samples} samples:\n{}",
            rig.log_text()
        );
        samples += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    // Raising the limit lets the law have it again.
    rig.set_limit(&t.cg.rel, "all", "memory_max", 1u64 << 30)
        .await;
    rig.expect_eventually(
        "thawed again by the law",
        Duration::from_secs(10),
        || async {
            (std::fs::read_to_string(t.cg.dir.join("cgroup.freeze"))
                .unwrap_or_default()
                .trim()
                == "0")
                .then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn with_hardware_off_no_control_is_issued_and_best_effort_yields_to_latency_critical() {
    let _serial = SERIAL.lock().await;
    let Some((rig, mut ts)) = world("compute-freezer", "stop", false, &["fz-be"]).await else {
        return;
    };
    let be = ts.remove(0);
    set(
        &rig,
        &be,
        &[("priority", zbus::Variant::from("best-effort"))],
    )
    .await;
    std::thread::sleep(Duration::from_secs(1));
    let alone = shares(&rig, By::Cpu, &[&be], Duration::from_secs(2))[0];
    assert!(
        alone > 80.0,
        "best-effort alone was held back: {alone:.1} %"
    );
    // A latency-critical tenant starts: best-effort is frozen within a sample and a period.
    let lc_cg = Cgroup::new("fz-lc");
    {
        let (_c, p) = rig.proxy().await;
        let m = std::collections::BTreeMap::from([(
            "priority",
            zbus::Variant::from("latency-critical"),
        )]);
        p.set_limits(&lc_cg.rel, "0", m).await.expect("SetLimits");
    }
    let woke = Instant::now();
    let mut p = RmProcess::spawn(Some(&lc_cg.dir), &rig.ctl());
    let (client, device) = p.client_device(0);
    let group = p.handle(&format!("channel-group {client} {device}"));
    p.ok("burn");
    let lc = Tenant {
        p,
        cg: lc_cg,
        group,
    };
    scenario(&rig, &[&be, &lc]);
    let frozen = rig
        .expect_eventually("best-effort frozen", Duration::from_secs(5), || async {
            be.cg.frozen().then(|| woke.elapsed())
        })
        .await;
    println!(
        "best-effort frozen {} ms after latency-critical started",
        frozen.as_millis()
    );
    assert!(frozen <= Duration::from_millis(1500), "took {frozen:?}");
    std::thread::sleep(Duration::from_secs(1));
    let got = shares(&rig, By::Cpu, &[&be, &lc], Duration::from_secs(3));
    assert!(
        got[0] <= 5.0 && got[1] >= 80.0,
        "best-effort / latency-critical: {got:?}"
    );
    // compute.hardware = false: the law issued no control (no group taken off the runlist and
    // preempted, no timeslice set). The scheduler guard's sweeps after the tenants' own controls
    // only put groups back on the runlist, which they never left.
    let s = rig.fake().snapshot();
    for t in [&be, &lc] {
        let g = group_of(&s, t);
        assert_eq!(
            (g.enabled, g.preempts, g.timeslice_us),
            (true, 0, 1024),
            "{g:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn priority_classes_get_their_timeslices_and_refused_controls_fall_back_to_the_freezer() {
    let _serial = SERIAL.lock().await;
    let Some((rig, ts)) = world("compute-classes", "stop", true, &["cl-lc", "cl-be"]).await else {
        return;
    };
    set(
        &rig,
        &ts[0],
        &[("priority", zbus::Variant::from("latency-critical"))],
    )
    .await;
    set(
        &rig,
        &ts[1],
        &[("priority", zbus::Variant::from("best-effort"))],
    )
    .await;
    // From the first plan that sees them, with no probe and no hold: a long and a short
    // timeslice.
    let s = groups_until(&rig, "timeslices", |s| {
        group_of(s, &ts[0]).timeslice_us == 16_384 && group_of(s, &ts[1]).timeslice_us == 128
    });
    assert!(
        ts.iter().all(|t| group_of(&s, t).enabled),
        "{:?}",
        s.channel_groups
    );
    // A driver that refuses the controls: the next tenant's first control fails, and its unit
    // is run by the freezer instead (logged once).
    rig.fake()
        .inject(&format!("fail-control {:#x} 0x56 1000", tsg::SET_TIMESLICE))
        .expect("inject");
    let third = tenant(&rig, "cl-normal");
    scenario(&rig, &[&ts[0], &ts[1], &third]);
    set(&rig, &third, &[("compute_max", zbus::Variant::from(50u32))]).await;
    logged(&rig, "its shares fall back to cgroup.freeze").await;
    rig.expect_eventually("the freezer ran", Duration::from_secs(5), || async {
        third.cg.frozen().then_some(())
    })
    .await;
}
