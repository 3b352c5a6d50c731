//! Finding processes that already hold NVIDIA files, by reading `/proc/*/fd`.
//!
//! Runs at start-up (processes that opened a device before the probes were attached) and
//! periodically (files passed over unix sockets are not seen opening).

use std::collections::BTreeSet;

use crate::probes::Matcher;

/// Pids (thread-group ids) with at least one open file the matcher accepts.
pub fn holders(matcher: &Matcher) -> BTreeSet<u32> {
    let mut found = BTreeSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        // Processes may exit or deny access mid-scan; skip them.
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            // metadata() follows the magic link to the open file itself.
            if std::fs::metadata(fd.path()).is_ok_and(|m| matcher.matches(&m)) {
                found.insert(pid);
                break;
            }
        }
    }
    found
}
