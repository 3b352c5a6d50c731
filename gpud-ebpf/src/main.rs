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
        bpf_get_current_cgroup_id, bpf_get_current_pid_tgid, bpf_get_current_task,
        bpf_probe_read_kernel, bpf_probe_read_user,
    },
    macros::{fentry, lsm, map, raw_tracepoint, tracepoint},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{FEntryContext, LsmContext, RawTracePointContext, TracePointContext},
};
use gpud_common::{
    CFG_HAS_EXTRA_FILES, CFG_READY, DeviceKind, EVENT_PROC_EXIT, EVENT_PROC_NEW, EVENTS_BYTES,
    Event, FileKey, IOCTL_CLASSES, IoctlClass, IoctlCounts, KERNEL_MINOR_BITS, MAX_CGROUPS,
    MAX_EXTRA_FILES, MAX_PROCS, PROC_INHERITED, PROC_OPENED, ProbeConfig, ProcEntry,
    TRACKED_PER_WORD,
    nv::{self, Decoded},
    stat,
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
    let ev = Event {
        kind,
        tgid,
        cgroup_id,
    };
    if EVENTS.output::<Event>(&ev, 0).is_err() {
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

// ---- fentry mode -------------------------------------------------------------------------------

#[inline(always)]
fn on_file_ioctl(ctx: &FEntryContext) -> i32 {
    let file: *const u8 = ctx.arg(0);
    let cmd: u32 = ctx.arg(1);
    let arg: u64 = ctx.arg(2);
    if let Some(kind) = unsafe { device_kind(&BtfRead, file) } {
        account(kind, cmd, arg);
    }
    0
}

#[fentry(function = "security_file_ioctl")]
pub fn gpud_fentry_ioctl(ctx: FEntryContext) -> i32 {
    on_file_ioctl(&ctx)
}

/// 32-bit callers on kernels with the `file_ioctl_compat` hook (6.8+, some 6.6.y) skip
/// `security_file_ioctl`; loaded only where the kernel has the function.
#[fentry(function = "security_file_ioctl_compat")]
pub fn gpud_fentry_ioctl_compat(ctx: FEntryContext) -> i32 {
    on_file_ioctl(&ctx)
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
    }
    0
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
            emit(EVENT_PROC_NEW, child_tgid, entry.cgroup_id);
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
