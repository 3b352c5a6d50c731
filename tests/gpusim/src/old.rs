//! The daemon's old compute controller (`controller`, a frozen copy) on the simulated GPU:
//! its inputs built from the simulated NVML exactly as the daemon builds them, its periods and
//! freeze times driven in virtual time, its `cgroup.freeze` writes sent to the simulated freezer.
//!
//! What the daemon did between NVML and the controller is mirrored here, not called (it was
//! private to gpud's sampler and state task). The daemon's side as it was when the old controller
//! was replaced (commit d57c160's parent; the files have moved since):
//! - `gpud/src/nvml/sampler.rs`, `sample` and `average_new_samples`: per GPU, the running compute
//!   processes, then `process_utilization_stats(last_seen)` with `NotFound` as "no new sample";
//!   new samples averaged per pid (integer division), `last_seen` advanced to the newest;
//! - `gpud/src/nvml/view.rs`, `NvmlView::by_cgroup`: per (cgroup, GPU) the processes' `sm_util`
//!   summed, capped at 100, `sampled` if any process had a new sample;
//! - `gpud/src/daemon.rs` of that commit, `control_input` (today's `daemon/views.rs`,
//!   `feed_compute`, feeds the new law): each cgroup mapped to its controlled unit (the
//!   deepest cgroup with a compute policy above it, else itself), utilization summed per unit;
//!   a unit sampled reads its sum (≤ 100), one not sampled reads 0 if the GPU had any new
//!   sample, else `None`; GPUs where no unit has a compute policy are left out;
//! - `gpud/src/enforcement/compute.rs` of that commit (today's `enforcement/compute/mod.rs`
//!   runs the law), `run`: `update` with the newest input (if its `seq`
//!   changed) at the start of each period, then the period's plan; periods back to back, each
//!   sleep on tokio's timer (1 ms ticks, deadlines rounded up), so a 100 ms period lasts about
//!   101 ms and drifts against NVML's windows as on a real host.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use gpud::policy::Limits;

mod controller;

use controller::{CgroupInput, ControlInput, Controller as Compute};

use crate::{
    Nanos,
    control::{Controller, Ctx, TenantInfo},
    nvml::ProcessUtilizationSample,
};

/// tokio's timer wheel ticks every millisecond and rounds a deadline up to the next tick.
const TIMER_TICK: Nanos = 1_000_000;
/// From a timer tick to the task running (epoll wake-up, scheduling).
const WAKE_LATENCY: Nanos = 50_000;

/// When a tokio `sleep_until(at)` returns (virtual time 0 taken as a tick).
fn tokio_wake(at: Nanos) -> Nanos {
    at.div_ceil(TIMER_TICK) * TIMER_TICK + WAKE_LATENCY
}

/// The old controller, as configured on the H100 (`compute.period_ms = 100`).
pub struct OldController {
    compute: Compute,
    /// Virtual time 0 as an `Instant` (only differences matter to the controller).
    base: Instant,
    /// Per GPU: the newest sample timestamp consumed (the sampler's `last_seen`).
    last_seen: BTreeMap<u32, u64>,
    input: ControlInput,
    applied_seq: u64,
    /// The current period's freezes still to do, earliest first.
    freezes: Vec<(Nanos, String)>,
    period_end: Nanos,
}

impl OldController {
    pub fn new(period: Nanos) -> Self {
        Self {
            compute: Compute::new(Duration::from_nanos(period)),
            base: Instant::now(),
            last_seen: BTreeMap::new(),
            input: ControlInput::default(),
            applied_seq: 0,
            freezes: Vec::new(),
            period_end: 0,
        }
    }

    /// The controller's statistics per cgroup (duty, target, measured), as `ListCompute` shows.
    pub fn stats(&self) -> BTreeMap<String, gpud::enforcement::compute::ComputeStat> {
        self.compute.stats()
    }

    /// The last input given to the controller.
    pub fn input(&self) -> &ControlInput {
        &self.input
    }

    fn instant(&self, t: Nanos) -> Instant {
        self.base + Duration::from_nanos(t)
    }

    fn nanos(&self, i: Instant) -> Nanos {
        i.saturating_duration_since(self.base).as_nanos() as Nanos
    }

    /// Starts a period at `now`: update on a new input, plan, thaw, and ask to be woken for
    /// each freeze and the period's end.
    fn begin_period(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now();
        if self.input.seq != self.applied_seq {
            self.applied_seq = self.input.seq;
            self.compute.update(&self.input, self.instant(now));
        }
        let plan = self.compute.plan(self.instant(now));
        for path in &plan.thaw {
            ctx.freeze_cgroup(path, false);
            self.compute.set_frozen(path, false);
        }
        self.freezes = plan
            .freeze
            .iter()
            .map(|(at, p)| match self.nanos(*at) {
                // A deadline already past returns at once.
                at if at <= now => (now, p.clone()),
                at => (tokio_wake(at), p.clone()),
            })
            .collect();
        self.period_end = tokio_wake(self.nanos(plan.end));
        for &(at, _) in &self.freezes {
            ctx.wake_at(at);
        }
        ctx.wake_at(self.period_end);
        self.do_freezes(ctx);
    }

    fn do_freezes(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now();
        let due = self.freezes.iter().take_while(|(at, _)| *at <= now).count();
        for (_, path) in self.freezes.drain(..due) {
            ctx.freeze_cgroup(&path, true);
            self.compute.set_frozen(&path, true);
        }
        if self.freezes.is_empty() {
            for path in self.compute.release_gone() {
                ctx.freeze_cgroup(&path, false);
            }
        }
    }
}

/// `average_new_samples` (gpud/src/nvml/mod.rs): per pid, the mean of the samples newer than
/// `last_seen` (integer division), advancing `last_seen` to the newest.
fn average_new_samples(
    samples: &[ProcessUtilizationSample],
    last_seen: &mut u64,
) -> BTreeMap<u32, u32> {
    let since = *last_seen;
    let mut acc: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.timestamp > since) {
        let a = acc.entry(s.pid).or_default();
        a.0 += u64::from(s.sm_util);
        a.1 += 1;
        *last_seen = (*last_seen).max(s.timestamp);
    }
    acc.into_iter()
        .map(|(pid, (sm, n))| (pid, (sm / n) as u32))
        .collect()
}

/// The controller's input from what NVML returns now, as the daemon builds it (module docs).
pub fn control_input(ctx: &Ctx<'_>, last_seen: &mut BTreeMap<u32, u64>, seq: u64) -> ControlInput {
    let nvml = ctx.nvml();
    // The sampler (`nvml::sample`): per GPU and pid, `Some(util)` when sampled this time.
    let mut processes: Vec<(u32, u32, Option<u32>)> = Vec::new();
    for gpu in 0..nvml.device_count() {
        let mut procs: BTreeMap<u32, Option<u32>> = nvml
            .running_compute_processes(gpu)
            .unwrap_or_default()
            .iter()
            .map(|p| (p.pid, None))
            .collect();
        let seen = last_seen.get(&gpu).copied();
        // NotFound: no sample newer than `seen` (the daemon reads it as none).
        let samples = nvml
            .process_utilization_stats(gpu, seen)
            .unwrap_or_default();
        let newest = last_seen.entry(gpu).or_insert(0);
        for (pid, sm) in average_new_samples(&samples, newest) {
            procs.insert(pid, Some(sm));
        }
        processes.extend(procs.into_iter().map(|(pid, sm)| (gpu, pid, sm)));
    }
    // `NvmlView::by_cgroup`: per (cgroup, GPU), summed and capped; sampled if any was.
    let mut by_cgroup: BTreeMap<(String, u32), (u32, bool)> = BTreeMap::new();
    for &(gpu, pid, sm) in &processes {
        let cgroup = ctx.cgroup_of(pid).unwrap_or_default().to_owned();
        let e = by_cgroup.entry((cgroup, gpu)).or_default();
        e.0 += sm.unwrap_or(0);
        e.1 |= sm.is_some();
    }
    // `daemon::control_input`.
    let policies: Vec<&TenantInfo> = ctx
        .tenants()
        .iter()
        .filter(|t| t.limits.has_compute())
        .collect();
    let unit_of = |path: &str| -> String {
        policies
            .iter()
            .map(|t| t.cgroup.as_str())
            .filter(|p| path == *p || path.starts_with(&format!("{}/", p.trim_end_matches('/'))))
            .max_by_key(|p| p.len())
            .unwrap_or(path)
            .to_owned()
    };
    let mut per_gpu: BTreeMap<u32, BTreeMap<String, (f64, bool)>> = BTreeMap::new();
    for ((cgroup, gpu), (sm, sampled)) in by_cgroup {
        if cgroup.is_empty() {
            continue;
        }
        let e = per_gpu
            .entry(gpu)
            .or_default()
            .entry(unit_of(&cgroup))
            .or_default();
        e.0 += f64::from(sm.min(100));
        e.1 |= sampled;
    }
    let limits_of = |path: &str, gpu: u32| -> Limits {
        ctx.tenants()
            .iter()
            .find(|t| t.cgroup == path && t.gpu == gpu && t.limits.has_compute())
            .map(|t| t.limits.clone())
            .unwrap_or_default()
    };
    let gpus = per_gpu
        .iter()
        .map(|(&gpu, units)| {
            let gpu_sampled = units.values().any(|(_, s)| *s);
            let list: Vec<CgroupInput> = units
                .iter()
                .map(|(path, (util, sampled))| CgroupInput {
                    path: path.clone(),
                    util: if *sampled {
                        Some(util.min(100.0))
                    } else if gpu_sampled {
                        Some(0.0)
                    } else {
                        None
                    },
                    limits: limits_of(path, gpu),
                })
                .collect();
            (gpu, list)
        })
        .filter(|(_, list)| list.iter().any(|c| c.limits.has_compute()))
        .collect();
    ControlInput {
        seq,
        gpus,
        memory_frozen: BTreeSet::new(),
    }
}

impl Controller for OldController {
    fn start(&mut self, ctx: &mut Ctx<'_>) {
        self.begin_period(ctx);
    }

    fn on_sample(&mut self, ctx: &mut Ctx<'_>) {
        let seq = self.input.seq + 1;
        self.input = control_input(ctx, &mut self.last_seen, seq);
    }

    fn on_wake(&mut self, ctx: &mut Ctx<'_>) {
        if ctx.now() >= self.period_end {
            self.freezes.clear();
            self.begin_period(ctx);
        } else {
            self.do_freezes(ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_samples_are_averaged_once() {
        let s = |pid, timestamp, sm_util| ProcessUtilizationSample {
            pid,
            timestamp,
            sm_util,
            ..ProcessUtilizationSample::default()
        };
        let mut seen = 0;
        let first = [s(1, 10, 40), s(1, 20, 61), s(2, 20, 10)];
        assert_eq!(
            average_new_samples(&first, &mut seen),
            BTreeMap::from([(1, 50), (2, 10)])
        );
        assert_eq!(seen, 20);
        assert!(average_new_samples(&first, &mut seen).is_empty());
    }
}
