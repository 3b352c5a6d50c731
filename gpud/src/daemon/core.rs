//! The kernel stack the daemon stands on, opened from a configuration in one place: the stored
//! limits checked and loaded, the cgroup hierarchy and the device files found, the probes attached
//! (or adopted), the tables seeded from `/proc`, the limits restored into the kernel and the
//! guard's allowances set. [`open`] is what the daemon's start-up runs, and what the VM test and
//! the benchmarks run instead of a copy of it; [`Core::route`] is the state task's routing of
//! kernel events, and [`Core::drain`] the same for a caller without a state task.

use std::{collections::BTreeMap, path::PathBuf};

use aya::maps::{MapData, RingBuf};
use gpud_api::{LimitState, limits::LimitKind};
use tracing::{info, warn};

use crate::{
    attribution::{Attribution, AttributionError, CgroupView},
    cgroupfs::{CgroupError, CgroupFs, Freezer},
    config::Config,
    enforcement::{
        EnforcementError, MemoryEnforcement, guard,
        restore::{RestoreError, Restorer},
    },
    notice::Notice,
    policy::{
        GpuCatalog, GpuSelector, LimitStore, LimitUpdate, PolicyError, PolicyStore,
        workloads::{Names, Workloads},
    },
    probes::{
        self, DynamicMajors, KernelSettings, Matcher, ProbeError, ProbeSetup, Probes,
        caps::DmemRegion,
        devices::DeviceError,
        events::{KernelEvent, Record},
    },
    report::Chain,
};

/// Facts fixed at start-up, reported on D-Bus and in the metrics.
#[derive(Clone, Debug)]
pub struct DaemonInfo {
    pub version: String,
    pub attach_mode: String,
    /// GPU-memory enforcement tier in force: `deny`, `react` or `dmem`.
    pub enforcement_tier: String,
    /// What the react tier does: `kill`, `freeze` or `notify`.
    pub react_action: String,
    pub kernel_capabilities: BTreeMap<String, bool>,
    /// The pre-driver hook in force: `lsm`, `fmod_ret` or `none`.
    pub deny_hook: String,
    /// Why each hook above the one in force is not used, by hook name.
    pub deny_hook_refusals: BTreeMap<String, String>,
    /// The driver's own limits: `dmem: …` with its regions, or `none: …` and why.
    pub driver_limits: String,
    pub cgroup_root: String,
    pub probes_resumed: bool,
    /// Tenants' calls the probes do not see on this kernel, and why.
    pub unseen_calls: BTreeMap<String, String>,
    /// What this start took over from the previous ABI's pins (empty: nothing).
    pub probes_taken_over: BTreeMap<String, String>,
}

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The state directory or the stored limits need a person (exit status 78).
    #[error(transparent)]
    Limits(PolicyError),
    #[error("cannot locate the cgroup v2 hierarchy")]
    Cgroups(#[source] CgroupError),
    #[error("cannot identify the NVIDIA device files")]
    Devices(#[source] DeviceError),
    #[error("cannot start the eBPF probes")]
    Probes(#[source] ProbeError),
    #[error("cannot read the probes' maps")]
    Attribution(#[source] AttributionError),
}

impl StartError {
    /// Whether a person must act before a restart can help (a corrupt or unusable state
    /// directory), like a configuration error.
    pub fn needs_a_person(&self) -> bool {
        matches!(
            self,
            Self::Limits(PolicyError::CorruptState { .. } | PolicyError::StateDir { .. })
                | Self::Probes(ProbeError::NewerAbi { .. })
        )
    }
}

/// The state that kernel events change and the API's changes go through: the loaded probes
/// (their lifecycle and live toggles), the accounting, the stored policies, the memory limits put
/// in force, and the one writer of the kernel's settings.
pub struct Core {
    pub probes: Probes,
    pub attribution: Attribution,
    pub policies: PolicyStore,
    pub memory: MemoryEnforcement,
    pub settings: KernelSettings,
    /// Which workload each cgroup runs, as the runtime integrations said: labels only.
    pub workloads: Workloads,
}

/// An opened kernel stack: the core, and what its other users take from it.
pub struct Opened {
    pub core: Core,
    /// The probes' event ring (its reader's).
    pub events: RingBuf<MapData>,
    /// The previous ABI's event ring after an upgrade's take-over, read once before `events`.
    pub previous_events: Option<RingBuf<MapData>>,
    /// The kernel's map of channel groups gpud holds off (the compute actuator's).
    pub held: aya::maps::HashMap<MapData, gpud_common::ObjKey, u32>,
    /// Facts for D-Bus and the metrics.
    pub info: DaemonInfo,
    /// The device files gpud watches (the compute actuator and the restorer match files by it).
    pub matcher: Matcher,
    /// The one writer of `cgroup.freeze`, for the compute actuator (the memory enforcement
    /// freezes through the attribution's cgroups, which share it).
    pub freezer: Freezer,
    pub cgroup_root: PathBuf,
    /// NVIDIA's regions in the dmem controller (empty where the kernel or driver has none).
    pub dmem_regions: Vec<DmemRegion>,
    /// Where the kernel can neither refuse nor rewrite a tenant's control: what undoes it.
    pub restorer: Option<Restorer>,
}

/// Opens the kernel stack `config` describes (see the module docs).
pub fn open(config: &Config) -> Result<Opened, StartError> {
    // Before anything is attached: the limits must be loadable and storable.
    LimitStore::check_dir(&config.daemon.state_dir).map_err(StartError::Limits)?;
    let store = LimitStore::load(&config.daemon.state_dir, config.daemon.on_corrupt_state)
        .map_err(StartError::Limits)?;
    let cgroups = CgroupFs::discover().map_err(StartError::Cgroups)?;
    let majors = DynamicMajors::read().map_err(StartError::Devices)?;
    let extra = probes::devices::resolve_extra_paths(&config.devices.extra_paths)
        .map_err(StartError::Devices)?;
    for e in &extra {
        info!(path = %e.path.display(), dev = e.key.dev, ino = e.key.ino, "extra device file");
    }
    let mut probes = start_probes(config, majors, &extra, &cgroups)?;
    let events = probes.take_events().map_err(StartError::Probes)?;
    let previous_events = probes.take_previous_events();
    let mut settings = probes.take_settings().map_err(StartError::Probes)?;
    let held = probes.take_held_groups().map_err(StartError::Probes)?;
    let cgroup_root = cgroups.root().to_owned();
    let freezer = cgroups.freezer();
    let (dmem_regions, driver_limits) = driver_limits(&cgroup_root);
    let info = daemon_info(config, &probes, driver_limits, &cgroup_root);
    let matcher = Matcher { majors, extra };
    let restorer = start_restorer(config, &probes, &matcher);
    let mut attribution = open_attribution(&mut probes, cgroups, &matcher)?;
    let catalog = if config.nvml.enabled {
        GpuCatalog::Unavailable("NVML has not answered yet".into())
    } else {
        GpuCatalog::Disabled
    };
    let mut policies = PolicyStore::new(store, catalog);
    let mut memory = MemoryEnforcement::new(
        probes.tier(),
        config.enforcement.react_action,
        crate::enforcement::backstop::BackstopRule::configured(&config.enforcement),
        freezer.clone(),
    );
    memory.restore(&mut attribution, &mut settings, &mut policies);
    guard::sync_allowances(&mut attribution, &mut settings, policies.policies());
    Ok(Opened {
        core: Core {
            probes,
            attribution,
            policies,
            memory,
            settings,
            workloads: Workloads::load(&config.daemon.state_dir, &cgroup_root),
        },
        events,
        previous_events,
        held,
        info,
        matcher,
        freezer,
        cgroup_root,
        dmem_regions,
        restorer,
    })
}

/// Loads and attaches the probes (or adopts what a previous daemon left) as `config` says.
fn start_probes(
    config: &Config,
    majors: DynamicMajors,
    extra: &[probes::ExtraFile],
    cgroups: &CgroupFs,
) -> Result<Probes, StartError> {
    Probes::start(ProbeSetup {
        config: &config.probes,
        majors,
        extra,
        cgroup2_root: cgroups.root(),
        tier: config.enforcement.tier,
        react_action: config.enforcement.react_action,
        virtualize_memory_info: config.enforcement.virtualize_memory_info,
        scheduler_guard: config.enforcement.scheduler_guard,
        guard_timeslice_us: guard::allowance(None),
        deny_hook: config.enforcement.deny_hook,
        guard_react_action: config.enforcement.guard_react_action,
    })
    .map_err(StartError::Probes)
}

/// NVIDIA's regions in the dmem controller, and what the driver's own limits are, as reported.
fn driver_limits(cgroup_root: &std::path::Path) -> (Vec<DmemRegion>, String) {
    let regions = probes::caps::dmem_nvidia_regions(
        cgroup_root,
        std::path::Path::new(probes::caps::PCI_DEVICES),
    )
    .unwrap_or_default();
    let said = if regions.is_empty() {
        "none: no NVIDIA region in dmem.capacity (the dmem controller needs Linux 6.14+, and \
         NVIDIA's open module registers its GPUs from the 610/615 series)"
            .to_owned()
    } else {
        format!(
            "dmem: memory_max is also written to dmem.max of {}",
            regions
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    info!(driver_limits = %said, "driver-native memory limits");
    (regions, said)
}

/// The start-up facts D-Bus and the metrics report.
fn daemon_info(
    config: &Config,
    probes: &Probes,
    driver_limits: String,
    cgroup_root: &std::path::Path,
) -> DaemonInfo {
    DaemonInfo {
        version: crate::VERSION.to_owned(),
        attach_mode: probes.mode().as_str().to_owned(),
        enforcement_tier: probes.tier().as_str().to_owned(),
        react_action: format!("{:?}", config.enforcement.react_action).to_lowercase(),
        kernel_capabilities: probes.caps().as_map(),
        deny_hook: probes.ladder().in_force.as_str().to_owned(),
        deny_hook_refusals: probes.ladder().refusals(),
        driver_limits,
        cgroup_root: cgroup_root.display().to_string(),
        probes_resumed: probes.resumed(),
        unseen_calls: probes.unseen_calls().clone(),
        probes_taken_over: probes.take_over().as_map(),
    }
}

/// The restorer (started by the caller on its own thread). Where neither a hook nor a rewrite
/// can stop a tenant's control, the kernel asks for it to be undone; on every kernel, for the
/// driver's state to be read back after tenants' controls (what the guard read at their entry
/// may not be what the driver ran), and for a crossing allocation the react tier's kill left in
/// another process's file to be freed. `None` (logged) where it cannot be made.
fn start_restorer(config: &Config, probes: &Probes, matcher: &Matcher) -> Option<Restorer> {
    let kill = config.enforcement.react_action == crate::config::ReactAction::Kill;
    probes
        .runs()
        .map_err(RestoreError::from)
        .and_then(|runs| Restorer::new(matcher.clone(), probes.base_dir(), runs, kill))
        .inspect_err(|e| {
            warn!(
                "the scheduler guard cannot undo tenants' controls: {}",
                Chain(e)
            )
        })
        .ok()
}

/// The attribution over the probes' maps, with the control files of recorded objects marked,
/// the processes holding NVIDIA files found in `/proc`, and what is gone forgotten.
fn open_attribution(
    probes: &mut Probes,
    cgroups: CgroupFs,
    matcher: &Matcher,
) -> Result<Attribution, StartError> {
    let mut attribution =
        Attribution::new(probes, cgroups, matcher.clone()).map_err(StartError::Attribution)?;
    let marked = attribution.mark_recorded_files();
    if marked > 0 {
        info!(
            files = marked,
            "control files of recorded objects marked for their release"
        );
    }
    let found = attribution.scan();
    attribution.sweep();
    info!(found, "start-up scan of /proc done");
    Ok(attribution)
}

impl Core {
    /// Hands a kernel event to its one owner: processes and objects to the attribution, limits
    /// met to the memory enforcement, scheduling controls to the guard. Returns what to announce.
    pub fn route(&mut self, ev: &KernelEvent) -> Option<Notice> {
        Some(match ev {
            KernelEvent::LimitCrossed(l) => Notice::MemoryLimitExceeded(self.memory.on_limit(
                &mut self.attribution,
                &self.settings,
                l,
                false,
            )),
            KernelEvent::AllocationDenied(l) => Notice::MemoryLimitExceeded(self.memory.on_limit(
                &mut self.attribution,
                &self.settings,
                l,
                true,
            )),
            KernelEvent::SchedulerGuarded(g) => {
                Notice::SchedulerControlGuarded(guard::on_event(&mut self.attribution, g))
            }
            KernelEvent::ProcessTracked { .. }
            | KernelEvent::ProcessExited { .. }
            | KernelEvent::TreeFreed { .. }
            | KernelEvent::FileReleased { .. } => {
                self.attribution.on_kernel_event(ev);
                return None;
            }
        })
    }

    /// Routes a batch of kernel events in order ([`Self::route`]); each run of consecutive file
    /// releases (two per open of a control file in a loop) is done with one read of `OBJECTS`
    /// ([`Attribution::release_files`]) instead of one per release. Returns the notices, in order.
    pub fn route_all(&mut self, events: &[KernelEvent]) -> Vec<Notice> {
        let mut out = Vec::new();
        let mut run = Vec::new();
        for ev in events {
            if let KernelEvent::FileReleased { file, clock } = ev {
                run.push((*file, *clock));
                continue;
            }
            if !run.is_empty() {
                self.attribution.release_files(&run);
                run.clear();
            }
            out.extend(self.route(ev));
        }
        if !run.is_empty() {
            self.attribution.release_files(&run);
        }
        out
    }

    /// Reads every record waiting in `ring`: events routed ([`Self::route_all`]), undo and
    /// read-back requests handed to `restore`. Returns the notices, in order. For callers without a state task (the
    /// daemon reads its ring asynchronously, `ring.rs`).
    pub fn drain(
        &mut self,
        ring: &mut RingBuf<MapData>,
        restore: impl FnMut(Record),
    ) -> Vec<Notice> {
        let mut events = Vec::new();
        super::ring::read_records(ring, &mut events, restore);
        self.route_all(&events)
    }

    /// Sets limits on (cgroup, GPU selector): the policy store checks and persists them, then
    /// each kind goes to its owner before this returns: a memory limit into the kernel (where
    /// its GPU is known: an index or `all` always, a UUID once NVML names it), a priority class
    /// into the guard's allowances (a tenant's next control meets it). Compute caps, weights
    /// and guarantees reach the compute law with the next NVML sample, which reads the store.
    /// Nothing changes on error. Returns the entry's state.
    pub fn set_limits(
        &mut self,
        cgroup: &str,
        gpu: &str,
        update: &LimitUpdate,
    ) -> Result<LimitState, EnforcementError> {
        let gpu: GpuSelector = gpu.parse().map_err(PolicyError::from)?;
        let checked = self.policies.checked_key(&gpu)?;
        let (path, id) = self.attribution.id_of(cgroup)?;
        // An entry in force keeps its GPU while NVML cannot name it.
        let key = checked.or_else(|| self.memory.in_force_under(&path, &gpu));
        if let Some(key) = key {
            let memory = &self.memory;
            let policies = &self.policies;
            policies.check_one_selector(&path, &gpu, key, |c, g| memory.key_of(policies, c, g))?;
        }
        self.policies.set(&path, &gpu, update)?;
        if update.touches(LimitKind::MemoryMax) {
            self.memory.put_in_force(
                &mut self.attribution,
                &mut self.settings,
                &self.policies,
                (&path, id),
                &gpu,
                key,
            )?;
        }
        if update.touches(LimitKind::Priority) {
            self.sync_allowances();
        }
        Ok(self.memory.state_of(&self.policies, &path, &gpu))
    }

    /// Clears the named limits (all when `names` is empty) on (cgroup, GPU selector), persisted
    /// by the policy store and taken out of force by each kind's owner as [`Self::set_limits`]
    /// puts them in. A cgroup already removed has what is stored for it dropped.
    pub fn clear_limits(
        &mut self,
        cgroup: &str,
        gpu: &str,
        names: &[String],
    ) -> Result<(), EnforcementError> {
        let gpu: GpuSelector = gpu.parse().map_err(PolicyError::from)?;
        PolicyStore::check_names(names)?;
        let (path, id) = match self.attribution.id_of(cgroup) {
            Ok(found) => found,
            Err(AttributionError::Cgroup(CgroupError::NotFound(missing))) => {
                self.memory
                    .forget_removed(&mut self.policies, &missing, &gpu)?;
                self.sync_allowances();
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        // Where it is in force, whatever NVML says now (none: a UUID never applied).
        let key = self.memory.key_of(&self.policies, &path, &gpu);
        self.policies.clear(&path, &gpu, names)?;
        let named =
            |kind: LimitKind| names.is_empty() || names.iter().any(|n| n == kind.dbus_name());
        if named(LimitKind::MemoryMax) {
            self.memory.take_out_of_force(
                &mut self.attribution,
                &mut self.settings,
                (&path, id),
                &gpu,
                key,
            )?;
        }
        if named(LimitKind::Priority) {
            self.sync_allowances();
        }
        info!(cgroup = %path, gpu = %gpu, "limit cleared");
        Ok(())
    }

    /// Drops what is stored for cgroups that were removed (their kernel entries went with
    /// their ids), and the allowances follow.
    pub fn forget_removed_cgroups(&mut self) {
        self.memory.sweep(&mut self.attribution, &mut self.policies);
        self.sync_allowances();
        if let Err(e) = self.workloads.forget_removed() {
            warn!("cannot forget the workload names of removed cgroups: {e}");
        }
    }

    /// Names the workload `cgroup` runs (no names: forgets them); persisted when it returns.
    pub fn set_workload(&mut self, cgroup: &str, names: Names) -> Result<(), PolicyError> {
        self.workloads.set(cgroup, names)
    }

    /// `view` with the workload names reported for its cgroup.
    pub fn with_workload(&self, mut view: CgroupView) -> CgroupView {
        if let Some(names) = self.workloads.of(&view.path) {
            view.workload = names.clone();
        }
        view
    }

    /// The scheduler guard's allowances follow the stored policies' priority classes.
    pub fn sync_allowances(&mut self) {
        guard::sync_allowances(
            &mut self.attribution,
            &mut self.settings,
            self.policies.policies(),
        );
    }

    /// The in-container memory view: `on`, `off` or `unavailable: <why>`.
    pub fn memory_info(&self) -> String {
        self.probes.memory_info().describe()
    }

    /// The scheduler guard's state, as reported (see [`GuardState::describe`]).
    ///
    /// [`GuardState::describe`]: crate::probes::GuardState::describe
    pub fn scheduler_guard(&self) -> String {
        self.probes.guard().describe()
    }

    /// An orderly close: what the memory enforcement froze is thawed, the probes pinned or
    /// detached (after the attribution lets go of their maps).
    pub fn close(mut self, keep_pinned: bool) {
        self.memory.thaw_all();
        drop(self.attribution);
        self.probes.shutdown(keep_pinned);
    }
}
