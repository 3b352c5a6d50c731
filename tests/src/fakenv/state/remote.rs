//! The caller's memory, where nested structs live: bytes read and written with
//! `process_vm_readv`/`writev` (the FUSE request names the calling thread), and the typed reads
//! of class parameters and of a control's parameters.

use std::io;

use gpud_common::rm;

use super::Caller;
use crate::rm::{Plain, bytes_of_mut, status};

/// Reads `buf.len()` bytes at `addr` in process (or thread) `pid`; all or an error.
pub(super) fn remote_read(pid: u32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    remote_io(pid, addr, buf.as_mut_ptr(), buf.len(), false)
}

/// Writes `buf` at `addr` in process (or thread) `pid`; all or an error.
pub(super) fn remote_write(pid: u32, addr: u64, buf: &[u8]) -> io::Result<()> {
    // Only read from: process_vm_writev takes the local side as a mutable iovec all the same.
    remote_io(pid, addr, buf.as_ptr().cast_mut(), buf.len(), true)
}

/// `len` bytes between `local` and `addr` in process (or thread) `pid`: all or an error.
fn remote_io(pid: u32, addr: u64, local: *mut u8, len: usize, write: bool) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: local.cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: one local iovec over the caller's buffer of `len` bytes (written only when
    // reading); the remote side is checked by the kernel.
    let n = unsafe {
        if write {
            libc::process_vm_writev(pid as libc::pid_t, &local, 1, &remote, 1, 0)
        } else {
            libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0)
        }
    };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize != len => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        _ => Ok(()),
    }
}

/// A `T` read from `addr` in `pid`'s memory; `None` for a null or unreadable pointer.
pub(super) fn read_remote<T: Plain>(pid: u32, addr: u64) -> Option<T> {
    if addr == 0 {
        return None;
    }
    let mut v = T::default();
    remote_read(pid, addr, bytes_of_mut(&mut v)).ok()?;
    Some(v)
}

/// Class params: zeroes for a null pointer (RM's defaults), the struct otherwise.
pub(super) fn read_params<T: Plain>(pid: u32, addr: u64) -> Result<T, u32> {
    if addr == 0 {
        return Ok(T::default());
    }
    read_remote(pid, addr).ok_or(status::NV_ERR_INVALID_POINTER)
}

/// A control's parameters from the caller's memory, once [`Rm::control`] has checked their
/// size: `NV_ERR_INVALID_ARGUMENT` for a size other than `T`'s all the same,
/// `NV_ERR_INVALID_POINTER` where they cannot be read.
pub(super) fn params<T: Plain>(c: Caller, p: &rm::Nvos54) -> Result<T, u32> {
    if p.params_size as usize != size_of::<T>() {
        return Err(status::NV_ERR_INVALID_ARGUMENT);
    }
    read_remote(c.tid, p.params).ok_or(status::NV_ERR_INVALID_POINTER)
}
