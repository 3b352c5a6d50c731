//! The policy store: every limit operators set (memory, compute caps, weights, guarantees,
//! priority classes), by cgroup path and GPU selector; the checks a new one must pass (its GPU in
//! the inventory, one selector per card, guarantees that fit a GPU); the GPU each selector names;
//! persisted in the state directory ([`LimitStore`]) before a change is answered. What is put in
//! force from it, and how, is the enforcement's (memory limits, the guard's allowances, the
//! compute law's shares); nothing here touches the kernel.

use std::collections::BTreeMap;

use gpud_common::GPU_ALL;
use tracing::error;

use super::{GpuSelector, LimitStore, LimitUpdate, Limits, PolicyError};
use crate::report::Chain;

/// What the daemon knows of the machine's GPUs, to check the GPU selectors of new limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuCatalog {
    /// NVML is off by configuration (`[nvml] enabled = false`).
    Disabled,
    /// NVML has not answered (yet, or any more): why.
    Unavailable(String),
    /// Index and UUID of every whole GPU NVML reports.
    Known(Vec<(u32, String)>),
}

/// The limits set on one (cgroup, GPU selector).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitEntry {
    /// Path relative to the cgroup v2 root.
    pub cgroup: String,
    pub gpu: GpuSelector,
    pub limits: Limits,
}

/// The stored limits and what is known of the GPUs their selectors name.
pub struct PolicyStore {
    store: LimitStore,
    catalog: GpuCatalog,
}

impl PolicyStore {
    /// `catalog`: what is known of the GPUs at start (`Disabled` without NVML, else
    /// `Unavailable` until its first answer).
    pub fn new(store: LimitStore, catalog: GpuCatalog) -> Self {
        Self { store, catalog }
    }

    /// A new inventory (or NVML going away); true when it is a known one that differs from the
    /// last (stored UUID selectors may resolve now).
    pub fn set_catalog(&mut self, catalog: GpuCatalog) -> bool {
        let known = matches!(catalog, GpuCatalog::Known(_)) && catalog != self.catalog;
        self.catalog = catalog;
        known
    }

    /// The GPU key (index or `GPU_ALL`) of a selector for a new limit, checked against the
    /// inventory. Without one a per-GPU selector cannot be checked, so it is refused (`all`
    /// needs none).
    pub fn checked_key(&self, gpu: &GpuSelector) -> Result<u32, PolicyError> {
        let selector = || gpu.to_string();
        match (gpu, &self.catalog) {
            (GpuSelector::All, _) => Ok(GPU_ALL),
            (_, GpuCatalog::Disabled) => Err(PolicyError::NoInventory {
                selector: selector(),
            }),
            (_, GpuCatalog::Unavailable(reason)) => Err(PolicyError::InventoryUnavailable {
                selector: selector(),
                reason: reason.clone(),
            }),
            (GpuSelector::Index(i), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(idx, _)| idx == i)
                .map(|(idx, _)| *idx)
                .ok_or_else(|| {
                    PolicyError::UnknownGpu(selector(), "no GPU with this index".into())
                }),
            (GpuSelector::Uuid(u), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(_, uuid)| uuid.eq_ignore_ascii_case(u))
                .map(|(idx, _)| *idx)
                .ok_or_else(|| PolicyError::UnknownGpu(selector(), "no GPU with this UUID".into())),
        }
    }

    /// The GPU key a stored selector names now: a UUID only through a known inventory.
    pub fn resolve(&self, gpu: &GpuSelector) -> Option<u32> {
        match (gpu, &self.catalog) {
            (GpuSelector::All, _) => Some(GPU_ALL),
            (GpuSelector::Index(i), _) => Some(*i),
            (GpuSelector::Uuid(u), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(_, uuid)| uuid.eq_ignore_ascii_case(u))
                .map(|(idx, _)| *idx),
            (GpuSelector::Uuid(_), _) => None,
        }
    }

    /// The GPU key a stored entry names: where `in_force` says it was put in force, whatever
    /// NVML says by then, else what its selector resolves to now.
    pub fn key_in(
        &self,
        in_force: &BTreeMap<(String, GpuSelector), u32>,
        cgroup: &str,
        gpu: &GpuSelector,
    ) -> Option<u32> {
        in_force
            .get(&(cgroup.to_owned(), gpu.clone()))
            .copied()
            .or_else(|| self.resolve(gpu))
    }

    /// Sets limits on (cgroup `path`, `gpu`), validated and persisted: a second selector for a
    /// card this cgroup has limits for (an index and a UUID naming one GPU: what an entry names
    /// is where `in_force` says it was put in force, else what its selector resolves to) is
    /// refused, as are guarantees over 100 % of a GPU and a guarantee above its cap. Returns the
    /// limits now stored there. Nothing changes on error.
    pub fn set(
        &mut self,
        path: &str,
        gpu: &GpuSelector,
        key: u32,
        update: LimitUpdate,
        in_force: &BTreeMap<(String, GpuSelector), u32>,
    ) -> Result<Limits, PolicyError> {
        let key_of = |c: &str, g: &GpuSelector| self.key_in(in_force, c, g);
        if key != GPU_ALL
            && let Some(((_, other), _)) = self
                .store
                .iter()
                .filter(|((c, g), _)| c == path && g != gpu)
                .find(|((c, g), _)| key_of(c, g) == Some(key))
        {
            return Err(PolicyError::SameGpu {
                selector: gpu.to_string(),
                index: key,
                other: other.to_string(),
            });
        }
        let mut entries = self.store.entries().clone();
        let mut limits = entries
            .get(&(path.to_owned(), gpu.clone()))
            .cloned()
            .unwrap_or_default();
        update.apply_to(&mut limits);
        entries.insert((path.to_owned(), gpu.clone()), limits.clone());
        // Guarantees must fit in one GPU.
        let mins: u32 = entries
            .iter()
            .filter(|((_, g), _)| g == gpu || *g == GpuSelector::All || *gpu == GpuSelector::All)
            .filter_map(|(_, l)| l.compute_min)
            .sum();
        if mins > 100 {
            return Err(PolicyError::InvalidValue {
                name: "compute_min".into(),
                reason: format!("guarantees on this GPU would add up to {mins} % (at most 100)"),
            });
        }
        if let (Some(min), Some(max)) = (limits.compute_min, limits.compute_max)
            && min > max
        {
            return Err(PolicyError::InvalidValue {
                name: "compute_min".into(),
                reason: format!("{min} is above compute_max {max}"),
            });
        }
        self.store.replace(entries)?;
        Ok(limits)
    }

    /// Clears the named limits (all when `names` is empty) on (cgroup `path`, `gpu`), persisted;
    /// the limits left there. Unknown names are refused before anything changes.
    pub fn clear(
        &mut self,
        path: &str,
        gpu: &GpuSelector,
        names: &[String],
    ) -> Result<Option<Limits>, PolicyError> {
        Self::check_names(names)?;
        let mut entries = self.store.entries().clone();
        if let Some(l) = entries.get_mut(&(path.to_owned(), gpu.clone())) {
            if names.is_empty() {
                *l = Limits::default();
            } else {
                for n in names {
                    l.clear(n);
                }
            }
        }
        let left = entries.get(&(path.to_owned(), gpu.clone())).cloned();
        self.store.replace(entries)?;
        Ok(left)
    }

    /// Refuses names that are no limit.
    pub fn check_names(names: &[String]) -> Result<(), PolicyError> {
        let mut probe = Limits::default();
        match names.iter().find(|n| !probe.clear(n)) {
            Some(bad) => Err(PolicyError::UnknownLimit(bad.chars().take(80).collect())),
            None => Ok(()),
        }
    }

    /// Drops the entries `gone` (cgroups removed), persisted (a failure is logged: the entries
    /// are gone from memory either way, and the next change persists again).
    pub fn remove(&mut self, gone: &[(String, GpuSelector)]) -> Result<(), PolicyError> {
        let mut entries = self.store.entries().clone();
        for k in gone {
            entries.remove(k);
        }
        self.store.replace(entries)
    }

    /// Keeps exactly `keep` (the start-up restore's verdict), persisted if it changed.
    pub fn retain(&mut self, keep: BTreeMap<(String, GpuSelector), Limits>) {
        if keep != *self.store.entries()
            && let Err(e) = self.store.replace(keep)
        {
            error!("cannot persist limits: {}", Chain(&e));
        }
    }

    pub fn get(&self, cgroup: &str, gpu: &GpuSelector) -> Option<&Limits> {
        self.store.get(cgroup, gpu)
    }

    pub fn entries(&self) -> &BTreeMap<(String, GpuSelector), Limits> {
        self.store.entries()
    }

    /// Every stored entry, ordered by cgroup and GPU.
    pub fn list(&self) -> Vec<LimitEntry> {
        self.store
            .iter()
            .map(|((cgroup, gpu), l)| LimitEntry {
                cgroup: cgroup.clone(),
                gpu: gpu.clone(),
                limits: l.clone(),
            })
            .collect()
    }

    /// Every stored policy: (cgroup path, limits), one per GPU selector.
    pub fn policies(&self) -> impl Iterator<Item = (&str, &Limits)> {
        self.store.iter().map(|((c, _), l)| (c.as_str(), l))
    }

    /// Compute policies: (cgroup path, GPU selector, limits).
    pub fn compute_policies(&self) -> Vec<(String, GpuSelector, Limits)> {
        self.store
            .iter()
            .filter(|(_, l)| l.has_compute())
            .map(|((c, g), l)| (c.clone(), g.clone(), l.clone()))
            .collect()
    }

    /// The compute policy of a cgroup path on a GPU: a per-GPU entry (index or UUID) wins over
    /// an `all` entry, whose caps and guarantees are split evenly over the `n_gpus` it uses.
    pub fn compute_policy_for(&self, path: &str, gpu: u32, n_gpus: u32) -> Option<Limits> {
        let mut all = None;
        for ((c, g), l) in self.store.iter() {
            if c != path || !l.has_compute() {
                continue;
            }
            match g {
                GpuSelector::All => all = Some(l.clone()),
                g if self.resolve(g) == Some(gpu) => return Some(l.clone()),
                _ => {}
            }
        }
        all.map(|mut l| {
            let n = n_gpus.max(1);
            l.compute_max = l.compute_max.map(|v| (v / n).max(1));
            l.compute_min = l.compute_min.map(|v| (v / n).max(1));
            l
        })
    }
}
