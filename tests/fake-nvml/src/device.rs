//! NVML's device queries, but for device utilization samples (`samples`): the device count
//! and handles (MIG devices included), identity (index, UUID, name, PCI), topology (NUMA node,
//! common ancestor, NVLink), compute and MIG modes, memory, the processes running on a device
//! (compute, graphics) and their utilization samples (the simulated GPU's, [`crate::sim`], for
//! processes without a scripted `sm_util`), and the event types a device supports.

use std::ffi::{c_char, c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlProcessInfo_t,
    nvmlProcessUtilizationSample_t, nvmlReturn_t,
};

use crate::{
    INSUFFICIENT_SIZE, INVALID_ARGUMENT, NO_INSTANCE, NOT_FOUND, NOT_SUPPORTED, SUCCESS, State,
    TOPOLOGY_INTERNAL, TOPOLOGY_NODE, TOPOLOGY_SINGLE, TOPOLOGY_SYSTEM, XID, decode, gpu_of,
    handle, processes_on,
    scenario::{Gpu, Kind, Process},
    sim::{log_samples, next_timestamp, simulated},
    with, write_str,
};

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

/// Fills NVML's PCI record of a GPU from its bus id.
fn fill_pci(p: &mut nvmlPciInfo_t, bus_id: &str) {
    // SAFETY: plain data.
    *p = unsafe { std::mem::zeroed() };
    for (i, b) in bus_id.bytes().take(31).enumerate() {
        p.busId[i] = b as c_char;
    }
    for (i, b) in bus_id.bytes().skip(4).take(15).enumerate() {
        p.busIdLegacy[i] = b as c_char;
    }
    p.pciDeviceId = 0x2330_10de;
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
        fill_pci(unsafe { &mut *pci }, &g.pci_bus_id);
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(
    device: nvmlDevice_t,
    node: *mut c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetNumaNodeId", |st| match gpu_of(st, device) {
        Some((g, None)) if !node.is_null() => {
            // SAFETY: non-null out pointer.
            unsafe { *node = g.numa_node };
            SUCCESS
        }
        _ => INVALID_ARGUMENT,
    })
}

/// The closest common ancestor of two GPUs: the same GPU, a shared PCIe switch, the same NUMA
/// node, or only the system.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    level: *mut c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetTopologyCommonAncestor", |st| {
        let (Some((a, None)), Some((b, None))) = (gpu_of(st, device1), gpu_of(st, device2)) else {
            return INVALID_ARGUMENT;
        };
        if level.is_null() {
            return INVALID_ARGUMENT;
        }
        let l = if a.uuid == b.uuid {
            TOPOLOGY_INTERNAL
        } else if a.pci_switch.is_some() && a.pci_switch == b.pci_switch {
            TOPOLOGY_SINGLE
        } else if a.numa_node == b.numa_node {
            TOPOLOGY_NODE
        } else {
            TOPOLOGY_SYSTEM
        };
        // SAFETY: non-null out pointer.
        unsafe { *level = l };
        SUCCESS
    })
}

/// The peer GPU of one NVLink of a GPU: `Err` with NVML's code when the GPU has no NVLink or
/// the link number is out of range, `Ok(None)` for an inactive link.
fn nvlink_peer(
    st: &State,
    device: nvmlDevice_t,
    link: c_uint,
) -> Result<Option<&Gpu>, nvmlReturn_t> {
    let Some((g, None)) = gpu_of(st, device) else {
        return Err(INVALID_ARGUMENT);
    };
    if link >= nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS {
        return Err(INVALID_ARGUMENT);
    }
    let Some(links) = &g.nvlinks else {
        return Err(NOT_SUPPORTED);
    };
    match links.get(link as usize) {
        None => Ok(None),
        Some(peer) => st
            .scenario
            .gpus
            .get(*peer as usize)
            .map(Some)
            .ok_or(INVALID_ARGUMENT),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    active: *mut c_uint,
) -> nvmlReturn_t {
    with("nvmlDeviceGetNvLinkState", |st| {
        if active.is_null() {
            return INVALID_ARGUMENT;
        }
        match nvlink_peer(st, device, link) {
            Ok(peer) => {
                // SAFETY: non-null out pointer; nvmlEnableState_t is 0 or 1.
                unsafe { *active = c_uint::from(peer.is_some()) };
                SUCCESS
            }
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with("nvmlDeviceGetNvLinkRemotePciInfo_v2", |st| {
        if pci.is_null() {
            return INVALID_ARGUMENT;
        }
        match nvlink_peer(st, device, link) {
            Ok(Some(peer)) => {
                // SAFETY: non-null out pointer to the caller's struct.
                fill_pci(unsafe { &mut *pci }, &peer.pci_bus_id);
                SUCCESS
            }
            // Real NVML answers an inactive link's remote end as not supported.
            Ok(None) => NOT_SUPPORTED,
            Err(code) => code,
        }
    })
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
        let used: u64 = processes_on(st, gi, mi).iter().map(|p| p.memory).sum();
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

unsafe fn running_processes(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
    graphics: bool,
    name: &str,
) -> nvmlReturn_t {
    with(name, |st| {
        let (Some((gi, mi)), Some((gpu, _))) = (decode(device), gpu_of(st, device)) else {
            return INVALID_ARGUMENT;
        };
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        let mig_mode = gpu.mig.is_some();
        let list: Vec<Process> = processes_on(st, gi, mi)
            .into_iter()
            .filter(|p| match p.kind {
                Kind::Both => true,
                Kind::Graphics => graphics,
                Kind::Compute => !graphics,
            })
            .collect();
        // SAFETY: non-null in/out pointer.
        let room = unsafe { *count } as usize;
        // SAFETY: as above.
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
            (out.gpuInstanceId, out.computeInstanceId) = match p.mig {
                Some(m) if mig_mode => (m, 0),
                _ => (NO_INSTANCE, NO_INSTANCE),
            };
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
        running_processes(
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
        running_processes(
            device,
            count,
            infos,
            true,
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
        )
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    samples: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    last_seen: c_ulonglong,
) -> nvmlReturn_t {
    with("nvmlDeviceGetProcessUtilization", |st| {
        let (Some((gi, mi)), Some((gpu, _))) = (decode(device), gpu_of(st, device)) else {
            return INVALID_ARGUMENT;
        };
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        // NVML samples per process only on whole GPUs outside MIG mode.
        if mi.is_some() || gpu.mig.is_some() || !gpu.process_utilization {
            return NOT_SUPPORTED;
        }
        let procs = processes_on(st, gi, None);
        if samples.is_null() {
            // A size query: at most one sample per process.
            // SAFETY: non-null out pointer.
            unsafe { *count = procs.len() as c_uint };
            return if procs.is_empty() {
                NOT_FOUND
            } else {
                INSUFFICIENT_SIZE
            };
        }
        // SAFETY: non-null in/out pointer.
        let room = unsafe { *count } as usize;
        if room < procs.len() {
            // SAFETY: as above.
            unsafe { *count = procs.len() as c_uint };
            return INSUFFICIENT_SIZE;
        }
        let now = next_timestamp(st);
        let mut n = 0;
        for p in &procs {
            let sm = match p.sm_util {
                Some(u) => u,
                None => simulated(st, p.pid, last_seen, now).unwrap_or(0),
            };
            if sm == 0 && p.enc_util == 0 && p.dec_util == 0 {
                // Real NVML returns only processes with a non-zero figure in the window.
                continue;
            }
            // SAFETY: the caller's array holds `room` >= procs.len() entries.
            let out = unsafe { &mut *samples.add(n) };
            out.pid = p.pid;
            out.timeStamp = now;
            out.smUtil = sm;
            out.memUtil = 0;
            out.encUtil = p.enc_util;
            out.decUtil = p.dec_util;
            n += 1;
        }
        // SAFETY: non-null out pointer.
        unsafe { *count = n as c_uint };
        log_samples("fake-nvml-samples.log", gi, last_seen, &vec![now; n]);
        if n == 0 { NOT_FOUND } else { SUCCESS }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    with("nvmlDeviceGetSupportedEventTypes", |st| {
        match (decode(device), gpu_of(st, device)) {
            (Some((_, None)), Some((g, None))) if !types.is_null() => {
                // SAFETY: non-null out pointer.
                unsafe { *types = if g.xid_events { XID } else { 0 } };
                SUCCESS
            }
            (Some((_, Some(_))), Some(_)) => NOT_SUPPORTED,
            _ => INVALID_ARGUMENT,
        }
    })
}
