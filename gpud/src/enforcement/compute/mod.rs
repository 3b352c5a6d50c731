//! Compute shares: GPU time caps, weights, guarantees and priority classes.
//!
//! GPU work is submitted through user-mapped doorbells, not system calls, and queued work runs
//! whatever its submitter does next; the GPU itself time-slices channel groups round robin. So
//! the shares are made where the GPU makes them: the law ([`law`]) plans, per GPU and period,
//! exclusive windows on the runlist for each unit and timeslices for the priority classes,
//! issued as RM controls on the tenants' channel groups ([`channel`]), where a probe finds that
//! the firmware honors them; where it does not, or the controls cannot be issued, it falls back
//! to exclusive slots of `cgroup.freeze`. docs/design.md ("Compute shares") says why, and what
//! each mode holds to.
//!
//! The state task sends a [`ControlInput`] at every NVML sample; the compute task ([`run`])
//! owns the law and plans; its actuator thread carries the commands out at their times.

mod actuator;
pub mod channel;
pub mod law;

pub use law::{ComputeStat, targets};

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use self::{
    actuator::{Actuator, Order},
    law::{Command, Firmware, Law, LawParams, Lever, Nanos, Reading, Tenant},
};
use crate::{
    attribution::TenantObjects,
    config::Config,
    notice::{Notice, NoticeBus},
    probes::Matcher,
    report::Chain,
};

/// The law's settings from the configuration: `compute.period_ms`, and the NVML sampling
/// interval, which bounds how soon a tenant can be seen idle.
pub fn params(config: &Config) -> LawParams {
    let sample = config.nvml.sample_interval_ms * 1_000_000;
    let defaults = LawParams::default();
    LawParams {
        period: config.compute.period_ms * 1_000_000,
        idle_after: defaults.idle_after.max(2 * sample + 200_000_000),
        ..defaults
    }
}

/// What the state task knows at an NVML sample, for the law.
#[derive(Clone, Debug)]
pub struct ControlInput {
    /// When NVML was read.
    pub at: Instant,
    /// Processes of every GPU with a context there, by controlled unit.
    pub tenants: Vec<Tenant>,
    /// One per GPU, every GPU (one without processes too: its units are gone).
    pub readings: Vec<Reading>,
    /// cgroups the memory enforcement froze: never thawed here.
    pub memory_frozen: BTreeSet<String>,
    /// The tenants' channel groups, channels and subdevices by process (empty where hardware
    /// controls are off).
    pub groups: BTreeMap<u32, TenantObjects>,
}

/// What the compute task needs from the daemon.
pub struct Settings {
    /// The one writer of `cgroup.freeze` (the memory enforcement writes through it too).
    pub freezer: crate::cgroupfs::Freezer,
    /// Recognizes the tenants' NVIDIA files.
    pub matcher: Matcher,
    pub params: LawParams,
    /// Use the channel-group controls where the firmware honors them (`compute.hardware`).
    pub hardware: bool,
    /// The kernel's record of the groups held off the runlist, for the scheduler guard.
    pub held: Option<channel::HeldGroups>,
}

/// The compute task's channels.
pub struct Links {
    pub input: mpsc::Receiver<ControlInput>,
    /// New settings on a reload.
    pub params: watch::Receiver<LawParams>,
    pub stats: watch::Sender<BTreeMap<String, ComputeStat>>,
    /// Where a cgroup that starts being throttled is announced.
    pub notices: NoticeBus,
    pub shutdown: watch::Receiver<bool>,
}

/// Runs the compute task until shutdown: the law observes every input and plans when a plan
/// runs out or the tenants change; the actuator carries the plans out. At the end everything is
/// thawed and put back on the runlist.
pub async fn run(settings: Settings, mut links: Links) {
    let (failed_tx, mut failures) = mpsc::unbounded_channel();
    let actuator =
        match Actuator::spawn(settings.freezer, settings.matcher, settings.held, failed_tx) {
            Ok(a) => a,
            Err(e) => {
                warn!("compute shares off: cannot start the actuator thread: {e}");
                return;
            }
        };
    let origin = Instant::now();
    let nanos = |t: Instant| t.saturating_duration_since(origin).as_nanos() as Nanos;
    let instant = |n: Nanos| origin + Duration::from_nanos(n);
    let mut law = Law::new(settings.params);
    // Processes whose controls failed: their units are run by the freezer.
    let mut no_hw: BTreeSet<u32> = BTreeSet::new();
    let mut throttled: BTreeSet<String> = BTreeSet::new();
    let mut verdicts: BTreeMap<u32, Firmware> = BTreeMap::new();
    let mut next = Instant::now() + Duration::from_millis(100);
    // A crash may have left channel groups off the runlist: at the first sample every known
    // group is put back on (failures there are only logged).
    let mut recovered = !settings.hardware;
    loop {
        tokio::select! {
            biased;
            _ = links.shutdown.changed() => break,
            input = links.input.recv() => {
                let Some(input) = input else { break };
                let mut tenants = input.tenants;
                for t in &mut tenants {
                    t.hw &= settings.hardware
                        && !no_hw.contains(&t.pid)
                        && input.groups.get(&t.pid).is_some_and(|g| !g.groups.is_empty());
                }
                no_hw.retain(|pid| input.groups.contains_key(pid));
                law.set_memory_frozen(input.memory_frozen);
                law.observe(nanos(input.at), &tenants, &input.readings);
                actuator.send(Order::Groups(input.groups));
                if !recovered {
                    recovered = true;
                    let now = Instant::now();
                    let commands = tenants
                        .iter()
                        .filter(|t| t.hw)
                        .flat_map(|t| {
                            Lever::ALL.map(|lever| {
                                (now, t.gpu, Command::Hold { pid: t.pid, lever, held: false })
                            })
                        })
                        .collect();
                    actuator.send(Order::Plan {
                        commands,
                        replanned: Vec::new(),
                    });
                }
            }
            Some(f) = failures.recv() => {
                warn!(
                    pid = f.pid,
                    "cannot control the process's channel groups, its shares fall back to \
                     cgroup.freeze: {}",
                    Chain(&f.error)
                );
                no_hw.insert(f.pid);
            }
            _ = links.params.changed() => {
                law.set_params(links.params.borrow_and_update().clone());
            }
            _ = tokio::time::sleep_until(next.into()) => {}
        }
        let plan = law.plan(nanos(Instant::now()));
        if !plan.commands.is_empty() || !plan.replanned.is_empty() {
            actuator.send(Order::Plan {
                commands: plan
                    .commands
                    .into_iter()
                    .map(|(t, gpu, c)| (instant(t), gpu, c))
                    .collect(),
                replanned: plan.replanned,
            });
        }
        next = instant(plan.end);
        report_verdicts(&law, &mut verdicts);
        let stats = law.stats();
        for (unit, s) in &stats {
            let now_throttled = s.duty < 99.9;
            if now_throttled && throttled.insert(unit.clone()) {
                links.notices.send(Notice::ComputeThrottled(unit.clone()));
            } else if !now_throttled {
                throttled.remove(unit);
            }
        }
        throttled.retain(|u| stats.contains_key(u));
        links.stats.send_if_modified(|old| {
            let changed = *old != stats;
            *old = stats;
            changed
        });
    }
    actuator.finish(law.release_all());
}

/// Logs what the probes found out about each GPU's firmware, once per change.
fn report_verdicts(law: &Law, seen: &mut BTreeMap<u32, Firmware>) {
    for gpu in law.gpus() {
        let Some(f) = law.firmware(gpu) else { continue };
        if seen.insert(gpu, f) == Some(f) {
            continue;
        }
        match f {
            Firmware::Honors(lever) => info!(
                gpu,
                lever = lever.as_str(),
                "the GPU stops queued work when held with this lever: compute shares set in \
                 hardware"
            ),
            Firmware::Ignores => warn!(
                gpu,
                "no lever stops the GPU's queued work (FIFO_DISABLE_CHANNELS and GPFIFO_SCHEDULE \
                 ignored): compute shares by cgroup.freeze (shares hold where queued work is \
                 shorter than a period; priority classes still by timeslices)"
            ),
            Firmware::Probing { .. } | Firmware::Unknown => {}
        }
    }
}
