//! NVML: the driver's own view of GPUs and of the processes using them, read with nvml-wrapper on
//! a sampler thread (NVML calls block) and handed to the state task as [`Snapshot`]s. This module
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

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    path::PathBuf,
    time::{Duration, Instant},
};

use nvml_wrapper::{
    Device, EventSet, Nvml, bitmasks::event::EventTypes, enum_wrappers::device::ComputeMode,
    enums::device::UsedGpuMemory, enums::event::XidError, error::NvmlError as WrapperError,
    struct_wrappers::device::ProcessInfo,
};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

/// Failures of one NVML step, reported as the reason NVML is unavailable.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("cannot load NVML from {path}: {source}")]
    Load { path: String, source: WrapperError },
    #[error("NVML {call}: {source}")]
    Call {
        call: &'static str,
        source: WrapperError,
    },
    #[error("no GPU found by NVML")]
    NoGpu,
}

fn call<T>(what: &'static str, r: Result<T, WrapperError>) -> Result<T, NvmlError> {
    r.map_err(|source| NvmlError::Call { call: what, source })
}

/// `Ok(None)` where this GPU does not offer the feature (`NotSupported`); other errors fail.
fn optional<T>(what: &'static str, r: Result<T, WrapperError>) -> Result<Option<T>, NvmlError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(WrapperError::NotSupported) => Ok(None),
        Err(source) => Err(NvmlError::Call { call: what, source }),
    }
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

/// The state task's view of NVML: status, inventory, and per-cgroup usage.
#[derive(Clone, Debug, Default)]
pub struct NvmlView {
    pub available: bool,
    /// Why NVML is unavailable, or `"available"`.
    pub status: String,
    pub gpus: Vec<GpuInfo>,
    pub processes: Vec<ProcessSample>,
    pub updated: Option<Instant>,
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

    pub fn apply(&mut self, s: Snapshot) {
        match s {
            Snapshot::Unavailable(reason) => {
                if self.available || self.status != reason {
                    warn!("NVML unavailable: {reason}");
                }
                self.available = false;
                self.status = reason;
                // What NVML said last may no longer be true: no inventory, no usage.
                self.gpus.clear();
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

    /// Pids the driver reports on any GPU.
    pub fn reported_pids(&self) -> std::collections::HashSet<u32> {
        self.processes.iter().map(|p| p.pid).collect()
    }

    /// Per GPU index, the pids the driver still reports there at the last sample: a process that
    /// holds accounting on a GPU but is not in its set has released its memory there. Empty while
    /// NVML is unavailable (then nothing can be concluded).
    pub fn reported_pids_by_gpu(&self) -> BTreeMap<u32, BTreeSet<u32>> {
        let mut by: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        if !self.available {
            return by;
        }
        for g in self.gpus.iter().filter(|g| g.mig.is_none()) {
            by.entry(g.index).or_default();
        }
        for p in &self.processes {
            by.entry(p.gpu).or_default().insert(p.pid);
        }
        by
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

/// cgroup v2 path of a process, from the `0::` line of `/proc/<pid>/cgroup`.
pub fn cgroup_of_pid_text(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().trim_end_matches(" (deleted)").to_owned())
}

fn cgroup_of_pid(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()
        .and_then(|t| cgroup_of_pid_text(&t))
        .unwrap_or_default()
}

/// Longest a blocking wait of the sampler lasts before it looks at the stop flag again.
const POLL: Duration = Duration::from_millis(200);

/// Why a session with an initialized NVML ended.
enum Ended {
    /// Asked to stop, or the state task is gone.
    Stop,
    Failed(NvmlError),
}

/// The sampler: owns the NVML handle and the last-seen utilization timestamps.
pub struct Sampler {
    settings: SamplerSettings,
    /// Per GPU index: the newest utilization sample timestamp already consumed, so no sample is
    /// counted twice.
    last_seen: HashMap<u32, u64>,
}

impl Sampler {
    pub fn new(settings: SamplerSettings) -> Self {
        Self {
            settings,
            last_seen: HashMap::new(),
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

    /// Samples until `stop()` is true or `send` reports the receiver gone: initializes NVML
    /// (again every `retry_interval` while that fails), samples every `sample_interval`, and
    /// waits for Xid events in between. A failing call ends the session: NVML is shut down and
    /// initialized afresh after `retry_interval`.
    pub fn run(mut self, mut send: impl FnMut(Snapshot) -> bool, stop: impl Fn() -> bool) {
        while !stop() {
            let failure = match self.init() {
                Ok(nvml) => {
                    self.last_seen.clear();
                    match self.session(&nvml, &mut send, &stop) {
                        Ended::Stop => return,
                        Ended::Failed(e) => e,
                    }
                    // `nvml` drops here: nvmlShutdown, and the library is closed.
                }
                Err(e) => e,
            };
            if !send(Snapshot::Unavailable(failure.to_string())) {
                return;
            }
            if pause(self.settings.retry_interval, &stop) {
                return;
            }
        }
    }

    fn session(
        &mut self,
        nvml: &Nvml,
        send: &mut impl FnMut(Snapshot) -> bool,
        stop: &impl Fn() -> bool,
    ) -> Ended {
        let mut events = xid_event_set(nvml);
        loop {
            let (gpus, processes) = match sample(nvml, &mut self.last_seen) {
                Ok(s) => s,
                Err(e) => return Ended::Failed(e),
            };
            if !send(Snapshot::Available { gpus, processes }) {
                return Ended::Stop;
            }
            let deadline = Instant::now() + self.settings.sample_interval;
            loop {
                if stop() {
                    return Ended::Stop;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let slice = left.min(POLL);
                let Some(set) = &events else {
                    std::thread::sleep(slice);
                    continue;
                };
                match set.wait(slice.as_millis().max(1) as u32) {
                    Ok(ev) => {
                        let xid = Snapshot::Xid {
                            uuid: ev.device.uuid().unwrap_or_default(),
                            xid: match ev.event_data {
                                Some(XidError::Value(v)) => Some(v),
                                _ => None,
                            },
                        };
                        if !send(xid) {
                            return Ended::Stop;
                        }
                    }
                    Err(WrapperError::Timeout) => {}
                    Err(e) => {
                        warn!(
                            "waiting for NVML events failed ({e}); Xid events are off until NVML is initialized again"
                        );
                        events = None;
                    }
                }
            }
        }
    }
}

/// Sleeps `d`, looking at `stop` every [`POLL`]; true if asked to stop.
fn pause(d: Duration, stop: &impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + d;
    loop {
        if stop() {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(left.min(POLL));
    }
}

/// An event set with critical Xid errors registered on every GPU that reports them; `None` where
/// none does or NVML refuses (logged: the rest of NVML works without events). Only GPUs that list
/// the event type are registered: nvml-wrapper frees the set when a registration is refused, which
/// would drop the GPUs registered before.
fn xid_event_set(nvml: &Nvml) -> Option<EventSet<'_>> {
    let count = nvml.device_count().ok()?;
    let mut set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            warn!("cannot create an NVML event set ({e}); no Xid events");
            return None;
        }
    };
    let mut watched = 0;
    for i in 0..count {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        if !d
            .supported_event_types()
            .is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR))
        {
            continue;
        }
        // A refusal frees the set (nvml-wrapper's contract), so it ends the watch.
        set = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => s,
            Err(e) => {
                warn!(gpu = i, "cannot watch NVML Xid events ({e}); no Xid events");
                return None;
            }
        };
        watched += 1;
    }
    debug!(gpus = watched, "watching NVML Xid events");
    (watched > 0).then_some(set)
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
        Ok(ComputeMode::Default) => "default",
        Ok(ComputeMode::ExclusiveThread) => "exclusive_thread",
        Ok(ComputeMode::Prohibited) => "prohibited",
        Ok(ComputeMode::ExclusiveProcess) => "exclusive_process",
        Err(_) => "n/a",
    }
    .to_owned();
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

/// Used memory per pid from NVML's compute and graphics lists. Each list's entries of one pid are
/// summed (one per context); a process in both lists (compute and graphics contexts) reports its
/// whole usage in each, so it counts once: the larger of the two.
fn memory_by_pid(compute: &[ProcessInfo], graphics: &[ProcessInfo]) -> BTreeMap<u32, u64> {
    let sum = |list: &[ProcessInfo]| {
        let mut m: BTreeMap<u32, u64> = BTreeMap::new();
        for p in list {
            let bytes = match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            };
            *m.entry(p.pid).or_default() += bytes;
        }
        m
    };
    let mut out = sum(compute);
    for (pid, bytes) in sum(graphics) {
        let e = out.entry(pid).or_default();
        *e = (*e).max(bytes);
    }
    out
}

/// Utilization samples per pid, averaged, keeping only samples newer than `*last_seen` and
/// advancing it to the newest one taken: (sm, enc, dec) in percent.
fn average_new_samples(
    samples: &[nvml_wrapper::struct_wrappers::device::ProcessUtilizationSample],
    last_seen: &mut u64,
) -> BTreeMap<u32, (u32, u32, u32)> {
    let since = *last_seen;
    let mut acc: BTreeMap<u32, (u64, u64, u64, u64)> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.timestamp > since) {
        let a = acc.entry(s.pid).or_default();
        a.0 += u64::from(s.sm_util);
        a.1 += u64::from(s.enc_util);
        a.2 += u64::from(s.dec_util);
        a.3 += 1;
        *last_seen = (*last_seen).max(s.timestamp);
    }
    acc.into_iter()
        .map(|(pid, (sm, enc, dec, n))| {
            (pid, ((sm / n) as u32, (enc / n) as u32, (dec / n) as u32))
        })
        .collect()
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
        let compute = call("compute processes", d.running_compute_processes())?;
        let graphics = optional("graphics processes", d.running_graphics_processes())?;
        let mut procs: BTreeMap<u32, ProcessSample> = BTreeMap::new();
        for (pid, bytes) in memory_by_pid(&compute, graphics.as_deref().unwrap_or_default()) {
            procs.insert(
                pid,
                ProcessSample {
                    pid,
                    gpu: i,
                    cgroup: cgroup_of_pid(pid),
                    memory_bytes: bytes,
                    ..ProcessSample::default()
                },
            );
        }
        let seen = last_seen.get(&i).copied();
        let samples = match d.process_utilization_stats(seen) {
            Ok(s) => s,
            // NotFound: no sample newer than `seen`. NotSupported: this GPU does not sample per
            // process (MIG). InsufficientSize: a process appeared between NVML's size query and
            // the read; it is read next time (`seen` stays, so nothing is lost).
            Err(
                WrapperError::NotFound
                | WrapperError::NotSupported
                | WrapperError::InsufficientSize(_),
            ) => Vec::new(),
            Err(e) => {
                return Err(NvmlError::Call {
                    call: "process utilization",
                    source: e,
                });
            }
        };
        let newest = last_seen.entry(i).or_insert(0);
        for (pid, (sm, enc, dec)) in average_new_samples(&samples, newest) {
            let e = procs.entry(pid).or_insert_with(|| ProcessSample {
                pid,
                gpu: i,
                cgroup: cgroup_of_pid(pid),
                ..ProcessSample::default()
            });
            e.sm_util = Some(sm);
            e.enc_util = Some(enc);
            e.dec_util = Some(dec);
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
    use nvml_wrapper::struct_wrappers::device::ProcessUtilizationSample;

    use super::*;

    #[test]
    fn cgroup_v2_line_is_found_among_v1_lines() {
        let hybrid = "12:cpu,cpuacct:/x\n1:name=systemd:/user.slice\n0::/kubepods/pod1/ctr\n";
        assert_eq!(
            cgroup_of_pid_text(hybrid).as_deref(),
            Some("/kubepods/pod1/ctr")
        );
        assert_eq!(cgroup_of_pid_text("0::/\n").as_deref(), Some("/"));
        assert_eq!(
            cgroup_of_pid_text("0::/gone (deleted)\n").as_deref(),
            Some("/gone")
        );
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
        assert_eq!(
            v.reported_pids_by_gpu(),
            BTreeMap::from([(0, BTreeSet::from([1, 2, 4])), (1, BTreeSet::from([3]))])
        );
        v.apply(Snapshot::Unavailable("gone".into()));
        assert!(!v.available && v.by_cgroup().is_empty() && v.status == "gone");
        assert!(v.gpus.is_empty() && v.reported_pids_by_gpu().is_empty());
    }

    fn info(pid: u32, bytes: u64) -> ProcessInfo {
        ProcessInfo {
            pid,
            used_gpu_memory: UsedGpuMemory::Used(bytes),
            gpu_instance_id: None,
            compute_instance_id: None,
        }
    }

    #[test]
    fn a_process_with_compute_and_graphics_contexts_counts_once() {
        let compute = [info(1, 100), info(2, 30), info(2, 20)];
        let graphics = [info(1, 100), info(3, 7)];
        let m = memory_by_pid(&compute, &graphics);
        assert_eq!(m, BTreeMap::from([(1, 100), (2, 50), (3, 7)]));
        let unavailable = ProcessInfo {
            used_gpu_memory: UsedGpuMemory::Unavailable,
            ..info(4, 0)
        };
        assert_eq!(memory_by_pid(&[unavailable], &[]), BTreeMap::from([(4, 0)]));
    }

    #[test]
    fn samples_already_seen_are_not_counted_again() {
        let s = |pid, timestamp, sm_util| ProcessUtilizationSample {
            pid,
            timestamp,
            sm_util,
            mem_util: 0,
            enc_util: 0,
            dec_util: 0,
        };
        let mut seen = 0;
        let first = [s(1, 10, 40), s(1, 20, 60), s(2, 20, 10)];
        assert_eq!(
            average_new_samples(&first, &mut seen),
            BTreeMap::from([(1, (50, 0, 0)), (2, (10, 0, 0))])
        );
        assert_eq!(seen, 20);
        // A source that hands old samples again: only the new one counts.
        let second = [s(1, 10, 40), s(1, 20, 60), s(1, 30, 90)];
        assert_eq!(
            average_new_samples(&second, &mut seen),
            BTreeMap::from([(1, (90, 0, 0))])
        );
        assert_eq!(seen, 30);
        assert!(average_new_samples(&second, &mut seen).is_empty());
        assert_eq!(seen, 30);
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
        v.apply(Snapshot::Available {
            gpus: vec![
                gpu(0, None, "GPU-0"),
                gpu(1, None, "GPU-1"),
                gpu(1, Some(0), "MIG-1"),
            ],
            processes: vec![p(10, 0, "/a"), p(20, 1, "/b"), p(21, 1, "/c")],
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
            v.apply(Snapshot::Xid {
                uuid: "GPU-0".into(),
                xid: Some(i as u64),
            });
        }
        assert_eq!(v.xid_errors.get("GPU-0"), Some(&(EVENTS_KEPT as u64 + 1)));
        assert_eq!(v.events.len(), EVENTS_KEPT);
        assert_eq!(v.events.back().map(|e| e.xid), Some(EVENTS_KEPT as u64 - 1));
    }
}
