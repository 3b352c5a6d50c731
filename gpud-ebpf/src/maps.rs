//! Every map of the object, and the few accessors all concerns share (the configuration record,
//! the health counters, the event ring).
//!
//! The statics' names are the names in the object and in bpffs: the daemon pins and checks them
//! through `gpud_common::maps`, so renaming one is an ABI change.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use gpud_common::{
    Ancestry, CFG_READY, EVENTS_BYTES, Event, FileKey, GuardBucket, GuardKey, GuardRestore,
    IoctlCounts, KernelLimit, MAX_CGROUPS, MAX_EXTRA_FILES, MAX_GUARD_BUCKETS, MAX_GUARD_COUNTS,
    MAX_HELD_GROUPS, MAX_LIMITS, MAX_OBJECTS, MAX_PENDING, MAX_PROCS, MAX_SCHED_ALLOW, MAX_USAGE,
    ObjEntry, ObjKey, Pending, ProbeConfig, ProcEntry, UsageKey, stat,
};

#[map]
pub(crate) static CONFIG: Array<ProbeConfig> = Array::pinned(1, 0);

#[map]
pub(crate) static EXTRA_FILES: HashMap<FileKey, u32> = HashMap::pinned(MAX_EXTRA_FILES, 0);

#[map]
pub(crate) static PROCS: HashMap<u32, ProcEntry> = HashMap::pinned(MAX_PROCS, 0);

#[map]
pub(crate) static CGROUPS: HashMap<u64, IoctlCounts> = HashMap::pinned(MAX_CGROUPS, 0);

#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::pinned(EVENTS_BYTES, 0);

#[map]
pub(crate) static STATS: PerCpuArray<u64> = PerCpuArray::pinned(stat::COUNT, 0);

/// Tracked-process counters, 8 per word (see `gpud_common::TRACKED_PER_WORD`); the loader sizes
/// it from `pid_max`.
#[map]
pub(crate) static TRACKED: Array<u64> = Array::pinned(1, 0);

/// RM objects followed for memory accounting (clients, devices, subdevices, video memory).
#[map]
pub(crate) static OBJECTS: HashMap<ObjKey, ObjEntry> = HashMap::pinned(MAX_OBJECTS, 0);

/// Hierarchical video-memory usage in bytes per (cgroup, GPU) and per (cgroup, `GPU_ALL`).
#[map]
pub(crate) static USAGE: HashMap<UsageKey, u64> = HashMap::pinned(MAX_USAGE, 0);

/// Limits set by the daemon, keyed like `USAGE`.
#[map]
pub(crate) static LIMITS: HashMap<UsageKey, KernelLimit> = HashMap::pinned(MAX_LIMITS, 0);

/// Ancestor chain of each charged cgroup (see `gpud_common::Ancestry`).
#[map]
pub(crate) static ANCESTRY: HashMap<u64, Ancestry> = HashMap::pinned(MAX_CGROUPS, 0);

/// RM calls between their ioctl's entry and return, by `pid_tgid`. LRU: an entry orphaned by a
/// thread killed inside the ioctl ages out.
#[map]
pub(crate) static PENDING: LruHashMap<u64, Pending> = LruHashMap::pinned(MAX_PENDING, 0);

/// The scheduler guard's timeslice allowance (µs) of cgroups whose policy sets one.
#[map]
pub(crate) static SCHED_ALLOW: HashMap<u64, u64> = HashMap::pinned(MAX_SCHED_ALLOW, 0);

/// Channel groups the daemon holds off the runlist (value 1).
#[map]
pub(crate) static HELD_GROUPS: HashMap<ObjKey, u32> = HashMap::pinned(MAX_HELD_GROUPS, 0);

/// Every call the scheduler guard acted on, by cgroup, command and verdict.
#[map]
pub(crate) static GUARD_COUNTS: HashMap<GuardKey, u64> = HashMap::pinned(MAX_GUARD_COUNTS, 0);

/// The guard events each cgroup may still send (see `gpud_common::EVENT_SCHED_GUARD`).
#[map]
pub(crate) static GUARD_BUCKET: LruHashMap<u64, GuardBucket> =
    LruHashMap::pinned(MAX_GUARD_BUCKETS, 0);

/// By thread (`pid_tgid`): what the daemon must undo when a tenant's control, which neither a
/// hook nor a rewrite could stop, returns (sent to the ring at the call's exit). Not pinned: a
/// call in flight across a daemon restart is the only loss.
#[map]
pub(crate) static GUARD_PENDING: LruHashMap<u64, GuardRestore> =
    LruHashMap::with_max_entries(1024, 0);

/// Scratch space for building a [`GuardRestore`] (larger than the stack).
#[map]
pub(crate) static RESTORE_SCRATCH: PerCpuArray<GuardRestore> = PerCpuArray::with_max_entries(1, 0);

/// Scratch space for building an `Ancestry` (too large for the stack beside the callers).
#[map]
pub(crate) static SCRATCH: PerCpuArray<Ancestry> = PerCpuArray::with_max_entries(1, 0);

/// The daemon's configuration record, once it has filled it (`CFG_READY`).
#[inline(always)]
pub(crate) fn config() -> Option<&'static ProbeConfig> {
    let cfg = CONFIG.get(0)?;
    if cfg.flags & CFG_READY == 0 {
        return None;
    }
    Some(cfg)
}

#[inline(always)]
pub(crate) fn bump_stat(index: u32) {
    if let Some(p) = STATS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer.
        unsafe { *p += 1 };
    }
}

#[inline(always)]
pub(crate) fn emit(kind: u32, tgid: u32, cgroup_id: u64) {
    send(&Event {
        kind,
        tgid,
        cgroup_id,
        ..Event::default()
    });
}

#[inline(always)]
pub(crate) fn send(ev: &Event) {
    if EVENTS.output::<Event>(ev, 0).is_err() {
        bump_stat(stat::EVENTS_LOST);
    }
}
