//! A stand-in for `libnvidia-ml.so` (test fixture; never in gpud's code path): the NVML calls
//! gpud makes, with NVML's real C ABI (layouts from `nvml-wrapper-sys`), answered from a scenario
//! file, so gpud's real `nvml-wrapper` code path runs against it.
//!
//! **Scenario.** `fake-nvml.json` in the directory of this library's file (found with `dladdr`,
//! so each test uses its own copy), re-read whenever it changes:
//!
//! ```json
//! { "driver_version": "580.159.04", "cuda_version": 13000,
//!   "init_error": 9,
//!   "gpus": [ { "uuid": "GPU-…", "name": "…", "pci_bus_id": "00000000:00:06.0",
//!               "memory_total": 85899345920, "compute_mode": 0,
//!               "mig": [ { "uuid": "MIG-…", "name": "…", "memory_total": 10737418240 } ] } ],
//!   "processes": [ { "pid": 123, "gpu": 0, "memory": 1073741824, "kind": "compute",
//!                    "sm_util": 40, "enc_util": 0, "dec_util": 0 } ],
//!   "fail": { "nvmlDeviceGetComputeRunningProcesses_v3": 15 } }
//! ```
//!
//! `init_error` makes `nvmlInit_v2` fail with that NVML code; `fail` makes the named function
//! fail with its code; a GPU with a `mig` list is in MIG mode and has those MIG devices.
//!
//! **Simulated GPU.** A process without `sm_util` is a simulated GPU user: its SM utilization is
//! its share of one CPU over the sample window — the growth of the `sum_exec_runtime` of all its
//! threads (`/proc/<pid>/task/*/schedstat`, nanoseconds) since the previous sample, over the
//! wall time since then. A frozen process consumes no CPU, so freezing it lowers its measured GPU
//! utilization: a real closed loop for compute-share controllers.
//!
//! **Sample log.** Every `nvmlDeviceGetProcessUtilization` that returns samples appends
//! `{"gpu":…,"last_seen":…,"returned":[timestamps]}` to `fake-nvml-samples.log` beside the
//! scenario, so tests can check that the caller never asks for samples it already had.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::{
    collections::HashMap,
    ffi::{CStr, c_char, c_uint, c_ulonglong},
    io::Write as _,
    path::PathBuf,
    sync::{Mutex, MutexGuard},
    time::SystemTime,
};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlMemory_v2_t, nvmlPciInfo_t,
    nvmlProcessInfo_t, nvmlProcessUtilizationSample_t, nvmlReturn_t,
};
use serde::Deserialize;

const SUCCESS: nvmlReturn_t = 0;
const UNINITIALIZED: nvmlReturn_t = 1;
const INVALID_ARGUMENT: nvmlReturn_t = 2;
const NOT_SUPPORTED: nvmlReturn_t = 3;
const NOT_FOUND: nvmlReturn_t = 6;
const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const TIMEOUT: nvmlReturn_t = 10;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Mig {
    uuid: String,
    name: String,
    memory_total: u64,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Gpu {
    uuid: String,
    name: String,
    pci_bus_id: String,
    memory_total: u64,
    #[serde(default)]
    compute_mode: u32,
    #[serde(default)]
    mig: Option<Vec<Mig>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Process {
    pid: u32,
    gpu: u32,
    #[serde(default)]
    memory: u64,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    sm_util: Option<u32>,
    #[serde(default)]
    enc_util: u32,
    #[serde(default)]
    dec_util: u32,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    #[serde(default)]
    driver_version: String,
    #[serde(default)]
    cuda_version: i32,
    #[serde(default)]
    init_error: Option<u32>,
    #[serde(default)]
    gpus: Vec<Gpu>,
    #[serde(default)]
    processes: Vec<Process>,
    #[serde(default)]
    fail: HashMap<String, u32>,
    /// Critical Xid errors to deliver once each to event sets: `{"gpu": 0, "xid": 79}`.
    #[serde(default)]
    xid: Vec<Xid>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Xid {
    gpu: u32,
    xid: u64,
}

#[derive(Default)]
struct State {
    /// `nvmlInit` calls not yet matched by `nvmlShutdown` (NVML counts them too).
    initialized: u32,
    scenario: Scenario,
    mtime: Option<SystemTime>,
    /// Per pid: (summed runtime ns, wall time µs) at the previous sample.
    cpu: HashMap<u32, (u64, u64)>,
    /// Xid entries of the scenario already delivered.
    xid_delivered: usize,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The directory holding this library's file.
fn own_dir() -> Option<PathBuf> {
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
    Some(own_dir()?.join("fake-nvml.json"))
}

/// Re-reads the scenario if its file changed; a missing or broken file reads as empty.
fn refresh(st: &mut State) {
    let Some(path) = scenario_path() else { return };
    let mtime = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
    if mtime == st.mtime {
        return;
    }
    st.mtime = mtime;
    st.scenario = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
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
    if let Some(code) = st.scenario.fail.get(name) {
        return *code;
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

fn gpu_of(st: &State, d: nvmlDevice_t) -> Option<(&Gpu, Option<&Mig>)> {
    let (g, m) = decode(d)?;
    let gpu = st.scenario.gpus.get(g as usize)?;
    match m {
        None => Some((gpu, None)),
        Some(m) => Some((gpu, Some(gpu.mig.as_ref()?.get(m as usize)?))),
    }
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
    st.mtime = None;
    refresh(st);
    if let Some(code) = st.scenario.init_error {
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    with("nvmlDeviceGetCount_v2", |st| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null out pointer.
        unsafe { *count = st.scenario.gpus.len() as c_uint };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with("nvmlDeviceGetHandleByIndex_v2", |st| {
        if device.is_null() || index as usize >= st.scenario.gpus.len() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null out pointer.
        unsafe { *device = handle(index, None) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetIndex", |st| {
        match (decode(device), gpu_of(st, device)) {
            (Some((g, None)), Some(_)) if !index.is_null() => {
                // SAFETY: non-null out pointer.
                unsafe { *index = g };
                SUCCESS
            }
            (Some((_, Some(_))), Some(_)) => NOT_SUPPORTED,
            _ => INVALID_ARGUMENT,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetUUID", |st| match gpu_of(st, device) {
        Some((_, Some(m))) => unsafe { write_str(uuid, len, &m.uuid) },
        Some((g, None)) => unsafe { write_str(uuid, len, &g.uuid) },
        None => INVALID_ARGUMENT,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetName", |st| match gpu_of(st, device) {
        Some((_, Some(m))) => unsafe { write_str(name, len, &m.name) },
        Some((g, None)) => unsafe { write_str(name, len, &g.name) },
        None => INVALID_ARGUMENT,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with("nvmlDeviceGetPciInfo_v3", |st| {
        let Some((g, _)) = gpu_of(st, device) else {
            return INVALID_ARGUMENT;
        };
        if pci.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null out pointer to the caller's struct.
        let p = unsafe { &mut *pci };
        // SAFETY: plain data.
        *p = unsafe { std::mem::zeroed() };
        for (i, b) in g.pci_bus_id.bytes().take(31).enumerate() {
            p.busId[i] = b as c_char;
        }
        for (i, b) in g.pci_bus_id.bytes().skip(4).take(15).enumerate() {
            p.busIdLegacy[i] = b as c_char;
        }
        p.pciDeviceId = 0x2330_10de;
        SUCCESS
    })
}

fn used_on(st: &State, gpu: u32) -> u64 {
    st.scenario
        .processes
        .iter()
        .filter(|p| p.gpu == gpu)
        .map(|p| p.memory)
        .sum()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    mem: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with("nvmlDeviceGetMemoryInfo_v2", |st| {
        let (Some((gi, mi)), Some((g, m))) = (decode(device), gpu_of(st, device)) else {
            return INVALID_ARGUMENT;
        };
        if mem.is_null() {
            return INVALID_ARGUMENT;
        }
        let total = m.map_or(g.memory_total, |m| m.memory_total);
        let used = if mi.is_some() { 0 } else { used_on(st, gi) };
        // SAFETY: non-null out pointer.
        let out = unsafe { &mut *mem };
        out.total = total;
        out.reserved = 0;
        out.used = used.min(total);
        out.free = total - out.used;
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetComputeMode", |st| match gpu_of(st, device) {
        Some((g, _)) if !mode.is_null() => {
            // SAFETY: non-null out pointer.
            unsafe { *mode = g.compute_mode };
            SUCCESS
        }
        _ => INVALID_ARGUMENT,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetMigMode", |st| {
        match (decode(device), gpu_of(st, device)) {
            (Some((_, None)), Some((g, _))) if !current.is_null() && !pending.is_null() => {
                let on = c_uint::from(g.mig.is_some());
                // SAFETY: non-null out pointers.
                unsafe {
                    *current = on;
                    *pending = on;
                }
                SUCCESS
            }
            (Some((_, Some(_))), Some(_)) => NOT_SUPPORTED,
            _ => INVALID_ARGUMENT,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetMaxMigDeviceCount", |st| {
        match gpu_of(st, device) {
            Some((g, None)) if !count.is_null() => {
                // SAFETY: non-null out pointer.
                unsafe { *count = g.mig.as_ref().map_or(0, |m| m.len() as c_uint) };
                SUCCESS
            }
            _ => INVALID_ARGUMENT,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with("nvmlDeviceGetMigDeviceHandleByIndex", |st| {
        match (decode(device), gpu_of(st, device)) {
            (Some((gi, None)), Some((g, None))) if !mig.is_null() => {
                if g.mig.as_ref().is_none_or(|m| index as usize >= m.len()) {
                    return NOT_FOUND;
                }
                // SAFETY: non-null out pointer.
                unsafe { *mig = handle(gi, Some(index)) };
                SUCCESS
            }
            _ => INVALID_ARGUMENT,
        }
    })
}

unsafe fn processes(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
    graphics: bool,
    name: &str,
) -> nvmlReturn_t {
    with(name, |st| {
        let Some((gi, None)) = decode(device) else {
            return INVALID_ARGUMENT;
        };
        if count.is_null() || gi as usize >= st.scenario.gpus.len() {
            return INVALID_ARGUMENT;
        }
        let list: Vec<&Process> = st
            .scenario
            .processes
            .iter()
            .filter(|p| p.gpu == gi && (p.kind.as_deref() == Some("graphics")) == graphics)
            .collect();
        // SAFETY: non-null in/out pointer.
        let room = unsafe { *count } as usize;
        unsafe { *count = list.len() as c_uint };
        if infos.is_null() || room < list.len() {
            return if list.is_empty() {
                SUCCESS
            } else {
                INSUFFICIENT_SIZE
            };
        }
        for (i, p) in list.iter().enumerate() {
            // SAFETY: the caller's array holds `room` >= len entries.
            let out = unsafe { &mut *infos.add(i) };
            out.pid = p.pid;
            out.usedGpuMemory = p.memory;
            out.gpuInstanceId = u32::MAX;
            out.computeInstanceId = u32::MAX;
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe {
        processes(
            device,
            count,
            infos,
            false,
            "nvmlDeviceGetComputeRunningProcesses_v3",
        )
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe {
        processes(
            device,
            count,
            infos,
            true,
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
        )
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Sum of `sum_exec_runtime` (ns) over the threads of `pid`; `None` if it is gone.
fn runtime_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat"))
            && let Some(v) = s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        {
            total += v;
        }
    }
    Some(total)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    samples: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    last_seen: c_ulonglong,
) -> nvmlReturn_t {
    with("nvmlDeviceGetProcessUtilization", |st| {
        let Some((gi, None)) = decode(device) else {
            return INVALID_ARGUMENT;
        };
        if count.is_null() || gi as usize >= st.scenario.gpus.len() {
            return INVALID_ARGUMENT;
        }
        let now = now_us();
        let procs: Vec<Process> = st
            .scenario
            .processes
            .iter()
            .filter(|p| p.gpu == gi)
            .cloned()
            .collect();
        // Each process yields one sample stamped `now`, newer than anything returned before.
        let fresh = if now > last_seen { procs.len() } else { 0 };
        if samples.is_null() {
            // SAFETY: non-null out pointer.
            unsafe { *count = fresh as c_uint };
            return if fresh == 0 {
                NOT_FOUND
            } else {
                INSUFFICIENT_SIZE
            };
        }
        // SAFETY: non-null in/out pointer.
        let room = unsafe { *count } as usize;
        if room < fresh {
            unsafe { *count = fresh as c_uint };
            return INSUFFICIENT_SIZE;
        }
        let mut returned = Vec::new();
        let mut n = 0;
        for p in procs.iter().take(fresh) {
            let sm = match p.sm_util {
                Some(u) => u,
                None => {
                    let Some(rt) = runtime_ns(p.pid) else {
                        continue;
                    };
                    let prev = st.cpu.insert(p.pid, (rt, now));
                    match prev {
                        Some((prt, pt)) if now > pt => {
                            let busy_ns = rt.saturating_sub(prt) as f64;
                            let wall_ns = (now - pt) as f64 * 1000.0;
                            ((busy_ns / wall_ns) * 100.0).round().min(100.0) as u32
                        }
                        _ => 0,
                    }
                }
            };
            // SAFETY: the caller's array holds `room` >= fresh entries.
            let out = unsafe { &mut *samples.add(n) };
            out.pid = p.pid;
            out.timeStamp = now;
            out.smUtil = sm;
            out.memUtil = 0;
            out.encUtil = p.enc_util;
            out.decUtil = p.dec_util;
            returned.push(now);
            n += 1;
        }
        // SAFETY: non-null out pointer.
        unsafe { *count = n as c_uint };
        if let Some(dir) = own_dir()
            && let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("fake-nvml-samples.log"))
        {
            let line = serde_json::json!({"gpu": gi, "last_seen": last_seen, "returned": returned});
            let _ = writeln!(f, "{line}");
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    with("nvmlEventSetCreate", |_| {
        if set.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null out pointer; the handle is opaque.
        unsafe { *set = 0x5e7 as nvmlEventSet_t };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    _device: nvmlDevice_t,
    _types: c_ulonglong,
    _set: nvmlEventSet_t,
) -> nvmlReturn_t {
    with("nvmlDeviceRegisterEvents", |_| SUCCESS)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    _set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    let r = with("nvmlEventSetWait_v2", |st| {
        let Some(x) = st.scenario.xid.get(st.xid_delivered).cloned() else {
            return TIMEOUT;
        };
        if data.is_null() {
            return INVALID_ARGUMENT;
        }
        st.xid_delivered += 1;
        // SAFETY: non-null out pointer.
        let out = unsafe { &mut *data };
        out.device = handle(x.gpu, None);
        out.eventType = 8; // nvmlEventTypeXidCriticalError
        out.eventData = x.xid;
        out.gpuInstanceId = u32::MAX;
        out.computeInstanceId = u32::MAX;
        SUCCESS
    });
    if r == TIMEOUT {
        // A quiet GPU: wait out the timeout (bounded, so callers stay responsive).
        std::thread::sleep(std::time::Duration::from_millis(u64::from(
            timeout_ms.min(1000),
        )));
    }
    r
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(_set: nvmlEventSet_t) -> nvmlReturn_t {
    SUCCESS
}
