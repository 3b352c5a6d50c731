//! Reads of what the accounting keeps, shared by the memory tiers ([`crate::memory`]), the memory
//! view ([`crate::meminfo`]) and the scheduler guard ([`crate::guard`]): user memory, the caller's
//! cgroup ancestry, a cgroup's usage and limits, the GPU an object lives on. Only reads (and the
//! ancestry's first recording), so that none of those modules needs another.

use aya_ebpf::helpers::{
    bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_probe_read_user,
};
use gpud_common::{
    Ancestry, GPU_ALL, GPU_UNKNOWN, KernelLimit, MAX_CGROUP_DEPTH, OBJ_DEVICE, OBJ_SUBDEVICE,
    ObjKey, UsageKey,
};

use crate::maps::{ANCESTRY, LIMITS, OBJECTS, SCRATCH, USAGE};

#[inline(always)]
pub(crate) unsafe fn user<T>(addr: u64) -> Option<T> {
    unsafe { bpf_probe_read_user(addr as *const T).ok() }
}

#[inline(always)]
pub(crate) fn gpu_of(client: u32, parent: u32) -> u32 {
    match unsafe {
        OBJECTS.get(ObjKey {
            client,
            object: parent,
        })
    } {
        Some(e) if e.kind == OBJ_DEVICE || e.kind == OBJ_SUBDEVICE => e.gpu,
        _ => GPU_UNKNOWN,
    }
}

/// The calling task's cgroup and its ancestors, recorded once per cgroup.
#[inline(always)]
pub(crate) fn current_ancestry() -> Option<(u64, &'static Ancestry)> {
    let leaf = unsafe { bpf_get_current_cgroup_id() };
    if let Some(a) = unsafe { ANCESTRY.get(leaf) } {
        return Some((leaf, a));
    }
    let scratch = SCRATCH.get_ptr_mut(0)?;
    let a = unsafe { &mut *scratch };
    a.depth = 0;
    for level in 0..MAX_CGROUP_DEPTH {
        let id = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
        if id == 0 {
            break;
        }
        a.ids[level] = id;
        a.depth = level as u32 + 1;
        if id == leaf {
            break;
        }
    }
    if a.depth == 0 {
        // Deeper than MAX_CGROUP_DEPTH or no cgroup v2: charge the cgroup itself only.
        a.ids[0] = leaf;
        a.depth = 1;
    }
    let _ = ANCESTRY.insert(leaf, a, 0);
    unsafe { ANCESTRY.get(leaf) }.map(|a| (leaf, a))
}

#[inline(always)]
pub(crate) fn usage(cgroup_id: u64, gpu: u32) -> u64 {
    let key = UsageKey::new(cgroup_id, gpu);
    match USAGE.get_ptr(key) {
        Some(p) => unsafe { core::ptr::read_volatile(p) },
        None => 0,
    }
}

/// Calls `f(cgroup, GPU key, limit)` for each limit that applies to `gpu` (its own and the
/// all-GPU one) over `anc`, from the root down, until `f` returns true.
#[inline(always)]
pub(crate) fn each_limit(
    anc: &Ancestry,
    gpu: u32,
    mut f: impl FnMut(u64, u32, *mut KernelLimit) -> bool,
) {
    for i in 0..MAX_CGROUP_DEPTH {
        if i as u32 >= anc.depth {
            break;
        }
        let id = anc.ids[i];
        for g in [gpu, GPU_ALL] {
            let key = UsageKey::new(id, g);
            if let Some(l) = LIMITS.get_ptr_mut(key)
                && f(id, g, l)
            {
                return;
            }
        }
    }
}

/// Whether `anc` has a limit on `gpu` itself (an `all` limit does not count).
#[inline(always)]
pub(crate) fn limited_on(anc: &Ancestry, gpu: u32) -> bool {
    for i in 0..MAX_CGROUP_DEPTH {
        if i as u32 >= anc.depth {
            break;
        }
        let key = UsageKey::new(anc.ids[i], gpu);
        if LIMITS.get_ptr_mut(key).is_some() {
            return true;
        }
    }
    false
}
