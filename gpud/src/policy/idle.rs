//! The idle/hoarding rule: a cgroup that holds GPU memory on a GPU while its utilization there
//! stays under a threshold for longer than a minimum time keeps that GPU from others.
//!
//! The state task feeds [`IdleTracker::observe`] one observation per (cgroup, GPU) from every
//! NVML sample (memory from the probes or NVML, utilization from NVML) and forwards the
//! transitions it returns; the API lists [`IdleTracker::list`]. It is pure bookkeeping over the
//! times it is given, so it is tested without a clock.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant, SystemTime},
};

use crate::notice::IdleChange;

/// The rule (`[idle]` in the configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdleRule {
    /// Utilization (percent) under which a cgroup counts as idle.
    pub threshold_percent: u32,
    pub min_duration: Duration,
    pub min_memory_bytes: u64,
}

impl From<&crate::config::IdleConfig> for IdleRule {
    fn from(c: &crate::config::IdleConfig) -> Self {
        Self {
            threshold_percent: c.threshold_percent,
            min_duration: Duration::from_secs(c.min_duration_secs),
            min_memory_bytes: c.min_memory_bytes,
        }
    }
}

/// One cgroup on one GPU at one sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    pub cgroup: String,
    pub cgroup_id: u64,
    pub gpu: u32,
    /// GPU memory it holds there (bytes).
    pub memory_bytes: u64,
    /// Its SM utilization there (percent, summed over its processes).
    pub util: u32,
}

#[derive(Clone, Debug)]
struct Entry {
    cgroup_id: u64,
    memory_bytes: u64,
    util: u32,
    /// First sample of the current run under the threshold.
    below_since: Option<Instant>,
    /// Last sample at or above the threshold (wall clock, for reporting).
    last_active: Option<SystemTime>,
    /// Whether it has been reported idle (and not yet active again).
    reported: bool,
}

/// A cgroup reported idle on a GPU, as [`IdleTracker::list`] gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdleEntry {
    pub cgroup: String,
    /// cgroup v2 id (0 if unknown to the probes: NVML-only).
    pub cgroup_id: u64,
    pub gpu: u32,
    /// GPU memory it holds there at the last sample (bytes).
    pub memory_bytes: u64,
    /// Since the first sample that saw it under the threshold.
    pub idle_for: Duration,
    /// Last sample at or above the threshold; `None`: not since gpud started.
    pub last_active: Option<SystemTime>,
    /// SM utilization at the last sample (percent).
    pub util: u32,
}

/// Per (cgroup, GPU) idleness.
#[derive(Debug)]
pub struct IdleTracker {
    rule: IdleRule,
    entries: BTreeMap<(String, u32), Entry>,
}

impl IdleTracker {
    pub fn new(rule: IdleRule) -> Self {
        Self {
            rule,
            entries: BTreeMap::new(),
        }
    }

    /// Replaces the rule (a reload); what was observed so far is judged by the new one from the
    /// next sample on.
    pub fn set_rule(&mut self, rule: IdleRule) {
        self.rule = rule;
    }

    /// Takes one sample's observations (every cgroup holding memory on a GPU that NVML
    /// sampled); returns the transitions. A (cgroup, GPU) missing from `obs`, or holding less
    /// than the minimum memory, is forgotten (and reported active if it was reported idle).
    pub fn observe(
        &mut self,
        now: Instant,
        wall: SystemTime,
        obs: impl IntoIterator<Item = Observation>,
    ) -> Vec<IdleChange> {
        let mut changes = Vec::new();
        let mut seen = BTreeMap::new();
        for o in obs {
            if o.memory_bytes < self.rule.min_memory_bytes {
                continue;
            }
            let key = (o.cgroup.clone(), o.gpu);
            let e = self.entries.entry(key.clone()).or_insert(Entry {
                cgroup_id: o.cgroup_id,
                memory_bytes: 0,
                util: 0,
                below_since: None,
                last_active: None,
                reported: false,
            });
            e.cgroup_id = o.cgroup_id;
            e.memory_bytes = o.memory_bytes;
            e.util = o.util;
            if o.util >= self.rule.threshold_percent {
                let idle_secs = idle_secs(e, now);
                e.last_active = Some(wall);
                e.below_since = None;
                if std::mem::take(&mut e.reported) {
                    changes.push(change(&key, e.memory_bytes, false, idle_secs));
                }
            } else {
                let since = *e.below_since.get_or_insert(now);
                if !e.reported && now.saturating_duration_since(since) >= self.rule.min_duration {
                    e.reported = true;
                    changes.push(change(&key, e.memory_bytes, true, idle_secs(e, now)));
                }
            }
            seen.insert(key, ());
        }
        self.entries.retain(|key, e| {
            let keep = seen.contains_key(key);
            if !keep && e.reported {
                changes.push(change(key, 0, false, idle_secs(e, now)));
            }
            keep
        });
        changes
    }

    /// Forgets everything (NVML went away: utilization is unknown), reporting the cgroups that
    /// were idle as no longer so.
    pub fn reset(&mut self, now: Instant) -> Vec<IdleChange> {
        self.observe(now, SystemTime::now(), std::iter::empty())
    }

    /// The cgroups idle for at least the minimum time, longest first.
    pub fn list(&self, now: Instant) -> Vec<IdleEntry> {
        let mut out: Vec<IdleEntry> = self
            .entries
            .iter()
            .filter(|(_, e)| e.reported)
            .map(|((cgroup, gpu), e)| IdleEntry {
                cgroup: cgroup.clone(),
                cgroup_id: e.cgroup_id,
                gpu: *gpu,
                memory_bytes: e.memory_bytes,
                idle_for: idle_for(e, now),
                last_active: e.last_active,
                util: e.util,
            })
            .collect();
        out.sort_by(|a, b| {
            b.idle_for
                .cmp(&a.idle_for)
                .then_with(|| a.cgroup.cmp(&b.cgroup))
        });
        out
    }
}

/// How long `e` has been under the threshold at `now`.
fn idle_for(e: &Entry, now: Instant) -> Duration {
    e.below_since
        .map_or(Duration::ZERO, |s| now.saturating_duration_since(s))
}

fn idle_secs(e: &Entry, now: Instant) -> u64 {
    idle_for(e, now).as_secs()
}

fn change(key: &(String, u32), memory_bytes: u64, idle: bool, idle_secs: u64) -> IdleChange {
    IdleChange {
        cgroup: key.0.clone(),
        gpu: key.1,
        idle,
        memory_bytes,
        idle_secs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> IdleRule {
        IdleRule {
            threshold_percent: 5,
            min_duration: Duration::from_secs(10),
            min_memory_bytes: 100,
        }
    }

    fn obs(cgroup: &str, memory_bytes: u64, util: u32) -> Observation {
        Observation {
            cgroup: cgroup.into(),
            cgroup_id: 7,
            gpu: 0,
            memory_bytes,
            util,
        }
    }

    #[test]
    fn reported_only_after_the_minimum_time_and_once() {
        let mut t = IdleTracker::new(rule());
        let t0 = Instant::now();
        let w = SystemTime::now();
        assert!(t.observe(t0, w, [obs("/a", 1000, 0)]).is_empty());
        let at = |s| t0 + Duration::from_secs(s);
        assert!(t.observe(at(9), w, [obs("/a", 1000, 4)]).is_empty());
        assert!(t.list(at(9)).is_empty());
        let ch = t.observe(at(10), w, [obs("/a", 1000, 0)]);
        assert_eq!(
            ch,
            vec![IdleChange {
                cgroup: "/a".into(),
                gpu: 0,
                idle: true,
                memory_bytes: 1000,
                idle_secs: 10
            }]
        );
        assert!(t.observe(at(20), w, [obs("/a", 1000, 0)]).is_empty());
        let l = t.list(at(20));
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].idle_for.as_secs(), 20);
        assert_eq!(l[0].last_active, None, "never seen active");
    }

    #[test]
    fn activity_ends_idleness_and_restarts_the_clock() {
        let mut t = IdleTracker::new(rule());
        let t0 = Instant::now();
        let w = SystemTime::now();
        let at = |s| t0 + Duration::from_secs(s);
        t.observe(t0, w, [obs("/a", 1000, 0)]);
        assert_eq!(t.observe(at(10), w, [obs("/a", 1000, 0)]).len(), 1);
        let ch = t.observe(at(11), w, [obs("/a", 1000, 50)]);
        assert_eq!(ch.len(), 1);
        assert!(!ch[0].idle);
        assert_eq!(ch[0].idle_secs, 11);
        assert!(t.list(at(11)).is_empty());
        assert!(t.observe(at(12), w, [obs("/a", 1000, 0)]).is_empty());
        assert!(t.observe(at(21), w, [obs("/a", 1000, 0)]).is_empty());
        assert_eq!(t.observe(at(22), w, [obs("/a", 1000, 0)]).len(), 1);
        assert!(t.list(at(22))[0].last_active.is_some());
    }

    #[test]
    fn busy_small_or_vanished_cgroups_are_not_idle() {
        let mut t = IdleTracker::new(rule());
        let t0 = Instant::now();
        let w = SystemTime::now();
        let at = |s| t0 + Duration::from_secs(s);
        for s in 0..=30 {
            t.observe(at(s), w, [obs("/busy", 1000, 90), obs("/small", 99, 0)]);
        }
        assert!(t.list(at(30)).is_empty());
        t.observe(at(0), w, [obs("/a", 1000, 0)]);
        assert_eq!(t.observe(at(10), w, [obs("/a", 1000, 0)]).len(), 1);
        // Memory released: no longer hoarding.
        let ch = t.observe(at(11), w, []);
        assert_eq!(ch.len(), 1);
        assert!(!ch[0].idle);
        assert_eq!(ch[0].memory_bytes, 0);
        assert!(t.list(at(11)).is_empty());
    }
}
