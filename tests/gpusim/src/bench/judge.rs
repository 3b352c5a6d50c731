//! Running the cases and judging them: each case under a controller, over its seeds, against
//! its targets (shares scaled by what a tenant uses alone, settling, LC latency, BE's use of
//! the idle time), on several threads.

use std::{
    collections::BTreeMap,
    sync::{Mutex, atomic::AtomicUsize, atomic::Ordering},
};

use super::{
    BE_IDLE_PCT, Case, CaseResult, FALLBACK_WINDOW, LC_P99_RATIO, Rule, SETTLE_WINDOW, ShareCheck,
    TenantResult, controller, hardware,
};
use crate::{MS, Nanos, control::NoControl, engine::Firmware, scenario::Outcome};

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
