//! NVML's event handling: event sets, the devices and Xid event types registered in them, and
//! `nvmlEventSetWait_v2` delivering each scenario event once.

use std::{
    ffi::{c_uint, c_ulonglong},
    time::{Duration, Instant},
};

use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlReturn_t};

use crate::{
    INVALID_ARGUMENT, NO_INSTANCE, NOT_SUPPORTED, SUCCESS, State, TIMEOUT, UNINITIALIZED, XID,
    decode, gpu_of, handle, lock, refresh, with,
};

/// Event-set handles are opaque to the caller: small numbers above this base.
const SET_BASE: usize = 0x5e70_0000;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    with("nvmlEventSetCreate", |st| {
        if set.is_null() {
            return INVALID_ARGUMENT;
        }
        st.next_set += 1;
        st.sets.insert(st.next_set, Vec::new());
        // SAFETY: non-null out pointer; the handle is opaque.
        unsafe { *set = (SET_BASE + st.next_set) as nvmlEventSet_t };
        SUCCESS
    })
}

fn set_id(set: nvmlEventSet_t) -> usize {
    (set as usize).wrapping_sub(SET_BASE)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    with("nvmlDeviceRegisterEvents", |st| {
        let supported = match (decode(device), gpu_of(st, device)) {
            (Some((_, None)), Some((g, None))) if g.xid_events => XID,
            (Some(_), Some(_)) => 0,
            _ => return INVALID_ARGUMENT,
        };
        let Some((gi, None)) = decode(device) else {
            return NOT_SUPPORTED;
        };
        if types & !supported != 0 {
            return NOT_SUPPORTED;
        }
        match st.sets.get_mut(&set_id(set)) {
            Some(devices) => {
                devices.push((gi, types));
                SUCCESS
            }
            None => INVALID_ARGUMENT,
        }
    })
}

/// The next undelivered event for event set `set`, marked delivered.
fn take_event(st: &mut State, set: usize) -> Option<(u32, u64)> {
    let registered = st.sets.get(&set)?;
    let (id, gpu, xid) = st
        .scenario
        .events
        .iter()
        .enumerate()
        .map(|(i, e)| (e.id.unwrap_or(i as u64), e.gpu, e.xid))
        .find(|(id, gpu, _)| {
            !st.delivered.contains(id)
                && registered
                    .iter()
                    .any(|(g, mask)| g == gpu && mask & XID != 0)
        })?;
    st.delivered.insert(id);
    Some((gpu, xid))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    let rc = with("nvmlEventSetWait_v2", |st| {
        if data.is_null() || !st.sets.contains_key(&set_id(set)) {
            INVALID_ARGUMENT
        } else {
            SUCCESS
        }
    });
    if rc != SUCCESS {
        return rc;
    }
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    loop {
        {
            let mut guard = lock();
            let Some(st) = guard.as_mut().filter(|s| s.initialized > 0) else {
                return UNINITIALIZED;
            };
            refresh(st);
            if let Some((gpu, xid)) = take_event(st, set_id(set)) {
                // SAFETY: non-null out pointer (checked above).
                let out = unsafe { &mut *data };
                out.device = handle(gpu, None);
                out.eventType = XID;
                out.eventData = xid;
                out.gpuInstanceId = NO_INSTANCE;
                out.computeInstanceId = NO_INSTANCE;
                return SUCCESS;
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return TIMEOUT;
        }
        // Poll without holding the lock, so other calls go on meanwhile.
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    if let Some(st) = lock().as_mut() {
        st.sets.remove(&set_id(set));
    }
    SUCCESS
}
