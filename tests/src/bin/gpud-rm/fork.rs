//! `fork` and `handoff`: the script's process forks, and the child takes the script over;
//! `forks`: children that only wait.

use std::io::Write as _;

use serde_json::{Value, json};

use crate::err;

/// Forks; the child takes over the script, the parent leaves at once without closing anything
/// itself (as the first half of a daemon's double fork).
pub(crate) fn handoff() -> Value {
    let parent = std::process::id();
    let _ = std::io::stdout().flush();
    // SAFETY: this process is single-threaded here (`parallel` joins its threads).
    match unsafe { libc::fork() } {
        -1 => err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => json!({ "ok": true, "pid": std::process::id(), "parent": parent }),
        // SAFETY: leaves at once; the child answers for both.
        _ => unsafe { libc::_exit(0) },
    }
}

/// Forks; the child answers and returns to the command loop, the parent waits for it and
/// reports.
pub(crate) fn fork() -> Value {
    let _ = std::io::stdout().flush();
    // SAFETY: this process is single-threaded here (`parallel` joins its threads).
    match unsafe { libc::fork() } {
        -1 => err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => json!({ "ok": true, "pid": std::process::id() }),
        child => {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(child, &mut status, 0) };
            let code = if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                128 + libc::WTERMSIG(status)
            };
            json!({ "ok": true, "reaped": child, "code": code })
        }
    }
}

/// Forks `n` children that hold the open file and wait, each dying with this process
/// (`PR_SET_PDEATHSIG`): a tenant filling the host's process map.
pub(crate) fn forks(n: u64) -> Value {
    let _ = std::io::stdout().flush();
    let parent = std::process::id() as libc::pid_t;
    for made in 0..n {
        // SAFETY: this process is single-threaded here; the child only calls async-signal-safe
        // functions before it waits.
        match unsafe { libc::fork() } {
            -1 => {
                return err(format!(
                    "fork after {made}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            0 => unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != parent {
                    libc::_exit(0);
                }
                loop {
                    libc::pause();
                }
            },
            _ => {}
        }
    }
    json!({ "ok": true, "children": n })
}
