//! The live modes of the probes: the scheduler guard's state and the in-container memory
//! view's, as probed at start and changed by a reload.

use super::*;

/// The scheduler guard: its mode and the means this kernel gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardState {
    pub mode: GuardMode,
    /// A pre-driver hook runs (the `deny` tier): a call can be refused with `EPERM`.
    pub deny: bool,
    /// Why the entry programs cannot rewrite a call (`bpf_probe_write_user` refused); `None`
    /// where they can.
    pub no_rewrite: Option<String>,
    /// `[enforcement] guard_react_action = "kill"`: where no hook can refuse a forbidden
    /// control or a foreign disable, its caller is killed.
    pub kill: bool,
}

impl GuardState {
    /// As reported on D-Bus and by `gpudctl status`: `off`, `audit`, `enforce (deny, rewrite)`,
    /// `enforce (rewrite)`, `enforce (deny only: <why>)` or `unenforced: <why>`.
    pub fn describe(&self) -> String {
        match (self.mode, self.deny, &self.no_rewrite) {
            (GuardMode::Off, ..) => "off".to_owned(),
            (GuardMode::Audit, ..) => "audit".to_owned(),
            (GuardMode::Enforce, true, None) => "enforce (deny, rewrite)".to_owned(),
            (GuardMode::Enforce, false, None) => "enforce (rewrite)".to_owned(),
            (GuardMode::Enforce, true, Some(why)) => format!(
                "enforce (deny only; timeslices are refused above {} µs, not lowered: {why})",
                gpud_common::rm::sched::CUDA_TIMESLICE_US
            ),
            (GuardMode::Enforce, false, Some(why)) => format!(
                "enforce (react and restore: a timeslice is set back and a neighbour's channels \
                 enabled again after the call, a foreign disable's caller {}; no pre-driver hook, \
                 and {why})",
                if self.kill { "killed" } else { "reported" }
            ),
        }
    }

    /// Whether this kernel lets the guard only react: no hook refuses a call and no rewrite
    /// changes it, so in `enforce` calls go through and are undone after.
    pub fn reacts(&self) -> bool {
        !self.deny && self.no_rewrite.is_some()
    }

    pub(super) fn flags(mode: GuardMode) -> u32 {
        match mode {
            GuardMode::Off => 0,
            GuardMode::Audit => gpud_common::CFG_SCHED_GUARD,
            GuardMode::Enforce => gpud_common::CFG_SCHED_GUARD | gpud_common::CFG_SCHED_ENFORCE,
        }
    }
}

/// The in-container memory view (limited cgroups read their limit as the GPU's memory size).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryInfoState {
    On,
    /// Off by configuration; the rewriting programs are attached, so it can be turned on live.
    Off,
    /// The kernel refuses `bpf_probe_write_user`; why.
    Unavailable(String),
}

impl MemoryInfoState {
    /// `on`, `off` or `unavailable: <why>`, as reported on D-Bus and by `gpudctl status`.
    pub fn describe(&self) -> String {
        match self {
            Self::On => "on".to_owned(),
            Self::Off => "off".to_owned(),
            Self::Unavailable(why) => format!("unavailable: {why}"),
        }
    }
}
