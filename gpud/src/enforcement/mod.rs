//! Enforcement of GPU-memory limits: turns the stored policy into kernel-map entries, re-applies
//! it at start, and acts on the kernel's limit events (the `freeze` action, notices for D-Bus).
//! The `kill` and `deny` actions happen in the kernel itself; this module only reports them.
//! Owned by the state task. Compute shares are [`compute`]'s, a task of their own; the scheduler
//! guard's allowances and reports are [`guard`]'s.

pub mod compute;
pub mod dmem;
pub mod guard;
pub mod restore;

use std::collections::{BTreeMap, BTreeSet};

use gpud_common::GPU_ALL;
use tracing::{error, info, warn};

use crate::{
    attribution::{Attribution, AttributionError, memory::gpu_name},
    cgroupfs::CgroupError,
    config::ReactAction,
    notice::LimitNotice,
    policy::{GpuSelector, LimitStore, LimitUpdate, Limits, PolicyError},
    probes::{KernelSettings, SettingError, Tier, events::LimitEvent},
    report::Chain,
};

#[derive(Debug, thiserror::Error)]
pub enum EnforcementError {
    #[error(transparent)]
    Attribution(#[from] AttributionError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    Setting(#[from] SettingError),
    #[error("unknown GPU {0}: {1}")]
    UnknownGpu(String, String),
    /// NVML has not answered (yet, or any more): the selector cannot be checked now.
    #[error("GPU {selector} cannot be checked now: NVML is unavailable ({reason}); try again")]
    InventoryUnavailable { selector: String, reason: String },
    /// NVML is off by configuration: per-GPU selectors cannot be checked at all.
    #[error(
        "GPU {selector} cannot be checked: NVML is disabled ([nvml] enabled = false); per-GPU \
         limits need it, use `all`"
    )]
    NoInventory { selector: String },
    /// One card under two selectors (an index and a UUID) on one cgroup: which limit holds?
    #[error(
        "GPU {selector} is GPU {index}, which this cgroup already has limits for as `{other}`: \
         change them through `{other}`, or clear those first"
    )]
    SameGpu {
        selector: String,
        index: u32,
        other: String,
    },
}

/// The limits set on one (cgroup, GPU selector).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitEntry {
    /// Path relative to the cgroup v2 root.
    pub cgroup: String,
    pub gpu: GpuSelector,
    pub limits: Limits,
}

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

pub struct MemoryEnforcement {
    store: LimitStore,
    tier: Tier,
    action: ReactAction,
    /// cgroups this module froze (react `freeze`), thawed when their limit is raised or cleared.
    frozen: BTreeSet<String>,
    catalog: GpuCatalog,
    /// The kernel key (GPU index or `GPU_ALL`) each stored entry's memory limit is in force
    /// under. A UUID entry restored before NVML answered is stored but in force nowhere until
    /// the inventory resolves it; clearing an entry uses the key it was applied under, whatever
    /// NVML says by then.
    applied: BTreeMap<(String, GpuSelector), u32>,
}

impl MemoryEnforcement {
    /// `catalog`: what is known of the GPUs at start (`Disabled` without NVML, else
    /// `Unavailable` until its first answer).
    pub fn new(store: LimitStore, tier: Tier, action: ReactAction, catalog: GpuCatalog) -> Self {
        Self {
            store,
            tier,
            action,
            frozen: BTreeSet::new(),
            catalog,
            applied: BTreeMap::new(),
        }
    }

    /// A new inventory (or NVML going away). A known one puts the stored limits that waited for
    /// it (UUID selectors restored before NVML answered) in force.
    pub fn set_catalog(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        catalog: GpuCatalog,
    ) {
        let known = matches!(catalog, GpuCatalog::Known(_)) && catalog != self.catalog;
        self.catalog = catalog;
        if known {
            self.apply_pending(attr, settings);
        }
    }

    /// The kernel key of a selector for a new limit: checked against the inventory. Without one
    /// a per-GPU selector cannot be checked, so it is refused (`all` needs none).
    fn checked_key(&self, gpu: &GpuSelector) -> Result<u32, EnforcementError> {
        let selector = || gpu.to_string();
        match (gpu, &self.catalog) {
            (GpuSelector::All, _) => Ok(GPU_ALL),
            (_, GpuCatalog::Disabled) => Err(EnforcementError::NoInventory {
                selector: selector(),
            }),
            (_, GpuCatalog::Unavailable(reason)) => Err(EnforcementError::InventoryUnavailable {
                selector: selector(),
                reason: reason.clone(),
            }),
            (GpuSelector::Index(i), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(idx, _)| idx == i)
                .map(|(idx, _)| *idx)
                .ok_or_else(|| {
                    EnforcementError::UnknownGpu(selector(), "no GPU with this index".into())
                }),
            (GpuSelector::Uuid(u), GpuCatalog::Known(c)) => c
                .iter()
                .find(|(_, uuid)| uuid.eq_ignore_ascii_case(u))
                .map(|(idx, _)| *idx)
                .ok_or_else(|| {
                    EnforcementError::UnknownGpu(selector(), "no GPU with this UUID".into())
                }),
        }
    }

    /// The kernel key of a stored entry (validated when it was set): where it was applied, else
    /// what the selector names (a UUID only through a known inventory).
    fn stored_key(&self, cgroup: &str, gpu: &GpuSelector) -> Option<u32> {
        if let Some(k) = self.applied.get(&(cgroup.to_owned(), gpu.clone())) {
            return Some(*k);
        }
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

    /// Refuses a second selector for a card this cgroup already has limits for (an index and a
    /// UUID naming one GPU): the two would overwrite each other's kernel entry.
    fn check_one_selector_per_gpu(
        &self,
        cgroup: &str,
        gpu: &GpuSelector,
        key: u32,
    ) -> Result<(), EnforcementError> {
        if key == GPU_ALL {
            return Ok(());
        }
        let other = self
            .store
            .iter()
            .filter(|((c, g), _)| c == cgroup && g != gpu)
            .find(|((c, g), _)| self.stored_key(c, g) == Some(key));
        match other {
            Some(((_, g), _)) => Err(EnforcementError::SameGpu {
                selector: gpu.to_string(),
                index: key,
                other: g.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// Puts stored limits that are in force nowhere yet (UUID selectors restored before NVML
    /// answered) in force, now that the inventory resolves them.
    fn apply_pending(&mut self, attr: &mut Attribution, settings: &mut KernelSettings) {
        let pending: Vec<(String, GpuSelector, u64)> = self
            .store
            .iter()
            .filter(|(k, _)| !self.applied.contains_key(k))
            .filter_map(|((c, g), l)| Some((c.clone(), g.clone(), l.memory_max?)))
            .collect();
        for (cgroup, gpu, max) in pending {
            let Some(key) = self.stored_key(&cgroup, &gpu) else {
                warn!(
                    cgroup = %cgroup, gpu = %gpu,
                    "stored limit names a GPU NVML does not report; kept, in force nowhere"
                );
                continue;
            };
            let applied = attr
                .id_of(&cgroup)
                .map_err(EnforcementError::from)
                .and_then(|(_, id)| Ok(settings.set_limit(id, key, max)?));
            match applied {
                Ok(()) => {
                    info!(cgroup = %cgroup, gpu = %gpu, index = key, memory_max = max, "stored limit in force");
                    self.applied.insert((cgroup, gpu), key);
                }
                Err(e) => {
                    error!(cgroup = %cgroup, gpu = %gpu, "cannot apply stored limit: {}", Chain(&e))
                }
            }
        }
    }

    /// Re-applies the stored limits at start: the kernel maps get exactly the stored set; limits
    /// of cgroups that no longer exist are dropped with a log line.
    pub fn restore(&mut self, attr: &mut Attribution, settings: &mut KernelSettings) {
        let mut keep = BTreeMap::new();
        let mut wanted = BTreeSet::new();
        for ((cgroup, gpu), limits) in self.store.entries().clone() {
            let id = match attr.id_of(&cgroup) {
                Ok((_, id)) => id,
                Err(e) => {
                    warn!(cgroup = %cgroup, gpu = %gpu, "dropping stored limit: {}", Chain(&e));
                    continue;
                }
            };
            // A UUID waits for NVML to resolve it (`apply_pending`): kept, not dropped.
            match (self.stored_key(&cgroup, &gpu), limits.memory_max) {
                (Some(key), Some(max)) => {
                    if let Err(e) = settings.set_limit(id, key, max) {
                        error!(cgroup = %cgroup, "cannot apply stored limit: {}", Chain(&e));
                        continue;
                    }
                    wanted.insert((id, key));
                    self.applied.insert((cgroup.clone(), gpu.clone()), key);
                }
                (None, Some(_)) => {
                    info!(cgroup = %cgroup, gpu = %gpu, "stored limit waits for NVML to resolve its GPU");
                }
                (_, None) => {}
            }
            keep.insert((cgroup, gpu), limits);
        }
        // Pinned maps may hold limits the store no longer has (changed while down).
        for (id, key) in settings.limits().into_keys() {
            if !wanted.contains(&(id, key)) {
                let _ = settings.clear_limit(id, key);
            }
        }
        let n = keep.len();
        if keep != *self.store.entries()
            && let Err(e) = self.store.replace(keep)
        {
            error!("cannot persist limits: {}", Chain(&e));
        }
        info!(limits = n, tier = self.tier.as_str(), "limits in force");
    }

    /// Sets limits on (cgroup, GPU); validated and persisted before it returns. Nothing changes
    /// on error.
    pub fn set(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        cgroup: &str,
        gpu: &str,
        update: LimitUpdate,
    ) -> Result<(), EnforcementError> {
        let gpu: GpuSelector = gpu.parse().map_err(PolicyError::from)?;
        let key = self.checked_key(&gpu)?;
        let (path, id) = attr.id_of(cgroup)?;
        self.check_one_selector_per_gpu(&path, &gpu, key)?;
        let mut entries = self.store.entries().clone();
        let mut limits = entries
            .get(&(path.clone(), gpu.clone()))
            .cloned()
            .unwrap_or_default();
        update.apply_to(&mut limits);
        entries.insert((path.clone(), gpu.clone()), limits.clone());
        // Guarantees must fit in one GPU.
        let mins: u32 = entries
            .iter()
            .filter(|((_, g), _)| *g == gpu || *g == GpuSelector::All || gpu == GpuSelector::All)
            .filter_map(|(_, l)| l.compute_min)
            .sum();
        if mins > 100 {
            return Err(PolicyError::InvalidValue {
                name: "compute_min".into(),
                reason: format!("guarantees on this GPU would add up to {mins} % (at most 100)"),
            }
            .into());
        }
        if let (Some(min), Some(max)) = (limits.compute_min, limits.compute_max)
            && min > max
        {
            return Err(PolicyError::InvalidValue {
                name: "compute_min".into(),
                reason: format!("{min} is above compute_max {max}"),
            }
            .into());
        }
        self.store.replace(entries)?;
        if let Some(max) = limits.memory_max {
            settings.set_limit(id, key, max)?;
            self.applied.insert((path.clone(), gpu.clone()), key);
            info!(cgroup = %path, gpu = %gpu, memory_max = max, "limit set");
            self.maybe_thaw(attr, settings, &path, id);
        }
        Ok(())
    }

    /// Clears the named limits (all when `names` is empty) on (cgroup, GPU).
    pub fn clear(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        cgroup: &str,
        gpu: &str,
        names: &[String],
    ) -> Result<(), EnforcementError> {
        let gpu: GpuSelector = gpu.parse().map_err(PolicyError::from)?;
        let mut probe = Limits::default();
        if let Some(bad) = names.iter().find(|n| !probe.clear(n)) {
            return Err(PolicyError::UnknownLimit(bad.chars().take(80).collect()).into());
        }
        let (path, id) = match attr.id_of(cgroup) {
            Ok(found) => found,
            Err(AttributionError::Cgroup(CgroupError::NotFound(missing))) => {
                return self.forget_removed(&missing, &gpu);
            }
            Err(e) => return Err(e.into()),
        };
        let mut entries = self.store.entries().clone();
        if let Some(l) = entries.get_mut(&(path.clone(), gpu.clone())) {
            if names.is_empty() {
                *l = Limits::default();
            } else {
                for n in names {
                    l.clear(n);
                }
            }
        }
        let memory_left = entries
            .get(&(path.clone(), gpu.clone()))
            .and_then(|l| l.memory_max);
        // Where it is in force, whatever NVML says now (none: a UUID never applied).
        let key = self.stored_key(&path, &gpu);
        self.store.replace(entries)?;
        if memory_left.is_none() {
            self.applied.remove(&(path.clone(), gpu.clone()));
            if let Some(key) = key {
                settings.clear_limit(id, key)?;
            }
        }
        info!(cgroup = %path, gpu = %gpu, "limit cleared");
        self.maybe_thaw(attr, settings, &path, id);
        Ok(())
    }

    /// Clearing the limits of a cgroup that was removed (as a container runtime's `poststop`
    /// hook does: the runtime removes the container's cgroup first) drops what is stored for it
    /// at once rather than at the next sweep; its kernel entry went with its id. `NotFound` when
    /// nothing is stored for it either.
    fn forget_removed(&mut self, path: &str, gpu: &GpuSelector) -> Result<(), EnforcementError> {
        let key = (path.to_owned(), gpu.clone());
        if self.store.get(path, gpu).is_none() {
            return Err(AttributionError::Cgroup(CgroupError::NotFound(path.to_owned())).into());
        }
        let mut entries = self.store.entries().clone();
        entries.remove(&key);
        self.store.replace(entries)?;
        self.applied.remove(&key);
        if !self.store.entries().keys().any(|(cg, _)| cg == path) {
            self.frozen.remove(path);
        }
        info!(cgroup = %path, gpu = %gpu, "limits of a removed cgroup cleared");
        Ok(())
    }

    /// Every limit in force, ordered by cgroup and GPU.
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

    /// Drops limits of cgroups that were removed (with a log line).
    pub fn sweep(&mut self, attr: &mut Attribution) {
        let gone: Vec<(String, GpuSelector)> = self
            .store
            .entries()
            .keys()
            .filter(|(cg, _)| attr.id_of(cg).is_err())
            .cloned()
            .collect();
        if gone.is_empty() {
            return;
        }
        let mut entries = self.store.entries().clone();
        for k in &gone {
            info!(cgroup = %k.0, gpu = %k.1, "cgroup removed; dropping its limit");
            entries.remove(k);
            self.applied.remove(k);
            self.frozen.remove(&k.0);
        }
        if let Err(e) = self.store.replace(entries) {
            error!("cannot persist limits: {}", Chain(&e));
        }
    }

    /// Acts on an allocation that met a limit (`denied`: the deny tier refused it; else it
    /// crossed the limit); returns the notice to publish.
    pub fn on_limit(
        &mut self,
        attr: &mut Attribution,
        settings: &KernelSettings,
        ev: &LimitEvent,
        denied: bool,
    ) -> LimitNotice {
        let path = attr.path_of(ev.cgroup_id);
        let max = settings
            .limits()
            .get(&(ev.cgroup_id, ev.gpu))
            .copied()
            .unwrap_or(0);
        let action = if denied {
            "denied"
        } else {
            match self.action {
                ReactAction::Kill => "killed",
                ReactAction::Notify => "notified",
                ReactAction::Freeze => match &path {
                    Some(p) => match attr.freeze(p, true) {
                        Ok(()) => {
                            self.frozen.insert(p.clone());
                            "frozen"
                        }
                        Err(e) => {
                            error!(cgroup = %p, "cannot freeze: {}", Chain(&e));
                            "notified"
                        }
                    },
                    None => "notified",
                },
            }
        };
        LimitNotice {
            cgroup: path.unwrap_or_else(|| format!("#{}", ev.cgroup_id)),
            gpu: gpu_name(ev.gpu),
            pid: ev.pid,
            bytes: ev.bytes,
            usage: ev.usage,
            max,
            action: action.to_owned(),
        }
    }

    /// Thaws a cgroup this module froze once none of its limits is exceeded any more.
    fn maybe_thaw(
        &mut self,
        attr: &mut Attribution,
        settings: &KernelSettings,
        path: &str,
        id: u64,
    ) {
        if !self.frozen.contains(path) {
            return;
        }
        let limits = settings.limits();
        let over = limits
            .iter()
            .any(|((cg, gpu), max)| *cg == id && attr.usage_of(id, *gpu) > *max);
        if !over {
            match attr.freeze(path, false) {
                Ok(()) => {
                    info!(cgroup = %path, "thawed: back within its limits");
                    self.frozen.remove(path);
                }
                Err(e) => error!(cgroup = %path, "cannot thaw: {}", Chain(&e)),
            }
        }
    }

    /// Thaws every cgroup this module froze (clean shutdown: the daemon will not be there to
    /// thaw them later).
    pub fn thaw_all(&mut self, attr: &mut Attribution) {
        for p in std::mem::take(&mut self.frozen) {
            if let Err(e) = attr.freeze(&p, false) {
                error!(cgroup = %p, "cannot thaw at shutdown: {}", Chain(&e));
            }
        }
    }

    /// The memory limits in force: (cgroup path, GPU index or `GPU_ALL`, bytes).
    pub fn memory_limits(&self) -> Vec<(String, u32, u64)> {
        self.applied
            .iter()
            .filter_map(|((cgroup, gpu), key)| {
                let max = self.store.get(cgroup, gpu)?.memory_max?;
                Some((cgroup.clone(), *key, max))
            })
            .collect()
    }

    /// Every stored policy: (cgroup path, limits), one per GPU selector.
    pub fn policies(&self) -> impl Iterator<Item = (&str, &Limits)> {
        self.store.iter().map(|((c, _), l)| (c.as_str(), l))
    }

    /// Compute policies in force: (cgroup path, GPU selector, limits).
    pub fn compute_policies(&self) -> Vec<(String, GpuSelector, Limits)> {
        self.store
            .iter()
            .filter(|(_, l)| l.has_compute())
            .map(|((c, g), l)| (c.clone(), g.clone(), l.clone()))
            .collect()
    }

    /// cgroups the `freeze` action froze (the compute controller leaves them alone).
    pub fn frozen(&self) -> &BTreeSet<String> {
        &self.frozen
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
                g if self.stored_key(c, g) == Some(gpu) => return Some(l.clone()),
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

    pub fn tier(&self) -> Tier {
        self.tier
    }

    pub fn action(&self) -> ReactAction {
        self.action
    }
}
