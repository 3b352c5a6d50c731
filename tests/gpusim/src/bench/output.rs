//! The benchmark's output: one JSON object per case (`--json`), or the readable table with the
//! count of cases that meet their targets.

use std::fmt::Write as _;

use serde::Serialize;

use super::{CaseResult, Rule};

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
