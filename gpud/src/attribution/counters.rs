//! The kernel side's health counters (`STATS`, per CPU), readable from any task: a second handle
//! on the map, so that readers do not go through the state task for them.

use std::collections::BTreeMap;

use aya::maps::{Map, MapData, PerCpuArray};
use gpud_common::stat;

use super::{Attribution, AttributionError};

/// The counters by the names the API and metrics use.
const NAMES: [(u32, &str); stat::COUNT as usize] = [
    (stat::EVENTS_LOST, "events_lost"),
    (stat::PROCS_FULL, "procs_map_full"),
    (stat::CGROUPS_FULL, "cgroups_map_full"),
    (stat::MATCHED_IOCTLS, "matched_ioctls"),
    (stat::OBJECTS_FULL, "objects_map_full"),
    (stat::CHARGES, "memory_charges"),
    (stat::UNCHARGES, "memory_uncharges"),
    (stat::UNREADABLE, "allocs_unreadable"),
    (stat::DENIED, "allocs_denied"),
    (stat::CROSSED, "limit_crossings"),
    (stat::UNKNOWN_GPU, "allocs_unknown_gpu"),
    (stat::MEMINFO_REWRITTEN, "memory_info_rewritten"),
    (stat::MEMINFO_SKIPPED, "memory_info_skipped"),
    (stat::SCHED_GUARDED, "sched_guarded"),
    (stat::SCHED_GUARD_QUIET, "sched_guard_quiet"),
    (stat::GUARD_COUNTS_FULL, "guard_counts_map_full"),
    (stat::ORPHANS_RELEASED, "orphans_released"),
    (stat::DUPLICATES, "duplicates"),
    (stat::UNCONFIRMED, "unconfirmed_charges"),
    (stat::RACED, "raced_calls"),
    (stat::READ_BACKS, "guard_read_backs"),
    (stat::SCHED_GROUPS_FULL, "sched_groups_map_full"),
    (stat::FILE_RELEASES_SKIPPED, "file_releases_skipped"),
    (stat::FILE_MARKS_FULL, "file_marks_map_full"),
    (stat::OBJECTS_CGROUP_CAP, "objects_cgroup_cap"),
    (stat::OBJ_COUNTS_FULL, "obj_counts_map_full"),
    (stat::ADOPTED, "objects_adopted"),
    (stat::MEMORY_READ_BACKS, "memory_read_backs"),
    (stat::DEVICE_READ_BACKS, "device_read_backs"),
    (stat::FREE_READ_BACKS, "free_read_backs"),
];

/// The counters that move whenever the kernel changes what a cgroup's record shows without
/// telling the daemon: ioctl counts (every matched ioctl), charged bytes (charges and
/// uncharges, and the objects taken over at an upgrade) and limit events (denials; a crossing is
/// also a charge).
const CHANGES: [u32; 5] = [
    stat::MATCHED_IOCTLS,
    stat::CHARGES,
    stat::UNCHARGES,
    stat::DENIED,
    stat::ADOPTED,
];

/// A read-only handle on the kernel's counters.
pub struct KernelCounters {
    stats: PerCpuArray<MapData, u64>,
}

/// Counter `index` of `stats` summed over CPUs (0 if unreadable).
pub(super) fn summed(stats: &PerCpuArray<MapData, u64>, index: u32) -> u64 {
    stats
        .get(&index, 0)
        .map(|per_cpu| per_cpu.iter().sum())
        .unwrap_or(0)
}

impl KernelCounters {
    fn sum(&self, index: u32) -> u64 {
        summed(&self.stats, index)
    }

    /// Every counter summed over CPUs.
    pub fn stats(&self) -> BTreeMap<String, u64> {
        NAMES
            .into_iter()
            .map(|(i, n)| (n.to_owned(), self.sum(i)))
            .collect()
    }

    /// A number that grows whenever the kernel changes a cgroup's ioctl counts, charged bytes or
    /// limit events (the counters only grow): equal readings mean the kernel changed none of
    /// them in between.
    pub fn generation(&self) -> u64 {
        CHANGES
            .iter()
            .map(|i| self.sum(*i))
            .fold(0, u64::wrapping_add)
    }
}

impl Attribution {
    /// A second handle on the counters, for readers outside the state task.
    pub fn counters(&self) -> Result<KernelCounters, AttributionError> {
        use aya::maps::IterableMap as _;
        use std::os::fd::AsFd as _;
        let fd = self
            .maps
            .stats
            .map()
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|io_error| {
                aya::maps::MapError::SyscallError(aya::sys::SyscallError {
                    call: "dup",
                    io_error,
                })
            })?;
        let data = MapData::from_fd(fd)?;
        Ok(KernelCounters {
            stats: PerCpuArray::try_from(Map::PerCpuArray(data))?,
        })
    }
}
