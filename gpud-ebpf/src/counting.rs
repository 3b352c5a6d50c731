//! Ioctl counting: per-cgroup and per-process counters by ioctl class, and the `TRACKED` filter
//! that lets tracepoint mode leave at once for processes that hold no NVIDIA file.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_cgroup_id, bpf_probe_read_user},
};
use gpud_common::{
    DeviceKind, EVENT_PROC_NEW, IOCTL_CLASSES, IoctlClass, IoctlCounts, PROC_OPENED, ProcEntry,
    TRACKED_PER_WORD,
    nv::{self, Decoded},
    stat,
};

use crate::{
    kernel::current_tgid,
    maps::{CGROUPS, PROCS, TRACKED, bump_stat, config, emit},
};

/// The `TRACKED` word holding `tgid`'s counter, and the counter's bit shift.
#[inline(always)]
fn tracked_slot(tgid: u32) -> Option<(*mut u64, u32)> {
    let word = TRACKED.get_ptr_mut(tgid / TRACKED_PER_WORD)?;
    Some((word, (tgid % TRACKED_PER_WORD) * 8))
}

/// Whether `tgid` may hold an NVIDIA file. A pid beyond the map (pid_max raised after it was
/// created) falls back to `PROCS`.
#[inline(always)]
pub(crate) fn is_tracked(tgid: u32) -> bool {
    match tracked_slot(tgid) {
        Some((word, shift)) => (unsafe { core::ptr::read_volatile(word) } >> shift) & 0xff != 0,
        None => PROCS.get_ptr(tgid).is_some(),
    }
}

#[inline(always)]
pub(crate) fn mark_tracked(tgid: u32) {
    if let Some((word, shift)) = tracked_slot(tgid) {
        // Racing markers may both add: the counter then reads 2, still "tracked".
        if (unsafe { core::ptr::read_volatile(word) } >> shift) & 0xff == 0 {
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(word, 1 << shift) };
        }
    }
}

/// Called when the process is gone, so nothing marks its slot concurrently.
#[inline(always)]
pub(crate) fn clear_tracked(tgid: u32) {
    if let Some((word, shift)) = tracked_slot(tgid) {
        let v = (unsafe { core::ptr::read_volatile(word) } >> shift) & 0xff;
        if v != 0 {
            let minus = (v << shift).wrapping_neg();
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(word, minus) };
        }
    }
}

/// The `PROCS` entry of `tgid`, created (and announced) if absent.
#[inline(always)]
fn proc_entry(tgid: u32, cgroup_id: u64, flags: u32) -> Option<*mut ProcEntry> {
    if let Some(p) = PROCS.get_ptr_mut(tgid) {
        return Some(p);
    }
    let fresh = ProcEntry {
        cgroup_id,
        flags,
        ..ProcEntry::default()
    };
    match PROCS.insert(tgid, fresh, BPF_NOEXIST as u64) {
        Ok(()) => {
            mark_tracked(tgid);
            emit(EVENT_PROC_NEW, tgid, cgroup_id);
        }
        // Another CPU inserted it first: fine, use theirs.
        Err(_) if PROCS.get_ptr_mut(tgid).is_some() => {}
        Err(_) => {
            // Uncounted, but its RM calls' return sides must still run (they charge what it
            // allocates): `TRACKED`, sized to pid_max, cannot fill.
            mark_tracked(tgid);
            bump_stat(stat::PROCS_FULL);
            return None;
        }
    }
    PROCS.get_ptr_mut(tgid)
}

#[inline(always)]
fn add_one(counts: *mut IoctlCounts, class: IoctlClass) {
    let i = class as usize;
    if i >= IOCTL_CLASSES {
        return;
    }
    // Threads of one process, and processes of one cgroup, run on several CPUs at once.
    unsafe {
        let slot = core::ptr::addr_of_mut!((*counts).by_class[i]);
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(slot, 1);
    }
}

/// Charges one ioctl on an NVIDIA file to the calling cgroup and process.
#[inline(always)]
pub(crate) fn account(kind: DeviceKind, cmd: u32, arg: u64) {
    let class = match nv::classify(kind, cmd) {
        Decoded::Class(c) => c,
        Decoded::Xfer => match unsafe { bpf_probe_read_user(arg as *const [u32; 2]) } {
            Ok([inner_cmd, inner_size]) => nv::classify_xfer(inner_cmd, inner_size),
            Err(_) => IoctlClass::Other,
        },
    };
    let tgid = current_tgid();
    // gpud's own calls through copies of tenants' files (the compute law's controls, the free
    // of a crossing allocation) are no tenant's: neither counted nor tracked.
    if config().is_some_and(|c| c.daemon_tgid == tgid) {
        return;
    }
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };

    let counts = match CGROUPS.get_ptr_mut(cgroup_id) {
        Some(p) => Some(p),
        None => {
            let zero = IoctlCounts::default();
            if CGROUPS.insert(cgroup_id, zero, BPF_NOEXIST as u64).is_err()
                && CGROUPS.get_ptr_mut(cgroup_id).is_none()
            {
                bump_stat(stat::CGROUPS_FULL);
            }
            CGROUPS.get_ptr_mut(cgroup_id)
        }
    };
    if let Some(c) = counts {
        add_one(c, class);
    }
    if let Some(p) = proc_entry(tgid, cgroup_id, 0) {
        unsafe {
            (*p).cgroup_id = cgroup_id;
            add_one(core::ptr::addr_of_mut!((*p).counts), class);
        }
    }
    bump_stat(stat::MATCHED_IOCTLS);
}

/// Marks the calling process as holding an NVIDIA file.
#[inline(always)]
pub(crate) fn mark_opened() {
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    let tgid = current_tgid();
    mark_tracked(tgid);
    if let Some(p) = proc_entry(tgid, cgroup_id, PROC_OPENED) {
        unsafe {
            (*p).flags |= PROC_OPENED;
            (*p).cgroup_id = cgroup_id;
        }
    }
}
