//! Reading kernel structs: the file behind a descriptor, and whether a `struct file` is an NVIDIA
//! device.
//!
//! Two readers share one walk ([`KernelReader`]): [`ProbeRead`] uses `bpf_probe_read_kernel` with
//! the offsets the daemon put in `CONFIG` (any program type), [`BtfRead`] uses direct loads with
//! the offsets frozen into `.rodata` (fentry, fexit and LSM programs, whose loads the verifier
//! checks against the kernel's BTF).

use aya_ebpf::{
    Global,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel},
};
use gpud_common::{
    CFG_HAS_EXTRA_FILES, DeviceKind, FileKey, KERNEL_MINOR_BITS, KernelOffsets, compat, nv,
};

use crate::maps::{EXTRA_FILES, config};

/// The calling process's tgid (the userspace pid).
#[inline(always)]
pub(crate) fn current_tgid() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}

#[inline(always)]
pub(crate) unsafe fn read_at<T>(base: *const u8, offset: u32) -> Option<T> {
    unsafe { bpf_probe_read_kernel(base.add(offset as usize).cast::<T>()).ok() }
}

/// The calling task's descriptor table: `current->files->fdt`'s `fd` array and `max_fds`.
///
/// The task comes from `bpf_get_current_task_btf()`, so the verifier knows its type and the
/// pointers down to the array are direct loads it checks against the kernel's BTF (offsets
/// frozen into `.rodata`: [`BTF_TASK_FILES`] and the three after it), which tracepoint programs
/// may make as fentry programs do; a fault reads as zero. Four helper calls fewer per matched
/// ioctl than reading every link with `bpf_probe_read_kernel` (docs/benchmarks.md).
#[inline(always)]
pub(crate) unsafe fn fd_table() -> Option<(*const u8, u32)> {
    let task = unsafe { aya_ebpf::helpers::generated::bpf_get_current_task_btf() } as *const u8;
    let files: *const u8 = unsafe { BtfRead.load(task, BTF_TASK_FILES.load())? };
    if files.is_null() {
        return None;
    }
    let fdt: *const u8 = unsafe { BtfRead.load(files, BTF_FILES_FDT.load())? };
    if fdt.is_null() {
        return None;
    }
    let max_fds: u32 = unsafe { BtfRead.load(fdt, BTF_FDT_MAX_FDS.load())? };
    let fd_array: *const u8 = unsafe { BtfRead.load(fdt, BTF_FDT_FD.load())? };
    if fd_array.is_null() {
        None
    } else {
        Some((fd_array, max_fds))
    }
}

/// `fd_array[fd]`: a helper read, as the verifier allows no variable offset into a BTF pointer
/// and the array is `struct file **`, which it does not type. Null slots read as `None`.
#[inline(always)]
pub(crate) unsafe fn file_at(fd_array: *const u8, fd: u64) -> Option<*const u8> {
    let file: *const u8 =
        unsafe { bpf_probe_read_kernel(fd_array.add(fd as usize * 8).cast::<*const u8>()).ok()? };
    if file.is_null() { None } else { Some(file) }
}

/// `current->files->fdt->fd[fd]`, the file behind a descriptor of the calling process.
#[inline(always)]
pub(crate) unsafe fn file_of_fd(fd: u64) -> Option<*const u8> {
    let (fd_array, max_fds) = unsafe { fd_table()? };
    if fd >= max_fds as u64 {
        return None;
    }
    unsafe { file_at(fd_array, fd) }
}

/// How a program reads fields of kernel structs, with the offsets that go with it.
pub(crate) trait KernelReader {
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
pub(crate) struct ProbeRead<'a>(pub(crate) &'a KernelOffsets);

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
// helper call is needed (fentry hands over typed pointers). The daemon sets them by these names.
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
// The descriptor table's links (`task_struct.files`, `files_struct.fdt`, `fdtable.max_fds`,
// `fdtable.fd`), for [`fd_table`].
#[unsafe(no_mangle)]
static BTF_TASK_FILES: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_FILES_FDT: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_FDT_MAX_FDS: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static BTF_FDT_FD: Global<u32> = Global::new(0);

/// Offset of `task_struct.thread_info.status` (x86-64), frozen into .rodata by the daemon from
/// BTF; 0 where the kernel's BTF has none, and the 32-bit programs are not attached there.
#[unsafe(no_mangle)]
static TASK_TI_STATUS: Global<u32> = Global::new(0);

/// Whether the current task is in an i386 system call (the kernel's `in_ia32_syscall()`): a
/// BTF-checked load of `thread_info.status`, as [`fd_table`] loads, not a helper read (every
/// 64-bit ioctl past the filter asks, since i386's table gives its number to `lchown`).
#[inline(always)]
pub(crate) fn in_ia32_syscall() -> bool {
    let off = TASK_TI_STATUS.load();
    if off == 0 {
        return false;
    }
    let task = unsafe { aya_ebpf::helpers::generated::bpf_get_current_task_btf() } as *const u8;
    unsafe { BtfRead.load::<u32>(task, off) }.is_some_and(|s| s & compat::TS_COMPAT != 0)
}

/// Which system-call table a followed call's number is from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Abi {
    /// x86-64's own: arguments in rdi, rsi, rdx.
    Native,
    /// i386's (`int 0x80`, `sysenter`): ebx, ecx, edx.
    I386,
    /// x32's: rdi, rsi, rdx, each 32 bits wide.
    X32,
}

/// The first three arguments of a system call of `abi`, from the registers saved at its entry
/// (one helper read: a raw tracepoint's `regs` is untyped). A 32-bit call's are 32 bits wide
/// (x32's pointers too), whatever the upper halves of the registers hold.
#[inline(always)]
pub(crate) unsafe fn syscall_args(regs: *const u8, abi: Abi) -> Option<[u64; 3]> {
    if abi == Abi::I386 {
        const N: usize = (compat::REGS_DX - compat::REGS_BX) / 8 + 1;
        let at = |off: usize| (off - compat::REGS_BX) / 8;
        let r: [u64; N] =
            unsafe { bpf_probe_read_kernel(regs.add(compat::REGS_BX).cast::<[u64; N]>()).ok()? };
        let (a, b, c) = (
            r[at(compat::REGS_BX)],
            r[at(compat::REGS_CX)],
            r[at(compat::REGS_DX)],
        );
        return Some([a as u32 as u64, b as u32 as u64, c as u32 as u64]);
    }
    // dx, si, di lie side by side: one read of the three.
    const _: () =
        assert!(compat::REGS_SI == compat::REGS_DX + 8 && compat::REGS_DI == compat::REGS_SI + 8);
    let [dx, si, di]: [u64; 3] =
        unsafe { bpf_probe_read_kernel(regs.add(compat::REGS_DX).cast::<[u64; 3]>()).ok()? };
    Some(if abi == Abi::X32 {
        [di as u32 as u64, si as u32 as u64, dx as u32 as u64]
    } else {
        [di, si, dx]
    })
}

/// Direct, BTF-checked loads (fentry/fexit/LSM programs only).
pub(crate) struct BtfRead;

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
pub(crate) unsafe fn device_kind(r: &impl KernelReader, file: *const u8) -> Option<DeviceKind> {
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

/// Whether `file` is still referenced at all. Both encodings of the count read "no reference"
/// below `one`: `f_count` drops to 0, `f_ref` (file_ref_t) goes negative (released, dead). A
/// freed file keeps these bytes: the file cache is `SLAB_TYPESAFE_BY_RCU`, whose free pointer
/// lies outside the count.
#[inline(always)]
pub(crate) unsafe fn referenced(r: &impl KernelReader, file: *const u8, one: u32) -> bool {
    match unsafe { r.load::<i64>(file, r.file_refs()) } {
        Some(v) => v >= one as i64,
        None => false,
    }
}

/// Whether the caller holds the only reference to `file`.
#[inline(always)]
pub(crate) unsafe fn sole_reference(r: &impl KernelReader, file: *const u8, one: u32) -> bool {
    match unsafe { r.load::<i64>(file, r.file_refs()) } {
        Some(v) => v == one as i64,
        None => false,
    }
}
