//! The compute-share benchmark on the simulated GPU (`cargo xtask bench compute`): the matrix of
//! policies × kernel durations × queue depths × firmware modes ([`MODES`]: every control
//! honored, the H200's, none), the latency-critical /
//! best-effort pair, and the H100 reproduction; each case run under a controller and judged
//! against its targets (±3 points; LC p99 ≤ 1.10 × solo; BE ≥ 80 % of the time LC leaves idle).
//! This module owns the matrix, the judging and the output (a table, or one JSON object per
//! line); whether targets are met does not change the exit status.//!
//! Here: the targets, the controllers, and the types of cases and results; `cases` owns the
//! matrix, `judge` the running and judging, `output` the output.

use gpud::enforcement::compute::law::LawParams;

use crate::{
    MS, Nanos, SEC, US,
    control::{Controller, NoControl},
    engine::Firmware,
    law::LawController,
    old::OldController,
    scenario::Scenario,
    tenant::Workload,
};

pub use cases::{H100_RUN, H100_SEEDS, cases, h100_cases, lc_be_case, policy_cases, shapes};
pub use judge::{run_all, run_case};
pub use output::{table, to_json};

mod cases;
mod judge;
mod output;

/// Shares must land within this many points of their targets.
pub const TOLERANCE: f64 = 3.0;
/// ... within this long after a neighbour starts or stops.
pub const SETTLE_LIMIT: Nanos = 2 * SEC;
/// LC p99 at most this times its solo p99.
pub const LC_P99_RATIO: f64 = 1.10;
/// BE gets at least this percent of the time LC leaves idle.
pub const BE_IDLE_PCT: f64 = 80.0;
/// A weighted tenant alone gets at least this percent.
pub const ALONE_PCT: f64 = 95.0;
/// Shares are judged over windows this long when settling: a steady share keeps every such
/// window within bounds, not only its mean over the run.
const SETTLE_WINDOW: Nanos = SEC;
/// ... and in the freezer fallback, whose slots must outlast the freezer's thaw latency and the
/// tenants' queued work: its cycles last up to 1.6 s, so its shares hold over a few cycles.
const FALLBACK_WINDOW: Nanos = 5 * SEC;

/// The controllers the benchmark knows, by name.
pub const CONTROLLERS: &[&str] = &["law", "old", "none"];

/// A fresh controller by name (`law`: gpud's; `old`: the controller it replaced, period 100 ms;
/// `none`: no control).
pub fn controller(name: &str) -> Option<Box<dyn Controller>> {
    match name {
        "law" => Some(Box::new(LawController::new(LawParams::default()))),
        "old" => Some(Box::new(OldController::new(100 * MS))),
        "none" => Some(Box::new(NoControl)),
        _ => None,
    }
}

/// A submitter's shape in the matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    pub kernel: Nanos,
    pub depth: usize,
}

impl Shape {
    pub fn label(&self) -> String {
        let k = if self.kernel >= MS {
            format!("{}ms", self.kernel / MS)
        } else {
            format!("{}us", self.kernel / US)
        };
        format!("k{k}-d{}", self.depth)
    }

    fn workload(&self) -> Workload {
        Workload::Saturating {
            kernel: self.kernel,
            depth: self.depth,
        }
    }
}

/// How an achieved share is judged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// Within [`TOLERANCE`] points of the target.
    Within,
    /// At least the target.
    AtLeast,
}

impl Rule {
    fn holds(self, target: f64, achieved: f64) -> bool {
        match self {
            Self::Within => (achieved - target).abs() <= TOLERANCE,
            Self::AtLeast => achieved >= target,
        }
    }
}

/// A share to check: the tenant's over [from, to), and how soon after `settle_from` every
/// [`SETTLE_WINDOW`] of it (up to `to`) obeys the rule: within `settle_limit`.
#[derive(Clone, Debug, PartialEq)]
pub struct ShareCheck {
    /// Reported name (the tenant's, or the tenant's with a phase).
    pub label: String,
    pub tenant: String,
    pub target: f64,
    pub rule: Rule,
    pub from: Nanos,
    pub to: Nanos,
    pub settle_from: Nanos,
    pub settle_limit: Nanos,
}

/// One benchmark case.
#[derive(Clone, Debug)]
pub struct Case {
    pub scenario: Scenario,
    pub mode: Firmware,
    pub shares: Vec<ShareCheck>,
    /// (LC tenant, BE tenant, from, to).
    pub lc_be: Option<(String, String, Nanos, Nanos)>,
    /// Only reported: not judged (the H100 reproduction).
    pub report_only: bool,
    /// Outside what the freezer fallback can hold (docs/design.md, "Compute shares"): no
    /// control the firmware honors stops queued work, and a tenant keeps a period's worth of work or more queued
    /// (no controller outside the process stops work it cannot see), or priority classes are
    /// asked of it (nothing outside the process sees a latency-critical request arrive). Judged
    /// and reported like the others, counted apart.
    pub beyond_bound: bool,
    /// Runs with seeds 1..=seeds (and the daemon's sampling phase moved with each): shares
    /// are their mean, settling their worst.
    pub seeds: u64,
}

/// One tenant's (or phase's) figures in a case.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantResult {
    pub name: String,
    /// The policy's target.
    pub target: f64,
    /// What it is judged against: the target scaled by what the tenant uses alone (contended
    /// shares), else the target.
    pub judged: f64,
    pub achieved: f64,
    pub rule: Rule,
    /// Time to settle (ms), `None` if it never did; absent where not judged.
    pub settle_ms: Option<Option<u64>>,
}

/// What a case came to.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseResult {
    pub scenario: String,
    pub mode: Firmware,
    pub tenants: Vec<TenantResult>,
    pub lc_p99_ratio: Option<f64>,
    /// LC's p50, p99 and solo p99 latencies (ms).
    pub lc_ms: Option<(f64, f64, f64)>,
    pub be_idle_pct: Option<f64>,
    pub beyond_bound: bool,
    pub pass: Option<bool>,
}

/// The firmware modes of the matrix: every control honored; as measured on the H200
/// (`FIFO_DISABLE_CHANNELS` and timeslices honored, `GPFIFO_SCHEDULE` and `PREEMPT` ignored);
/// none honored (the freezer fallback).
pub const MODES: [Firmware; 3] = [Firmware::Honors, Firmware::H200, Firmware::Ignores];

/// Whether shares can be made in hardware in `mode` (some control stops queued work), and so
/// are judged as the hardware mode's: every 1 s window settled, no bound on queued work.
pub fn hardware(mode: Firmware) -> bool {
    mode.stops_queued_work()
}
