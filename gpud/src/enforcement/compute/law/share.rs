//! What the law shares out and reports, with no state of its own: each cgroup's target on a
//! GPU from demands and policies ([`targets`]), and what the controller did per cgroup
//! ([`ComputeStat`]).

use serde::{Deserialize, Serialize};

use crate::policy::{DEFAULT_WEIGHT, Limits, Priority};

/// Utilization (percent) under which a cgroup counts as idle on a GPU.
const ACTIVE_UTIL: f64 = 3.0;

/// Per cgroup, what the controller does and has done (like `cpu.stat`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ComputeStat {
    /// Share of each period the cgroup may run (percent).
    pub duty: f64,
    /// Target utilization (percent of one GPU), summed over its GPUs.
    pub target: f64,
    /// Measured utilization in the last sample (percent), summed over its GPUs.
    pub measured: f64,
    /// Time spent frozen by the controller.
    pub throttled_usec: u64,
    /// Periods in which it was frozen at all.
    pub nr_throttled: u64,
}

/// The target utilization of each cgroup on one GPU (percent), from demands and policies.
///
/// Work-conserving weighted shares of the GPU's 100 %, each capped by `compute_max` and by what
/// the cgroup asks for; `compute_min` is then honoured by taking from the others; an active
/// latency-critical cgroup leaves best-effort cgroups nothing.
pub fn targets(cgroups: &[(f64, &Limits)]) -> Vec<f64> {
    let n = cgroups.len();
    let lc_active = cgroups
        .iter()
        .any(|(d, l)| *d >= ACTIVE_UTIL && l.priority == Some(Priority::LatencyCritical));
    let cap = |i: usize| {
        let (d, l) = cgroups[i];
        let max = l.compute_max.map_or(100.0, f64::from);
        if lc_active && l.priority == Some(Priority::BestEffort) {
            0.0
        } else {
            d.min(max)
        }
    };
    let weight = |i: usize| f64::from(cgroups[i].1.compute_weight.unwrap_or(DEFAULT_WEIGHT));
    // Water-filling: whoever needs less than its weighted share gets its need; the rest is shared
    // by weight among the others.
    let mut target = vec![0.0; n];
    let mut open: Vec<usize> = (0..n).collect();
    let mut remaining = 100.0f64;
    loop {
        let total_w: f64 = open.iter().map(|&i| weight(i)).sum();
        if open.is_empty() || total_w <= 0.0 {
            break;
        }
        let satisfied: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| cap(i) <= remaining * weight(i) / total_w)
            .collect();
        if satisfied.is_empty() {
            for &i in &open {
                target[i] = remaining * weight(i) / total_w;
            }
            break;
        }
        for &i in &satisfied {
            target[i] = cap(i);
            remaining -= cap(i);
        }
        open.retain(|i| !satisfied.contains(i));
    }
    // Guarantees: raise to min(compute_min, demand), taking from those above their own floor.
    for i in 0..n {
        let (d, l) = cgroups[i];
        let Some(min) = l.compute_min else { continue };
        let need = f64::from(min).min(d).min(cap(i).max(f64::from(min).min(d)));
        if target[i] >= need {
            continue;
        }
        let mut deficit = need - target[i];
        target[i] = need;
        let floor = |j: usize| f64::from(cgroups[j].1.compute_min.unwrap_or(0)).min(cgroups[j].0);
        let spare: f64 = (0..n)
            .filter(|&j| j != i)
            .map(|j| (target[j] - floor(j)).max(0.0))
            .sum();
        if spare <= 0.0 {
            continue;
        }
        for j in (0..n).filter(|&j| j != i) {
            let give = (target[j] - floor(j)).max(0.0) / spare * deficit.min(spare);
            target[j] -= give;
        }
        deficit -= deficit.min(spare);
        let _ = deficit;
    }
    target
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(max: Option<u32>, w: Option<u32>, min: Option<u32>, p: Option<Priority>) -> Limits {
        Limits {
            compute_max: max,
            compute_weight: w,
            compute_min: min,
            priority: p,
            ..Limits::default()
        }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 0.01)
    }

    #[test]
    fn shares() {
        let none = l(None, None, None, None);
        // A cap binds even alone.
        let capped = l(Some(30), None, None, None);
        assert!(close(&targets(&[(100.0, &capped)]), &[30.0]));
        // Weights 1:3 under contention; work-conserving when one is idle.
        let (w1, w3) = (l(None, Some(1), None, None), l(None, Some(3), None, None));
        assert!(close(
            &targets(&[(100.0, &w1), (100.0, &w3)]),
            &[25.0, 75.0]
        ));
        assert!(close(&targets(&[(100.0, &w1), (0.0, &w3)]), &[100.0, 0.0]));
        // Someone needing less than its share leaves the rest to the others.
        assert!(close(
            &targets(&[(10.0, &none), (100.0, &none), (100.0, &none)]),
            &[10.0, 45.0, 45.0]
        ));
        // A guarantee is taken from the others.
        let min60 = l(None, None, Some(60), None);
        assert!(close(
            &targets(&[(100.0, &min60), (100.0, &none)]),
            &[60.0, 40.0]
        ));
        // ... but never more than the guaranteed one asks for.
        assert!(close(
            &targets(&[(20.0, &min60), (100.0, &none)]),
            &[20.0, 80.0]
        ));
        // An active latency-critical cgroup leaves best-effort nothing; idle, it leaves it all.
        let lc = l(None, None, None, Some(Priority::LatencyCritical));
        let be = l(None, None, None, Some(Priority::BestEffort));
        assert!(close(&targets(&[(50.0, &lc), (100.0, &be)]), &[50.0, 0.0]));
        assert!(close(&targets(&[(0.0, &lc), (100.0, &be)]), &[0.0, 100.0]));
    }
}
