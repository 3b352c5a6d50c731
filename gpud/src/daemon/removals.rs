//! Watches for the removal of cgroups that have limits (inotify), so that a cgroup removed while
//! it has limits loses them at once rather than at the next sweep: a container that failed after
//! its runtime's hook set its shares, a pod torn down while the integration's clear went
//! unanswered. The sweep stays the safety net (a cgroup removed while the daemon was down, a
//! watch that could not be added).
//!
//! cgroupfs reports an `rmdir` to watchers of the parent directory (`IN_DELETE` with the name),
//! not to watchers of the removed directory itself (no `IN_DELETE_SELF`), so parents are watched.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use futures_util::StreamExt as _;
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask};
use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};

use super::messages::Message;

/// Runs until shutdown: watches the parent of every directory in `dirs` and tells the state
/// task when one of those directories is removed.
pub(super) async fn run(
    mut dirs: watch::Receiver<BTreeSet<PathBuf>>,
    tx: mpsc::Sender<Message>,
    mut shutdown: watch::Receiver<bool>,
) {
    let stream = Inotify::init().and_then(|i| i.into_event_stream([0u8; 4096]));
    let mut events = match stream {
        Ok(s) => s,
        Err(e) => {
            warn!("cannot watch cgroup removals ({e}); limits of removed cgroups go at each sweep");
            return;
        }
    };
    let mut parents: BTreeMap<PathBuf, WatchDescriptor> = BTreeMap::new();
    loop {
        let wanted = dirs.borrow_and_update().clone();
        let wanted_parents: BTreeSet<PathBuf> = wanted
            .iter()
            .filter_map(|d| d.parent().map(Path::to_path_buf))
            .collect();
        parents.retain(|dir, wd| {
            let keep = wanted_parents.contains(dir);
            if !keep {
                // Already gone if the parent itself was removed: nothing to undo then.
                let _ = events.watches().remove(wd.clone());
            }
            keep
        });
        let new: Vec<&PathBuf> = wanted_parents
            .iter()
            .filter(|d| !parents.contains_key(*d))
            .collect();
        for dir in new {
            match events
                .watches()
                .add(dir, WatchMask::DELETE | WatchMask::ONLYDIR)
            {
                Ok(wd) => {
                    parents.insert(dir.clone(), wd);
                }
                // Removed before it could be watched: the sweep finds its children gone.
                Err(e) => debug!(dir = %dir.display(), "cannot watch a cgroup: {e}"),
            }
        }
        tokio::select! {
            changed = dirs.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            event = events.next() => match event {
                Some(Ok(ev)) if ev.mask.contains(EventMask::DELETE) => {
                    let removed = parents
                        .iter()
                        .find(|(_, wd)| **wd == ev.wd)
                        .zip(ev.name.as_ref())
                        .map(|((parent, _), name)| parent.join(name));
                    if let Some(dir) = removed.filter(|d| wanted.contains(d)) {
                        debug!(dir = %dir.display(), "a limited cgroup was removed");
                        if tx.send(Message::CgroupRemoved).await.is_err() {
                            return;
                        }
                    }
                }
                Some(Ok(ev)) if ev.mask.contains(EventMask::IGNORED) => {
                    parents.retain(|_, wd| *wd != ev.wd);
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    warn!("cgroup removals no longer watched ({e}); the sweep drops their limits");
                    return;
                }
                None => return,
            },
            _ = shutdown.changed() => return,
        }
    }
}
