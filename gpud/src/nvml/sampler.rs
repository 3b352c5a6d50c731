//! The sampler thread's side of NVML: owns the library handle, the per-GPU last-seen utilization
//! timestamps, the Xid event set and the retry schedule, and sends what it reads to the state task
//! as [`Update`]s. Its settings are live: a reload's new intervals apply from the next wait.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    time::{Duration, Instant},
};

use nvml_wrapper::{
    Device, EventSet, Nvml, bitmasks::event::EventTypes, enum_wrappers::device::ComputeMode,
    enums::device::UsedGpuMemory, enums::event::XidError, error::NvmlError as WrapperError,
    struct_wrappers::device::ProcessInfo,
};
use tokio::sync::watch;
use tracing::{debug, warn};

use super::{GpuInfo, NvmlError, ProcessSample, Update};
use crate::{cgroupfs::CgroupFs, report::Chain};

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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SamplerSettings {
    pub library_path: Option<PathBuf>,
    pub sample_interval: Duration,
    pub retry_interval: Duration,
}

impl SamplerSettings {
    pub fn of(c: &crate::config::NvmlConfig) -> Self {
        Self {
            library_path: c.library(),
            sample_interval: Duration::from_millis(c.sample_interval_ms),
            retry_interval: Duration::from_secs(c.retry_interval_secs),
        }
    }
}

fn cgroup_of_pid(pid: u32) -> String {
    CgroupFs::path_of_pid(pid).unwrap_or_default()
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
    /// Read at every use: a reload changes the intervals (the library path is only read when NVML
    /// is loaded, so a new one takes effect at the next retry).
    settings: watch::Receiver<SamplerSettings>,
    /// Per GPU index: the newest utilization sample timestamp already consumed, so no sample is
    /// counted twice.
    last_seen: HashMap<u32, u64>,
    /// Per GPU, the newest device utilization window taken.
    device_seen: HashMap<u32, u64>,
}

impl Sampler {
    pub fn new(settings: watch::Receiver<SamplerSettings>) -> Self {
        Self {
            settings,
            last_seen: HashMap::new(),
            device_seen: HashMap::new(),
        }
    }

    fn init(&self) -> Result<Nvml, NvmlError> {
        let mut b = Nvml::builder();
        let library = self.settings.borrow().library_path.clone();
        let path_text = match &library {
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
    pub fn run(mut self, mut send: impl FnMut(Update) -> bool, stop: impl Fn() -> bool) {
        while !stop() {
            let failure = match self.init() {
                Ok(nvml) => {
                    self.last_seen.clear();
                    self.device_seen.clear();
                    match self.session(&nvml, &mut send, &stop) {
                        Ended::Stop => return,
                        Ended::Failed(e) => e,
                    }
                    // `nvml` drops here: nvmlShutdown, and the library is closed.
                }
                Err(e) => e,
            };
            // The reason is status text at the API edge: with its causes.
            if !send(Update::Unavailable(Chain(&failure).to_string())) {
                return;
            }
            let retry = self.settings.borrow().retry_interval;
            if pause(retry, &stop) {
                return;
            }
        }
    }

    fn session(
        &mut self,
        nvml: &Nvml,
        send: &mut impl FnMut(Update) -> bool,
        stop: &impl Fn() -> bool,
    ) -> Ended {
        let mut events = xid_event_set(nvml);
        loop {
            let (gpus, processes, device_windows) =
                match sample(nvml, &mut self.last_seen, &mut self.device_seen) {
                    Ok(s) => s,
                    Err(e) => return Ended::Failed(e),
                };
            let clock_us = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64);
            if !send(Update::Available {
                gpus,
                processes,
                device_windows,
                clock_us,
            }) {
                return Ended::Stop;
            }
            let deadline = Instant::now() + self.settings.borrow().sample_interval;
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
                        let xid = Update::Xid {
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

type Sample = (
    Vec<GpuInfo>,
    Vec<ProcessSample>,
    BTreeMap<u32, Vec<(u64, u32)>>,
);

fn sample(
    n: &Nvml,
    last_seen: &mut HashMap<u32, u64>,
    device_seen: &mut HashMap<u32, u64>,
) -> Result<Sample, NvmlError> {
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
    let mut device_windows = BTreeMap::new();
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
        if !mig_on {
            device_windows.insert(i, device_utilization(&d, device_seen.entry(i).or_insert(0)));
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
        let mut windows: BTreeMap<u32, Vec<(u64, u32)>> = BTreeMap::new();
        for s in samples.iter().filter(|s| s.timestamp > *newest) {
            windows
                .entry(s.pid)
                .or_default()
                .push((s.timestamp, s.sm_util));
        }
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
            e.windows = windows.remove(&pid).unwrap_or_default();
            e.windows.sort_unstable();
        }
        processes.extend(procs.into_values());
    }
    debug!(
        gpus = gpus.len(),
        processes = processes.len(),
        "NVML sample"
    );
    Ok((gpus, processes, device_windows))
}

/// NVML's device utilization windows newer than `*seen` (µs timestamp, percent), oldest first,
/// advancing `*seen`. What the compute controller's firmware probe reads: unlike the
/// per-process samples, a window in which nothing ran is listed (0). None where NVML does not
/// keep them (an older library, a MIG device): the probe then goes by the per-process samples.
fn device_utilization(d: &nvml_wrapper::Device<'_>, seen: &mut u64) -> Vec<(u64, u32)> {
    use nvml_wrapper::{enum_wrappers::device::Sampling, enums::device::SampleValue};
    let Ok(samples) = d.samples(Sampling::GpuUtilization, *seen) else {
        return Vec::new();
    };
    let mut out: Vec<(u64, u32)> = samples
        .iter()
        .filter(|s| s.timestamp > *seen)
        .filter_map(|s| match s.value {
            SampleValue::U32(v) => Some((s.timestamp, v.min(100))),
            SampleValue::U64(v) => Some((s.timestamp, v.min(100) as u32)),
            _ => None,
        })
        .collect();
    out.sort_unstable();
    if let Some(&(t, _)) = out.last() {
        *seen = t;
    }
    out
}

#[cfg(test)]
mod tests {
    use nvml_wrapper::struct_wrappers::device::ProcessUtilizationSample;

    use super::*;

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
}
