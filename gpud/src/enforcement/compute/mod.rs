//! Compute shares: GPU time caps, weights, guarantees and priority classes, enforced by pausing
//! and resuming the submitting processes (`cgroup.freeze`) in duty cycles.
//!
//! GPU work is submitted through user-mapped doorbells, so the only lever on stock drivers is the
//! submitter itself: a frozen process submits nothing, and the GPU time it uses falls once its
//! queued kernels drain. Each GPU's controller turns measured utilization (NVML samples) and the
//! policies into a target per cgroup, and a duty cycle per cgroup into freeze/thaw times within a
//! period. This module owns the duty cycles, what it froze, and the throttling statistics; it runs
//! as a task of its own and gets its inputs from the state task over a watch channel.
//!
//! The decisions ([`Controller::update`], [`Controller::plan`]) take the time as an argument and
//! do no I/O, so the simulated GPU (tests/gpusim) can drive the same controller in virtual time;
//! [`Controller::period`] and [`run`] do the real clock and `cgroup.freeze` writes.

pub mod law;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use tracing::{debug, info, warn};

use crate::policy::{DEFAULT_WEIGHT, Limits, Priority};

/// Utilization (percent) under which a cgroup counts as idle on a GPU.
const ACTIVE_UTIL: f64 = 3.0;
/// Integral gain of the duty-cycle correction (duty change per point of error / 100).
const GAIN: f64 = 0.6;
/// Weight of a new utilization sample in the running average. Real GPUs time-slice processes and
/// NVML's per-process samples read 0 or ~100 depending on who held the GPU in the sample, so
/// single samples are noise; the simulated GPU's samples are exact and lose little to this.
const SMOOTHING: f64 = 0.25;
/// Smallest duty of a cgroup that is allowed any GPU time: it keeps running a little in every
/// period, so NVML keeps sampling it (NVML reports only processes that used the GPU).
const MIN_DUTY: f64 = 0.02;
/// A cgroup without any utilization sample for this long is taken as idle.
const SAMPLE_TIMEOUT: Duration = Duration::from_millis(500);

/// One cgroup on one GPU, as the state task sees it at a sample.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CgroupInput {
    /// Path relative to the cgroup v2 root.
    pub path: String,
    /// SM utilization in the last sample (percent of one GPU); `None` when NVML returned no new
    /// sample for it (which does not mean idle).
    pub util: Option<f64>,
    /// The policy in force for this GPU (defaults where unset).
    pub limits: Limits,
}

/// What the controller works from; `seq` changes with every sample.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ControlInput {
    pub seq: u64,
    pub gpus: BTreeMap<u32, Vec<CgroupInput>>,
    /// cgroups the memory enforcement froze: never thawed here.
    pub memory_frozen: BTreeSet<String>,
}

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

#[derive(Default)]
struct Slot {
    frozen: bool,
    throttled: bool,
    stat: ComputeStat,
}

/// What one period does, decided from the duties alone: thaw `thaw` at the start, freeze each of
/// `freeze` at its time, then [`Controller::release_gone`]; the period ends at `end`.
#[derive(Clone, Debug, PartialEq)]
pub struct PeriodPlan {
    /// Frozen cgroups that may run in this period.
    pub thaw: Vec<String>,
    /// cgroups to freeze at the end of their share, earliest first.
    pub freeze: Vec<(Instant, String)>,
    /// cgroups that started being throttled in this period.
    pub started: Vec<String>,
    pub end: Instant,
}

/// The controller: duty cycles per cgroup, actuated every `period`.
pub struct Controller {
    root: PathBuf,
    period: Duration,
    /// Per (path, GPU): duty cycle in [0, 1].
    duties: BTreeMap<(String, u32), f64>,
    /// Per (path, GPU): running average of the measured utilization and when it last had a
    /// sample.
    util: BTreeMap<(String, u32), (f64, Instant)>,
    slots: BTreeMap<String, Slot>,
    memory_frozen: BTreeSet<String>,
}

impl Controller {
    pub fn new(root: PathBuf, period: Duration) -> Self {
        Self {
            root,
            period,
            duties: BTreeMap::new(),
            util: BTreeMap::new(),
            slots: BTreeMap::new(),
            memory_frozen: BTreeSet::new(),
        }
    }

    fn write_freeze(&self, path: &str, frozen: bool) -> bool {
        match crate::cgroupfs::freeze_at(&self.root, path, frozen) {
            Ok(()) => true,
            Err(e) => {
                debug!(cgroup = path, "{}", crate::report::Chain(&e));
                false
            }
        }
    }

    /// Updates duty cycles from a new sample taken at about `now`.
    pub fn update(&mut self, input: &ControlInput, now: Instant) {
        self.memory_frozen = input.memory_frozen.clone();
        let mut seen: BTreeSet<(String, u32)> = BTreeSet::new();
        let mut measured: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for (&gpu, cgroups) in &input.gpus {
            let utils: Vec<f64> = cgroups
                .iter()
                .map(|c| {
                    let key = (c.path.clone(), gpu);
                    let prev = self.util.get(&key).copied();
                    // No sample for a while: it did not use the GPU.
                    let sample = match (c.util, prev) {
                        (None, Some((_, at))) if now - at > SAMPLE_TIMEOUT => Some(0.0),
                        (s, _) => s,
                    };
                    let (u, at) = match (prev, sample) {
                        (Some((p, _)), Some(u)) => (p + SMOOTHING * (u - p), now),
                        (None, Some(u)) => (u, now),
                        (Some((p, at)), None) => (p, at),
                        (None, None) => (0.0, now),
                    };
                    self.util.insert(key, (u, at));
                    u
                })
                .collect();
            // Demand: what each would use unthrottled, from its utilization at its duty.
            let demands: Vec<f64> = cgroups
                .iter()
                .zip(&utils)
                .map(|(c, util)| {
                    let duty = self
                        .duties
                        .get(&(c.path.clone(), gpu))
                        .copied()
                        .unwrap_or(1.0);
                    if duty >= 0.05 {
                        (util / duty).min(100.0)
                    } else {
                        // Frozen: assume it still wants the whole GPU.
                        100.0
                    }
                })
                .collect();
            let pairs: Vec<(f64, &Limits)> = demands
                .iter()
                .copied()
                .zip(cgroups.iter().map(|c| &c.limits))
                .collect();
            let t = targets(&pairs);
            for (i, c) in cgroups.iter().enumerate() {
                let key = (c.path.clone(), gpu);
                let duty = self.duties.get(&key).copied().unwrap_or(1.0);
                let new = if t[i] >= demands[i] - 0.5 {
                    // Not limited: run freely (ramping up fast).
                    (duty + 0.5).min(1.0)
                } else if t[i] <= 0.0 {
                    0.0
                } else {
                    let model = t[i] / demands[i].max(1.0);
                    let corrected = duty + GAIN * (t[i] - utils[i]) / 100.0;
                    // From unthrottled, jump to the model; then correct on the error.
                    if duty >= 1.0 { model } else { corrected }.clamp(MIN_DUTY, 1.0)
                };
                self.duties.insert(key.clone(), new);
                seen.insert(key);
                let m = measured.entry(c.path.clone()).or_default();
                m.0 += t[i];
                m.1 += utils[i];
            }
        }
        // cgroups no longer reported run freely.
        self.duties.retain(|k, _| seen.contains(k));
        self.util.retain(|k, _| seen.contains(k));
        for (path, (target, util)) in measured {
            let slot = self.slots.entry(path).or_default();
            slot.stat.target = target;
            slot.stat.measured = util;
        }
    }

    /// The duty of a cgroup: the smallest over its GPUs (one freezer for all of them).
    fn duty_of(&self, path: &str) -> f64 {
        self.duties
            .iter()
            .filter(|((p, _), _)| p == path)
            .map(|(_, d)| *d)
            .fold(1.0, f64::min)
    }

    /// Plans the period starting at `start`: who is thawed, who is frozen when, and who started
    /// being throttled; updates the duty and throttling statistics. What was actually written is
    /// reported back with [`Controller::set_frozen`].
    pub fn plan(&mut self, start: Instant) -> PeriodPlan {
        let paths: BTreeSet<String> = self.duties.keys().map(|(p, _)| p.clone()).collect();
        let mut thaw = Vec::new();
        let mut throttled_now: Vec<(f64, String)> = Vec::new();
        let mut started = Vec::new();
        for path in paths {
            if self.memory_frozen.contains(&path) {
                continue;
            }
            let duty = self.duty_of(&path);
            let throttled = duty < 0.999;
            let slot = self.slots.entry(path.clone()).or_default();
            if duty > 0.0 && slot.frozen {
                thaw.push(path.clone());
            }
            slot.stat.duty = duty * 100.0;
            if throttled {
                slot.stat.nr_throttled += 1;
                slot.stat.throttled_usec += ((1.0 - duty) * self.period.as_micros() as f64) as u64;
                if !slot.throttled {
                    started.push(path.clone());
                }
            }
            slot.throttled = throttled;
            if throttled {
                throttled_now.push((duty, path));
            }
        }
        throttled_now.sort_by(|a, b| a.0.total_cmp(&b.0));
        let freeze = throttled_now
            .into_iter()
            .map(|(duty, path)| (start + self.period.mul_f64(duty), path))
            .collect();
        PeriodPlan {
            thaw,
            freeze,
            started,
            end: start + self.period,
        }
    }

    /// Records that `cgroup.freeze` of `path` was written (`frozen`: with 1).
    pub fn set_frozen(&mut self, path: &str, frozen: bool) {
        self.slots.entry(path.to_owned()).or_default().frozen = frozen;
    }

    /// Forgets the cgroups no longer controlled; returns those of them to thaw (frozen here, not
    /// by the memory enforcement).
    pub fn release_gone(&mut self) -> Vec<String> {
        let controlled: BTreeSet<String> = self.duties.keys().map(|(p, _)| p.clone()).collect();
        let gone: Vec<String> = self
            .slots
            .keys()
            .filter(|p| !controlled.contains(*p))
            .cloned()
            .collect();
        let mut thaw = Vec::new();
        for p in gone {
            if self.slots.get(&p).is_some_and(|s| s.frozen) && !self.memory_frozen.contains(&p) {
                thaw.push(p.clone());
            }
            self.slots.remove(&p);
        }
        thaw
    }

    /// One period: thaw whoever may run, freeze each at the end of its share. Returns the
    /// cgroups that started being throttled.
    pub async fn period(&mut self) -> Vec<String> {
        let plan = self.plan(Instant::now());
        for path in &plan.thaw {
            if self.write_freeze(path, false) {
                self.set_frozen(path, false);
            }
        }
        for (at, path) in &plan.freeze {
            tokio::time::sleep_until((*at).into()).await;
            if self.write_freeze(path, true) {
                self.set_frozen(path, true);
            }
        }
        // Slots of cgroups no longer controlled: thawed, forgotten.
        for p in self.release_gone() {
            self.write_freeze(&p, false);
        }
        tokio::time::sleep_until(plan.end.into()).await;
        plan.started
    }

    pub fn stats(&self) -> BTreeMap<String, ComputeStat> {
        self.slots
            .iter()
            .map(|(p, s)| (p.clone(), s.stat.clone()))
            .collect()
    }

    /// Thaws everything this controller froze (shutdown).
    pub fn thaw_all(&mut self) {
        let frozen: Vec<String> = self
            .slots
            .iter()
            .filter(|(p, s)| s.frozen && !self.memory_frozen.contains(*p))
            .map(|(p, _)| p.clone())
            .collect();
        for p in frozen {
            if self.write_freeze(&p, false) {
                info!(cgroup = %p, "thawed at shutdown");
            }
        }
    }
}

/// Runs the controller until shutdown: re-plans on every new input, actuates every period (whose
/// length `period` may change on a reload),
/// publishes statistics and the cgroups that start being throttled; thaws what it froze on exit.
pub async fn run(
    mut controller: Controller,
    mut input: watch::Receiver<ControlInput>,
    period: watch::Receiver<Duration>,
    stats: watch::Sender<BTreeMap<String, ComputeStat>>,
    throttled: broadcast::Sender<String>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut seq = 0;
    loop {
        if *shutdown.borrow() {
            break;
        }
        // A reload may change the period; it applies from the next one.
        controller.period = *period.borrow();
        {
            let current = input.borrow_and_update().clone();
            if current.seq != seq {
                seq = current.seq;
                controller.update(&current, Instant::now());
            }
        }
        tokio::select! {
            started = controller.period() => {
                for path in started {
                    debug!(cgroup = %path, "compute throttling started");
                    let _ = throttled.send(path);
                }
                let _ = stats.send(controller.stats());
            }
            _ = shutdown.changed() => break,
        }
    }
    controller.thaw_all();
    if controller.slots.values().any(|s| s.frozen) {
        warn!("some cgroups could not be thawed");
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
