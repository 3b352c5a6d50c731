//! What the driver allocated for limited cgroups' memory objects, read back after the call.
//!
//! The probes charge the size they read from the caller's memory at the call's entry. The
//! driver copies the request a few microseconds later, so another thread of the caller can
//! change it in between (a wrapped call's `pAllocParms`, the size itself) and put it back once
//! the driver answered: the driver makes 16 MiB where 4 KiB was charged. For every object a
//! limited cgroup makes, the kernel side asks the restorer to read its size back from the
//! driver (`EVENT_MEM_READ_BACK`). This module keeps what the driver holds beyond the charge
//! ("excess", per object, for as long as the object lives) and judges the limits with it: a
//! cgroup's charged usage plus the excess of its objects and its descendants' over a limit of
//! its own or an ancestor's is a crossing, which the restorer acts on at once. An object whose
//! driver size equals its charge (every call no thread raced) adds nothing, so a size the
//! driver rounds differently than it wrote back is never acted on alone, only once it would
//! really take the cgroup over its limit.

use std::collections::BTreeMap;

use aya::maps::{HashMap, MapData};
use gpud_common::{
    Ancestry, CgroupUsage, GPU_ALL, KernelLimit, MAX_CGROUP_DEPTH, ObjKey, UsageKey,
};

/// What the driver holds for one object beyond what the probes charged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Excess {
    /// The process that made it.
    pub pid: u32,
    /// The object's serial (its record in `OBJECTS` while it lives).
    pub serial: u64,
    /// The GPU it was charged on.
    pub gpu: u32,
    pub bytes: u64,
    /// Its cgroup and that cgroup's ancestors, root first.
    pub levels: Vec<u64>,
}

/// A limit the charges plus the excess cross.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crossed {
    /// The limited cgroup (the object's or an ancestor).
    pub cgroup_id: u64,
    /// The limit's GPU key.
    pub gpu: u32,
    /// Charged usage plus the excess under that cgroup.
    pub usage: u64,
    pub max: u64,
}

/// The first limit, from the root down, that `levels`' charged usage plus the excess under each
/// level crosses on `gpu` or in total, where the excess is what crosses it: the charges alone
/// within the limit, or `own` (the object just read back has excess of its own). A limit the
/// charges alone cross is the probes' crossing, which the kernel acted on at the call.
pub fn first_crossed(
    levels: &[u64],
    gpu: u32,
    usage: impl Fn(u64, u32) -> u64,
    limit: impl Fn(u64, u32) -> Option<u64>,
    excess: &BTreeMap<ObjKey, Excess>,
    own: bool,
) -> Option<Crossed> {
    for &id in levels {
        for key in [gpu, GPU_ALL] {
            let Some(max) = limit(id, key) else {
                continue;
            };
            let extra: u64 = excess
                .values()
                .filter(|e| under(e, id, key))
                .map(|e| e.bytes)
                .sum();
            let charged = usage(id, key);
            let total = charged.saturating_add(extra);
            if total > max && (charged <= max || own) {
                return Some(Crossed {
                    cgroup_id: id,
                    gpu: key,
                    usage: total,
                    max,
                });
            }
        }
    }
    None
}

/// Whether `e` counts against the limit of cgroup `id` on GPU key `key`.
fn under(e: &Excess, id: u64, key: u32) -> bool {
    e.levels.contains(&id) && (key == GPU_ALL || e.gpu == key)
}

/// The kernel's charges and limits, and the excess of live objects.
pub struct Sizes {
    usage: HashMap<MapData, u64, CgroupUsage>,
    limits: HashMap<MapData, UsageKey, KernelLimit>,
    ancestry: HashMap<MapData, u64, Ancestry>,
    excess: BTreeMap<ObjKey, Excess>,
}

impl Sizes {
    /// Over the kernel's `USAGE`, `LIMITS` and `ANCESTRY`.
    pub fn new(
        usage: HashMap<MapData, u64, CgroupUsage>,
        limits: HashMap<MapData, UsageKey, KernelLimit>,
        ancestry: HashMap<MapData, u64, Ancestry>,
    ) -> Self {
        Self {
            usage,
            limits,
            ancestry,
            excess: BTreeMap::new(),
        }
    }

    /// `cgroup_id` and its ancestors, root first, as the kernel recorded them at its first
    /// charge (the cgroup alone where it did not): an [`Excess`]'s `levels`.
    pub fn levels(&self, cgroup_id: u64) -> Vec<u64> {
        match self.ancestry.get(&cgroup_id, 0) {
            Ok(a) => a.ids[..(a.depth as usize).min(MAX_CGROUP_DEPTH)].to_vec(),
            Err(_) => vec![cgroup_id],
        }
    }

    /// The first of `levels` (root first) with a limit of its own on `gpu` itself (not `all`).
    pub fn limited_on(&self, levels: &[u64], gpu: u32) -> Option<u64> {
        levels
            .iter()
            .copied()
            .find(|&id| self.limits.get(&UsageKey::new(id, gpu), 0).is_ok())
    }

    /// Notes what the driver holds beyond the charge for the object at `object` and returns the
    /// limit over `excess.levels` that excess takes over, if any, with the objects whose excess
    /// counts against it (the raced ones, to act on). Excess of objects `live` says are gone
    /// (freed, their handle reused) is forgotten first.
    pub fn note(
        &mut self,
        object: ObjKey,
        excess: Excess,
        live: impl Fn(&ObjKey, u64) -> bool,
    ) -> Option<(Crossed, Vec<(ObjKey, Excess)>)> {
        self.excess.retain(|k, e| live(k, e.serial));
        let (gpu, own, levels) = (excess.gpu, excess.bytes > 0, excess.levels.clone());
        if own {
            self.excess.insert(object, excess);
        }
        if self.excess.is_empty() {
            return None;
        }
        let crossed = first_crossed(
            &levels,
            gpu,
            |id, g| self.usage.get(&id, 0).map_or(0, |record| record.on(g)),
            |id, g| {
                self.limits
                    .get(&UsageKey::new(id, g), 0)
                    .ok()
                    .map(|l| l.max)
            },
            &self.excess,
            own,
        )?;
        let raced = self
            .excess
            .iter()
            .filter(|(_, e)| under(e, crossed.cgroup_id, crossed.gpu))
            .map(|(k, e)| (*k, e.clone()))
            .collect();
        Some((crossed, raced))
    }

    /// Forgets the object at `object` (freed).
    pub fn forget(&mut self, object: &ObjKey) {
        self.excess.remove(object);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn excess(gpu: u32, bytes: u64, levels: &[u64]) -> Excess {
        Excess {
            pid: 1,
            serial: 1,
            gpu,
            bytes,
            levels: levels.to_vec(),
        }
    }

    fn obj(object: u32) -> ObjKey {
        ObjKey { client: 1, object }
    }

    #[test]
    fn excess_under_a_limit_adds_to_the_charges_until_they_cross_it() {
        // Root 1, pod 2, container 3; a 64 MiB limit on the container for all GPUs.
        let limit = |id, g| (id == 3 && g == GPU_ALL).then_some(64 * MIB);
        let usage = |_, _| 4 * 4096;
        let mut ex = BTreeMap::new();
        ex.insert(obj(1), excess(0, 16 * MIB - 4096, &[1, 2, 3]));
        ex.insert(obj(2), excess(0, 16 * MIB - 4096, &[1, 2, 3]));
        ex.insert(obj(3), excess(0, 16 * MIB - 4096, &[1, 2, 3]));
        assert_eq!(first_crossed(&[1, 2, 3], 0, usage, limit, &ex, true), None);
        ex.insert(obj(4), excess(0, 16 * MIB - 4096, &[1, 2, 3]));
        assert_eq!(
            first_crossed(&[1, 2, 3], 0, usage, limit, &ex, true),
            None,
            "exactly at the limit is within it"
        );
        ex.insert(obj(5), excess(0, 4096, &[1, 2, 3]));
        let c = first_crossed(&[1, 2, 3], 0, usage, limit, &ex, true).expect("crossed");
        assert_eq!((c.cgroup_id, c.gpu, c.max), (3, GPU_ALL, 64 * MIB));
        assert_eq!(c.usage, 64 * MIB + 4096);
    }

    #[test]
    fn an_ancestors_limit_counts_its_descendants_excess_and_a_gpu_limit_its_gpu_only() {
        // A 32 MiB limit on GPU 1 of the pod (2); excess in two containers (3, 4).
        let limit = |id, g| (id == 2 && g == 1).then_some(32 * MIB);
        let usage = |_, _| 0;
        let mut ex = BTreeMap::new();
        ex.insert(obj(1), excess(1, 20 * MIB, &[1, 2, 3]));
        ex.insert(obj(2), excess(0, 20 * MIB, &[1, 2, 4]));
        assert_eq!(first_crossed(&[1, 2, 4], 1, usage, limit, &ex, true), None);
        ex.insert(obj(3), excess(1, 20 * MIB, &[1, 2, 4]));
        let c = first_crossed(&[1, 2, 4], 1, usage, limit, &ex, true).expect("crossed");
        assert_eq!((c.cgroup_id, c.gpu, c.usage), (2, 1, 40 * MIB));
    }

    #[test]
    fn charges_over_the_limit_alone_are_the_probes_crossing_not_the_excess() {
        let limit = |id, g| (id == 3 && g == GPU_ALL).then_some(64 * MIB);
        // A crossing the kernel charged (80 MiB) and acts on; an object read back with no
        // excess of its own is not what crossed.
        let usage = |_, _| 80 * MIB;
        let mut ex = BTreeMap::new();
        assert_eq!(first_crossed(&[1, 2, 3], 0, usage, limit, &ex, false), None);
        ex.insert(obj(1), excess(0, 2 * MIB, &[1, 2, 3]));
        assert_eq!(first_crossed(&[1, 2, 3], 0, usage, limit, &ex, false), None);
        assert!(first_crossed(&[1, 2, 3], 0, usage, limit, &ex, true).is_some());
        // Within the limit by the charges, over by earlier objects' excess: those crossed it,
        // whichever object was read back last.
        let usage = |_, _| 63 * MIB;
        assert!(first_crossed(&[1, 2, 3], 0, usage, limit, &ex, false).is_some());
    }
}
