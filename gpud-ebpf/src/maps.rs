//! Every map of the object, and the few accessors all concerns share (the configuration record,
//! the health counters, the event ring).
//!
//! The statics' names are the names in the object and in bpffs: the daemon pins and checks them
//! through `gpud_common::maps`, so renaming one is an ABI change.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use gpud_common::{
    Ancestry, CFG_READY, CgroupUsage, EVENTS_BYTES, Event, FileKey, GuardBucket, GuardKey,
    GuardRestore, IoctlCounts, KernelLimit, MAX_CGROUPS, MAX_EXTRA_FILES, MAX_FILE_MARKS,
    MAX_GUARD_BUCKETS, MAX_GUARD_COUNTS, MAX_HELD_GROUPS, MAX_LIMITS, MAX_OBJECTS, MAX_PROCS,
    MAX_SCHED_ALLOW, MAX_SCHED_FILES, MAX_SCHED_GROUPS, MAX_SHARES, MAX_USAGE, ObjEntry, ObjKey,
    Pending, ProbeConfig, ProcEntry, UsageKey, stat,
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

/// Charge serial → references beyond the first (docs of `gpud_common::maps::SHARES`).
#[map]
pub(crate) static SHARES: HashMap<u64, u64> = HashMap::pinned(MAX_SHARES, 0);

/// Hierarchical video-memory usage in bytes per cgroup, by GPU and in total, and each cgroup's
/// own `OBJECTS` entries (`gpud_common::CgroupUsage`).
#[map]
pub(crate) static USAGE: HashMap<u64, CgroupUsage> = HashMap::pinned(MAX_USAGE, 0);

/// Limits set by the daemon, by cgroup and GPU key.
#[map]
pub(crate) static LIMITS: HashMap<UsageKey, KernelLimit> = HashMap::pinned(MAX_LIMITS, 0);

/// Ancestor chain of each charged cgroup (see `gpud_common::Ancestry`).
#[map]
pub(crate) static ANCESTRY: HashMap<u64, Ancestry> = HashMap::pinned(MAX_CGROUPS, 0);

/// The limits' generation (`gpud_common::limits_seen`), raised by the daemon.
#[map]
pub(crate) static LIMITS_GEN: Array<u64> = Array::pinned(1, 0);

/// The scheduler guard's timeslice allowance (µs) of cgroups whose policy sets one.
#[map]
pub(crate) static SCHED_ALLOW: HashMap<u64, u64> = HashMap::pinned(MAX_SCHED_ALLOW, 0);

/// Channel groups the daemon holds off the runlist (value 1).
#[map]
pub(crate) static HELD_GROUPS: HashMap<ObjKey, u32> = HashMap::pinned(MAX_HELD_GROUPS, 0);

/// Control files with channel groups, and whether a read-back of them is asked (value 1) or
/// not (0); see `gpud_common::maps::SCHED_FILES`.
#[map]
pub(crate) static SCHED_FILES: HashMap<u64, u32> = HashMap::pinned(MAX_SCHED_FILES, 0);

/// Control files through which objects were recorded (`gpud_common::maps::FILE_MARKS`).
#[map]
pub(crate) static FILE_MARKS: HashMap<u64, u32> = HashMap::pinned(MAX_FILE_MARKS, 0);

/// Channel groups by the control file they were made through (`gpud_common::maps::SCHED_GROUPS`).
#[map]
pub(crate) static SCHED_GROUPS: HashMap<ObjKey, u64> = HashMap::pinned(MAX_SCHED_GROUPS, 0);

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

/// A zeroed `CgroupUsage`, never written: what a cgroup's first charge inserts (larger than
/// the stack left beside the callers).
#[map]
pub(crate) static ZERO_USAGE: PerCpuArray<CgroupUsage> = PerCpuArray::with_max_entries(1, 0);

/// What a charge walk did to the object count it was given (`memory::Counted`): a slot, not a
/// value of the walk, so that the verifier need not explore the callers once per value.
#[map]
pub(crate) static WALK_COUNT: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

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

/// Sends `ev` to the daemon; false (counted) when the ring has no room.
#[inline(always)]
pub(crate) fn send(ev: &Event) -> bool {
    if EVENTS.output::<Event>(ev, 0).is_err() {
        bump_stat(stat::EVENTS_LOST);
        return false;
    }
    true
}

/// A per-task map (`BPF_MAP_TYPE_TASK_STORAGE`) as a BTF map definition: the kernel keeps the
/// value in the task itself, so getting it is a pointer fetch, not a hash operation.
#[repr(C)]
pub(crate) struct TaskStorage<T> {
    r#type: *const [i32; aya_ebpf::bindings::bpf_map_type::BPF_MAP_TYPE_TASK_STORAGE as usize],
    key: *const i32,
    value: *const T,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize],
}

// SAFETY: placeholder pointers the loader reads from BTF; never dereferenced.
unsafe impl<T> Sync for TaskStorage<T> {}

impl<T> TaskStorage<T> {
    pub(crate) const fn new() -> Self {
        Self {
            r#type: core::ptr::null(),
            key: core::ptr::null(),
            value: core::ptr::null(),
            max_entries: core::ptr::null(),
            map_flags: core::ptr::null(),
        }
    }

    /// The calling task's value; created (zeroed) when `create`.
    #[inline(always)]
    pub(crate) fn current(&self, create: bool) -> Option<*mut T> {
        let flags = if create {
            aya_ebpf::bindings::BPF_LOCAL_STORAGE_GET_F_CREATE as u64
        } else {
            0
        };
        let p = unsafe {
            aya_ebpf::helpers::generated::bpf_task_storage_get(
                core::ptr::from_ref(self).cast_mut().cast(),
                aya_ebpf::helpers::generated::bpf_get_current_task_btf().cast(),
                core::ptr::null_mut(),
                flags,
            )
        };
        (!p.is_null()).then_some(p.cast::<T>())
    }
}

/// The RM call a thread has in flight, noted at its ioctl's entry for the return side (`file` 0:
/// none). Per task, not in a hash keyed by `pid_tgid`: a pointer fetch instead of an insert, a
/// lookup and a delete per call (the largest share of an allocation's cost in tracepoint mode,
/// docs/benchmarks.md), nothing a tenant's threads can fill, and freed with the thread. Not
/// pinned: a call in flight while the daemon replaces its programs is the only loss.
#[aya_ebpf::macros::btf_map]
pub(crate) static CALLS: TaskStorage<Pending> = TaskStorage::new();

/// The calling thread's record of its RM call, cleared, for the entry side to fill in place
/// (the record is too large to build on the BPF stack and copy). Setting `file` notes the call.
#[inline(always)]
pub(crate) fn noting() -> Option<&'static mut Pending> {
    let slot = CALLS.current(true)?;
    // Cleared word by word in place: a struct assignment compiles to a call of the object's
    // byte-wise `memset` (about a twentieth of the entry program's time, docs/benchmarks.md);
    // volatile stores stay stores. `Pending` is 8-aligned, its size a multiple of 8.
    const WORDS: usize = core::mem::size_of::<Pending>() / 8;
    const _: () = assert!(core::mem::size_of::<Pending>().is_multiple_of(8));
    let words = slot.cast::<u64>();
    for i in 0..WORDS {
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
    }
    Some(unsafe { &mut *slot })
}

/// Whether the calling thread has an RM call noted (by the guard, for an undo at its exit).
#[inline(always)]
pub(crate) fn noted() -> bool {
    CALLS
        .current(false)
        .is_some_and(|slot| unsafe { (*slot).file } != 0)
}

/// Takes the calling thread's noted RM call, if any: read in place (a copy would take room the
/// exit programs' stack does not have), and no longer noted once the taker is dropped.
#[inline(always)]
pub(crate) fn take_call() -> Option<Taken> {
    let slot = CALLS.current(false)?;
    let p = unsafe { &mut *slot };
    (p.file != 0).then_some(Taken(p))
}

/// A noted RM call being handled at its exit ([`take_call`]).
pub(crate) struct Taken(&'static mut Pending);

impl core::ops::Deref for Taken {
    type Target = Pending;

    fn deref(&self) -> &Pending {
        self.0
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.0.file = 0;
    }
}

/// The entry under `key` in `map`, made as `init` where absent (of racing makers, one inserts
/// and all use its entry); `None` when the map has no room for it.
#[inline(always)]
pub(crate) fn entry_or_insert<K: Copy, V>(map: &HashMap<K, V>, key: K, init: &V) -> Option<*mut V> {
    if let Some(p) = map.get_ptr_mut(key) {
        return Some(p);
    }
    let _ = map.insert(key, init, BPF_NOEXIST as u64);
    map.get_ptr_mut(key)
}

/// The `u64` counter under `key` in `map`, made at 0 where absent ([`entry_or_insert`]).
#[inline(always)]
pub(crate) fn counter_slot<K: Copy>(map: &HashMap<K, u64>, key: K) -> Option<*mut u64> {
    entry_or_insert(map, key, &0)
}
