//! GPU-memory accounting and the limits' kernel-side tiers.
//!
//! At an RM call's entry ([`crate::rm`]) the `deny` tier refuses an allocation that would take
//! a cgroup over a limit ([`over_limit`]). At its return the driver has written back `status`,
//! handles and the allocated size, so successful calls are charged or uncharged
//! ([`account_alloc`], [`account_free`], [`account_vidheap`]). Subtree, client and file releases
//! are announced to the daemon, which walks `OBJECTS` and releases each object through
//! `gpud_release`.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_send_signal,
    },
};
use gpud_common::{
    Ancestry, DeviceKind, EVENT_FILE_RELEASE, EVENT_FREE_TREE, EVENT_LIMIT_CROSSED, Event, GPU_ALL,
    GPU_UNKNOWN, MAX_CGROUP_DEPTH, OBJ_CHANNEL, OBJ_CHANNEL_GROUP, OBJ_CLIENT, OBJ_DEVICE,
    OBJ_MEMORY, OBJ_SUBDEVICE, ObjEntry, ObjKey, Pending, ProbeConfig, REACT_KILL, UsageKey, nv,
    rm, stat,
};

use crate::{
    kernel::{ProbeRead, current_tgid, device_kind, read_at, sole_reference},
    ledger::{current_ancestry, each_limit, gpu_of, usage, user},
    maps::{ANCESTRY, OBJECTS, USAGE, bump_stat, config, send},
};

const SIGKILL: u32 = 9;
const EEXIST: i32 = 17;

/// An RM_ALLOC's parameters, from one read of the caller's struct: NVOS21's fields (NVOS64's
/// `status` in `head.status`) and NVOS64's `flags` (0 for NVOS21). One read instead of one per
/// field: each `bpf_probe_read_user` costs tens of ns (hardened usercopy checks included).
pub(crate) struct AllocArgs {
    pub(crate) head: rm::Nvos21,
    pub(crate) flags: u32,
}

#[inline(always)]
pub(crate) fn alloc_args(size: u32, params: u64) -> Option<AllocArgs> {
    if size == nv::NVOS64_SIZE {
        let a: rm::Nvos64 = unsafe { user(params)? };
        return Some(AllocArgs {
            head: rm::Nvos21 {
                h_root: a.h_root,
                h_object_parent: a.h_object_parent,
                h_object_new: a.h_object_new,
                h_class: a.h_class,
                p_alloc_parms: a.p_alloc_parms,
                params_size: a.params_size,
                status: a.status,
            },
            flags: a.flags,
        });
    }
    let head: rm::Nvos21 = unsafe { user(params)? };
    Some(AllocArgs { head, flags: 0 })
}

/// A video-memory RM_ALLOC: client, parent, new handle, bytes (read from the alloc params:
/// requested at entry, allocated at return).
#[inline(always)]
fn vidmem_alloc(a: &AllocArgs) -> Option<(u32, u32, u32, u64)> {
    if a.head.h_class != rm::class::MEMORY_LOCAL_USER {
        return None;
    }
    if a.flags & rm::NVOS64_FLAGS_FINN_SERIALIZED != 0 {
        bump_stat(stat::UNREADABLE);
        return None;
    }
    let Some(bytes) = (unsafe { user::<u64>(a.head.p_alloc_parms + rm::MEM_PARAMS_SIZE as u64) })
    else {
        bump_stat(stat::UNREADABLE);
        return None;
    };
    Some((
        a.head.h_root,
        a.head.h_object_parent,
        a.head.h_object_new,
        bytes,
    ))
}

/// A video-memory allocation request: client, parent, new handle, bytes. For RM_ALLOC the
/// bytes are read from the alloc params (requested at entry, allocated at return).
#[inline(always)]
pub(crate) fn vidmem_request(nr: u32, size: u32, params: u64) -> Option<(u32, u32, u32, u64)> {
    if nr == nv::NV_ESC_RM_ALLOC {
        return vidmem_alloc(&alloc_args(size, params)?);
    }
    if nr == nv::NV_ESC_RM_VID_HEAP_CONTROL {
        let function: u32 = unsafe { user(params + rm::VIDHEAP_FUNCTION as u64)? };
        let (attr_off, size_off) = rm::vidheap_alloc_fields(function)?;
        let flags: u32 = unsafe { user(params + rm::VIDHEAP_FLAGS as u64)? };
        let attr: u32 = unsafe { user(params + attr_off as u64)? };
        if flags & rm::NVOS32_ALLOC_FLAGS_VIRTUAL != 0
            || rm::attr_location(attr) != rm::NVOS32_ATTR_LOCATION_VIDMEM
        {
            return None;
        }
        let ids: [u32; 2] = unsafe { user(params)? };
        let h_memory: u32 = unsafe { user(params + rm::VIDHEAP_H_MEMORY as u64)? };
        let bytes: u64 = unsafe { user(params + size_off as u64)? };
        return Some((ids[0], ids[1], h_memory, bytes));
    }
    None
}

#[inline(always)]
fn add_usage(cgroup_id: u64, gpu: u32, delta: u64) {
    let key = UsageKey {
        cgroup_id,
        gpu,
        _pad: 0,
    };
    let slot = match USAGE.get_ptr_mut(key) {
        Some(p) => p,
        None => {
            let _ = USAGE.insert(key, 0, BPF_NOEXIST as u64);
            match USAGE.get_ptr_mut(key) {
                Some(p) => p,
                None => return,
            }
        }
    };
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(slot, delta) };
}

/// Adds `delta` (two's complement for an uncharge) to every level of `anc`, per GPU and in total.
#[inline(always)]
fn charge(anc: &Ancestry, gpu: u32, delta: u64) {
    for i in 0..MAX_CGROUP_DEPTH {
        if i as u32 >= anc.depth {
            break;
        }
        let id = anc.ids[i];
        add_usage(id, gpu, delta);
        add_usage(id, GPU_ALL, delta);
    }
}

/// The first limit (from the root down) that usage plus `extra` exceeds (any limit at all with
/// `any`): the cgroup, the GPU key of the limit, and the usage it holds now. Bumps that limit's
/// event counter.
#[inline(always)]
pub(crate) fn over_limit(anc: &Ancestry, gpu: u32, extra: u64) -> Option<(u64, u32, u64)> {
    limit_met(anc, gpu, extra, false)
}

#[inline(always)]
fn limit_met(anc: &Ancestry, gpu: u32, extra: u64, any: bool) -> Option<(u64, u32, u64)> {
    let mut hit = None;
    each_limit(anc, gpu, |id, g, l| {
        let now = usage(id, g);
        if !any && now.saturating_add(extra) <= unsafe { (*l).max } {
            return false;
        }
        unsafe {
            let ev = core::ptr::addr_of_mut!((*l).events);
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(ev, 1);
        }
        hit = Some((id, g, now));
        true
    });
    hit
}

/// Object serials are the monotonic clock: unique per key (one object per key at a time) and
/// ordered against the events that release objects created before them.
#[inline(always)]
fn serial_now() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

/// Records an object made through the control file `file`. Every object carries its file, not
/// only its client: the driver frees everything made through a file when the file's last
/// reference goes, so an object is released by its own file even where its client's record is
/// gone or was never seen (the release rule, docs/design.md). A stale entry under the key (a free
/// missed while nothing was attached) is released first; the insert tells, so the common case
/// costs no lookup of its own.
#[inline(always)]
fn track_object(key: ObjKey, kind: u32, parent: u32, gpu: u32, bytes: u64, file: u64) -> bool {
    let entry = ObjEntry {
        kind,
        parent,
        gpu,
        tgid: current_tgid(),
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        bytes,
        file,
        serial: serial_now(),
    };
    let inserted = match OBJECTS.insert(key, entry, BPF_NOEXIST as u64) {
        Ok(()) => true,
        Err(e) if e == -EEXIST => {
            release(&key, 0);
            OBJECTS.insert(key, entry, 0).is_ok()
        }
        Err(_) => false,
    };
    if !inserted {
        bump_stat(stat::OBJECTS_FULL);
    }
    inserted
}

/// Removes `key` if it still holds the object `expect` (any, when 0) and uncharges its bytes;
/// the removal decides, so two racing releases uncharge once.
#[inline(always)]
pub(crate) fn release(key: &ObjKey, expect: u64) -> bool {
    let Some(e) = (unsafe { OBJECTS.get(key) }).copied() else {
        return false;
    };
    if expect != 0 && e.serial != expect {
        return false;
    }
    release_entry(key, &e)
}

/// [`release`] of an entry the caller has read as `e`.
#[inline(always)]
fn release_entry(key: &ObjKey, e: &ObjEntry) -> bool {
    if OBJECTS.remove(key).is_err() {
        return false;
    }
    if e.kind == OBJ_MEMORY && e.bytes != 0 {
        match unsafe { ANCESTRY.get(e.cgroup_id) } {
            Some(anc) => charge(anc, e.gpu, e.bytes.wrapping_neg()),
            None => {
                add_usage(e.cgroup_id, e.gpu, e.bytes.wrapping_neg());
                add_usage(e.cgroup_id, GPU_ALL, e.bytes.wrapping_neg());
            }
        }
        bump_stat(stat::UNCHARGES);
    }
    true
}

#[inline(always)]
pub(crate) fn account_alloc(p: &Pending) {
    let Some(args) = alloc_args(p.size, p.params) else {
        return;
    };
    if args.head.status != rm::status::NV_OK {
        return;
    }
    let head = &args.head;
    let key = ObjKey {
        client: head.h_root,
        object: head.h_object_new,
    };
    match head.h_class {
        c if rm::class::is_root(c) => {
            // The new client's handle is its own key.
            let key = ObjKey {
                client: head.h_object_new,
                object: head.h_object_new,
            };
            track_object(key, OBJ_CLIENT, head.h_object_new, GPU_UNKNOWN, 0, p.file);
        }
        rm::class::DEVICE => {
            let gpu = unsafe { user::<u32>(head.p_alloc_parms + rm::DEVICE_PARAMS_ID as u64) }
                .unwrap_or(GPU_UNKNOWN);
            track_object(key, OBJ_DEVICE, head.h_object_parent, gpu, 0, p.file);
        }
        rm::class::SUBDEVICE => {
            let gpu = gpu_of(head.h_root, head.h_object_parent);
            track_object(key, OBJ_SUBDEVICE, head.h_object_parent, gpu, 0, p.file);
        }
        rm::class::CHANNEL_GROUP => {
            let gpu = gpu_of(head.h_root, head.h_object_parent);
            track_object(key, OBJ_CHANNEL_GROUP, head.h_object_parent, gpu, 0, p.file);
        }
        c if rm::class::is_gpfifo_channel(c) => {
            // Its group's GPU (a group's entry carries its device's).
            let gpu = match unsafe {
                OBJECTS.get(ObjKey {
                    client: head.h_root,
                    object: head.h_object_parent,
                })
            } {
                Some(g) if g.kind == OBJ_CHANNEL_GROUP => g.gpu,
                _ => GPU_UNKNOWN,
            };
            track_object(key, OBJ_CHANNEL, head.h_object_parent, gpu, 0, p.file);
        }
        rm::class::MEMORY_LOCAL_USER => {
            if let Some((client, parent, handle, bytes)) = vidmem_alloc(&args) {
                charge_memory(client, parent, handle, bytes, p.file);
            }
        }
        _ => {}
    }
}

#[inline(always)]
pub(crate) fn account_vidheap(p: &Pending) {
    let Some(status) = (unsafe { user::<u32>(p.params + rm::VIDHEAP_STATUS as u64) }) else {
        return;
    };
    if status != rm::status::NV_OK {
        return;
    }
    let Some(function) = (unsafe { user::<u32>(p.params + rm::VIDHEAP_FUNCTION as u64) }) else {
        return;
    };
    if function == rm::NVOS32_FUNCTION_FREE {
        let (Some(ids), Some(h_memory)) = (unsafe {
            (
                user::<[u32; 2]>(p.params),
                user::<u32>(p.params + rm::VIDHEAP_H_MEMORY as u64),
            )
        }) else {
            return;
        };
        release(
            &ObjKey {
                client: ids[0],
                object: h_memory,
            },
            0,
        );
        return;
    }
    if let Some((client, parent, handle, bytes)) = vidmem_request(p.nr, p.size, p.params) {
        charge_memory(client, parent, handle, bytes, p.file);
    }
}

/// Charges a successful video-memory allocation made through the control file `file` and
/// applies the `react` tier.
#[inline(always)]
fn charge_memory(client: u32, parent: u32, handle: u32, bytes: u64, file: u64) {
    let Some((_, anc)) = current_ancestry() else {
        return;
    };
    let gpu = gpu_of(client, parent);
    if gpu == GPU_UNKNOWN {
        bump_stat(stat::UNKNOWN_GPU);
    }
    let key = ObjKey {
        client,
        object: handle,
    };
    charge(anc, gpu, bytes);
    let tracked = track_object(key, OBJ_MEMORY, parent, gpu, bytes, file);
    let met = if tracked {
        bump_stat(stat::CHARGES);
        over_limit(anc, gpu, 0)
    } else {
        // The map is full: no free of this memory could ever be seen, so it cannot stay
        // charged. Under a limit that fails closed: it counts as crossing it.
        charge(anc, gpu, bytes.wrapping_neg());
        limit_met(anc, gpu, 0, true)
    };
    if let Some((cg, g, now)) = met {
        bump_stat(stat::CROSSED);
        if let Some(cfg) = config()
            && cfg.react_action == REACT_KILL
        {
            let _ = unsafe { bpf_send_signal(SIGKILL) };
        }
        send(&Event {
            kind: EVENT_LIMIT_CROSSED,
            tgid: current_tgid(),
            cgroup_id: cg,
            client,
            object: handle,
            value: now,
            bytes,
            gpu: g,
            _pad: 0,
        });
    }
}

#[inline(always)]
pub(crate) fn account_free(p: &Pending) {
    let Some(args) = (unsafe { user::<rm::Nvos00>(p.params) }) else {
        return;
    };
    if args.status != rm::status::NV_OK {
        return;
    }
    let key = ObjKey {
        client: args.h_root,
        object: args.h_object_old,
    };
    // Memory is released here; anything else may have objects below it, which the daemon
    // releases on the event.
    match (unsafe { OBJECTS.get(key) }).copied() {
        Some(e) if e.kind == OBJ_MEMORY => {
            release_entry(&key, &e);
            return;
        }
        Some(_) => {}
        // A client is keyed by its own handle; other unknown handles own nothing we charged.
        None if args.h_object_old == args.h_root => {}
        None => return,
    }
    send(&Event {
        kind: EVENT_FREE_TREE,
        tgid: current_tgid(),
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        client: args.h_root,
        object: args.h_object_old,
        value: serial_now(),
        ..Event::default()
    });
}

/// Announces the release of a control file's last reference (its clients go with it).
#[inline(always)]
pub(crate) fn file_released(file: u64) {
    send(&Event {
        kind: EVENT_FILE_RELEASE,
        tgid: current_tgid(),
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        value: file,
        bytes: serial_now(),
        ..Event::default()
    });
}

/// Most descriptors a dying process's table is searched for control files (tracepoint mode);
/// the search stops at the table's size (the verifier accepts 512 iterations on 6.1 and 6.18).
const EXIT_FD_SCAN: u64 = 512;

/// At the exit of a tracked process (tracepoint mode): its control files whose only reference is
/// its own descriptor are released with it (the table is closed right after this tracepoint).
#[inline(always)]
pub(crate) fn release_files_at_exit(cfg: &ProbeConfig) {
    let r = ProbeRead(&cfg.offsets);
    let o = &cfg.offsets;
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let Some(files) = (unsafe { read_at::<*const u8>(task, o.task_files) }) else {
        return;
    };
    if files.is_null() {
        return;
    }
    let Some(fdt) = (unsafe { read_at::<*const u8>(files, o.files_fdt) }) else {
        return;
    };
    let (Some(max_fds), Some(fd_array)) = (unsafe {
        (
            read_at::<u32>(fdt, o.fdt_max_fds),
            read_at::<*const u8>(fdt, o.fdt_fd),
        )
    }) else {
        return;
    };
    for fd in 0..EXIT_FD_SCAN {
        if fd >= max_fds as u64 {
            break;
        }
        let Ok(file) =
            (unsafe { bpf_probe_read_kernel(fd_array.add(fd as usize * 8).cast::<*const u8>()) })
        else {
            continue;
        };
        if file.is_null() {
            continue;
        }
        if let Some(DeviceKind::Control) = unsafe { device_kind(&r, file) }
            && unsafe { sole_reference(&r, file, cfg.offsets.file_one_ref) }
        {
            file_released(file as u64);
        }
    }
}
