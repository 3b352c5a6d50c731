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
//!   share that is reported. The firmware's behaviour is told apart by what the GPU does: a probe
//!   holds every tenant of the GPU with one lever ([`Lever`]) and reads NVML's device-level
//!   utilization windows (zeros included, unlike the per-process samples): a window inside the
//!   hold that is busy means the lever is ignored, an idle one that it holds queued work. Each
//!   lever has its own verdict (on the H200, `FIFO_DISABLE_CHANNELS` stops queued work within
//!   milliseconds while `GPFIFO_SCHEDULE` is ignored), and verdicts are checked again every
//!   [`LawParams::recheck`];
//! - priority classes need no activity signal: where a unit's channel groups can be controlled,
//!   a latency-critical or best-effort unit gets its class's timeslice from the moment its
//!   groups are seen, whether NVML ever samples it or not (a latency-critical tenant's short
//!   requests rarely hold the engine at a sample instant), and the GPU's round robin does the
//!   rest: it is never held or frozen for the class;
//! - where the firmware ignores the controls, or they cannot be issued, the fallback gives each
//!   active unit an exclusive slot of a cycle by freezing the others; what a frozen tenant had
//!   queued drains into the next slot, which cancels out between tenants with like queues, so
//!   the fallback holds where queued work is shorter than the smallest slot (slots last at
//!   least a period and five thaw latencies); a capped unit alone, whose drain runs into the
//!   idle part, reads its own utilization truly (nobody else holds the engine) and has its slot
//!   shortened by the overrun it measured.

use std::collections::{BTreeMap, BTreeSet};

mod freezer;
mod gpu;
mod hardware;
mod probe;
mod share;

use gpu::{active_units, plan_gpu};

use crate::policy::Limits;
pub use share::{ComputeStat, targets};

/// Nanoseconds of a monotonic clock (the daemon's `Instant`s, or virtual time).
pub type Nanos = u64;

const MS: Nanos = 1_000_000;

/// The law's settings (`[compute]` in the configuration, and the defaults of this module).
#[derive(Clone, Debug, PartialEq)]
pub struct LawParams {
    /// Length of one control period (`compute.period_ms`).
    pub period: Nanos,
    /// How long a thaw takes to let a frozen cgroup run again; it is thawed that early (a
    /// spinning process runs again 0.05–0.3 ms after the write here).
    pub thaw_latency: Nanos,
    /// A tenant NVML has not listed for this long (while it could run) is idle: longer than the
    /// daemon's NVML sampling interval and a window, as the windows arrive that late.
    pub idle_after: Nanos,
    /// How long the firmware probe holds the GPU's tenants with one lever: at least a settle
    /// time and two of NVML's device windows (1/6–1/5 s), so one whole window lies inside.
    pub probe: Nanos,
    /// How often a GPU's verdicts are checked again (a probe holds its tenants for `probe`).
    pub recheck: Nanos,
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
            thaw_latency: MS,
            idle_after: 600 * MS,
            probe: 600 * MS,
            recheck: 300_000 * MS,
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

/// One of NVML's device-level utilization windows (`nvmlDeviceGetSamples`, GPU utilization):
/// listed whether anything ran or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSample {
    /// NVML's timestamp (µs) of the window's end.
    pub timestamp_us: u64,
    /// Percent of the window in which a kernel ran.
    pub util: u32,
}

/// What one NVML read of one GPU returned.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    pub gpu: u32,
    /// Processes with a context on the GPU.
    pub running: Vec<u32>,
    /// Samples newer than the previous read's.
    pub samples: Vec<ProcSample>,
    /// Device-level windows newer than the previous read's (empty where NVML has none).
    pub device: Vec<DeviceSample>,
    /// NVML's clock (µs, the samples' timestamps) when it was read: places each window on the
    /// law's clock.
    pub clock_us: u64,
}

/// How a process's queued GPU work is held off the GPU in hardware.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Lever {
    /// `FIFO_DISABLE_CHANNELS` of its channels (disabled and preempted, queued work kept).
    Channels,
    /// `GPFIFO_SCHEDULE` off for its channel groups, then `PREEMPT`.
    Runlist,
}

impl Lever {
    /// In the order they are probed: the one measured to work on Hopper first.
    pub const ALL: [Lever; 2] = [Lever::Channels, Lever::Runlist];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Channels => "FIFO_DISABLE_CHANNELS",
            Self::Runlist => "GPFIFO_SCHEDULE + PREEMPT",
        }
    }
}

/// Something to do at a time of the period.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Command {
    /// `cgroup.freeze` of a unit.
    Freeze { unit: String, frozen: bool },
    /// A process's queued work held off the GPU with `lever`, or let run again.
    Hold { pid: u32, lever: Lever, held: bool },
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
    /// Not probed yet (or its verdict is due to be checked again).
    Unknown,
    /// Every tenant of the GPU is held with `lever` from `since` until `until`.
    Probing {
        lever: Lever,
        since: Nanos,
        until: Nanos,
    },
    /// This lever stops queued work: shares are set in hardware with it.
    Honors(Lever),
    /// No lever stops queued work (or none can be issued): the freezer fallback.
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
    /// NVML's windows since `trim_at` (when, utilization fraction): a lone capped unit's own
    /// reading of the freezer's overrun.
    recent: Vec<(Nanos, f64)>,
    /// The share of the cycle a lone capped unit is given in the fallback (its target less the
    /// overrun measured), and since when.
    slot: Option<f64>,
    trim_at: Nanos,
    /// Timeslice set on its groups (µs); the lever its work is held with, if it is; whether it
    /// is frozen.
    timeslice: Option<u64>,
    off: Option<Lever>,
    frozen: bool,
    /// What was planned for it was voided before it all ran: whether it is frozen or off the
    /// runlist is not known, so the next plan issues its first commands whatever they were.
    unsure: bool,
    stat: ComputeStat,
}

impl Unit {
    /// Thaws the unit (unless memory enforcement froze it, as `name` in `memory_frozen`) and
    /// lets its held work run again.
    fn release(&mut self, name: &str, memory_frozen: &BTreeSet<String>, out: &mut Vec<Command>) {
        if (self.frozen || self.unsure) && !memory_frozen.contains(name) {
            out.push(Command::Freeze {
                unit: name.to_owned(),
                frozen: false,
            });
            self.frozen = false;
        }
        self.unhold(out);
    }

    /// Lets its held work run again: the lever that held it, or every lever when unsure.
    fn unhold(&mut self, out: &mut Vec<Command>) {
        let levers: Vec<Lever> = match (self.off, self.unsure) {
            (_, true) => Lever::ALL.to_vec(),
            (Some(l), false) => vec![l],
            (None, false) => Vec::new(),
        };
        for lever in levers {
            for &pid in &self.pids {
                out.push(Command::Hold {
                    pid,
                    lever,
                    held: false,
                });
            }
        }
        self.off = None;
    }
}

#[derive(Clone, Debug)]
struct Gpu {
    firmware: Firmware,
    /// Levers the probes found ignored since the last verdict.
    rejected: Vec<Lever>,
    /// When the present verdict was reached (checked again [`LawParams::recheck`] later); while
    /// unknown, when a probe may start (later after an inconclusive one).
    checked: Nanos,
    /// A device window inside the present probe read idle.
    probe_quiet: bool,
    /// The verdict changed since the last plan: what was planned is void.
    replan: bool,
    /// Newest device window already counted, and the shortest gap seen between two (µs).
    last_device: u64,
    device_window_us: Option<u64>,
    /// When a device window last read the GPU busy (at least twice [`BUSY`]).
    device_busy: Option<Nanos>,
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
    /// Whether a policy is in force among its active units (only those GPUs are reported).
    controlled: bool,
    /// What units gone since the last plan leave to undo (thaw, back on the runlist).
    leaving: Vec<Command>,
}

impl Default for Gpu {
    fn default() -> Self {
        Self {
            firmware: Firmware::Unknown,
            rejected: Vec::new(),
            checked: 0,
            probe_quiet: false,
            replan: false,
            last_device: 0,
            device_window_us: None,
            device_busy: None,
            units: BTreeMap::new(),
            last_window: 0,
            window_us: None,
            phase: 0x9e37_79b9,
            next: 0,
            planned: Vec::new(),
            controlled: false,
            leaving: Vec::new(),
        }
    }
}

/// The law, for every GPU.
#[derive(Clone, Debug)]
pub struct Law {
    params: LawParams,
    gpus: BTreeMap<u32, Gpu>,
    /// Units the memory enforcement froze: left alone.
    memory_frozen: BTreeSet<String>,
}

impl Law {
    pub fn new(params: LawParams) -> Self {
        Self {
            params,
            gpus: BTreeMap::new(),
            memory_frozen: BTreeSet::new(),
        }
    }

    pub fn params(&self) -> &LawParams {
        &self.params
    }

    /// New settings (a reload); they apply from the next plan of each GPU.
    pub fn set_params(&mut self, params: LawParams) {
        self.params = params;
    }

    /// The GPUs the law has seen.
    pub fn gpus(&self) -> Vec<u32> {
        self.gpus.keys().copied().collect()
    }

    /// What the law knows of `gpu`'s firmware.
    pub fn firmware(&self, gpu: u32) -> Option<Firmware> {
        self.gpus.get(&gpu).map(|g| g.firmware)
    }

    /// Units another owner froze (the memory limits' `freeze` action): never thawed here.
    pub fn set_memory_frozen(&mut self, units: BTreeSet<String>) {
        self.memory_frozen = units;
    }

    /// Takes one NVML read per GPU and the tenants the daemon knows at `now`.
    pub fn observe(&mut self, now: Nanos, tenants: &[Tenant], readings: &[Reading]) {
        let alpha_per_window = 1.0 / 6.0 / (self.params.tau as f64 / 1e9);
        // A GPU no longer read (NVML lost it, or went away) has no processes any more.
        let missing: Vec<Reading> = self
            .gpus
            .keys()
            .filter(|gpu| !readings.iter().any(|r| r.gpu == **gpu))
            .map(|&gpu| Reading {
                gpu,
                ..Reading::default()
            })
            .collect();
        for r in readings.iter().chain(&missing) {
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
            // Units whose processes are gone (or moved): released, not forgotten frozen (their
            // cgroups may hold other processes).
            let gone: Vec<String> = g
                .units
                .keys()
                .filter(|u| !seen.contains_key(*u))
                .cloned()
                .collect();
            for name in gone {
                if let Some(mut u) = g.units.remove(&name) {
                    u.release(&name, &self.memory_frozen, &mut g.leaving);
                }
            }
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
                // When the window was sampled, on the law's clock.
                let at = now.saturating_sub(r.clock_us.saturating_sub(ts).saturating_mul(1_000));
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
                            push_recent(u, at, 0.0);
                        }
                    }
                }
                g.last_window = g.last_window.max(ts);
                for u in g.units.values_mut() {
                    let util: u32 = u.pids.iter().filter_map(|p| by_pid.get(p)).sum();
                    if u.pids.iter().any(|p| by_pid.contains_key(p)) {
                        u.listed = Some(u.listed.map_or(at, |l| l.max(at)));
                    }
                    u.share
                        .add(f64::from(util.min(100)) / 100.0, alpha_per_window);
                    push_recent(u, at, f64::from(util.min(100)) / 100.0);
                    u.stat.measured = u.share.value * 100.0;
                }
                if let Firmware::Probing {
                    lever,
                    since,
                    until,
                } = g.firmware
                    && at >= since + self.params.probe / 2
                    && at < until
                    && by_pid.values().any(|u| *u > 0)
                {
                    // A held process ran: the lever is ignored.
                    probe::reject(g, lever, now);
                }
            }
            probe::judge_device(g, r, now, self.params.probe);
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
            let active = active_units(&p, g, now, &self.memory_frozen);
            let changed = active != g.planned || !g.leaving.is_empty() || g.replan;
            g.replan = false;
            plan.commands
                .extend(g.leaving.drain(..).map(|c| (now, gpu, c)));
            if changed && g.next > now {
                // What was planned for other tenants is void: start over from a known state.
                plan.replanned.push(gpu);
                for u in g.units.values_mut() {
                    u.unsure = true;
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
                g.next = now + plan_gpu(&p, g, now, &active, &self.memory_frozen, &mut out);
                for u in g.units.values_mut() {
                    u.unsure = false;
                }
                g.planned = active;
                plan.commands
                    .extend(out.into_iter().map(|(t, c)| (t, gpu, c)));
            }
            plan.end = plan.end.min(g.next);
        }
        // By time alone, keeping the order of one instant's commands (a release, then the probe
        // taking one group off again).
        plan.commands.sort_by_key(|(t, gpu, _)| (*t, *gpu));
        plan
    }

    /// What the law does per unit (summed over GPUs), as `ListCompute` shows it.
    pub fn stats(&self) -> BTreeMap<String, ComputeStat> {
        let mut out: BTreeMap<String, ComputeStat> = BTreeMap::new();
        for g in self.gpus.values().filter(|g| g.controlled) {
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
                u.release(name, &self.memory_frozen, &mut out);
            }
        }
        out
    }
}

/// Keeps a window's reading for the lone-unit correction (the last 256).
fn push_recent(u: &mut Unit, at: Nanos, x: f64) {
    if u.recent.len() >= 256 {
        u.recent.remove(0);
    }
    u.recent.push((at, x));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Priority;

    fn tenant(pid: u32, unit: &str, limits: Limits, hw: bool) -> Tenant {
        Tenant {
            pid,
            gpu: 0,
            unit: unit.into(),
            limits,
            hw,
        }
    }

    /// NVML read at `now` (ns), listing `running`, with one window naming `ran`.
    fn reading(now: Nanos, running: &[u32], ran: &[u32]) -> Reading {
        let ts = now / 1_000;
        Reading {
            gpu: 0,
            running: running.to_vec(),
            samples: ran
                .iter()
                .map(|&pid| ProcSample {
                    pid,
                    timestamp_us: ts,
                    sm_util: 99,
                })
                .collect(),
            device: Vec::new(),
            clock_us: ts,
        }
    }

    fn cap(max: u32) -> Limits {
        Limits {
            compute_max: Some(max),
            ..Limits::default()
        }
    }

    fn prio(p: Priority) -> Limits {
        Limits {
            priority: Some(p),
            ..Limits::default()
        }
    }

    fn at(plan: &Plan, t: Nanos) -> Vec<Command> {
        plan.commands
            .iter()
            .filter(|(when, _, _)| *when == t)
            .map(|(_, _, c)| c.clone())
            .collect()
    }

    /// As [`reading`], with one device window of `util` percent ending at `now`.
    fn with_device(mut r: Reading, util: u32) -> Reading {
        r.device.push(DeviceSample {
            timestamp_us: r.clock_us,
            util,
        });
        r
    }

    /// Runs one capped tenant under the probes for `until`, in 100 ms samples whose device
    /// window (200 ms) reads `busy(t, held)` (held: the probe holds it with that lever).
    fn probe_run(busy: impl Fn(Option<Lever>) -> u32, until: Nanos) -> (Law, Vec<Command>) {
        let mut law = Law::new(LawParams::default());
        let ts = [tenant(7, "/a", cap(30), true)];
        let mut cmds = Vec::new();
        let mut held: Option<Lever> = None;
        let mut t = 0;
        // Windows every 200 ms, NVML read every 100 ms.
        while t < until {
            t += 100 * MS;
            let r = reading(t, &[7], if held.is_some() { &[] } else { &[7] });
            let r = if (t / (100 * MS)).is_multiple_of(2) {
                with_device(r, busy(held))
            } else {
                r
            };
            law.observe(t, &ts, &[r]);
            for (_, _, c) in law.plan(t).commands {
                if let Command::Hold { lever, held: h, .. } = c {
                    held = if h {
                        Some(lever)
                    } else if held == Some(lever) {
                        None
                    } else {
                        held
                    };
                }
                cmds.push(c);
            }
        }
        (law, cmds)
    }

    #[test]
    fn the_probes_judge_each_lever_by_the_devices_own_windows() {
        // Channels stop the GPU's work, the runlist does not: the first probe finds it.
        let (law, cmds) = probe_run(
            |h| if h == Some(Lever::Channels) { 0 } else { 99 },
            3_000 * MS,
        );
        assert_eq!(law.firmware(0), Some(Firmware::Honors(Lever::Channels)));
        assert!(cmds.contains(&Command::Hold {
            pid: 7,
            lever: Lever::Channels,
            held: true
        }));
        // Only the runlist works: channels are rejected, then the runlist is found.
        let (law, _) = probe_run(
            |h| if h == Some(Lever::Runlist) { 0 } else { 99 },
            5_000 * MS,
        );
        assert_eq!(law.firmware(0), Some(Firmware::Honors(Lever::Runlist)));
        // Neither: the freezer.
        let (law, cmds) = probe_run(|_| 99, 5_000 * MS);
        assert_eq!(law.firmware(0), Some(Firmware::Ignores));
        assert!(
            cmds.iter()
                .any(|c| matches!(c, Command::Freeze { frozen: true, .. }))
        );
    }

    #[test]
    fn a_verdict_is_checked_again_after_a_while() {
        let p = LawParams::default();
        let (mut law, _) = probe_run(|_| 99, 5_000 * MS);
        assert_eq!(law.firmware(0), Some(Firmware::Ignores));
        let ts = [tenant(7, "/a", cap(30), true)];
        let t = 5_000 * MS + p.recheck + MS;
        law.observe(t, &ts, &[with_device(reading(t, &[7], &[7]), 99)]);
        let plan = law.plan(t);
        assert!(
            matches!(law.firmware(0), Some(Firmware::Probing { .. })),
            "{plan:?}"
        );
    }

    #[test]
    fn without_device_windows_a_held_tenant_nvml_never_lists_is_taken_as_stopped() {
        let mut law = Law::new(LawParams::default());
        let ts = [tenant(7, "/a", cap(30), true)];
        law.observe(MS, &ts, &[reading(MS, &[7], &[7])]);
        let plan = law.plan(MS);
        // Whatever is released first, the probe's hold comes last at that instant.
        assert_eq!(
            at(&plan, MS).last(),
            Some(&Command::Hold {
                pid: 7,
                lever: Lever::Channels,
                held: true
            }),
            "{plan:?}"
        );
        let mut t = MS;
        while t < 1_200 * MS {
            t += 100 * MS;
            law.observe(t, &ts, &[reading(t, &[7], &[])]);
            law.plan(t);
        }
        assert_eq!(law.firmware(0), Some(Firmware::Honors(Lever::Channels)));
    }

    #[test]
    fn priority_classes_get_their_timeslices_whether_nvml_samples_them_or_not() {
        let mut law = Law::new(LawParams::default());
        let p = LawParams::default();
        let be = tenant(1, "/be", prio(Priority::BestEffort), true);
        let lc = tenant(2, "/lc", prio(Priority::LatencyCritical), true);
        // NVML lists both processes but only ever samples BE (LC's bursts never hold a window).
        let mut cmds = Vec::new();
        let mut t = 0;
        while t < 2_000 * MS {
            t += 100 * MS;
            let r = with_device(reading(t, &[1, 2], &[1]), 99);
            law.observe(t, &[be.clone(), lc.clone()], &[r]);
            cmds.extend(law.plan(t).commands.into_iter().map(|(_, _, c)| c));
        }
        assert!(cmds.contains(&Command::Timeslice {
            pid: 2,
            us: p.max_timeslice_us
        }));
        assert!(cmds.contains(&Command::Timeslice {
            pid: 1,
            us: p.min_timeslice_us
        }));
        // Neither is held nor frozen for the classes.
        assert!(
            !cmds.iter().any(|c| matches!(
                c,
                Command::Hold { held: true, .. } | Command::Freeze { frozen: true, .. }
            )),
            "{cmds:?}"
        );
    }

    #[test]
    fn a_unit_whose_process_leaves_is_thawed_and_put_back_on_the_runlist() {
        let mut law = Law::new(LawParams::default());
        let ts = [
            tenant(1, "/a", cap(30), false),
            tenant(2, "/b", cap(70), false),
        ];
        law.observe(MS, &ts, &[reading(MS, &[1, 2], &[1, 2])]);
        law.plan(MS);
        // /b's process is gone.
        law.observe(50 * MS, &ts[..1], &[reading(50 * MS, &[1], &[1])]);
        let plan = law.plan(50 * MS);
        assert!(plan.replanned.contains(&0), "{plan:?}");
        assert!(
            at(&plan, 50 * MS).contains(&Command::Freeze {
                unit: "/b".into(),
                frozen: false
            }),
            "{plan:?}"
        );
        assert!(!law.stats().contains_key("/b"));
    }

    #[test]
    fn after_a_voided_plan_best_effort_is_frozen_again_beside_latency_critical() {
        let mut law = Law::new(LawParams::default());
        let be = tenant(1, "/be", prio(Priority::BestEffort), false);
        let lc = tenant(2, "/lc", prio(Priority::LatencyCritical), false);
        law.observe(MS, std::slice::from_ref(&be), &[reading(MS, &[1], &[1])]);
        law.plan(MS);
        // Latency-critical starts mid-plan: the plan is voided, and best-effort must be frozen
        // whatever the law believed of it.
        law.observe(20 * MS, &[be, lc], &[reading(20 * MS, &[1, 2], &[1, 2])]);
        let plan = law.plan(20 * MS);
        assert!(
            at(&plan, 20 * MS).contains(&Command::Freeze {
                unit: "/be".into(),
                frozen: true
            }),
            "{plan:?}"
        );
        assert!(!at(&plan, 20 * MS).contains(&Command::Freeze {
            unit: "/lc".into(),
            frozen: true
        }));
    }

    #[test]
    fn the_memory_enforcements_frozen_units_are_never_thawed() {
        let mut law = Law::new(LawParams::default());
        let ts = [
            tenant(1, "/a", cap(30), false),
            tenant(2, "/b", cap(70), false),
        ];
        law.set_memory_frozen(BTreeSet::from(["/b".to_owned()]));
        law.observe(MS, &ts, &[reading(MS, &[1, 2], &[1, 2])]);
        let mut cmds = law.plan(MS).commands;
        cmds.extend(law.release_all().into_iter().map(|c| (0, 0, c)));
        assert!(
            cmds.iter()
                .all(|(_, _, c)| !matches!(c, Command::Freeze { unit, .. } if unit == "/b")),
            "{cmds:?}"
        );
    }
}
