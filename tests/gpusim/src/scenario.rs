//! Scenarios: tenants, their policies and the simulation's parameters, run for a while under a
//! controller; and what the benchmark reports from the ground truth: each tenant's achieved
//! share over a steady-state window, how long shares take to settle after a tenant starts or
//! stops, request latency percentiles, and how much of the time a latency-critical tenant
//! leaves idle a best-effort one gets.

use crate::{
    Nanos,
    control::Controller,
    sim::{Sim, SimParams, Trace},
    tenant::TenantSpec,
};

/// A run to make.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub params: SimParams,
    pub tenants: Vec<TenantSpec>,
    /// Virtual time it runs.
    pub duration: Nanos,
}

impl Scenario {
    pub fn new(name: &str, params: SimParams, tenants: Vec<TenantSpec>, duration: Nanos) -> Self {
        Self {
            name: name.to_owned(),
            params,
            tenants,
            duration,
        }
    }

    /// Runs it under `controller`.
    pub fn run(&self, controller: &mut dyn Controller) -> Outcome {
        let mut sim = Sim::new(self.params.clone(), self.tenants.clone());
        sim.run(controller, self.duration);
        Outcome {
            names: self.tenants.iter().map(|t| t.name.clone()).collect(),
            trace: sim.into_trace(),
        }
    }

    /// The same run with only the tenant `name` (for solo latencies).
    pub fn solo(&self, name: &str) -> Self {
        let mut s = self.clone();
        s.tenants.retain(|t| t.name == name);
        s.name = format!("{}/solo-{name}", self.name);
        s
    }
}

/// Latency percentiles of a tenant's requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Latency {
    pub count: usize,
    pub p50: Nanos,
    pub p99: Nanos,
}

/// What a run did.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub names: Vec<String>,
    pub trace: Trace,
}

impl Outcome {
    fn index(&self, name: &str) -> usize {
        self.names
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no tenant {name}"))
    }

    fn bin_of(&self, t: Nanos) -> usize {
        (t / self.trace.bin) as usize
    }

    fn busy_between(&self, tenant: usize, from: usize, to: usize) -> Nanos {
        let s = &self.trace.busy[tenant];
        let to = to.min(s.len() - 1);
        s[to] - s[from.min(to)]
    }

    /// Percent of the GPU's time the tenant's kernels ran over [from, to) (rounded to bins).
    pub fn share(&self, name: &str, from: Nanos, to: Nanos) -> f64 {
        let (a, b) = (self.bin_of(from), self.bin_of(to));
        let i = self.index(name);
        let b = b.min(self.trace.busy[i].len() - 1);
        if b <= a {
            return 0.0;
        }
        self.busy_between(i, a, b) as f64 * 100.0 / ((b - a) as Nanos * self.trace.bin) as f64
    }

    /// Percent of the time in [from, to) some kernel ran on GPU `gpu`.
    pub fn device_busy(&self, gpu: usize, from: Nanos, to: Nanos) -> f64 {
        let s = &self.trace.device_busy[gpu];
        let (a, b) = (self.bin_of(from), self.bin_of(to).min(s.len() - 1));
        if b <= a {
            return 0.0;
        }
        (s[b] - s[a]) as f64 * 100.0 / ((b - a) as Nanos * self.trace.bin) as f64
    }

    /// How long after `change` the tenant's share (percent), over every window of `window`
    /// starting then or later and ending by `until`, satisfies `ok`; `None` if it never does.
    pub fn settle_time(
        &self,
        name: &str,
        change: Nanos,
        until: Nanos,
        window: Nanos,
        ok: impl Fn(f64) -> bool,
    ) -> Option<Nanos> {
        let i = self.index(name);
        let w = (window / self.trace.bin).max(1) as usize;
        let (c, end) = (self.bin_of(change), self.bin_of(until));
        let end = end.min(self.trace.busy[i].len() - 1);
        if end < c + w {
            return None;
        }
        let good =
            |k: usize| {
                ok(self.busy_between(i, k, k + w) as f64 * 100.0
                    / (w as Nanos * self.trace.bin) as f64)
            };
        // The latest window out of bounds decides.
        let last_bad = (c..=end - w).rev().find(|&k| !good(k));
        match last_bad {
            None => Some(0),
            Some(k) if k < end - w => Some((k + 1 - c) as Nanos * self.trace.bin),
            Some(_) => None,
        }
    }

    /// Latency percentiles of the requests that arrived in [from, to).
    pub fn latency(&self, name: &str, from: Nanos, to: Nanos) -> Option<Latency> {
        let mut l: Vec<Nanos> = self.trace.latencies[self.index(name)]
            .iter()
            .filter(|(a, _)| (from..to).contains(a))
            .map(|&(_, l)| l)
            .collect();
        if l.is_empty() {
            return None;
        }
        l.sort_unstable();
        let pct = |p: f64| l[((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1];
        Some(Latency {
            count: l.len(),
            p50: pct(0.50),
            p99: pct(0.99),
        })
    }

    /// Percent of the time `lc` left the GPU idle (did not run) that `be` ran, over [from, to).
    pub fn idle_share(&self, be: &str, lc: &str, from: Nanos, to: Nanos) -> f64 {
        let (a, b) = (self.bin_of(from), self.bin_of(to));
        let span = (b.saturating_sub(a)) as Nanos * self.trace.bin;
        let lc_busy = self.busy_between(self.index(lc), a, b);
        let be_busy = self.busy_between(self.index(be), a, b);
        let idle = span.saturating_sub(lc_busy);
        if idle == 0 {
            return 0.0;
        }
        be_busy as f64 * 100.0 / idle as f64
    }
}
