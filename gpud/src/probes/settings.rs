//! The kernel settings the daemon writes, in one owner: the memory limits (`LIMITS`), the
//! scheduler guard's timeslice allowances (`SCHED_ALLOW`) and its call counts (`GUARD_COUNTS`,
//! written by the kernel, forgotten here for removed cgroups). The state task owns the one
//! [`KernelSettings`]; the memory enforcement and the guard write through it. The attribution
//! reads the limits back for its views through a handle of its own that it never writes.

use std::collections::{BTreeMap, HashMap};

use aya::maps::{HashMap as BpfHashMap, MapData};
use gpud_common::{GuardKey, KernelLimit, UsageKey};
use tracing::warn;

use super::{ProbeError, map_entries, remove_key};
use crate::report::Chain;

/// Why a kernel setting was not written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the kernel map {map}")]
pub struct SettingError {
    map: &'static str,
    #[source]
    source: aya::maps::MapError,
}

/// The maps of settings (see the module docs).
pub struct KernelSettings {
    pub(super) limits: BpfHashMap<MapData, UsageKey, KernelLimit>,
    pub(super) sched_allow: BpfHashMap<MapData, u64, u64>,
    pub(super) guard_counts: BpfHashMap<MapData, GuardKey, u64>,
}

impl KernelSettings {
    /// Sets a memory limit, keeping its event counter.
    pub fn set_limit(&mut self, cgroup_id: u64, gpu: u32, max: u64) -> Result<(), SettingError> {
        let key = UsageKey {
            cgroup_id,
            gpu,
            _pad: 0,
        };
        let events = self.limits.get(&key, 0).map(|l| l.events).unwrap_or(0);
        self.limits
            .insert(key, KernelLimit { max, events }, 0)
            .map_err(|source| SettingError {
                map: gpud_common::maps::LIMITS,
                source,
            })
    }

    /// Removes a memory limit (absent is fine).
    pub fn clear_limit(&mut self, cgroup_id: u64, gpu: u32) -> Result<(), SettingError> {
        let key = UsageKey {
            cgroup_id,
            gpu,
            _pad: 0,
        };
        remove_key(&mut self.limits, &key).map_err(|source| SettingError {
            map: gpud_common::maps::LIMITS,
            source,
        })
    }

    /// Memory limits in force: (cgroup id, GPU key) → max.
    pub fn limits(&self) -> HashMap<(u64, u32), u64> {
        map_entries(&self.limits)
            .into_iter()
            .map(|(k, l)| ((k.cgroup_id, k.gpu), l.max))
            .collect()
    }

    /// Sets (or, with `None`, removes) the scheduler guard's timeslice allowance of a cgroup.
    pub fn set_sched_allowance(
        &mut self,
        cgroup_id: u64,
        us: Option<u64>,
    ) -> Result<(), SettingError> {
        let map = gpud_common::maps::SCHED_ALLOW;
        match us {
            Some(us) => self.sched_allow.insert(cgroup_id, us, 0),
            None => remove_key(&mut self.sched_allow, &cgroup_id),
        }
        .map_err(|source| SettingError { map, source })
    }

    /// The scheduler guard's allowances, by cgroup id.
    pub fn sched_allowances(&self) -> BTreeMap<u64, u64> {
        map_entries(&self.sched_allow).into_iter().collect()
    }

    /// The calls the scheduler guard acted on, by cgroup, command and verdict.
    pub fn guard_counts(&self) -> Vec<(GuardKey, u64)> {
        map_entries(&self.guard_counts)
    }

    /// Drops the guard's counts of these keys (of cgroups that are gone).
    pub fn forget_guard_counts(&mut self, keys: &[GuardKey]) {
        for k in keys {
            if let Err(e) = remove_key(&mut self.guard_counts, k) {
                warn!("cannot drop a removed cgroup's guard counts: {}", Chain(&e));
            }
        }
    }
}

/// A second handle on the limits map, read-only by convention (the attribution's views), from
/// its pin.
pub(super) fn limits_reader(
    pins: &std::path::Path,
) -> Result<BpfHashMap<MapData, UsageKey, KernelLimit>, ProbeError> {
    let name = gpud_common::maps::LIMITS;
    super::pinned(pins, name).map_err(|source| ProbeError::TakeMap { name, source })
}
