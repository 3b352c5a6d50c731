//! Records exchanged over D-Bus, shared by the daemon and `gpudctl` (one definition of the wire
//! shapes; their D-Bus signatures are documented in docs/dbus-api.md).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use zbus::zvariant::Type;

/// One attributed cgroup: signature `(tsaua{st}a{st}a{st}t)`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct CgroupRecord {
    /// cgroup v2 id (the inode number of its directory).
    pub id: u64,
    /// Path relative to the cgroup v2 root, e.g. `/kubepods/pod1/ctr`.
    pub path: String,
    /// Live processes attributed to it: they opened or used an NVIDIA file.
    pub pids: Vec<u32>,
    /// ioctls on NVIDIA files by class (`alloc`, `free`, `control`, `map`, `vid_heap`, `uvm`,
    /// `other`); every class is present.
    pub ioctls: BTreeMap<String, u64>,
    /// GPU memory held by the cgroup and its descendants, from the RM allocations the probes
    /// charged, in bytes by GPU index, `unknown` (parent device not known) and `all` (the sum).
    pub memory_current: BTreeMap<String, u64>,
    /// Limits in force on this cgroup, by GPU index or `all`.
    pub memory_max: BTreeMap<String, u64>,
    /// Allocations that crossed (react) or were refused by (deny) this cgroup's limits.
    pub memory_events: u64,
}

/// A limit as listed by `ListLimits`: signature `(ssa{sv})`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Type)]
pub struct LimitRecord {
    pub cgroup: String,
    /// `all`, an index or a UUID, as set.
    pub gpu: String,
    /// `memory_max` (t).
    pub limits: BTreeMap<String, u64>,
}

/// One attributed process: signature `(utsa{st})`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ProcessRecord {
    /// Process id (thread-group id).
    pub pid: u32,
    /// cgroup v2 id of the cgroup it was in at its last open or ioctl of an NVIDIA file.
    pub cgroup_id: u64,
    /// That cgroup's path relative to the cgroup v2 root; empty if the cgroup was removed.
    pub cgroup: String,
    /// Its ioctls on NVIDIA files by class, as in [`CgroupRecord::ioctls`].
    pub ioctls: BTreeMap<String, u64>,
}
