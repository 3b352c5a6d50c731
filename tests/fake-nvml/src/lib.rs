//! A stand-in for `libnvidia-ml.so` (test fixture; never in gpud's code path): the NVML calls
//! gpud makes, with NVML's real C ABI (layouts from `nvml-wrapper-sys`), answered from a scenario
//! file, so gpud's real `nvml-wrapper` code path runs against it. gpud cannot tell it from the
//! real library: it is loaded through `nvml.library_path` like any libnvidia-ml.
//!
//! # What this fake models, and how far to trust it
//!
//! The calls and their semantics come from NVML's documentation and headers; each behaviour a
//! test relies on must also be seen once through the real library on a GPU, by a script under
//! `tests/gpu/` (results in docs/real-gpu.md). Trust the rest no further than the documentation.
//!
//! Checked on an H100 (driver 580, CUDA 13, through gpud's own nvml-wrapper path):
//! * the inventory gpud shows (name, UUID, PCI bus id, memory total, driver and CUDA versions,
//!   compute mode, MIG mode disabled) and per-process used memory from
//!   `nvmlDeviceGetComputeRunningProcesses_v3`, attributed to the right cgroup and equal to the
//!   probes' bytes: `tests/gpu/real-gpu.sh`;
//! * per-process utilization from `nvmlDeviceGetProcessUtilization` at a 100 ms sampling
//!   interval: `tests/gpu/compute-gpu.sh`. There the samples are coarse (0 or 98–99, whoever
//!   held the time-sliced GPU, about every 1/6 s); this fake's simulated GPU (below) gives exact
//!   shares. So compute-share accuracy measured against this fake shows the control law, not
//!   what a real GPU achieves (docs/real-gpu.md, "Compute shares").
//!
//! Checked on an H200 (2026-11-27, `tests/gpu/hw-controls.sh`): device utilization samples from
//! `nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES)`: one sample about every 200 ms, zeros
//! included, each stamped with a CPU timestamp in µs; 99 while a tenant ran alone, 0 within one
//! window while its channels were disabled. This fake gives one sample per call instead
//! ("Device utilization" below).
//!
//! **Not checked on hardware yet**: MIG devices and their handles (the H100 cloud VM was not in MIG
//! mode), graphics and compute-and-graphics processes, Xid events through
//! `nvmlEventSetWait_v2`, every failure code (`fail`, `init_error`: GPU lost, driver not loaded,
//! transient errors), `NOT_SUPPORTED` per-process utilization, the exact sample semantics
//! (only samples newer than `lastSeenTimeStamp`, `NOT_FOUND` when none), and for device samples:
//! the count a size query answers, `NOT_SUPPORTED` on MIG devices and GPUs in MIG mode (from
//! NVML's documentation), and the other sampling types (not modelled: `NOT_SUPPORTED`).
//!
//! # Scenario
//!
//! A JSON file: `$FAKE_NVML_SCENARIO` if that is set, else `fake-nvml.json` in the directory of
//! this library's file (found with `dladdr`, so each test uses its own copy of the library and
//! needs no environment). It is re-read whenever its modification time changes, so a test can
//! change GPUs, processes, errors and events while the daemon runs (write a new file and rename it
//! over the old one, so no half-written file is ever read; a file that does not parse is reported
//! on stderr and the previous scenario stays). A missing file is an empty scenario (no GPU).
//!
//! ```json
//! { "driver_version": "580.159.04", "cuda_version": 13000,
//!   "gpus": [ { "uuid": "GPU-…", "name": "…", "pci_bus_id": "00000000:00:06.0",
//!               "memory_total": 85899345920, "compute_mode": 0,
//!               "mig": [ { "uuid": "MIG-…", "name": "…", "memory_total": 10737418240 } ] } ],
//!   "processes": [ { "pid": 123, "gpu": 0, "mig": 1, "memory": 1073741824, "kind": "compute",
//!                    "sm_util": 40, "enc_util": 0, "dec_util": 0 } ],
//!   "events": [ { "id": 1, "gpu": 0, "xid": 79 } ],
//!   "fail": { "nvmlDeviceGetComputeRunningProcesses_v3": 15,
//!             "nvmlDeviceGetCount_v2": { "code": 15, "after": 10, "times": 2 } },
//!   "init_error": 9 }
//! ```
//!
//! - `gpus`: a GPU with a `mig` list is in MIG mode and has those MIG devices (its MIG device
//!   handles are indices into that list). `process_utilization: false` makes
//!   `nvmlDeviceGetProcessUtilization` answer `NOT_SUPPORTED` (as it does on MIG devices and on
//!   GPUs in MIG mode, where real NVML does not sample per process); `xid_events: false` makes the
//!   GPU support no event type.
//! - Topology, for callers that place work on several GPUs: `numa_node` (default 0),
//!   `pci_switch` (GPUs naming the same switch have the common ancestor `SINGLE`, else `NODE` on
//!   one NUMA node, `SYSTEM` across nodes: `nvmlDeviceGetTopologyCommonAncestor`) and `nvlinks`
//!   (the peer GPU index of each active link, e.g. `[1, 1]` for two links to GPU 1:
//!   `nvmlDeviceGetNvLinkState`, `nvmlDeviceGetNvLinkRemotePciInfo_v2`; absent: no NVLink).
//! - `processes`: `kind` is `compute` (the default), `graphics` or `both` (listed by both
//!   `nvmlDeviceGet{Compute,Graphics}RunningProcesses_v3`, as a process with both contexts is);
//!   `mig` puts it on that MIG device (its `gpuInstanceId` is the MIG index). A GPU's and a MIG
//!   device's used memory is the sum of its processes' `memory`.
//! - `events` (or `xid`): critical Xid errors, each delivered once (by `id`, default its position
//!   in the list, so appending to the list delivers only the new ones) by `nvmlEventSetWait_v2` to
//!   an event set that registered `nvmlEventTypeXidCriticalError` on that GPU.
//! - `fail`: the named function (e.g. `nvmlDeviceGetSamples`) returns that NVML code: always (a number), or
//!   `{ "code", "after", "times" }`: the first `after` calls succeed, then `times` calls fail (all
//!   further calls if `times` is absent). Calls are counted per function from the moment the
//!   scenario's text last changed. `nvmlInit_v2` can fail the same way; `init_error` is a shorthand
//!   for an always-failing `nvmlInit_v2`.
//!
//! Initializations are counted like NVML's: the library stays initialized until as many
//! `nvmlShutdown`s as `nvmlInit_v2`s came. It is linked `-z nodelete`, so call counts, delivered
//! events and utilization history survive the caller's `dlclose` and re-`dlopen`, as the state of a
//! driver would.
//!
//! # Simulated GPU
//!
//! A process without `sm_util` is a simulated GPU user: its SM utilization is its share of one CPU
//! over the window the caller asks about, from the caller's `lastSeenTimeStamp` to now:
//!
//! `sm_util = round(100 × Δruntime / Δwall)`, capped at 100,
//!
//! where runtime is the time the process's live threads were runnable: on a CPU or waiting in a
//! run queue for one (the first two fields of `/proc/<pid>/task/*/schedstat`, nanoseconds: exact,
//! unlike the 10 ms ticks of `/proc/<pid>/stat`). Time spent waiting for a CPU counts: each
//! simulated process has the stand-in GPU to itself, and a busy host (a build beside the tests)
//! does not slow a GPU down; only what stops the process (frozen, stopped, asleep) does. Every data call records each simulated process's runtime under the
//! timestamp it returns, so the next call, which passes that timestamp back as
//! `lastSeenTimeStamp`, is measured from exactly there. A `lastSeenTimeStamp` from before the
//! process started (0 on a first call) measures from its start (runtime 0 then; start time from
//! `/proc/<pid>/stat`, 10 ms resolution). A process first seen after `lastSeenTimeStamp` had
//! started yields no sample in that call, only a baseline for the next.
//!
//! So a frozen process (`cgroup.freeze`) consumes no CPU and its measured GPU utilization falls to
//! 0 over the next window; thawed, it rises again: a real closed loop for compute-share
//! controllers. Limits: a thread that exits during a window takes its runtime out of the sum, so
//! that window under-counts; several busy processes on one GPU each report their own CPU share
//! (the sum may exceed 100, unlike a time-sliced GPU).
//!
//! Like real NVML, a data call returns only samples with a non-zero utilization, each stamped with
//! the call's timestamp (strictly increasing across calls), and `NOT_FOUND` when there is none.
//!
//! # Device utilization
//!
//! `nvmlDeviceGetSamples` answers `NVML_GPU_UTILIZATION_SAMPLES` of a whole GPU (other sampling
//! types, MIG devices and GPUs in MIG mode: `NOT_SUPPORTED`; `process_utilization: false` does
//! not matter), values `NVML_VALUE_TYPE_UNSIGNED_INT` in percent. A size query (null buffer)
//! answers a count of 1 with `NVML_SUCCESS`. Each data call returns ONE sample, zeros included,
//! stamped with the call's timestamp (the same strictly increasing clock as the per-process
//! samples): the GPU's utilization over the window since its previous device sample,
//!
//! `util = min(100, Σ over the GPU's processes of their utilization over the window)`,
//!
//! a scripted process counting its `sm_util`, a simulated one its runtime growth over the window
//! (measured as above, `round(100 × Δruntime / Δwall)`, capped at 100 each). The window begins at
//! the GPU's previous device sample; on its first, at the caller's `lastSeenTimeStamp` but not
//! before the earliest start of its simulated processes (a first call passes 0: each process is
//! then measured from its start). A process that started in the window counts all its runtime; one
//! already running that the previous device sample did not see (or a reused pid) counts nothing
//! in that sample, only a baseline for the next. `NOT_FOUND` (count 0) when `lastSeenTimeStamp` is
//! at or past the newest timestamp handed out and the wall clock has not passed it.
//!
//! The device samples keep their own baselines per GPU (the last device sample's timestamp and
//! each simulated process's runtime then): they never move the per-process history, so each
//! `nvmlDeviceGetProcessUtilization` call is still measured from its own `lastSeenTimeStamp`.
//! On a real GPU, samples come about every 200 ms whether asked or not; a caller polling this fake
//! at that period sees a similar stream.
//!
//! # Sample log
//!
//! Every data call of `nvmlDeviceGetProcessUtilization` appends
//! `{"gpu":…,"last_seen":…,"returned":[timestamps]}` to `fake-nvml-samples.log` beside the
//! scenario, so tests can check that the caller never asks again for samples it already had.
//! Every data call of `nvmlDeviceGetSamples` appends the same record to
//! `fake-nvml-device-samples.log` (`returned` empty for `NOT_FOUND`).
//!
//! # Code
//!
//! Here: the state behind every call (the scenario, re-read when it changes; call counts for
//! injected failures), device handles, initialization and the system queries; `device` has the
//! device queries, `samples` the device utilization samples, `events` the event handling (Xid
//! events), `sim` the simulated GPU, `scenario` the scenario's types.
#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod scenario;

use std::{
    collections::{HashMap, HashSet},
    ffi::{CStr, c_char, c_uint},
    path::PathBuf,
    sync::{Mutex, MutexGuard},
    time::SystemTime,
};

use scenario::{Gpu, Mig, Process, Scenario};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventTypeXidCriticalError, nvmlReturn_t,
    nvmlSamplingType_enum_NVML_GPU_UTILIZATION_SAMPLES, nvmlSamplingType_t,
    nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT, nvmlValueType_t,
};

pub use device::{
    nvmlDeviceGetComputeMode, nvmlDeviceGetComputeRunningProcesses_v3, nvmlDeviceGetCount_v2,
    nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetIndex,
    nvmlDeviceGetMaxMigDeviceCount, nvmlDeviceGetMemoryInfo_v2,
    nvmlDeviceGetMigDeviceHandleByIndex, nvmlDeviceGetMigMode, nvmlDeviceGetName,
    nvmlDeviceGetNumaNodeId, nvmlDeviceGetNvLinkRemotePciInfo_v2, nvmlDeviceGetNvLinkState,
    nvmlDeviceGetPciInfo_v3, nvmlDeviceGetProcessUtilization, nvmlDeviceGetSupportedEventTypes,
    nvmlDeviceGetTopologyCommonAncestor, nvmlDeviceGetUUID,
};
pub use events::{
    nvmlDeviceRegisterEvents, nvmlEventSetCreate, nvmlEventSetFree, nvmlEventSetWait_v2,
};
pub use samples::nvmlDeviceGetSamples;
use sim::{DeviceHistory, History};

mod device;
mod events;
mod samples;
mod sim;

const SUCCESS: nvmlReturn_t = 0;
const UNINITIALIZED: nvmlReturn_t = 1;
const INVALID_ARGUMENT: nvmlReturn_t = 2;
const NOT_SUPPORTED: nvmlReturn_t = 3;
const NOT_FOUND: nvmlReturn_t = 6;
const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const TIMEOUT: nvmlReturn_t = 10;
/// `gpuInstanceId` / `computeInstanceId` of a process not on a MIG device.
const NO_INSTANCE: u32 = u32::MAX;
const XID: u64 = nvmlEventTypeXidCriticalError as u64;
/// `nvmlDeviceGetSamples`: the one sampling type modelled, and the type of its values.
const GPU_UTILIZATION_SAMPLES: nvmlSamplingType_t =
    nvmlSamplingType_enum_NVML_GPU_UTILIZATION_SAMPLES;
const UNSIGNED_INT: nvmlValueType_t = nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT;
/// `nvmlGpuTopologyLevel_t` values.
const TOPOLOGY_INTERNAL: u32 = 0;
const TOPOLOGY_SINGLE: u32 = 10;
const TOPOLOGY_NODE: u32 = 40;
const TOPOLOGY_SYSTEM: u32 = 50;

#[derive(Default)]
struct State {
    /// `nvmlInit` calls not yet matched by `nvmlShutdown` (NVML counts them too).
    initialized: u32,
    scenario: Scenario,
    /// The scenario file's modification time and text when last read.
    mtime: Option<SystemTime>,
    text: String,
    /// Calls per function since the scenario's text last changed.
    calls: HashMap<String, u64>,
    history: HashMap<u32, History>,
    /// Device-level utilization samples, per GPU index: kept apart from `history`, so neither
    /// kind of sample moves the other's baselines.
    device: HashMap<u32, DeviceHistory>,
    /// The newest timestamp handed out (they strictly increase).
    last_ts: u64,
    /// Ids of the events already delivered.
    delivered: HashSet<u64>,
    /// Event sets: id → registered (GPU, event mask).
    sets: HashMap<usize, Vec<(u32, u64)>>,
    next_set: usize,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The directory holding this library's file.
fn own_dir() -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data, filled in by dladdr.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: any address inside this library identifies it.
    let ok = unsafe { libc::dladdr(own_dir as *const libc::c_void, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returns a NUL-terminated path.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_str().ok()?;
    PathBuf::from(path).parent().map(PathBuf::from)
}

fn scenario_path() -> Option<PathBuf> {
    match std::env::var_os("FAKE_NVML_SCENARIO") {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => Some(own_dir()?.join("fake-nvml.json")),
    }
}

/// Re-reads the scenario if its file changed. A missing file reads as an empty scenario; one that
/// does not parse leaves the previous one in place.
fn refresh(st: &mut State) {
    let Some(path) = scenario_path() else { return };
    let mtime = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
    if mtime == st.mtime {
        return;
    }
    st.mtime = mtime;
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    if text == st.text {
        return;
    }
    let parsed = if text.trim().is_empty() {
        Ok(Scenario::default())
    } else {
        serde_json::from_str(&text)
    };
    match parsed {
        Ok(s) => {
            st.scenario = s;
            st.text = text;
            st.calls.clear();
        }
        Err(e) => eprintln!("fake NVML: ignoring {}: {e}", path.display()),
    }
}

/// Counts a call of `name`; the code it must fail with, if the scenario says so.
fn injected(st: &mut State, name: &str) -> Option<nvmlReturn_t> {
    let n = st.calls.entry(name.to_owned()).or_insert(0);
    *n += 1;
    let mut code = st.scenario.fail.get(name)?.code_for_call(*n)?;
    if code == SUCCESS {
        // A "failure" with code 0 would leave outputs unset; make it a visible error.
        code = INVALID_ARGUMENT;
    }
    Some(code)
}

/// Runs `f` on the refreshed state, unless NVML is not initialized or `name` is set to fail.
fn with(name: &str, f: impl FnOnce(&mut State) -> nvmlReturn_t) -> nvmlReturn_t {
    let mut guard = lock();
    let Some(st) = guard.as_mut() else {
        return UNINITIALIZED;
    };
    if st.initialized == 0 {
        return UNINITIALIZED;
    }
    refresh(st);
    if let Some(code) = injected(st, name) {
        return code;
    }
    f(st)
}

/// Device handles encode (GPU index + 1) << 8 | (MIG index + 1); NVML treats them as opaque.
fn handle(gpu: u32, mig: Option<u32>) -> nvmlDevice_t {
    (((gpu as usize + 1) << 8) | mig.map_or(0, |m| m as usize + 1)) as nvmlDevice_t
}

fn decode(d: nvmlDevice_t) -> Option<(u32, Option<u32>)> {
    let v = d as usize;
    let gpu = (v >> 8).checked_sub(1)? as u32;
    let mig = (v & 0xff).checked_sub(1).map(|m| m as u32);
    Some((gpu, mig))
}

/// The GPU (and MIG device) a handle names, if they exist in the current scenario.
fn gpu_of(st: &State, d: nvmlDevice_t) -> Option<(&Gpu, Option<&Mig>)> {
    let (g, m) = decode(d)?;
    let gpu = st.scenario.gpus.get(g as usize)?;
    match m {
        None => Some((gpu, None)),
        Some(m) => Some((gpu, Some(gpu.mig.as_ref()?.get(m as usize)?))),
    }
}

/// Processes on the device a handle names: all of a GPU's, or those of one MIG device.
fn processes_on(st: &State, gpu: u32, mig: Option<u32>) -> Vec<Process> {
    st.scenario
        .processes
        .iter()
        .filter(|p| p.gpu == gpu && (mig.is_none() || p.mig == mig))
        .cloned()
        .collect()
}

unsafe fn write_str(dst: *mut c_char, len: c_uint, s: &str) -> nvmlReturn_t {
    if dst.is_null() {
        return INVALID_ARGUMENT;
    }
    let b = s.as_bytes();
    if b.len() + 1 > len as usize {
        return INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller's buffer holds `len` bytes, checked above.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr().cast::<c_char>(), dst, b.len());
        *dst.add(b.len()) = 0;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let mut guard = lock();
    let st = guard.get_or_insert_with(State::default);
    refresh(st);
    if let Some(code) = injected(st, "nvmlInit_v2").or(st.scenario.init_error) {
        return code;
    }
    st.initialized += 1;
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    match lock().as_mut() {
        Some(st) if st.initialized > 0 => {
            st.initialized -= 1;
            if st.initialized == 0 {
                st.sets.clear();
            }
            SUCCESS
        }
        _ => UNINITIALIZED,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(_result: nvmlReturn_t) -> *const c_char {
    c"fake NVML error".as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(v: *mut c_char, len: c_uint) -> nvmlReturn_t {
    with("nvmlSystemGetDriverVersion", |st| unsafe {
        write_str(v, len, &st.scenario.driver_version)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut i32) -> nvmlReturn_t {
    with("nvmlSystemGetCudaDriverVersion_v2", |st| {
        if v.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null out pointer.
        unsafe { *v = st.scenario.cuda_version };
        SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use std::{
        collections::VecDeque,
        time::{Duration, Instant},
    };

    use nvml_wrapper_sys::bindings::{nvmlProcessUtilizationSample_t, nvmlSample_t};

    use super::*;
    use crate::scenario::Fail;
    use crate::sim::*;

    /// Held by the tests that measure this process's CPU time, so one's busy loop does not show
    /// in another's idle window.
    static CPU: Mutex<()> = Mutex::new(());

    fn cpu() -> MutexGuard<'static, ()> {
        CPU.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn counted_failures_start_after_and_stop_after_times() {
        let f = Fail::Counted {
            code: 15,
            after: 2,
            times: Some(2),
        };
        let codes: Vec<Option<u32>> = (1..=6).map(|n| f.code_for_call(n)).collect();
        assert_eq!(codes, [None, None, Some(15), Some(15), None, None]);
        let forever = Fail::Counted {
            code: 9,
            after: 1,
            times: None,
        };
        assert_eq!(forever.code_for_call(1), None);
        assert_eq!(forever.code_for_call(1000), Some(9));
        assert_eq!(Fail::Always(3).code_for_call(1), Some(3));
        let parsed: HashMap<String, Fail> =
            serde_json::from_str(r#"{"a": 15, "b": {"code": 9, "after": 3}}"#).unwrap_or_default();
        assert_eq!(parsed.get("a"), Some(&Fail::Always(15)));
        assert_eq!(
            parsed.get("b"),
            Some(&Fail::Counted {
                code: 9,
                after: 3,
                times: None
            })
        );
    }

    #[test]
    fn window_starts_at_the_last_seen_observation_or_the_process_start() {
        let mut h = History {
            start_ticks: 1,
            start_us: 1_000_000,
            seen: VecDeque::new(),
        };
        // Before any observation: from the start if the window begins before it.
        assert_eq!(h.baseline(0), Some((1_000_000, 0)));
        assert_eq!(h.baseline(1_500_000), None);
        h.record(2_000_000, 400_000_000);
        h.record(3_000_000, 900_000_000);
        // Exactly the observation the caller was handed, or the newest before it.
        assert_eq!(h.baseline(3_000_000), Some((3_000_000, 900_000_000)));
        assert_eq!(h.baseline(2_999_999), Some((2_000_000, 400_000_000)));
        assert_eq!(h.baseline(0), Some((1_000_000, 0)));
        // 500 ms of CPU in 1 s of wall time: 50 %; a busy process is capped at 100.
        assert_eq!(
            share_of_cpu(900_000_000, (2_000_000, 400_000_000), 3_000_000),
            Some(50)
        );
        assert_eq!(
            share_of_cpu(3_000_000_000, (2_000_000, 0), 3_000_000),
            Some(100)
        );
        // A frozen process: no runtime growth, 0 %.
        assert_eq!(
            share_of_cpu(900_000_000, (3_000_000, 900_000_000), 4_000_000),
            Some(0)
        );
        assert_eq!(share_of_cpu(1, (3_000_000, 0), 3_000_000), None);
        for i in 0..(HISTORY as u64 + 10) {
            h.record(4_000_000 + i, i);
        }
        assert_eq!(h.seen.len(), HISTORY);
    }

    /// The whole simulated path on this very process: idle and busy windows chained by the
    /// timestamps handed out, as a caller passing back `lastSeenTimeStamp` sees them.
    #[test]
    fn simulated_utilization_follows_this_process_cpu_window_by_window() {
        let _cpu = cpu();
        let pid = std::process::id();
        let ticks = start_ticks(pid).expect("start ticks");
        let now = 10_000_000_000_000;
        let began = start_us(ticks, now);
        assert!(began < now && now - began < 3_600_000_000, "{began}");

        let mut st = State::default();
        let t0 = next_timestamp(&mut st);
        // A first call (lastSeenTimeStamp 0) measures from the process's start.
        assert!(simulated(&mut st, pid, 0, t0).is_some());
        std::thread::sleep(Duration::from_millis(300));
        let t1 = next_timestamp(&mut st);
        let idle = simulated(&mut st, pid, t0, t1);
        assert!(idle.is_some_and(|u| u <= 10), "idle window: {idle:?}");
        let busy_from = Instant::now();
        while busy_from.elapsed() < Duration::from_millis(300) {
            std::hint::black_box(0u64);
        }
        let t2 = next_timestamp(&mut st);
        let busy = simulated(&mut st, pid, t1, t2);
        assert!(busy.is_some_and(|u| u >= 50), "busy window: {busy:?}");
        // Asked again from t1 (a caller that did not take the busy sample): the same window
        // plus the moment since, so about the same figure; never the idle one.
        let t3 = next_timestamp(&mut st);
        let again = simulated(&mut st, pid, t1, t3);
        assert!(again.is_some_and(|u| u >= 50), "re-asked window: {again:?}");
        // A process first seen after the window began gives no figure, only a baseline.
        let mut fresh = State::default();
        assert_eq!(simulated(&mut fresh, pid, t2, t3), None);
        let t4 = next_timestamp(&mut fresh);
        assert!(simulated(&mut fresh, pid, t3, t4).is_some());
        assert_eq!(simulated(&mut st, u32::MAX, 0, t3), None, "no such process");
    }

    #[test]
    fn device_window_chains_from_the_previous_device_sample_and_sums_processes() {
        // A GPU's first device sample: from lastSeenTimeStamp, not before its first simulated
        // process started (a first call passes 0).
        assert_eq!(device_window_start(None, 0, Some(5_000_000)), 5_000_000);
        assert_eq!(
            device_window_start(None, 7_000_000, Some(5_000_000)),
            7_000_000
        );
        assert_eq!(device_window_start(None, 0, None), 0);
        // Later ones: from the GPU's previous device sample, whatever the caller passes.
        assert_eq!(
            device_window_start(Some(8_000_000), 0, Some(5_000_000)),
            8_000_000
        );
        assert_eq!(
            device_window_start(Some(8_000_000), 9_000_000, None),
            8_000_000
        );

        let seen = |start_ticks, start_us, runtime_ns| Observed {
            start_ticks,
            start_us,
            runtime_ns,
        };
        let prev = DeviceHistory {
            ts: 2_000_000,
            procs: [
                (10, seen(1, 1_000_000, 500_000_000)),
                (11, seen(2, 1_500_000, 100_000_000)),
            ]
            .into(),
        };
        // Over (2 s, 3 s]: pid 10 ran 300 ms (30 %), pid 11 200 ms (20 %), pid 12 started at
        // 2.5 s and ran 100 ms (10 % of the window): 60 %.
        let now = [
            (10, seen(1, 1_000_000, 800_000_000)),
            (11, seen(2, 1_500_000, 300_000_000)),
            (12, seen(3, 2_500_000, 100_000_000)),
        ];
        let util = |procs: &[(u32, Observed)], scripted: &[u32]| {
            device_utilization(2_000_000, 3_000_000, Some(&prev), procs, scripted)
        };
        assert_eq!(util(&now, &[]), 60);
        // Scripted processes add their fixed figure; the sum is capped at 100.
        assert_eq!(util(&now, &[30]), 90);
        assert_eq!(util(&now, &[30, 40]), 100);
        // Nothing ran (frozen): a sample of 0, not no sample.
        assert_eq!(
            util(
                &prev.procs.iter().map(|(p, o)| (*p, *o)).collect::<Vec<_>>(),
                &[]
            ),
            0
        );
        assert_eq!(util(&[], &[]), 0);
        // A reused pid, or a process the previous sample did not see, already running when the
        // window began: only a baseline for the next window. Started in the window: all of it.
        assert_eq!(util(&[(10, seen(9, 1_900_000, 900_000_000))], &[]), 0);
        assert_eq!(util(&[(13, seen(4, 500_000, 900_000_000))], &[]), 0);
        assert_eq!(util(&[(10, seen(9, 2_100_000, 400_000_000))], &[]), 40);
        // A first device sample measures a process from its start.
        let first = [(10, seen(1, 1_000_000, 1_000_000_000))];
        assert_eq!(
            device_utilization(1_000_000, 3_000_000, None, &first, &[]),
            50
        );
    }

    /// `nvmlDeviceGetSamples` through its C ABI, as nvml-wrapper calls it, with this very process
    /// as a simulated GPU user. The only test here that touches the library's global state.
    #[test]
    fn device_samples_through_the_c_abi() {
        let _cpu = cpu();
        let dir = std::env::temp_dir().join(format!("fake-nvml-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("fake-nvml.json");
        let write = |v: serde_json::Value, secs: u64| {
            std::fs::write(&path, v.to_string()).expect("scenario");
            let f = std::fs::File::options()
                .write(true)
                .open(&path)
                .expect("open");
            // Distinct modification times, so each version is read however coarse the clock.
            f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
                .expect("mtime");
        };
        let gpu = |i: u32| {
            serde_json::json!({"uuid": format!("GPU-{i}"), "name": "Fake", "memory_total": 1,
                               "pci_bus_id": format!("00000000:00:0{i}.0")})
        };
        let mut mig = gpu(1);
        mig["mig"] = serde_json::json!([{"uuid": "MIG-0", "name": "Fake 1g", "memory_total": 1}]);
        let mut no_proc_util = gpu(2);
        no_proc_util["process_utilization"] = false.into();
        let mut scenario = serde_json::json!({
            "gpus": [gpu(0), mig, no_proc_util],
            "processes": [{"pid": std::process::id(), "gpu": 0},
                          {"pid": 4_000_000, "gpu": 0, "sm_util": 20}]
        });
        write(scenario.clone(), 1_000);
        // SAFETY: no other test reads the environment or this library's state.
        unsafe { std::env::set_var("FAKE_NVML_SCENARIO", &path) };
        assert_eq!(nvmlInit_v2(), SUCCESS);

        let (gpu0, gpu2) = (handle(0, None), handle(2, None));
        // SAFETY: nvmlSample_t is plain data.
        let zero: nvmlSample_t = unsafe { std::mem::zeroed() };
        // Calls as nvml-wrapper does: (code, value type, count, samples returned).
        let call = |d: nvmlDevice_t, kind: u32, last_seen: u64, room: Option<u32>| {
            let mut buf = vec![zero; room.unwrap_or(0) as usize];
            let (mut vt, mut n) = (0, room.unwrap_or(0));
            let ptr = if room.is_some() {
                buf.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: valid out pointers; `buf` holds `n` entries.
            let rc = unsafe { nvmlDeviceGetSamples(d, kind, last_seen, &mut vt, &mut n, ptr) };
            let got: Vec<(u64, u32)> = buf
                .iter()
                .take(if rc == SUCCESS { n as usize } else { 0 })
                // SAFETY: the fake writes `uiVal` (value type checked by the caller).
                .map(|s| (s.timeStamp, unsafe { s.sampleValue.uiVal }))
                .collect();
            (rc, vt, n, got)
        };
        let per_process = |last_seen: u64| {
            let mut buf = [nvmlProcessUtilizationSample_t {
                pid: 0,
                timeStamp: 0,
                smUtil: 0,
                memUtil: 0,
                encUtil: 0,
                decUtil: 0,
            }; 4];
            let mut n = 4;
            // SAFETY: valid pointers; `buf` holds `n` entries.
            let rc = unsafe {
                nvmlDeviceGetProcessUtilization(gpu0, buf.as_mut_ptr(), &mut n, last_seen)
            };
            assert!(rc == SUCCESS || rc == NOT_FOUND, "{rc}");
        };
        per_process(0);

        // The count query: one sample, NVML_SUCCESS.
        assert_eq!(call(gpu0, 1, 0, None), (SUCCESS, UNSIGNED_INT, 1, vec![]));
        // First data call: the scripted 20 % plus this process's share since it started.
        let (rc, vt, n, got) = call(gpu0, 1, 0, Some(1));
        assert_eq!((rc, vt, n), (SUCCESS, UNSIGNED_INT, 1));
        let (t1, first) = got[0];
        assert!((20..=100).contains(&first), "{first}");
        // A busy window: this process's CPU plus the scripted 20 %.
        let busy_from = Instant::now();
        while busy_from.elapsed() < Duration::from_millis(300) {
            std::hint::black_box(0u64);
        }
        let (rc, _, _, got) = call(gpu0, 1, t1, Some(4));
        assert_eq!((rc, got.len()), (SUCCESS, 1));
        let (t2, busy) = got[0];
        assert!(t2 > t1 && busy >= 70, "{t1} {t2} {busy}");
        // Nothing newer than what the caller has seen: NOT_FOUND.
        let future = wall_us() + 10_000_000;
        assert_eq!(call(gpu0, 1, future, Some(1)).0, NOT_FOUND);
        // A GPU with nothing on it answers zeros, per-process sampling or not.
        let (rc, _, _, got) = call(gpu2, 1, 0, Some(1));
        assert_eq!((rc, got.len(), got[0].1), (SUCCESS, 1, 0));
        let (rc, _, _, again) = call(gpu2, 1, got[0].0, Some(1));
        assert_eq!((rc, again[0].1), (SUCCESS, 0));
        assert!(again[0].0 > got[0].0);
        // Too small a buffer; other sampling types; MIG; unknown handles.
        assert_eq!(call(gpu0, 1, 0, Some(0)).0, INSUFFICIENT_SIZE);
        assert_eq!(call(gpu0, 1, 0, Some(0)).2, 1);
        assert_eq!(call(gpu0, 2, 0, Some(1)).0, NOT_SUPPORTED);
        assert_eq!(call(gpu0, 5, 0, None).0, NOT_SUPPORTED);
        assert_eq!(call(handle(1, None), 1, 0, Some(1)).0, NOT_SUPPORTED);
        assert_eq!(call(handle(1, Some(0)), 1, 0, Some(1)).0, NOT_SUPPORTED);
        assert_eq!(call(handle(7, None), 1, 0, Some(1)).0, INVALID_ARGUMENT);

        // The per-process history has only the per-process calls' timestamps.
        per_process(0);
        {
            let guard = lock();
            let st = guard.as_ref().expect("state");
            let h = st.history.get(&std::process::id()).expect("history");
            assert_eq!(h.seen.len(), 2);
            assert!(h.seen.iter().all(|(ts, _)| *ts != t1 && *ts != t2));
            assert!(h.seen[0].0 < t1 && h.seen[1].0 > t2);
        }
        // The log beside the scenario has every device data call.
        let log = std::fs::read_to_string(dir.join("fake-nvml-device-samples.log")).expect("log");
        assert_eq!(log.lines().count(), 5, "{log}");

        // Injected failures, like every other call.
        scenario["fail"] = serde_json::json!({"nvmlDeviceGetSamples": 15});
        write(scenario, 2_000);
        assert_eq!(call(gpu0, 1, 0, None).0, 15);
        assert_eq!(call(gpu0, 1, 0, Some(1)).0, 15);

        assert_eq!(nvmlShutdown(), SUCCESS);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
