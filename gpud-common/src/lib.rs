//! The kernel/user ABI of gpud, defined once.
//!
//! Everything here is shared by the eBPF programs (`gpud-ebpf`, `no_std`) and the daemon (`gpud`):
//! map keys and values, ring-buffer event records, the kernel-offsets record the daemon computes
//! from BTF, and the NVIDIA ioctl numbers with the classifier that turns a command into a class.
//! Layouts are `#[repr(C)]` with explicit padding so both sides agree byte for byte.
#![no_std]
#![warn(missing_docs)]

mod events;
pub mod nv;
mod objects;
pub mod rm;

/// The system calls tracepoint mode follows where every system call passes (the raw `sys_enter`
/// and `sys_exit` tracepoints, x86-64): the 64-bit ioctl and close, and the 32-bit entries, which
/// the `syscalls:*` tracepoints skip (`ARCH_TRACE_IGNORE_COMPAT_SYSCALLS`). Their numbers in the
/// 64-bit table (`arch/x86/entry/syscalls/syscall_64.tbl`), the i386 one (`syscall_32.tbl`) and
/// the x32 one (the 64-bit table's numbers with [`X32_SYSCALL_BIT`]), and where their arguments
/// sit in `struct pt_regs`.
pub mod compat {
    /// `ioctl` in the 64-bit table (`lchown` in the i386 one: [`TS_COMPAT`] tells them apart).
    pub const NATIVE_IOCTL: i64 = 16;
    /// `close` in the 64-bit table (`read` in the i386 one).
    pub const NATIVE_CLOSE: i64 = 3;
    /// `ioctl` in the i386 table (`setsockopt` in the 64-bit one: [`TS_COMPAT`] tells them apart).
    pub const IA32_IOCTL: i64 = 54;
    /// `close` in the i386 table (`lstat` in the 64-bit one).
    pub const IA32_CLOSE: i64 = 6;
    /// `open`, `openat` and `openat2` in the i386 table (`fstat`, `preadv` and `openat2` in the
    /// 64-bit one).
    pub const IA32_OPEN: i64 = 5;
    /// i386 `openat`.
    pub const IA32_OPENAT: i64 = 295;
    /// i386 `openat2`.
    pub const IA32_OPENAT2: i64 = 437;
    /// Set in the number of every x32 system call (`__X32_SYSCALL_BIT`).
    pub const X32_SYSCALL_BIT: i64 = 0x4000_0000;
    /// x32 `ioctl` (`compat_sys_ioctl`).
    pub const X32_IOCTL: i64 = X32_SYSCALL_BIT | 514;
    /// x32 `close`.
    pub const X32_CLOSE: i64 = X32_SYSCALL_BIT | 3;
    /// x32 `open`, `openat` and `openat2`.
    pub const X32_OPEN: i64 = X32_SYSCALL_BIT | 2;
    /// x32 `openat`.
    pub const X32_OPENAT: i64 = X32_SYSCALL_BIT | 257;
    /// x32 `openat2`.
    pub const X32_OPENAT2: i64 = X32_SYSCALL_BIT | 437;
    /// `thread_info.status` bit set for the length of an i386 system call (`in_ia32_syscall()`),
    /// cleared on the way back to user space, after the `sys_exit` tracepoint.
    pub const TS_COMPAT: u32 = 0x0002;
    /// Byte offsets in x86-64's `struct pt_regs` (the entry code's frame layout): `bx`.
    pub const REGS_BX: usize = 40;
    /// `pt_regs.cx`.
    pub const REGS_CX: usize = 88;
    /// `pt_regs.dx`.
    pub const REGS_DX: usize = 96;
    /// `pt_regs.si`.
    pub const REGS_SI: usize = 104;
    /// `pt_regs.di`.
    pub const REGS_DI: usize = 112;
    /// `pt_regs.orig_ax`: the system call's number, as `syscall_get_nr()` reads it.
    pub const REGS_ORIG_AX: usize = 120;
}

/// Bumped whenever a map layout, map name or event record changes. Maps are pinned under
/// `<bpffs>/gpud/v<ABI_VERSION>/`, so a daemon of another ABI never reads a foreign layout; a
/// daemon takes over the maps of [`previous::ABI_VERSION`] (docs/design.md, "Upgrades").
pub const ABI_VERSION: u32 = 8;

/// Classes of ioctls on NVIDIA device files, as counted per cgroup and per process.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoctlClass {
    /// RM object allocation (`NV_ESC_RM_ALLOC`, and the legacy `RM_ALLOC_MEMORY`/`RM_ALLOC_OBJECT`).
    Alloc = 0,
    /// `NV_ESC_RM_FREE`.
    Free = 1,
    /// `NV_ESC_RM_CONTROL`.
    Control = 2,
    /// CPU and GPU-VA mappings: `RM_MAP_MEMORY`, `RM_UNMAP_MEMORY`, `RM_MAP_MEMORY_DMA`,
    /// `RM_UNMAP_MEMORY_DMA`.
    Map = 3,
    /// `NV_ESC_RM_VID_HEAP_CONTROL`.
    VidHeap = 4,
    /// Any ioctl on `/dev/nvidia-uvm` (its commands are not `_IOC`-encoded).
    Uvm = 5,
    /// Everything else, including commands whose size the driver would reject.
    Other = 6,
}

/// Number of [`IoctlClass`] values; the length of [`IoctlCounts::by_class`].
pub const IOCTL_CLASSES: usize = 7;

/// Stable names of the classes, indexed by `IoctlClass as usize`. Used as keys on D-Bus and in JSON.
pub const IOCTL_CLASS_NAMES: [&str; IOCTL_CLASSES] = [
    "alloc", "free", "control", "map", "vid_heap", "uvm", "other",
];

/// What kind of NVIDIA file an ioctl was issued on.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// `/dev/nvidiactl` (195:255) and files standing in for it (`devices.extra_paths`).
    Control = 1,
    /// `/dev/nvidiaN` (195:0..=247).
    Gpu = 2,
    /// `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools` (dynamic major).
    Uvm = 3,
    /// `/dev/nvidia-caps/*` and `/dev/nvidia-caps-imex-channels/*` (dynamic majors).
    Caps = 4,
}

impl DeviceKind {
    /// Decodes a value stored in a map; `None` for anything unknown.
    #[inline(always)]
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::Control),
            2 => Some(Self::Gpu),
            3 => Some(Self::Uvm),
            4 => Some(Self::Caps),
            _ => None,
        }
    }
}

/// Per-class ioctl counters. Values in the `CGROUPS` map and inside [`ProcEntry`]; the kernel side
/// increments them atomically.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoctlCounts {
    /// Ioctls per class, indexed by `IoctlClass as usize`.
    pub by_class: [u64; IOCTL_CLASSES],
}

impl IoctlCounts {
    /// Sum over all classes.
    pub fn total(&self) -> u64 {
        let mut t = 0u64;
        let mut i = 0;
        while i < IOCTL_CLASSES {
            t = t.wrapping_add(self.by_class[i]);
            i += 1;
        }
        t
    }
}

/// `ProcEntry::flags`: the process was seen opening an NVIDIA file.
pub const PROC_OPENED: u32 = 1 << 0;
/// `ProcEntry::flags`: the process was forked by a tracked process (it may hold inherited files).
pub const PROC_INHERITED: u32 = 1 << 1;
/// `ProcEntry::flags`: the daemon found an NVIDIA file in `/proc/<pid>/fd` when scanning.
pub const PROC_SCANNED: u32 = 1 << 2;

/// Value of the `PROCS` map, keyed by thread-group id (the userspace pid).
///
/// In tracepoint mode the presence of an entry is what lets a process's ioctls walk the fd table;
/// every other process leaves the program after one lookup in this map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcEntry {
    /// cgroup v2 id of the thread that last opened or used an NVIDIA file.
    pub cgroup_id: u64,
    /// `PROC_*` bits.
    pub flags: u32,
    /// Explicit padding (always 0), so the layout has no implicit holes.
    pub _pad: u32,
    /// The process's ioctls on NVIDIA files, by class.
    pub counts: IoctlCounts,
}

/// Processes per 64-bit word of the `TRACKED` map: an 8-bit counter each, indexed by tgid.
///
/// `TRACKED` is the tracepoint-mode filter: an array lookup (inlined by the verifier) instead of
/// a hash lookup on every ioctl of the host. The kernel side changes it only with atomic adds
/// (mark: +1 when zero; clear at exit: minus the slot's value), so processes whose slots share a
/// word never lose each other's updates. The daemon marks processes it found by scanning through
/// the `gpud_seed` program (run with `BPF_PROG_TEST_RUN`), never by writing the map.
pub const TRACKED_PER_WORD: u32 = 8;

/// Number of `TRACKED` words for a `pid_max`.
pub const fn tracked_words(pid_max: u32) -> u32 {
    pid_max.div_ceil(TRACKED_PER_WORD)
}

/// Key of the `EXTRA_FILES` map: a file identified by the kernel's encoding of its
/// superblock device (`major << 20 | minor`) and inode number.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FileKey {
    /// `inode->i_sb->s_dev` in the kernel's encoding (see [`kernel_mkdev`]).
    pub dev: u64,
    /// `inode->i_ino`.
    pub ino: u64,
}

/// Kernel encoding of device numbers (`MINORBITS` = 20), as found in `inode->i_rdev` and
/// `super_block->s_dev`. Userspace `st_rdev`/`st_dev` use glibc's encoding and must be converted.
pub const KERNEL_MINOR_BITS: u32 = 20;

/// Builds a kernel `dev_t` from major and minor.
#[inline(always)]
pub const fn kernel_mkdev(major: u32, minor: u32) -> u64 {
    ((major as u64) << KERNEL_MINOR_BITS) | (minor as u64 & ((1 << KERNEL_MINOR_BITS) - 1))
}

/// Field offsets of kernel structs, computed by the daemon from the running kernel's BTF and
/// stored in the single-entry `CONFIG` array map (aya has no CO-RE for field accesses).
/// All values are byte offsets. The descriptor table's four (`task_files`, `files_fdt`,
/// `fdt_max_fds`, `fdt_fd`) are also frozen into the object's `.rodata`, where the programs read
/// them for BTF-checked loads; here they stay for the layout's sake.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    /// `task_struct.files` (the task's `files_struct *`).
    pub task_files: u32,
    /// `task_struct.tgid` (the userspace pid).
    pub task_tgid: u32,
    /// `task_struct.signal` (the `signal_struct *` the process's threads share).
    pub task_signal: u32,
    /// `signal_struct.live`: live threads of the process, 0 once the last one exits.
    pub signal_live: u32,
    /// `files_struct.fdt` (the current `fdtable *`).
    pub files_fdt: u32,
    /// `fdtable.max_fds`: the size of the descriptor array.
    pub fdt_max_fds: u32,
    /// `fdtable.fd` (the `struct file **` array indexed by descriptor).
    pub fdt_fd: u32,
    /// `file.f_inode`.
    pub file_inode: u32,
    /// `inode.i_rdev`: the device number of a device file, kernel encoding.
    pub inode_rdev: u32,
    /// `inode.i_ino`.
    pub inode_ino: u32,
    /// `inode.i_sb` (the `super_block *`).
    pub inode_sb: u32,
    /// `super_block.s_dev`: the file system's device number, kernel encoding.
    pub sb_dev: u32,
    /// `file.f_count` (before 6.13) or `file.f_ref` (a `file_ref_t`, 6.13 on).
    pub file_refs: u32,
    /// Value of that counter when exactly one reference is held: 1 for `f_count`, 0 for
    /// `file_ref_t` (which counts from zero).
    pub file_one_ref: u32,
}

/// `ProbeConfig::flags`: `EXTRA_FILES` is non-empty, so unmatched device numbers must still be
/// looked up by (device, inode).
pub const CFG_HAS_EXTRA_FILES: u32 = 1 << 0;
/// `ProbeConfig::flags`: the daemon filled this record; programs do nothing until it is set.
pub const CFG_READY: u32 = 1 << 1;
/// `ProbeConfig::flags`: no file-release hook is attached (tracepoint mode), so the exit
/// tracepoint searches a dying process's descriptors for control files it releases.
pub const CFG_EXIT_RELEASE: u32 = 1 << 2;

/// `ProbeConfig::flags`: the in-container memory view is on: a limited cgroup's processes read
/// their limit as the GPU's memory size (the replies of the memory-info controls are rewritten
/// at the ioctl's exit). Set only while the rewriting exit program is attached.
pub const CFG_VIRT_MEMINFO: u32 = 1 << 3;
/// `ProbeConfig::flags`: the scheduler guard looks at tenants' scheduling controls
/// (`[enforcement] scheduler_guard` is `audit` or `enforce`).
pub const CFG_SCHED_GUARD: u32 = 1 << 4;
/// `ProbeConfig::flags`: the guard acts (`enforce`); without it, it only reports (`audit`).
pub const CFG_SCHED_ENFORCE: u32 = 1 << 5;
/// `ProbeConfig::flags`: where no hook can refuse a forbidden control, kill its caller at the
/// call's entry (`[enforcement] guard_react_action = "kill"`); otherwise only report it.
pub const CFG_GUARD_KILL: u32 = 1 << 6;
/// `ProbeConfig::flags`: the limit walks may skip the levels an ancestry record's
/// [`limits_seen`] word says have no limit. Set where loads are not reordered with older loads
/// (x86-64), which the word's validity relies on: a walk that read the generation the daemon
/// wrote after a limit sees that limit.
pub const CFG_LIMITS_SEEN: u32 = 1 << 7;

/// The single value of the `CONFIG` array map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeConfig {
    /// Field offsets for reading kernel structs with `bpf_probe_read_kernel`.
    pub offsets: KernelOffsets,
    /// Dynamic major of `nvidia-uvm` from `/proc/devices`; 0 when the module is not loaded.
    pub uvm_major: u32,
    /// Dynamic major of `nvidia-caps`; 0 when absent.
    pub caps_major: u32,
    /// Dynamic major of `nvidia-caps-imex-channels`; 0 when absent.
    pub caps_imex_major: u32,
    /// `CFG_*` bits.
    pub flags: u32,
    /// What the kernel side does itself when an allocation takes a cgroup over a GPU-memory
    /// limit: `REACT_*`.
    pub react_action: u32,
    /// The daemon's process: its own RM controls (the compute law's) pass the scheduler guard.
    pub daemon_tgid: u32,
    /// The longest channel-group timeslice (µs) a tenant may set where no `SCHED_ALLOW` entry
    /// of its cgroup or an ancestor says otherwise.
    pub guard_timeslice_us: u64,
    /// Most `OBJECTS` entries one cgroup may hold ([`CgroupUsage::objects`]); 0: no cap. One tenant making
    /// RM clients in a loop (they cost no GPU memory) cannot fill the map the host shares.
    pub objects_per_cgroup: u32,
    /// Explicit padding (always 0), so the layout has no implicit holes.
    pub _pad: u32,
}

/// `ProbeConfig::react_action`: only report the crossing (ring-buffer event, counter).
pub const REACT_NOTIFY: u32 = 0;
/// `ProbeConfig::react_action`: also `SIGKILL` the allocating process, from the probe.
pub const REACT_KILL: u32 = 1;
/// `ProbeConfig::react_action`: report; the daemon freezes the cgroup.
pub const REACT_FREEZE: u32 = 2;

/// Indices into the `STATS` per-CPU array: health counters of the kernel side.
pub mod stat {
    /// Ring-buffer reservations that failed (events lost).
    pub const EVENTS_LOST: u32 = 0;
    /// Inserts into `PROCS` that failed (map full): the process is not tracked.
    pub const PROCS_FULL: u32 = 1;
    /// Inserts into `CGROUPS` that failed (map full): the ioctl is not counted per cgroup.
    pub const CGROUPS_FULL: u32 = 2;
    /// Matched ioctls (all classes), for rate metrics.
    pub const MATCHED_IOCTLS: u32 = 3;
    /// Inserts into `OBJECTS` that failed (map full): that object is not accounted.
    pub const OBJECTS_FULL: u32 = 4;
    /// Video-memory allocations charged.
    pub const CHARGES: u32 = 5;
    /// Video-memory objects uncharged (freed, subtree, client or file release).
    pub const UNCHARGES: u32 = 6;
    /// Allocations whose parameters could not be read or were malformed: not charged.
    pub const UNREADABLE: u32 = 7;
    /// Allocations refused by the `deny` tier.
    pub const DENIED: u32 = 8;
    /// Allocations that took a cgroup over a limit after the fact (`react` tier).
    pub const CROSSED: u32 = 9;
    /// Video-memory allocations whose parent object was not known: charged to `GPU_UNKNOWN`.
    pub const UNKNOWN_GPU: u32 = 10;
    /// Memory-info replies (FB info lists, VID_HEAP_CONTROL INFO) given a limited cgroup's view.
    pub const MEMINFO_REWRITTEN: u32 = 11;
    /// Memory-info replies of a limited cgroup left as the driver wrote them: unreadable,
    /// malformed (a list size the driver would not have answered) or not writable.
    pub const MEMINFO_SKIPPED: u32 = 12;
    /// Scheduling controls of tenants the guard acted on or, in `audit`, reported.
    pub const SCHED_GUARDED: u32 = 13;
    /// Of those, calls not sent as an event (their cgroup's burst spent); counted all the same.
    pub const SCHED_GUARD_QUIET: u32 = 14;
    /// Calls the guard acted on whose `GUARD_COUNTS` entry could not be made (map full).
    pub const GUARD_COUNTS_FULL: u32 = 15;
    /// Objects the daemon's sweep released as orphans: no client record and no known control
    /// file, so no release rule could ever reach them (a race the rules missed, or an object of
    /// an older daemon).
    pub const ORPHANS_RELEASED: u32 = 16;
    /// Duplicates of charged memory (`RM_DUP_OBJECT`) followed as references to its charge.
    pub const DUPLICATES: u32 = 17;
    /// Video-memory allocations charged although the status read back says the driver failed
    /// them: under a limit, a status rewritten by another thread of the caller must not erase a
    /// charge (docs/design.md, "Threat model").
    pub const UNCONFIRMED: u32 = 18;
    /// RM calls whose `NV_ESC_IOCTL_XFER_CMD` header changed while the driver ran: what the
    /// driver did is not what the entry side saw (a limited caller counts as crossing).
    pub const RACED: u32 = 19;
    /// Read-backs asked of the daemon after tenants' controls on files with channel groups
    /// ([`EVENT_GUARD_READ_BACK`](crate::EVENT_GUARD_READ_BACK)).
    pub const READ_BACKS: u32 = 20;
    /// Channel groups not entered in `SCHED_GROUPS` (map full): their timeslice is not read back.
    pub const SCHED_GROUPS_FULL: u32 = 21;
    /// Releases of control files through which no object was recorded, not sent: nothing to
    /// release (a tenant opening and closing `/dev/nvidiactl` in a loop costs gpud nothing).
    pub const FILE_RELEASES_SKIPPED: u32 = 22;
    /// Control files not entered in `FILE_MARKS` (map full): their release is found by the
    /// daemon's sweep instead of an event.
    pub const FILE_MARKS_FULL: u32 = 23;
    /// Objects not recorded because their cgroup holds `ProbeConfig::objects_per_cgroup`
    /// entries of `OBJECTS` already (a limited cgroup's allocation then counts as crossing).
    pub const OBJECTS_CGROUP_CAP: u32 = 24;
    /// Objects whose cgroup has no `USAGE` record and `USAGE` no room for one: not counted,
    /// so not capped.
    pub const OBJ_COUNTS_FULL: u32 = 25;
    /// Objects of a previous ABI's maps the daemon took over (`gpud_adopt`) at an upgrade.
    pub const ADOPTED: u32 = 26;
    /// Sizes of limited cgroups' new memory objects asked of the daemon
    /// ([`EVENT_MEM_READ_BACK`](crate::EVENT_MEM_READ_BACK)).
    pub const MEMORY_READ_BACKS: u32 = 27;
    /// GPUs of limited cgroups' new devices asked of the daemon
    /// ([`EVENT_DEVICE_READ_BACK`](crate::EVENT_DEVICE_READ_BACK)).
    pub const DEVICE_READ_BACKS: u32 = 28;
    /// Frees by limited cgroups whose object the daemon is asked to find gone
    /// ([`EVENT_FREE_READ_BACK`](crate::EVENT_FREE_READ_BACK)).
    pub const FREE_READ_BACKS: u32 = 29;
    /// Number of counters.
    pub const COUNT: u32 = 30;
}

pub use events::*;
pub use objects::*;

/// Key of the `GUARD_COUNTS` map: the calls of a cgroup's processes the scheduler guard acted on
/// or reported, by command and verdict.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GuardKey {
    /// The caller's cgroup.
    pub cgroup_id: u64,
    /// The RM command.
    pub cmd: u32,
    /// `GUARD_*` action | `GUARD_REASON_*` << 8.
    pub verdict: u32,
}

/// Value of the `GUARD_BUCKET` map: a cgroup's guard events left to send, and when it was last
/// refilled (see [`EVENT_SCHED_GUARD`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuardBucket {
    /// Events it may still send now.
    pub tokens: u64,
    /// `bpf_ktime_get_ns()` of the last refill.
    pub at: u64,
}

/// Key of the `LIMITS` map: a cgroup and a GPU key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UsageKey {
    /// cgroup v2 id (the cgroup directory's inode number).
    pub cgroup_id: u64,
    /// RM device instance, `GPU_UNKNOWN`, or `GPU_ALL`.
    pub gpu: u32,
    /// Explicit padding (always 0): keys are compared byte for byte.
    pub _pad: u32,
}

impl UsageKey {
    /// The key of `cgroup_id`'s usage or limit on GPU key `gpu`.
    pub const fn new(cgroup_id: u64, gpu: u32) -> Self {
        Self {
            cgroup_id,
            gpu,
            _pad: 0,
        }
    }
}

/// GPU slots of a [`CgroupUsage`] record: the driver's device instances are below
/// `NV_MAX_DEVICES` (32, `nvlimits.h`).
pub const USAGE_GPUS: usize = 32;
/// Slots of a [`CgroupUsage`] record: [`GPU_ALL`]'s, then one per device instance, then
/// [`GPU_UNKNOWN`]'s.
pub const USAGE_SLOTS: usize = USAGE_GPUS + 2;

/// Value of the `USAGE` map, keyed by cgroup id: the bytes of video memory charged to the
/// cgroup and its descendants, per GPU and in total, in one record so that a charge looks each
/// ancestry level up once. Hierarchical: an allocation is charged to its cgroup and every
/// ancestor, on its GPU's slot and on the `GPU_ALL` slot. The record also counts the cgroup's
/// own `OBJECTS` entries, for its cap: an allocation's record and charge touch one record of
/// its cgroup, not two of two maps. The fields a charge on the first GPUs writes (the count,
/// the total, the GPU's bytes) come first, next to the map's key: one or two cache lines per
/// record instead of three.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupUsage {
    /// `OBJECTS` entries recorded for this cgroup itself (not its descendants), for the
    /// per-cgroup cap ([`ProbeConfig::objects_per_cgroup`]). Read as signed: releases of
    /// entries recorded before the count began may take it below zero.
    pub objects: u64,
    /// Bytes by slot ([`CgroupUsage::slot`]).
    pub bytes: [u64; USAGE_SLOTS],
}

impl Default for CgroupUsage {
    fn default() -> Self {
        Self {
            objects: 0,
            bytes: [0; USAGE_SLOTS],
        }
    }
}

impl CgroupUsage {
    /// The slot of GPU key `gpu`. A device instance the driver cannot have shares
    /// [`GPU_UNKNOWN`]'s slot (the programs charge memory on such a device to `GPU_UNKNOWN`).
    #[inline(always)]
    pub const fn slot(gpu: u32) -> usize {
        match gpu {
            GPU_ALL => Self::ALL,
            g => Self::charge_slot(g),
        }
    }

    /// The slot of [`GPU_ALL`]'s total.
    pub const ALL: usize = 0;

    /// The slot of [`GPU_UNKNOWN`]'s bytes.
    pub const UNKNOWN: usize = USAGE_GPUS + 1;

    /// The slot memory on GPU key `gpu` is charged to besides [`Self::ALL`]: its own, or
    /// [`GPU_UNKNOWN`]'s for any other key (`GPU_ALL` names no GPU memory is on); never
    /// [`Self::ALL`].
    #[inline(always)]
    pub const fn charge_slot(gpu: u32) -> usize {
        if (gpu as usize) < USAGE_GPUS {
            gpu as usize + 1
        } else {
            Self::UNKNOWN
        }
    }

    /// The GPU key of slot `slot` (below [`USAGE_SLOTS`]).
    pub const fn gpu_of_slot(slot: usize) -> u32 {
        match slot {
            Self::ALL => GPU_ALL,
            s if s <= USAGE_GPUS => (s - 1) as u32,
            _ => GPU_UNKNOWN,
        }
    }

    /// Bytes charged under GPU key `gpu`.
    pub const fn on(&self, gpu: u32) -> u64 {
        self.bytes[Self::slot(gpu)]
    }

    /// Whether nothing is charged on any GPU (the object count aside).
    pub fn is_empty(&self) -> bool {
        self.bytes.iter().all(|b| *b == 0)
    }

    /// (GPU key, bytes) of every slot holding bytes, `GPU_ALL`'s last.
    pub fn charged(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        (Self::ALL + 1..USAGE_SLOTS)
            .chain([Self::ALL])
            .map(|s| (Self::gpu_of_slot(s), self.bytes[s]))
            .filter(|(_, b)| *b != 0)
    }
}

/// Value of the `LIMITS` map, keyed by [`UsageKey`]: a cgroup's limit on one GPU key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelLimit {
    /// Maximum bytes.
    pub max: u64,
    /// Allocations that crossed this limit (`react`) or were refused by it (`deny`), like
    /// `memory.events`' `max`.
    pub events: u64,
}

/// Deepest cgroup level (root is level 0) the kernel side charges hierarchically.
pub const MAX_CGROUP_DEPTH: usize = 16;

/// Value of the `ANCESTRY` map, keyed by cgroup id: the ids from the root (level 0) down to the
/// cgroup itself, recorded at its first charge so uncharges from any context reach the same
/// ancestors.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ancestry {
    /// How many entries of `ids` are valid.
    pub depth: u32,
    /// Explicit padding (always 0).
    pub _pad: u32,
    /// cgroup ids, root first; the last valid one is the cgroup itself.
    pub ids: [u64; MAX_CGROUP_DEPTH],
    /// Which levels have no memory limit at all, as the kernel side last found them: see
    /// [`limits_seen`]. Written by the programs in place; 0 in every record the daemon writes.
    pub limits_seen: u64,
}

/// [`Ancestry::limits_seen`]: bit `i` of the low [`MAX_CGROUP_DEPTH`] bits set where `ids[i]`
/// had no `LIMITS` entry on any GPU (no `GPU_UNKNOWN` entry, which comes with every per-GPU
/// limit, and no `GPU_ALL` one), found under the `LIMITS_GEN` value in the bits above. The limit
/// walks skip those levels' lookups while the value is still `LIMITS_GEN`'s: the daemon adds 1
/// to it after every limit it writes and every `ANCESTRY` record it writes or removes, so a
/// level that gains a limit is looked up again from then on (docs/design.md, "Levels without
/// limits"). Generation 0 is never current (the daemon raises it when it starts), so 0, the
/// state of a record the daemon wrote or converted, skips nothing.
pub mod limits_seen {
    use crate::MAX_CGROUP_DEPTH;

    /// Bits of the level mask.
    pub const LEVEL_BITS: u32 = MAX_CGROUP_DEPTH as u32;
    const _: () = assert!(LEVEL_BITS <= 16);

    /// The word for `levels` (the bits of levels without a limit) found under `generation`.
    #[inline(always)]
    pub const fn word(generation: u64, levels: u32) -> u64 {
        (generation << LEVEL_BITS) | (levels as u64 & ((1 << LEVEL_BITS) - 1))
    }

    /// The levels `word` says have no limit, where it was found under `generation` (not 0);
    /// `None` where it is of another generation (nothing known).
    #[inline(always)]
    pub const fn levels(word: u64, generation: u64) -> Option<u32> {
        if generation != 0 && word >> LEVEL_BITS == generation {
            Some((word & ((1 << LEVEL_BITS) - 1)) as u32)
        } else {
            None
        }
    }
}

/// An RM call seen at the ioctl's entry whose result the exit side reads, kept per thread in the
/// task-storage map `CALLS` (never read by the daemon; `nr` 0 there: no call in flight).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    /// The control `struct file`.
    pub file: u64,
    /// User address of the parameter struct (the inner one for an XFER).
    pub params: u64,
    /// Escape number (`_IOC_NR`, or the XFER's inner `cmd`).
    pub nr: u32,
    /// Parameter size (`_IOC_SIZE`, or the XFER's inner `size`): tells NVOS21 from NVOS64.
    pub size: u32,
    /// A memory-info call of a limited cgroup whose reply the exit side rewrites: the RM
    /// control command (`RM_CONTROL`), or `NVOS32_FUNCTION_INFO` (`VID_HEAP_CONTROL`); 0 for
    /// every other call.
    pub cmd: u32,
    /// The GPU that call asks about (`GPU_UNKNOWN` when its subdevice is not known).
    pub gpu: u32,
    /// What the entry side read before the driver ran, for the accounting's calls (`op`; all 0
    /// for other calls). The return side keys and sizes its charges by these and reads back
    /// only what the driver writes (the status, a handle RM picked, the allocated size), never
    /// to lower a charge or to replace another entry: a second thread of the caller may
    /// rewrite the struct once the driver has answered (docs/design.md, "Threat model").
    /// The client (`hRoot`, `hClient`).
    pub client: u32,
    /// The parent of a new object.
    pub parent: u32,
    /// The new object's handle, or the one freed; 0 when RM picks it (read back at the return).
    pub handle: u32,
    /// The class allocated (`NV01_MEMORY_LOCAL_USER` for a video-memory VID_HEAP_CONTROL).
    pub class: u32,
    /// `OP_*`: what the return side does.
    pub op: u32,
    /// Explicit padding.
    pub _pad: u32,
    /// Bytes asked for (video memory; 0 when unreadable) or the device id (`NV01_DEVICE_0`).
    pub arg: u64,
    /// User address of the size the driver writes back (video memory), else 0.
    pub size_at: u64,
    /// User address of the `NV_ESC_IOCTL_XFER_CMD` header the call came in (0: not wrapped):
    /// the return side checks it still names the same call.
    pub xfer: u64,
    /// A duplicate of charged memory: the source's entry, with `charge` 0 when no reference
    /// could be taken (`SHARES` full); `kind` 0 for any other call.
    pub src: ObjEntry,
}

/// `Pending::op`: an allocation (`RM_ALLOC`, or a VID_HEAP_CONTROL allocation function).
pub const OP_ALLOC: u32 = 1;
/// `Pending::op`: a free (`RM_FREE`, or VID_HEAP_CONTROL `FREE`).
pub const OP_FREE: u32 = 2;
/// `Pending::op`: `RM_DUP_OBJECT`.
pub const OP_DUP: u32 = 3;

/// Map names, as written in the eBPF object and pinned in bpffs.
pub mod maps {
    /// Array of one [`ProbeConfig`](crate::ProbeConfig), written by the daemon at start.
    pub const CONFIG: &str = "CONFIG";
    /// Hash [`FileKey`](crate::FileKey) → `DeviceKind as u32`: files that stand in for NVIDIA
    /// devices (`devices.extra_paths`).
    pub const EXTRA_FILES: &str = "EXTRA_FILES";
    /// Hash tgid → [`ProcEntry`](crate::ProcEntry): processes holding or using NVIDIA files.
    pub const PROCS: &str = "PROCS";
    /// Hash cgroup id → [`IoctlCounts`](crate::IoctlCounts).
    pub const CGROUPS: &str = "CGROUPS";
    /// Ring buffer of [`Event`](crate::Event) records.
    pub const EVENTS: &str = "EVENTS";
    /// Per-CPU array of `u64` health counters, indexed by [`stat`](crate::stat).
    pub const STATS: &str = "STATS";
    /// Array of `u64` words, [`TRACKED_PER_WORD`](crate::TRACKED_PER_WORD) processes each.
    pub const TRACKED: &str = "TRACKED";
    /// Hash [`ObjKey`](crate::ObjKey) → [`ObjEntry`](crate::ObjEntry): RM objects followed.
    pub const OBJECTS: &str = "OBJECTS";
    /// Hash cgroup id → [`CgroupUsage`](crate::CgroupUsage): bytes of video memory charged, and
    /// the cgroup's own `OBJECTS` entries.
    pub const USAGE: &str = "USAGE";
    /// Hash [`UsageKey`](crate::UsageKey) → [`KernelLimit`](crate::KernelLimit).
    pub const LIMITS: &str = "LIMITS";
    /// Hash cgroup id → [`Ancestry`](crate::Ancestry).
    pub const ANCESTRY: &str = "ANCESTRY";
    /// Hash cgroup id → the longest timeslice (µs) its tenants may set on their channel groups
    /// (the scheduler guard's allowance; the least over a cgroup's ancestry holds).
    pub const SCHED_ALLOW: &str = "SCHED_ALLOW";
    /// Hash [`ObjKey`](crate::ObjKey) → `u32` (1): channel groups the daemon's compute law holds
    /// off the runlist and channels it holds disabled; the scheduler guard refuses their owners'
    /// own `GPFIFO_SCHEDULE` and `FIFO_DISABLE_CHANNELS` enables of them.
    pub const HELD_GROUPS: &str = "HELD_GROUPS";
    /// Hash [`GuardKey`](crate::GuardKey) → `u64`: every call the scheduler guard acted on or
    /// reported, by cgroup, command and verdict.
    pub const GUARD_COUNTS: &str = "GUARD_COUNTS";
    /// LRU hash cgroup id → [`GuardBucket`](crate::GuardBucket): the guard events it may send.
    pub const GUARD_BUCKET: &str = "GUARD_BUCKET";
    /// Hash charge ([`ObjEntry::charge`](crate::ObjEntry)) → `u64`: the references to a
    /// charged allocation beyond one (its duplicates); absent for memory never duplicated.
    pub const SHARES: &str = "SHARES";
    /// Hash control file (`struct file` address) → `u32`: files through which gpud saw channel
    /// groups made; 1 while a read-back of them is asked and not yet begun, else 0.
    pub const SCHED_FILES: &str = "SCHED_FILES";
    /// Hash [`ObjKey`](crate::ObjKey) of a channel group → the control file (`struct file`
    /// address) it was made through: what a read-back of that file reads.
    pub const SCHED_GROUPS: &str = "SCHED_GROUPS";
    /// Hash control file (`struct file` address) → `u32` (1): files through which an object was
    /// recorded in `OBJECTS`; only their releases are sent to the daemon.
    pub const FILE_MARKS: &str = "FILE_MARKS";
    /// Array of one `u64`: the limits' generation, which the daemon raises after every limit
    /// and ancestry record it writes (see [`limits_seen`](crate::limits_seen)).
    pub const LIMITS_GEN: &str = "LIMITS_GEN";

    /// Every pinned map: the daemon checks each one's layout before adopting its pin.
    pub const ALL: [&str; 20] = [
        CONFIG,
        EXTRA_FILES,
        PROCS,
        CGROUPS,
        EVENTS,
        STATS,
        TRACKED,
        OBJECTS,
        USAGE,
        LIMITS,
        ANCESTRY,
        SCHED_ALLOW,
        HELD_GROUPS,
        GUARD_COUNTS,
        GUARD_BUCKET,
        SHARES,
        SCHED_FILES,
        SCHED_GROUPS,
        FILE_MARKS,
        LIMITS_GEN,
    ];
}

/// Program names, as written in the eBPF object (the entry points' `fn` names in `gpud-ebpf`).
/// The daemon loads, attaches and runs programs by these names.
pub mod programs {
    /// fentry on `security_file_ioctl`: counts ioctls on NVIDIA files and notes RM calls
    /// (fentry mode, `react` tier).
    pub const FENTRY_IOCTL: &str = "gpud_fentry_ioctl";
    /// [`FENTRY_IOCTL`] on `security_file_ioctl_compat` (32-bit callers, kernels 6.8+).
    pub const FENTRY_IOCTL_COMPAT: &str = "gpud_fentry_ioctl_compat";
    /// BPF-LSM `file_ioctl`: [`FENTRY_IOCTL`] that also refuses allocations over a limit
    /// (`deny` tier).
    pub const LSM_IOCTL: &str = "gpud_lsm_ioctl";
    /// [`LSM_IOCTL`] on `file_ioctl_compat`.
    pub const LSM_IOCTL_COMPAT: &str = "gpud_lsm_ioctl_compat";
    /// [`FENTRY_IOCTL`] that may also rewrite a tenant's scheduling control
    /// (`bpf_probe_write_user`): attached instead of it where the kernel allows the helper.
    pub const FENTRY_IOCTL_RW: &str = "gpud_fentry_ioctl_rw";
    /// [`FENTRY_IOCTL_RW`] on `security_file_ioctl_compat`.
    pub const FENTRY_IOCTL_COMPAT_RW: &str = "gpud_fentry_ioctl_compat_rw";
    /// [`LSM_IOCTL`] that may also rewrite a tenant's scheduling control.
    pub const LSM_IOCTL_RW: &str = "gpud_lsm_ioctl_rw";
    /// [`LSM_IOCTL_RW`] on `file_ioctl_compat`.
    pub const LSM_IOCTL_COMPAT_RW: &str = "gpud_lsm_ioctl_compat_rw";
    /// fmod_ret (`BPF_MODIFY_RETURN`) on `security_file_ioctl`: [`LSM_IOCTL`] where BPF-LSM does
    /// not run (`bpf` left out of `lsm=`); its return value replaces the hook's, so a refusal
    /// stops the ioctl before the driver as LSM's does. aya 0.14 has no loader for this attach
    /// type: the object carries these in `fentry/` sections and the daemon loads them itself.
    pub const FMODRET_IOCTL: &str = "gpud_fmodret_ioctl";
    /// [`FMODRET_IOCTL`] on `security_file_ioctl_compat`.
    pub const FMODRET_IOCTL_COMPAT: &str = "gpud_fmodret_ioctl_compat";
    /// [`FMODRET_IOCTL`] that may also rewrite a tenant's scheduling control.
    pub const FMODRET_IOCTL_RW: &str = "gpud_fmodret_ioctl_rw";
    /// [`FMODRET_IOCTL_RW`] on `security_file_ioctl_compat`.
    pub const FMODRET_IOCTL_COMPAT_RW: &str = "gpud_fmodret_ioctl_compat_rw";
    /// Loaded and attached for a moment to learn whether the kernel runs fmod_ret programs on
    /// `security_file_ioctl`; returns 0 (lets every call through).
    pub const FMODRET_PROBE: &str = "gpud_fmodret_probe";
    /// fexit on the architecture's `sys_ioctl` entry: the return side of RM calls.
    pub const FEXIT_IOCTL: &str = "gpud_fexit_ioctl";
    /// [`FEXIT_IOCTL`] on the 32-bit compat entry.
    pub const FEXIT_IOCTL_COMPAT: &str = "gpud_fexit_ioctl_compat";
    /// [`FEXIT_IOCTL`] that also rewrites the memory-info replies of limited cgroups
    /// (`bpf_probe_write_user`): attached instead of it where the kernel allows the helper.
    pub const FEXIT_IOCTL_RW: &str = "gpud_fexit_ioctl_rw";
    /// [`FEXIT_IOCTL_RW`] on the 32-bit compat entry.
    pub const FEXIT_IOCTL_COMPAT_RW: &str = "gpud_fexit_ioctl_compat_rw";
    /// fentry on `security_file_free`: the last reference to a control file is dropped.
    pub const FENTRY_FILE_FREE: &str = "gpud_fentry_file_free";
    /// fentry on `security_file_open`: marks processes that open an NVIDIA file.
    pub const FENTRY_OPEN: &str = "gpud_fentry_open";
    /// Loaded (never attached) to learn whether the kernel accepts BPF-LSM programs.
    pub const LSM_PROBE: &str = "gpud_lsm_probe";
    /// Loaded (never attached) to learn whether the kernel lets programs call
    /// `bpf_probe_write_user`, before a rewriting twin (`*_RW`) is loaded.
    pub const WRITE_USER_PROBE: &str = "gpud_write_user_probe";
    /// `syscalls:sys_enter_ioctl` (tracepoint mode).
    pub const TP_IOCTL: &str = "gpud_tp_ioctl";
    /// [`TP_IOCTL`] that may also rewrite a tenant's scheduling control.
    pub const TP_IOCTL_RW: &str = "gpud_tp_ioctl_rw";
    /// `syscalls:sys_exit_ioctl`: the return side in tracepoint mode.
    pub const TP_IOCTL_EXIT: &str = "gpud_tp_ioctl_exit";
    /// [`TP_IOCTL_EXIT`] that also rewrites the memory-info replies of limited cgroups.
    pub const TP_IOCTL_EXIT_RW: &str = "gpud_tp_ioctl_exit_rw";
    /// `syscalls:sys_enter_close`: closing the only reference to a control file.
    pub const TP_CLOSE: &str = "gpud_tp_close";
    /// `syscalls:sys_exit_open*`: marks processes that open an NVIDIA file.
    pub const TP_OPEN: &str = "gpud_tp_open";
    /// Raw tracepoint `sys_enter` (tracepoint mode, x86-64): the entry of ioctls and closes,
    /// 64-bit and 32-bit (ia32 and x32, which the `syscalls:*` tracepoints skip); attached
    /// instead of [`TP_IOCTL`] and [`TP_CLOSE`] where 32-bit callers are followed.
    pub const TP_SYS_ENTER: &str = "gpud_tp_sys_enter";
    /// [`TP_SYS_ENTER`] that may also rewrite a tenant's scheduling control.
    pub const TP_SYS_ENTER_RW: &str = "gpud_tp_sys_enter_rw";
    /// Raw tracepoint `sys_exit`: the return side of ioctls, 64-bit and 32-bit, and of 32-bit
    /// opens; attached instead of [`TP_IOCTL_EXIT`] beside [`TP_SYS_ENTER`].
    pub const TP_SYS_EXIT: &str = "gpud_tp_sys_exit";
    /// [`TP_SYS_EXIT`] that also rewrites the memory-info replies of limited cgroups.
    pub const TP_SYS_EXIT_RW: &str = "gpud_tp_sys_exit_rw";
    /// Raw tracepoint `sched_process_fork`: children of tracked processes are tracked.
    pub const TP_FORK: &str = "gpud_tp_fork";
    /// `sched:sched_process_exit` (both modes): a tracked process is gone.
    pub const TP_EXIT: &str = "gpud_tp_exit";
    /// Run by the daemon (`BPF_PROG_TEST_RUN`) to mark a process it found holding an NVIDIA file.
    pub const SEED: &str = "gpud_seed";
    /// Run by the daemon to release an object below a freed subtree, client or file.
    pub const RELEASE: &str = "gpud_release";
    /// Run by the daemon to ask whether a control file is still referenced (by a descriptor in
    /// any process, a mapping, a message in flight): its clients live exactly that long.
    pub const FILE_HELD: &str = "gpud_file_held";
    /// Run by the daemon at an upgrade to record an object of the previous ABI's maps in this
    /// ABI's (counted, its file marked, its memory charged or shared) unless one is recorded
    /// under its key already.
    pub const ADOPT: &str = "gpud_adopt";
    /// Benchmark reference (`xtask bench`): an empty raw tracepoint program.
    pub const NOOP_RAW_TP: &str = "gpud_noop_raw_tp";
    /// Benchmark reference: an empty fentry program on `security_file_ioctl`.
    pub const NOOP_FENTRY: &str = "gpud_noop_fentry";
    /// Benchmark reference: an empty fexit program on the ioctl syscall's entry (where fentry
    /// mode attaches its return side).
    pub const NOOP_FEXIT: &str = "gpud_noop_fexit";
}

/// The previous ABI, whose pinned maps a daemon of this one takes over at an upgrade
/// (docs/design.md, "Upgrades"): its version and its layouts, defined here beside the current
/// ones. ABI 8 changed `STATS` (it gained [`stat::ADOPTED`](crate::stat::ADOPTED)) and
/// `ANCESTRY`'s records (they gained [`limits_seen`](crate::Ancestry::limits_seen)), added
/// `LIMITS_GEN`, and moved `OBJ_COUNTS` into the `USAGE` records ([`CgroupUsage`](crate::CgroupUsage),
/// which also changed to one record per cgroup): neither is copied at an upgrade, the adoption of
/// every object rebuilds both. `OBJECTS`' entries gained [`flags`](crate::ObjEntry::flags) in
/// ABI 8 (read as [`ObjEntry`] here, converted at their adoption). Every other map has the same
/// names, keys and values in both, so they are re-exported from the current definitions. A
/// layout that changes moves here as it was, beside its conversion's input, and stays until the
/// ABI after next.
pub mod previous {
    use crate::MAX_CGROUP_DEPTH;

    /// The previous ABI's version: its pins are under `<bpffs>/gpud/v7/`.
    pub const ABI_VERSION: u32 = 7;
    /// Counters in its `STATS` (the same indices as [`stat`](crate::stat) up to this).
    pub const STAT_COUNT: u32 = 26;
    pub use crate::{GuardBucket, GuardKey, IoctlCounts, KernelLimit, ObjKey, ProcEntry, UsageKey};

    /// ABI 7's `OBJECTS` entry: [`crate::ObjEntry`] without `flags`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct ObjEntry {
        /// As [`crate::ObjEntry::kind`].
        pub kind: u32,
        /// As [`crate::ObjEntry::parent`].
        pub parent: u32,
        /// As [`crate::ObjEntry::gpu`].
        pub gpu: u32,
        /// As [`crate::ObjEntry::tgid`].
        pub tgid: u32,
        /// As [`crate::ObjEntry::cgroup_id`].
        pub cgroup_id: u64,
        /// As [`crate::ObjEntry::bytes`].
        pub bytes: u64,
        /// As [`crate::ObjEntry::file`].
        pub file: u64,
        /// As [`crate::ObjEntry::serial`].
        pub serial: u64,
        /// As [`crate::ObjEntry::charge`].
        pub charge: u64,
    }

    impl From<ObjEntry> for crate::ObjEntry {
        /// The same object; its flags are the adopting program's to set.
        fn from(e: ObjEntry) -> Self {
            Self {
                kind: e.kind,
                parent: e.parent,
                gpu: e.gpu,
                tgid: e.tgid,
                cgroup_id: e.cgroup_id,
                bytes: e.bytes,
                file: e.file,
                serial: e.serial,
                charge: e.charge,
                flags: 0,
                _pad: 0,
            }
        }
    }

    /// ABI 7's `ANCESTRY` record: [`crate::Ancestry`] without `limits_seen`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Ancestry {
        /// As [`crate::Ancestry::depth`].
        pub depth: u32,
        /// Explicit padding (always 0).
        pub _pad: u32,
        /// As [`crate::Ancestry::ids`].
        pub ids: [u64; MAX_CGROUP_DEPTH],
    }

    impl From<Ancestry> for crate::Ancestry {
        /// The same levels; nothing known yet of which have limits.
        fn from(a: Ancestry) -> Self {
            Self {
                depth: a.depth,
                _pad: 0,
                ids: a.ids,
                limits_seen: 0,
            }
        }
    }
}

/// Capacity of `PROCS`, tracked processes on the host, as built; the daemon sets it at load time
/// from `probes.max_procs` (this is its default).
pub const MAX_PROCS: u32 = 65_536;
/// Capacity of `CGROUPS` and `ANCESTRY`: cgroups that used an NVIDIA file or were charged.
pub const MAX_CGROUPS: u32 = 16_384;
/// Capacity of `EXTRA_FILES`.
pub const MAX_EXTRA_FILES: u32 = 256;
/// The event ring's size in the object; the daemon sets it at load (`probes.events_ring_kib`,
/// whose default this is).
pub const EVENTS_BYTES: u32 = 1024 * 1024;
/// Capacity of `OBJECTS` as built; the daemon sets it at load time from `probes.max_objects`
/// (this is its default).
pub const MAX_OBJECTS: u32 = 262_144;
/// Capacity of `SHARES`: duplicated allocations followed at once.
pub const MAX_SHARES: u32 = 65_536;
/// Capacity of `USAGE`: cgroups charged, each charged cgroup's ancestors included, and cgroups
/// holding recorded objects.
pub const MAX_USAGE: u32 = MAX_CGROUPS;
/// Capacity of `LIMITS`.
pub const MAX_LIMITS: u32 = 16_384;
/// Capacity of `SCHED_ALLOW`: cgroups with a timeslice allowance of their own.
pub const MAX_SCHED_ALLOW: u32 = 4_096;
/// Capacity of `HELD_GROUPS`: channel groups held off the runlist and channels held disabled at
/// once.
pub const MAX_HELD_GROUPS: u32 = 16_384;
/// Capacity of `GUARD_COUNTS`: (cgroup, command, verdict) triples counted.
pub const MAX_GUARD_COUNTS: u32 = 16_384;
/// Capacity of `GUARD_BUCKET` (an LRU: the least recent cgroup's bucket goes, refilled).
pub const MAX_GUARD_BUCKETS: u32 = 4_096;
/// Capacity of `FILE_MARKS`: control files with recorded objects at once.
pub const MAX_FILE_MARKS: u32 = 65_536;
/// Capacity of `SCHED_FILES`: control files with channel groups at once.
pub const MAX_SCHED_FILES: u32 = 16_384;
/// Capacity of `SCHED_GROUPS`: channel groups whose timeslice a read-back checks.
pub const MAX_SCHED_GROUPS: u32 = 65_536;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)], Copy, contain only integers and have no implicit
    // padding (padding is spelled out as `_pad` fields), so any bit pattern is valid.
    unsafe impl aya::Pod for super::IoctlCounts {}
    unsafe impl aya::Pod for super::ProcEntry {}
    unsafe impl aya::Pod for super::FileKey {}
    unsafe impl aya::Pod for super::ProbeConfig {}
    unsafe impl aya::Pod for super::Event {}
    unsafe impl aya::Pod for super::ObjKey {}
    unsafe impl aya::Pod for super::ObjEntry {}
    unsafe impl aya::Pod for super::CgroupUsage {}
    unsafe impl aya::Pod for super::UsageKey {}
    unsafe impl aya::Pod for super::KernelLimit {}
    unsafe impl aya::Pod for super::Ancestry {}
    unsafe impl aya::Pod for super::Pending {}
    unsafe impl aya::Pod for super::GuardKey {}
    unsafe impl aya::Pod for super::GuardBucket {}
    unsafe impl aya::Pod for super::previous::Ancestry {}
    unsafe impl aya::Pod for super::previous::ObjEntry {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_slots_name_every_gpu_key_once_and_alias_impossible_instances_to_unknown() {
        for s in 0..USAGE_SLOTS {
            let gpu = CgroupUsage::gpu_of_slot(s);
            assert_eq!(CgroupUsage::slot(gpu), s, "slot {s} ↔ GPU key {gpu:#x}");
        }
        assert_eq!(
            CgroupUsage::slot(USAGE_GPUS as u32),
            CgroupUsage::slot(GPU_UNKNOWN)
        );
        assert_eq!(
            CgroupUsage::slot(0x8000_0000),
            CgroupUsage::slot(GPU_UNKNOWN)
        );

        let mut r = CgroupUsage::default();
        assert!(r.is_empty());
        r.bytes[CgroupUsage::slot(3)] = 7;
        r.bytes[CgroupUsage::slot(GPU_ALL)] = 7;
        assert_eq!((r.on(3), r.on(GPU_ALL), r.on(0)), (7, 7, 0));
        let mut charged = r.charged();
        assert_eq!(charged.next(), Some((3, 7)));
        assert_eq!(charged.next(), Some((GPU_ALL, 7)));
        assert_eq!(charged.next(), None);
    }
}
