//! NVML: the driver's own view of GPUs and of the processes using them, read with nvml-wrapper on
//! a sampler thread (NVML calls block) and handed to the state task as snapshots. This module owns
//! the NVML library handle, the per-GPU last-seen utilization timestamps and the retry schedule;
//! the state task owns what the snapshots say (see [`NvmlView`]).
//!
//! NVML is the ground truth for what the ioctl probes cannot see: per-process memory including
//! RM-internal allocations, and GPU utilization (kernel launches are not ioctls). When the library
//! is missing, no GPU is present or NVML fails, the daemon runs on without it, reports why, and
//! retries every `nvml.retry_interval_secs`.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    time::{Duration, Instant},
};

use nvml_wrapper::{Device, Nvml, enums::device::UsedGpuMemory};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

/// Failures of one NVML step, reported as the reason NVML is unavailable.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("cannot load NVML from {path}: {source}")]
    Load {
        path: String,
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("NVML {call}: {source}")]
    Call {
        call: &'static str,
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("no GPU found by NVML")]
    NoGpu,
}

fn call<T>(
    what: &'static str,
    r: Result<T, nvml_wrapper::error::NvmlError>,
) -> Result<T, NvmlError> {
    r.map_err(|source| NvmlError::Call { call: what, source })
}

/// Settings of the sampler (`[nvml]` in the configuration).
#[derive(Clone, Debug)]
pub struct SamplerSettings {
    pub library_path: Option<PathBuf>,
    pub sample_interval: Duration,
    pub retry_interval: Duration,
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
    /// `default`, `exclusive_process`, `prohibited`, ...
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
}

/// What the sampler saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Snapshot {
    Unavailable(String),
    Available {
        gpus: Vec<GpuInfo>,
        processes: Vec<ProcessSample>,
    },
    /// A critical Xid error on the GPU with this UUID (NVML's event names the GPU, not a
    /// process). `None`: NVML did not say which Xid.
    Xid {
        uuid: String,
        xid: Option<u64>,
    },
}

/// The state task's view of NVML: status, inventory, and per-cgroup usage.
#[derive(Clone, Debug, Default)]
pub struct NvmlView {
    pub available: bool,
    /// Why NVML is unavailable, or `"available"`.
    pub status: String,
    pub gpus: Vec<GpuInfo>,
    pub processes: Vec<ProcessSample>,
    pub updated: Option<Instant>,
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

    pub fn apply(&mut self, s: Snapshot) {
        match s {
            Snapshot::Unavailable(reason) => {
                if self.available || self.status != reason {
                    warn!("NVML unavailable: {reason}");
                }
                self.available = false;
                self.status = reason;
                self.processes.clear();
            }
            Snapshot::Available { gpus, processes } => {
                if !self.available {
                    info!(gpus = gpus.len(), "NVML available");
                }
                self.available = true;
                self.status = "available".into();
                self.gpus = gpus;
                self.processes = processes;
            }
            Snapshot::Xid { uuid, xid } => {
                let gpu = self
                    .gpus
                    .iter()
                    .find(|g| g.uuid == uuid)
                    .map(|g| g.index.to_string())
                    .unwrap_or_else(|| "?".into());
                warn!(gpu, uuid = %uuid, xid = ?xid, "critical Xid error on the GPU");
                *self.xid_errors.entry(uuid).or_default() += 1;
                return;
            }
        }
        self.updated = Some(Instant::now());
    }

    /// Per cgroup path and GPU: memory, utilization and pids.
    pub fn by_cgroup(&self) -> BTreeMap<(String, u32), CgroupUsage> {
        let mut out: BTreeMap<(String, u32), CgroupUsage> = BTreeMap::new();
        for p in &self.processes {
            let u = out.entry((p.cgroup.clone(), p.gpu)).or_default();
            u.memory_bytes += p.memory_bytes;
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

    /// Pids the driver reports on any GPU.
    pub fn reported_pids(&self) -> std::collections::HashSet<u32> {
        self.processes.iter().map(|p| p.pid).collect()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupUsage {
    pub memory_bytes: u64,
    pub sm_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
    pub pids: Vec<u32>,
}

/// cgroup v2 path of a process, from the `0::` line of `/proc/<pid>/cgroup`.
pub fn cgroup_of_pid_text(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().to_owned())
}

fn cgroup_of_pid(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()
        .and_then(|t| cgroup_of_pid_text(&t))
        .unwrap_or_default()
}

/// The sampler: owns the NVML handle and the last-seen utilization timestamps.
pub struct Sampler {
    settings: SamplerSettings,
    nvml: Option<Nvml>,
    /// Per GPU index: the newest utilization sample timestamp already consumed, so no sample is
    /// counted twice.
    last_seen: HashMap<u32, u64>,
    next_try: Instant,
}

impl Sampler {
    pub fn new(settings: SamplerSettings) -> Self {
        Self {
            settings,
            nvml: None,
            last_seen: HashMap::new(),
            next_try: Instant::now(),
        }
    }

    fn init(&self) -> Result<Nvml, NvmlError> {
        let mut b = Nvml::builder();
        let path_text = match &self.settings.library_path {
            Some(p) => {
                b.lib_path(p.as_os_str());
                p.display().to_string()
            }
            None => "libnvidia-ml.so.1 (system default)".to_owned(),
        };
        b.init().map_err(|source| NvmlError::Load {
            path: path_text,
            source,
        })
    }

    /// One sampling step: (re)initializes when due, then reads inventory and processes.
    /// Returns `None` while waiting to retry (nothing new to say).
    pub fn step(&mut self) -> Option<Snapshot> {
        if self.nvml.is_none() {
            if Instant::now() < self.next_try {
                return None;
            }
            self.next_try = Instant::now() + self.settings.retry_interval;
            match self.init() {
                Ok(n) => {
                    self.nvml = Some(n);
                    self.last_seen.clear();
                }
                Err(e) => return Some(Snapshot::Unavailable(e.to_string())),
            }
        }
        let result = match &self.nvml {
            Some(n) => sample(n, &mut self.last_seen),
            None => return None,
        };
        match result {
            Ok((gpus, processes)) => Some(Snapshot::Available { gpus, processes }),
            Err(e) => {
                // Drop the handle (shuts NVML down) and retry from scratch later.
                self.nvml = None;
                self.next_try = Instant::now() + self.settings.retry_interval;
                Some(Snapshot::Unavailable(e.to_string()))
            }
        }
    }

    pub fn interval(&self) -> Duration {
        self.settings.sample_interval
    }
}

/// Watches NVML's critical Xid events on a thread of its own (`nvmlEventSetWait` blocks): it owns
/// its NVML handle and event set, re-initializes after failures, and stops when `stop` says so or
/// the receiver is gone.
pub fn watch_xid(
    settings: SamplerSettings,
    mut send: impl FnMut(Snapshot) -> bool,
    stop: impl Fn() -> bool,
) {
    while !stop() {
        let nvml = match Sampler::new(settings.clone()).init() {
            Ok(n) => n,
            Err(_) => {
                // The sampler reports why; just try again later.
                std::thread::sleep(settings.retry_interval);
                continue;
            }
        };
        let mut set = nvml.create_event_set().ok();
        let count = nvml.device_count().unwrap_or(0);
        for i in 0..count {
            let (Ok(d), Some(s)) = (nvml.device_by_index(i), set.take()) else {
                break;
            };
            set = match d.register_events(
                nvml_wrapper::bitmasks::event::EventTypes::CRITICAL_XID_ERROR,
                s,
            ) {
                Ok(s) => Some(s),
                // Not every GPU supports events; the failed set is gone, start a fresh one.
                Err(e) => {
                    debug!(gpu = i, "Xid events unavailable: {}", e.error);
                    nvml.create_event_set().ok()
                }
            };
        }
        let Some(set) = set else {
            std::thread::sleep(settings.retry_interval);
            continue;
        };
        loop {
            if stop() {
                return;
            }
            match set.wait(500) {
                Ok(ev) => {
                    let uuid = ev.device.uuid().unwrap_or_default();
                    let xid = match ev.event_data {
                        Some(nvml_wrapper::enums::event::XidError::Value(v)) => Some(v),
                        _ => None,
                    };
                    if !send(Snapshot::Xid { uuid, xid }) {
                        return;
                    }
                }
                Err(nvml_wrapper::error::NvmlError::Timeout) => {}
                Err(_) => break,
            }
        }
        std::thread::sleep(settings.retry_interval);
    }
}

fn device_info(
    d: &Device<'_>,
    index: u32,
    mig: Option<u32>,
    driver: &str,
    cuda: &str,
) -> Result<GpuInfo, NvmlError> {
    let mem = call("memory info", d.memory_info())?;
    let compute_mode = match d.compute_mode() {
        Ok(m) => format!("{m:?}").to_lowercase(),
        Err(_) => "n/a".into(),
    };
    let mig_mode = match (mig, d.mig_mode()) {
        (None, Ok(m)) if m.current == 1 => "enabled".into(),
        (None, Ok(_)) => "disabled".into(),
        _ => "n/a".into(),
    };
    Ok(GpuInfo {
        index,
        mig,
        uuid: call("UUID", d.uuid())?,
        name: call("name", d.name())?,
        pci_bus_id: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
        memory_total: mem.total,
        memory_used: mem.used,
        driver_version: driver.to_owned(),
        cuda_version: cuda.to_owned(),
        compute_mode,
        mig_mode,
    })
}

type Sample = (Vec<GpuInfo>, Vec<ProcessSample>);

fn sample(n: &Nvml, last_seen: &mut HashMap<u32, u64>) -> Result<Sample, NvmlError> {
    let count = call("device count", n.device_count())?;
    if count == 0 {
        return Err(NvmlError::NoGpu);
    }
    let driver = call("driver version", n.sys_driver_version())?;
    let cuda = n
        .sys_cuda_driver_version()
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_else(|_| "n/a".into());
    let mut gpus = Vec::new();
    let mut processes = Vec::new();
    for i in 0..count {
        let d = call("device handle", n.device_by_index(i))?;
        let info = device_info(&d, i, None, &driver, &cuda)?;
        let mig_on = info.mig_mode == "enabled";
        gpus.push(info);
        if mig_on {
            let max = d.mig_device_count().unwrap_or(0);
            for m in 0..max {
                if let Ok(md) = d.mig_device_by_index(m) {
                    gpus.push(device_info(&md, i, Some(m), &driver, &cuda)?);
                }
            }
        }
        let mut procs: BTreeMap<u32, ProcessSample> = BTreeMap::new();
        let listed = call("compute processes", d.running_compute_processes())?
            .into_iter()
            .chain(call("graphics processes", d.running_graphics_processes())?);
        for p in listed {
            let e = procs.entry(p.pid).or_insert_with(|| ProcessSample {
                pid: p.pid,
                gpu: i,
                cgroup: cgroup_of_pid(p.pid),
                ..ProcessSample::default()
            });
            if let UsedGpuMemory::Used(b) = p.used_gpu_memory {
                e.memory_bytes += b;
            }
        }
        let seen = last_seen.get(&i).copied();
        let samples = match d.process_utilization_stats(seen) {
            Ok(s) => s,
            // NotFound: no sample newer than `seen`.
            Err(nvml_wrapper::error::NvmlError::NotFound) => Vec::new(),
            Err(e) => {
                return Err(NvmlError::Call {
                    call: "process utilization",
                    source: e,
                });
            }
        };
        // Average each process's new samples; remember the newest timestamp.
        let mut acc: BTreeMap<u32, (u32, u32, u32, u32)> = BTreeMap::new();
        for s in &samples {
            let a = acc.entry(s.pid).or_default();
            a.0 += s.sm_util;
            a.1 += s.enc_util;
            a.2 += s.dec_util;
            a.3 += 1;
            let newest = last_seen.entry(i).or_insert(0);
            *newest = (*newest).max(s.timestamp);
        }
        for (pid, (sm, enc, dec, n)) in acc {
            let e = procs.entry(pid).or_insert_with(|| ProcessSample {
                pid,
                gpu: i,
                cgroup: cgroup_of_pid(pid),
                ..ProcessSample::default()
            });
            e.sm_util = Some(sm / n);
            e.enc_util = Some(enc / n);
            e.dec_util = Some(dec / n);
        }
        processes.extend(procs.into_values());
    }
    debug!(
        gpus = gpus.len(),
        processes = processes.len(),
        "NVML sample"
    );
    Ok((gpus, processes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_v2_line_is_found_among_v1_lines() {
        let hybrid = "12:cpu,cpuacct:/x\n1:name=systemd:/user.slice\n0::/kubepods/pod1/ctr\n";
        assert_eq!(
            cgroup_of_pid_text(hybrid).as_deref(),
            Some("/kubepods/pod1/ctr")
        );
        assert_eq!(cgroup_of_pid_text("0::/\n").as_deref(), Some("/"));
        assert_eq!(cgroup_of_pid_text("3:memory:/a\n"), None);
        assert_eq!(cgroup_of_pid_text(""), None);
    }

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
        v.apply(Snapshot::Available {
            gpus: vec![],
            processes: vec![
                p(1, 0, "/a", 10, Some(70)),
                p(2, 0, "/a", 5, Some(60)),
                p(3, 1, "/a", 7, None),
                p(4, 0, "/b", 1, Some(3)),
            ],
        });
        let by = v.by_cgroup();
        let a0 = &by[&("/a".to_owned(), 0)];
        assert_eq!(
            (a0.memory_bytes, a0.sm_util, a0.pids.clone()),
            (15, 100, vec![1, 2])
        );
        assert_eq!(by[&("/a".to_owned(), 1)].sm_util, 0);
        assert_eq!(by[&("/b".to_owned(), 0)].memory_bytes, 1);
        v.apply(Snapshot::Unavailable("gone".into()));
        assert!(!v.available && v.by_cgroup().is_empty() && v.status == "gone");
    }
}
