//! Records exchanged over D-Bus, shared by the daemon and its clients (one definition of the wire
//! shapes; their D-Bus signatures are documented in docs/dbus-api.md).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use zbus::zvariant::Type;

/// One attributed cgroup: signature `(tsaua{st}a{st}a{st}ta{ss})`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct CgroupRecord {
    /// cgroup v2 id (the inode number of its directory).
    pub id: u64,
    /// Path relative to the cgroup v2 root, e.g. `/kubepods/pod1/ctr`.
    pub path: String,
    /// Live processes attributed to it: they opened or used an NVIDIA file.
    pub pids: Vec<u32>,
    /// ioctls on NVIDIA files by class (`alloc`, `free`, `control`, `map`, `vid_heap`, `uvm`,
    /// `other`); every class is present.
    pub ioctls: BTreeMap<String, u64>,
    /// GPU memory held by the cgroup and its descendants, from the RM allocations the probes
    /// charged, in bytes by GPU index, `unknown` (parent device not known) and `all` (the sum).
    pub memory_current: BTreeMap<String, u64>,
    /// Limits in force on this cgroup, by GPU index or `all`.
    pub memory_max: BTreeMap<String, u64>,
    /// Allocations that crossed (react) or were refused by (deny) this cgroup's limits.
    pub memory_events: u64,
    /// The Kubernetes workload the cgroup runs, as the runtime integration reported it
    /// (`SetWorkload`): `namespace`, `pod` and, for a container's cgroup, `container`. Empty for
    /// a cgroup no integration named.
    pub workload: BTreeMap<String, String>,
}

/// A limit as listed by `ListLimits`: signature `(ssa{st}ss)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Type)]
pub struct LimitRecord {
    /// Path relative to the cgroup v2 root.
    pub cgroup: String,
    /// `all`, an index or a UUID, as set.
    pub gpu: String,
    /// Every limit set, by name: `memory_max` (bytes), `compute_max`, `compute_min` (percent),
    /// `compute_weight`, `priority` (0 latency-critical, 1 normal, 2 best-effort).
    pub limits: BTreeMap<String, u64>,
    /// [`LimitState::IN_FORCE`] or [`LimitState::PENDING`].
    pub state: String,
    /// Why a pending limit waits (empty when in force).
    pub note: String,
}

impl LimitRecord {
    /// The state as sent.
    pub fn limit_state(&self) -> LimitState {
        LimitState::from_wire(&self.state, &self.note)
    }
}

/// Whether a stored limit is in force: `SetLimits`' answer `(state, note)` and
/// [`LimitRecord`]'s last two fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitState {
    /// Enforced now (memory in the kernel; compute shares and priority classes by the controller
    /// and the scheduler guard).
    InForce,
    /// Stored, enforced nowhere yet: the GPU it names is not known now (a UUID while NVML has not
    /// answered, an index or UUID NVML does not report, a card the cgroup limits under another
    /// selector). Put in force as soon as that changes; why it waits.
    Pending(String),
}

impl LimitState {
    /// The state of a limit in force.
    pub const IN_FORCE: &str = "in-force";
    /// The state of a pending limit.
    pub const PENDING: &str = "pending";

    /// `(state, note)` as sent on the bus.
    pub fn to_wire(&self) -> (String, String) {
        match self {
            Self::InForce => (Self::IN_FORCE.to_owned(), String::new()),
            Self::Pending(why) => (Self::PENDING.to_owned(), why.clone()),
        }
    }

    /// Reads `(state, note)`; any state other than [`Self::IN_FORCE`] is pending.
    pub fn from_wire(state: &str, note: &str) -> Self {
        if state == Self::IN_FORCE {
            Self::InForce
        } else {
            Self::Pending(note.to_owned())
        }
    }

    /// Stored but in force nowhere yet.
    pub fn is_pending(&self) -> bool {
        matches!(self, Self::Pending(_))
    }
}

impl std::fmt::Display for LimitState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::InForce => f.write_str(Self::IN_FORCE),
            Self::Pending(why) => write!(f, "{}: {why}", Self::PENDING),
        }
    }
}

/// One attributed process: signature `(utsa{st})`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ProcessRecord {
    /// Process id (thread-group id).
    pub pid: u32,
    /// cgroup v2 id of the cgroup it was in at its last open or ioctl of an NVIDIA file.
    pub cgroup_id: u64,
    /// That cgroup's path relative to the cgroup v2 root; empty if the cgroup was removed.
    pub cgroup: String,
    /// Its ioctls on NVIDIA files by class, as in [`CgroupRecord::ioctls`].
    pub ioctls: BTreeMap<String, u64>,
}

/// A GPU or MIG device as NVML reports it: signature `(uusssttsssst)`: index, MIG number
/// (`u32::MAX` for a whole GPU), UUID, name, PCI bus id, memory total and used (bytes), driver and
/// CUDA versions, compute mode, MIG mode, critical Xid errors seen since the daemon started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct GpuRecord {
    /// NVML index (of the parent GPU for a MIG device).
    pub index: u32,
    /// MIG device number under its GPU; `u32::MAX` for a whole GPU.
    pub mig: u32,
    /// `GPU-…` or `MIG-…`.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// PCI bus id, e.g. `00000000:00:06.0`.
    pub pci_bus_id: String,
    /// Memory size (bytes).
    pub memory_total: u64,
    /// Memory in use by all processes at the last sample (bytes).
    pub memory_used: u64,
    /// Driver version, e.g. `580.159.04`.
    pub driver_version: String,
    /// CUDA version the driver supports, e.g. `13.0`.
    pub cuda_version: String,
    /// `default`, `exclusive_process`, `exclusive_thread`, `prohibited` or `n/a`.
    pub compute_mode: String,
    /// `enabled`, `disabled` or `n/a`.
    pub mig_mode: String,
    /// Critical Xid errors seen since the daemon started.
    pub xid_errors: u64,
}

/// NVML's figures for one cgroup on one GPU: signature `(tsuttuuuau)`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct NvmlUsageRecord {
    /// cgroup v2 id (0 if the cgroup is gone).
    pub cgroup_id: u64,
    /// Path relative to the cgroup v2 root.
    pub cgroup: String,
    /// GPU index.
    pub gpu: u32,
    /// Used GPU memory NVML reports for the cgroup's processes (bytes).
    pub nvml_memory_bytes: u64,
    /// GPU memory the probes charged to the cgroup on that GPU (bytes; hierarchical).
    pub ebpf_memory_bytes: u64,
    /// SM utilization in percent over the last sample window (sum over its processes, capped).
    pub sm_util: u32,
    /// Encoder utilization in percent over the same window.
    pub enc_util: u32,
    /// Decoder utilization in percent over the same window.
    pub dec_util: u32,
    /// The cgroup's processes NVML reported on that GPU.
    pub pids: Vec<u32>,
}

/// What the compute controller does for a cgroup: signature `(sddddtt)`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Type)]
pub struct ComputeRecord {
    /// Path relative to the cgroup v2 root.
    pub cgroup: String,
    /// Share of each period it may run (percent).
    pub duty: f64,
    /// Target GPU utilization (percent of one GPU, summed over its GPUs).
    pub target: f64,
    /// Measured GPU utilization at the last sample (percent).
    pub measured: f64,
    /// Time frozen by the controller, and periods in which it was (like `cpu.stat`).
    pub throttled_usec: u64,
    /// Periods in which it was frozen at all.
    pub nr_throttled: u64,
}

/// An NVML event (a critical Xid error): signature `(tusstutsau)`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct NvmlEventRecord {
    /// When the daemon received it, µs since the Unix epoch.
    pub timestamp_us: u64,
    /// GPU index (the parent GPU for an event on a MIG device).
    pub gpu: u32,
    /// UUID of the device NVML names in the event.
    pub uuid: String,
    /// `xid`.
    pub kind: String,
    /// The Xid number; 999 where NVML does not know it.
    pub xid: u64,
    /// The process the event is attributed to, 0 if none: NVML's event names a device, not a
    /// process, so this is the only process NVML reported on that GPU at the last sample.
    pub pid: u32,
    /// cgroup v2 id of that process (0 if none).
    pub cgroup_id: u64,
    /// Path of that cgroup (empty if none).
    pub cgroup: String,
    /// Every process NVML reported on that GPU at the last sample.
    pub pids: Vec<u32>,
}

/// A cgroup holding GPU memory while idle on that GPU, as `ListIdle` reports it: signature
/// `(stutttu)`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct IdleRecord {
    /// Path relative to the cgroup v2 root.
    pub cgroup: String,
    /// cgroup v2 id (0 if unknown to the probes: NVML-only).
    pub cgroup_id: u64,
    /// GPU index.
    pub gpu: u32,
    /// GPU memory it holds there at the last sample (bytes; the larger of the probes' and
    /// NVML's figure).
    pub memory_bytes: u64,
    /// Seconds since the first sample that saw it under the threshold.
    pub idle_secs: u64,
    /// Last sample at or above the threshold, seconds since the Unix epoch; 0: not since gpud
    /// started.
    pub last_active: u64,
    /// SM utilization at the last sample (percent).
    pub util: u32,
}
