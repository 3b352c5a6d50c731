//! The API edge: the core's domain types turned into gpud-api's wire records, in one place, so
//! D-Bus and the metrics endpoint show the same figures.

use std::collections::BTreeMap;

use gpud_api::{
    CgroupRecord, ComputeRecord, GpuRecord, IdleRecord, LimitRecord, LimitState, NvmlEventRecord,
    NvmlUsageRecord, ProcessRecord,
};
use gpud_common::{IOCTL_CLASS_NAMES, IoctlCounts};

use crate::{
    attribution::{CgroupView, ProcessView},
    daemon::NvmlUsage,
    enforcement::compute::ComputeStat,
    nvml::{AttributedXid, GpuStatus},
    policy::LimitEntry,
    policy::idle::IdleEntry,
};

/// ioctl counts by class name; every class is present.
pub(super) fn class_map(c: &IoctlCounts) -> BTreeMap<String, u64> {
    IOCTL_CLASS_NAMES
        .iter()
        .zip(c.by_class)
        .map(|(n, v)| ((*n).to_owned(), v))
        .collect()
}

impl From<CgroupView> for CgroupRecord {
    fn from(c: CgroupView) -> Self {
        Self {
            id: c.id,
            path: c.path,
            pids: c.pids,
            ioctls: class_map(&c.ioctls),
            memory_current: c.memory.current,
            memory_max: c.memory.max,
            memory_events: c.memory.events,
            workload: c.workload,
        }
    }
}

impl From<ProcessView> for ProcessRecord {
    fn from(p: ProcessView) -> Self {
        Self {
            pid: p.pid,
            cgroup_id: p.cgroup_id,
            cgroup: p.cgroup,
            ioctls: class_map(&p.ioctls),
        }
    }
}

/// A stored limit and its state as `ListLimits` lists it.
pub fn limit_record((l, state): (LimitEntry, LimitState)) -> LimitRecord {
    let (state, note) = state.to_wire();
    LimitRecord {
        cgroup: l.cgroup,
        gpu: l.gpu.to_string(),
        limits: l.limits.named(),
        state,
        note,
    }
}

impl From<&GpuStatus> for GpuRecord {
    fn from(g: &GpuStatus) -> Self {
        let i = &g.info;
        Self {
            index: i.index,
            mig: i.mig.unwrap_or(u32::MAX),
            uuid: i.uuid.clone(),
            name: i.name.clone(),
            pci_bus_id: i.pci_bus_id.clone(),
            memory_total: i.memory_total,
            memory_used: i.memory_used,
            driver_version: i.driver_version.clone(),
            cuda_version: i.cuda_version.clone(),
            compute_mode: i.compute_mode.clone(),
            mig_mode: i.mig_mode.clone(),
            xid_errors: g.xid_errors,
        }
    }
}

impl From<NvmlUsage> for NvmlUsageRecord {
    fn from(u: NvmlUsage) -> Self {
        Self {
            cgroup_id: u.cgroup_id,
            cgroup: u.cgroup,
            gpu: u.gpu,
            nvml_memory_bytes: u.usage.memory_bytes,
            ebpf_memory_bytes: u.ebpf_memory_bytes,
            sm_util: u.usage.sm_util,
            enc_util: u.usage.enc_util,
            dec_util: u.usage.dec_util,
            pids: u.usage.pids,
        }
    }
}

impl From<AttributedXid> for NvmlEventRecord {
    fn from(e: AttributedXid) -> Self {
        Self {
            timestamp_us: e.timestamp_us,
            gpu: e.gpu,
            uuid: e.uuid,
            kind: "xid".into(),
            xid: e.xid,
            pid: e.pid.unwrap_or(0),
            cgroup_id: e.cgroup_id,
            cgroup: e.cgroup,
            pids: e.pids,
        }
    }
}

impl From<IdleEntry> for IdleRecord {
    fn from(i: IdleEntry) -> Self {
        Self {
            cgroup: i.cgroup,
            cgroup_id: i.cgroup_id,
            gpu: i.gpu,
            memory_bytes: i.memory_bytes,
            idle_secs: i.idle_for.as_secs(),
            last_active: i
                .last_active
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs()),
            util: i.util,
        }
    }
}

/// The controller's figures for one cgroup.
pub fn compute_record(cgroup: &str, s: &ComputeStat) -> ComputeRecord {
    ComputeRecord {
        cgroup: cgroup.to_owned(),
        duty: s.duty,
        target: s.target,
        measured: s.measured,
        throttled_usec: s.throttled_usec,
        nr_throttled: s.nr_throttled,
    }
}

/// Every element converted.
pub fn all<T, R: From<T>>(items: Vec<T>) -> Vec<R> {
    items.into_iter().map(R::from).collect()
}
