//! The RM calls on control files, entry and exit sides: each is routed to the scheduler guard
//! ([`crate::guard`]), the memory view ([`crate::meminfo`]) and the accounting with the limits'
//! tiers ([`crate::memory`]), which know nothing of one another.

use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use gpud_common::{
    CFG_SCHED_GUARD, CFG_VIRT_MEMINFO, EVENT_ALLOC_DENIED, Event, GPU_UNKNOWN, Pending, nv, rm,
    stat,
};

use crate::{
    guard,
    kernel::current_tgid,
    ledger::{current_ancestry, gpu_of, user},
    maps::{bump_stat, config, note_call, send, take_call},
    meminfo,
    memory::{account_alloc, account_free, account_vidheap, over_limit, vidmem_request},
};

const ENOMEM: i32 = 12;

/// The RM call an ioctl makes: escape number, parameter size and user address, unwrapping an
/// XFER. `None` for commands neither the accounting nor the memory view follows.
#[inline(always)]
fn rm_call(cmd: u32, arg: u64) -> Option<(u32, u32, u64)> {
    let (mut nr, mut size, mut params) = (nv::ioc_nr(cmd), nv::ioc_size(cmd), arg);
    if nr == nv::NV_ESC_IOCTL_XFER_CMD {
        if size != nv::NV_IOCTL_XFER_SIZE {
            return None;
        }
        let x: rm::NvIoctlXfer = unsafe { user(arg)? };
        if x.size > nv::NV_MAX_IOCTL_SIZE || x.cmd > 0xff {
            return None;
        }
        (nr, size, params) = (x.cmd, x.size, x.ptr);
    }
    match (nr, size) {
        (nv::NV_ESC_RM_ALLOC, nv::NVOS21_SIZE | nv::NVOS64_SIZE)
        | (nv::NV_ESC_RM_FREE, nv::NVOS00_SIZE)
        | (nv::NV_ESC_RM_VID_HEAP_CONTROL, nv::NVOS32_SIZE)
        | (nv::NV_ESC_RM_CONTROL, nv::NVOS54_SIZE) => Some((nr, size, params)),
        _ => None,
    }
}

/// Entry side of an ioctl on a control file. Returns the verdict (`-ENOMEM` or `-EPERM` to
/// refuse). With `REWRITE` (the entry programs that may call `bpf_probe_write_user`) the
/// scheduler guard may also rewrite a tenant's control.
#[inline(always)]
pub(crate) fn rm_entry<const REWRITE: bool>(file: u64, cmd: u32, arg: u64, deny: bool) -> i32 {
    let Some((nr, size, params)) = rm_call(cmd, arg) else {
        return 0;
    };
    // A memory-info call of a limited cgroup: its reply is rewritten at the exit. Other
    // controls are not noted at all; only these two escapes look the configuration up.
    let (mut view_cmd, mut view_gpu) = (0, GPU_UNKNOWN);
    if nr == nv::NV_ESC_RM_CONTROL {
        let Some(cfg) = config() else { return 0 };
        if cfg.flags & (CFG_VIRT_MEMINFO | CFG_SCHED_GUARD) == 0 {
            return 0;
        }
        let Some(c) = (unsafe { user::<rm::Nvos54>(params) }) else {
            return 0;
        };
        if cfg.flags & CFG_SCHED_GUARD != 0
            && let Some(verdict) = guard::control::<REWRITE>(cfg, file, params, &c, deny)
        {
            return verdict;
        }
        if cfg.flags & CFG_VIRT_MEMINFO == 0 {
            return 0;
        }
        let Some((c, g)) = meminfo::control_entry(&c) else {
            return 0;
        };
        (view_cmd, view_gpu) = (c, g);
    } else if nr == nv::NV_ESC_RM_VID_HEAP_CONTROL
        && config().is_some_and(|c| c.flags & CFG_VIRT_MEMINFO != 0)
        && let Some((c, g)) = meminfo::vidheap_entry(params)
    {
        (view_cmd, view_gpu) = (c, g);
    }
    if deny && let Some((client, parent, _, bytes)) = vidmem_request(nr, size, params) {
        let gpu = gpu_of(client, parent);
        if let Some((_, anc)) = current_ancestry()
            && let Some((cg, g, now)) = over_limit(anc, gpu, bytes)
        {
            bump_stat(stat::DENIED);
            send(&Event {
                kind: EVENT_ALLOC_DENIED,
                tgid: current_tgid(),
                cgroup_id: cg,
                client,
                object: 0,
                value: now,
                bytes,
                gpu: g,
                _pad: 0,
            });
            return -ENOMEM;
        }
    }
    let pending = Pending {
        file,
        params,
        nr,
        size,
        cmd: view_cmd,
        gpu: view_gpu,
    };
    note_call(pending);
    0
}

/// Return side: accounts a successful RM call noted at entry; with `REWRITE` (the exit
/// programs that may call `bpf_probe_write_user`) also gives memory-info replies the caller's
/// view.
#[inline(always)]
pub(crate) fn rm_exit<const REWRITE: bool>(ret: i64) {
    let Some(p) = take_call() else {
        return;
    };
    let id = bpf_get_current_pid_tgid();
    if p.nr == nv::NV_ESC_RM_CONTROL && p.cmd == 0 {
        // Only the guard notes a control with no memory-info command: an undo for the daemon,
        // whatever the call returned (the driver may have acted before failing).
        guard::restore_at_exit(id);
        return;
    }
    if ret != 0 {
        return;
    }
    match p.nr {
        nv::NV_ESC_RM_ALLOC => account_alloc(&p),
        nv::NV_ESC_RM_FREE => account_free(&p),
        nv::NV_ESC_RM_CONTROL => {
            if REWRITE {
                meminfo::control_done(&p);
            }
        }
        _ if REWRITE && p.cmd != 0 => meminfo::vidheap_done(&p),
        _ => account_vidheap(&p),
    }
}
