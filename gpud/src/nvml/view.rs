//! The state task's side of NVML: what the last snapshot said (status, inventory, per-process
//! samples), per-cgroup aggregates, the Xid counts and the recent events.

use std::{
    collections::{BTreeMap, VecDeque},
    time::Instant,
};

use tracing::{info, warn};

use super::{GpuInfo, ProcessSample, Update};

/// How many events [`NvmlView`] keeps.
pub const EVENTS_KEPT: usize = 64;

/// An Xid event as the state task attributed it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttributedXid {
    /// Wall clock when it was received, µs since the Unix epoch.
    pub timestamp_us: u64,
    pub gpu: u32,
    pub uuid: String,
    /// The Xid number (999: NVML does not know it).
    pub xid: u64,
    /// Every process NVML reported on that GPU at the last sample.
    pub pids: Vec<u32>,
    /// The process it is attributed to: the only one NVML reported on that GPU (NVML's event
    /// record names the device, not a process); `None` if there were none or several.
    pub pid: Option<u32>,
    /// That process's cgroup path (empty if none).
    pub cgroup: String,
    /// That cgroup's id when the event came (0 if none).
    pub cgroup_id: u64,
}

/// A GPU or MIG device of the inventory with the critical Xid errors seen on it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuStatus {
    pub info: GpuInfo,
    /// Critical Xid errors seen on it since the daemon started.
    pub xid_errors: u64,
}

/// The state task's view of NVML: status, inventory, and per-cgroup usage.
#[derive(Clone, Debug, Default)]
pub struct NvmlView {
    pub available: bool,
    /// Why NVML is unavailable, or `"available"`.
    pub status: String,
    pub gpus: Vec<GpuInfo>,
    pub processes: Vec<ProcessSample>,
    /// The last read's new device utilization windows per GPU (see [`Update`]).
    pub device_windows: BTreeMap<u32, Vec<(u64, u32)>>,
    pub updated: Option<Instant>,
    /// The wall clock (µs) of the last read, as the sampler took it.
    pub clock_us: u64,
    /// The most recent Xid events, oldest first (at most [`EVENTS_KEPT`]).
    pub events: VecDeque<AttributedXid>,
    /// Critical Xid errors seen per GPU UUID since the daemon started.
    pub xid_errors: BTreeMap<String, u64>,
}

impl NvmlView {
    pub fn disabled() -> Self {
        Self {
            status: "disabled by configuration (nvml.enabled = false)".into(),
            ..Self::default()
        }
    }

    pub fn apply(&mut self, s: Update) {
        match s {
            Update::Unavailable(reason) => {
                if self.available || self.status != reason {
                    warn!("NVML unavailable: {reason}");
                }
                self.available = false;
                self.status = reason;
                // What NVML said last may no longer be true: no inventory, no usage.
                self.gpus.clear();
                self.processes.clear();
            }
            Update::Available {
                gpus,
                processes,
                device_windows,
                clock_us,
            } => {
                if !self.available {
                    info!(gpus = gpus.len(), "NVML available");
                }
                self.available = true;
                self.status = "available".into();
                self.gpus = gpus;
                self.processes = processes;
                self.device_windows = device_windows;
                self.clock_us = clock_us;
            }
            Update::Xid { uuid, xid } => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros() as u64);
                self.on_xid(uuid, xid, now, |_| 0);
                return;
            }
        }
        self.updated = Some(Instant::now());
    }

    /// Records an Xid event on the device with `uuid`: counts it for that GPU, attributes it to
    /// the GPU's only process if it has exactly one (with the id `cgroup_id_of` gives its cgroup
    /// path), keeps it among the recent events and returns it.
    pub fn on_xid(
        &mut self,
        uuid: String,
        xid: Option<u64>,
        timestamp_us: u64,
        cgroup_id_of: impl FnOnce(&str) -> u64,
    ) -> AttributedXid {
        *self.xid_errors.entry(uuid.clone()).or_default() += 1;
        // A MIG device's event counts against its parent GPU (the inventory gives its index).
        let gpu = self
            .gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .map_or(u32::MAX, |g| g.index);
        let on_gpu: Vec<&ProcessSample> = self.processes.iter().filter(|p| p.gpu == gpu).collect();
        let only = match on_gpu.as_slice() {
            [one] => Some(*one),
            _ => None,
        };
        let mut pids: Vec<u32> = on_gpu.iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        let rec = AttributedXid {
            timestamp_us,
            gpu,
            uuid,
            xid: xid.unwrap_or(999),
            pids,
            pid: only.map(|p| p.pid),
            cgroup_id: only.map_or(0, |p| cgroup_id_of(&p.cgroup)),
            cgroup: only.map(|p| p.cgroup.clone()).unwrap_or_default(),
        };
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(rec.clone());
        rec
    }

    /// The inventory with each device's Xid count.
    pub fn inventory(&self) -> Vec<GpuStatus> {
        self.gpus
            .iter()
            .map(|g| GpuStatus {
                info: g.clone(),
                xid_errors: self.xid_errors.get(&g.uuid).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Per cgroup path and GPU: memory, utilization and pids.
    pub fn by_cgroup(&self) -> BTreeMap<(String, u32), CgroupUsage> {
        let mut out: BTreeMap<(String, u32), CgroupUsage> = BTreeMap::new();
        for p in &self.processes {
            let u = out.entry((p.cgroup.clone(), p.gpu)).or_default();
            u.memory_bytes += p.memory_bytes;
            u.sampled |= p.sm_util.is_some();
            u.sm_util += p.sm_util.unwrap_or(0);
            u.enc_util += p.enc_util.unwrap_or(0);
            u.dec_util += p.dec_util.unwrap_or(0);
            u.pids.push(p.pid);
        }
        for u in out.values_mut() {
            u.sm_util = u.sm_util.min(100);
            u.enc_util = u.enc_util.min(100);
            u.dec_util = u.dec_util.min(100);
            u.pids.sort_unstable();
            u.pids.dedup();
        }
        out
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupUsage {
    pub memory_bytes: u64,
    /// Whether NVML returned a utilization sample for any of its processes since the previous
    /// snapshot (no sample is not the same as idle).
    pub sampled: bool,
    pub sm_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
    pub pids: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_summed_per_cgroup_and_gpu_and_capped() {
        let p = |pid, gpu, cg: &str, mem, sm| ProcessSample {
            pid,
            gpu,
            cgroup: cg.into(),
            memory_bytes: mem,
            sm_util: sm,
            ..ProcessSample::default()
        };
        let mut v = NvmlView::default();
        v.apply(Update::Available {
            gpus: vec![],
            processes: vec![
                p(1, 0, "/a", 10, Some(70)),
                p(2, 0, "/a", 5, Some(60)),
                p(3, 1, "/a", 7, None),
                p(4, 0, "/b", 1, Some(3)),
            ],
            device_windows: BTreeMap::new(),
            clock_us: 0,
        });
        let by = v.by_cgroup();
        let a0 = &by[&("/a".to_owned(), 0)];
        assert_eq!(
            (a0.memory_bytes, a0.sm_util, a0.pids.clone()),
            (15, 100, vec![1, 2])
        );
        assert_eq!(by[&("/a".to_owned(), 1)].sm_util, 0);
        assert_eq!(by[&("/b".to_owned(), 0)].memory_bytes, 1);
        v.apply(Update::Unavailable("gone".into()));
        assert!(!v.available && v.by_cgroup().is_empty() && v.status == "gone");
        assert!(v.gpus.is_empty());
    }

    #[test]
    fn xid_goes_to_the_only_process_on_its_gpu() {
        let p = |pid, gpu, cg: &str| ProcessSample {
            pid,
            gpu,
            cgroup: cg.into(),
            ..ProcessSample::default()
        };
        let mut v = NvmlView::default();
        let gpu = |index, mig, uuid: &str| GpuInfo {
            index,
            mig,
            uuid: uuid.into(),
            ..GpuInfo::default()
        };
        v.apply(Update::Available {
            gpus: vec![
                gpu(0, None, "GPU-0"),
                gpu(1, None, "GPU-1"),
                gpu(1, Some(0), "MIG-1"),
            ],
            processes: vec![p(10, 0, "/a"), p(20, 1, "/b"), p(21, 1, "/c")],
            device_windows: BTreeMap::new(),
            clock_us: 0,
        });
        let a = v.on_xid(
            "GPU-0".into(),
            Some(79),
            5,
            |p| if p == "/a" { 42 } else { 0 },
        );
        assert_eq!(a.cgroup_id, 42);
        assert_eq!(
            (a.gpu, a.xid, a.pid, a.cgroup.as_str(), a.pids.clone()),
            (0, 79, Some(10), "/a", vec![10])
        );
        // Two processes on the GPU: the event names neither.
        let b = v.on_xid("MIG-1".into(), None, 6, |_| 7);
        assert_eq!(b.cgroup_id, 0, "no cgroup when the event names no process");
        assert_eq!(
            (b.gpu, b.xid, b.pid, b.cgroup.as_str(), b.pids.clone()),
            (1, 999, None, "", vec![20, 21])
        );
        assert_eq!(
            v.xid_errors,
            BTreeMap::from([("GPU-0".into(), 1), ("MIG-1".into(), 1)])
        );
        for i in 0..EVENTS_KEPT {
            v.apply(Update::Xid {
                uuid: "GPU-0".into(),
                xid: Some(i as u64),
            });
        }
        assert_eq!(v.xid_errors.get("GPU-0"), Some(&(EVENTS_KEPT as u64 + 1)));
        assert_eq!(v.events.len(), EVENTS_KEPT);
        assert_eq!(v.events.back().map(|e| e.xid), Some(EVENTS_KEPT as u64 - 1));
    }
}
