//! Device utilization samples (module docs, "Device utilization"): `nvmlDeviceGetSamples`, one
//! sample of a whole GPU per data call, from the simulated GPU's device windows
//! ([`crate::sim`]).

use std::ffi::{c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlReturn_t, nvmlSample_t, nvmlSamplingType_t, nvmlValueType_t,
};

use crate::{
    GPU_UTILIZATION_SAMPLES, INSUFFICIENT_SIZE, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED,
    SUCCESS, UNSIGNED_INT, decode, gpu_of, processes_on,
    sim::{
        DeviceHistory, Observed, device_utilization, device_window_start, log_samples,
        next_timestamp, observe, wall_us,
    },
    with,
};

/// Device-level samples: only `NVML_GPU_UTILIZATION_SAMPLES` of a whole GPU, one sample per data
/// call covering the time since the GPU's previous one (module docs, "Device utilization").
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSamples(
    device: nvmlDevice_t,
    kind: nvmlSamplingType_t,
    last_seen: c_ulonglong,
    value_type: *mut nvmlValueType_t,
    count: *mut c_uint,
    samples: *mut nvmlSample_t,
) -> nvmlReturn_t {
    with("nvmlDeviceGetSamples", |st| {
        let (Some((gi, mi)), Some((gpu, _))) = (decode(device), gpu_of(st, device)) else {
            return INVALID_ARGUMENT;
        };
        if count.is_null() || value_type.is_null() {
            return INVALID_ARGUMENT;
        }
        // Whole GPUs outside MIG mode only (NVML has no device utilization for MIG devices).
        if mi.is_some() || gpu.mig.is_some() || kind != GPU_UTILIZATION_SAMPLES {
            return NOT_SUPPORTED;
        }
        // SAFETY: non-null out pointer.
        unsafe { *value_type = UNSIGNED_INT };
        if samples.is_null() {
            // A size query: a data call returns at most one sample.
            // SAFETY: non-null out pointer.
            unsafe { *count = 1 };
            return SUCCESS;
        }
        // SAFETY: non-null in/out pointer.
        if unsafe { *count } < 1 {
            // SAFETY: as above.
            unsafe { *count = 1 };
            return INSUFFICIENT_SIZE;
        }
        if last_seen >= st.last_ts && wall_us() <= last_seen {
            // Nothing newer than what the caller has: no time has passed since.
            // SAFETY: non-null out pointer.
            unsafe { *count = 0 };
            log_samples("fake-nvml-device-samples.log", gi, last_seen, &[]);
            return NOT_FOUND;
        }
        let procs = processes_on(st, gi, None);
        let now = next_timestamp(st);
        let prev = st.device.remove(&gi);
        let scripted: Vec<u32> = procs.iter().filter_map(|p| p.sm_util).collect();
        let simulated: Vec<(u32, Observed)> = procs
            .iter()
            .filter(|p| p.sm_util.is_none())
            .filter_map(|p| Some((p.pid, observe(prev.as_ref(), p.pid, now)?)))
            .collect();
        let earliest = simulated.iter().map(|(_, o)| o.start_us).min();
        let t0 = device_window_start(prev.as_ref().map(|h| h.ts), last_seen, earliest);
        let util = device_utilization(t0, now, prev.as_ref(), &simulated, &scripted);
        st.device.insert(
            gi,
            DeviceHistory {
                ts: now,
                procs: simulated.into_iter().collect(),
            },
        );
        // SAFETY: the caller's array holds at least one entry (checked above); plain data.
        let out = unsafe { &mut *samples };
        // SAFETY: plain data; zeroed, the union's bytes past `uiVal` are defined too.
        *out = unsafe { std::mem::zeroed() };
        out.timeStamp = now;
        out.sampleValue.uiVal = util;
        // SAFETY: non-null out pointer.
        unsafe { *count = 1 };
        log_samples("fake-nvml-device-samples.log", gi, last_seen, &[now]);
        SUCCESS
    })
}
