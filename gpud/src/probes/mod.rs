//! The kernel side, from userspace: loading the eBPF object, probing what the kernel accepts,
//! attaching in the chosen mode, and pinning maps and links so a restarted daemon resumes.
//!
//! Pins live under `<bpffs>/gpud/v<ABI_VERSION>/`: maps by name, links under
//! `links/<object-hash>-<mode>/`. A daemon that finds the same object attached in the same mode
//! adopts it (no gap, no double counting); otherwise it removes the old links and attaches anew.

pub mod btf;
pub mod caps;
pub mod devices;

use std::{
    ffi::CString,
    hash::{DefaultHasher, Hash, Hasher},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{
        FEntry, FExit, Lsm, RawTracePoint, TracePoint,
        links::{FdLink, PinnedLink},
    },
};
use gpud_common::{
    ABI_VERSION, Ancestry, CFG_EXIT_RELEASE, CFG_HAS_EXTRA_FILES, CFG_READY, DeviceKind, FileKey,
    IoctlCounts, LimitValue, ObjEntry, ObjKey, Pending, ProbeConfig, ProcEntry, REACT_FREEZE,
    REACT_KILL, REACT_NOTIFY, UsageKey, maps, programs,
};
use tracing::{debug, info, warn};

pub use caps::KernelCaps;
pub use devices::{DynamicMajors, ExtraFile, Matcher};

use crate::config::{AttachPreference, ProbesConfig, ReactAction, TierPreference};

/// The eBPF object built by `build.rs` from the `gpud-ebpf` crate.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gpud-probes"));

/// The embedded eBPF object, for tools that load parts of it themselves (the benchmark's
/// reference programs).
pub fn ebpf_object() -> &'static [u8] {
    OBJECT
}

pub const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const TRACEFS_MAGIC: i64 = 0x7472_6163;
const TRACEFS: &str = "/sys/kernel/tracing";

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Btf(#[from] btf::BtfError),
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("eBPF program `{name}`: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("eBPF map `{name}`: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("pinning `{path}`: {reason}")]
    Pin { path: PathBuf, reason: String },
    #[error("probes.attach = \"fentry\" but this kernel refuses BPF trampolines")]
    FentryUnavailable,
    #[error("this kernel accepts neither fentry nor syscall tracepoint programs")]
    NoAttachMechanism,
    #[error(
        "enforcement.tier = \"deny\" but this kernel does not run BPF-LSM programs (needs CONFIG_BPF_LSM and `bpf` in the lsm= boot parameter)"
    )]
    DenyUnavailable,
    #[error(
        "enforcement.tier = \"dmem\" but the dmem cgroup controller lists no NVIDIA regions in dmem.capacity"
    )]
    DmemUnavailable,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ProbeError {
    let what = what.into();
    move |source| ProbeError::Io { what, source }
}

/// The attach mechanism in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Fentry,
    Tracepoint,
}

impl AttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fentry => "fentry",
            Self::Tracepoint => "tracepoint",
        }
    }
}

/// How GPU-memory limits are enforced, chosen at start-up from the configuration and what the
/// kernel offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// BPF-LSM `file_ioctl` refuses the crossing allocation with `ENOMEM`.
    Deny,
    /// The crossing allocation is acted on when its ioctl returns.
    React,
    /// The kernel's `dmem` controller enforces `dmem.max`; the probes still account.
    Dmem,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Deny => "deny",
            Self::React => "react",
            Self::Dmem => "dmem",
        }
    }
}

/// The return side of `ioctl(2)` for fexit, per architecture: native and 32-bit compat entry.
#[cfg(target_arch = "x86_64")]
const SYS_IOCTL: (&str, &str) = ("__x64_sys_ioctl", "__ia32_compat_sys_ioctl");
#[cfg(target_arch = "aarch64")]
const SYS_IOCTL: (&str, &str) = ("__arm64_sys_ioctl", "__arm64_compat_sys_ioctl");
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const SYS_IOCTL: (&str, &str) = ("sys_ioctl", "compat_sys_ioctl");

/// Where one program attaches.
#[derive(Clone, Copy)]
enum Target {
    Fentry(&'static str),
    Fexit(&'static str),
    Lsm(&'static str),
    Tracepoint(&'static str, &'static str),
    RawTracepoint(&'static str),
}

/// One attachment: program, target, and whether its absence is tolerated (e.g. `openat2` on
/// old kernels).
struct Attachment {
    program: &'static str,
    target: Target,
    optional: bool,
}

const fn att(program: &'static str, target: Target, optional: bool) -> Attachment {
    Attachment {
        program,
        target,
        optional,
    }
}

const FENTRY_ATTACHMENTS: &[Attachment] = &[
    att(
        programs::FENTRY_IOCTL,
        Target::Fentry("security_file_ioctl"),
        false,
    ),
    att(
        programs::FENTRY_IOCTL_COMPAT,
        Target::Fentry("security_file_ioctl_compat"),
        true,
    ),
    att(
        programs::FENTRY_OPEN,
        Target::Fentry("security_file_open"),
        false,
    ),
    att(
        programs::TP_EXIT,
        Target::Tracepoint("sched", "sched_process_exit"),
        false,
    ),
];

/// Added to the fentry set in both tiers: the return side and the file-release hook.
const FENTRY_RETURN_ATTACHMENTS: &[Attachment] = &[
    att(programs::FEXIT_IOCTL, Target::Fexit(SYS_IOCTL.0), false),
    att(
        programs::FEXIT_IOCTL_COMPAT,
        Target::Fexit(SYS_IOCTL.1),
        true,
    ),
    att(
        programs::FENTRY_FILE_FREE,
        Target::Fentry("security_file_free"),
        false,
    ),
];

/// The `deny` tier's replacements for the two fentry ioctl programs.
const LSM_ATTACHMENTS: &[Attachment] = &[
    att(programs::LSM_IOCTL, Target::Lsm("file_ioctl"), false),
    att(
        programs::LSM_IOCTL_COMPAT,
        Target::Lsm("file_ioctl_compat"),
        true,
    ),
];

const TRACEPOINT_ATTACHMENTS: &[Attachment] = &[
    att(
        programs::TP_IOCTL,
        Target::Tracepoint("syscalls", "sys_enter_ioctl"),
        false,
    ),
    att(
        programs::TP_IOCTL_EXIT,
        Target::Tracepoint("syscalls", "sys_exit_ioctl"),
        false,
    ),
    att(
        programs::TP_CLOSE,
        Target::Tracepoint("syscalls", "sys_enter_close"),
        false,
    ),
    att(
        programs::TP_OPEN,
        Target::Tracepoint("syscalls", "sys_exit_openat"),
        false,
    ),
    att(
        programs::TP_OPEN,
        Target::Tracepoint("syscalls", "sys_exit_open"),
        true,
    ),
    att(
        programs::TP_OPEN,
        Target::Tracepoint("syscalls", "sys_exit_openat2"),
        true,
    ),
    att(
        programs::TP_FORK,
        Target::RawTracepoint("sched_process_fork"),
        false,
    ),
    att(
        programs::TP_EXIT,
        Target::Tracepoint("sched", "sched_process_exit"),
        false,
    ),
];

impl Attachment {
    /// Name of the link's pin. bpffs reserves dots in names, hence the dashes.
    fn pin_name(&self) -> String {
        match self.target {
            Target::Fentry(f) => format!("fentry-{f}"),
            Target::Fexit(f) => format!("fexit-{f}"),
            Target::Lsm(h) => format!("lsm-{h}"),
            Target::Tracepoint(c, n) => format!("tp-{c}-{n}"),
            Target::RawTracepoint(n) => format!("raw_tp-{n}"),
        }
    }
}

/// Programs the daemon runs itself (`BPF_PROG_TEST_RUN`), loaded in every mode and never attached.
const RUN_PROGRAMS: [&str; 2] = [programs::SEED, programs::RELEASE];

/// The kernel's `pid_max`, which sizes the tracked-process filter (the kernel's hard limit if it
/// cannot be read).
fn pid_max() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4_194_304)
}

/// Mounts `fstype` at `path` unless a filesystem with `magic` is already there.
pub fn ensure_mounted(path: &Path, fstype: &str, magic: i64) -> Result<(), ProbeError> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| ProbeError::Io {
        what: format!("{} contains a NUL byte", path.display()),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    // A directory inside an existing mount of the right type is fine (e.g. a subdirectory of
    // /sys/fs/bpf): create it first so statfs sees what contains it.
    std::fs::create_dir_all(path).map_err(io_err(format!("creating {}", path.display())))?;
    // SAFETY: statfs writes into a zeroed struct we own; c_path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut st) } == 0 && st.f_type == magic {
        return Ok(());
    }
    let c_type = CString::new(fstype).map_err(|_| ProbeError::Io {
        what: "fstype".into(),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: all pointers are valid NUL-terminated strings; data is null.
    let rc = unsafe {
        libc::mount(
            c_type.as_ptr(),
            c_path.as_ptr(),
            c_type.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(ProbeError::Io {
            what: format!("mounting {fstype} at {}", path.display()),
            source: std::io::Error::last_os_error(),
        });
    }
    info!(path = %path.display(), fstype, "mounted");
    Ok(())
}

/// Inputs of [`Probes::start`].
pub struct ProbeSetup<'a> {
    pub config: &'a ProbesConfig,
    pub majors: DynamicMajors,
    pub extra: &'a [ExtraFile],
    pub cgroup2_root: &'a Path,
    pub tier: TierPreference,
    pub react_action: ReactAction,
}

/// The loaded object, its maps, and the links keeping it attached.
pub struct Probes {
    ebpf: Ebpf,
    mode: AttachMode,
    tier: Tier,
    caps: KernelCaps,
    base_dir: PathBuf,
    resumed: bool,
}

impl Probes {
    /// The pin directory for this ABI under `bpffs`.
    pub fn pin_base(bpffs: &Path) -> PathBuf {
        bpffs.join("gpud").join(format!("v{ABI_VERSION}"))
    }

    /// Loads, probes and attaches (or adopts what a previous daemon left attached).
    pub fn start(setup: ProbeSetup<'_>) -> Result<Self, ProbeError> {
        let cfg = setup.config;
        ensure_mounted(&cfg.bpffs, "bpf", BPF_FS_MAGIC)?;
        if let Err(e) = ensure_mounted(Path::new(TRACEFS), "tracefs", TRACEFS_MAGIC) {
            // Only tracepoint attachment needs it; fentry works without.
            warn!("{e}");
        }
        let base_dir = Self::pin_base(&cfg.bpffs);
        remove_other_abi_versions(&cfg.bpffs)?;
        remove_if_foreign_layout(&base_dir)?;
        std::fs::create_dir_all(base_dir.join("links"))
            .map_err(io_err(format!("creating {}", base_dir.display())))?;

        let ring_bytes = cfg.events_ring_kib.saturating_mul(1024);
        warn_if_pinned_ring_differs(&base_dir, ring_bytes);
        let kbtf = btf::KernelBtf::load()?;
        let offsets = kbtf.kernel_offsets()?;
        debug!(?offsets, "kernel offsets from BTF");
        let aya_btf = aya::Btf::from_sys_fs().map_err(|e| ProbeError::Io {
            what: "reading kernel BTF".into(),
            source: std::io::Error::other(e.to_string()),
        })?;

        // fentry programs read struct fields directly; the verifier checks those loads
        // against BTF using these offsets, frozen into the object's .rodata.
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&aya_btf))
            .default_map_pin_directory(&base_dir)
            .override_global("BTF_FILE_INODE", &offsets.file_inode, true)
            .override_global("BTF_INODE_RDEV", &offsets.inode_rdev, true)
            .override_global("BTF_INODE_INO", &offsets.inode_ino, true)
            .override_global("BTF_INODE_SB", &offsets.inode_sb, true)
            .override_global("BTF_SB_DEV", &offsets.sb_dev, true)
            .override_global("BTF_FILE_REFS", &offsets.file_refs, true)
            .map_max_entries(maps::TRACKED, gpud_common::tracked_words(pid_max()))
            .map_max_entries(maps::EVENTS, ring_bytes)
            .load(OBJECT)?;

        let mut caps = KernelCaps {
            file_ioctl_compat: kbtf.has_function("security_file_ioctl_compat"),
            dmem_cgroup: caps::dmem_available(setup.cgroup2_root),
            dmem_nvidia: caps::dmem_nvidia_regions(
                setup.cgroup2_root,
                Path::new(caps::PCI_DEVICES),
            )
            .is_some_and(|r| !r.is_empty()),
            ..KernelCaps::default()
        };
        caps.fentry = try_load(&mut ebpf, programs::FENTRY_IOCTL, |p: &mut FEntry| {
            p.load("security_file_ioctl", &aya_btf)
        });
        caps.tracepoint = try_load(&mut ebpf, programs::TP_IOCTL, |p: &mut TracePoint| p.load());
        caps.bpf_lsm = caps::bpf_in_lsm_list()
            && try_load(&mut ebpf, programs::LSM_PROBE, |p: &mut Lsm| {
                p.load("file_ioctl", &aya_btf)
            });
        info!(?caps, "kernel capabilities");
        for name in RUN_PROGRAMS {
            let p: &mut RawTracePoint = ebpf
                .program_mut(name)
                .ok_or(ProbeError::Program {
                    name,
                    source: aya::programs::ProgramError::NotLoaded,
                })?
                .try_into()
                .map_err(|source| ProbeError::Program { name, source })?;
            p.load()
                .map_err(|source| ProbeError::Program { name, source })?;
        }

        let mode = match (cfg.attach, caps.fentry, caps.tracepoint) {
            (AttachPreference::Fentry, false, _) => return Err(ProbeError::FentryUnavailable),
            (AttachPreference::Fentry | AttachPreference::Auto, true, _) => AttachMode::Fentry,
            (_, _, true) => AttachMode::Tracepoint,
            (_, _, false) => return Err(ProbeError::NoAttachMechanism),
        };
        // BPF-LSM programs run on trampolines too: deny needs the fentry mode.
        let can_deny = caps.bpf_lsm && mode == AttachMode::Fentry;
        let tier = match setup.tier {
            TierPreference::Deny if !can_deny => return Err(ProbeError::DenyUnavailable),
            TierPreference::Dmem if !caps.dmem_nvidia => return Err(ProbeError::DmemUnavailable),
            TierPreference::Dmem => Tier::Dmem,
            TierPreference::Deny | TierPreference::Auto if can_deny => Tier::Deny,
            _ => Tier::React,
        };
        write_config(
            &mut ebpf,
            offsets,
            setup.majors,
            setup.extra,
            mode,
            setup.react_action,
        )?;
        info!(
            mode = mode.as_str(),
            tier = tier.as_str(),
            "attach mode and enforcement tier"
        );

        let mut probes = Self {
            ebpf,
            mode,
            tier,
            caps,
            base_dir,
            resumed: false,
        };
        probes.attach_or_adopt(&kbtf, &aya_btf)?;
        Ok(probes)
    }

    fn attachments(&self) -> Vec<&'static Attachment> {
        match (self.mode, self.tier) {
            (AttachMode::Tracepoint, _) => TRACEPOINT_ATTACHMENTS.iter().collect(),
            (AttachMode::Fentry, Tier::Deny) => LSM_ATTACHMENTS
                .iter()
                .chain(FENTRY_ATTACHMENTS.iter().filter(|a| {
                    ![programs::FENTRY_IOCTL, programs::FENTRY_IOCTL_COMPAT].contains(&a.program)
                }))
                .chain(FENTRY_RETURN_ATTACHMENTS)
                .collect(),
            (AttachMode::Fentry, _) => FENTRY_ATTACHMENTS
                .iter()
                .chain(FENTRY_RETURN_ATTACHMENTS)
                .collect(),
        }
    }

    fn links_dir(&self) -> PathBuf {
        let mut h = DefaultHasher::new();
        OBJECT.hash(&mut h);
        self.base_dir.join("links").join(format!(
            "{:016x}-{}-{}",
            h.finish(),
            self.mode.as_str(),
            self.tier.as_str()
        ))
    }

    fn attach_or_adopt(&mut self, kbtf: &btf::KernelBtf, btf: &aya::Btf) -> Result<(), ProbeError> {
        let dir = self.links_dir();
        let required_present = self
            .attachments()
            .iter()
            .filter(|a| !a.optional)
            .all(|a| PinnedLink::from_pin(dir.join(a.pin_name())).is_ok());
        if required_present {
            info!(dir = %dir.display(), mode = self.mode.as_str(), "adopting attached probes");
            self.resumed = true;
            return Ok(());
        }
        // Anything else under links/ is another object or mode: detach it before attaching, so
        // no ioctl is counted twice.
        let links_root = self.base_dir.join("links");
        for entry in std::fs::read_dir(&links_root)
            .map_err(io_err(format!("reading {}", links_root.display())))?
            .flatten()
        {
            info!(path = %entry.path().display(), "detaching stale probes");
            std::fs::remove_dir_all(entry.path())
                .map_err(io_err(format!("removing {}", entry.path().display())))?;
        }
        std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        for a in self.attachments() {
            let func = match a.target {
                Target::Fentry(f) | Target::Fexit(f) => Some(f.to_owned()),
                Target::Lsm(h) => Some(format!("bpf_lsm_{h}")),
                _ => None,
            };
            if let Some(f) = func
                && a.optional
                && !kbtf.has_function(&f)
            {
                continue;
            }
            match self.attach_one(a, btf) {
                Ok(link) => {
                    let path = dir.join(a.pin_name());
                    link.pin(&path).map_err(|e| ProbeError::Pin {
                        path: path.clone(),
                        reason: error_chain(&e),
                    })?;
                    debug!(program = a.program, pin = %path.display(), "attached");
                }
                Err(e) if a.optional => {
                    debug!(
                        program = a.program,
                        target = a.pin_name(),
                        "optional attach skipped: {e}"
                    )
                }
                Err(e) => return Err(e),
            }
        }
        info!(mode = self.mode.as_str(), dir = %dir.display(), "probes attached");
        Ok(())
    }

    fn attach_one(&mut self, a: &Attachment, btf: &aya::Btf) -> Result<FdLink, ProbeError> {
        let name = a.program;
        let perr = move |source| ProbeError::Program { name, source };
        let prog = self.ebpf.program_mut(name).ok_or(ProbeError::Program {
            name,
            source: aya::programs::ProgramError::NotLoaded,
        })?;
        match a.target {
            Target::Fentry(func) => {
                let p: &mut FEntry = prog.try_into().map_err(perr)?;
                // An fentry program is bound to its target at load time.
                if p.fd().is_err() {
                    p.load(func, btf).map_err(perr)?;
                }
                let id = p.attach().map_err(perr)?;
                Ok(p.take_link(id).map_err(perr)?.into())
            }
            Target::Fexit(func) => {
                let p: &mut FExit = prog.try_into().map_err(perr)?;
                if p.fd().is_err() {
                    p.load(func, btf).map_err(perr)?;
                }
                let id = p.attach().map_err(perr)?;
                Ok(p.take_link(id).map_err(perr)?.into())
            }
            Target::Lsm(hook) => {
                let p: &mut Lsm = prog.try_into().map_err(perr)?;
                if p.fd().is_err() {
                    p.load(hook, btf).map_err(perr)?;
                }
                let id = p.attach().map_err(perr)?;
                Ok(p.take_link(id).map_err(perr)?.into())
            }
            Target::Tracepoint(cat, tp) => {
                let p: &mut TracePoint = prog.try_into().map_err(perr)?;
                if p.fd().is_err() {
                    p.load().map_err(perr)?;
                }
                let id = p.attach(cat, tp).map_err(perr)?;
                let link = p.take_link(id).map_err(perr)?;
                FdLink::try_from(link).map_err(|e| ProbeError::Pin {
                    path: PathBuf::from(format!("{cat}/{tp}")),
                    reason: format!("kernel returned a perf-event attachment, not a link: {e}"),
                })
            }
            Target::RawTracepoint(tp) => {
                let p: &mut RawTracePoint = prog.try_into().map_err(perr)?;
                if p.fd().is_err() {
                    p.load().map_err(perr)?;
                }
                let id = p.attach(tp).map_err(perr)?;
                Ok(p.take_link(id).map_err(perr)?.into())
            }
        }
    }

    /// Marks `pid` as holding an NVIDIA file in the tracepoint-mode filter, by running the
    /// `gpud_seed` program in the kernel (the filter is only changed with atomic adds there).
    pub fn seed(&self, pid: u32) -> Result<(), ProbeError> {
        use aya::programs::{RawTracePointRunOptions, TestRun as _};
        let name = programs::SEED;
        let perr = move |source| ProbeError::Program { name, source };
        let prog: &RawTracePoint = self
            .ebpf
            .program(name)
            .ok_or(perr(aya::programs::ProgramError::NotLoaded))?
            .try_into()
            .map_err(perr)?;
        let mut opts = RawTracePointRunOptions::new();
        opts.args[0] = u64::from(pid);
        prog.test_run(opts).map_err(perr)?;
        Ok(())
    }

    /// Releases the object `(client, object)` if it still carries `serial`, uncharging its
    /// bytes, by running the `gpud_release` program in the kernel (usage counters are only ever
    /// changed atomically there). Returns whether it was released.
    pub fn release(&self, key: ObjKey, serial: u64) -> Result<bool, ProbeError> {
        use aya::programs::{RawTracePointRunOptions, TestRun as _};
        let name = programs::RELEASE;
        let perr = move |source| ProbeError::Program { name, source };
        let prog: &RawTracePoint = self
            .ebpf
            .program(name)
            .ok_or(perr(aya::programs::ProgramError::NotLoaded))?
            .try_into()
            .map_err(perr)?;
        let mut opts = RawTracePointRunOptions::new();
        opts.args[0] = u64::from(key.client);
        opts.args[1] = u64::from(key.object);
        opts.args[2] = serial;
        let out = prog.test_run(opts).map_err(perr)?;
        Ok(out.return_value == 0)
    }

    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    pub fn caps(&self) -> &KernelCaps {
        &self.caps
    }

    /// Whether the probes were found attached by a previous daemon and adopted.
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    pub fn base_dir(&self) -> &Path {
        &self.base_dir
    }

    /// Takes the event ring buffer (for the reader task).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        take(&mut self.ebpf, maps::EVENTS)
    }

    /// Takes the counter maps (for the state owner).
    pub fn take_maps(&mut self) -> Result<KernelMaps, ProbeError> {
        Ok(KernelMaps {
            procs: take(&mut self.ebpf, maps::PROCS)?,
            cgroups: take(&mut self.ebpf, maps::CGROUPS)?,
            stats: take(&mut self.ebpf, maps::STATS)?,
            objects: take(&mut self.ebpf, maps::OBJECTS)?,
            usage: take(&mut self.ebpf, maps::USAGE)?,
            limits: take(&mut self.ebpf, maps::LIMITS)?,
            ancestry: take(&mut self.ebpf, maps::ANCESTRY)?,
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
            Err(e) => warn!(dir = %self.base_dir.display(), "removing pins: {e}"),
        }
    }
}

/// The error for a map the object lacks (a build of the eBPF crate out of step with gpud).
fn missing_map(name: &'static str) -> ProbeError {
    ProbeError::Map {
        name,
        source: aya::maps::MapError::InvalidName { name: name.into() },
    }
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, ProbeError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or_else(|| missing_map(name))?;
    T::try_from(map).map_err(|source| ProbeError::Map { name, source })
}

fn map_mut<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut aya::maps::Map, ProbeError> {
    ebpf.map_mut(name).ok_or_else(|| missing_map(name))
}

/// Loads a program to learn whether the kernel accepts its type; a refusal is an answer, not an
/// error.
fn try_load<P>(
    ebpf: &mut Ebpf,
    name: &'static str,
    load: impl FnOnce(&mut P) -> Result<(), aya::programs::ProgramError>,
) -> bool
where
    for<'a> &'a mut P: TryFrom<&'a mut aya::programs::Program>,
{
    let Some(prog) = ebpf.program_mut(name) else {
        return false;
    };
    let Ok(p) = <&mut P>::try_from(prog) else {
        return false;
    };
    match load(p) {
        Ok(()) => true,
        Err(e) => {
            debug!(program = name, "probe load refused: {e}");
            false
        }
    }
}

/// The maps the state owner reads and updates.
pub struct KernelMaps {
    pub procs: HashMap<MapData, u32, ProcEntry>,
    pub cgroups: HashMap<MapData, u64, IoctlCounts>,
    pub stats: PerCpuArray<MapData, u64>,
    pub objects: HashMap<MapData, ObjKey, ObjEntry>,
    pub usage: HashMap<MapData, UsageKey, u64>,
    pub limits: HashMap<MapData, UsageKey, LimitValue>,
    pub ancestry: HashMap<MapData, u64, Ancestry>,
}

/// Entries per `BPF_MAP_LOOKUP_BATCH` call: far more than a hash bucket ever holds (a bucket
/// larger than the batch is refused with `ENOSPC`).
const LOOKUP_BATCH: usize = 1024;

/// Every entry of a hash map. Read in batches (one `bpf()` call per 1,024 entries instead of two
/// per entry: the walks behind `ListCgroups`, the sweeps and the releases stay cheap with
/// thousands of processes and objects); by key walk where the kernel refuses batches. Entries
/// changing meanwhile may be seen or not, as with any walk of a live map.
pub fn map_entries<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>) -> Vec<(K, V)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let fd = aya::maps::IterableMap::map(map).fd().as_fd().as_raw_fd();
    match batch_entries(fd) {
        Ok(v) => v,
        Err(e) => {
            debug!("batched map read refused ({e}); walking keys");
            map.iter().filter_map(Result::ok).collect()
        }
    }
}

fn batch_entries<K: aya::Pod, V: aya::Pod>(fd: i32) -> std::io::Result<Vec<(K, V)>> {
    let (ks, vs) = (size_of::<K>(), size_of::<V>());
    let mut keys = vec![0u8; LOOKUP_BATCH * ks];
    let mut values = vec![0u8; LOOKUP_BATCH * vs];
    // Hash maps use a bucket index as the batch cursor; key-sized buffers hold it.
    let mut cursor_in = vec![0u8; ks.max(8)];
    let mut cursor_out = vec![0u8; ks.max(8)];
    let opts = libbpf_sys::bpf_map_batch_opts {
        sz: size_of::<libbpf_sys::bpf_map_batch_opts>() as _,
        elem_flags: 0,
        flags: 0,
    };
    let mut out = Vec::new();
    let mut first = true;
    loop {
        let mut count = LOOKUP_BATCH as u32;
        // SAFETY: the buffers hold `count` keys and values of the map's sizes (checked by aya
        // when the map was taken) and cursors of at least the key size; libbpf writes no more.
        let rc = unsafe {
            libbpf_sys::bpf_map_lookup_batch(
                fd,
                if first {
                    std::ptr::null_mut()
                } else {
                    cursor_in.as_mut_ptr().cast()
                },
                cursor_out.as_mut_ptr().cast(),
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                &mut count,
                &opts,
            )
        };
        let done = match rc {
            0 => false,
            e if -e == libc::ENOENT => true,
            e if -e == libc::EINTR => continue,
            e => return Err(std::io::Error::from_raw_os_error(-e)),
        };
        let n = (count as usize).min(LOOKUP_BATCH);
        for i in 0..n {
            // SAFETY: in bounds (i < n ≤ LOOKUP_BATCH) and both types are plain old data;
            // read_unaligned makes no assumption about the byte buffers' alignment.
            let (k, v) = unsafe {
                (
                    std::ptr::read_unaligned(keys.as_ptr().add(i * ks).cast::<K>()),
                    std::ptr::read_unaligned(values.as_ptr().add(i * vs).cast::<V>()),
                )
            };
            out.push((k, v));
        }
        if done {
            return Ok(out);
        }
        std::mem::swap(&mut cursor_in, &mut cursor_out);
        first = false;
    }
}

fn write_config(
    ebpf: &mut Ebpf,
    offsets: gpud_common::KernelOffsets,
    majors: DynamicMajors,
    extra: &[ExtraFile],
    mode: AttachMode,
    react: ReactAction,
) -> Result<(), ProbeError> {
    let map_err = |name| move |source| ProbeError::Map { name, source };
    let mut files: HashMap<_, FileKey, u32> =
        HashMap::try_from(map_mut(ebpf, maps::EXTRA_FILES)?).map_err(map_err(maps::EXTRA_FILES))?;
    // The pinned map may hold a previous daemon's list: make it exactly the configured one.
    let stale: Vec<FileKey> = files
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !extra.iter().any(|e| e.key == *k))
        .collect();
    for k in stale {
        files.remove(&k).map_err(map_err(maps::EXTRA_FILES))?;
    }
    for e in extra {
        files
            .insert(e.key, DeviceKind::Control as u32, 0)
            .map_err(map_err(maps::EXTRA_FILES))?;
    }
    let mut config: Array<_, ProbeConfig> =
        Array::try_from(map_mut(ebpf, maps::CONFIG)?).map_err(map_err(maps::CONFIG))?;
    let value = ProbeConfig {
        offsets,
        uvm_major: majors.uvm,
        caps_major: majors.caps,
        caps_imex_major: majors.caps_imex,
        flags: CFG_READY
            | if extra.is_empty() {
                0
            } else {
                CFG_HAS_EXTRA_FILES
            }
            | match mode {
                AttachMode::Tracepoint => CFG_EXIT_RELEASE,
                AttachMode::Fentry => 0,
            },
        react_action: match react {
            ReactAction::Kill => REACT_KILL,
            ReactAction::Freeze => REACT_FREEZE,
            ReactAction::Notify => REACT_NOTIFY,
        },
        _pad: 0,
    };
    config.set(0, value, 0).map_err(map_err(maps::CONFIG))
}

/// `e` and its sources, joined: aya's errors keep the OS error one level down.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// Key and value sizes of every pinned map, as this build defines them.
fn expected_layouts() -> [(&'static str, usize, usize); 12] {
    use std::mem::size_of;
    [
        (maps::OBJECTS, size_of::<ObjKey>(), size_of::<ObjEntry>()),
        (maps::USAGE, size_of::<UsageKey>(), size_of::<u64>()),
        (maps::LIMITS, size_of::<UsageKey>(), size_of::<LimitValue>()),
        (maps::ANCESTRY, size_of::<u64>(), size_of::<Ancestry>()),
        (maps::PENDING, size_of::<u64>(), size_of::<Pending>()),
        (maps::CONFIG, size_of::<u32>(), size_of::<ProbeConfig>()),
        (maps::EXTRA_FILES, size_of::<FileKey>(), size_of::<u32>()),
        (maps::PROCS, size_of::<u32>(), size_of::<ProcEntry>()),
        (maps::CGROUPS, size_of::<u64>(), size_of::<IoctlCounts>()),
        (maps::STATS, size_of::<u32>(), size_of::<u64>()),
        (maps::TRACKED, size_of::<u32>(), size_of::<u64>()),
        (maps::EVENTS, 0, 0),
    ]
}

/// A pinned ring buffer is adopted as it is (the programs attached to it keep sending): a new
/// size applies once the pins are gone. Say so rather than silently run with the old size.
fn warn_if_pinned_ring_differs(base_dir: &Path, want: u32) {
    if let Ok(info) = aya::maps::MapInfo::from_pin(base_dir.join(maps::EVENTS))
        && info.max_entries() != want
    {
        warn!(
            pinned_kib = info.max_entries() / 1024,
            configured_kib = want / 1024,
            "the pinned event ring keeps its size until the pins are removed (probes.events_ring_kib)"
        );
    }
}

/// Pinned maps whose key or value size differs from this build's (an ABI change without a
/// version bump) would be read with the wrong layout: detach and remove them all, and start from
/// empty maps, rather than count into garbage.
fn remove_if_foreign_layout(base_dir: &Path) -> Result<(), ProbeError> {
    for (name, key, value) in expected_layouts() {
        let path = base_dir.join(name);
        if !path.exists() {
            continue;
        }
        let matches = aya::maps::MapInfo::from_pin(&path).is_ok_and(|info| {
            info.key_size() as usize == key && info.value_size() as usize == value
        });
        if !matches {
            warn!(
                map = name,
                dir = %base_dir.display(),
                "pinned map has another layout than this build; removing the pins and starting from empty maps"
            );
            return std::fs::remove_dir_all(base_dir)
                .map_err(io_err(format!("removing {}", base_dir.display())));
        }
    }
    Ok(())
}

/// Removes pins of other ABI versions: their programs would count with a foreign layout.
fn remove_other_abi_versions(bpffs: &Path) -> Result<(), ProbeError> {
    let root = bpffs.join("gpud");
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Ok(());
    };
    let current = format!("v{ABI_VERSION}");
    for entry in entries.flatten() {
        if entry.file_name() != current.as_str() {
            warn!(path = %entry.path().display(), "removing pins of another ABI version");
            std::fs::remove_dir_all(entry.path())
                .map_err(io_err(format!("removing {}", entry.path().display())))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use aya_obj::maps::PinningType;

    use super::*;

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
        assert_eq!(pinned, BTreeSet::from(maps::ALL), "pinned maps");
        let checked: BTreeSet<&str> = expected_layouts().iter().map(|l| l.0).collect();
        assert_eq!(
            checked,
            BTreeSet::from(maps::ALL),
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
            .chain(TRACEPOINT_ATTACHMENTS)
            .map(|a| a.program)
            .collect();
        used.extend(RUN_PROGRAMS);
        used.insert(programs::LSM_PROBE);
        // The benchmark's references (tests/src/bin/gpud-bench.rs).
        used.extend([programs::NOOP_TP, programs::NOOP_FENTRY]);
        let in_object: BTreeSet<&str> = obj.programs.keys().map(String::as_str).collect();
        assert_eq!(in_object, used, "programs in the object and their users");
        Ok(())
    }
}
