//! The NVML backstop: memory the probes cannot size still shows in NVML's per-process used
//! memory (managed memory paged in by the UVM driver, RM-internal buffers, a memory class a newer
//! driver adds, a caller the probes do not see). A limited cgroup whose NVML figure (its
//! processes' and its descendants', on the limit's GPU, or on every GPU for `all`) stays above its
//! `memory_max` plus a margin for the contexts' own buffers for the rule's hold time is reported
//! once per episode, for the memory enforcement to apply the react action. Pure: the state task
//! feeds it NVML's samples and the limits in force.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use gpud_common::GPU_ALL;

use crate::nvml::ProcessSample;

/// When NVML's figure counts as over a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackstopRule {
    /// How long the figure must stay over before it is acted on; `None`: the backstop is off.
    pub hold: Option<Duration>,
    /// Bytes over `memory_max` that NVML's figure may show without being over (the contexts'
    /// own buffers, which the probes do not charge).
    pub margin: u64,
}

impl BackstopRule {
    /// From `[enforcement] nvml_backstop_secs` (0: off) and `nvml_backstop_margin_bytes`.
    pub fn of(secs: u64, margin: u64) -> Self {
        Self {
            hold: (secs > 0).then(|| Duration::from_secs(secs)),
            margin,
        }
    }

    /// The rule `[enforcement]` configures.
    pub fn configured(c: &crate::config::EnforcementConfig) -> Self {
        Self::of(c.nvml_backstop_secs, c.nvml_backstop_margin_bytes)
    }
}

/// A limited cgroup NVML shows over its limit for the hold time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Over {
    /// The limited cgroup (path relative to the cgroup v2 root).
    pub cgroup: String,
    /// The limit's GPU key (an index or `GPU_ALL`).
    pub gpu: u32,
    /// NVML's figure (bytes).
    pub usage: u64,
    pub max: u64,
    /// The processes holding that memory: (pid, its cgroup, bytes), largest first.
    pub holders: Vec<(u32, String, u64)>,
}

/// Episodes of NVML's figure over a limit, by (cgroup, GPU key).
#[derive(Debug)]
pub struct Backstop {
    rule: BackstopRule,
    /// Since when each limit has been over, for as long as it stays so.
    since: BTreeMap<(String, u32), Instant>,
    /// Limits acted on in their current episode (acted on once until back under).
    acted: BTreeSet<(String, u32)>,
}

impl Backstop {
    pub fn new(rule: BackstopRule) -> Self {
        Self {
            rule,
            since: BTreeMap::new(),
            acted: BTreeSet::new(),
        }
    }

    pub fn set_rule(&mut self, rule: BackstopRule) {
        self.rule = rule;
    }

    /// One NVML sample taken at `now` against the memory limits in force, (cgroup, GPU key,
    /// bytes): the limits over for the hold time and not yet acted on in this episode.
    pub fn observe(
        &mut self,
        now: Instant,
        limits: &[(String, u32, u64)],
        processes: &[ProcessSample],
    ) -> Vec<Over> {
        let Some(hold) = self.rule.hold else {
            self.since.clear();
            self.acted.clear();
            return Vec::new();
        };
        let mut over_now = BTreeSet::new();
        let mut out = Vec::new();
        for (cgroup, gpu, max) in limits {
            let mut holders: Vec<(u32, String, u64)> = processes
                .iter()
                .filter(|p| p.memory_bytes > 0 && (*gpu == GPU_ALL || p.gpu == *gpu))
                .filter(|p| within(&p.cgroup, cgroup))
                .map(|p| (p.pid, p.cgroup.clone(), p.memory_bytes))
                .collect();
            let usage: u64 = holders.iter().map(|(_, _, b)| *b).sum();
            if usage <= max.saturating_add(self.rule.margin) {
                continue;
            }
            let key = (cgroup.clone(), *gpu);
            over_now.insert(key.clone());
            let since = *self.since.entry(key.clone()).or_insert(now);
            if now.saturating_duration_since(since) >= hold && self.acted.insert(key) {
                holders.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
                out.push(Over {
                    cgroup: cgroup.clone(),
                    gpu: *gpu,
                    usage,
                    max: *max,
                    holders,
                });
            }
        }
        self.since.retain(|k, _| over_now.contains(k));
        self.acted.retain(|k| over_now.contains(k));
        out
    }
}

/// Whether cgroup `path` is `ancestor` or below it (an empty path: a process that is gone).
fn within(path: &str, ancestor: &str) -> bool {
    !path.is_empty()
        && (ancestor == "/"
            || path == ancestor
            || path
                .strip_prefix(ancestor)
                .is_some_and(|rest| rest.starts_with('/')))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32, gpu: u32, cgroup: &str, mib: u64) -> ProcessSample {
        ProcessSample {
            pid,
            gpu,
            cgroup: cgroup.into(),
            memory_bytes: mib << 20,
            sm_util: None,
            enc_util: None,
            dec_util: None,
            windows: Vec::new(),
        }
    }

    #[test]
    fn a_limit_over_for_the_hold_time_is_reported_once_per_episode() {
        let mut b = Backstop::new(BackstopRule::of(2, 16 << 20));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let limits = [("/pod".to_owned(), 0, 64 << 20)];
        // 40 + 30 MiB below /pod on GPU 0, 500 MiB on GPU 1 and 1 GiB elsewhere: 70 MiB, within
        // the margin.
        let mut procs = vec![
            p(1, 0, "/pod/a", 40),
            p(2, 0, "/pod/b", 30),
            p(3, 1, "/pod/a", 500),
            p(4, 0, "/podx", 1024),
        ];
        assert!(b.observe(at(0), &limits, &procs).is_empty());
        assert!(b.observe(at(5), &limits, &procs).is_empty());
        // 100 MiB: over from t=6, reported at t=8 (not at 7), once.
        procs[1].memory_bytes = 60 << 20;
        assert!(b.observe(at(6), &limits, &procs).is_empty());
        assert!(b.observe(at(7), &limits, &procs).is_empty());
        let over = b.observe(at(8), &limits, &procs);
        assert_eq!(over.len(), 1);
        assert_eq!(over[0].usage, 100 << 20);
        assert_eq!(
            over[0].holders.iter().map(|h| h.0).collect::<Vec<_>>(),
            [2, 1]
        );
        assert!(b.observe(at(9), &limits, &procs).is_empty());
        // Back under, then over again: a new episode with its own hold.
        procs[1].memory_bytes = 0;
        assert!(b.observe(at(10), &limits, &procs).is_empty());
        procs[1].memory_bytes = 60 << 20;
        assert!(b.observe(at(11), &limits, &procs).is_empty());
        assert_eq!(b.observe(at(13), &limits, &procs).len(), 1);
        // `all` counts every GPU; off means nothing is reported.
        let all = [("/pod".to_owned(), GPU_ALL, 64 << 20)];
        let mut b = Backstop::new(BackstopRule::of(1, 0));
        assert!(b.observe(at(0), &all, &procs).is_empty());
        let over = b.observe(at(1), &all, &procs);
        assert_eq!(over.first().map(|o| o.usage), Some(600 << 20));
        let mut off = Backstop::new(BackstopRule::of(0, 0));
        assert!(off.observe(at(0), &all, &procs).is_empty());
        assert!(off.observe(at(100), &all, &procs).is_empty());
    }

    #[test]
    fn below_means_the_cgroup_or_its_descendants() {
        assert!(within("/a", "/a"));
        assert!(within("/a/b", "/a"));
        assert!(!within("/ab", "/a"));
        assert!(within("/x", "/"));
        assert!(!within("", "/"));
    }
}
