//! The kernel/user ABI of gpud, defined once.
//!
//! Everything here is shared by the eBPF programs (`gpud-ebpf`, `no_std`) and the daemon (`gpud`):
//! map keys and values, ring-buffer event records, the kernel-offsets record the daemon computes
//! from BTF, and the NVIDIA ioctl numbers with the classifier that turns a command into a class.
//! Layouts are `#[repr(C)]` with explicit padding so both sides agree byte for byte.
#![no_std]

pub mod nv;
pub mod rm;

/// Bumped whenever a map layout, map name or event record changes. Maps are pinned under
/// `<bpffs>/gpud/v<ABI_VERSION>/`, so a daemon of another ABI never reads a foreign layout.
pub const ABI_VERSION: u32 = 1;

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
    pub _pad: u32,
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
    pub dev: u64,
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
/// All values are byte offsets.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub task_files: u32,
    pub task_tgid: u32,
    pub task_signal: u32,
    pub signal_live: u32,
    pub files_fdt: u32,
    pub fdt_max_fds: u32,
    pub fdt_fd: u32,
    pub file_inode: u32,
    pub inode_rdev: u32,
    pub inode_ino: u32,
    pub inode_sb: u32,
    pub sb_dev: u32,
}

/// `ProbeConfig::flags`: `EXTRA_FILES` is non-empty, so unmatched device numbers must still be
/// looked up by (device, inode).
pub const CFG_HAS_EXTRA_FILES: u32 = 1 << 0;
/// `ProbeConfig::flags`: the daemon filled this record; programs do nothing until it is set.
pub const CFG_READY: u32 = 1 << 1;

/// The single value of the `CONFIG` array map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeConfig {
    pub offsets: KernelOffsets,
    /// Dynamic major of `nvidia-uvm` from `/proc/devices`; 0 when the module is not loaded.
    pub uvm_major: u32,
    /// Dynamic major of `nvidia-caps`; 0 when absent.
    pub caps_major: u32,
    /// Dynamic major of `nvidia-caps-imex-channels`; 0 when absent.
    pub caps_imex_major: u32,
    /// `CFG_*` bits.
    pub flags: u32,
}

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
    /// Number of counters.
    pub const COUNT: u32 = 4;
}

/// `Event::kind`: a process became tracked (opened an NVIDIA file, or first matched ioctl).
pub const EVENT_PROC_NEW: u32 = 1;
/// `Event::kind`: a tracked process exited (its last thread).
pub const EVENT_PROC_EXIT: u32 = 2;

/// Record sent through the `EVENTS` ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    pub kind: u32,
    pub tgid: u32,
    pub cgroup_id: u64,
}

/// Map names, as written in the eBPF object and pinned in bpffs.
pub mod maps {
    pub const CONFIG: &str = "CONFIG";
    pub const EXTRA_FILES: &str = "EXTRA_FILES";
    pub const PROCS: &str = "PROCS";
    pub const CGROUPS: &str = "CGROUPS";
    pub const EVENTS: &str = "EVENTS";
    pub const STATS: &str = "STATS";
    pub const TRACKED: &str = "TRACKED";
}

/// Capacities of the maps.
pub const MAX_PROCS: u32 = 65_536;
pub const MAX_CGROUPS: u32 = 16_384;
pub const MAX_EXTRA_FILES: u32 = 256;
pub const EVENTS_BYTES: u32 = 256 * 1024;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)], Copy, contain only integers and have no implicit
    // padding (padding is spelled out as `_pad` fields), so any bit pattern is valid.
    unsafe impl aya::Pod for super::IoctlCounts {}
    unsafe impl aya::Pod for super::ProcEntry {}
    unsafe impl aya::Pod for super::FileKey {}
    unsafe impl aya::Pod for super::ProbeConfig {}
    unsafe impl aya::Pod for super::Event {}
}
