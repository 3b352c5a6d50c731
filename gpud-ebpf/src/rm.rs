//! The RM calls on control files, entry and exit sides: each is routed to the scheduler guard
//! ([`crate::guard`]), the memory view ([`crate::meminfo`]) and the accounting with the limits'
//! tiers ([`crate::memory`]), which know nothing of one another.

use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use gpud_common::{
    CFG_SCHED_GUARD, CFG_VIRT_MEMINFO, EVENT_ALLOC_DENIED, Event, GPU_UNKNOWN, OP_ALLOC, OP_DUP,
    OP_FREE, Pending, nv, rm, stat,
};

use crate::{
    guard,
    kernel::current_tgid,
    ledger::{current_ancestry, gpu_of, user},
    maps::{bump_stat, config, noted, noting, send, take_call},
    meminfo,
    memory::{self, account_alloc, account_dup, account_free, limit_met, note_entry},
};

const ENOMEM: i32 = 12;

/// The RM call an ioctl makes: escape number, parameter size and user address, unwrapping an
/// XFER (whose header's address comes fourth, 0 when not wrapped). `None` for commands neither
/// the accounting nor the memory view follows, except XFERs: every one is noted, as another
/// thread may point its header at another call before the driver reads it.
#[inline(always)]
fn rm_call(cmd: u32, arg: u64) -> Option<(u32, u32, u64, u64)> {
    let (nr, size) = (nv::ioc_nr(cmd), nv::ioc_size(cmd));
    if nr == nv::NV_ESC_IOCTL_XFER_CMD {
        if size != nv::NV_IOCTL_XFER_SIZE {
            return None;
        }
        let x: rm::NvIoctlXfer = unsafe { user(arg)? };
        return Some((x.cmd, x.size, x.ptr, arg));
    }
    followed(nr, size).then_some((nr, size, arg, 0))
}

/// Whether `(nr, size)` is a call the accounting or the memory view reads.
#[inline(always)]
fn followed(nr: u32, size: u32) -> bool {
    matches!(
        (nr, size),
        (nv::NV_ESC_RM_ALLOC, nv::NVOS21_SIZE | nv::NVOS64_SIZE)
            | (nv::NV_ESC_RM_FREE, nv::NVOS00_SIZE)
            | (nv::NV_ESC_RM_VID_HEAP_CONTROL, nv::NVOS32_SIZE)
            | (nv::NV_ESC_RM_DUP_OBJECT, nv::NVOS55_SIZE)
            | (nv::NV_ESC_RM_CONTROL, nv::NVOS54_SIZE)
    )
}

/// Entry side of an ioctl on a control file. Returns the verdict (`-ENOMEM` or `-EPERM` to
/// refuse). With `REWRITE` (the entry programs that may call `bpf_probe_write_user`) the
/// scheduler guard may also rewrite a tenant's control.
#[inline(always)]
pub(crate) fn rm_entry<const REWRITE: bool>(file: u64, cmd: u32, arg: u64, deny: bool) -> i32 {
    let Some((nr, size, params, xfer)) = rm_call(cmd, arg) else {
        return 0;
    };
    let watched = followed(nr, size);
    // A memory-info call of a limited cgroup: its reply is rewritten at the exit. Other
    // controls are not noted (but in an XFER); only these two escapes look the configuration
    // up.
    let (mut view_cmd, mut view_gpu) = (0, GPU_UNKNOWN);
    if watched && nr == nv::NV_ESC_RM_CONTROL {
        // Noted for its exit if its driver state is read back there, whatever the guard saw.
        let mut read_back = false;
        if let Some(cfg) = config()
            && cfg.flags & (CFG_VIRT_MEMINFO | CFG_SCHED_GUARD) != 0
            && let Some(c) = unsafe { user::<rm::Nvos54>(params) }
        {
            if cfg.flags & CFG_SCHED_GUARD != 0 {
                let verdict = guard::control::<REWRITE>(cfg, file, params, &c, deny);
                read_back = guard::reads_back(cfg, file);
                match verdict {
                    Some(0) if read_back && !noted() => {}
                    Some(verdict) => return verdict,
                    None => {}
                }
            }
            if cfg.flags & CFG_VIRT_MEMINFO != 0
                && let Some((c, g)) = meminfo::control_entry(&c)
            {
                (view_cmd, view_gpu) = (c, g);
            }
        }
        if view_cmd == 0 && xfer == 0 && !read_back {
            return 0;
        }
    } else if watched
        && nr == nv::NV_ESC_RM_VID_HEAP_CONTROL
        && config().is_some_and(|c| c.flags & CFG_VIRT_MEMINFO != 0)
        && let Some((c, g)) = meminfo::vidheap_entry(params)
    {
        (view_cmd, view_gpu) = (c, g);
    }
    let Some(p) = noting() else {
        return 0;
    };
    (p.file, p.params, p.nr, p.size, p.cmd, p.gpu, p.xfer) =
        (file, params, nr, size, view_cmd, view_gpu, xfer);
    if !watched {
        // An XFER of a call nothing follows: noted for the header's check alone.
        return 0;
    }
    note_entry(p);
    if deny && p.op == OP_ALLOC && p.class == rm::class::MEMORY_LOCAL_USER {
        let gpu = gpu_of(p.client, p.parent);
        // An allocation of no size the entry side could read (FINN-serialized, unreadable)
        // meets any limit: refused before the driver rather than acted on after it.
        if let Some((_, anc)) = current_ancestry()
            && let Some((cg, g, now)) = limit_met(anc, gpu, p.arg, p.arg == 0)
        {
            bump_stat(stat::DENIED);
            send(&Event {
                kind: EVENT_ALLOC_DENIED,
                tgid: current_tgid(),
                cgroup_id: cg,
                client: p.client,
                object: 0,
                value: now,
                bytes: p.arg,
                gpu: g,
                _pad: 0,
            });
            p.file = 0;
            return -ENOMEM;
        }
    }
    0
}

/// Return side: accounts an RM call noted at entry; with `REWRITE` (the exit programs that may
/// call `bpf_probe_write_user`) also gives memory-info replies the caller's view. False where the
/// calling thread had no call noted.
#[inline(always)]
pub(crate) fn rm_exit<const REWRITE: bool>(ret: i64) -> bool {
    let Some(p) = take_call() else {
        return false;
    };
    rm_call_done::<REWRITE>(&p, ret);
    true
}

/// [`rm_exit`]'s work on the call `p` the driver answered with `ret`.
#[inline(always)]
fn rm_call_done<const REWRITE: bool>(p: &Pending, ret: i64) {
    // An XFER's inner call is user memory too: it may have been a control when the driver read it.
    if p.nr == nv::NV_ESC_RM_CONTROL || p.xfer != 0 {
        guard::read_back_at_exit(p.file);
    }
    if p.xfer != 0 && raced(p) {
        return;
    }
    if p.op == OP_DUP {
        // Whatever it returned: a reference taken at the entry is kept or given back.
        account_dup(p, ret);
        return;
    }
    if p.nr == nv::NV_ESC_RM_CONTROL && p.cmd == 0 {
        // Only the guard notes a control with no memory-info command: an undo for the daemon,
        // whatever the call returned (the driver may have acted before failing).
        guard::restore_at_exit(bpf_get_current_pid_tgid());
        return;
    }
    if ret != 0 {
        return;
    }
    if p.cmd != 0 {
        if REWRITE {
            match p.nr {
                nv::NV_ESC_RM_CONTROL => meminfo::control_done(p),
                _ => meminfo::vidheap_done(p),
            }
        }
        return;
    }
    match p.op {
        OP_ALLOC => account_alloc(p),
        OP_FREE => account_free(p),
        _ => {}
    }
}

/// Whether the XFER header of `p` no longer names the call its entry side saw: another thread
/// pointed it elsewhere while the driver read it, so what the driver did is unknown. A limited
/// caller counts as crossing its limit; the accounting of the call is skipped.
#[inline(always)]
fn raced(p: &Pending) -> bool {
    let Some(x) = (unsafe { user::<rm::NvIoctlXfer>(p.xfer) }) else {
        return false;
    };
    if (x.cmd, x.size, x.ptr) == (p.nr, p.size, p.params) {
        return false;
    }
    bump_stat(stat::RACED);
    memory::raced_call(p);
    true
}
