//! The compute-share benchmark on the simulated GPU (`cargo xtask bench compute`): the matrix of
//! policies × kernel durations × queue depths × firmware modes ([`MODES`]: every control
//! honored, the H200's, none), the latency-critical /
//! best-effort pair, and the H100 reproduction; each case run under a controller and judged
//! against its targets (±3 points; LC p99 ≤ 1.10 × solo; BE ≥ 80 % of the time LC leaves idle).
//! This module owns the matrix, the judging and the output (a table, or one JSON object per
//! line); whether targets are met does not change the exit status.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{Mutex, atomic::AtomicUsize, atomic::Ordering},
};

use gpud::{
    enforcement::compute::law::LawParams,
    policy::{Limits, Priority},
};
use serde::Serialize;

use crate::{
    MS, Nanos, SEC, US,
    control::{Controller, NoControl},
    engine::Firmware,
    law::LawController,
    old::OldController,
    scenario::{Outcome, Scenario},
    sim::SimParams,
    tenant::{TenantSpec, Workload},
};

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

/// Kernel durations × queue depths of the full matrix.
pub fn shapes(quick: bool) -> Vec<Shape> {
    if quick {
        return vec![
            Shape {
                kernel: 50 * US,
                depth: 1024,
            },
            Shape {
                kernel: 2 * MS,
                depth: 64,
            },
            Shape {
                kernel: 20 * MS,
                depth: 1,
            },
        ];
    }
    let mut v = Vec::new();
    for kernel in [50 * US, 2 * MS, 20 * MS] {
        for depth in [1, 64, 1024] {
            v.push(Shape { kernel, depth });
        }
    }
    v
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

fn limits(max: Option<u32>, weight: Option<u32>, min: Option<u32>) -> Limits {
    Limits {
        compute_max: max,
        compute_weight: weight,
        compute_min: min,
        ..Limits::default()
    }
}

fn priority(p: Priority) -> Limits {
    Limits {
        priority: Some(p),
        ..Limits::default()
    }
}

fn params(mode: Firmware) -> SimParams {
    let mut p = SimParams::default();
    p.engine.firmware = mode;
    p
}

fn tenant(name: &str, i: u32, w: Workload, l: Limits) -> TenantSpec {
    TenantSpec::new(name, 1000 + i, w, l)
}

/// Length and number of the H100 reproduction runs (the old controller's shares wander).
pub const H100_RUN: Nanos = 60 * SEC;
pub const H100_SEEDS: u64 = 4;
/// Steady-state run length and the window shares are measured over.
const RUN: Nanos = 20 * SEC;
const MEASURE_FROM: Nanos = 5 * SEC;

fn steady(
    name: String,
    mode: Firmware,
    tenants: Vec<TenantSpec>,
    targets: &[(&str, f64, Rule)],
) -> Case {
    let shares = targets
        .iter()
        .map(|&(t, target, rule)| ShareCheck {
            label: t.to_owned(),
            tenant: t.to_owned(),
            target,
            rule,
            from: MEASURE_FROM,
            to: RUN,
            settle_from: 0,
            settle_limit: MEASURE_FROM,
        })
        .collect();
    Case {
        scenario: Scenario::new(&name, params(mode), tenants, RUN),
        mode,
        shares,
        lc_be: None,
        report_only: false,
        beyond_bound: false,
        seeds: 1,
    }
}

/// The policy cases for one shape and firmware mode.
pub fn policy_cases(shape: Shape, mode: Firmware) -> Vec<Case> {
    let w = shape.workload();
    let l = shape.label();
    let t = |name: &str, i: u32, lim: Limits| tenant(name, i, w.clone(), lim);
    let mut v = vec![
        steady(
            format!("caps-30-70/{l}"),
            mode,
            vec![
                t("a", 1, limits(Some(30), None, None)),
                t("b", 2, limits(Some(70), None, None)),
            ],
            &[("a", 30.0, Rule::Within), ("b", 70.0, Rule::Within)],
        ),
        steady(
            format!("caps-10-90/{l}"),
            mode,
            vec![
                t("a", 1, limits(Some(10), None, None)),
                t("b", 2, limits(Some(90), None, None)),
            ],
            &[("a", 10.0, Rule::Within), ("b", 90.0, Rule::Within)],
        ),
        steady(
            format!("caps-50-50/{l}"),
            mode,
            vec![
                t("a", 1, limits(Some(50), None, None)),
                t("b", 2, limits(Some(50), None, None)),
            ],
            &[("a", 50.0, Rule::Within), ("b", 50.0, Rule::Within)],
        ),
        steady(
            format!("weights-1-3/{l}"),
            mode,
            vec![
                t("a", 1, limits(None, Some(1), None)),
                t("b", 2, limits(None, Some(3), None)),
            ],
            &[("a", 25.0, Rule::Within), ("b", 75.0, Rule::Within)],
        ),
        steady(
            format!("weights-1-2-5/{l}"),
            mode,
            vec![
                t("a", 1, limits(None, Some(1), None)),
                t("b", 2, limits(None, Some(2), None)),
                t("c", 3, limits(None, Some(5), None)),
            ],
            &[
                ("a", 12.5, Rule::Within),
                ("b", 25.0, Rule::Within),
                ("c", 62.5, Rule::Within),
            ],
        ),
        // The neighbour's weight alone would leave the guaranteed tenant 25 %.
        steady(
            format!("min-40/{l}"),
            mode,
            vec![
                t("a", 1, limits(None, Some(100), Some(40))),
                t("b", 2, limits(None, Some(300), None)),
            ],
            &[("a", 40.0, Rule::Within), ("b", 60.0, Rule::Within)],
        ),
        steady(
            format!("capped-alone/{l}"),
            mode,
            vec![t("a", 1, limits(Some(30), None, None))],
            &[("a", 30.0, Rule::Within)],
        ),
        steady(
            format!("weighted-alone/{l}"),
            mode,
            vec![t("a", 1, limits(None, Some(1), None))],
            &[("a", ALONE_PCT, Rule::AtLeast)],
        ),
    ];
    // A neighbour (weight 3 against 1) starts at 10 s and stops at 20 s.
    let (on, off, end) = (10 * SEC, 20 * SEC, 30 * SEC);
    let phase = |label: &str, tenant: &str, target, rule, since: Nanos, to| ShareCheck {
        label: label.to_owned(),
        tenant: tenant.to_owned(),
        target,
        rule,
        from: since + SETTLE_LIMIT,
        to,
        settle_from: since,
        settle_limit: SETTLE_LIMIT,
    };
    v.push(Case {
        scenario: Scenario::new(
            &format!("neighbour/{l}"),
            params(mode),
            vec![
                t("a", 1, limits(None, Some(1), None)),
                t("b", 2, limits(None, Some(3), None))
                    .starting(on)
                    .stopping(off),
            ],
            end,
        ),
        mode,
        shares: vec![
            ShareCheck {
                settle_limit: MEASURE_FROM,
                from: MEASURE_FROM,
                ..phase("a:alone", "a", ALONE_PCT, Rule::AtLeast, 0, on)
            },
            phase("a:with-b", "a", 25.0, Rule::Within, on, off),
            phase("b", "b", 75.0, Rule::Within, on, off),
            phase("a:after-b", "a", ALONE_PCT, Rule::AtLeast, off, end),
        ],
        lc_be: None,
        report_only: false,
        beyond_bound: false,
        seeds: 1,
    });
    v.push(lc_be_case(shape, mode));
    v
}

/// LC: requests of 10 × 300 µs kernels (3 ms of GPU work), Poisson arrivals at 30 % load; BE
/// saturating with `shape`.
pub fn lc_be_case(shape: Shape, mode: Firmware) -> Case {
    let lc = tenant(
        "lc",
        1,
        Workload::LatencyCritical {
            kernel: 300 * US,
            kernels_per_request: 10,
            load: 0.3,
        },
        priority(Priority::LatencyCritical),
    );
    let be = tenant("be", 2, shape.workload(), priority(Priority::BestEffort));
    Case {
        scenario: Scenario::new(
            &format!("lc-be/{}", shape.label()),
            params(mode),
            vec![lc, be],
            RUN,
        ),
        mode,
        shares: Vec::new(),
        lc_be: Some(("lc".into(), "be".into(), MEASURE_FROM, RUN)),
        report_only: false,
        beyond_bound: false,
        seeds: 1,
    }
}

/// The H100 set-up of docs/real-gpu.md: two matmul loops (4096² bf16, ~0.2 ms each, batches of
/// 10 then a synchronize) or two deep queues of the same kernels, unlimited, caps 30 / 70,
/// weights 1 : 3.
pub fn h100_cases() -> Vec<Case> {
    let matmul = Workload::Batched {
        kernel: 200 * US,
        batch: 10,
        depth: 1024,
    };
    let deep = Workload::Saturating {
        kernel: 200 * US,
        depth: 1024,
    };
    let mut v = Vec::new();
    for (shape, w) in [("matmul", matmul), ("deep", deep)] {
        for (policy, la, lb, ta, tb) in [
            ("unlimited", None, None, 50.0, 50.0),
            (
                "caps-30-70",
                Some((Some(30), None)),
                Some((Some(70), None)),
                30.0,
                70.0,
            ),
            (
                "weights-1-3",
                Some((None, Some(1))),
                Some((None, Some(3))),
                25.0,
                75.0,
            ),
        ] {
            let lim = |x: Option<(Option<u32>, Option<u32>)>| {
                x.map_or_else(Limits::default, |(m, w)| limits(m, w, None))
            };
            let mut a = tenant("a", 1, w.clone(), lim(la));
            let mut b = tenant("b", 2, w.clone(), lim(lb));
            // PyTorch's per-op dispatch is slower than a bare launch.
            for t in [&mut a, &mut b] {
                t.host.launch = 15 * US;
                t.host.sync_return = 20 * US;
            }
            let mut c = steady(
                format!("h100/{policy}/{shape}"),
                Firmware::Honors,
                vec![a, b],
                &[("a", ta, Rule::Within), ("b", tb, Rule::Within)],
            );
            c.scenario.duration = H100_RUN;
            for s in &mut c.shares {
                s.to = H100_RUN;
            }
            c.report_only = policy == "unlimited";
            c.seeds = H100_SEEDS;
            v.push(c);
        }
    }
    v
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

/// The cases of a run: the H100 reproduction, then the matrix.
pub fn cases(quick: bool) -> Vec<Case> {
    let mut v = h100_cases();
    let period = LawParams::default().period;
    for shape in shapes(quick) {
        for mode in MODES {
            let queued = shape.kernel * shape.depth as Nanos;
            v.extend(policy_cases(shape, mode).into_iter().map(|mut c| {
                c.beyond_bound = !hardware(mode) && (queued >= period || c.lc_be.is_some());
                c
            }));
        }
    }
    v
}

/// Runs one case (and, for LC/BE, the LC solo run, from `solo` when already made).
pub fn run_case(
    case: &Case,
    controller_name: &str,
    solo: &Mutex<BTreeMap<String, f64>>,
) -> CaseResult {
    let results: Vec<CaseResult> = (1..=case.seeds.max(1))
        .map(|seed| {
            let mut c = case.clone();
            let p = &mut c.scenario.params;
            p.seed = seed;
            p.daemon_phase = (p.daemon_phase + (seed - 1) * 7_919_000) % p.daemon_interval;
            let mut ctrl = controller(controller_name).expect("known controller");
            let out = c.scenario.run(ctrl.as_mut());
            judge(&c, &out, solo)
        })
        .collect();
    merge(results)
}

/// The mean of several seeds' results (worst settling, pass only if every run passed).
fn merge(mut runs: Vec<CaseResult>) -> CaseResult {
    let n = runs.len() as f64;
    let mut r = runs.remove(0);
    for other in &runs {
        for (t, o) in r.tenants.iter_mut().zip(&other.tenants) {
            t.achieved += o.achieved;
            t.settle_ms = match (t.settle_ms, o.settle_ms) {
                (Some(Some(a)), Some(Some(b))) => Some(Some(a.max(b))),
                (Some(_), Some(_)) => Some(None),
                (x, _) => x,
            };
        }
        r.lc_p99_ratio = r
            .lc_p99_ratio
            .zip(other.lc_p99_ratio)
            .map(|(a, b)| a.max(b));
        r.be_idle_pct = r.be_idle_pct.zip(other.be_idle_pct).map(|(a, b)| a.min(b));
        r.lc_ms = r
            .lc_ms
            .zip(other.lc_ms)
            .map(|(a, b)| (a.0.max(b.0), a.1.max(b.1), a.2.max(b.2)));
        r.pass = r.pass.zip(other.pass).map(|(a, b)| a && b);
    }
    for t in &mut r.tenants {
        t.achieved /= n;
    }
    r
}

fn judge(case: &Case, out: &Outcome, solo: &Mutex<BTreeMap<String, f64>>) -> CaseResult {
    // What a tenant can use at all: its share running alone, uncontrolled, over the same span
    // (a tenant that synchronizes after every short kernel leaves the GPU idle between them,
    // and no controller can give it that time). Targets of contended shares are scaled by it.
    let usable = |c: &ShareCheck| -> f64 {
        let key = format!(
            "share/{}/{}/{}/{}/{}-{}",
            case.mode.as_str(),
            case.scenario.params.seed,
            case.scenario.name,
            c.tenant,
            c.from,
            c.to
        );
        if let Some(v) = solo.lock().expect("solo cache").get(&key) {
            return *v;
        }
        let v = case
            .scenario
            .solo(&c.tenant)
            .run(&mut NoControl)
            .share(&c.tenant, c.from, c.to)
            .min(100.0);
        solo.lock().expect("solo cache").insert(key, v);
        v
    };
    let mut tenants: Vec<TenantResult> = case
        .shares
        .iter()
        .map(|c| {
            let target = match c.rule {
                Rule::Within => c.target * usable(c) / 100.0,
                Rule::AtLeast => c.target,
            };
            TenantResult {
                name: c.label.clone(),
                target: c.target,
                judged: target,
                achieved: out.share(&c.tenant, c.from, c.to),
                rule: c.rule,
                settle_ms: Some(settle(out, c, target, case.mode).map(|t| t / MS)),
            }
        })
        .collect();
    let limit = |c: &ShareCheck| {
        if hardware(case.mode) {
            c.settle_limit
        } else {
            c.settle_limit.max(FALLBACK_WINDOW)
        }
    };
    let mut pass = case.shares.iter().zip(&tenants).all(|(c, r)| {
        r.rule.holds(r.judged, r.achieved)
            && r.settle_ms.flatten().is_some_and(|ms| ms * MS <= limit(c))
    });
    let (mut lc_p99_ratio, mut lc_ms, mut be_idle_pct) = (None, None, None);
    if let Some((lc, be, from, to)) = &case.lc_be {
        // LC alone, same arrivals (its own random stream), no controller needed.
        let key = format!(
            "{}/{}/{}",
            case.mode.as_str(),
            case.scenario.params.seed,
            lc
        );
        let cached = solo.lock().expect("solo cache").get(&key).copied();
        let solo_p99 = cached.map(|v| v as Nanos).unwrap_or_else(|| {
            let p99 = case
                .scenario
                .solo(lc)
                .run(&mut NoControl)
                .latency(lc, *from, *to)
                .map_or(1, |l| l.p99);
            solo.lock().expect("solo cache").insert(key, p99 as f64);
            p99
        });
        let (p50, p99) = out
            .latency(lc, *from, *to)
            .map_or((Nanos::MAX, Nanos::MAX), |l| (l.p50, l.p99));
        let ratio = p99 as f64 / solo_p99.max(1) as f64;
        let ms = |t: Nanos| t as f64 / MS as f64;
        lc_ms = Some((ms(p50), ms(p99), ms(solo_p99)));
        let idle = out.idle_share(be, lc, *from, *to);
        let lc_share = out.share(lc, *from, *to);
        tenants.push(TenantResult {
            name: lc.clone(),
            target: 30.0,
            judged: 30.0,
            achieved: lc_share,
            rule: Rule::Within,
            settle_ms: None,
        });
        tenants.push(TenantResult {
            name: be.clone(),
            target: BE_IDLE_PCT / 100.0 * (100.0 - lc_share),
            judged: BE_IDLE_PCT / 100.0 * (100.0 - lc_share),
            achieved: out.share(be, *from, *to),
            rule: Rule::AtLeast,
            settle_ms: None,
        });
        pass &= ratio <= LC_P99_RATIO && idle >= BE_IDLE_PCT;
        lc_p99_ratio = Some(ratio);
        be_idle_pct = Some(idle);
    }
    CaseResult {
        scenario: case.scenario.name.clone(),
        mode: case.mode,
        tenants,
        lc_p99_ratio,
        lc_ms,
        be_idle_pct,
        beyond_bound: case.beyond_bound,
        pass: (!case.report_only).then_some(pass),
    }
}

fn settle(out: &Outcome, c: &ShareCheck, target: f64, mode: Firmware) -> Option<Nanos> {
    let rule = c.rule;
    let window = if hardware(mode) {
        SETTLE_WINDOW
    } else {
        FALLBACK_WINDOW
    };
    out.settle_time(&c.tenant, c.settle_from, c.to, window, |pct| {
        rule.holds(target, pct)
    })
}

/// Runs `cases` on `threads` threads; results in the cases' order.
pub fn run_all(cases: &[Case], controller_name: &str, threads: usize) -> Vec<CaseResult> {
    let next = AtomicUsize::new(0);
    let solo = Mutex::new(BTreeMap::new());
    let results: Mutex<Vec<Option<CaseResult>>> = Mutex::new(vec![None; cases.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(case) = cases.get(i) else { break };
                    let r = run_case(case, controller_name, &solo);
                    results.lock().expect("results")[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .expect("results")
        .into_iter()
        .map(|r| r.expect("every case ran"))
        .collect()
}

/// A line of `--json`.
#[derive(Serialize)]
struct JsonLine<'a> {
    scenario: &'a str,
    mode: &'a str,
    tenants: Vec<JsonTenant<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lc_p99_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lc_p50_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lc_p99_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lc_solo_p99_ms: Option<f64>,
    /// Percent of the time LC left idle that BE ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    be_idle_pct: Option<f64>,
    beyond_bound: bool,
    /// Whether every target was met; `null` for cases only reported.
    pass: Option<bool>,
}

#[derive(Serialize)]
struct JsonTenant<'a> {
    name: &'a str,
    target_pct: f64,
    /// The target it was judged against: scaled by the share the tenant uses alone.
    judged_target_pct: f64,
    achieved_pct: f64,
    /// Time to settle within bounds (ms), `null` if it never did; absent where not judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    settle_ms: Option<Option<u64>>,
}

/// One JSON object (a line of `--json`).
pub fn to_json(r: &CaseResult) -> String {
    let line = JsonLine {
        scenario: &r.scenario,
        mode: r.mode.as_str(),
        tenants: r
            .tenants
            .iter()
            .map(|t| JsonTenant {
                name: &t.name,
                target_pct: round2(t.target),
                judged_target_pct: round2(t.judged),
                achieved_pct: round2(t.achieved),
                settle_ms: t.settle_ms,
            })
            .collect(),
        lc_p99_ratio: r.lc_p99_ratio.map(round3),
        lc_p50_ms: r.lc_ms.map(|l| round3(l.0)),
        lc_p99_ms: r.lc_ms.map(|l| round3(l.1)),
        lc_solo_p99_ms: r.lc_ms.map(|l| round3(l.2)),
        be_idle_pct: r.be_idle_pct.map(round2),
        beyond_bound: r.beyond_bound,
        pass: r.pass,
    };
    serde_json::to_string(&line).expect("plain data serializes")
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The readable table.
pub fn table(results: &[CaseResult]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<32} {:<8} {:<6} {:<30} tenant target → achieved % of GPU (settling time)",
        "scenario", "mode", "result", "LC p99 / solo, BE idle share"
    );
    for r in results {
        let shares = r
            .tenants
            .iter()
            .map(|t| {
                let op = if t.rule == Rule::AtLeast { "≥" } else { "" };
                let settle = match t.settle_ms {
                    None => String::new(),
                    Some(None) => " (unsettled)".into(),
                    Some(Some(ms)) => format!(" ({:.1}s)", ms as f64 / 1e3),
                };
                let judged = if (t.judged - t.target).abs() >= 0.05 {
                    format!("({:.1})", t.judged)
                } else {
                    String::new()
                };
                format!(
                    "{} {op}{:.0}{judged}→{:.1}{settle}",
                    t.name, t.target, t.achieved
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let mut other = Vec::new();
        if let (Some(x), Some((_, p99, solo))) = (r.lc_p99_ratio, r.lc_ms) {
            other.push(format!("p99 {p99:.1}/{solo:.1}ms ×{x:.2}"));
        }
        if let Some(x) = r.be_idle_pct {
            other.push(format!("BE idle {x:.0}%"));
        }
        let verdict = match (r.pass, r.beyond_bound) {
            (Some(true), _) => "pass",
            (Some(false), false) => "miss",
            (Some(false), true) => "beyond",
            (None, _) => "-",
        };
        let _ = writeln!(
            s,
            "{:<32} {:<8} {verdict:<6} {:<30} {shares}",
            r.scenario,
            r.mode.as_str(),
            other.join(", ")
        );
    }
    let count = |beyond: bool| {
        let judged: Vec<bool> = results
            .iter()
            .filter(|r| r.beyond_bound == beyond)
            .filter_map(|r| r.pass)
            .collect();
        (judged.iter().filter(|p| **p).count(), judged.len())
    };
    let (met, of) = count(false);
    let (met_beyond, of_beyond) = count(true);
    let _ = writeln!(
        s,
        "{met} of {of} cases meet their targets; beyond the fallback's bound, {met_beyond} of \
         {of_beyond}"
    );
    s
}
