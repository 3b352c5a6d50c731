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

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
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
    policy::{DEFAULT_WEIGHT, Limits, Priority},
    probes::Matcher,
    report::Chain,
};

/// Utilization (percent) under which a cgroup counts as idle on a GPU.
const ACTIVE_UTIL: f64 = 3.0;

/// Per cgroup, what the controller does and has done (like `cpu.stat`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ComputeStat {
    /// Share of each period the cgroup may run (percent).
    pub duty: f64,
    /// Target utilization (percent of one GPU), summed over its GPUs.
    pub target: f64,
    /// Measured utilization in the last sample (percent), summed over its GPUs.
    pub measured: f64,
    /// Time spent frozen by the controller.
    pub throttled_usec: u64,
    /// Periods in which it was frozen at all.
    pub nr_throttled: u64,
}

/// The target utilization of each cgroup on one GPU (percent), from demands and policies.
///
/// Work-conserving weighted shares of the GPU's 100 %, each capped by `compute_max` and by what
/// the cgroup asks for; `compute_min` is then honoured by taking from the others; an active
/// latency-critical cgroup leaves best-effort cgroups nothing.
pub fn targets(cgroups: &[(f64, &Limits)]) -> Vec<f64> {
    let n = cgroups.len();
    let lc_active = cgroups
        .iter()
        .any(|(d, l)| *d >= ACTIVE_UTIL && l.priority == Some(Priority::LatencyCritical));
    let cap = |i: usize| {
        let (d, l) = cgroups[i];
        let max = l.compute_max.map_or(100.0, f64::from);
        if lc_active && l.priority == Some(Priority::BestEffort) {
            0.0
        } else {
            d.min(max)
        }
    };
    let weight = |i: usize| f64::from(cgroups[i].1.compute_weight.unwrap_or(DEFAULT_WEIGHT));
    // Water-filling: whoever needs less than its weighted share gets its need; the rest is shared
    // by weight among the others.
    let mut target = vec![0.0; n];
    let mut open: Vec<usize> = (0..n).collect();
    let mut remaining = 100.0f64;
    loop {
        let total_w: f64 = open.iter().map(|&i| weight(i)).sum();
        if open.is_empty() || total_w <= 0.0 {
            break;
        }
        let satisfied: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| cap(i) <= remaining * weight(i) / total_w)
            .collect();
        if satisfied.is_empty() {
            for &i in &open {
                target[i] = remaining * weight(i) / total_w;
            }
            break;
        }
        for &i in &satisfied {
            target[i] = cap(i);
            remaining -= cap(i);
        }
        open.retain(|i| !satisfied.contains(i));
    }
    // Guarantees: raise to min(compute_min, demand), taking from those above their own floor.
    for i in 0..n {
        let (d, l) = cgroups[i];
        let Some(min) = l.compute_min else { continue };
        let need = f64::from(min).min(d).min(cap(i).max(f64::from(min).min(d)));
        if target[i] >= need {
            continue;
        }
        let mut deficit = need - target[i];
        target[i] = need;
        let floor = |j: usize| f64::from(cgroups[j].1.compute_min.unwrap_or(0)).min(cgroups[j].0);
        let spare: f64 = (0..n)
            .filter(|&j| j != i)
            .map(|j| (target[j] - floor(j)).max(0.0))
            .sum();
        if spare <= 0.0 {
            continue;
        }
        for j in (0..n).filter(|&j| j != i) {
            let give = (target[j] - floor(j)).max(0.0) / spare * deficit.min(spare);
            target[j] -= give;
        }
        deficit -= deficit.min(spare);
        let _ = deficit;
    }
    target
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn l(max: Option<u32>, w: Option<u32>, min: Option<u32>, p: Option<Priority>) -> Limits {
        Limits {
            compute_max: max,
            compute_weight: w,
            compute_min: min,
            priority: p,
            ..Limits::default()
        }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 0.01)
    }

    #[test]
    fn shares() {
        let none = l(None, None, None, None);
        // A cap binds even alone.
        let capped = l(Some(30), None, None, None);
        assert!(close(&targets(&[(100.0, &capped)]), &[30.0]));
        // Weights 1:3 under contention; work-conserving when one is idle.
        let (w1, w3) = (l(None, Some(1), None, None), l(None, Some(3), None, None));
        assert!(close(
            &targets(&[(100.0, &w1), (100.0, &w3)]),
            &[25.0, 75.0]
        ));
        assert!(close(&targets(&[(100.0, &w1), (0.0, &w3)]), &[100.0, 0.0]));
        // Someone needing less than its share leaves the rest to the others.
        assert!(close(
            &targets(&[(10.0, &none), (100.0, &none), (100.0, &none)]),
            &[10.0, 45.0, 45.0]
        ));
        // A guarantee is taken from the others.
        let min60 = l(None, None, Some(60), None);
        assert!(close(
            &targets(&[(100.0, &min60), (100.0, &none)]),
            &[60.0, 40.0]
        ));
        // ... but never more than the guaranteed one asks for.
        assert!(close(
            &targets(&[(20.0, &min60), (100.0, &none)]),
            &[20.0, 80.0]
        ));
        // An active latency-critical cgroup leaves best-effort nothing; idle, it leaves it all.
        let lc = l(None, None, None, Some(Priority::LatencyCritical));
        let be = l(None, None, None, Some(Priority::BestEffort));
        assert!(close(&targets(&[(50.0, &lc), (100.0, &be)]), &[50.0, 0.0]));
        assert!(close(&targets(&[(0.0, &lc), (100.0, &be)]), &[0.0, 100.0]));
    }
}
