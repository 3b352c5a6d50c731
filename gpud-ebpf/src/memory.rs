//! GPU-memory accounting and the limits' kernel-side tiers.
//!
//! At an RM call's entry ([`crate::rm`]) the keys and sizes are read once ([`note_entry`]) and
//! the `deny` tier refuses an allocation that would take a cgroup over a limit
//! ([`limit_met`]). At its return the driver has written back `status`, a handle it picked and
//! the allocated size, so calls are charged or uncharged ([`account_alloc`], [`account_free`],
//! [`account_dup`]) by what the entry side read, never less. A duplicate of memory is a
//! reference to its allocation's charge (`SHARES`): the bytes go with the last handle, as the
//! driver frees the pages. Subtree, client and file releases are announced to the daemon, which
//! walks `OBJECTS` and releases each object through `gpud_release`.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_cgroup_id, bpf_ktime_get_ns, bpf_send_signal},
};
use gpud_common::{
    Ancestry, CgroupUsage, DeviceKind, EVENT_DEVICE_READ_BACK, EVENT_FILE_RELEASE,
    EVENT_FREE_READ_BACK, EVENT_FREE_TREE, EVENT_LIMIT_CROSSED, EVENT_MEM_READ_BACK, Event,
    GPU_UNKNOWN, MAX_CGROUP_DEPTH, OBJ_CHANNEL, OBJ_CHANNEL_GROUP, OBJ_CLIENT, OBJ_DEVICE,
    OBJ_MAY_SHARE, OBJ_MEMORY, OBJ_SUBDEVICE, OP_ALLOC, OP_DUP, OP_FREE, ObjEntry, ObjKey, Pending,
    ProbeConfig, REACT_KILL, nv, rm, stat,
};

use crate::{
    kernel::{ProbeRead, current_tgid, device_kind, fd_table, file_at, sole_reference},
    ledger::{
        charge_slot, current_ancestry, each_limit, gpu_of, learn_levels_if_stale,
        levels_without_limits, limited_on, parent_of, usage, user,
    },
    maps::{
        ANCESTRY, FILE_MARKS, OBJECTS, SHARES, USAGE, WALK_COUNT, ZERO_USAGE, bump_stat, config,
        entry_or_insert, send,
    },
};

const SIGKILL: u32 = 9;
const EEXIST: i32 = 17;
/// A status no driver writes: the call returned an error or its struct could not be read.
const NO_ANSWER: u32 = u32::MAX;

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

/// Notes what the accounting needs of an RM call before the driver runs (`Pending`'s entry
/// fields): the keys and sizes of allocations, frees and duplicates are taken from the caller's
/// struct here, once. A duplicate of charged memory takes its reference to the charge here too,
/// before the driver can free the source.
#[inline(always)]
pub(crate) fn note_entry(p: &mut Pending) {
    match p.nr {
        nv::NV_ESC_RM_ALLOC => {
            let Some(a) = alloc_args(p.size, p.params) else {
                return;
            };
            let h = &a.head;
            (p.op, p.client, p.parent, p.handle, p.class) = (
                OP_ALLOC,
                h.h_root,
                h.h_object_parent,
                h.h_object_new,
                h.h_class,
            );
            if h.h_class == rm::class::MEMORY_LOCAL_USER {
                if a.flags & rm::NVOS64_FLAGS_FINN_SERIALIZED != 0 {
                    return;
                }
                p.size_at = h.p_alloc_parms + rm::MEM_PARAMS_SIZE as u64;
                p.arg = unsafe { user::<u64>(p.size_at) }.unwrap_or(0);
            } else if h.h_class == rm::class::DEVICE {
                p.arg = unsafe { user::<u32>(h.p_alloc_parms + rm::DEVICE_PARAMS_ID as u64) }
                    .map_or(GPU_UNKNOWN as u64, u64::from);
            }
        }
        nv::NV_ESC_RM_FREE => {
            if let Some(f) = unsafe { user::<rm::Nvos00>(p.params) } {
                (p.op, p.client, p.handle) = (OP_FREE, f.h_root, f.h_object_old);
            }
        }
        nv::NV_ESC_RM_VID_HEAP_CONTROL => note_vidheap(p),
        nv::NV_ESC_RM_DUP_OBJECT => {
            let Some(d) = (unsafe { user::<rm::Nvos55>(p.params) }) else {
                return;
            };
            (p.op, p.client, p.parent, p.handle) = (OP_DUP, d.h_client, d.h_parent, d.h_object);
            let src = ObjKey {
                client: d.h_client_src,
                object: d.h_object_src,
            };
            if let Some(e) = OBJECTS.get_ptr_mut(src)
                && unsafe { (*e).kind } == OBJ_MEMORY
                && unsafe { (*e).bytes } != 0
            {
                p.src = unsafe { *e };
                // The source's free looks its charge's holders up from now on: marked before
                // the reference is taken, both before the driver can free the source.
                unsafe {
                    let flags = core::ptr::addr_of_mut!((*e).flags);
                    core::ptr::write_volatile(
                        flags,
                        core::ptr::read_volatile(flags) | OBJ_MAY_SHARE,
                    );
                }
                if share(p.src.charge) {
                    // The reference this call holds is given back through this copy.
                    p.src.flags |= OBJ_MAY_SHARE;
                } else {
                    p.src.charge = 0;
                }
            }
        }
        _ => {}
    }
}

/// [`note_entry`] of `NV_ESC_RM_VID_HEAP_CONTROL`: a free, or an allocation (of video memory
/// when its flags and attributes say so, as the driver decides the class).
#[inline(always)]
fn note_vidheap(p: &mut Pending) {
    let at = |off: usize| p.params + off as u64;
    let (Some(ids), Some(function)) = (unsafe {
        (
            user::<[u32; 2]>(p.params),
            user::<u32>(at(rm::VIDHEAP_FUNCTION)),
        )
    }) else {
        return;
    };
    (p.client, p.parent) = (ids[0], ids[1]);
    if function == rm::NVOS32_FUNCTION_FREE {
        if let Some(h) = unsafe { user::<u32>(at(rm::VIDHEAP_H_MEMORY)) } {
            (p.op, p.handle) = (OP_FREE, h);
        }
        return;
    }
    let Some((attr_off, size_off)) = rm::vidheap_alloc_fields(function) else {
        return;
    };
    let (Some(flags), Some(attr)) = (unsafe {
        (
            user::<u32>(at(rm::VIDHEAP_FLAGS)),
            user::<u32>(at(attr_off)),
        )
    }) else {
        return;
    };
    p.op = OP_ALLOC;
    if flags & rm::NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED != 0 {
        p.handle = unsafe { user::<u32>(at(rm::VIDHEAP_H_MEMORY)) }.unwrap_or(0);
    }
    if flags & rm::NVOS32_ALLOC_FLAGS_VIRTUAL != 0
        || rm::attr_location(attr) != rm::NVOS32_ATTR_LOCATION_VIDMEM
    {
        return;
    }
    p.class = rm::class::MEMORY_LOCAL_USER;
    p.size_at = at(size_off);
    p.arg = unsafe { user::<u64>(p.size_at) }.unwrap_or(0);
}

/// `cgroup_id`'s `USAGE` record, made where absent; `None` when the map has no room for it.
#[inline(always)]
fn usage_record(cgroup_id: u64) -> Option<*mut CgroupUsage> {
    if let Some(rec) = USAGE.get_ptr_mut(cgroup_id) {
        return Some(rec);
    }
    // A first charge or count inserts the record from the map's zeros, not from the stack (the
    // zeros looked up only then).
    ZERO_USAGE
        .get(0)
        .and_then(|zero| entry_or_insert(&USAGE, cgroup_id, zero))
}

/// What a charge walk does to the object count (`CgroupUsage::objects`) of one cgroup it
/// passes: the count of an object recorded or released with the charge is kept in the record
/// the walk has just looked up, not in a lookup of its own (docs/benchmarks.md).
#[derive(Clone, Copy)]
enum ObjCount {
    /// Leave every count as it is.
    Keep,
    /// Count one more object for this cgroup, unless it holds `cap` already (0: no cap).
    Add(u64, u32),
    /// Count one object less for this cgroup.
    Sub(u64),
}

/// What a charge walk did to the count it was given ([`ObjCount`]).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Counted {
    /// Not taken: the walk passed no record of that cgroup (none, or no room for one).
    No,
    /// Counted.
    Yes,
    /// The cgroup holds its cap of objects: not counted.
    Capped,
}

/// Adds `delta` to `cgroup_id`'s usage on GPU key `gpu` and in total, and applies `count` where
/// it names this cgroup: one lookup for all three. What the count came to is left in
/// `WALK_COUNT` ([`walk_end`]).
#[inline(always)]
fn add_usage(cgroup_id: u64, gpu: u32, delta: u64, count: ObjCount) {
    let Some(rec) = usage_record(cgroup_id) else {
        return;
    };
    unsafe {
        let bytes = core::ptr::addr_of_mut!((*rec).bytes).cast::<u64>();
        let slot = charge_slot(gpu);
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(bytes.add(slot), delta);
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(bytes.add(CgroupUsage::ALL), delta);
    }
    let counted = match count {
        ObjCount::Add(id, cap) if id == cgroup_id => add_object(rec, cap),
        ObjCount::Sub(id) if id == cgroup_id => {
            sub_object(rec);
            Counted::Yes
        }
        _ => return,
    };
    if let Some(out) = WALK_COUNT.get_ptr_mut(0) {
        unsafe { core::ptr::write_volatile(out, counted as u32) };
    }
}

/// Adds `delta` (two's complement for an uncharge) to every level of `anc`, on `gpu` and in
/// total, applying `count` at the level it names.
#[inline(always)]
fn charge(anc: &Ancestry, gpu: u32, delta: u64, count: ObjCount) -> Counted {
    walk_begin(count);
    for i in 0..MAX_CGROUP_DEPTH {
        if i as u32 >= anc.depth {
            break;
        }
        add_usage(anc.ids[i], gpu, delta, count);
    }
    walk_end(count)
}

/// Clears what the last walk counted ([`add_usage`]), where this one counts.
#[inline(always)]
fn walk_begin(count: ObjCount) {
    if matches!(count, ObjCount::Keep) {
        return;
    }
    if let Some(out) = WALK_COUNT.get_ptr_mut(0) {
        unsafe { core::ptr::write_volatile(out, Counted::No as u32) };
    }
}

/// What the walk since [`walk_begin`] did to `count`. Carried in a per-CPU slot rather than a
/// value of the walk's loop: the verifier would explore the rest of the program once per value
/// such a variable could hold, which took the return programs past its limit.
#[inline(always)]
fn walk_end(count: ObjCount) -> Counted {
    if matches!(count, ObjCount::Keep) {
        return Counted::No;
    }
    match WALK_COUNT
        .get_ptr(0)
        .map(|p| unsafe { core::ptr::read_volatile(p) })
    {
        Some(v) if v == Counted::Yes as u32 => Counted::Yes,
        Some(v) if v == Counted::Capped as u32 => Counted::Capped,
        _ => Counted::No,
    }
}

/// The first limit (from the root down) that usage plus `extra` exceeds (any limit at all with
/// `any`): the cgroup, the GPU key of the limit, and the usage it holds now. Bumps that limit's
/// event counter.
#[inline(always)]
pub(crate) fn limit_met(
    anc: &Ancestry,
    gpu: u32,
    extra: u64,
    any: bool,
) -> Option<(u64, u32, u64)> {
    first_limit(anc, gpu, extra, any, &mut false, 0)
}

/// [`limit_met`], noting in `limited` whether any limit applies at all (one walk for both), and
/// not looking up the levels in `skip` ([`each_limit`]).
#[inline(always)]
fn first_limit(
    anc: &Ancestry,
    gpu: u32,
    extra: u64,
    any: bool,
    limited: &mut bool,
    skip: u32,
) -> Option<(u64, u32, u64)> {
    let mut hit = None;
    each_limit(anc, gpu, skip, |id, g, l| {
        *limited = true;
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

/// Whether any limit applies to `gpu` over `anc` (nothing counted), not looking up the levels
/// in `skip` ([`each_limit`]).
#[inline(always)]
fn limited(anc: &Ancestry, gpu: u32, skip: u32) -> bool {
    let mut any = false;
    each_limit(anc, gpu, skip, |_, _, _| {
        any = true;
        true
    });
    any
}

/// Object serials are the monotonic clock: unique per key (one object per key at a time) and
/// ordered against the events that release objects created before them.
#[inline(always)]
fn serial_now() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

/// Takes one more reference to `charge` (a duplicate on its way). False when `SHARES` is full.
#[inline(always)]
fn share(charge: u64) -> bool {
    if let Some(n) = SHARES.get_ptr_mut(charge) {
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, 1) };
        return true;
    }
    match SHARES.insert(charge, 1, BPF_NOEXIST as u64) {
        Ok(()) => true,
        // Another duplicate of the same memory inserted first.
        Err(e) if e == -EEXIST => match SHARES.get_ptr_mut(charge) {
            Some(n) => {
                unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, 1) };
                true
            }
            None => false,
        },
        Err(_) => false,
    }
}

/// Drops one reference to `charge`: true when it was the last, whose holder uncharges the
/// bytes. The count goes below zero with the last reference, and the delete decides who saw
/// that: of racing releases exactly one uncharges. (No fetching atomics: the object is built
/// for the first eBPF instruction set, which has none.)
#[inline(always)]
fn unshare(charge: u64) -> bool {
    let Some(n) = SHARES.get_ptr_mut(charge) else {
        return true;
    };
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, u64::MAX) };
    if unsafe { core::ptr::read_volatile(n) } != u64::MAX {
        return false;
    }
    SHARES.remove(charge).is_ok()
}

/// An object to record in `OBJECTS`.
struct Track {
    key: ObjKey,
    kind: u32,
    parent: u32,
    gpu: u32,
    bytes: u64,
    file: u64,
    /// The charge a duplicate holds; 0 makes a memory object its own charge.
    charge: u64,
    /// The cgroup charged (a duplicate's source's); 0: the caller's.
    cgroup_id: u64,
    /// The key came from the entry side (the caller chose the handle and the driver accepted
    /// it, so whatever is recorded under it is stale): replace what is there. A handle RM
    /// picked is read back after the driver ran, where another thread may have rewritten it:
    /// it never replaces an entry.
    replace: bool,
    /// `file` was marked already ([`mark_file`]): the object's parent was recorded through it.
    marked: bool,
    /// The object is counted for its cgroup already (by the charge walk of its bytes).
    counted: bool,
}

/// Records an object made through the control file `file`. Every object carries its file, not
/// only its client: the driver frees everything made through a file when the file's last
/// reference goes, so an object is released by its own file even where its client's record is
/// gone or was never seen (the release rule, docs/design.md). A stale entry under a key the
/// entry side read (a free missed while nothing was attached) is released first; the insert
/// tells, so the common case costs no lookup of its own. The serial it was recorded under, or
/// `None` where the map (or the cgroup's cap) left no room.
#[inline(always)]
fn track_object(t: &Track) -> Option<u64> {
    let serial = serial_now();
    let (charge, flags) = match (t.kind, t.charge) {
        (OBJ_MEMORY, 0) => (serial, 0),
        // A duplicate holds a charge with another holder.
        (OBJ_MEMORY, c) => (c, OBJ_MAY_SHARE),
        (_, c) => (c, 0),
    };
    let entry = ObjEntry {
        kind: t.kind,
        parent: t.parent,
        gpu: t.gpu,
        tgid: current_tgid(),
        cgroup_id: match t.cgroup_id {
            0 => unsafe { bpf_get_current_cgroup_id() },
            id => id,
        },
        bytes: t.bytes,
        file: t.file,
        serial,
        charge,
        flags,
        _pad: 0,
    };
    if !t.counted && !count_object(entry.cgroup_id) {
        return None;
    }
    let inserted = match OBJECTS.insert(t.key, entry, BPF_NOEXIST as u64) {
        Ok(()) => true,
        Err(e) if e == -EEXIST && t.replace => {
            release(&t.key, 0);
            OBJECTS.insert(t.key, entry, 0).is_ok()
        }
        Err(_) => false,
    };
    if inserted {
        if !t.marked {
            mark_file(t.file);
        }
        Some(serial)
    } else {
        uncount_object(entry.cgroup_id);
        bump_stat(stat::OBJECTS_FULL);
        None
    }
}

/// Marks `file` as one through which an object was recorded, so its release is sent.
#[inline(always)]
fn mark_file(file: u64) {
    if unsafe { FILE_MARKS.get(file) }.is_none() && FILE_MARKS.insert(file, 1, 0).is_err() {
        // Its release goes unsent: the daemon's sweep finds the file gone.
        bump_stat(stat::FILE_MARKS_FULL);
    }
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
    release_entry(key, &e, None)
}

/// [`release`] of an entry the caller has read as `e`. Memory is uncharged with the last
/// reference to its charge (the allocation or a duplicate, whichever goes last); `known` is an
/// ancestry looked up already (see [`charge_recorded`]).
#[inline(always)]
fn release_entry(key: &ObjKey, e: &ObjEntry, known: Known) -> bool {
    if OBJECTS.remove(key).is_err() {
        return false;
    }
    if !drop_reference(e, known, ObjCount::Sub(e.cgroup_id)) {
        uncount_object(e.cgroup_id);
    }
    true
}

/// Counts one more `OBJECTS` entry for `cgroup_id` (in its `USAGE` record, which an
/// allocation's charge has just looked up), unless it holds its cap
/// (`ProbeConfig::objects_per_cgroup`) already: false then, counted. Without fetching atomics
/// the check and the add are two steps, so inserts racing on several CPUs may pass the cap by as
/// many. A cgroup `USAGE` has no room for is not capped (counted apart).
#[inline(always)]
fn count_object(cgroup_id: u64) -> bool {
    count_object_up_to(cgroup_id, config().map_or(0, |c| c.objects_per_cgroup))
}

/// [`count_object`] against `cap` (0: none).
#[inline(always)]
fn count_object_up_to(cgroup_id: u64, cap: u32) -> bool {
    let Some(rec) = usage_record(cgroup_id) else {
        bump_stat(stat::OBJ_COUNTS_FULL);
        return true;
    };
    add_object(rec, cap) != Counted::Capped
}

/// Counts one more object in `rec` unless it holds `cap` (0: none) already.
#[inline(always)]
fn add_object(rec: *mut CgroupUsage, cap: u32) -> Counted {
    let n = unsafe { core::ptr::addr_of_mut!((*rec).objects) };
    // Read as signed: releases racing past zero (entries recorded before the count began)
    // must not make a full cgroup of an empty one.
    let held = unsafe { core::ptr::read_volatile(n) } as i64;
    if cap != 0 && held >= i64::from(cap) {
        bump_stat(stat::OBJECTS_CGROUP_CAP);
        return Counted::Capped;
    }
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, 1) };
    Counted::Yes
}

/// Counts one `OBJECTS` entry of `cgroup_id` less (none below zero, as far as a read shows).
#[inline(always)]
fn uncount_object(cgroup_id: u64) {
    if let Some(rec) = USAGE.get_ptr_mut(cgroup_id) {
        sub_object(rec);
    }
}

/// Counts one object less in `rec` (none below zero, as far as a read shows).
#[inline(always)]
fn sub_object(rec: *mut CgroupUsage) {
    let n = unsafe { core::ptr::addr_of_mut!((*rec).objects) };
    if unsafe { core::ptr::read_volatile(n) } as i64 > 0 {
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, u64::MAX) };
    }
}

/// Gives back one reference to the charge memory entry `e` holds (its own, or a duplicate's
/// source's as noted at the entry), uncharging the bytes with the last; `e.charge` 0 holds none.
/// An entry without [`OBJ_MAY_SHARE`] is its charge's only holder. True where that uncharge
/// applied `count` (see [`add_usage`]).
#[inline(always)]
fn drop_reference(e: &ObjEntry, known: Known, count: ObjCount) -> bool {
    if e.kind == OBJ_MEMORY
        && e.bytes != 0
        && e.charge != 0
        && (e.flags & OBJ_MAY_SHARE == 0 || unshare(e.charge))
    {
        return uncharge(e.cgroup_id, e.gpu, e.bytes, known, count) == Counted::Yes;
    }
    false
}

/// Whether `OBJECTS` records something under `client:handle`.
#[inline(always)]
fn recorded(client: u32, handle: u32) -> bool {
    unsafe {
        OBJECTS.get(ObjKey {
            client,
            object: handle,
        })
    }
    .is_some()
}

/// Takes `bytes` off `cgroup_id` and its ancestors (itself only when its ancestry is gone),
/// applying `count` on the way.
#[inline(always)]
fn uncharge(cgroup_id: u64, gpu: u32, bytes: u64, known: Known, count: ObjCount) -> Counted {
    bump_stat(stat::UNCHARGES);
    charge_recorded(cgroup_id, gpu, bytes.wrapping_neg(), known, count)
}

/// A cgroup and its `ANCESTRY` record, looked up already by the caller (a free's: its own
/// cgroup's, which is most often the freed memory's too): one lookup fewer on that path.
type Known = Option<(u64, &'static Ancestry)>;

/// Adds `delta` to `cgroup_id` and the ancestors `ANCESTRY` records for it (itself only where
/// none are), applying `count` on the way; `known` saves the lookup when it is `cgroup_id`'s.
#[inline(always)]
fn charge_recorded(cgroup_id: u64, gpu: u32, delta: u64, known: Known, count: ObjCount) -> Counted {
    let anc = match known {
        Some((id, anc)) if id == cgroup_id => Some(anc),
        _ => unsafe { ANCESTRY.get(cgroup_id) },
    };
    match anc {
        Some(anc) => charge(anc, gpu, delta, count),
        None => {
            walk_begin(count);
            add_usage(cgroup_id, gpu, delta, count);
            walk_end(count)
        }
    }
}

/// Records `e`, an object of the maps taken over at an upgrade, under `key` unless an object is
/// there already (the new programs saw it made): counted for its cgroup, its file marked, and
/// memory charged to its cgroup's recorded ancestry when `first` (no holder of its charge is
/// recorded yet) or else shared, and marked [`OBJ_MAY_SHARE`]. 0: adopted; 1: the key holds an
/// object; 2: no room.
#[inline(always)]
pub(crate) fn adopt(key: &ObjKey, e: &ObjEntry, first: bool) -> i32 {
    // Other holders of adopted memory's charge may be adopted after it.
    let e = &ObjEntry {
        flags: if e.kind == OBJ_MEMORY {
            OBJ_MAY_SHARE
        } else {
            e.flags
        },
        ..*e
    };
    match OBJECTS.insert(key, e, BPF_NOEXIST as u64) {
        Ok(()) => {}
        Err(err) if err == -EEXIST => return 1,
        Err(_) => {
            bump_stat(stat::OBJECTS_FULL);
            return 2;
        }
    }
    // Past the cap too: the object exists.
    count_object_up_to(e.cgroup_id, 0);
    mark_file(e.file);
    if e.kind == OBJ_MEMORY && e.bytes != 0 && e.charge != 0 {
        if first {
            charge_recorded(e.cgroup_id, e.gpu, e.bytes, None, ObjCount::Keep);
        } else {
            // SHARES full: the charge goes with whichever holder is freed first, as for a
            // duplicate the kernel could not count.
            let _ = share(e.charge);
        }
    }
    bump_stat(stat::ADOPTED);
    0
}

/// The status and the handle the driver wrote back into an allocation's struct.
#[inline(always)]
fn answer(p: &Pending) -> Option<(u32, u32)> {
    if p.nr == nv::NV_ESC_RM_ALLOC {
        let a = alloc_args(p.size, p.params)?;
        return Some((a.head.status, a.head.h_object_new));
    }
    let st: u32 = unsafe { user(p.params + rm::VIDHEAP_STATUS as u64)? };
    let h: u32 = unsafe { user(p.params + rm::VIDHEAP_H_MEMORY as u64)? };
    Some((st, h))
}

/// Return side of an allocation (`RM_ALLOC`, a VID_HEAP_CONTROL allocation): records the new
/// object under the keys the entry side read, and charges video memory.
#[inline(always)]
pub(crate) fn account_alloc(p: &Pending) {
    let Some((status, back)) = answer(p) else {
        return;
    };
    let (replace, handle) = match p.handle {
        0 => (false, back),
        h => (true, h),
    };
    if p.class == rm::class::MEMORY_LOCAL_USER {
        let ok = status == rm::status::NV_OK;
        charge_memory(p, handle, replace, ok);
        return;
    }
    if status != rm::status::NV_OK {
        return;
    }
    let mut t = Track {
        key: ObjKey {
            client: p.client,
            object: handle,
        },
        kind: 0,
        parent: p.parent,
        gpu: GPU_UNKNOWN,
        bytes: 0,
        file: p.file,
        charge: 0,
        cgroup_id: 0,
        replace,
        marked: false,
        counted: false,
    };
    match p.class {
        c if rm::class::is_root(c) => {
            // The new client's handle is its own key.
            t.key.client = handle;
            (t.kind, t.parent) = (OBJ_CLIENT, handle);
        }
        rm::class::DEVICE => (t.kind, t.gpu) = (OBJ_DEVICE, p.arg as u32),
        rm::class::SUBDEVICE => (t.kind, t.gpu) = (OBJ_SUBDEVICE, gpu_of(p.client, p.parent)),
        rm::class::CHANNEL_GROUP => {
            (t.kind, t.gpu) = (OBJ_CHANNEL_GROUP, gpu_of(p.client, p.parent));
        }
        c if rm::class::is_gpfifo_channel(c) => {
            // Its group's GPU (a group's entry carries its device's).
            t.kind = OBJ_CHANNEL;
            if let Some(g) = unsafe {
                OBJECTS.get(ObjKey {
                    client: p.client,
                    object: p.parent,
                })
            } && g.kind == OBJ_CHANNEL_GROUP
            {
                t.gpu = g.gpu;
            }
        }
        _ => return,
    }
    // Recorded first: the daemon prunes watched groups that `OBJECTS` does not hold, and
    // reads back only devices recorded under the serial it is sent.
    match track_object(&t) {
        Some(_) if t.kind == OBJ_CHANNEL_GROUP => crate::guard::watch_group(p.file, t.key),
        Some(_) if t.kind == OBJ_SUBDEVICE => crate::guard::watch_file(p.file),
        Some(serial) if t.kind == OBJ_DEVICE => ask_device(t.key, serial, t.gpu),
        _ => {}
    }
}

/// Asks the daemon which GPU the driver made the device recorded at `key` under `serial` on
/// (`EVENT_DEVICE_READ_BACK`), where its caller is under a limit on some GPU by itself: the
/// entry side read `deviceId` before the driver copied it, and another thread may have changed
/// it in between, so that what is allocated under the device is charged to a GPU the caller's
/// limit does not name (an `all` limit names every GPU: nothing to ask). A request the ring
/// cannot take fails closed: it counts as crossing the caller's limit on unnamed GPUs
/// ([`UNNAMED_GPU_MAX`](gpud_common::UNNAMED_GPU_MAX)).
#[inline(always)]
fn ask_device(key: ObjKey, serial: u64, gpu: u32) {
    let Some((leaf, anc)) = current_ancestry() else {
        return;
    };
    // A limit on some GPU by itself comes with a `GPU_UNKNOWN` entry (`UNNAMED_GPU_MAX`).
    if !limited_on(anc, GPU_UNKNOWN) {
        return;
    }
    let asked = ask(
        EVENT_DEVICE_READ_BACK,
        stat::DEVICE_READ_BACKS,
        key,
        serial,
        0,
        gpu,
        leaf,
    );
    fail_closed_unless(asked, anc, key);
}

/// Charges a video-memory allocation made through the control file `p.file` and applies the
/// `react` tier: the bytes the entry side saw asked for, or the size the driver wrote back if
/// larger (it rounds up). `confirmed` false: the status read back says the driver failed it;
/// under a limit the charge is made all the same (another thread of the caller may have
/// written that status), unlimited cgroups are not charged.
#[inline(always)]
fn charge_memory(p: &Pending, handle: u32, replace: bool, confirmed: bool) {
    let Some((leaf, anc)) = current_ancestry() else {
        return;
    };
    learn_levels_if_stale(anc);
    let (gpu, parent_file) = parent_of(p.client, p.parent);
    let key = ObjKey {
        client: p.client,
        object: handle,
    };
    // Unconfirmed, a handle already recorded is the driver refusing a duplicate name (a live
    // object keeps its entry and its charge): nothing was made.
    if !confirmed && (handle == 0 || !limited(anc, gpu, 0) || recorded(p.client, handle)) {
        return;
    }
    let back = match p.size_at {
        0 => 0,
        at => unsafe { user::<u64>(at) }.unwrap_or(0),
    };
    let bytes = if back > p.arg { back } else { p.arg };
    if p.arg == 0 {
        // Unsized at the entry (FINN-serialized or unreadable): nothing to charge, and under a
        // limit that fails closed.
        bump_stat(stat::UNREADABLE);
        if let Some(hit) = limit_met(anc, gpu, 0, true) {
            crossed(p.client, handle, 0, hit);
        }
        return;
    }
    if gpu == GPU_UNKNOWN {
        bump_stat(stat::UNKNOWN_GPU);
    }
    if !confirmed {
        bump_stat(stat::UNCONFIRMED);
    }
    // The object is counted for its cgroup in the same walk, in the record it has just updated.
    let cap = config().map_or(0, |c| c.objects_per_cgroup);
    let counted = charge(anc, gpu, bytes, ObjCount::Add(leaf, cap));
    let track = Track {
        key,
        kind: OBJ_MEMORY,
        parent: p.parent,
        gpu,
        bytes,
        file: p.file,
        charge: 0,
        // The caller's, read already (a helper call fewer).
        cgroup_id: leaf,
        // Only a call the driver confirmed proves the handle was free.
        replace: replace && confirmed,
        // The parent's record marked the file when it was made through it: the mark stays
        // until that file's release, which also releases the parent. (A parent recorded through
        // an earlier file at the same address, not yet released by the daemon, leaves the file
        // unmarked: its release goes unsent and the sweep finds it, as where `FILE_MARKS` is
        // full.)
        marked: parent_file == p.file,
        counted: counted == Counted::Yes,
    };
    // Not `bool::then` with a closure: the closure would be a function of its own, a third
    // frame whose stack Linux 6.1's verifier adds to the two above it.
    let tracked = if counted == Counted::Capped {
        None
    } else {
        track_object(&track)
    };
    let (met, under_a_limit) = if tracked.is_some() {
        bump_stat(stat::CHARGES);
        let mut any = false;
        let skip = levels_without_limits(anc);
        (first_limit(anc, gpu, 0, false, &mut any, skip), any)
    } else {
        // The map is full: no free of this memory could ever be seen, so it cannot stay
        // charged. Under a limit that fails closed: it counts as crossing it.
        charge(anc, gpu, bytes.wrapping_neg(), ObjCount::Keep);
        (limit_met(anc, gpu, 0, true), false)
    };
    if let Some(hit) = met {
        crossed(p.client, handle, bytes, hit);
    } else if under_a_limit
        && let Some(serial) = tracked
        && !ask_size(key, serial, bytes, gpu, leaf)
        && let Some(hit) = limit_met(anc, gpu, 0, true)
    {
        // The driver's size cannot be asked: under a limit that fails closed.
        crossed(p.client, handle, bytes, hit);
    }
}

/// Asks the daemon to read back what the driver holds for the memory object recorded at `key`
/// under `serial`, made by a caller in limited cgroup `cgroup_id` and charged `bytes` on `gpu`
/// (`EVENT_MEM_READ_BACK`): the entry side read the caller's struct before the driver copied
/// it, and another thread may have changed it in between (the size, a wrapped call's params, a
/// duplicate's source). False when the request cannot be sent (the ring full).
#[inline(always)]
fn ask_size(key: ObjKey, serial: u64, bytes: u64, gpu: u32, cgroup_id: u64) -> bool {
    ask(
        EVENT_MEM_READ_BACK,
        stat::MEMORY_READ_BACKS,
        key,
        serial,
        bytes,
        gpu,
        cgroup_id,
    )
}

/// Sends the daemon a request of `kind` (one of the `EVENT_*_READ_BACK`) to read the object at
/// `key` back from the driver, from the caller in `cgroup_id`, counted in `counter`. False when
/// the ring cannot take it.
#[inline(always)]
fn ask(
    kind: u32,
    counter: u32,
    key: ObjKey,
    value: u64,
    bytes: u64,
    gpu: u32,
    cgroup_id: u64,
) -> bool {
    bump_stat(counter);
    send(&Event {
        kind,
        tgid: current_tgid(),
        cgroup_id,
        client: key.client,
        object: key.object,
        value,
        bytes,
        gpu,
        _pad: 0,
    })
}

/// A read-back of the object at `key` that could not be `asked` fails closed: it counts as
/// crossing the caller's first limit of any kind (the `unknown` key holds the entry beside
/// per-GPU limits, and `all` is walked with it).
#[inline(always)]
fn fail_closed_unless(asked: bool, anc: &Ancestry, key: ObjKey) {
    if !asked && let Some(hit) = limit_met(anc, GPU_UNKNOWN, 0, true) {
        crossed(key.client, key.object, 0, hit);
    }
}

/// A limit crossed by the caller (`hit`: the cgroup, GPU key and usage of [`limit_met`]):
/// counted, the `react` tier's kill, and the event.
#[inline(always)]
fn crossed(client: u32, handle: u32, bytes: u64, hit: (u64, u32, u64)) {
    let (cg, g, now) = hit;
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

/// Return side of a duplicate (`RM_DUP_OBJECT`, whatever the call returned): one of charged
/// memory becomes a reference to its source's charge under the new handle, or gives back the
/// reference the entry side took. A duplicate whose status reads failed keeps it under a limit
/// (as [`charge_memory`]); one that cannot be recorded while the driver made it counts as
/// crossing the caller's limit, as its source's charge would go with the source's handle.
#[inline(always)]
pub(crate) fn account_dup(p: &Pending, ret: i64) {
    let src = &p.src;
    if src.kind != OBJ_MEMORY {
        return;
    }
    let back = if ret == 0 {
        unsafe { user::<rm::Nvos55>(p.params) }
    } else {
        None
    };
    let (status, handle, replace) = match (back, p.handle) {
        (None, _) => (NO_ANSWER, 0, false),
        (Some(d), 0) => (d.status, d.h_object, false),
        (Some(d), h) => (d.status, h, true),
    };
    let anc = current_ancestry();
    let is_limited = anc.is_some_and(|(_, a)| limited(a, src.gpu, 0));
    let confirmed = status == rm::status::NV_OK;
    let keep = ret == 0 && handle != 0 && (confirmed || is_limited);
    let key = ObjKey {
        client: p.client,
        object: handle,
    };
    let tracked = if keep && src.charge != 0 {
        track_object(&Track {
            key,
            kind: OBJ_MEMORY,
            parent: p.parent,
            gpu: src.gpu,
            bytes: src.bytes,
            file: p.file,
            charge: src.charge,
            cgroup_id: src.cgroup_id,
            // Only a duplicate the driver confirmed proves the handle was free.
            replace: replace && confirmed,
            marked: false,
            counted: false,
        })
    } else {
        None
    };
    if let Some(serial) = tracked {
        bump_stat(stat::DUPLICATES);
        // The source the driver duplicated may not be the one the entry side read.
        if is_limited
            && let Some((leaf, a)) = anc
            && !ask_size(key, serial, src.bytes, src.gpu, leaf)
            && let Some(hit) = limit_met(a, src.gpu, 0, true)
        {
            crossed(p.client, handle, src.bytes, hit);
        }
        return;
    }
    drop_reference(src, None, ObjCount::Keep);
    // Unconfirmed under a handle already recorded: the driver refused a duplicate name.
    let refused = !confirmed && recorded(p.client, handle);
    if keep
        && !refused
        && let Some((_, a)) = anc
        && let Some(hit) = limit_met(a, src.gpu, 0, true)
    {
        crossed(p.client, handle, src.bytes, hit);
    }
}

/// GPUs an RM call that raced its XFER header is checked against (the driver's numbering): it
/// may have been anything on any of them.
const RACED_GPUS: u32 = 8;

/// An RM call whose XFER header changed while the driver ran (`rm::raced`): a reference the
/// entry side took is given back, and a caller under any limit counts as crossing it.
#[inline(always)]
pub(crate) fn raced_call(p: &Pending) {
    if p.op == OP_DUP {
        drop_reference(&p.src, None, ObjCount::Keep);
    }
    let Some((_, anc)) = current_ancestry() else {
        return;
    };
    for gpu in 0..RACED_GPUS {
        if let Some(hit) = limit_met(anc, gpu, 0, true) {
            crossed(p.client, p.handle, 0, hit);
            return;
        }
    }
}

/// Return side of a free (`RM_FREE`, VID_HEAP_CONTROL `FREE`) of the handle the entry side read.
#[inline(always)]
pub(crate) fn account_free(p: &Pending) {
    let at = if p.nr == nv::NV_ESC_RM_FREE {
        core::mem::offset_of!(rm::Nvos00, status)
    } else {
        rm::VIDHEAP_STATUS
    };
    if unsafe { user::<u32>(p.params + at as u64) } != Some(rm::status::NV_OK) {
        return;
    }
    let key = ObjKey {
        client: p.client,
        object: p.handle,
    };
    let entry = (unsafe { OBJECTS.get(key) }).copied();
    // A client is keyed by its own handle; other unknown handles own nothing we charged.
    if entry.is_none() && p.handle != p.client {
        return;
    }
    let caller = current_ancestry();
    ask_freed(key, caller);
    // Memory is released here; anything else may have objects below it, which the daemon
    // releases on the event.
    if let Some(e) = entry
        && e.kind == OBJ_MEMORY
    {
        release_entry(&key, &e, caller);
        return;
    }
    if p.nr != nv::NV_ESC_RM_FREE {
        return;
    }
    send(&Event {
        kind: EVENT_FREE_TREE,
        tgid: current_tgid(),
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        client: p.client,
        object: p.handle,
        value: serial_now(),
        ..Event::default()
    });
}

/// Asks the daemon to check that the object at `key`, whose free by the caller the driver
/// confirmed, is gone (`EVENT_FREE_READ_BACK`), where the caller is under any limit: the entry
/// side read the handle before the driver copied it, and another thread may have changed it in
/// between, so that the driver freed another object while the probes release this one (and what
/// is below it). A request the ring cannot take fails closed: it counts as crossing the limit.
#[inline(always)]
fn ask_freed(key: ObjKey, caller: Known) {
    let Some((leaf, anc)) = caller else {
        return;
    };
    // The `unknown` key holds the entry beside per-GPU limits, and `all` is walked with it: any
    // limit at all.
    if !limited(anc, GPU_UNKNOWN, levels_without_limits(anc)) {
        return;
    }
    let asked = ask(
        EVENT_FREE_READ_BACK,
        stat::FREE_READ_BACKS,
        key,
        serial_now(),
        0,
        GPU_UNKNOWN,
        leaf,
    );
    fail_closed_unless(asked, anc, key);
}

/// Announces the release of a control file's last reference (its clients go with it), if any
/// object was recorded through it (`FILE_MARKS`): the releases of files that made nothing, a
/// tenant's open/close loop, are counted, not sent.
#[inline(always)]
pub(crate) fn file_released(file: u64) {
    crate::guard::forget_file(file);
    // Nothing was recorded through it: nothing for the daemon to release.
    if FILE_MARKS.remove(file).is_err() {
        bump_stat(stat::FILE_RELEASES_SKIPPED);
        return;
    }
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
    let Some((fd_array, max_fds)) = (unsafe { fd_table() }) else {
        return;
    };
    for fd in 0..EXIT_FD_SCAN {
        if fd >= max_fds as u64 {
            break;
        }
        let Some(file) = (unsafe { file_at(fd_array, fd) }) else {
            continue;
        };
        if let Some(DeviceKind::Control) = unsafe { device_kind(&r, file) }
            && unsafe { sole_reference(&r, file, cfg.offsets.file_one_ref) }
        {
            file_released(file as u64);
        }
    }
}
