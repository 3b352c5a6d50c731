//! NVML: the driver's own view of GPUs and of the processes using them, read with nvml-wrapper on
//! a sampler thread (NVML calls block) and handed to the state task as [`Update`]s. This module
//! owns the NVML library handle, the per-GPU last-seen utilization timestamps, the Xid event set
//! and the retry schedule ([`Sampler`]); the state task owns what the snapshots say
//! ([`NvmlView`]: inventory, per-process samples, per-cgroup aggregates, recent events).
//!
//! NVML is the ground truth for what the ioctl probes cannot see: per-process memory including
//! RM-internal allocations, and GPU utilization (kernel launches are not ioctls). When the library
//! is missing, no GPU is present or NVML fails, the daemon runs on without it, reports why, and
//! retries every `nvml.retry_interval_secs`. A feature one GPU does not offer (per-process
//! utilization under MIG, graphics processes, events) is left out for that GPU; it does not make
//! NVML unavailable.

pub mod sampler;
pub mod view;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use sampler::{Sampler, SamplerSettings};
pub use view::{AttributedXid, CgroupUsage, EVENTS_KEPT, GpuStatus, NvmlView};

/// Failures of one NVML step, reported as the reason NVML is unavailable.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("cannot load NVML from {path}")]
    Load {
        path: String,
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("NVML {call} failed")]
    Call {
        call: &'static str,
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("no GPU found by NVML")]
    NoGpu,
}

/// One GPU or MIG device as NVML reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index of the GPU (of the parent GPU for a MIG device).
    pub index: u32,
    /// MIG device number under its parent, or `None` for a whole GPU.
    pub mig: Option<u32>,
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub memory_total: u64,
    pub memory_used: u64,
    pub driver_version: String,
    pub cuda_version: String,
    /// `default`, `exclusive_process`, `prohibited`, `exclusive_thread`, or `n/a`.
    pub compute_mode: String,
    /// `enabled`, `disabled` or `n/a` (MIG devices, GPUs without MIG).
    pub mig_mode: String,
}

/// A process NVML reports on a GPU in one sample.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessSample {
    pub pid: u32,
    pub gpu: u32,
    /// cgroup v2 path from `/proc/<pid>/cgroup` (empty if the process is gone).
    pub cgroup: String,
    pub memory_bytes: u64,
    /// Utilization in percent over the samples since the previous snapshot; `None` when NVML
    /// returned no new sample for it.
    pub sm_util: Option<u32>,
    pub enc_util: Option<u32>,
    pub dec_util: Option<u32>,
    /// The new samples themselves, (timestamp µs, SM utilization), oldest first: NVML's windows,
    /// which the compute controller reads one by one (an average would hide who held the GPU).
    pub windows: Vec<(u64, u32)>,
}

/// What the sampler saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Update {
    Unavailable(String),
    Available {
        gpus: Vec<GpuInfo>,
        processes: Vec<ProcessSample>,
        /// Per GPU (not MIG devices), NVML's new device utilization windows: (timestamp µs,
        /// percent), oldest first; zeros included.
        device_windows: BTreeMap<u32, Vec<(u64, u32)>>,
        /// The wall clock (µs since the epoch) just after the read: NVML stamps its samples on
        /// this clock.
        clock_us: u64,
    },
    /// A critical Xid error on the GPU with this UUID (NVML's event names the GPU, not a
    /// process). `None`: NVML did not say which Xid.
    Xid {
        uuid: String,
        xid: Option<u64>,
    },
}
