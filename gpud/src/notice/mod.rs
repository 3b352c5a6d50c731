//! The daemon's outgoing news on one bus: every [`Notice`] the state task and the compute task
//! produce is broadcast once, and the D-Bus signals, the metrics' counts, the log (`log`) and
//! the `Gpu1` objects subscribe to it. A new kind of news is a variant here, its producer, and its D-Bus shape
//! (api/dbus.rs): nothing is wired by hand in between.
//!
//! The payloads are what the signals carry, typed: the producers build them, the subscribers
//! only read, and a payload becomes text only at its edge (the D-Bus signal, the log line).

mod log;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, PoisonError},
};

use tokio::sync::broadcast;
use tracing::{debug, info, warn};

use crate::{
    nvml::{AttributedXid, GpuStatus},
    probes::events::{GuardAction, GuardReason},
};

/// Notices a subscriber may fall behind by before it misses some (and is told how many).
const CAPACITY: usize = 1024;

/// One piece of news.
#[derive(Clone, Debug, PartialEq)]
pub enum Notice {
    /// An allocation crossed a memory limit, or was denied at it.
    MemoryLimitExceeded(LimitNotice),
    /// The scheduler guard met a tenant's scheduling control.
    SchedulerControlGuarded(GuardNotice),
    /// The compute controller started throttling a cgroup (its path).
    ComputeThrottled(String),
    /// A cgroup became idle holding GPU memory, or stopped being so.
    IdleChanged(IdleChange),
    /// NVML reported a critical Xid error.
    Xid(AttributedXid),
    /// The GPU inventory changed (NVML came, went, or saw other GPUs): the whole new inventory.
    Inventory(Arc<Vec<GpuStatus>>),
    /// The kernel side could not deliver this many events since the last report (its ring was
    /// full); the sweeps reconcile what they would have said.
    KernelEventsLost(u64),
}

impl Notice {
    /// The notice's name: its D-Bus signal's member name, and its label in the metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::MemoryLimitExceeded(_) => "MemoryLimitExceeded",
            Self::SchedulerControlGuarded(_) => "SchedulerControlGuarded",
            Self::ComputeThrottled(_) => "ComputeThrottled",
            Self::IdleChanged(_) => "IdleChanged",
            Self::Xid(_) => "Xid",
            Self::Inventory(_) => "Inventory",
            Self::KernelEventsLost(_) => "KernelEventsLost",
        }
    }

    /// Its log line, at the level the news deserves. The scheduler guard's are rate-limited by
    /// the log's subscriber, which says how many were `skipped` before this one.
    fn log(&self, skipped: u64) {
        match self {
            Self::MemoryLimitExceeded(n) => warn!(
                cgroup = %n.cgroup, gpu = %n.gpu, pid = n.pid, bytes = n.bytes, usage = n.usage,
                max = n.max, action = n.action.as_str(), source = n.source.as_str(),
                "GPU memory limit exceeded"
            ),
            Self::SchedulerControlGuarded(n) => warn!(
                cgroup = %n.cgroup, pid = n.pid, control = %n.control,
                action = n.action.as_str(), reason = n.reason.as_str(),
                requested = n.requested, allowed = n.allowed,
                client = format_args!("{:#x}", n.client), skipped,
                "scheduling control of a tenant {}", n.action.as_str()
            ),
            Self::ComputeThrottled(cgroup) => {
                debug!(cgroup = %cgroup, "compute throttling started")
            }
            Self::IdleChanged(c) => info!(
                cgroup = %c.cgroup, gpu = c.gpu, idle = c.idle, memory_bytes = c.memory_bytes,
                idle_secs = c.idle_secs, "{}",
                if c.idle { "cgroup holds GPU memory while idle" } else { "cgroup no longer idle" }
            ),
            Self::Xid(e) => warn!(
                gpu = e.gpu, uuid = %e.uuid, xid = e.xid, pid = e.pid.unwrap_or(0),
                cgroup = %e.cgroup, pids = ?e.pids, "critical Xid error on the GPU"
            ),
            Self::Inventory(gpus) => debug!(gpus = gpus.len(), "GPU inventory changed"),
            Self::KernelEventsLost(lost) => warn!(
                lost,
                "kernel events lost (ring buffer full); the sweeps reconcile what they would have said"
            ),
        }
    }
}

/// A memory limit met by an allocation, for the `MemoryLimitExceeded` signal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitNotice {
    /// cgroup whose limit was crossed (path, or `#<id>` if it is gone).
    pub cgroup: String,
    pub gpu: String,
    pub pid: u32,
    /// Size of the allocation.
    pub bytes: u64,
    /// Usage of that cgroup after (react) or before (deny) the allocation.
    pub usage: u64,
    pub max: u64,
    pub action: LimitAction,
    pub source: LimitSource,
}

/// What gpud did about a memory limit met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitAction {
    /// The deny tier refused the allocation.
    Denied,
    /// The crossing process (or, from NVML, the holders' cgroups) killed.
    Killed,
    /// The limited cgroup frozen.
    Frozen,
    /// Reported only (`notify`, or the kill or freeze failed: logged apart).
    Notified,
}

impl LimitAction {
    /// The name in the signal and the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Denied => "denied",
            Self::Killed => "killed",
            Self::Frozen => "frozen",
            Self::Notified => "notified",
        }
    }
}

/// What saw a memory limit met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// The probes, at the allocation.
    Kernel,
    /// The backstop: NVML's per-process used memory stayed over the limit (`bytes` is the
    /// excess).
    Nvml,
}

impl LimitSource {
    /// The name in the signal and the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kernel => "kernel",
            Self::Nvml => "nvml",
        }
    }
}

/// One report of the scheduler guard, for the `SchedulerControlGuarded` signal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardNotice {
    /// The caller's cgroup (path, or `#<id>` once gone).
    pub cgroup: String,
    pub pid: u32,
    pub control: GuardedControl,
    pub action: GuardAction,
    pub reason: GuardReason,
    /// The timeslice asked (µs), or the foreign client named (0 otherwise).
    pub requested: u64,
    /// The caller's timeslice allowance (µs; 0 where none is involved).
    pub allowed: u64,
    /// The call's RM client (for the log).
    pub client: u32,
}

/// A tenant's RM control command, named by the driver's name for it (`SET_TIMESLICE`,
/// `FIFO_DISABLE_CHANNELS`, ...; `NAME(legacy 0x…)` on the driver's legacy path, the number
/// where gpud knows no name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GuardedControl(pub u32);

impl std::fmt::Display for GuardedControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use gpud_common::rm::sched;
        let cmd = self.0;
        match sched::control(cmd) {
            Some(c) if cmd & sched::LEGACY_BIT != 0 => write!(f, "{}(legacy {cmd:#x})", c.name),
            Some(c) => f.write_str(c.name),
            None => write!(f, "{cmd:#010x}"),
        }
    }
}

/// A cgroup crossing into idleness (after the minimum time) or out of it (active again, memory
/// released, or gone), for the `IdleChanged` signal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdleChange {
    pub cgroup: String,
    pub gpu: u32,
    pub idle: bool,
    pub memory_bytes: u64,
    /// How long it had been idle at the transition.
    pub idle_secs: u64,
}

/// Notices published since start, by name (the metrics' `gpud_notices_total`), counted by a
/// subscriber of the bus; notices it fell behind on are counted as `missed`.
#[derive(Clone, Debug, Default)]
pub struct NoticeCounts(Arc<Mutex<BTreeMap<&'static str, u64>>>);

impl NoticeCounts {
    /// Counts every notice until the bus closes.
    async fn follow(self, mut rx: broadcast::Receiver<Notice>) {
        use broadcast::error::RecvError;
        loop {
            let (name, n) = match rx.recv().await {
                Ok(notice) => (notice.name(), 1),
                Err(RecvError::Lagged(missed)) => ("missed", missed),
                Err(RecvError::Closed) => return,
            };
            *self
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(name)
                .or_default() += n;
        }
    }

    pub fn get(&self) -> BTreeMap<&'static str, u64> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The sending side of the bus, for producers; cheap to clone.
#[derive(Clone, Debug)]
pub struct NoticeBus(broadcast::Sender<Notice>);

impl Default for NoticeBus {
    fn default() -> Self {
        Self(broadcast::channel(CAPACITY).0)
    }
}

impl NoticeBus {
    /// Publishes a notice. No subscriber (no bus yet, a test) is fine: the notice is dropped.
    pub fn send(&self, notice: Notice) {
        let _ = self.0.send(notice);
    }

    /// A new subscriber: it sees every notice sent from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Notice> {
        self.0.subscribe()
    }

    /// Starts the subscribers that must see every notice from the first (inside a tokio
    /// runtime, before any producer runs): the log, and the counts it returns.
    pub fn start_log_and_counts(&self) -> NoticeCounts {
        tokio::spawn(log::log_notices(self.subscribe()));
        let counts = NoticeCounts::default();
        tokio::spawn(counts.clone().follow(self.subscribe()));
        counts
    }
}
