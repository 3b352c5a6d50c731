//! Where the programs attach: the attach modes and enforcement tiers, the attachment table of
//! each, and attaching them (or adopting the links a previous daemon pinned).
//!
//! Links are pinned under `links/<object-hash>-<mode>-<tier>[-rw][-no32]/` (`-rw`: the ioctl
//! programs are the twins that may rewrite user memory; `-no32`: tracepoint mode on the
//! `syscalls:*` events, which 32-bit callers pass unseen, instead of the raw `sys_enter` and
//! `sys_exit` tracepoints; `-raw-failed`: the same, where the raw ones would not attach), one
//! file per attachment, so a daemon that finds every required link
//! of its own object, mode, tier and return side adopts them with no gap.

use std::{
    fmt,
    hash::{DefaultHasher, Hash, Hasher},
    path::PathBuf,
};

use aya::programs::{
    FEntry, FExit, Lsm, RawTracePoint, TracePoint,
    links::{FdLink, PinnedLink},
};
use gpud_common::programs;
use tracing::{debug, info};

use super::{OBJECT, ProbeError, Probes, btf, io_err};
use crate::report::Chain;

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

/// The pre-driver hook that refuses an ioctl before the driver runs it (the ladder, tried in
/// this order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenyHook {
    /// BPF-LSM `file_ioctl`.
    Lsm,
    /// fmod_ret on `security_file_ioctl` (and `_compat`).
    FmodRet,
    /// kprobe + `bpf_override_return` on the ioctl syscall: not built, never in force.
    Kprobe,
    /// No hook: memory limits react after the allocation, the guard restores.
    None,
}

impl DenyHook {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lsm => "lsm",
            Self::FmodRet => "fmod_ret",
            Self::Kprobe => "kprobe",
            Self::None => "none",
        }
    }
}

/// The return side of `ioctl(2)` for fexit, per architecture: native and 32-bit compat entry.
#[cfg(target_arch = "x86_64")]
pub const SYS_IOCTL: (&str, &str) = ("__x64_sys_ioctl", "__ia32_compat_sys_ioctl");
#[cfg(target_arch = "aarch64")]
pub const SYS_IOCTL: (&str, &str) = ("__arm64_sys_ioctl", "__arm64_compat_sys_ioctl");
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub const SYS_IOCTL: (&str, &str) = ("sys_ioctl", "compat_sys_ioctl");

/// Where one program attaches.
#[derive(Clone, Copy)]
enum Target {
    Fentry(&'static str),
    Fexit(&'static str),
    Lsm(&'static str),
    /// fmod_ret on a kernel function, loaded by [`super::modify_return`].
    ModifyReturn(&'static str),
    Tracepoint(&'static str, &'static str),
    RawTracepoint(&'static str),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fentry(func) => write!(f, "fentry {func}"),
            Self::Fexit(func) => write!(f, "fexit {func}"),
            Self::Lsm(hook) => write!(f, "LSM hook {hook}"),
            Self::ModifyReturn(func) => write!(f, "fmod_ret {func}"),
            Self::Tracepoint(cat, name) => write!(f, "tracepoint {cat}/{name}"),
            Self::RawTracepoint(name) => write!(f, "raw tracepoint {name}"),
        }
    }
}

/// One attachment: program, target, and whether its absence is tolerated (e.g. `openat2` on
/// old kernels).
pub(super) struct Attachment {
    pub(super) program: &'static str,
    /// The program attached instead where the kernel allows `bpf_probe_write_user` (the memory
    /// view's and the scheduler guard's rewrites).
    pub(super) rewriting: Option<&'static str>,
    target: Target,
    optional: bool,
}

const fn att(program: &'static str, target: Target, optional: bool) -> Attachment {
    Attachment {
        program,
        rewriting: None,
        target,
        optional,
    }
}

/// An ioctl program, with its rewriting twin.
const fn att_rw(
    program: &'static str,
    rewriting: &'static str,
    target: Target,
    optional: bool,
) -> Attachment {
    Attachment {
        program,
        rewriting: Some(rewriting),
        target,
        optional,
    }
}

pub(super) const FENTRY_ATTACHMENTS: &[Attachment] = &[
    att_rw(
        programs::FENTRY_IOCTL,
        programs::FENTRY_IOCTL_RW,
        Target::Fentry("security_file_ioctl"),
        false,
    ),
    att_rw(
        programs::FENTRY_IOCTL_COMPAT,
        programs::FENTRY_IOCTL_COMPAT_RW,
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
pub(super) const FENTRY_RETURN_ATTACHMENTS: &[Attachment] = &[
    att_rw(
        programs::FEXIT_IOCTL,
        programs::FEXIT_IOCTL_RW,
        Target::Fexit(SYS_IOCTL.0),
        false,
    ),
    att_rw(
        programs::FEXIT_IOCTL_COMPAT,
        programs::FEXIT_IOCTL_COMPAT_RW,
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
pub(super) const LSM_ATTACHMENTS: &[Attachment] = &[
    att_rw(
        programs::LSM_IOCTL,
        programs::LSM_IOCTL_RW,
        Target::Lsm("file_ioctl"),
        false,
    ),
    att_rw(
        programs::LSM_IOCTL_COMPAT,
        programs::LSM_IOCTL_COMPAT_RW,
        Target::Lsm("file_ioctl_compat"),
        true,
    ),
];

/// The `deny` tier's replacements for the two fentry ioctl programs where the fmod_ret hook is
/// in force.
pub(super) const MODIFY_RETURN_ATTACHMENTS: &[Attachment] = &[
    att_rw(
        programs::FMODRET_IOCTL,
        programs::FMODRET_IOCTL_RW,
        Target::ModifyReturn("security_file_ioctl"),
        false,
    ),
    att_rw(
        programs::FMODRET_IOCTL_COMPAT,
        programs::FMODRET_IOCTL_COMPAT_RW,
        Target::ModifyReturn("security_file_ioctl_compat"),
        true,
    ),
];

/// Tracepoint mode's programs whatever the system calls' route (opens are seen on the
/// `syscalls:*` events, for every process: see `gpud_common::compat`).
pub(super) const TRACEPOINT_ATTACHMENTS: &[Attachment] = &[
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

/// Ioctls and closes on the raw `sys_enter` and `sys_exit` tracepoints, 64-bit and 32-bit
/// (x86-64, where 32-bit callers are followed: `compat_syscalls`): no event record is built for
/// them, and 32-bit callers, whom the `syscalls:*` events skip, are seen.
pub(super) const RAW_SYSCALL_ATTACHMENTS: &[Attachment] = &[
    att_rw(
        programs::TP_SYS_ENTER,
        programs::TP_SYS_ENTER_RW,
        Target::RawTracepoint("sys_enter"),
        false,
    ),
    att_rw(
        programs::TP_SYS_EXIT,
        programs::TP_SYS_EXIT_RW,
        Target::RawTracepoint("sys_exit"),
        false,
    ),
];

/// Ioctls and closes on the `syscalls:*` events, where the raw route is not taken: 64-bit
/// callers only.
pub(super) const EVENT_SYSCALL_ATTACHMENTS: &[Attachment] = &[
    att_rw(
        programs::TP_IOCTL,
        programs::TP_IOCTL_RW,
        Target::Tracepoint("syscalls", "sys_enter_ioctl"),
        false,
    ),
    att_rw(
        programs::TP_IOCTL_EXIT,
        programs::TP_IOCTL_EXIT_RW,
        Target::Tracepoint("syscalls", "sys_exit_ioctl"),
        false,
    ),
    att(
        programs::TP_CLOSE,
        Target::Tracepoint("syscalls", "sys_enter_close"),
        false,
    ),
];

/// Where tracepoint mode takes ioctls and closes (fentry mode takes them on its hooks, whatever
/// this says).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SyscallRoute {
    /// The raw `sys_enter` and `sys_exit` tracepoints, 64-bit and 32-bit callers.
    Raw,
    /// The `syscalls:*` events, 64-bit callers only: 32-bit callers are not followed.
    Events,
    /// The same, because the raw tracepoints would not attach.
    EventsRawFailed,
}

/// Why a set of programs did not attach: the raw system-call tracepoints (the daemon then takes
/// the `syscalls:*` events) or anything else.
enum Attach {
    RawSyscalls(ProbeError),
    Other(ProbeError),
}

impl Attach {
    fn into_error(self) -> ProbeError {
        match self {
            Self::RawSyscalls(e) | Self::Other(e) => e,
        }
    }
}

/// The `unseen_calls` entry of 32-bit callers' ioctls.
pub const UNSEEN_COMPAT: &str = "32-bit ioctls";

impl Attachment {
    /// Whether this is fentry mode's 32-bit (compat) ioctl hook, without which a 32-bit
    /// tenant's RM calls go unseen.
    fn is_compat(&self) -> bool {
        self.program.contains("compat")
    }

    /// Whether this is one of the raw system-call tracepoints' programs, which come and go as a
    /// pair, with the 64-bit ioctls.
    fn is_raw_syscall(&self) -> bool {
        RAW_SYSCALL_ATTACHMENTS
            .iter()
            .any(|r| r.program == self.program)
    }

    /// The program attached here: the rewriting twin where `rewriting` holds.
    fn program_of(&self, rewriting: bool) -> &'static str {
        match self.rewriting {
            Some(rw) if rewriting => rw,
            _ => self.program,
        }
    }

    /// Name of the link's pin. bpffs reserves dots in names, hence the dashes.
    fn pin_name(&self) -> String {
        match self.target {
            Target::Fentry(f) => format!("fentry-{f}"),
            Target::Fexit(f) => format!("fexit-{f}"),
            Target::Lsm(h) => format!("lsm-{h}"),
            Target::ModifyReturn(f) => format!("fmod_ret-{f}"),
            Target::Tracepoint(c, n) => format!("tp-{c}-{n}"),
            Target::RawTracepoint(n) => format!("raw_tp-{n}"),
        }
    }
}

/// The embedded object's hash, which starts the name of its links' directory: a daemon tells
/// links of its own object from another build's by it.
pub(super) fn object_hash() -> String {
    let mut h = DefaultHasher::new();
    OBJECT.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Programs the daemon runs itself (`BPF_PROG_TEST_RUN`), loaded in every mode and never attached.
pub(super) const RUN_PROGRAMS: [&str; 4] = [
    programs::SEED,
    programs::RELEASE,
    programs::FILE_HELD,
    programs::ADOPT,
];

impl Probes {
    fn attachments(&self) -> Vec<&'static Attachment> {
        let entry: &[Attachment] = match (self.tier, self.ladder.in_force) {
            (Tier::Deny, DenyHook::Lsm) => LSM_ATTACHMENTS,
            (Tier::Deny, DenyHook::FmodRet) => MODIFY_RETURN_ATTACHMENTS,
            _ => &[],
        };
        match self.mode {
            AttachMode::Tracepoint => {
                let syscalls = match self.route {
                    SyscallRoute::Raw => RAW_SYSCALL_ATTACHMENTS,
                    SyscallRoute::Events | SyscallRoute::EventsRawFailed => {
                        EVENT_SYSCALL_ATTACHMENTS
                    }
                };
                syscalls.iter().chain(TRACEPOINT_ATTACHMENTS).collect()
            }
            // The hook's programs count as the fentry ioctl programs do, and replace them.
            AttachMode::Fentry if !entry.is_empty() => entry
                .iter()
                .chain(FENTRY_ATTACHMENTS.iter().filter(|a| {
                    ![programs::FENTRY_IOCTL, programs::FENTRY_IOCTL_COMPAT].contains(&a.program)
                }))
                .chain(FENTRY_RETURN_ATTACHMENTS)
                .collect(),
            AttachMode::Fentry => FENTRY_ATTACHMENTS
                .iter()
                .chain(FENTRY_RETURN_ATTACHMENTS)
                .collect(),
        }
    }

    fn links_dir(&self) -> PathBuf {
        let hook = match self.tier {
            Tier::Deny => format!("-{}", self.ladder.in_force.as_str()),
            _ => String::new(),
        };
        // The system calls' route is another set of programs; the events' route taken because
        // the raw one would not attach is named apart from the one the configuration or the
        // kernel chose, so that a daemon told to follow 32-bit callers adopts only the former.
        let no32 = match (self.mode, self.route) {
            (AttachMode::Fentry, _) | (_, SyscallRoute::Raw) => "",
            (_, SyscallRoute::Events) => "-no32",
            (_, SyscallRoute::EventsRawFailed) => "-raw-failed",
        };
        self.base_dir.join("links").join(format!(
            "{}-{}-{}{hook}{}{}",
            object_hash(),
            self.mode.as_str(),
            self.tier.as_str(),
            if self.rewriting() { "-rw" } else { "" },
            no32
        ))
    }

    pub(super) fn attach_or_adopt(
        &mut self,
        kbtf: &btf::KernelBtf,
        btf: &aya::Btf,
    ) -> Result<(), ProbeError> {
        let compat_unseen = match self.mode {
            AttachMode::Fentry => None,
            AttachMode::Tracepoint if !self.follow_32bit => Some(
                "tracepoint mode: the syscalls:* tracepoints do not fire for 32-bit (compat) \
                 system calls, and following them elsewhere is turned off \
                 (probes.follow_32bit = false)",
            ),
            AttachMode::Tracepoint if !self.caps.compat_syscalls => Some(
                "tracepoint mode: the syscalls:* tracepoints do not fire for 32-bit (compat) \
                 system calls, and this kernel's 32-bit calls cannot be told apart where every \
                 system call passes (x86-64 with thread_info.status in BTF only)",
            ),
            AttachMode::Tracepoint => None,
        }
        .map(str::to_owned);
        if let Some(why) = &compat_unseen {
            self.unseen.insert(UNSEEN_COMPAT.to_owned(), why.clone());
        }
        // The route's links; where the raw route is to be taken, also those of the events'
        // route a daemon before took when the raw tracepoints would not attach.
        let preferred = self.mode == AttachMode::Tracepoint && compat_unseen.is_none();
        let routes: &[SyscallRoute] = if preferred {
            &[SyscallRoute::Raw, SyscallRoute::EventsRawFailed]
        } else {
            &[SyscallRoute::Events]
        };
        for &route in routes {
            self.route = route;
            if self.adopt()? {
                if route == SyscallRoute::EventsRawFailed {
                    self.unseen.insert(
                        UNSEEN_COMPAT.to_owned(),
                        "the raw sys_enter and sys_exit tracepoints did not attach when these \
                         probes were attached: ioctls are followed on the syscalls:* \
                         tracepoints, which skip 32-bit callers"
                            .to_owned(),
                    );
                }
                return Ok(());
            }
        }
        self.route = routes[0];
        // Anything else under links/ is another object or mode: detach it before attaching, so
        // no ioctl is counted twice.
        self.detach_all()?;
        match self.attach_all(kbtf, btf) {
            Err(Attach::RawSyscalls(e)) => {
                // The 64-bit ioctls are on that route too: take the events' instead.
                self.unseen.insert(
                    UNSEEN_COMPAT.to_owned(),
                    format!(
                        "the raw system-call tracepoints did not attach ({}): ioctls are followed \
                         on the syscalls:* tracepoints, which skip 32-bit callers",
                        Chain(&e)
                    ),
                );
                self.detach_all()?;
                self.route = SyscallRoute::EventsRawFailed;
                self.attach_all(kbtf, btf).map_err(Attach::into_error)
            }
            r => r.map_err(Attach::into_error),
        }
    }

    /// Adopts the links of this object, mode, tier and route where every required one is pinned.
    fn adopt(&mut self) -> Result<bool, ProbeError> {
        let dir = self.links_dir();
        let required_present = self
            .attachments()
            .iter()
            .filter(|a| !a.optional)
            .all(|a| PinnedLink::from_pin(dir.join(a.pin_name())).is_ok());
        if !required_present {
            return Ok(false);
        }
        info!(dir = %dir.display(), mode = self.mode.as_str(), "adopting attached probes");
        self.resumed = true;
        for a in self.attachments() {
            if a.is_compat() && PinnedLink::from_pin(dir.join(a.pin_name())).is_err() {
                self.unseen.insert(
                    UNSEEN_COMPAT.to_owned(),
                    format!(
                        "{} was not attached by the daemon that attached the probes",
                        a.pin_name()
                    ),
                );
            }
        }
        Ok(true)
    }

    /// Detaches every set of links under `links/` (their pins removed).
    fn detach_all(&self) -> Result<(), ProbeError> {
        let links_root = self.base_dir.join("links");
        for entry in std::fs::read_dir(&links_root)
            .map_err(io_err("read", &links_root))?
            .flatten()
        {
            let path = entry.path();
            info!(path = %path.display(), "detaching stale probes");
            std::fs::remove_dir_all(&path).map_err(io_err("remove", &path))?;
        }
        Ok(())
    }

    /// Attaches this mode's, tier's and route's programs, pinning their links.
    fn attach_all(&mut self, kbtf: &btf::KernelBtf, btf: &aya::Btf) -> Result<(), Attach> {
        let dir = self.links_dir();
        std::fs::create_dir_all(&dir).map_err(|e| Attach::Other(io_err("create", &dir)(e)))?;
        for a in self.attachments() {
            let func = match a.target {
                Target::Fentry(f) | Target::Fexit(f) | Target::ModifyReturn(f) => {
                    Some(f.to_owned())
                }
                Target::Lsm(h) => Some(format!("bpf_lsm_{h}")),
                _ => None,
            };
            // A kernel without the compat hook (before 6.8) runs 32-bit ioctls through the
            // native one; without the compat syscall it has no 32-bit callers: no gap either way.
            if let Some(f) = func
                && a.optional
                && !kbtf.has_function(&f)
            {
                continue;
            }
            let path = dir.join(a.pin_name());
            match self.attach_one(a, btf, &path) {
                Ok(()) => {
                    debug!(program = a.program_of(self.rewriting()), pin = %path.display(), "attached");
                }
                Err(e) if a.is_raw_syscall() => return Err(Attach::RawSyscalls(e)),
                Err(e) if a.is_compat() => {
                    self.unseen.insert(
                        UNSEEN_COMPAT.to_owned(),
                        format!("{} did not attach: {}", a.pin_name(), Chain(&e)),
                    );
                }
                Err(e) if a.optional => {
                    debug!(
                        program = a.program_of(self.rewriting()),
                        target = a.pin_name(),
                        "optional attach skipped: {}",
                        Chain(&e)
                    )
                }
                Err(e) => return Err(Attach::Other(e)),
            }
        }
        info!(mode = self.mode.as_str(), dir = %dir.display(), "probes attached");
        Ok(())
    }

    /// Attaches one program and pins its link at `path`.
    fn attach_one(
        &mut self,
        a: &Attachment,
        btf: &aya::Btf,
        path: &std::path::Path,
    ) -> Result<(), ProbeError> {
        let name = a.program_of(self.rewriting());
        if let Target::ModifyReturn(func) = a.target {
            let relocated = self
                .modify_return
                .as_ref()
                .ok_or(ProbeError::NoProgram(name))?;
            let prog = relocated.load(name, func, btf)?;
            let link = super::modify_return::attach(&prog, name, func)?;
            super::modify_return::pin(&link, path, name)?;
            return Ok(());
        }
        let link = self.attach_link(a, name, btf)?;
        link.pin(path).map_err(|source| ProbeError::Pin {
            path: path.to_owned(),
            source,
        })?;
        Ok(())
    }

    fn attach_link(
        &mut self,
        a: &Attachment,
        name: &'static str,
        btf: &aya::Btf,
    ) -> Result<FdLink, ProbeError> {
        let lerr = |source| ProbeError::LoadProgram { name, source };
        let aerr = |source| ProbeError::Attach {
            name,
            target: a.target.to_string(),
            source,
        };
        let prog = self
            .ebpf
            .program_mut(name)
            .ok_or(ProbeError::NoProgram(name))?;
        match a.target {
            Target::Fentry(func) => {
                let p: &mut FEntry = prog.try_into().map_err(aerr)?;
                // An fentry program is bound to its target at load time.
                if p.fd().is_err() {
                    p.load(func, btf).map_err(lerr)?;
                }
                let id = p.attach().map_err(aerr)?;
                Ok(p.take_link(id).map_err(aerr)?.into())
            }
            Target::Fexit(func) => {
                let p: &mut FExit = prog.try_into().map_err(aerr)?;
                if p.fd().is_err() {
                    p.load(func, btf).map_err(lerr)?;
                }
                let id = p.attach().map_err(aerr)?;
                Ok(p.take_link(id).map_err(aerr)?.into())
            }
            Target::Lsm(hook) => {
                let p: &mut Lsm = prog.try_into().map_err(aerr)?;
                if p.fd().is_err() {
                    p.load(hook, btf).map_err(lerr)?;
                }
                let id = p.attach().map_err(aerr)?;
                Ok(p.take_link(id).map_err(aerr)?.into())
            }
            Target::Tracepoint(cat, tp) => {
                let p: &mut TracePoint = prog.try_into().map_err(aerr)?;
                if p.fd().is_err() {
                    p.load().map_err(lerr)?;
                }
                let id = p.attach(cat, tp).map_err(aerr)?;
                let link = p.take_link(id).map_err(aerr)?;
                FdLink::try_from(link).map_err(|source| ProbeError::NotALink {
                    name,
                    target: a.target.to_string(),
                    source,
                })
            }
            Target::RawTracepoint(tp) => {
                let p: &mut RawTracePoint = prog.try_into().map_err(aerr)?;
                if p.fd().is_err() {
                    p.load().map_err(lerr)?;
                }
                let id = p.attach(tp).map_err(aerr)?;
                Ok(p.take_link(id).map_err(aerr)?.into())
            }
            Target::ModifyReturn(_) => Err(ProbeError::NoProgram(name)),
        }
    }
}
