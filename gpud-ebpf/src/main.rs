//! gpud's kernel side: attribution of ioctls on NVIDIA device files to cgroups and processes.
//!
//! Two attach modes, chosen by the daemon after probing the kernel:
//! - **fentry**: `security_file_ioctl` (and `_compat`) hand over the `struct file`, so only ioctls
//!   pay, and only a few loads decide whether the file is an NVIDIA device; `security_file_open`
//!   marks processes that open one.
//! - **tracepoint**: `syscalls:sys_enter_ioctl` runs for every ioctl on the host. A process is
//!   looked up in `PROCS` first and leaves at once unless it is known to hold an NVIDIA file (it
//!   opened one, `sys_exit_open*`; it was forked by such a process, `sched_process_fork`; or the
//!   daemon found one in its fd table). Only then is the fd table walked to the file.
//!
//! Both modes share the identification of the file and the accounting: per-cgroup and
//! per-process counters by ioctl class, in pinned maps that outlive the daemon.
#![no_std]
#![no_main]
// The bpf target has no atomic RMW types; the intrinsic lowers to BPF_ATOMIC_ADD (XADD).
#![feature(core_intrinsics)]
#![allow(internal_features)]

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    Global,
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_current_pid_tgid,
        bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user,
        bpf_send_signal,
    },
    macros::{fentry, fexit, lsm, map, raw_tracepoint, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{FEntryContext, FExitContext, LsmContext, RawTracePointContext, TracePointContext},
};
use gpud_common::{
    Ancestry, CFG_EXIT_RELEASE, CFG_HAS_EXTRA_FILES, CFG_READY, DeviceKind, EVENT_ALLOC_DENIED,
    EVENT_FILE_RELEASE, EVENT_FREE_TREE, EVENT_LIMIT_CROSSED, EVENT_PROC_EXIT, EVENT_PROC_NEW,
    EVENTS_BYTES, Event, FileKey, GPU_ALL, GPU_UNKNOWN, IOCTL_CLASSES, IoctlClass, IoctlCounts,
    KERNEL_MINOR_BITS, LimitValue, MAX_CGROUP_DEPTH, MAX_CGROUPS, MAX_EXTRA_FILES, MAX_LIMITS,
    MAX_OBJECTS, MAX_PENDING, MAX_PROCS, MAX_USAGE, OBJ_CLIENT, OBJ_DEVICE, OBJ_MEMORY,
    OBJ_SUBDEVICE, ObjEntry, ObjKey, PROC_INHERITED, PROC_OPENED, Pending, ProbeConfig, ProcEntry,
    REACT_KILL, TRACKED_PER_WORD, UsageKey,
    nv::{self, Decoded},
    rm, stat,
};

#[map]
static CONFIG: Array<ProbeConfig> = Array::pinned(1, 0);

#[map]
static EXTRA_FILES: HashMap<FileKey, u32> = HashMap::pinned(MAX_EXTRA_FILES, 0);

#[map]
static PROCS: HashMap<u32, ProcEntry> = HashMap::pinned(MAX_PROCS, 0);

#[map]
static CGROUPS: HashMap<u64, IoctlCounts> = HashMap::pinned(MAX_CGROUPS, 0);

#[map]
static EVENTS: RingBuf = RingBuf::pinned(EVENTS_BYTES, 0);

#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::pinned(stat::COUNT, 0);

/// Tracked-process counters, 8 per word (see `gpud_common::TRACKED_PER_WORD`); the loader sizes
/// it from `pid_max`.
#[map]
static TRACKED: Array<u64> = Array::pinned(1, 0);

/// RM objects followed for memory accounting (clients, devices, subdevices, video memory).
#[map]
static OBJECTS: HashMap<ObjKey, ObjEntry> = HashMap::pinned(MAX_OBJECTS, 0);

/// Hierarchical video-memory usage in bytes per (cgroup, GPU) and per (cgroup, `GPU_ALL`).
#[map]
static USAGE: HashMap<UsageKey, u64> = HashMap::pinned(MAX_USAGE, 0);

/// Limits set by the daemon, keyed like `USAGE`.
#[map]
static LIMITS: HashMap<UsageKey, LimitValue> = HashMap::pinned(MAX_LIMITS, 0);

/// Ancestor chain of each charged cgroup (see `gpud_common::Ancestry`).
#[map]
static ANCESTRY: HashMap<u64, Ancestry> = HashMap::pinned(MAX_CGROUPS, 0);

/// RM calls between their ioctl's entry and return, by `pid_tgid`. LRU: an entry orphaned by a
/// thread killed inside the ioctl ages out.
#[map]
static PENDING: LruHashMap<u64, Pending> = LruHashMap::pinned(MAX_PENDING, 0);

/// Scratch space for building an `Ancestry` (too large for the stack beside the callers).
#[map]
static SCRATCH: PerCpuArray<Ancestry> = PerCpuArray::with_max_entries(1, 0);

/// Offsets of the syscall tracepoint records (`common_*` header, `__syscall_nr`, then 8-byte args),
/// from `/sys/kernel/tracing/events/syscalls/*/format`; stable across kernels.
const TP_SYSCALL_ARG0: usize = 16;
const TP_SYSCALL_RET: usize = 16;

#[inline(always)]
fn config() -> Option<&'static ProbeConfig> {
    let cfg = CONFIG.get(0)?;
    if cfg.flags & CFG_READY == 0 {
        return None;
    }
    Some(cfg)
}

#[inline(always)]
fn bump_stat(index: u32) {
    if let Some(p) = STATS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer.
        unsafe { *p += 1 };
    }
}

#[inline(always)]
unsafe fn read_at<T>(base: *const u8, offset: u32) -> Option<T> {
    unsafe { bpf_probe_read_kernel(base.add(offset as usize).cast::<T>()).ok() }
}

/// `current->files->fdt->fd[fd]`, the file behind a descriptor of the calling process.
#[inline(always)]
unsafe fn file_of_fd(cfg: &ProbeConfig, fd: u64) -> Option<*const u8> {
    let o = &cfg.offsets;
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let files: *const u8 = unsafe { read_at(task, o.task_files)? };
    if files.is_null() {
        return None;
    }
    let fdt: *const u8 = unsafe { read_at(files, o.files_fdt)? };
    if fdt.is_null() {
        return None;
    }
    let max_fds: u32 = unsafe { read_at(fdt, o.fdt_max_fds)? };
    if fd >= max_fds as u64 {
        return None;
    }
    let fd_array: *const u8 = unsafe { read_at(fdt, o.fdt_fd)? };
    let file: *const u8 =
        unsafe { bpf_probe_read_kernel(fd_array.add(fd as usize * 8).cast::<*const u8>()).ok()? };
    if file.is_null() { None } else { Some(file) }
}

/// How a program reads fields of kernel structs, with the offsets that go with it.
trait KernelReader {
    fn file_inode(&self) -> u32;
    fn inode_rdev(&self) -> u32;
    fn inode_ino(&self) -> u32;
    fn inode_sb(&self) -> u32;
    fn sb_dev(&self) -> u32;
    fn file_refs(&self) -> u32;
    /// Reads a `T` at `base + off`.
    unsafe fn load<T: Copy>(&self, base: *const u8, off: u32) -> Option<T>;
}

/// `bpf_probe_read_kernel` with offsets from `CONFIG`: works from any program type.
struct ProbeRead<'a>(&'a gpud_common::KernelOffsets);

impl KernelReader for ProbeRead<'_> {
    fn file_inode(&self) -> u32 {
        self.0.file_inode
    }
    fn inode_rdev(&self) -> u32 {
        self.0.inode_rdev
    }
    fn inode_ino(&self) -> u32 {
        self.0.inode_ino
    }
    fn inode_sb(&self) -> u32 {
        self.0.inode_sb
    }
    fn sb_dev(&self) -> u32 {
        self.0.sb_dev
    }
    fn file_refs(&self) -> u32 {
        self.0.file_refs
    }
    unsafe fn load<T: Copy>(&self, base: *const u8, off: u32) -> Option<T> {
        unsafe { read_at(base, off) }
    }
}

// Offsets for direct loads in fentry programs, written by the loader into frozen .rodata: the
// verifier then knows them as constants and checks each access against the kernel's BTF, so no
// helper call is needed (fentry hands over typed pointers).
#[unsafe(no_mangle)]
static BTF_FILE_INODE: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_INODE_RDEV: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_INODE_INO: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_INODE_SB: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_SB_DEV: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_FILE_REFS: Global<u32> = Global::new(0);

/// Direct, BTF-checked loads (fentry/fexit/LSM programs only).
struct BtfRead;

impl KernelReader for BtfRead {
    fn file_inode(&self) -> u32 {
        BTF_FILE_INODE.load()
    }
    fn inode_rdev(&self) -> u32 {
        BTF_INODE_RDEV.load()
    }
    fn inode_ino(&self) -> u32 {
        BTF_INODE_INO.load()
    }
    fn inode_sb(&self) -> u32 {
        BTF_INODE_SB.load()
    }
    fn sb_dev(&self) -> u32 {
        BTF_SB_DEV.load()
    }
    fn file_refs(&self) -> u32 {
        BTF_FILE_REFS.load()
    }
    unsafe fn load<T: Copy>(&self, base: *const u8, off: u32) -> Option<T> {
        // A fault on a bad pointer is caught by the BPF exception table and reads as zero.
        Some(unsafe { core::ptr::read_volatile(base.add(off as usize).cast::<T>()) })
    }
}

/// Identifies an NVIDIA file by its device number (or, for configured stand-ins, by its
/// superblock device and inode); never by path. `CONFIG` is only consulted for files outside
/// major 195, so the common case costs two loads.
#[inline(always)]
unsafe fn device_kind(r: &impl KernelReader, file: *const u8) -> Option<DeviceKind> {
    let inode: *const u8 = unsafe { r.load(file, r.file_inode())? };
    if inode.is_null() {
        return None;
    }
    let rdev: u32 = unsafe { r.load(inode, r.inode_rdev())? };
    let major = rdev >> KERNEL_MINOR_BITS;
    let minor = rdev & ((1 << KERNEL_MINOR_BITS) - 1);
    if major == nv::NV_MAJOR {
        return if minor == nv::NV_CTL_MINOR {
            Some(DeviceKind::Control)
        } else if minor <= nv::NV_GPU_MINOR_MAX {
            Some(DeviceKind::Gpu)
        } else {
            None
        };
    }
    let cfg = config()?;
    if major != 0 {
        if major == cfg.uvm_major {
            return Some(DeviceKind::Uvm);
        }
        if major == cfg.caps_major || major == cfg.caps_imex_major {
            return Some(DeviceKind::Caps);
        }
    }
    if cfg.flags & CFG_HAS_EXTRA_FILES == 0 {
        return None;
    }
    let ino: u64 = unsafe { r.load(inode, r.inode_ino())? };
    let sb: *const u8 = unsafe { r.load(inode, r.inode_sb())? };
    if sb.is_null() {
        return None;
    }
    let s_dev: u32 = unsafe { r.load(sb, r.sb_dev())? };
    let key = FileKey {
        dev: s_dev as u64,
        ino,
    };
    let kind = unsafe { EXTRA_FILES.get(key)? };
    DeviceKind::from_u32(*kind)
}

/// The `TRACKED` word holding `tgid`'s counter, and the counter's bit shift.
#[inline(always)]
fn tracked_slot(tgid: u32) -> Option<(*mut u64, u32)> {
    let word = TRACKED.get_ptr_mut(tgid / TRACKED_PER_WORD)?;
    Some((word, (tgid % TRACKED_PER_WORD) * 8))
}

/// Whether `tgid` may hold an NVIDIA file. A pid beyond the map (pid_max raised after it was
/// created) falls back to `PROCS`.
#[inline(always)]
fn is_tracked(tgid: u32) -> bool {
    match tracked_slot(tgid) {
        Some((word, shift)) => (unsafe { core::ptr::read_volatile(word) } >> shift) & 0xff != 0,
        None => PROCS.get_ptr(tgid).is_some(),
    }
}

#[inline(always)]
fn mark_tracked(tgid: u32) {
    if let Some((word, shift)) = tracked_slot(tgid) {
        // Racing markers may both add: the counter then reads 2, still "tracked".
        if (unsafe { core::ptr::read_volatile(word) } >> shift) & 0xff == 0 {
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(word, 1 << shift) };
        }
    }
}

/// Called when the process is gone, so nothing marks its slot concurrently.
#[inline(always)]
fn clear_tracked(tgid: u32) {
    if let Some((word, shift)) = tracked_slot(tgid) {
        let v = (unsafe { core::ptr::read_volatile(word) } >> shift) & 0xff;
        if v != 0 {
            let minus = (v << shift).wrapping_neg();
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(word, minus) };
        }
    }
}

#[inline(always)]
fn current_tgid() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}

#[inline(always)]
fn emit(kind: u32, tgid: u32, cgroup_id: u64) {
    send(&Event {
        kind,
        tgid,
        cgroup_id,
        ..Event::default()
    });
}

#[inline(always)]
fn send(ev: &Event) {
    if EVENTS.output::<Event>(ev, 0).is_err() {
        bump_stat(stat::EVENTS_LOST);
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
fn account(kind: DeviceKind, cmd: u32, arg: u64) {
    let class = match nv::classify(kind, cmd) {
        Decoded::Class(c) => c,
        Decoded::Xfer => match unsafe { bpf_probe_read_user(arg as *const [u32; 2]) } {
            Ok([inner_cmd, inner_size]) => nv::classify_xfer(inner_cmd, inner_size),
            Err(_) => IoctlClass::Other,
        },
    };
    let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    let tgid = current_tgid();

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
fn mark_opened() {
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

// ---- GPU-memory accounting ---------------------------------------------------------------------
//
// Entry side (ioctl hook): an RM_ALLOC, RM_FREE or VID_HEAP_CONTROL on a control file is noted
// in `PENDING`; the `deny` tier also refuses here an allocation that would take a cgroup over a
// limit. Return side: the driver has written back `status`, handles and the allocated size, so
// successful calls are charged or uncharged. Subtree, client and file releases are announced to
// the daemon, which walks `OBJECTS` and releases each object through `gpud_release`.

const ENOMEM: i32 = 12;
const SIGKILL: u32 = 9;

#[inline(always)]
unsafe fn user<T>(addr: u64) -> Option<T> {
    unsafe { bpf_probe_read_user(addr as *const T).ok() }
}

/// The RM call an ioctl makes: escape number, parameter size and user address, unwrapping an
/// XFER. `None` for commands the accounting does not follow.
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
        | (nv::NV_ESC_RM_VID_HEAP_CONTROL, nv::NVOS32_SIZE) => Some((nr, size, params)),
        _ => None,
    }
}

#[inline(always)]
fn gpu_of(client: u32, parent: u32) -> u32 {
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

/// A video-memory allocation request: client, parent, new handle, bytes. For RM_ALLOC the
/// bytes are read from the alloc params (requested at entry, allocated at return).
#[inline(always)]
fn vidmem_request(nr: u32, size: u32, params: u64) -> Option<(u32, u32, u32, u64)> {
    if nr == nv::NV_ESC_RM_ALLOC {
        let head: rm::Nvos21 = unsafe { user(params)? };
        if head.h_class != rm::class::MEMORY_LOCAL_USER {
            return None;
        }
        if size == nv::NVOS64_SIZE {
            let flags: u32 = unsafe { user(params + rm::NVOS64_FLAGS as u64)? };
            if flags & rm::NVOS64_FLAGS_FINN_SERIALIZED != 0 {
                bump_stat(stat::UNREADABLE);
                return None;
            }
        }
        let Some(bytes) = (unsafe { user::<u64>(head.p_alloc_parms + rm::MEM_PARAMS_SIZE as u64) })
        else {
            bump_stat(stat::UNREADABLE);
            return None;
        };
        return Some((head.h_root, head.h_object_parent, head.h_object_new, bytes));
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

/// The calling task's cgroup and its ancestors, recorded once per cgroup.
#[inline(always)]
fn current_ancestry() -> Option<(u64, &'static Ancestry)> {
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

#[inline(always)]
fn usage(cgroup_id: u64, gpu: u32) -> u64 {
    let key = UsageKey {
        cgroup_id,
        gpu,
        _pad: 0,
    };
    match USAGE.get_ptr(key) {
        Some(p) => unsafe { core::ptr::read_volatile(p) },
        None => 0,
    }
}

/// The first limit (from the root down) that usage plus `extra` exceeds: the cgroup, the GPU
/// key of the limit, and the usage it holds now. Bumps that limit's event counter.
#[inline(always)]
fn over_limit(anc: &Ancestry, gpu: u32, extra: u64) -> Option<(u64, u32, u64)> {
    for i in 0..MAX_CGROUP_DEPTH {
        if i as u32 >= anc.depth {
            break;
        }
        let id = anc.ids[i];
        for g in [gpu, GPU_ALL] {
            let key = UsageKey {
                cgroup_id: id,
                gpu: g,
                _pad: 0,
            };
            if let Some(l) = LIMITS.get_ptr_mut(key) {
                let now = usage(id, g);
                if now.saturating_add(extra) > unsafe { (*l).max } {
                    unsafe {
                        let ev = core::ptr::addr_of_mut!((*l).events);
                        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(ev, 1);
                    }
                    return Some((id, g, now));
                }
            }
        }
    }
    None
}

/// Object serials are the monotonic clock: unique per key (one object per key at a time) and
/// ordered against the events that release objects created before them.
#[inline(always)]
fn serial_now() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

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
    if OBJECTS.insert(key, entry, 0).is_err() {
        bump_stat(stat::OBJECTS_FULL);
        return false;
    }
    true
}

/// Removes `key` if it still holds the object `expect` (any, when 0) and uncharges its bytes;
/// the removal decides, so two racing releases uncharge once.
#[inline(always)]
fn release(key: &ObjKey, expect: u64) -> bool {
    let Some(e) = (unsafe { OBJECTS.get(key) }).copied() else {
        return false;
    };
    if expect != 0 && e.serial != expect {
        return false;
    }
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

/// Entry side of an ioctl on a control file. Returns the verdict (`-ENOMEM` to refuse).
#[inline(always)]
fn rm_entry(file: u64, cmd: u32, arg: u64, deny: bool) -> i32 {
    let Some((nr, size, params)) = rm_call(cmd, arg) else {
        return 0;
    };
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
    };
    let _ = PENDING.insert(bpf_get_current_pid_tgid(), pending, 0);
    0
}

/// Return side: accounts a successful RM call noted at entry.
#[inline(always)]
fn rm_exit(ret: i64) {
    let id = bpf_get_current_pid_tgid();
    let Some(p) = (unsafe { PENDING.get(id) }).copied() else {
        return;
    };
    let _ = PENDING.remove(id);
    if ret != 0 {
        return;
    }
    match p.nr {
        nv::NV_ESC_RM_ALLOC => alloc_done(&p),
        nv::NV_ESC_RM_FREE => free_done(&p),
        _ => vidheap_done(&p),
    }
}

#[inline(always)]
fn alloc_done(p: &Pending) {
    let status_off = if p.size == nv::NVOS64_SIZE {
        rm::NVOS64_STATUS
    } else {
        rm::NVOS21_STATUS
    };
    let Some(status) = (unsafe { user::<u32>(p.params + status_off as u64) }) else {
        return;
    };
    if status != rm::status::NV_OK {
        return;
    }
    let Some(head) = (unsafe { user::<rm::Nvos21>(p.params) }) else {
        return;
    };
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
            track_object(key, OBJ_DEVICE, head.h_object_parent, gpu, 0, 0);
        }
        rm::class::SUBDEVICE => {
            let gpu = gpu_of(head.h_root, head.h_object_parent);
            track_object(key, OBJ_SUBDEVICE, head.h_object_parent, gpu, 0, 0);
        }
        rm::class::MEMORY_LOCAL_USER => {
            if let Some((client, parent, handle, bytes)) = vidmem_request(p.nr, p.size, p.params) {
                memory_done(client, parent, handle, bytes);
            }
        }
        _ => {}
    }
}

#[inline(always)]
fn vidheap_done(p: &Pending) {
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
        memory_done(client, parent, handle, bytes);
    }
}

/// Charges a successful video-memory allocation and applies the `react` tier.
#[inline(always)]
fn memory_done(client: u32, parent: u32, handle: u32, bytes: u64) {
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
    // A stale entry under this key (a free missed while nothing was attached) goes first.
    release(&key, 0);
    charge(anc, gpu, bytes);
    if !track_object(key, OBJ_MEMORY, parent, gpu, bytes, 0) {
        charge(anc, gpu, bytes.wrapping_neg());
        return;
    }
    bump_stat(stat::CHARGES);
    if let Some((cg, g, now)) = over_limit(anc, gpu, 0) {
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
fn free_done(p: &Pending) {
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
    let kind = match unsafe { OBJECTS.get(key) } {
        Some(e) => e.kind,
        // A client is keyed by its own handle; other unknown handles own nothing we charged.
        None if args.h_object_old == args.h_root => OBJ_CLIENT,
        None => return,
    };
    if kind == OBJ_MEMORY {
        release(&key, 0);
        return;
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
fn file_released(file: u64) {
    send(&Event {
        kind: EVENT_FILE_RELEASE,
        tgid: current_tgid(),
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        value: file,
        bytes: serial_now(),
        ..Event::default()
    });
}

/// Whether the caller holds the only reference to `file`.
#[inline(always)]
unsafe fn sole_reference(r: &impl KernelReader, file: *const u8, one: u32) -> bool {
    match unsafe { r.load::<i64>(file, r.file_refs()) } {
        Some(v) => v == one as i64,
        None => false,
    }
}

/// Never attached: the daemon runs it with `BPF_PROG_TEST_RUN` (arguments: client, object,
/// serial) to release an object below a freed subtree, client or file. Returns 0 if released.
#[raw_tracepoint]
pub fn gpud_release(ctx: RawTracePointContext) -> i32 {
    let client: u64 = ctx.arg(0);
    let object: u64 = ctx.arg(1);
    let serial: u64 = ctx.arg(2);
    let key = ObjKey {
        client: client as u32,
        object: object as u32,
    };
    if serial == 0 || !release(&key, serial) {
        return 1;
    }
    0
}

// ---- fentry mode -------------------------------------------------------------------------------

/// Shared by the fentry and LSM programs on the ioctl hooks; `deny` only from LSM.
#[inline(always)]
fn on_file_ioctl(file: *const u8, cmd: u32, arg: u64, deny: bool) -> i32 {
    let Some(kind) = (unsafe { device_kind(&BtfRead, file) }) else {
        return 0;
    };
    account(kind, cmd, arg);
    if let DeviceKind::Control = kind {
        return rm_entry(file as u64, cmd, arg, deny);
    }
    0
}

#[fentry(function = "security_file_ioctl")]
pub fn gpud_fentry_ioctl(ctx: FEntryContext) -> i32 {
    on_file_ioctl(ctx.arg(0), ctx.arg(1), ctx.arg(2), false)
}

/// 32-bit callers on kernels with the `file_ioctl_compat` hook (6.8+, some 6.6.y) skip
/// `security_file_ioctl`; loaded only where the kernel has the function.
#[fentry(function = "security_file_ioctl_compat")]
pub fn gpud_fentry_ioctl_compat(ctx: FEntryContext) -> i32 {
    on_file_ioctl(ctx.arg(0), ctx.arg(1), ctx.arg(2), false)
}

/// The `deny` tier: counts like [`gpud_fentry_ioctl`] and refuses, before the driver sees it,
/// a video-memory allocation that would take the caller's cgroup (or an ancestor) over a limit.
#[lsm(hook = "file_ioctl")]
pub fn gpud_lsm_ioctl(ctx: LsmContext) -> i32 {
    let prev: i32 = ctx.arg(3);
    if prev != 0 {
        return prev;
    }
    on_file_ioctl(ctx.arg(0), ctx.arg(1), ctx.arg(2), true)
}

/// The `deny` tier for 32-bit callers on kernels with the `file_ioctl_compat` hook.
#[lsm(hook = "file_ioctl_compat")]
pub fn gpud_lsm_ioctl_compat(ctx: LsmContext) -> i32 {
    let prev: i32 = ctx.arg(3);
    if prev != 0 {
        return prev;
    }
    on_file_ioctl(ctx.arg(0), ctx.arg(1), ctx.arg(2), true)
}

/// Return side of `ioctl(2)` in the fentry and LSM tiers. The loader attaches it to the
/// architecture's syscall entry (`__x64_sys_ioctl`, `__ia32_compat_sys_ioctl`, ...), which takes
/// one argument (`struct pt_regs *`), so the return value is argument 1. Only threads with a
/// pending RM call do more than one lookup.
#[fexit(function = "__x64_sys_ioctl")]
pub fn gpud_fexit_ioctl(ctx: FExitContext) -> i32 {
    let ret: i64 = ctx.arg(1);
    rm_exit(ret);
    0
}

/// [`gpud_fexit_ioctl`] for 32-bit callers (`__ia32_compat_sys_ioctl` on x86-64).
#[fexit(function = "__ia32_compat_sys_ioctl")]
pub fn gpud_fexit_ioctl_compat(ctx: FExitContext) -> i32 {
    let ret: i64 = ctx.arg(1);
    rm_exit(ret);
    0
}

/// Last reference to a file dropped (fentry and LSM tiers): a control file's clients are freed
/// by the driver without an `RM_FREE`.
#[fentry(function = "security_file_free")]
pub fn gpud_fentry_file_free(ctx: FEntryContext) -> i32 {
    let file: *const u8 = ctx.arg(0);
    if let Some(DeviceKind::Control) = unsafe { device_kind(&BtfRead, file) } {
        file_released(file as u64);
    }
    0
}

#[fentry(function = "security_file_open")]
pub fn gpud_fentry_open(ctx: FEntryContext) -> i32 {
    let file: *const u8 = ctx.arg(0);
    if unsafe { device_kind(&BtfRead, file) }.is_some() {
        mark_opened();
    }
    0
}

/// Capability probe only: the daemon loads (never attaches) it to learn whether BPF-LSM programs
/// are accepted by this kernel.
#[lsm(hook = "file_ioctl")]
pub fn gpud_lsm_probe(_ctx: LsmContext) -> i32 {
    0
}

/// Benchmark reference only (`xtask bench`): an empty program, attached in place of gpud's to
/// measure what any program on the same hook costs. The daemon never attaches it.
#[tracepoint]
pub fn gpud_noop_tp(_ctx: TracePointContext) -> u32 {
    0
}

/// Benchmark reference only: the fentry counterpart of [`gpud_noop_tp`].
#[fentry(function = "security_file_ioctl")]
pub fn gpud_noop_fentry(_ctx: FEntryContext) -> i32 {
    0
}

// ---- tracepoint mode ---------------------------------------------------------------------------

#[tracepoint]
pub fn gpud_tp_ioctl(ctx: TracePointContext) -> u32 {
    // The one lookup every process on the host pays: an array read the verifier inlines.
    if !is_tracked(current_tgid()) {
        return 0;
    }
    let Some(cfg) = config() else { return 0 };
    let (Ok(fd), Ok(cmd), Ok(arg)) = (
        unsafe { ctx.read_at::<u64>(TP_SYSCALL_ARG0) },
        unsafe { ctx.read_at::<u64>(TP_SYSCALL_ARG0 + 8) },
        unsafe { ctx.read_at::<u64>(TP_SYSCALL_ARG0 + 16) },
    ) else {
        return 0;
    };
    let Some(file) = (unsafe { file_of_fd(cfg, fd) }) else {
        return 0;
    };
    if let Some(kind) = unsafe { device_kind(&ProbeRead(&cfg.offsets), file) } {
        account(kind, cmd as u32, arg);
        if let DeviceKind::Control = kind {
            rm_entry(file as u64, cmd as u32, arg, false);
        }
    }
    0
}

/// `syscalls:sys_exit_ioctl`: the return side in tracepoint mode.
#[tracepoint]
pub fn gpud_tp_ioctl_exit(ctx: TracePointContext) -> u32 {
    if !is_tracked(current_tgid()) {
        return 0;
    }
    if let Ok(ret) = unsafe { ctx.read_at::<i64>(TP_SYSCALL_RET) } {
        rm_exit(ret);
    }
    0
}

/// `syscalls:sys_enter_close` (tracepoint mode, which has no file-release hook): closing the only
/// reference to a control file releases its clients.
#[tracepoint]
pub fn gpud_tp_close(ctx: TracePointContext) -> u32 {
    if !is_tracked(current_tgid()) {
        return 0;
    }
    let Some(cfg) = config() else { return 0 };
    let Ok(fd) = (unsafe { ctx.read_at::<u64>(TP_SYSCALL_ARG0) }) else {
        return 0;
    };
    let Some(file) = (unsafe { file_of_fd(cfg, fd) }) else {
        return 0;
    };
    let r = ProbeRead(&cfg.offsets);
    if let Some(DeviceKind::Control) = unsafe { device_kind(&r, file) }
        && unsafe { sole_reference(&r, file, cfg.offsets.file_one_ref) }
    {
        file_released(file as u64);
    }
    0
}

/// Most descriptors a dying process's table is searched for control files (tracepoint mode);
/// the search stops at the table's size (the verifier accepts 512 iterations on 6.1 and 6.18).
const EXIT_FD_SCAN: u64 = 512;

/// At the exit of a tracked process (tracepoint mode): its control files whose only reference is
/// its own descriptor are released with it (the table is closed right after this tracepoint).
#[inline(always)]
fn release_files_at_exit(cfg: &ProbeConfig) {
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

/// Attached to `sys_exit_open`, `sys_exit_openat` and `sys_exit_openat2`.
#[tracepoint]
pub fn gpud_tp_open(ctx: TracePointContext) -> u32 {
    let Ok(ret) = (unsafe { ctx.read_at::<i64>(TP_SYSCALL_RET) }) else {
        return 0;
    };
    if ret < 0 {
        return 0;
    }
    let Some(cfg) = config() else { return 0 };
    let Some(file) = (unsafe { file_of_fd(cfg, ret as u64) }) else {
        return 0;
    };
    if unsafe { device_kind(&ProbeRead(&cfg.offsets), file) }.is_some() {
        mark_opened();
    }
    0
}

/// `sched_process_fork(parent, child)`: a child of a tracked process may hold its files.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn gpud_tp_fork(ctx: RawTracePointContext) -> i32 {
    let parent_tgid = current_tgid();
    if !is_tracked(parent_tgid) {
        return 0;
    }
    let Some(cfg) = config() else { return 0 };
    let child: *const u8 = ctx.arg(1);
    let Some(child_tgid) = (unsafe { read_at::<u32>(child, cfg.offsets.task_tgid) }) else {
        return 0;
    };
    if child_tgid == parent_tgid {
        return 0; // a new thread, not a new process
    }
    let entry = ProcEntry {
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        flags: PROC_INHERITED,
        ..ProcEntry::default()
    };
    match PROCS.insert(child_tgid, entry, BPF_NOEXIST as u64) {
        Ok(()) => {
            mark_tracked(child_tgid);
            send(&Event {
                kind: EVENT_PROC_NEW,
                tgid: child_tgid,
                cgroup_id: entry.cgroup_id,
                client: parent_tgid,
                ..Event::default()
            });
        }
        Err(_) => bump_stat(stat::PROCS_FULL),
    }
    0
}

/// `sched_process_exit` runs for each exiting thread; the process is gone when its
/// `signal->live` count has dropped to zero (decremented before the tracepoint fires).
#[tracepoint]
pub fn gpud_tp_exit(_ctx: TracePointContext) -> u32 {
    let tgid = current_tgid();
    let entry = PROCS.get_ptr(tgid);
    if entry.is_none() && !is_tracked(tgid) {
        return 0;
    }
    let Some(cfg) = config() else { return 0 };
    let o = &cfg.offsets;
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let Some(signal) = (unsafe { read_at::<*const u8>(task, o.task_signal) }) else {
        return 0;
    };
    if signal.is_null() {
        return 0;
    }
    let Some(live) = (unsafe { read_at::<i32>(signal, o.signal_live) }) else {
        return 0;
    };
    if live != 0 {
        return 0;
    }
    if cfg.flags & CFG_EXIT_RELEASE != 0 {
        release_files_at_exit(cfg);
    }
    clear_tracked(tgid);
    if let Some(entry) = entry {
        let cgroup_id = unsafe { (*entry).cgroup_id };
        let _ = PROCS.remove(tgid);
        emit(EVENT_PROC_EXIT, tgid, cgroup_id);
    }
    0
}

/// Never attached: the daemon runs it with `BPF_PROG_TEST_RUN` (argument 0: a tgid) to mark a
/// process it found holding an NVIDIA file, so `TRACKED` is only ever changed atomically.
#[raw_tracepoint]
pub fn gpud_seed(ctx: RawTracePointContext) -> i32 {
    let tgid: u64 = ctx.arg(0);
    if tgid == 0 || tgid > u32::MAX as u64 {
        return 1;
    }
    mark_tracked(tgid as u32);
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
