//! The scheduler guard's daemon side: each cgroup's timeslice allowance, derived from its policy
//! and written to the kernel's `SCHED_ALLOW` map, and the reports of what the kernel side did
//! (a rate-limited log line, counters by cgroup, control and action, and a notice for the D-Bus
//! `SchedulerControlGuarded` signal). Owned by the state task. The decisions themselves are the
//! kernel's (gpud-ebpf `guard`); the guarded controls are `gpud_common::rm::sched::CONTROLS`.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use gpud_common::{
    EVENT_SCHED_GUARD, Event, GUARD_AUDITED, GUARD_CLAMPED, GUARD_DENIED, GUARD_KILLED,
    GUARD_REASON_FLAGS, GUARD_REASON_FORBIDDEN, GUARD_REASON_FOREIGN, GUARD_REASON_HELD,
    GUARD_REASON_LEGACY, GUARD_REASON_TIMESLICE, GUARD_REFUSED, GUARD_RESTORED, GUARD_UNENFORCED,
    rm::sched,
};
use tracing::{error, warn};

use super::compute::law::LawParams;
use crate::{
    attribution::Attribution,
    policy::{Limits, Priority},
    report::Chain,
};

/// At most one log line per (cgroup, control) in this long; the lines skipped are counted in
/// the next one.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The longest timeslice (µs) a tenant of this priority class may set: what the compute law
/// sets for the class where it issues timeslices itself (latency-critical the longest,
/// best-effort the shortest, others what CUDA sets at context creation).
pub fn allowance(priority: Option<Priority>) -> u64 {
    let p = LawParams::default();
    match priority {
        Some(Priority::LatencyCritical) => p.max_timeslice_us,
        Some(Priority::BestEffort) => p.min_timeslice_us,
        Some(Priority::Normal) | None => p.base_timeslice_us,
    }
}

/// One report of the kernel side, for the D-Bus signal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardNotice {
    /// The caller's cgroup (path, or `#<id>` once gone).
    pub cgroup: String,
    pub pid: u32,
    /// The control's driver name (`SET_TIMESLICE`, `FIFO_DISABLE_CHANNELS`, ...).
    pub control: String,
    /// `denied`, `refused` (rewritten to fail or to do nothing), `clamped`, `restored` (let
    /// through and undone after), `killed` (its caller killed, what it did undone), `audited` or
    /// `unenforced`.
    pub action: String,
    /// `forbidden`, `timeslice`, `foreign-client`, `legacy-path`, `flags` or `held-off`.
    pub reason: String,
    /// The timeslice asked (µs), or the foreign client named (0 otherwise).
    pub requested: u64,
    /// The caller's timeslice allowance (µs; 0 where none is involved).
    pub allowed: u64,
}

/// Calls acted on, by (cgroup, control, action).
pub type GuardCounts = BTreeMap<(String, String, String), u64>;

fn action_name(a: u32) -> &'static str {
    match a {
        GUARD_DENIED => "denied",
        GUARD_REFUSED => "refused",
        GUARD_CLAMPED => "clamped",
        GUARD_AUDITED => "audited",
        GUARD_UNENFORCED => "unenforced",
        GUARD_RESTORED => "restored",
        GUARD_KILLED => "killed",
        _ => "unknown",
    }
}

fn reason_name(r: u32) -> &'static str {
    match r {
        GUARD_REASON_FORBIDDEN => "forbidden",
        GUARD_REASON_TIMESLICE => "timeslice",
        GUARD_REASON_FOREIGN => "foreign-client",
        GUARD_REASON_LEGACY => "legacy-path",
        GUARD_REASON_FLAGS => "flags",
        GUARD_REASON_HELD => "held-off",
        _ => "unknown",
    }
}

/// The control's name, or its number for one outside the table.
pub fn control_name(cmd: u32) -> String {
    match sched::control(cmd) {
        Some(c) if cmd & sched::LEGACY_BIT != 0 => format!("{}(legacy {cmd:#x})", c.name),
        Some(c) => c.name.to_owned(),
        None => format!("{cmd:#010x}"),
    }
}

#[derive(Default)]
pub struct SchedulerGuard {
    /// Per (cgroup, control): when a line was last logged (never: `None`), and the lines
    /// skipped since.
    logged: HashMap<(String, String), (Option<Instant>, u64)>,
}

impl SchedulerGuard {
    /// Makes the kernel's allowances exactly those of `policies` (cgroup path → limits): the
    /// least of a cgroup's entries (one per GPU selector) where any names a priority class other
    /// than the default's. Called after every change of the stored policies.
    pub fn sync_allowances<'a>(
        &self,
        attr: &mut Attribution,
        policies: impl IntoIterator<Item = (&'a str, &'a Limits)>,
    ) {
        let default = allowance(None);
        let mut want: BTreeMap<u64, u64> = BTreeMap::new();
        for (path, limits) in policies {
            let us = allowance(limits.priority);
            if us == default {
                continue;
            }
            // A cgroup that is gone has no tenants to allow anything.
            if let Ok((_, id)) = attr.id_of(path) {
                let slot = want.entry(id).or_insert(us);
                *slot = (*slot).min(us);
            }
        }
        let have = attr.sched_allowances();
        let apply = |attr: &mut Attribution, id: u64, us: Option<u64>| {
            if let Err(e) = attr.set_sched_allowance(id, us) {
                error!(
                    cgroup_id = id,
                    "cannot set the timeslice allowance: {}",
                    Chain(&e)
                );
            }
        };
        for (&id, &us) in &want {
            if have.get(&id) != Some(&us) {
                apply(attr, id, Some(us));
            }
        }
        for id in have.keys().filter(|id| !want.contains_key(id)) {
            apply(attr, *id, None);
        }
    }

    /// A kernel event: logged (rate-limited) and returned as a notice; `None` for other events.
    /// (The kernel counts every call itself, events or not: [`Self::counts`].)
    pub fn on_event(&mut self, attr: &mut Attribution, ev: &Event) -> Option<GuardNotice> {
        if ev.kind != EVENT_SCHED_GUARD {
            return None;
        }
        let cgroup = attr
            .path_of(ev.cgroup_id)
            .unwrap_or_else(|| format!("#{}", ev.cgroup_id));
        let control = control_name(ev.object);
        let (action, reason) = (action_name(ev.gpu & 0xff), reason_name(ev.gpu >> 8));
        let now = Instant::now();
        let slot = self
            .logged
            .entry((cgroup.clone(), control.clone()))
            .or_insert((None, 0));
        if slot.0.is_none_or(|at| now.duration_since(at) >= LOG_EVERY) {
            warn!(
                cgroup = %cgroup, pid = ev.tgid, control = %control, action, reason,
                requested = ev.value, allowed = ev.bytes, client = format_args!("{:#x}", ev.client),
                skipped = slot.1,
                "scheduling control of a tenant {action}"
            );
            *slot = (Some(now), 0);
        } else {
            slot.1 += 1;
        }
        Some(GuardNotice {
            cgroup,
            pid: ev.tgid,
            control,
            action: action.to_owned(),
            reason: reason.to_owned(),
            requested: ev.value,
            allowed: ev.bytes,
        })
    }

    /// Calls acted on so far, by (cgroup, control, action), from the kernel's counts.
    pub fn counts(&self, attr: &mut Attribution) -> GuardCounts {
        let mut out = GuardCounts::new();
        for (k, n) in attr.guard_counts() {
            let cgroup = attr
                .path_of(k.cgroup_id)
                .unwrap_or_else(|| format!("#{}", k.cgroup_id));
            let key = (
                cgroup,
                control_name(k.cmd),
                action_name(k.verdict & 0xff).to_owned(),
            );
            *out.entry(key).or_default() += n;
        }
        out
    }

    /// Forgets the counts and log slots of cgroups that were removed.
    pub fn sweep(&mut self, attr: &mut Attribution) {
        let dead: Vec<_> = attr
            .guard_counts()
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| attr.path_of(k.cgroup_id).is_none())
            .collect();
        attr.forget_guard_counts(&dead);
        self.logged
            .retain(|(cg, _), _| !cg.starts_with('#') && attr.id_of(cg).is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowances_follow_the_laws_timeslices_and_names_the_drivers() {
        let p = LawParams::default();
        assert_eq!(allowance(None), sched::CUDA_TIMESLICE_US);
        assert_eq!(allowance(Some(Priority::Normal)), p.base_timeslice_us);
        assert_eq!(
            allowance(Some(Priority::LatencyCritical)),
            p.max_timeslice_us
        );
        assert_eq!(allowance(Some(Priority::BestEffort)), p.min_timeslice_us);
        assert_eq!(control_name(0xa06c_0103), "SET_TIMESLICE");
        assert_eq!(
            control_name(0xa06c_8103),
            "SET_TIMESLICE(legacy 0xa06c8103)"
        );
        assert_eq!(control_name(0x2080_110b), "FIFO_DISABLE_CHANNELS");
        assert_eq!(control_name(0x1234_5678), "0x12345678");
        assert_eq!(
            (
                action_name(GUARD_CLAMPED),
                reason_name(GUARD_REASON_FOREIGN)
            ),
            ("clamped", "foreign-client")
        );
    }
}
