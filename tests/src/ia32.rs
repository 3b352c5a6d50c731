//! x86-64's 32-bit system-call entries, from this 64-bit process. The i386 one: `int 0x80`, which
//! the kernel serves as it serves a 32-bit process's calls (`TS_COMPAT` set, the compat handlers,
//! skipped by the `syscalls:*` tracepoints), with arguments below 4 GiB as such a process has
//! them. The test tenant's 32-bit mode and the benchmark's 32-bit ioctl use it. The x32 one
//! ([`x32`]): `syscall` with the x32 bit in the number, where the kernel has it on.

use std::{cell::Cell, io};

/// `ioctl` in the i386 system-call table.
pub const NR_IOCTL: u32 = gpud_common::compat::IA32_IOCTL as u32;

/// An i386 system call with three arguments; returns the kernel's answer (`-errno` on failure).
///
/// # Safety
/// As for the call itself: pointers among the arguments must be valid for it.
pub unsafe fn syscall3(nr: u32, a: u32, b: u32, c: u32) -> i32 {
    let mut ret = nr;
    // SAFETY: as the caller guarantees. rbx, which LLVM reserves, carries the first argument
    // and is swapped back; the i386 entry may clear r8-r11.
    unsafe {
        std::arch::asm!(
            "xchg {a:r}, rbx",
            "int 0x80",
            "xchg {a:r}, rbx",
            a = inout(reg) a as u64 => _,
            inout("eax") ret,
            in("ecx") b,
            in("edx") c,
            out("r8") _, out("r9") _, out("r10") _, out("r11") _,
        );
    }
    ret as i32
}

/// `getpid` in the i386 system-call table.
const NR_GETPID: u32 = 20;
/// `close` in the i386 system-call table.
const NR_CLOSE: u32 = gpud_common::compat::IA32_CLOSE as u32;

/// Whether this kernel serves the i386 entry (IA32 emulation built and not turned off).
pub fn available() -> bool {
    // SAFETY: a call without arguments.
    (unsafe { syscall3(NR_GETPID, 0, 0, 0) }) > 0
}

/// Closes `file` through the i386 entry.
pub fn close(file: std::fs::File) -> io::Result<()> {
    use std::os::fd::IntoRawFd as _;
    // SAFETY: the descriptor is ours (taken from `file`) and closed exactly once here.
    let ret = unsafe { syscall3(NR_CLOSE, file.into_raw_fd() as u32, 0, 0) };
    if ret < 0 {
        Err(io::Error::from_raw_os_error(-ret))
    } else {
        Ok(())
    }
}

/// One page below 4 GiB (`MAP_32BIT`), where a 32-bit process's ioctl argument would be.
pub struct LowPage(*mut u8);

impl LowPage {
    pub const SIZE: usize = 4096;

    pub fn new() -> io::Result<Self> {
        // SAFETY: an anonymous private mapping of one page.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_32BIT,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self(p.cast()))
    }

    /// The page's address, which fits 32 bits.
    pub fn addr(&self) -> u32 {
        self.0 as u64 as u32
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.0
    }
}

impl Drop for LowPage {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.0.cast(), Self::SIZE) };
    }
}

thread_local! {
    static BOUNCE: Cell<Option<&'static LowPage>> = const { Cell::new(None) };
}

/// `ioctl(fd, cmd, arg)` through the i386 entry, as a 32-bit process makes it: the `_IOC_SIZE`
/// bytes at `arg` are copied to a page below 4 GiB (this thread's), passed from there, and copied
/// back. Pointers inside the struct (NvP64 fields) are passed as they are: the driver reads them
/// at 64 bits whatever the caller's width. Returns (ret, errno).
///
/// # Safety
/// `arg` must be valid for reads and writes of `_IOC_SIZE(cmd)` bytes (at most a page).
pub unsafe fn ioctl(fd: i32, cmd: u32, arg: *mut u8) -> (i32, i32) {
    let size = ((cmd >> 16) & 0x3fff) as usize;
    let page = match BOUNCE.with(Cell::get) {
        Some(p) => p,
        None => match LowPage::new() {
            // One page per thread for the thread's life: leaked on purpose.
            Ok(p) => {
                let p: &'static LowPage = Box::leak(Box::new(p));
                BOUNCE.with(|b| b.set(Some(p)));
                p
            }
            Err(e) => return (-1, e.raw_os_error().unwrap_or(libc::ENOMEM)),
        },
    };
    if size > LowPage::SIZE {
        return (-1, libc::EINVAL);
    }
    let low = page.as_mut_ptr();
    // SAFETY: `arg` holds `size` bytes (the caller), the page `SIZE`.
    unsafe { std::ptr::copy_nonoverlapping(arg, low, size) };
    // SAFETY: the descriptor's ioctl on the low copy.
    let ret = unsafe { syscall3(NR_IOCTL, fd as u32, cmd, page.addr()) };
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(low, arg, size) };
    if ret < 0 { (-1, -ret) } else { (ret, 0) }
}

/// `open` in the i386 system-call table.
pub const NR_OPEN: u32 = gpud_common::compat::IA32_OPEN as u32;

/// Opens `path` read-write through the i386 entry, the path below 4 GiB.
pub fn open(path: &std::path::Path) -> io::Result<std::fs::File> {
    use std::os::{fd::FromRawFd as _, unix::ffi::OsStrExt as _};
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= LowPage::SIZE || bytes.contains(&0) {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let page = LowPage::new()?;
    // SAFETY: the page holds the path and its NUL (zeroed page, shorter path).
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), page.as_mut_ptr(), bytes.len()) };
    let flags = (libc::O_RDWR | libc::O_CLOEXEC) as u32;
    // SAFETY: the path lies in the page.
    let fd = unsafe { syscall3(NR_OPEN, page.addr(), flags, 0) };
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a descriptor the kernel just gave us.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// The x32 entry: the 64-bit `syscall` instruction with `__X32_SYSCALL_BIT` in the number and
/// 32-bit pointers. Built into few kernels and off by default where it is (Debian:
/// `syscall.x32=y` turns it on).
pub mod x32 {
    use gpud_common::compat::{X32_IOCTL, X32_SYSCALL_BIT};

    /// `getpid`, x32.
    const NR_GETPID: i64 = X32_SYSCALL_BIT | 39;

    /// An x32 system call with three arguments; the kernel's answer (`-errno` on failure).
    ///
    /// # Safety
    /// As for the call itself.
    pub unsafe fn syscall3(nr: i64, a: u64, b: u64, c: u64) -> i64 {
        let ret: i64;
        // SAFETY: as the caller guarantees; `syscall` clobbers rcx and r11.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") nr => ret,
                in("rdi") a,
                in("rsi") b,
                in("rdx") c,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret
    }

    /// Whether this kernel serves x32 calls.
    pub fn available() -> bool {
        // SAFETY: a call without arguments.
        (unsafe { syscall3(NR_GETPID, 0, 0, 0) }) > 0
    }

    /// `ioctl(fd, cmd, arg)` through the x32 entry, `arg` below 4 GiB.
    ///
    /// # Safety
    /// As for the ioctl.
    pub unsafe fn ioctl(fd: i32, cmd: u32, arg: u32) -> i64 {
        // SAFETY: as the caller guarantees.
        unsafe { syscall3(X32_IOCTL, fd as u64, cmd as u64, arg as u64) }
    }
}
