//! The script's file descriptor moved about: under another number (`dup2`), and between
//! processes over a unix socket (`send-fd`, `recv-fd`: SCM_RIGHTS).

use std::{
    fs::File,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::Path,
};

/// `dup2(fd, n)` onto the first free descriptor from 100, then closes `fd`: the same open
/// file description under another number.
pub(crate) fn redup(f: File) -> std::io::Result<(File, i32)> {
    let mut target = 100;
    // SAFETY: probing descriptor numbers with fcntl(F_GETFD) only reads the table.
    while unsafe { libc::fcntl(target, libc::F_GETFD) } != -1 {
        target += 1;
    }
    // SAFETY: `target` is free; dup2 makes it refer to `f`'s open file description.
    if unsafe { libc::dup2(f.as_raw_fd(), target) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    drop(f);
    // SAFETY: `target` was just made ours by dup2.
    Ok((unsafe { File::from_raw_fd(target) }, target))
}

/// Sends `f`'s descriptor over a new connection to `path` (SCM_RIGHTS).
pub(crate) fn send_fd(path: &Path, f: &File) -> std::io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let stream = UnixStream::connect(path)?;
    let fds = [f.as_raw_fd()];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[std::io::IoSlice::new(b"f")],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    Ok(())
}

/// Accepts one connection on `l` and returns the descriptor sent over it.
pub(crate) fn recv_fd(l: &UnixListener) -> std::io::Result<File> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let (stream, _) = l.accept()?;
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = c
            && let Some(&fd) = fds.first()
        {
            // SAFETY: the kernel installed `fd` in this process for us.
            return Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    Err(std::io::Error::other("no descriptor in the message"))
}
