//! Reads of what the accounting keeps, shared by the memory tiers ([`crate::memory`]), the memory
//! view ([`crate::meminfo`]) and the scheduler guard ([`crate::guard`]): user memory, the caller's
//! cgroup ancestry, a cgroup's usage and limits, the GPU an object lives on. Only reads (and the
//! ancestry's first recording, and which of its levels have no limit), so that none of those
//! modules needs another.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_probe_read_user},
};
use gpud_common::{
    Ancestry, CFG_LIMITS_SEEN, CgroupUsage, GPU_ALL, GPU_UNKNOWN, KernelLimit, MAX_CGROUP_DEPTH,
    OBJ_DEVICE, OBJ_SUBDEVICE, ObjKey, USAGE_GPUS, UsageKey, limits_seen,
};

use crate::maps::{ANCESTRY, LIMITS, LIMITS_GEN, OBJECTS, SCRATCH, USAGE, config};

#[inline(always)]
pub(crate) unsafe fn user<T>(addr: u64) -> Option<T> {
    unsafe { bpf_probe_read_user(addr as *const T).ok() }
}

/// The GPU of what is allocated under `parent`: its device's or subdevice's, `GPU_UNKNOWN`
/// where that is not recorded or names a device instance the driver cannot have (a value a
/// tenant rewrote before the daemon read the device back), which then meets every per-GPU
/// limit.
#[inline(always)]
pub(crate) fn gpu_of(client: u32, parent: u32) -> u32 {
    parent_of(client, parent).0
}

/// [`gpu_of`], and the control file the parent's record was made through (0 where none is
/// recorded), from the one lookup.
#[inline(always)]
pub(crate) fn parent_of(client: u32, parent: u32) -> (u32, u64) {
    match unsafe {
        OBJECTS.get(ObjKey {
            client,
            object: parent,
        })
    } {
        Some(e)
            if (e.kind == OBJ_DEVICE || e.kind == OBJ_SUBDEVICE)
                && (e.gpu as usize) < USAGE_GPUS =>
        {
            (e.gpu, e.file)
        }
        Some(e) => (GPU_UNKNOWN, e.file),
        None => (GPU_UNKNOWN, 0),
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
    // The per-CPU scratch holds the last record built here.
    (a.depth, a.limits_seen) = (0, 0);
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
    // Never over a record another CPU made meanwhile: walks may be reading it.
    let _ = ANCESTRY.insert(leaf, a, BPF_NOEXIST as u64);
    unsafe { ANCESTRY.get(leaf) }.map(|a| (leaf, a))
}

/// [`CgroupUsage::charge_slot`] in a form whose bound every kernel's verifier sees: the device
/// instance is masked after an opaque read, so that LLVM can neither drop the mask (it knows
/// the instance is below 32 there) nor fold the two cases into one value it bounds no more.
/// Linux 6.1's verifier refused both forms LLVM made of the plain computation.
#[inline(always)]
pub(crate) fn charge_slot(gpu: u32) -> usize {
    if (gpu as usize) < USAGE_GPUS {
        let g = unsafe { core::ptr::read_volatile(&gpu) } as usize;
        return (g & (USAGE_GPUS - 1)) + 1;
    }
    CgroupUsage::UNKNOWN
}

/// Bytes charged to `cgroup_id` (and its descendants) under GPU key `gpu`.
#[inline(always)]
pub(crate) fn usage(cgroup_id: u64, gpu: u32) -> u64 {
    let Some(p) = USAGE.get_ptr(cgroup_id) else {
        return 0;
    };
    let slot = match gpu {
        GPU_ALL => CgroupUsage::ALL,
        g => charge_slot(g),
    };
    unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*p).bytes).cast::<u64>().add(slot)) }
}

/// The generation the limits are at, where the walks may skip levels on this host
/// (`CFG_LIMITS_SEEN`) and the daemon has started counting (not 0).
#[inline(always)]
fn limits_generation() -> Option<u64> {
    let cfg = config()?;
    if cfg.flags & CFG_LIMITS_SEEN == 0 {
        return None;
    }
    let generation = unsafe { core::ptr::read_volatile(LIMITS_GEN.get_ptr(0)?) };
    (generation != 0).then_some(generation)
}

/// The current generation, and the levels of `anc` its [`limits_seen`] word says have no limit
/// under it (`None`: the word is of another generation); `None` where nothing may be skipped.
#[inline(always)]
fn seen_levels(anc: &Ancestry) -> Option<(u64, Option<u32>)> {
    let generation = limits_generation()?;
    let word = unsafe { core::ptr::read_volatile(&anc.limits_seen) };
    Some((generation, limits_seen::levels(word, generation)))
}

/// The levels of `anc` its [`limits_seen`] word says have no limit at all, where the word is of
/// the current generation; otherwise none (every level is looked up). Only allocations learn
/// the levels ([`learn_levels`]): every other walk reads what they found.
#[inline(always)]
pub(crate) fn levels_without_limits(anc: &Ancestry) -> u32 {
    seen_levels(anc).and_then(|(_, levels)| levels).unwrap_or(0)
}

/// Learns which levels of `anc` have no limit, where its word is not of the current generation
/// (see [`learn_levels`]). Called once per allocation, before its limit walks: one learning
/// pass in the program instead of one per walk, which the verifier would explore at each.
#[inline(always)]
pub(crate) fn learn_levels_if_stale(anc: &Ancestry) {
    if let Some((generation, None)) = seen_levels(anc) {
        learn_levels(anc, generation);
    }
}

/// Finds which levels of `anc` have no limit on any GPU (neither a `GPU_UNKNOWN` entry, which
/// comes with every per-GPU limit, nor a `GPU_ALL` one) and writes them in its `limits_seen`
/// under `generation`, read before these lookups: a limit the daemon wrote before raising the
/// generation to it is seen. Written only while `anc` is still the record of its last level's
/// cgroup (a record deeper than [`MAX_CGROUP_DEPTH`] ends above its own cgroup: never). Its own
/// pass, apart from the limit walks: a mask built there would be a value per path for the
/// verifier.
#[inline(always)]
fn learn_levels(anc: &Ancestry, generation: u64) {
    // Read after the generation (volatile: not hoisted above it), as the levels are.
    let depth = unsafe { core::ptr::read_volatile(&anc.depth) };
    let mut without = 0u32;
    for i in 0..MAX_CGROUP_DEPTH {
        if i as u32 >= depth {
            break;
        }
        let id = unsafe { core::ptr::read_volatile(&anc.ids[i]) };
        if LIMITS.get_ptr(UsageKey::new(id, GPU_UNKNOWN)).is_none()
            && LIMITS.get_ptr(UsageKey::new(id, GPU_ALL)).is_none()
        {
            without |= 1 << i;
        }
    }
    let last = depth.wrapping_sub(1) as usize;
    if last >= MAX_CGROUP_DEPTH {
        return;
    }
    let Some(record) = ANCESTRY.get_ptr_mut(anc.ids[last]) else {
        return;
    };
    // Compared with an address read back through the stack: from an equality with `anc` the
    // compiler would infer the lookup non-null and drop its null check, which older verifiers
    // (6.1) do not infer themselves.
    let here = unsafe { core::ptr::read_volatile(&core::ptr::from_ref(anc)) };
    if !core::ptr::eq(record.cast_const(), here) {
        return;
    }
    // In place, one aligned word; a racing walk's word is as good (each is of the generation
    // it read before its lookups).
    let at = unsafe { core::ptr::addr_of_mut!((*record).limits_seen) };
    unsafe { core::ptr::write_volatile(at, limits_seen::word(generation, without)) };
}

/// Calls `f(cgroup, GPU key, limit)` for each limit that applies to `gpu` (its own and the
/// all-GPU one) over `anc`, from the root down, until `f` returns true. The levels set in
/// `skip` ([`levels_without_limits`]) are not looked up: only the walks every allocation and
/// free make pass them, as each such walk adds paths for the verifier to explore; the others
/// (unsized, unconfirmed or unrecorded calls, duplicates, devices, the memory view, the deny
/// tier's entry) pass 0 and look every level up.
#[inline(always)]
pub(crate) fn each_limit(
    anc: &Ancestry,
    gpu: u32,
    skip: u32,
    mut f: impl FnMut(u64, u32, *mut KernelLimit) -> bool,
) {
    for i in 0..MAX_CGROUP_DEPTH {
        if i as u32 >= anc.depth {
            break;
        }
        if skip & (1 << i) != 0 {
            continue;
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
