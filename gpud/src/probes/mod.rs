//! The kernel side, from userspace: loading the eBPF object, probing what the kernel accepts,
//! attaching in the chosen mode, and pinning maps and links so a restarted daemon resumes.
//!
//! This module owns [`Probes`] (start-up, the ladder of pre-driver hooks, the programs the
//! daemon runs itself, shutdown) and [`ProbeError`]. The rest is one file per concern, like aya's
//! `maps/`: `attach` (modes, tiers, hooks, attachment tables, attaching or adopting),
//! `modify_return` (loading fmod_ret programs, which aya 0.14 cannot), `pin` (bpffs and the pin
//! directory's hygiene), `takeover` (an upgrade's take-over of the pins attached before),
//! `maps` (taking and reading the maps, writing the configuration), [`btf`] (kernel struct
//! offsets), [`caps`] (what the kernel offers) and [`devices`] (which files are NVIDIA devices).
//!
//! Pins live under `<bpffs>/gpud/v<ABI_VERSION>/`: maps by name, links under
//! `links/<object-hash>-<mode>-<tier>/`. A daemon that finds the same object attached in the same
//! mode and tier adopts it (no gap, no double counting); the same object in another mode or tier
//! is detached and attached anew; another object's pins, and the previous ABI's, are taken over
//! (`takeover`).

mod attach;
pub mod btf;
pub mod caps;
pub mod devices;
pub mod events;
mod ladder;
mod maps;
mod modes;
mod modify_return;
mod pin;
mod runs;
mod settings;
mod takeover;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, RingBuf},
    programs::{FEntry, FExit, Lsm, RawTracePoint, TracePoint},
};
use gpud_common::{ABI_VERSION, ObjKey, maps as map_names, programs};
use tracing::{debug, info, warn};

pub use attach::{AttachMode, DenyHook, SYS_IOCTL, Tier};
pub use caps::KernelCaps;
pub use devices::{DynamicMajors, ExtraFile, Matcher};
pub use ladder::HookLadder;
use ladder::{LadderInputs, climb_ladder, load_probe, try_load};
pub use maps::{BPF_NOEXIST, KernelMaps, map_entries, pinned, remove_key};
pub use modes::{GuardState, MemoryInfoState};
pub use pin::{BPF_FS_MAGIC, TRACEFS, TRACEFS_MAGIC, ensure_mounted};
pub use runs::KernelRuns;
pub use settings::{KernelSettings, LimitsGeneration, SettingError};
pub use takeover::TakeOver;

use crate::{
    config::{
        AttachPreference, DenyHookPreference, GuardMode, GuardReactAction, ProbesConfig,
        ReactAction, TierPreference,
    },
    report::Chain,
};

/// The eBPF object built by `build.rs` from the `gpud-ebpf` crate.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gpud-probes"));

/// The embedded eBPF object, for tools that load parts of it themselves (the benchmark's
/// reference programs).
pub fn ebpf_object() -> &'static [u8] {
    OBJECT
}

/// Why the probes could not start, or a program the daemon runs could not run. Display says
/// what failed; the cause is the error's source (print the chain with `report::Chain`).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot {action} {path}")]
    Io {
        /// What was done to `path`: "create", "read", "remove".
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot mount {fstype} at {path}")]
    Mount {
        fstype: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Btf(#[from] btf::BtfError),
    #[error("cannot read the kernel BTF for the loader")]
    LoaderBtf(#[source] aya::BtfError),
    #[error("cannot load the eBPF object")]
    Load(#[from] aya::EbpfError),
    /// The embedded object lacks a program the daemon names (a build out of step).
    #[error("the eBPF object has no program `{0}`")]
    NoProgram(&'static str),
    #[error("cannot load eBPF program `{name}`")]
    LoadProgram {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("cannot attach eBPF program `{name}` to {target}")]
    Attach {
        name: &'static str,
        target: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("cannot run eBPF program `{name}`")]
    Run {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    /// The embedded object lacks a map the daemon names (a build out of step).
    #[error("the eBPF object has no map `{0}`")]
    NoMap(&'static str),
    #[error("cannot take eBPF map `{name}`")]
    TakeMap {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot write eBPF map `{name}`")]
    WriteMap {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot pin {path}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    /// Only links can be pinned; an attachment the kernel made a perf event would not survive
    /// the daemon.
    #[error("cannot pin the attachment of `{name}` to {target} (a perf event, not a BPF link)")]
    NotALink {
        name: &'static str,
        target: String,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error("probes.attach = \"fentry\" but this kernel refuses BPF trampolines")]
    FentryUnavailable,
    #[error("this kernel accepts neither fentry nor syscall tracepoint programs")]
    NoAttachMechanism,
    #[error("enforcement.tier = \"deny\" but this kernel offers no pre-driver hook ({0})")]
    DenyUnavailable(String),
    /// `[enforcement] deny_hook` names a hook the kernel refused.
    #[error("enforcement.deny_hook = \"{hook}\" but {reason}")]
    DenyHookRefused { hook: &'static str, reason: String },
    #[error("cannot attach fmod_ret program")]
    ModifyReturn(#[from] modify_return::ModifyReturnError),
    #[error(
        "enforcement.tier = \"dmem\" but the dmem cgroup controller lists no NVIDIA regions in dmem.capacity"
    )]
    DmemUnavailable,
    /// Pins of a newer ABI: a downgrade would drop their accounting (docs/operations.md,
    /// "Upgrading").
    #[error(
        "{path} holds the probes of eBPF ABI {found}, newer than this build's {ABI_VERSION}: \
         this gpud cannot take them over and will not drop their accounting; start the newer \
         gpud again, or remove {path} to start this one from empty maps"
    )]
    NewerAbi { found: u32, path: PathBuf },
}

/// `ProbeError::Io` for `action` ("create", "read", "remove") on `path`.
fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ProbeError {
    let path = path.to_owned();
    move |source| ProbeError::Io {
        action,
        path,
        source,
    }
}

/// The kernel's `pid_max`, which sizes the tracked-process filter (the kernel's hard limit if it
/// cannot be read).
fn pid_max() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4_194_304)
}

/// Inputs of [`Probes::start`].
pub struct ProbeSetup<'a> {
    pub config: &'a ProbesConfig,
    pub majors: DynamicMajors,
    pub extra: &'a [ExtraFile],
    pub cgroup2_root: &'a Path,
    pub tier: TierPreference,
    pub react_action: ReactAction,
    /// `[enforcement] virtualize_memory_info`: the memory view on at start.
    pub virtualize_memory_info: bool,
    /// `[enforcement] scheduler_guard` at start.
    pub scheduler_guard: GuardMode,
    /// The timeslice (µs) a tenant may set where its policy gives no other allowance.
    pub guard_timeslice_us: u64,
    /// `[enforcement] deny_hook`.
    pub deny_hook: DenyHookPreference,
    /// `[enforcement] guard_react_action`.
    pub guard_react_action: GuardReactAction,
}

/// The loaded object, its maps, and the links keeping it attached.
pub struct Probes {
    ebpf: Ebpf,
    mode: AttachMode,
    tier: Tier,
    caps: KernelCaps,
    base_dir: PathBuf,
    resumed: bool,
    memory_info: MemoryInfoState,
    guard: GuardState,
    ladder: HookLadder,
    /// The object relocated for fmod_ret loads, while the fmod_ret hook is being attached.
    modify_return: Option<modify_return::Relocated>,
    /// Calls the probes do not see on this kernel, and why (`unseen_calls`).
    unseen: BTreeMap<String, String>,
    /// `probes.follow_32bit`: tracepoint mode follows 32-bit callers (where it can).
    follow_32bit: bool,
    /// Where tracepoint mode takes ioctls and closes, settled when the probes attach.
    route: attach::SyscallRoute,
    /// What was taken over from the pins attached before (nothing: `from_abi` 0).
    take_over: TakeOver,
    /// The event ring of the probes taken over, for the daemon to read once.
    previous_events: Option<RingBuf<MapData>>,
}

impl Probes {
    /// The pin directory for this ABI under `bpffs`.
    pub fn pin_base(bpffs: &Path) -> PathBuf {
        pin::pin_base(bpffs)
    }

    /// Loads, probes and attaches (or adopts what a previous daemon left attached).
    pub fn start(setup: ProbeSetup<'_>) -> Result<Self, ProbeError> {
        let cfg = setup.config;
        mount_filesystems(&cfg.bpffs)?;
        let previous = takeover::Previous::find(&cfg.bpffs, &Self::pin_base(&cfg.bpffs))?;
        let base_dir = prepare_pin_dir(cfg)?;
        let taking_over = previous.taking_over();
        let started = Self::load_and_attach(setup, base_dir.clone(), previous);
        if let Err(e) = &started
            && taking_over
        {
            // This build's pins go (its links detach as this process exits); those it was
            // taking over, untouched, keep counting and enforcing, back where they were.
            warn!(
                "taking over the probes attached before failed ({}); they keep running",
                Chain(e)
            );
            takeover::put_back(&cfg.bpffs, &base_dir);
        }
        started
    }

    fn load_and_attach(
        setup: ProbeSetup<'_>,
        base_dir: PathBuf,
        previous: takeover::Previous,
    ) -> Result<Self, ProbeError> {
        let cfg = setup.config;
        let btf = KernelTypes::read()?;
        let mut ebpf = load_object(cfg, &base_dir, &btf)?;
        let (mut caps, fentry_refusal) = probe_caps(&mut ebpf, &btf, setup.cgroup2_root)?;
        let mode = choose_mode(cfg.attach, &caps)?;
        let hooks = choose_hook_and_tier(
            &mut ebpf,
            &btf.aya,
            &setup,
            mode,
            fentry_refusal.as_deref(),
            &mut caps,
        )?;
        let rewrite_refusal = probe_rewrite(&mut ebpf, mode, &btf.aya, &mut caps);
        let (memory_info, guard) = memory_view_and_guard(&setup, hooks.tier, rewrite_refusal);
        write_config(&mut ebpf, setup, btf.offsets, mode, &memory_info, &guard)?;
        log_choices(mode, &hooks, &memory_info, &guard);

        let probes = Self {
            ebpf,
            mode,
            tier: hooks.tier,
            caps,
            base_dir,
            resumed: false,
            memory_info,
            guard,
            ladder: hooks.ladder,
            modify_return: hooks.modify_return,
            unseen: BTreeMap::new(),
            follow_32bit: cfg.follow_32bit,
            route: attach::SyscallRoute::Events,
            take_over: TakeOver::default(),
            previous_events: None,
        };
        if !previous.taking_over() {
            let mut probes = probes.attach(&btf)?;
            probes.take_over = previous.report();
            return Ok(probes);
        }
        // Before the new programs attach, what they need from their first call.
        let mut report = previous.copy_settled(&probes.base_dir)?;
        let mut probes = probes.attach(&btf)?;
        let runs = probes.runs()?;
        probes.previous_events = previous.finish(&runs, &probes.base_dir, &mut report)?;
        probes.take_over = report;
        Ok(probes)
    }

    /// Attaches (or adopts), then warns of the calls this kernel keeps from the probes.
    fn attach(mut self, btf: &KernelTypes) -> Result<Self, ProbeError> {
        self.attach_or_adopt(&btf.kernel, &btf.aya)?;
        for (calls, why) in &self.unseen {
            warn!(
                "the probes do not see {calls}: {why}; such calls are neither charged nor guarded"
            );
        }
        // Loaded programs hold their maps; the relocated copy is needed no more.
        self.modify_return = None;
        Ok(self)
    }

    /// One of the daemon's own programs ([`attach::RUN_PROGRAMS`]), loaded.
    fn program(&self, name: &'static str) -> Result<&RawTracePoint, ProbeError> {
        self.ebpf
            .program(name)
            .ok_or(ProbeError::NoProgram(name))?
            .try_into()
            .map_err(move |source| ProbeError::Run { name, source })
    }

    /// Handles on the daemon's own programs, for the attribution ([`KernelRuns`]).
    pub fn runs(&self) -> Result<KernelRuns, ProbeError> {
        KernelRuns::of(self)
    }

    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The pre-driver hook in force and why each above it is not.
    pub fn ladder(&self) -> &HookLadder {
        &self.ladder
    }

    pub fn caps(&self) -> &KernelCaps {
        &self.caps
    }

    /// Whether the ioctl return side is the memory view's rewriting twin: wherever the kernel
    /// allows `bpf_probe_write_user`, whatever the configuration (so the view can be turned on
    /// live).
    fn rewriting(&self) -> bool {
        self.caps.probe_write_user
    }

    /// The memory view's state.
    pub fn memory_info(&self) -> &MemoryInfoState {
        &self.memory_info
    }

    /// Turns the memory view on or off (a reload of `virtualize_memory_info`); nothing changes
    /// where the kernel refuses it.
    pub fn set_memory_info(&mut self, on: bool) -> Result<(), ProbeError> {
        if !self.rewriting() {
            return Ok(());
        }
        maps::set_config_flag(&mut self.ebpf, gpud_common::CFG_VIRT_MEMINFO, on)?;
        self.memory_info = if on {
            MemoryInfoState::On
        } else {
            MemoryInfoState::Off
        };
        Ok(())
    }

    /// The scheduler guard's state.
    pub fn guard(&self) -> &GuardState {
        &self.guard
    }

    /// Changes the scheduler guard's mode (a reload of `scheduler_guard`).
    pub fn set_guard(&mut self, mode: GuardMode) -> Result<(), ProbeError> {
        let all = gpud_common::CFG_SCHED_GUARD | gpud_common::CFG_SCHED_ENFORCE;
        maps::set_config_flag(&mut self.ebpf, all, false)?;
        maps::set_config_flag(&mut self.ebpf, GuardState::flags(mode), true)?;
        self.guard.mode = mode;
        Ok(())
    }

    /// Whether the probes were found attached by a previous daemon and adopted.
    /// Calls of tenants the probes do not see (uncharged, unguarded), and why: `32-bit ioctls`
    /// in tracepoint mode (the `syscalls:*` tracepoints do not fire for compat system calls) or
    /// where a compat hook failed to attach. Each is also a warning at start.
    pub fn unseen_calls(&self) -> &BTreeMap<String, String> {
        &self.unseen
    }

    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// What this start took over from the previous ABI's pins (`from_abi` 0: nothing).
    pub fn take_over(&self) -> &TakeOver {
        &self.take_over
    }

    /// The previous ABI's event ring after a take-over: its unread records (those its programs
    /// sent while no daemon read them, and while both sets ran), for the daemon to read once.
    pub fn take_previous_events(&mut self) -> Option<RingBuf<MapData>> {
        self.previous_events.take()
    }

    pub fn base_dir(&self) -> &Path {
        &self.base_dir
    }

    /// Takes the event ring buffer (for the reader task).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        maps::take(&mut self.ebpf, map_names::EVENTS)
    }

    /// Takes the map of channel groups held off the runlist (for the compute actuator).
    pub fn take_held_groups(
        &mut self,
    ) -> Result<aya::maps::HashMap<MapData, ObjKey, u32>, ProbeError> {
        maps::take(&mut self.ebpf, map_names::HELD_GROUPS)
    }

    /// Takes the accounting maps (for the attribution), and a read handle on the limits.
    pub fn take_maps(&mut self) -> Result<KernelMaps, ProbeError> {
        Ok(KernelMaps {
            procs: maps::take(&mut self.ebpf, map_names::PROCS)?,
            cgroups: maps::take(&mut self.ebpf, map_names::CGROUPS)?,
            stats: maps::take(&mut self.ebpf, map_names::STATS)?,
            objects: maps::take(&mut self.ebpf, map_names::OBJECTS)?,
            usage: maps::take(&mut self.ebpf, map_names::USAGE)?,
            limits: settings::limits_reader(&self.base_dir)?,
            ancestry: maps::take(&mut self.ebpf, map_names::ANCESTRY)?,
            file_marks: maps::take(&mut self.ebpf, map_names::FILE_MARKS)?,
            limits_gen: LimitsGeneration::open(&self.base_dir)?,
        })
    }

    /// Takes the maps of the settings the daemon writes (for the state task's one writer), and
    /// raises the limits' generation: what the programs learnt of levels without limits before
    /// this daemon (a previous one's, on pins kept) is learnt again.
    pub fn take_settings(&mut self) -> Result<KernelSettings, ProbeError> {
        let mut generation = LimitsGeneration::open(&self.base_dir)?;
        generation.raise().map_err(|source| ProbeError::WriteMap {
            name: map_names::LIMITS_GEN,
            source,
        })?;
        Ok(KernelSettings {
            limits: maps::take(&mut self.ebpf, map_names::LIMITS)?,
            sched_allow: maps::take(&mut self.ebpf, map_names::SCHED_ALLOW)?,
            guard_counts: maps::take(&mut self.ebpf, map_names::GUARD_COUNTS)?,
            generation,
        })
    }

    /// Stops: with `keep_pinned` the links stay attached and the maps pinned; otherwise all pins
    /// are removed and the programs detach when this process's descriptors close.
    pub fn shutdown(self, keep_pinned: bool) {
        if keep_pinned {
            info!(dir = %self.base_dir.display(), "probes stay attached (probes.keep_pinned)");
            return;
        }
        match std::fs::remove_dir_all(&self.base_dir) {
            Ok(()) => info!(dir = %self.base_dir.display(), "probes detached, pins removed"),
            Err(e) => warn!(dir = %self.base_dir.display(), "removing pins: {}", Chain(&e)),
        }
        // `<bpffs>/gpud` too, unless something else lives there (other ABI versions' pins are
        // removed at start; remove_dir leaves a non-empty directory alone).
        if let Some(parent) = self.base_dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

/// Mounts bpffs (required) and tracefs (only tracepoint attachment needs it; fentry works
/// without, so a failure is a warning).
fn mount_filesystems(bpffs: &Path) -> Result<(), ProbeError> {
    ensure_mounted(bpffs, "bpf", BPF_FS_MAGIC)?;
    if let Err(e) = ensure_mounted(Path::new(pin::TRACEFS), "tracefs", pin::TRACEFS_MAGIC) {
        warn!("{}", Chain(&e));
    }
    Ok(())
}

/// The events ring's size in bytes.
fn ring_bytes(cfg: &ProbesConfig) -> u32 {
    cfg.events_ring_kib.saturating_mul(1024)
}

/// Clears pins this daemon cannot reuse (a foreign map layout; other ABIs' are
/// [`takeover::Previous::find`]'s), creates the
/// links directory, warns where the pinned events ring has another size, and returns the pin
/// directory.
fn prepare_pin_dir(cfg: &ProbesConfig) -> Result<PathBuf, ProbeError> {
    let base_dir = Probes::pin_base(&cfg.bpffs);
    pin::remove_if_foreign_layout(&base_dir)?;
    let links = base_dir.join("links");
    std::fs::create_dir_all(&links).map_err(io_err("create", &links))?;
    pin::warn_if_pinned_ring_differs(&base_dir, ring_bytes(cfg));
    Ok(base_dir)
}

/// What start-up reads from the kernel's BTF.
struct KernelTypes {
    /// Parsed by gpud, for struct offsets and function lookups.
    kernel: btf::KernelBtf,
    offsets: gpud_common::KernelOffsets,
    /// See [`btf::KernelBtf::task_compat_status`].
    compat_status: Option<u32>,
    /// Parsed by aya, for the loader and for loading BTF-typed programs.
    aya: aya::Btf,
}

impl KernelTypes {
    fn read() -> Result<Self, ProbeError> {
        let kernel = btf::KernelBtf::load()?;
        let offsets = kernel.kernel_offsets()?;
        debug!(?offsets, "kernel offsets from BTF");
        let compat_status = kernel.task_compat_status();
        let aya = aya::Btf::from_sys_fs().map_err(ProbeError::LoaderBtf)?;
        Ok(Self {
            kernel,
            offsets,
            compat_status,
            aya,
        })
    }
}

/// Loads the eBPF object with its maps pinned under `base_dir` and sized from `cfg`; no program
/// is loaded yet.
fn load_object(cfg: &ProbesConfig, base_dir: &Path, btf: &KernelTypes) -> Result<Ebpf, ProbeError> {
    let offsets = &btf.offsets;
    // fentry programs read struct fields directly, and tracepoint programs the descriptor
    // walk's links; the verifier checks those loads against BTF using these offsets, frozen
    // into the object's .rodata.
    let ebpf = EbpfLoader::new()
        .btf(Some(&btf.aya))
        .default_map_pin_directory(base_dir)
        .override_global("BTF_FILE_INODE", &offsets.file_inode, true)
        .override_global("BTF_INODE_RDEV", &offsets.inode_rdev, true)
        .override_global("BTF_INODE_INO", &offsets.inode_ino, true)
        .override_global("BTF_INODE_SB", &offsets.inode_sb, true)
        .override_global("BTF_SB_DEV", &offsets.sb_dev, true)
        .override_global("BTF_FILE_REFS", &offsets.file_refs, true)
        .override_global("BTF_TASK_FILES", &offsets.task_files, true)
        .override_global("BTF_FILES_FDT", &offsets.files_fdt, true)
        .override_global("BTF_FDT_MAX_FDS", &offsets.fdt_max_fds, true)
        .override_global("BTF_FDT_FD", &offsets.fdt_fd, true)
        .override_global("TASK_TI_STATUS", &btf.compat_status.unwrap_or(0), true)
        .map_max_entries(map_names::TRACKED, gpud_common::tracked_words(pid_max()))
        .map_max_entries(map_names::EVENTS, ring_bytes(cfg))
        .map_max_entries(map_names::OBJECTS, cfg.max_objects)
        .map_max_entries(map_names::PROCS, cfg.max_procs)
        // The per-task map of RM calls in flight (`CALLS`): aya has no type for task
        // storage, and the daemon never reads it.
        .allow_unsupported_maps()
        .load(OBJECT)?;
    Ok(ebpf)
}

/// Probes what the kernel offers before the ladder: the fentry and tracepoint programs load or
/// not (an answer, not an error), and the daemon's own programs must load. Also returns why
/// fentry was refused, which the ladder reports.
fn probe_caps(
    ebpf: &mut Ebpf,
    btf: &KernelTypes,
    cgroup2_root: &Path,
) -> Result<(KernelCaps, Option<String>), ProbeError> {
    let mut caps = KernelCaps {
        file_ioctl_compat: btf.kernel.has_function("security_file_ioctl_compat"),
        compat_syscalls: btf.compat_status.is_some(),
        dmem_cgroup: caps::dmem_available(cgroup2_root),
        dmem_nvidia: caps::dmem_nvidia_regions(cgroup2_root, Path::new(caps::PCI_DEVICES))
            .is_some_and(|r| !r.is_empty()),
        ..KernelCaps::default()
    };
    let fentry_refusal = load_probe(ebpf, programs::FENTRY_IOCTL, |p: &mut FEntry| {
        p.load("security_file_ioctl", &btf.aya)
    })
    .err();
    caps.fentry = fentry_refusal.is_none();
    caps.tracepoint = try_load(ebpf, programs::TP_IOCTL, |p: &mut TracePoint| p.load());
    for name in attach::RUN_PROGRAMS {
        let perr = move |source| ProbeError::LoadProgram { name, source };
        let p: &mut RawTracePoint = ebpf
            .program_mut(name)
            .ok_or(ProbeError::NoProgram(name))?
            .try_into()
            .map_err(perr)?;
        p.load().map_err(perr)?;
    }
    Ok((caps, fentry_refusal))
}

/// The attach mode from the preference and what the kernel accepts.
fn choose_mode(preference: AttachPreference, caps: &KernelCaps) -> Result<AttachMode, ProbeError> {
    match (preference, caps.fentry, caps.tracepoint) {
        (AttachPreference::Fentry, false, _) => Err(ProbeError::FentryUnavailable),
        (AttachPreference::Fentry | AttachPreference::Auto, true, _) => Ok(AttachMode::Fentry),
        (_, _, true) => Ok(AttachMode::Tracepoint),
        (_, _, false) => Err(ProbeError::NoAttachMechanism),
    }
}

/// The pre-driver hook and enforcement tier chosen at start-up.
struct Enforcement {
    ladder: HookLadder,
    tier: Tier,
    /// The object relocated for fmod_ret loads, while that hook is to be attached.
    modify_return: Option<modify_return::Relocated>,
}

/// Climbs the ladder of pre-driver hooks (recording in `caps` which the kernel accepts), then
/// picks the tier, refusing one the kernel cannot give.
fn choose_hook_and_tier(
    ebpf: &mut Ebpf,
    aya_btf: &aya::Btf,
    setup: &ProbeSetup<'_>,
    mode: AttachMode,
    fentry_refusal: Option<&str>,
    caps: &mut KernelCaps,
) -> Result<Enforcement, ProbeError> {
    let inputs = LadderInputs {
        preference: setup.deny_hook,
        tier: setup.tier,
        mode,
        fentry_refusal,
        attach: setup.config.attach,
    };
    let (ladder, [bpf_lsm, fmod_ret], modify_return) = climb_ladder(ebpf, aya_btf, &inputs)?;
    caps.bpf_lsm = bpf_lsm;
    caps.fmod_ret = fmod_ret;
    let tier = match setup.tier {
        TierPreference::Deny if ladder.in_force == DenyHook::None => {
            return Err(ProbeError::DenyUnavailable(ladder.summary()));
        }
        TierPreference::Dmem if !caps.dmem_nvidia => return Err(ProbeError::DmemUnavailable),
        TierPreference::Dmem => Tier::Dmem,
        _ if ladder.in_force != DenyHook::None => Tier::Deny,
        _ => Tier::React,
    };
    Ok(Enforcement {
        ladder,
        tier,
        modify_return,
    })
}

/// Learns whether the programs may call `bpf_probe_write_user`, which the kernel refuses under
/// lockdown or without CAP_SYS_ADMIN: first from a program of a few instructions that calls it,
/// then, where that loads, by loading the memory view's rewriting return program (which must
/// also pass the verifier). A refusal of the large program would cost the verifier, and the
/// loader's retry with a log, seconds at every start on a locked-down kernel. Records the answer
/// in `caps`, logs the capabilities (now all known) and returns the refusal, if any.
fn probe_rewrite(
    ebpf: &mut Ebpf,
    mode: AttachMode,
    aya_btf: &aya::Btf,
    caps: &mut KernelCaps,
) -> Option<String> {
    let rewrite = load_probe(ebpf, programs::WRITE_USER_PROBE, |p: &mut RawTracePoint| {
        p.load()
    })
    .and_then(|()| match mode {
        AttachMode::Tracepoint => {
            load_probe(ebpf, programs::TP_IOCTL_EXIT_RW, |p: &mut TracePoint| {
                p.load()
            })
        }
        AttachMode::Fentry => load_probe(ebpf, programs::FEXIT_IOCTL_RW, |p: &mut FExit| {
            p.load(SYS_IOCTL.0, aya_btf)
        }),
    });
    caps.probe_write_user = rewrite.is_ok();
    info!(?caps, "kernel capabilities");
    rewrite.err()
}

/// The memory view and scheduler guard at start, from the configuration and whether the
/// kernel lets the probes rewrite a call (`rewrite_refusal`).
fn memory_view_and_guard(
    setup: &ProbeSetup<'_>,
    tier: Tier,
    rewrite_refusal: Option<String>,
) -> (MemoryInfoState, GuardState) {
    let no_rewrite =
        rewrite_refusal.map(|e| caps::write_user_refusal(&e, crate::privileges::sys_admin()));
    let memory_info = match &no_rewrite {
        None if setup.virtualize_memory_info => MemoryInfoState::On,
        None => MemoryInfoState::Off,
        Some(why) => MemoryInfoState::Unavailable(why.clone()),
    };
    let guard = GuardState {
        mode: setup.scheduler_guard,
        deny: tier == Tier::Deny,
        no_rewrite,
        kill: setup.guard_react_action == GuardReactAction::Kill,
    };
    (memory_info, guard)
}

/// Writes the configuration record (`CONFIG`) the programs read.
fn write_config(
    ebpf: &mut Ebpf,
    setup: ProbeSetup<'_>,
    offsets: gpud_common::KernelOffsets,
    mode: AttachMode,
    memory_info: &MemoryInfoState,
    guard: &GuardState,
) -> Result<(), ProbeError> {
    let kill = if guard.kill {
        gpud_common::CFG_GUARD_KILL
    } else {
        0
    };
    maps::write_config(
        ebpf,
        maps::Settings {
            offsets,
            majors: setup.majors,
            extra: setup.extra,
            mode,
            react: setup.react_action,
            memory_info: *memory_info == MemoryInfoState::On,
            guard_flags: GuardState::flags(guard.mode) | kill,
            guard_timeslice_us: setup.guard_timeslice_us,
            objects_per_cgroup: setup.config.max_objects_per_cgroup,
        },
    )
}

/// Logs the attach mode, tier and hook, the hooks refused, the memory view and the guard.
fn log_choices(
    mode: AttachMode,
    hooks: &Enforcement,
    memory_info: &MemoryInfoState,
    guard: &GuardState,
) {
    info!(
        mode = mode.as_str(),
        tier = hooks.tier.as_str(),
        deny_hook = hooks.ladder.in_force.as_str(),
        "attach mode, enforcement tier and pre-driver hook"
    );
    for (hook, why) in &hooks.ladder.refused {
        info!(hook = hook.as_str(), "pre-driver hook not used: {why}");
    }
    match memory_info {
        MemoryInfoState::Unavailable(why) => {
            warn!("memory view unavailable ({why}): limited cgroups see the GPU's real memory size")
        }
        state => info!(memory_view = state.describe(), "in-container memory view"),
    }
    if guard.mode == GuardMode::Enforce && guard.reacts() {
        warn!(
            "scheduler guard {}: a tenant's control holds until gpud undoes it",
            guard.describe()
        );
    } else {
        info!(scheduler_guard = guard.describe(), "scheduler guard");
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use aya_obj::maps::PinningType;

    use super::{
        attach::{
            EVENT_SYSCALL_ATTACHMENTS, FENTRY_ATTACHMENTS, FENTRY_RETURN_ATTACHMENTS,
            LSM_ATTACHMENTS, MODIFY_RETURN_ATTACHMENTS, RAW_SYSCALL_ATTACHMENTS, RUN_PROGRAMS,
            TRACEPOINT_ATTACHMENTS,
        },
        pin::expected_layouts,
        *,
    };

    /// Every name the daemon uses is in the object it embeds, with the layout it expects, and
    /// every program in the object has a user: a rename or a dead program on either side fails
    /// here instead of at load time.
    #[test]
    fn names_and_layouts_match_the_embedded_object() -> Result<(), aya_obj::ParseError> {
        let obj = aya_obj::Object::parse(OBJECT)?;

        let pinned: BTreeSet<&str> = obj
            .maps
            .iter()
            .filter(|(_, m)| m.pinning() == PinningType::ByName)
            .map(|(name, _)| name.as_str())
            .collect();
        assert_eq!(pinned, BTreeSet::from(map_names::ALL), "pinned maps");
        let checked: BTreeSet<&str> = expected_layouts().iter().map(|l| l.0).collect();
        assert_eq!(
            checked,
            BTreeSet::from(map_names::ALL),
            "maps with a layout check"
        );
        for (name, key, value) in expected_layouts() {
            let map = &obj.maps[name];
            assert_eq!(
                (map.key_size() as usize, map.value_size() as usize),
                (key, value),
                "key and value sizes of `{name}`"
            );
        }

        let mut used: BTreeSet<&str> = FENTRY_ATTACHMENTS
            .iter()
            .chain(FENTRY_RETURN_ATTACHMENTS)
            .chain(LSM_ATTACHMENTS)
            .chain(MODIFY_RETURN_ATTACHMENTS)
            .chain(TRACEPOINT_ATTACHMENTS)
            .chain(RAW_SYSCALL_ATTACHMENTS)
            .chain(EVENT_SYSCALL_ATTACHMENTS)
            .flat_map(|a| [Some(a.program), a.rewriting])
            .flatten()
            .collect();
        used.extend(RUN_PROGRAMS);
        used.insert(programs::LSM_PROBE);
        used.insert(programs::WRITE_USER_PROBE);
        used.insert(programs::FMODRET_PROBE);
        // The benchmark's references (tests/src/bin/gpud-bench.rs).
        used.extend([
            programs::NOOP_RAW_TP,
            programs::NOOP_FENTRY,
            programs::NOOP_FEXIT,
        ]);
        let in_object: BTreeSet<&str> = obj.programs.keys().map(String::as_str).collect();
        assert_eq!(in_object, used, "programs in the object and their users");
        Ok(())
    }

    /// aya's style: Display says what failed, the cause is only the source, so a chain printed
    /// at the edge names each cause once.
    #[test]
    fn a_chain_shows_each_cause_once() {
        let e = ProbeError::Io {
            action: "create",
            path: PathBuf::from("/x/gpud"),
            source: std::io::Error::from_raw_os_error(libc::ENOTDIR),
        };
        assert_eq!(e.to_string(), "cannot create /x/gpud");
        let chain = Chain(&e).to_string();
        assert!(
            chain.starts_with("cannot create /x/gpud: Not a directory"),
            "{chain}"
        );
        assert_eq!(chain.matches("Not a directory").count(), 1, "{chain}");
    }
}
