//! The scheduler guard's daemon side: each cgroup's timeslice allowance, derived from its policy
//! and written to the kernel's `SCHED_ALLOW` map, and the reports of what the kernel side did
//! (counters by cgroup, control and action, and a notice for the `SchedulerControlGuarded`
//! signal and the log). Owned by the state task. The decisions themselves are the
//! kernel's (gpud-ebpf `guard`); the guarded controls are `gpud_common::rm::sched::CONTROLS`.

use std::collections::BTreeMap;

use tracing::error;

use super::compute::law::LawParams;
use crate::{
    attribution::Attribution,
    notice::{GuardNotice, GuardedControl},
    policy::{Limits, Priority},
    probes::{
        KernelSettings,
        events::{GuardEvent, split_verdict},
    },
    report::Chain,
};

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

/// Calls acted on, by (cgroup, control, action).
pub type GuardCounts = BTreeMap<(String, String, String), u64>;

/// Makes the kernel's allowances exactly those of `policies` (cgroup path → limits): the
/// least of a cgroup's entries (one per GPU selector) where any names a priority class other
/// than the default's. Called after every change of the stored policies.
pub fn sync_allowances<'a>(
    attr: &mut Attribution,
    settings: &mut KernelSettings,
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
    let have = settings.sched_allowances();
    let mut apply = |id: u64, us: Option<u64>| {
        if let Err(e) = settings.set_sched_allowance(id, us) {
            error!(
                cgroup_id = id,
                "cannot set the timeslice allowance: {}",
                Chain(&e)
            );
        }
    };
    for (&id, &us) in &want {
        if have.get(&id) != Some(&us) {
            apply(id, Some(us));
        }
    }
    for id in have.keys().filter(|id| !want.contains_key(id)) {
        apply(*id, None);
    }
}

/// A tenant's scheduling control the kernel side acted on: the notice to publish (the log
/// line is the log's, rate-limited there). The kernel counts every call itself, events or
/// not: [`counts`].
pub fn on_event(attr: &mut Attribution, ev: &GuardEvent) -> GuardNotice {
    GuardNotice {
        cgroup: attr
            .path_of(ev.cgroup_id)
            .unwrap_or_else(|| format!("#{}", ev.cgroup_id)),
        pid: ev.pid,
        control: GuardedControl(ev.command),
        action: ev.action,
        reason: ev.reason,
        requested: ev.requested,
        allowed: ev.allowance,
        client: ev.client,
    }
}

/// Calls acted on so far, by (cgroup, control, action), from the kernel's counts.
pub fn counts(attr: &mut Attribution, settings: &KernelSettings) -> GuardCounts {
    let mut out = GuardCounts::new();
    for (k, n) in settings.guard_counts() {
        let cgroup = attr
            .path_of(k.cgroup_id)
            .unwrap_or_else(|| format!("#{}", k.cgroup_id));
        let action = split_verdict(k.verdict).map_or("unknown", |(a, _)| a.as_str());
        let key = (cgroup, GuardedControl(k.cmd).to_string(), action.to_owned());
        *out.entry(key).or_default() += n;
    }
    out
}

/// Forgets the counts of cgroups that were removed.
pub fn sweep(attr: &mut Attribution, settings: &mut KernelSettings) {
    let dead: Vec<_> = settings
        .guard_counts()
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| attr.path_of(k.cgroup_id).is_none())
        .collect();
    settings.forget_guard_counts(&dead);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpud_common::rm::sched;

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
        assert_eq!(GuardedControl(0xa06c_0103).to_string(), "SET_TIMESLICE");
        assert_eq!(
            GuardedControl(0xa06c_8103).to_string(),
            "SET_TIMESLICE(legacy 0xa06c8103)"
        );
        assert_eq!(
            GuardedControl(0x2080_110b).to_string(),
            "FIFO_DISABLE_CHANNELS"
        );
        assert_eq!(GuardedControl(0x1234_5678).to_string(), "0x12345678");
    }
}
