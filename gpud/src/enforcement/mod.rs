//! Enforcement of GPU-memory limits: turns the stored policies' memory limits ([`PolicyStore`])
//! into kernel-map entries, re-applies them at start, and acts on the kernel's limit events (the
//! `freeze` action, notices).
//! The `kill` and `deny` actions happen in the kernel itself; this module only reports them.
//! What the probes cannot size, NVML's per-process memory shows: the [`backstop`] acts on it.
//! What the probes sized from a request another thread changed before the driver copied it, the
//! driver's own size of the object shows: [`sizes`] judges it, on the [`restore`] thread, which
//! also reads back the GPU of a device whose `deviceId` may have been changed the same way.
//! Memory on a GPU the probes cannot name meets every per-GPU limit: the kernel settings keep
//! the entry that says so beside them.
//! Owned by the state task. Compute shares are [`compute`]'s, a task of their own; the scheduler
//! guard's allowances and reports are [`guard`]'s.

pub mod backstop;
pub mod compute;
pub mod crossing;
pub mod dmem;
pub mod guard;
pub mod restore;
pub mod sizes;

use std::collections::{BTreeMap, BTreeSet};

use backstop::{Backstop, BackstopRule};
use gpud_api::LimitState;
use gpud_common::GPU_ALL;
use tracing::{error, info, warn};

use crate::{
    attribution::{Attribution, AttributionError, memory::gpu_name},
    cgroupfs::{CgroupError, Freezer, Holder},
    config::ReactAction,
    notice::{LimitAction, LimitNotice, LimitSource},
    nvml::ProcessSample,
    policy::{GpuCatalog, GpuSelector, LimitEntry, PolicyError, PolicyStore},
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
}

/// Memory limits put in force: each stored `memory_max` in the kernel's `LIMITS` (through
/// [`KernelSettings`]), under the GPU key its selector names, and the react tier's actions.
pub struct MemoryEnforcement {
    tier: Tier,
    action: ReactAction,
    /// The one writer of `cgroup.freeze`, and its record of the cgroups this module froze
    /// (react `freeze`, as `Holder::Memory`), thawed when their limit is raised or cleared.
    freezer: Freezer,
    /// The kernel key (GPU index or `GPU_ALL`) each stored entry's memory limit is in force
    /// under. An entry whose GPU is not known (a UUID set while NVML has not answered, an index
    /// NVML does not report) is stored but in force nowhere until the inventory names it
    /// ([`Self::reconcile`]); NVML going away leaves every entry where it is. Clearing an entry
    /// uses the key it was applied under, whatever NVML says by then.
    applied: BTreeMap<(String, GpuSelector), u32>,
    /// NVML's per-process memory against the limits in force ([`Self::on_nvml`]).
    backstop: Backstop,
}

impl MemoryEnforcement {
    pub fn new(tier: Tier, action: ReactAction, backstop: BackstopRule, freezer: Freezer) -> Self {
        Self {
            tier,
            action,
            freezer,
            applied: BTreeMap::new(),
            backstop: Backstop::new(backstop),
        }
    }

    /// The kernel key of a stored entry: where it was applied, else what its selector names now.
    pub fn key_of(&self, policies: &PolicyStore, cgroup: &str, gpu: &GpuSelector) -> Option<u32> {
        policies.key_in(self.in_force_under(cgroup, gpu), gpu)
    }

    /// A new inventory (or NVML going away). A known one moves every stored memory limit to
    /// the GPU its selector names now ([`Self::reconcile`]); NVML going away changes nothing in
    /// the kernel (what is in force stays in force).
    pub fn set_catalog(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        policies: &mut PolicyStore,
        catalog: GpuCatalog,
    ) {
        if policies.set_catalog(catalog) {
            self.reconcile(attr, settings, policies);
        }
    }

    /// Puts each stored memory limit in force under the GPU key its selector names now, per a
    /// known inventory: a UUID that waited for NVML goes in force; an index NVML does not
    /// report is taken out of force and kept aside (never applied to another GPU); a selector
    /// naming a card the cgroup already limits under another selector is kept aside. All moves
    /// out come before the moves in, so two entries trading GPUs do not collide.
    fn reconcile(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        policies: &PolicyStore,
    ) {
        let mut moves = Vec::new();
        for ((cgroup, gpu), l) in policies.entries() {
            let Some(max) = l.memory_max else { continue };
            let key = (cgroup.clone(), gpu.clone());
            let now = self.applied.get(&key).copied();
            let want = match policies.key_now(gpu) {
                Ok(k) => Some(k),
                Err(why) => {
                    warn!(cgroup = %cgroup, gpu = %gpu, "stored limit kept aside, in force nowhere: {why}");
                    None
                }
            };
            if want != now {
                moves.push((key, max, now, want));
            }
        }
        let mut ids = BTreeMap::new();
        for ((cgroup, gpu), _, now, _) in &moves {
            let id = match attr.id_of(cgroup) {
                Ok((_, id)) => id,
                Err(e) => {
                    warn!(cgroup = %cgroup, gpu = %gpu, "cannot move stored limit: {}", Chain(&e));
                    continue;
                }
            };
            ids.insert((cgroup.clone(), gpu.clone()), id);
            if let Some(old) = now {
                if let Err(e) = settings.clear_limit(id, *old) {
                    error!(cgroup = %cgroup, gpu = %gpu, "cannot take limit out of force: {}", Chain(&e));
                }
                self.applied.remove(&(cgroup.clone(), gpu.clone()));
            }
        }
        for (key, max, _, want) in moves {
            let (Some(want), Some(&id)) = (want, ids.get(&key)) else {
                continue;
            };
            if let Some(other) = self.other_selector_of(&key.0, &key.1, want) {
                warn!(
                    cgroup = %key.0, gpu = %key.1, index = want,
                    "stored limit kept aside: this cgroup limits GPU {want} as `{other}`"
                );
                continue;
            }
            match settings.set_limit(id, want, max) {
                Ok(()) => {
                    info!(cgroup = %key.0, gpu = %key.1, index = want, memory_max = max, "stored limit in force");
                    self.applied.insert(key, want);
                }
                Err(e) => {
                    error!(cgroup = %key.0, gpu = %key.1, "cannot apply stored limit: {}", Chain(&e))
                }
            }
        }
    }

    /// Whether a stored entry is in force, or why it waits.
    pub fn state_of(&self, policies: &PolicyStore, cgroup: &str, gpu: &GpuSelector) -> LimitState {
        let key = (cgroup.to_owned(), gpu.clone());
        if self.applied.contains_key(&key) {
            return LimitState::InForce;
        }
        let want = match policies.key_now(gpu) {
            Ok(want) => want,
            Err(why) => return LimitState::Pending(why),
        };
        if policies
            .get(cgroup, gpu)
            .and_then(|l| l.memory_max)
            .is_none()
        {
            // Compute shares and priority classes follow the selector as it resolves now.
            return LimitState::InForce;
        }
        match self.other_selector_of(cgroup, gpu, want) {
            Some(other) => {
                LimitState::Pending(format!("this cgroup limits GPU {want} as `{other}`"))
            }
            None => LimitState::Pending("not in the kernel's map (see the daemon's log)".into()),
        }
    }

    /// The other selector of `cgroup` whose memory limit is in force on GPU `key` (one card
    /// carries one selector's limits per cgroup; `all` is never taken).
    fn other_selector_of(&self, cgroup: &str, gpu: &GpuSelector, key: u32) -> Option<&GpuSelector> {
        if key == GPU_ALL {
            return None;
        }
        self.applied
            .iter()
            .find(|((c, g), k)| c == cgroup && g != gpu && **k == key)
            .map(|((_, g), _)| g)
    }

    /// Every stored entry and its state, ordered by cgroup and GPU.
    pub fn list(&self, policies: &PolicyStore) -> Vec<(LimitEntry, LimitState)> {
        policies
            .list()
            .into_iter()
            .map(|e| {
                let state = self.state_of(policies, &e.cgroup, &e.gpu);
                (e, state)
            })
            .collect()
    }

    /// Re-applies the stored limits at start: the kernel maps get exactly the stored set; limits
    /// of cgroups that no longer exist are dropped with a log line.
    pub fn restore(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        policies: &mut PolicyStore,
    ) {
        let pinned: BTreeMap<(u64, u32), u64> = settings.limits().into_iter().collect();
        let mut keep = BTreeMap::new();
        let mut wanted = BTreeSet::new();
        let mut waiting = Vec::new();
        for ((cgroup, gpu), limits) in policies.entries().clone() {
            let id = match attr.id_of(&cgroup) {
                Ok((_, id)) => id,
                Err(e) => {
                    warn!(cgroup = %cgroup, gpu = %gpu, "dropping stored limit: {}", Chain(&e));
                    continue;
                }
            };
            match (self.key_of(policies, &cgroup, &gpu), limits.memory_max) {
                (Some(key), Some(max)) => {
                    if let Err(e) = settings.set_limit(id, key, max) {
                        error!(cgroup = %cgroup, "cannot apply stored limit: {}", Chain(&e));
                        continue;
                    }
                    wanted.insert((id, key));
                    self.applied.insert((cgroup.clone(), gpu.clone()), key);
                }
                (None, Some(max)) => waiting.push((cgroup.clone(), gpu.clone(), id, max)),
                (_, None) => {}
            }
            keep.insert((cgroup, gpu), limits);
        }
        // A UUID NVML cannot name yet stays in force where the previous daemon put it: the
        // pinned map's entry of this cgroup with the same value on a GPU no other entry holds
        // (entries with one value are alike wherever they sit). `reconcile` moves it, if need
        // be, once NVML answers.
        for (cgroup, gpu, id, max) in waiting {
            let held = pinned.iter().find(|((cg, key), m)| {
                *cg == id && **m == max && *key != GPU_ALL && !wanted.contains(&(id, *key))
            });
            match held {
                Some(((_, key), _)) => {
                    info!(cgroup = %cgroup, gpu = %gpu, index = key, "stored limit stays in force where it was until NVML names its GPU");
                    wanted.insert((id, *key));
                    self.applied.insert((cgroup, gpu), *key);
                }
                None => {
                    info!(cgroup = %cgroup, gpu = %gpu, "stored limit waits for NVML to name its GPU");
                }
            }
        }
        // Pinned maps may hold limits the store no longer has (changed while down).
        for (id, key) in pinned.into_keys() {
            if !wanted.contains(&(id, key)) {
                let _ = settings.clear_limit(id, key);
            }
        }
        if let Err(e) = settings.keep_all_unnamed() {
            error!(
                "cannot keep the limits on GPUs the probes cannot name: {}",
                Chain(&e)
            );
        }
        let n = keep.len();
        policies.retain(keep);
        info!(limits = n, tier = self.tier.as_str(), "limits in force");
    }

    /// Where the memory limit of (cgroup, GPU selector) is in force, if it is.
    pub fn in_force_under(&self, cgroup: &str, gpu: &GpuSelector) -> Option<u32> {
        self.applied.get(&(cgroup.to_owned(), gpu.clone())).copied()
    }

    /// Puts the stored memory limit of (cgroup `path` = `id`, `gpu`) in force under GPU `key`,
    /// in the kernel before it returns; with no key (a UUID NVML has not named) it waits,
    /// stored, for the inventory ([`Self::set_catalog`]). A cgroup this module froze is thawed
    /// once it is within its limits.
    pub fn put_in_force(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        policies: &PolicyStore,
        (path, id): (&str, u64),
        gpu: &GpuSelector,
        key: Option<u32>,
    ) -> Result<(), EnforcementError> {
        match (policies.get(path, gpu).and_then(|l| l.memory_max), key) {
            (Some(max), Some(key)) => {
                settings.set_limit(id, key, max)?;
                self.applied.insert((path.to_owned(), gpu.clone()), key);
                info!(cgroup = %path, gpu = %gpu, memory_max = max, "limit set");
                self.maybe_thaw(attr, settings, path, id);
            }
            (Some(max), None) => {
                info!(cgroup = %path, gpu = %gpu, memory_max = max, "limit stored; in force once NVML names its GPU");
            }
            (None, _) => {}
        }
        Ok(())
    }

    /// Takes the memory limit of (cgroup `path` = `id`, `gpu`) out of force, from under the
    /// GPU `key` it was in force under (none: a UUID never applied); a cgroup this module froze
    /// is thawed.
    pub fn take_out_of_force(
        &mut self,
        attr: &mut Attribution,
        settings: &mut KernelSettings,
        (path, id): (&str, u64),
        gpu: &GpuSelector,
        key: Option<u32>,
    ) -> Result<(), EnforcementError> {
        self.applied.remove(&(path.to_owned(), gpu.clone()));
        if let Some(key) = key {
            settings.clear_limit(id, key)?;
        }
        self.maybe_thaw(attr, settings, path, id);
        Ok(())
    }

    /// Clearing the limits of a cgroup that was removed (as a container runtime's `poststop`
    /// hook does: the runtime removes the container's cgroup first) drops what is stored for it
    /// at once rather than at the next sweep; its kernel entry went with its id. `NotFound` when
    /// nothing is stored for it either.
    pub fn forget_removed(
        &mut self,
        policies: &mut PolicyStore,
        path: &str,
        gpu: &GpuSelector,
    ) -> Result<(), EnforcementError> {
        let key = (path.to_owned(), gpu.clone());
        if policies.get(path, gpu).is_none() {
            return Err(AttributionError::Cgroup(CgroupError::NotFound(path.to_owned())).into());
        }
        policies.remove(std::slice::from_ref(&key))?;
        self.applied.remove(&key);
        if !policies.entries().keys().any(|(cg, _)| cg == path) {
            self.freezer.forget(Holder::Memory, path);
        }
        info!(cgroup = %path, gpu = %gpu, "limits of a removed cgroup cleared");
        Ok(())
    }

    /// Drops limits of cgroups that were removed (with a log line).
    pub fn sweep(&mut self, attr: &mut Attribution, policies: &mut PolicyStore) {
        let gone: Vec<(String, GpuSelector)> = policies
            .entries()
            .keys()
            .filter(|(cg, _)| attr.id_of(cg).is_err())
            .cloned()
            .collect();
        if gone.is_empty() {
            return;
        }
        for k in &gone {
            info!(cgroup = %k.0, gpu = %k.1, "cgroup removed; dropping its limit");
            self.applied.remove(k);
            self.freezer.forget(Holder::Memory, &k.0);
        }
        if let Err(e) = policies.remove(&gone) {
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
            LimitAction::Denied
        } else {
            match self.action {
                ReactAction::Kill => LimitAction::Killed,
                ReactAction::Notify => LimitAction::Notified,
                ReactAction::Freeze => match &path {
                    Some(p) => match self.freezer.set(Holder::Memory, p, true) {
                        Ok(()) => LimitAction::Frozen,
                        Err(e) => {
                            error!(cgroup = %p, "cannot freeze: {}", Chain(&e));
                            LimitAction::Notified
                        }
                    },
                    None => LimitAction::Notified,
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
            action,
            source: LimitSource::Kernel,
        }
    }

    /// A fresh NVML sample taken at `now`: the limits NVML shows over for the backstop's hold
    /// time ([`backstop`]) get the react action, and their notices (`source` nvml) are returned.
    /// `kill` kills the cgroups of the processes holding the memory (`cgroup.kill`: the probes
    /// did not see the allocation, so there is no allocating call to kill in); `freeze` freezes
    /// the limited cgroup; `notify` only reports.
    pub fn on_nvml(
        &mut self,
        attr: &mut Attribution,
        policies: &PolicyStore,
        processes: &[ProcessSample],
        now: std::time::Instant,
    ) -> Vec<LimitNotice> {
        let limits = self.memory_limits(policies);
        let over = self.backstop.observe(now, &limits, processes);
        over.into_iter()
            .map(|o| self.act_on_nvml(attr, o))
            .collect()
    }

    fn act_on_nvml(&mut self, attr: &mut Attribution, o: backstop::Over) -> LimitNotice {
        let action = match self.action {
            ReactAction::Kill => {
                let cgroups: BTreeSet<&str> =
                    o.holders.iter().map(|(_, c, _)| c.as_str()).collect();
                let mut killed = false;
                for cg in cgroups {
                    match attr.kill(cg) {
                        Ok(()) => killed = true,
                        Err(e) => error!(cgroup = %cg, "cannot kill: {}", Chain(&e)),
                    }
                }
                if killed {
                    LimitAction::Killed
                } else {
                    LimitAction::Notified
                }
            }
            ReactAction::Freeze => match self.freezer.set(Holder::Memory, &o.cgroup, true) {
                Ok(()) => LimitAction::Frozen,
                Err(e) => {
                    error!(cgroup = %o.cgroup, "cannot freeze: {}", Chain(&e));
                    LimitAction::Notified
                }
            },
            ReactAction::Notify => LimitAction::Notified,
        };
        LimitNotice {
            pid: o.holders.first().map_or(0, |h| h.0),
            gpu: gpu_name(o.gpu),
            bytes: o.usage.saturating_sub(o.max),
            usage: o.usage,
            max: o.max,
            action,
            source: LimitSource::Nvml,
            cgroup: o.cgroup,
        }
    }

    /// A new backstop rule (a reload).
    pub fn set_backstop(&mut self, rule: BackstopRule) {
        self.backstop.set_rule(rule);
    }

    /// Thaws a cgroup this module froze once none of its limits is exceeded any more.
    fn maybe_thaw(
        &mut self,
        attr: &mut Attribution,
        settings: &KernelSettings,
        path: &str,
        id: u64,
    ) {
        if !self.freezer.holds(Holder::Memory, path) {
            return;
        }
        let limits = settings.limits();
        let over = limits
            .iter()
            .any(|((cg, gpu), max)| *cg == id && attr.usage_of(id, *gpu) > *max);
        if !over {
            match self.freezer.set(Holder::Memory, path, false) {
                Ok(()) => info!(cgroup = %path, "thawed: back within its limits"),
                Err(e) => error!(cgroup = %path, "cannot thaw: {}", Chain(&e)),
            }
        }
    }

    /// Thaws every cgroup this module froze (clean shutdown: the daemon will not be there to
    /// thaw them later).
    pub fn thaw_all(&mut self) {
        for p in self.freezer.held_by(Holder::Memory) {
            if let Err(e) = self.freezer.set(Holder::Memory, &p, false) {
                error!(cgroup = %p, "cannot thaw at shutdown: {}", Chain(&e));
            }
        }
    }

    /// The memory limits in force: (cgroup path, GPU index or `GPU_ALL`, bytes).
    pub fn memory_limits(&self, policies: &PolicyStore) -> Vec<(String, u32, u64)> {
        self.applied
            .iter()
            .filter_map(|((cgroup, gpu), key)| {
                let max = policies.get(cgroup, gpu)?.memory_max?;
                Some((cgroup.clone(), *key, max))
            })
            .collect()
    }

    /// cgroups the `freeze` action froze (the compute controller leaves them alone).
    pub fn frozen(&self) -> BTreeSet<String> {
        self.freezer.held_by(Holder::Memory)
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    pub fn action(&self) -> ReactAction {
        self.action
    }
}
