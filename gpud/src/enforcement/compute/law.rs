//! The control law of compute shares, free of clocks and I/O: it takes what NVML said (per GPU,
//! the running processes and the new per-process utilization samples) and the policies, and
//! plans the commands of each period — hardware controls on the tenants' channel groups
//! (runlist on/off, timeslice) where the driver honors them, `cgroup.freeze` otherwise. The
//! daemon's actuator (`super::run`) carries them out at their times; the simulated GPU
//! (tests/gpusim) drives the same code in virtual time.
//!
//! Why it holds on queued, time-sliced hardware (docs/design.md, "Compute shares"):
//! - shares are made where the GPU makes them, not read back from it: each normal unit gets an
//!   exclusive window of every 50 ms cycle in proportion to its target, on the runlist alone —
//!   taken off, its queued work stops within the preemption latency instead of draining — so
//!   its share does not depend on its queue depth or on how NVML samples; caps leave part of
//!   the cycle idle; latency-critical and best-effort units stay on the runlist with a long and
//!   a short timeslice, so the GPU's own round robin lets a request in within one short slice;
//! - the law never reads a tenant's demand from its utilization (under time-slicing every
//!   saturating tenant reads about the same): a tenant is active while NVML lists it (or the
//!   law keeps it from running), and active tenants are taken as saturating;
//! - NVML's per-process samples name whoever held the engine at the sample: unbiased only where
//!   the schedule does not alias with the 1/6 s sampling, and coarse; they give the measured
//!   share that is reported, and tell the firmware's behaviour apart (a probe: a tenant taken
//!   off the runlist that NVML still lists ran anyway);
//! - where the firmware ignores the controls, or they cannot be issued, the fallback gives each
//!   active unit an exclusive slot of a cycle by freezing the others; what a frozen tenant had
//!   queued drains into the next slot, which cancels out between tenants with like queues, so
//!   the fallback holds where queued work is shorter than the smallest slot (slots last at
//!   least a period and five thaw latencies).

use std::collections::{BTreeMap, BTreeSet};

use super::{ComputeStat, targets};
use crate::policy::{Limits, Priority};

/// Nanoseconds of a monotonic clock (the daemon's `Instant`s, or virtual time).
pub type Nanos = u64;

const MS: Nanos = 1_000_000;

/// The law's settings (`[compute]` in the configuration, and the defaults of this module).
#[derive(Clone, Debug, PartialEq)]
pub struct LawParams {
    /// Length of one control period (`compute.period_ms`).
    pub period: Nanos,
    /// How long a thaw takes to let a frozen cgroup run again; it is thawed that early.
    pub thaw_latency: Nanos,
    /// A tenant NVML has not listed for this long (while it could run) is idle.
    pub idle_after: Nanos,
    /// How long the firmware probe keeps one tenant off the runlist.
    pub probe: Nanos,
    /// Timeslice of a tenant with the mean target (µs; twice RM's default, so that switches cost
    /// about 1 % of the GPU).
    pub base_timeslice_us: u64,
    /// Bounds of the timeslices set (µs).
    pub min_timeslice_us: u64,
    pub max_timeslice_us: u64,
    /// Time constant of the measured shares' average.
    pub tau: Nanos,
}

impl Default for LawParams {
    fn default() -> Self {
        Self {
            period: 100 * MS,
            thaw_latency: 15 * MS,
            idle_after: 600 * MS,
            probe: 1_000 * MS,
            base_timeslice_us: 2048,
            min_timeslice_us: 128,
            max_timeslice_us: 16_384,
            tau: 5_000 * MS,
        }
    }
}

/// A process the law may control: a member of a controlled unit on one GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    pub pid: u32,
    pub gpu: u32,
    /// The controlled unit: the deepest cgroup with a compute policy above the process's cgroup,
    /// else its own cgroup.
    pub unit: String,
    /// The unit's policy on this GPU (defaults where unset).
    pub limits: Limits,
    /// Whether the daemon can issue controls on the process's channel groups.
    pub hw: bool,
}

/// One per-process utilization sample (nvmlProcessUtilizationSample_t).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcSample {
    pub pid: u32,
    /// NVML's timestamp (µs); samples of one window share it.
    pub timestamp_us: u64,
    pub sm_util: u32,
}

/// What one NVML read of one GPU returned.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    pub gpu: u32,
    /// Processes with a context on the GPU.
    pub running: Vec<u32>,
    /// Samples newer than the previous read's.
    pub samples: Vec<ProcSample>,
}

/// Something to do at a time of the period.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Command {
    /// `cgroup.freeze` of a unit.
    Freeze { unit: String, frozen: bool },
    /// A process's channel groups on (or off) the runlist; off also preempts them.
    Schedule { pid: u32, enabled: bool },
    /// A process's channel groups' timeslice.
    Timeslice { pid: u32, us: u64 },
}

/// Commands by time and GPU, and when the law wants to plan again. Commands may lie beyond
/// `end` (a freezer cycle longer than the period): they stand, and the next plan adds to them,
/// except for the GPUs in `replanned`, whose earlier commands still pending are void (the GPU's
/// tenants or their policies changed).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub commands: Vec<(Nanos, u32, Command)>,
    pub replanned: Vec<u32>,
    pub end: Nanos,
}

/// What the law knows of a GPU's firmware.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Firmware {
    /// Not probed yet.
    Unknown,
    /// A tenant is off the runlist until `until`; `since` is when it was taken off.
    Probing {
        pid: u32,
        since: Nanos,
        until: Nanos,
    },
    /// Controls take effect: shares are set in hardware.
    Honors,
    /// Controls are accepted and ignored (or cannot be issued): the freezer fallback.
    Ignores,
}

/// An exponentially weighted average over NVML windows, with its weight so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Average {
    value: f64,
    weight: f64,
}

impl Average {
    fn add(&mut self, x: f64, alpha: f64) {
        self.weight = self.weight * (1.0 - alpha) + alpha;
        self.value += (x - self.value) * alpha / self.weight.max(alpha);
    }
}

#[derive(Clone, Debug, Default)]
struct Unit {
    pids: BTreeSet<u32>,
    limits: Limits,
    hw: bool,
    /// When it was first seen running, and last listed by NVML.
    since: Nanos,
    listed: Option<Nanos>,
    /// Until when the law keeps it from running part of the time (frozen or off the runlist):
    /// NVML cannot list it while it is stopped, so it counts as active until then.
    stopped: Option<Nanos>,
    /// Measured share (fraction of the GPU), from NVML's windows.
    share: Average,
    target: f64,
    /// Timeslice set on its groups (µs), and whether they are on the runlist / it is frozen.
    timeslice: Option<u64>,
    off: bool,
    frozen: bool,
    stat: ComputeStat,
}

#[derive(Clone, Debug)]
struct Gpu {
    firmware: Firmware,
    units: BTreeMap<String, Unit>,
    /// Newest window already counted.
    last_window: u64,
    /// NVML's window length as seen (the shortest gap between windows, µs): a window in which
    /// nothing ran has no samples at all, and must still count as 0 for everyone.
    window_us: Option<u64>,
    /// A varying offset of the windows in the period, so that NVML's sample instants see every
    /// part of it (a fixed phase aliases with the 1/6 s sampling).
    phase: u64,
    /// When its current plan ends (the freezer's cycle may span several periods).
    next: Nanos,
    /// The active units and their policies the current plan was made for.
    planned: Vec<(String, Limits)>,
}

impl Default for Gpu {
    fn default() -> Self {
        Self {
            firmware: Firmware::Unknown,
            units: BTreeMap::new(),
            last_window: 0,
            window_us: None,
            phase: 0x9e37_79b9,
            next: 0,
            planned: Vec::new(),
        }
    }
}

/// The law, for every GPU.
#[derive(Clone, Debug)]
pub struct Law {
    params: LawParams,
    gpus: BTreeMap<u32, Gpu>,
    /// Units the memory enforcement froze: left alone.
    held: BTreeSet<String>,
}

impl Law {
    pub fn new(params: LawParams) -> Self {
        Self {
            params,
            gpus: BTreeMap::new(),
            held: BTreeSet::new(),
        }
    }

    pub fn params(&self) -> &LawParams {
        &self.params
    }

    pub fn set_period(&mut self, period: Nanos) {
        self.params.period = period;
    }

    /// What the law knows of `gpu`'s firmware.
    pub fn firmware(&self, gpu: u32) -> Option<Firmware> {
        self.gpus.get(&gpu).map(|g| g.firmware)
    }

    /// Units another owner froze (the memory limits' `freeze` action): never thawed here.
    pub fn set_held(&mut self, held: BTreeSet<String>) {
        self.held = held;
    }

    /// Takes one NVML read per GPU and the tenants the daemon knows at `now`.
    pub fn observe(&mut self, now: Nanos, tenants: &[Tenant], readings: &[Reading]) {
        let alpha_per_window = 1.0 / 6.0 / (self.params.tau as f64 / 1e9);
        for r in readings {
            let g = self.gpus.entry(r.gpu).or_default();
            // Membership: units of running processes.
            let mut seen: BTreeMap<String, (BTreeSet<u32>, Limits, bool)> = BTreeMap::new();
            for t in tenants
                .iter()
                .filter(|t| t.gpu == r.gpu && r.running.contains(&t.pid))
            {
                let e = seen
                    .entry(t.unit.clone())
                    .or_insert_with(|| (BTreeSet::new(), t.limits.clone(), true));
                e.0.insert(t.pid);
                e.2 &= t.hw;
            }
            g.units.retain(|u, _| seen.contains_key(u));
            for (name, (pids, limits, hw)) in seen {
                let u = g.units.entry(name).or_insert_with(|| Unit {
                    since: now,
                    ..Unit::default()
                });
                u.pids = pids;
                u.limits = limits;
                u.hw = hw;
            }
            // Windows: samples grouped by timestamp, oldest first.
            let mut windows: BTreeMap<u64, BTreeMap<u32, u32>> = BTreeMap::new();
            for s in r.samples.iter().filter(|s| s.timestamp_us > g.last_window) {
                *windows
                    .entry(s.timestamp_us)
                    .or_default()
                    .entry(s.pid)
                    .or_default() += s.sm_util;
            }
            for (ts, by_pid) in windows {
                // Windows with no samples since the previous one: nobody ran, all read 0.
                if g.last_window > 0 {
                    let gap = ts - g.last_window;
                    if gap >= 10_000 {
                        g.window_us = Some(g.window_us.map_or(gap, |w| w.min(gap)));
                    }
                    let skipped = g
                        .window_us
                        .map_or(0, |w| (gap as f64 / w as f64).round() as u64)
                        .saturating_sub(1)
                        .min(64);
                    for _ in 0..skipped {
                        for u in g.units.values_mut() {
                            u.share.add(0.0, alpha_per_window);
                        }
                    }
                }
                g.last_window = g.last_window.max(ts);
                for u in g.units.values_mut() {
                    let util: u32 = u.pids.iter().filter_map(|p| by_pid.get(p)).sum();
                    if u.pids.iter().any(|p| by_pid.contains_key(p)) {
                        u.listed = Some(now);
                    }
                    u.share
                        .add(f64::from(util.min(100)) / 100.0, alpha_per_window);
                    u.stat.measured = u.share.value * 100.0;
                }
                if let Firmware::Probing { pid, since, .. } = g.firmware
                    && now >= since + self.params.probe / 2
                    && by_pid.contains_key(&pid)
                {
                    // It ran while off the runlist: the firmware ignores the controls.
                    g.firmware = Firmware::Ignores;
                }
            }
        }
    }

    /// Whether a unit is active: running, and listed by NVML recently (or just started, or
    /// kept from running by the law, when NVML could not list it).
    fn active(params: &LawParams, u: &Unit, now: Nanos) -> bool {
        let recent =
            |t: Option<Nanos>| t.is_some_and(|t| now.saturating_sub(t) < params.idle_after);
        recent(u.listed) || recent(Some(u.since)) || recent(u.stopped)
    }

    /// Plans the GPUs whose plans run out at `now`.
    pub fn plan(&mut self, now: Nanos) -> Plan {
        let p = self.params.clone();
        let mut plan = Plan {
            end: now + p.period,
            ..Plan::default()
        };
        for (&gpu, g) in self.gpus.iter_mut() {
            let active = active_units(&p, g, now, &self.held);
            let changed = active != g.planned;
            if changed && g.next > now {
                // What was planned for other tenants is void: start over from a known state.
                plan.replanned.push(gpu);
                for u in g.units.values_mut() {
                    u.frozen = true;
                    u.off = true;
                }
            }
            if changed {
                // The measured shares were of another composition.
                for u in g.units.values_mut() {
                    u.share = Average::default();
                }
            }
            if changed || g.next <= now {
                let mut out = Vec::new();
                g.next = now + plan_gpu(&p, g, now, &active, &self.held, &mut out);
                g.planned = active;
                plan.commands
                    .extend(out.into_iter().map(|(t, c)| (t, gpu, c)));
            }
            plan.end = plan.end.min(g.next);
        }
        plan.commands.sort();
        plan
    }

    /// What the law does per unit (summed over GPUs), as `ListCompute` shows it.
    pub fn stats(&self) -> BTreeMap<String, ComputeStat> {
        let mut out: BTreeMap<String, ComputeStat> = BTreeMap::new();
        for g in self.gpus.values() {
            for (name, u) in &g.units {
                let s = out.entry(name.clone()).or_default();
                s.duty = u.stat.duty;
                s.target += u.stat.target;
                s.measured += u.stat.measured;
                s.throttled_usec += u.stat.throttled_usec;
                s.nr_throttled += u.stat.nr_throttled;
            }
        }
        out
    }

    /// Commands that leave everything running (shutdown): thawed, on the runlist.
    pub fn release_all(&mut self) -> Vec<Command> {
        let mut out = Vec::new();
        for g in self.gpus.values_mut() {
            for (name, u) in g.units.iter_mut() {
                release(name, u, &self.held, &mut out);
            }
        }
        out
    }
}

/// Thaws a unit and puts its groups back on the runlist.
fn release(name: &str, u: &mut Unit, held: &BTreeSet<String>, out: &mut Vec<Command>) {
    if u.frozen && !held.contains(name) {
        out.push(Command::Freeze {
            unit: name.to_owned(),
            frozen: false,
        });
        u.frozen = false;
    }
    if u.off {
        for &pid in &u.pids {
            out.push(Command::Schedule { pid, enabled: true });
        }
        u.off = false;
    }
}

/// Plans one GPU from `now`; returns how long the plan lasts.
/// The units of a GPU that are active now, with their policies, in order.
fn active_units(
    p: &LawParams,
    g: &Gpu,
    now: Nanos,
    held: &BTreeSet<String>,
) -> Vec<(String, Limits)> {
    g.units
        .iter()
        .filter(|(n, u)| !held.contains(*n) && Law::active(p, u, now))
        .map(|(n, u)| (n.clone(), u.limits.clone()))
        .collect()
}

fn plan_gpu(
    p: &LawParams,
    g: &mut Gpu,
    now: Nanos,
    active: &[(String, Limits)],
    held: &BTreeSet<String>,
    out: &mut Vec<(Nanos, Command)>,
) -> Nanos {
    // The probe, while it runs, is the whole plan.
    if let Firmware::Probing { pid, until, .. } = g.firmware {
        if now < until {
            return p.period;
        }
        g.firmware = Firmware::Honors;
        out.push((now, Command::Schedule { pid, enabled: true }));
        for u in g.units.values_mut().filter(|u| u.pids.contains(&pid)) {
            u.off = false;
        }
    }
    let active: Vec<String> = active.iter().map(|(n, _)| n.clone()).collect();
    let any_policy = active.iter().any(|n| g.units[n].limits.has_compute());
    let demands: Vec<(f64, Limits)> = active
        .iter()
        .map(|n| (100.0, g.units[n].limits.clone()))
        .collect();
    let pairs: Vec<(f64, &Limits)> = demands.iter().map(|(d, l)| (*d, l)).collect();
    let t = targets(&pairs);
    let total: f64 = t.iter().sum();
    let needs_control = any_policy && (active.len() > 1 || total < 99.5);
    // Units not controlled this period run freely.
    let mut released = Vec::new();
    for (name, u) in g.units.iter_mut() {
        if !needs_control || !active.contains(name) {
            release(name, u, held, &mut released);
            u.stat.duty = 100.0;
            u.stat.target = 0.0;
        }
    }
    out.extend(released.into_iter().map(|c| (now, c)));
    if !needs_control {
        return p.period;
    }
    for (i, n) in active.iter().enumerate() {
        let u = g.units.get_mut(n).expect("active units exist");
        u.target = t[i];
        u.stat.target = t[i];
    }
    let hw = active.iter().all(|n| g.units[n].hw);
    if g.firmware == Firmware::Unknown && hw {
        // Probe with the tenant that was listed last (it has work to show).
        let probe = active
            .iter()
            .filter_map(|n| Some((g.units[n].listed?, n.clone())))
            .max()
            .and_then(|(_, n)| g.units[&n].pids.first().copied());
        if let Some(pid) = probe {
            let mut released = Vec::new();
            for (name, u) in g.units.iter_mut() {
                release(name, u, held, &mut released);
            }
            out.extend(released.into_iter().map(|c| (now, c)));
            g.firmware = Firmware::Probing {
                pid,
                since: now,
                until: now + p.probe,
            };
            out.push((
                now,
                Command::Schedule {
                    pid,
                    enabled: false,
                },
            ));
            for u in g.units.values_mut().filter(|u| u.pids.contains(&pid)) {
                u.off = true;
                u.stopped = Some(now);
            }
            return p.period;
        }
    }
    g.phase = g
        .phase
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    let offset = (g.phase >> 33) % p.period;
    if hw && g.firmware == Firmware::Honors {
        plan_hardware(p, g, &active, now, offset, out);
        p.period
    } else {
        plan_freezer(p, g, &active, now, offset, held, out)
    }
}

/// Shares in hardware. Latency-critical and best-effort units stay on the runlist with a long
/// and a short timeslice: the GPU's round robin hands the engine to a latency-critical request
/// within one best-effort timeslice, and gives best-effort whatever it leaves. Every other unit
/// gets an exclusive window of the period in proportion to its target (on the runlist alone; the
/// others off and preempted), so its share does not depend on how it feeds its queue: a tenant
/// that keeps one kernel queued yields the engine after each kernel and would get no more than
/// its neighbours' turns under round robin, whatever its timeslice. Windows shorter than the
/// period leave the rest idle (caps).
fn plan_hardware(
    p: &LawParams,
    g: &mut Gpu,
    active: &[String],
    now: Nanos,
    offset: u64,
    out: &mut Vec<(Nanos, Command)>,
) {
    let classed = |u: &Unit| {
        matches!(
            u.limits.priority,
            Some(Priority::LatencyCritical | Priority::BestEffort)
        )
    };
    let (prio, slotted): (Vec<String>, Vec<String>) =
        active.iter().cloned().partition(|n| classed(&g.units[n]));
    let on = |u: &mut Unit, out: &mut Vec<(Nanos, Command)>, t: Nanos| {
        if u.off {
            for &pid in &u.pids {
                out.push((t, Command::Schedule { pid, enabled: true }));
            }
            u.off = false;
        }
    };
    for n in active {
        let u = g.units.get_mut(n).expect("active");
        if u.frozen {
            out.push((
                now,
                Command::Freeze {
                    unit: n.clone(),
                    frozen: false,
                },
            ));
            u.frozen = false;
        }
        let us = match u.limits.priority {
            Some(Priority::LatencyCritical) => p.max_timeslice_us,
            Some(Priority::BestEffort) => p.min_timeslice_us,
            _ => p.base_timeslice_us,
        };
        if u.timeslice != Some(us) {
            for &pid in &u.pids {
                out.push((now, Command::Timeslice { pid, us }));
            }
            u.timeslice = Some(us);
        }
    }
    for n in &prio {
        let u = g.units.get_mut(n).expect("active");
        on(u, out, now);
        u.stat.duty = 100.0;
    }
    // Targets among the windowed units alone (the classes have theirs from the round robin).
    let windowed: Vec<(f64, Limits)> = slotted
        .iter()
        .map(|n| (100.0, g.units[n].limits.clone()))
        .collect();
    let pairs: Vec<(f64, &Limits)> = windowed.iter().map(|(d, l)| (*d, l)).collect();
    let t = targets(&pairs);
    if slotted.len() == 1 && t[0] >= 99.5 {
        let u = g.units.get_mut(&slotted[0]).expect("active");
        on(u, out, now);
        u.stat.duty = 100.0;
        return;
    }
    // The windows repeat in cycles of about HW_CYCLE within the period: preemption makes short
    // windows exact, and the shares hold over any second, not only over the period.
    let cycles = (p.period / HW_CYCLE).max(1);
    let cycle = p.period / cycles;
    // Segments back to back over the period, in an order that rotates from period to period
    // (so the switch costs and the timer's error do not fall on the same unit every time), the
    // idle part (caps) taking its turn like a unit.
    let mut shares: Vec<f64> = t.iter().map(|x| x / 100.0).collect();
    shares.push((1.0 - t.iter().sum::<f64>() / 100.0).max(0.0));
    let order: Vec<usize> = (0..shares.len())
        .map(|k| (k + offset as usize) % shares.len())
        .collect();
    let scale = shares.iter().sum::<f64>().max(1e-9);
    let mut ideal = 0.0f64;
    let mut at = now;
    let mut segments: Vec<Vec<(Nanos, Nanos)>> = vec![Vec::new(); slotted.len()];
    for _ in 0..cycles {
        for &i in &order {
            ideal += cycle as f64 * shares[i] / scale;
            let end = now + ideal.round() as u64;
            if end > at && i < slotted.len() {
                segments[i].push((at, end));
            }
            at = end.max(at);
        }
    }
    for (i, n) in slotted.iter().enumerate() {
        let u = g.units.get_mut(n).expect("active");
        u.stat.target = t[i];
        u.stat.duty = t[i];
        let first_on = segments[i].first().map(|(s, _)| *s);
        for &pid in &u.pids {
            if first_on != Some(now) && !u.off {
                out.push((
                    now,
                    Command::Schedule {
                        pid,
                        enabled: false,
                    },
                ));
            }
            for &(start, end) in &segments[i] {
                out.push((start, Command::Schedule { pid, enabled: true }));
                out.push((
                    end,
                    Command::Schedule {
                        pid,
                        enabled: false,
                    },
                ));
            }
        }
        u.off = true;
        u.stopped = Some(now);
        u.stat.nr_throttled += 1;
        let ran: Nanos = segments[i].iter().map(|(s, e)| e - s).sum();
        u.stat.throttled_usec += p.period.saturating_sub(ran) / 1_000;
    }
}

/// Length of the hardware windows' cycle.
const HW_CYCLE: Nanos = 50 * MS;

/// Longest freezer cycle.
const MAX_CYCLE: Nanos = 1_600 * MS;

/// The smallest freezer slot lasts this many thaw latencies (a thaw's delay varies).
const MIN_SLOT_THAWS: u64 = 5;

/// The fallback: each active unit alone (the others frozen) for its slot of a cycle, slots in
/// proportion to the targets, the cycle long enough that the smallest slot lasts a period (a
/// frozen unit's queued work drains into the next slot: shorter than the period, the slot
/// absorbs it); latency-critical units are never frozen, and best-effort ones are frozen while
/// a latency-critical one is active. Returns the cycle's length.
fn plan_freezer(
    p: &LawParams,
    g: &mut Gpu,
    active: &[String],
    now: Nanos,
    offset: u64,
    held: &BTreeSet<String>,
    out: &mut Vec<(Nanos, Command)>,
) -> Nanos {
    let lc_active = active
        .iter()
        .any(|n| g.units[n].limits.priority == Some(Priority::LatencyCritical));
    let freeze = |out: &mut Vec<(Nanos, Command)>, t: Nanos, n: &str, frozen: bool| {
        if !held.contains(n) {
            out.push((
                t,
                Command::Freeze {
                    unit: n.to_owned(),
                    frozen,
                },
            ));
        }
    };
    let slotted: Vec<String> = active
        .iter()
        .filter(|n| g.units[*n].limits.priority != Some(Priority::LatencyCritical))
        .filter(|n| !(lc_active && g.units[*n].limits.priority == Some(Priority::BestEffort)))
        .cloned()
        .collect();
    for n in active {
        let u = g.units.get_mut(n).expect("active");
        if u.off {
            for &pid in &u.pids {
                out.push((now, Command::Schedule { pid, enabled: true }));
            }
            u.off = false;
        }
        if !slotted.contains(n) {
            // Latency-critical: runs freely; best-effort beside it: frozen for the period.
            let frozen = u.limits.priority == Some(Priority::BestEffort);
            if u.frozen != frozen {
                freeze(out, now, n, frozen);
                u.frozen = frozen;
            }
            if frozen {
                u.stopped = Some(now);
                u.stat.duty = 0.0;
                u.stat.nr_throttled += 1;
                u.stat.throttled_usec += p.period / 1_000;
            } else {
                u.stat.duty = 100.0;
            }
        }
    }
    if slotted.is_empty() {
        return p.period;
    }
    if slotted.len() == 1 && g.units[&slotted[0]].target >= 99.5 {
        let n = &slotted[0];
        let u = g.units.get_mut(n).expect("slotted");
        if u.frozen {
            freeze(out, now, n, false);
            u.frozen = false;
        }
        u.stat.duty = 100.0;
        return p.period;
    }
    // Slots back to back in a rotating order, from a varying offset where they leave part of the
    // period idle; each unit thawed a thaw latency before its slot and frozen at its end.
    let want: Vec<f64> = slotted.iter().map(|n| g.units[n].target / 100.0).collect();
    let scale = want.iter().sum::<f64>().max(1.0);
    // The smallest slot lasts several thaw latencies (a thaw's delay is only roughly known).
    let smallest = want
        .iter()
        .map(|w| w / scale)
        .filter(|w| *w > 0.0)
        .fold(1.0, f64::min);
    // A cycle length that varies by a few percent keeps it from aliasing with NVML's windows;
    // the slots start within the first tenth of the free part, so that each stretch of a few
    // cycles holds the same number of them.
    let base = ((MIN_SLOT_THAWS * p.thaw_latency) as f64 / smallest).max(p.period as f64);
    let jitter = 0.95 + 0.1 * ((g.phase >> 40) % 1024) as f64 / 1024.0;
    let cycle = ((base * jitter) as Nanos).min(MAX_CYCLE);
    let used = (want.iter().sum::<f64>() / scale * cycle as f64) as Nanos;
    let rotate = (offset as usize) % slotted.len();
    let mut t = now + offset % ((cycle - used.min(cycle)) / 10).max(1);
    for k in 0..slotted.len() {
        let i = (k + rotate) % slotted.len();
        let n = &slotted[i];
        let u = g.units.get_mut(n).expect("slotted");
        let len = (cycle as f64 * want[i] / scale) as Nanos;
        u.stat.duty = len as f64 * 100.0 / cycle as f64;
        if len == 0 {
            continue;
        }
        let thaw_at = t.saturating_sub(p.thaw_latency).max(now);
        freeze(out, thaw_at, n, false);
        freeze(out, t + len, n, true);
        u.frozen = true;
        u.stopped = Some(now + cycle);
        u.stat.nr_throttled += 1;
        u.stat.throttled_usec += (cycle - len.min(cycle)) / 1_000;
        t += len;
    }
    cycle
}
