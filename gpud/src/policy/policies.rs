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
    /// last (stored selectors may name other GPUs, or GPUs at all, now).
    pub fn set_catalog(&mut self, catalog: GpuCatalog) -> bool {
        let known = matches!(catalog, GpuCatalog::Known(_)) && catalog != self.catalog;
        self.catalog = catalog;
        known
    }

    /// The GPU key (index or `GPU_ALL`) of a selector for a new limit, checked against the
    /// inventory where there is one: `None` when the limit is to wait for NVML (a UUID while
    /// NVML has not answered). An index needs no NVML: the kernel side keys memory by the
    /// device the driver numbers, so it is taken as given until NVML can check it ([`Self::key_now`]).
    /// A selector NVML does not report, and a UUID with NVML off by configuration (nothing
    /// could ever resolve it), are refused.
    pub fn checked_key(&self, gpu: &GpuSelector) -> Result<Option<u32>, PolicyError> {
        let selector = || gpu.to_string();
        match (gpu, &self.catalog) {
            (GpuSelector::All, _) => Ok(Some(GPU_ALL)),
            (GpuSelector::Index(i), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(idx, _)| idx == i)
                .map(|(idx, _)| Some(*idx))
                .ok_or_else(|| {
                    PolicyError::UnknownGpu(selector(), "no GPU with this index".into())
                }),
            (GpuSelector::Index(i), _) => Ok(Some(*i)),
            (GpuSelector::Uuid(_), GpuCatalog::Disabled) => Err(PolicyError::NoInventory {
                selector: selector(),
            }),
            (GpuSelector::Uuid(_), GpuCatalog::Unavailable(_)) => Ok(None),
            (GpuSelector::Uuid(u), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(_, uuid)| uuid.eq_ignore_ascii_case(u))
                .map(|(idx, _)| Some(*idx))
                .ok_or_else(|| PolicyError::UnknownGpu(selector(), "no GPU with this UUID".into())),
        }
    }

    /// The GPU key a stored selector names now, or why it names none: a UUID only through a
    /// known inventory; an index as given until NVML answers, then only if NVML reports it
    /// (a limit is never moved onto another GPU).
    pub fn key_now(&self, gpu: &GpuSelector) -> Result<u32, String> {
        match (gpu, &self.catalog) {
            (GpuSelector::All, _) => Ok(GPU_ALL),
            (GpuSelector::Index(i), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(idx, _)| idx == i)
                .map(|(idx, _)| *idx)
                .ok_or_else(|| format!("NVML reports no GPU {i}")),
            (GpuSelector::Index(i), _) => Ok(*i),
            (GpuSelector::Uuid(u), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(_, uuid)| uuid.eq_ignore_ascii_case(u))
                .map(|(idx, _)| *idx)
                .ok_or_else(|| format!("NVML reports no GPU {u}")),
            (GpuSelector::Uuid(_), GpuCatalog::Unavailable(why)) => Err(format!(
                "waits for NVML to name this GPU (NVML is unavailable: {why})"
            )),
            (GpuSelector::Uuid(_), GpuCatalog::Disabled) => {
                Err("NVML is disabled ([nvml] enabled = false): nothing names this GPU".into())
            }
        }
    }

    /// The GPU key a stored selector names now ([`Self::key_now`]), if any.
    pub fn resolve(&self, gpu: &GpuSelector) -> Option<u32> {
        self.key_now(gpu).ok()
    }

    /// The GPU key a stored entry names: `in_force` (where it was put in force, whatever NVML
    /// says by then), else what its selector resolves to now.
    pub fn key_in(&self, in_force: Option<u32>, gpu: &GpuSelector) -> Option<u32> {
        in_force.or_else(|| self.resolve(gpu))
    }

    /// Refuses a selector `gpu` of `path` naming GPU `key` when another selector of `path` names
    /// it (one card carries one selector's limits per cgroup: an index and a UUID naming one GPU
    /// are refused), where `key_of` says what each stored entry names; `all` is never taken.
    pub fn check_one_selector(
        &self,
        path: &str,
        gpu: &GpuSelector,
        key: u32,
        key_of: impl Fn(&str, &GpuSelector) -> Option<u32>,
    ) -> Result<(), PolicyError> {
        if key == GPU_ALL {
            return Ok(());
        }
        match self
            .store
            .iter()
            .filter(|((c, g), _)| c == path && g != gpu)
            .find(|((c, g), _)| key_of(c, g) == Some(key))
        {
            Some(((_, other), _)) => Err(PolicyError::SameGpu {
                selector: gpu.to_string(),
                index: key,
                other: other.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// Sets limits on (cgroup `path`, `gpu`), validated and persisted: guarantees over 100 % of
    /// a GPU and a guarantee above its cap are refused. Returns the limits now stored there.
    /// Nothing changes on error. (Whether the selector names a card this cgroup limits under
    /// another one depends on where limits are in force: the caller checks it,
    /// [`Self::check_one_selector`].)
    pub fn set(
        &mut self,
        path: &str,
        gpu: &GpuSelector,
        update: &LimitUpdate,
    ) -> Result<Limits, PolicyError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CorruptState;

    fn store(tag: &str, catalog: GpuCatalog) -> PolicyStore {
        let dir = std::env::temp_dir().join(format!("gpud-policies-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        match LimitStore::load(&dir, CorruptState::Refuse) {
            Ok(s) => PolicyStore::new(s, catalog),
            Err(e) => panic!("{e}"),
        }
    }

    const UUID: &str = "GPU-00000001-1111-2222-3333-444444444444";

    #[test]
    fn selectors_name_gpus_with_and_without_nvml() {
        let uuid = GpuSelector::Uuid(UUID.into());
        let (i1, i3) = (GpuSelector::Index(1), GpuSelector::Index(3));

        // NVML not answering: an index is taken as given, a UUID waits.
        let s = store("down", GpuCatalog::Unavailable("no library".into()));
        assert_eq!(s.checked_key(&GpuSelector::All).ok(), Some(Some(GPU_ALL)));
        assert_eq!(s.checked_key(&i3).ok(), Some(Some(3)));
        assert_eq!(s.checked_key(&uuid).ok(), Some(None));
        assert_eq!(s.key_now(&i3), Ok(3));
        assert!(
            s.key_now(&uuid)
                .is_err_and(|why| why.contains("no library"))
        );

        // NVML off: the same for an index; a UUID can never resolve, so it is refused.
        let s = store("off", GpuCatalog::Disabled);
        assert_eq!(s.checked_key(&i1).ok(), Some(Some(1)));
        assert!(matches!(
            s.checked_key(&uuid),
            Err(PolicyError::NoInventory { .. })
        ));

        // NVML answering with GPUs 0 and 1: the UUID is GPU 1; GPU 3 is refused when set and,
        // stored, names no GPU (never another one).
        let mut s = store("known", GpuCatalog::Unavailable(String::new()));
        assert!(s.set_catalog(GpuCatalog::Known(vec![
            (0, "GPU-0".into()),
            (1, UUID.to_ascii_lowercase()),
        ])));
        assert_eq!(s.checked_key(&uuid).ok(), Some(Some(1)));
        assert_eq!(s.key_now(&uuid), Ok(1));
        assert!(matches!(
            s.checked_key(&i3),
            Err(PolicyError::UnknownGpu(..))
        ));
        assert!(s.key_now(&i3).is_err_and(|why| why.contains("no GPU 3")));
        assert_eq!(s.resolve(&i3), None);
        // The same inventory again is no change; NVML going away is none either.
        assert!(!s.set_catalog(GpuCatalog::Known(vec![
            (0, "GPU-0".into()),
            (1, UUID.to_ascii_lowercase()),
        ])));
        assert!(!s.set_catalog(GpuCatalog::Unavailable("gone".into())));
    }
}
