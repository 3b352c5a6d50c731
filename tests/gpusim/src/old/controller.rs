//! The compute controller gpud shipped until the control law (`gpud::enforcement::compute::law`)
//! replaced it: duty cycles of `cgroup.freeze` corrected from NVML's per-process utilization.
//! Kept here, frozen as it was (its decisions only: the clock and the writes are `super`'s), so
//! that `cargo xtask bench compute --controller old` measures the new law against it in one
//! run; docs/benchmarks.md gives both. Not to be changed, except to follow gpud's types.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use gpud::{
    enforcement::compute::{ComputeStat, targets},
    policy::Limits,
};

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
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            duties: BTreeMap::new(),
            util: BTreeMap::new(),
            slots: BTreeMap::new(),
            memory_frozen: BTreeSet::new(),
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

    pub fn stats(&self) -> BTreeMap<String, ComputeStat> {
        self.slots
            .iter()
            .map(|(p, s)| (p.clone(), s.stat.clone()))
            .collect()
    }
}
