//! The in-container memory view: a process whose cgroup (or an ancestor) has a GPU-memory limit
//! reads that limit as the GPU's memory size.
//!
//! Entry side: a memory-info call (`FB_GET_INFO_V2` by RM control, `VID_HEAP_CONTROL` INFO) of a
//! limited cgroup is noted in `CALLS` with its command and GPU; nothing else is noted, so
//! other controls and unlimited cgroups pay one comparison. Return side (only in the exit
//! programs that may call `bpf_probe_write_user`): once the driver answered `NV_OK`, each size in
//! the reply is lowered to the smallest limit above the caller and each free figure to the
//! smallest headroom (limit less usage) — values are only ever lowered, so a GPU that is really
//! fuller, or a smaller MIG instance, still shows the true figure.

use aya_ebpf::helpers::bpf_probe_write_user;
use gpud_common::{
    Ancestry, Pending,
    rm::{
        self,
        fb::{self, Clamp},
    },
    stat,
};

use crate::{
    ledger::{current_ancestry, each_limit, gpu_of, usage, user},
    maps::bump_stat,
};

/// The smallest limit over the caller's ancestry for `gpu` (and for all GPUs), and the smallest
/// headroom under those limits, in bytes; `None` when no limit applies.
#[inline(always)]
fn view(anc: &Ancestry, gpu: u32) -> Option<(u64, u64)> {
    let (mut total, mut free, mut found) = (u64::MAX, u64::MAX, false);
    each_limit(anc, gpu, 0, |id, g, l| {
        let max = unsafe { (*l).max };
        found = true;
        total = total.min(max);
        free = free.min(max.saturating_sub(usage(id, g)));
        false
    });
    found.then_some((total, free))
}

/// Entry side of an RM control (its `NVOS54`): `Some((cmd, gpu))` to note when it is a memory-info control
/// on a subdevice of a GPU the caller's cgroup is limited on.
#[inline(always)]
pub(crate) fn control_entry(c: &rm::Nvos54) -> Option<(u32, u32)> {
    if c.cmd != fb::GET_INFO_V2 {
        return None;
    }
    limited(c.h_client, c.h_object).map(|gpu| (c.cmd, gpu))
}

/// Entry side of `VID_HEAP_CONTROL`: `Some((NVOS32_FUNCTION_INFO, gpu))` for a heap query of a
/// limited cgroup.
#[inline(always)]
pub(crate) fn vidheap_entry(params: u64) -> Option<(u32, u32)> {
    let function: u32 = unsafe { user(params + rm::VIDHEAP_FUNCTION as u64)? };
    if function != rm::NVOS32_FUNCTION_INFO {
        return None;
    }
    let ids: [u32; 2] = unsafe { user(params)? };
    limited(ids[0], ids[1]).map(|gpu| (function, gpu))
}

/// The GPU of `object` if the caller is limited on it (or on all GPUs).
#[inline(always)]
fn limited(client: u32, object: u32) -> Option<u32> {
    let gpu = gpu_of(client, object);
    let (_, anc) = current_ancestry()?;
    view(anc, gpu).map(|_| gpu)
}

/// A byte count as the lists' KiB, saturated to their u32.
#[inline(always)]
fn kib(bytes: u64) -> u32 {
    let k = bytes >> 10;
    if k > u32::MAX as u64 {
        u32::MAX
    } else {
        k as u32
    }
}

#[inline(always)]
fn lower<T: Copy + PartialOrd>(addr: u64, now: T, cap: T) -> bool {
    if now <= cap {
        return true;
    }
    unsafe { bpf_probe_write_user(addr as *mut T, &cap as *const T) }.is_ok()
}

/// Return side of a noted RM control that the driver answered: lowers the reply's sizes.
#[inline(always)]
pub(crate) fn control_done(p: &Pending) {
    let Some(c) = (unsafe { user::<rm::Nvos54>(p.params) }) else {
        bump_stat(stat::MEMINFO_SKIPPED);
        return;
    };
    if c.status != rm::status::NV_OK {
        return;
    }
    let Some((_, anc)) = current_ancestry() else {
        return;
    };
    let Some((total, free)) = view(anc, p.gpu) else {
        return;
    };
    let ok = c.cmd == p.cmd && fb_list(c.params, c.params_size, kib(total), kib(free));
    bump_stat(if ok {
        stat::MEMINFO_REWRITTEN
    } else {
        stat::MEMINFO_SKIPPED
    });
}

/// `FB_GET_INFO_V2`'s inline list: `list_size` pairs after the count, as many as the params
/// (whose size the driver checked against its own version's) hold. `false` when the reply is
/// not one the driver could have answered, or could not be read.
#[inline(always)]
fn fb_list(params: u64, size: u32, total_k: u32, free_k: u32) -> bool {
    if size < 12 || !(size - 4).is_multiple_of(8) {
        return false;
    }
    let Some(count) = (unsafe { user::<u32>(params) }) else {
        return false;
    };
    let mut n = count.min((size - 4) / 8);
    if n == 0 {
        return false;
    }
    // An explicit bound the verifier sees, whatever the compiler makes of the loop.
    if n > fb::MAX_LIST_SIZE as u32 {
        n = fb::MAX_LIST_SIZE as u32;
    }
    let mut at = params + 4;
    for _ in 0..fb::MAX_LIST_SIZE {
        if n == 0 {
            break;
        }
        n -= 1;
        // A pair that cannot be read ends the walk: what was lowered stays lowered.
        let Some(e) = (unsafe { user::<fb::Info>(at) }) else {
            return false;
        };
        let cap = match fb::clamp_of(e.index) {
            Some(Clamp::Total) => total_k,
            Some(Clamp::Free) => free_k,
            None => u32::MAX,
        };
        // A value that cannot be written stays as the driver wrote it.
        let _ = lower(at + 4, e.data, cap);
        at += 8;
    }
    true
}

/// Return side of a noted `VID_HEAP_CONTROL` INFO: heap size, free bytes and the largest free
/// block (bytes).
#[inline(always)]
pub(crate) fn vidheap_done(p: &Pending) {
    let Some(q) = (unsafe { user::<rm::Nvos32>(p.params) }) else {
        bump_stat(stat::MEMINFO_SKIPPED);
        return;
    };
    if q.status != rm::status::NV_OK || q.function != rm::NVOS32_FUNCTION_INFO {
        return;
    }
    let Some((_, anc)) = current_ancestry() else {
        return;
    };
    let Some((total, free)) = view(anc, p.gpu) else {
        return;
    };
    let base = p.params;
    let largest = base + rm::VIDHEAP_INFO_SIZE as u64;
    let ok = lower(base + rm::VIDHEAP_TOTAL as u64, q.total, total)
        & lower(base + rm::VIDHEAP_FREE as u64, q.free, free)
        & unsafe { user::<u64>(largest) }.is_some_and(|s| lower(largest, s, free));
    bump_stat(if ok {
        stat::MEMINFO_REWRITTEN
    } else {
        stat::MEMINFO_SKIPPED
    });
}
