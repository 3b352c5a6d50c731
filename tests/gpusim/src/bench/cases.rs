//! The benchmark's matrix: the shapes of the submitters, the policy cases of each shape and
//! firmware mode (caps, weights, guarantees, alone, a neighbour coming and going, LC/BE), and
//! the H100 reproduction, each case with the shares it is judged on.

use gpud::{
    enforcement::compute::law::LawParams,
    policy::{Limits, Priority},
};

use super::{ALONE_PCT, Case, MODES, Rule, SETTLE_LIMIT, Shape, ShareCheck, hardware};
use crate::{
    MS, Nanos, SEC, US,
    engine::Firmware,
    scenario::Scenario,
    sim::SimParams,
    tenant::{TenantSpec, Workload},
};

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
