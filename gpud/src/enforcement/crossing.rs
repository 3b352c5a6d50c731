//! A crossing allocation left in a file another process holds (the react tier with `kill`).
//!
//! The kernel side kills the caller of an allocation that took its cgroup over a limit, in the
//! call, and the driver frees what was made through the caller's file when the file's last
//! reference goes. A tenant that keeps the file open in a second process (forked, or handed
//! over a socket) would keep the crossing allocation, of any size, while that process lives.
//! This module frees that one object: `RM_FREE` of its handle through a `pidfd_getfd` copy of a
//! holder's descriptor (the driver binds a client to its file, so only a copy of that file is
//! answered; others say `NV_ERR_INVALID_CLIENT` and are passed over), then releases its record
//! and charge in the kernel's maps, since the daemon's own call may go unseen by the probes (it
//! opened no NVIDIA file). The caller is tried first: it may still hold the file as it dies.
//! Killing every holder instead would also kill the parent of a worker that crossed.

use aya::maps::{HashMap, MapData};
use gpud_common::{ObjEntry, ObjKey};
use tracing::warn;

use super::compute::channel::{ControlError, Controls, RmObject};
use crate::{attribution::scan, probes::KernelRuns, report::Chain};

/// What became of a crossing allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Freed through a file of this process.
    Freed { holder: u32 },
    /// Nothing to free: no object was made, or its record went (the file released, the object
    /// freed) before gpud got to it.
    Gone,
    /// No process gpud may reach holds a file that owns its client.
    NoHolder,
}

/// Frees the object at `key` that process `pid` made (see the module docs), through the first
/// process that holds a file owning its client: the maker, then the client's creator (a forked
/// worker's parent), then, only if neither does, every process holding an NVIDIA file.
pub fn free(
    controls: &mut Controls,
    objects: &HashMap<MapData, ObjKey, ObjEntry>,
    runs: &KernelRuns,
    pid: u32,
    key: ObjKey,
) -> Outcome {
    // A refused allocation made nothing; a client handle is never what an allocation made.
    if key.object == 0 || key.object == key.client {
        return Outcome::Gone;
    }
    let Ok(made) = objects.get(&key, 0) else {
        return Outcome::Gone;
    };
    // With the caller's file released (it held it alone), the driver freed the object with it.
    let held = || runs.file_held(made.file).unwrap_or(true);
    if !held() {
        return Outcome::Gone;
    }
    // Taken before `through` borrows the controls, for the scan that may follow.
    let matcher = controls.matcher().clone();
    let mut through = |holder: u32| -> Option<Outcome> {
        // The handle is the client's to reuse once freed: only the object that crossed goes.
        if !objects
            .get(&key, 0)
            .is_ok_and(|now| now.serial == made.serial)
        {
            return Some(Outcome::Gone);
        }
        match controls.free_on(RmObject {
            pid: holder,
            client: key.client,
            object: key.object,
        }) {
            Ok(()) => {
                if let Err(e) = runs.release(key, made.serial, false) {
                    warn!(
                        pid = holder,
                        "freed a crossing allocation, but cannot release its charge: {}",
                        Chain(&e)
                    );
                }
                Some(Outcome::Freed { holder })
            }
            Err(ControlError::NoFile { .. } | ControlError::Gone { .. }) => None,
            Err(e) => {
                warn!(
                    pid = holder,
                    "cannot free a crossing allocation through this process: {}",
                    Chain(&e)
                );
                None
            }
        }
    };
    let creator = objects
        .get(
            &ObjKey {
                client: key.client,
                object: key.client,
            },
            0,
        )
        .ok()
        .map(|c| c.tgid)
        .filter(|&t| t != pid);
    let own = std::process::id();
    let likely = std::iter::once(pid).chain(creator);
    if let Some(done) = likely.clone().find_map(&mut through) {
        return done;
    }
    let tried: Vec<u32> = likely.chain([own]).collect();
    if let Some(done) = scan::holders(&matcher)
        .into_iter()
        .filter(|pid| !tried.contains(pid))
        .find_map(&mut through)
    {
        return done;
    }
    if held() {
        Outcome::NoHolder
    } else {
        Outcome::Gone
    }
}
