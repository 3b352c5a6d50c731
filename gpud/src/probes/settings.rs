//! The kernel settings the daemon writes, in one owner: the memory limits (`LIMITS`, and the
//! generation the programs check what they learnt of them against, `LIMITS_GEN`), the
//! scheduler guard's timeslice allowances (`SCHED_ALLOW`) and its call counts (`GUARD_COUNTS`,
//! written by the kernel, forgotten here for removed cgroups). The state task owns the one
//! [`KernelSettings`]; the memory enforcement and the guard write through it. The attribution
//! reads the limits back for its views through a handle of its own that it never writes.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use aya::maps::{Array as BpfArray, HashMap as BpfHashMap, MapData};
use gpud_common::{GPU_ALL, GPU_UNKNOWN, GuardKey, KernelLimit, UNNAMED_GPU_MAX, UsageKey};
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
    pub(super) generation: LimitsGeneration,
}

/// The limits' generation (`LIMITS_GEN`): raised after every write that may give a level of an
/// ancestry record a limit it did not have (a limit; an ancestry record written or removed), so
/// that what the programs learnt of levels without limits under the old value
/// ([`gpud_common::limits_seen`]) is not trusted any more. Its writers (the settings, the
/// attribution's ancestry records) are the state task's, one at a time.
pub struct LimitsGeneration(BpfArray<MapData, u64>);

impl LimitsGeneration {
    /// A handle on the map pinned under `pins`.
    pub(super) fn open(pins: &std::path::Path) -> Result<Self, ProbeError> {
        let name = gpud_common::maps::LIMITS_GEN;
        super::pinned(pins, name)
            .map(Self)
            .map_err(|source| ProbeError::TakeMap { name, source })
    }

    /// Raises the generation by one.
    pub fn raise(&mut self) -> Result<(), aya::maps::MapError> {
        let now = self.0.get(&0, 0)?;
        self.0.set(0, now.wrapping_add(1), 0)
    }
}

impl KernelSettings {
    /// Sets a memory limit, keeping its event counter. A limit on one GPU comes with the
    /// cgroup's limit on GPUs the probes cannot name ([`UNNAMED_GPU_MAX`]).
    pub fn set_limit(&mut self, cgroup_id: u64, gpu: u32, max: u64) -> Result<(), SettingError> {
        self.put(cgroup_id, gpu, max)?;
        if named(gpu) {
            self.put(cgroup_id, GPU_UNKNOWN, UNNAMED_GPU_MAX)?;
        }
        Ok(())
    }

    /// Removes a memory limit (absent is fine); the cgroup's limit on unnamed GPUs goes with
    /// its last limit on one GPU.
    pub fn clear_limit(&mut self, cgroup_id: u64, gpu: u32) -> Result<(), SettingError> {
        self.remove(cgroup_id, gpu)?;
        let last = named(gpu)
            && !map_entries(&self.limits)
                .iter()
                .any(|(k, _)| k.cgroup_id == cgroup_id && named(k.gpu));
        if last {
            self.remove(cgroup_id, GPU_UNKNOWN)?;
        }
        Ok(())
    }

    /// Writes a limit, then raises the generation: from then on the programs look the level
    /// up again wherever they had found it without limits.
    fn put(&mut self, cgroup_id: u64, gpu: u32, max: u64) -> Result<(), SettingError> {
        let key = UsageKey::new(cgroup_id, gpu);
        let events = self.limits.get(&key, 0).map(|l| l.events).unwrap_or(0);
        self.limits
            .insert(key, KernelLimit { max, events }, 0)
            .map_err(limits_error)?;
        self.generation.raise().map_err(|source| SettingError {
            map: gpud_common::maps::LIMITS_GEN,
            source,
        })
    }

    fn remove(&mut self, cgroup_id: u64, gpu: u32) -> Result<(), SettingError> {
        remove_key(&mut self.limits, &UsageKey::new(cgroup_id, gpu)).map_err(limits_error)
    }

    /// Puts every cgroup's limit on unnamed GPUs in step with its limits, in one walk of the
    /// map: present (at [`UNNAMED_GPU_MAX`]) exactly while it has a limit on some GPU by itself.
    /// After a start on pinned maps a previous daemon may have left them out of step (or an
    /// older one, without them).
    pub fn keep_all_unnamed(&mut self) -> Result<(), SettingError> {
        let (mut per_gpu, mut unnamed) = (BTreeSet::new(), BTreeSet::new());
        for (k, _) in map_entries(&self.limits) {
            if named(k.gpu) {
                per_gpu.insert(k.cgroup_id);
            } else if k.gpu == GPU_UNKNOWN {
                unnamed.insert(k.cgroup_id);
            }
        }
        for &id in per_gpu.difference(&unnamed) {
            self.put(id, GPU_UNKNOWN, UNNAMED_GPU_MAX)?;
        }
        for &id in unnamed.difference(&per_gpu) {
            self.remove(id, GPU_UNKNOWN)?;
        }
        Ok(())
    }

    /// Memory limits in force: (cgroup id, GPU key) → max. The limits on unnamed GPUs that go
    /// with per-GPU limits are not listed: they are the kernel's, kept here.
    pub fn limits(&self) -> HashMap<(u64, u32), u64> {
        map_entries(&self.limits)
            .into_iter()
            .filter(|(k, _)| k.gpu != GPU_UNKNOWN)
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

fn limits_error(source: aya::maps::MapError) -> SettingError {
    SettingError {
        map: gpud_common::maps::LIMITS,
        source,
    }
}

/// Whether GPU key `gpu` names one GPU (not all of them, not an unnamed one).
fn named(gpu: u32) -> bool {
    gpu != GPU_ALL && gpu != GPU_UNKNOWN
}

/// A second handle on the limits map, read-only by convention (the attribution's views), from
/// its pin.
pub(super) fn limits_reader(
    pins: &std::path::Path,
) -> Result<BpfHashMap<MapData, UsageKey, KernelLimit>, ProbeError> {
    let name = gpud_common::maps::LIMITS;
    super::pinned(pins, name).map_err(|source| ProbeError::TakeMap { name, source })
}
