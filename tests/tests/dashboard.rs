//! The Grafana dashboard `deploy/grafana/gpud.json` against a live `/metrics` of the real gpud:
//! every PromQL expression (panel targets and the template variable's query) is parsed with
//! `promql-parser`, and every metric it selects, every label it matches, groups or joins on, every
//! value it matches with `=` or `=~`, and every `{{label}}` of its legend are checked against a
//! scrape of the daemon under the test rig, in a scenario that gives each metric a series: a
//! docker-style container allocating on the fake NVIDIA device past its limit, NVML memory, a
//! compute cap throttling a simulated GPU user, an idle memory holder, and a tenant's scheduling
//! control the guard reports; the container is named as a pod's (`SetWorkload`), for the per-pod
//! panels.
//!
//! The labels each expression's result carries are followed through the syntax tree
//! (aggregations keep their `by` labels, `rate` and friends keep their argument's, a binary
//! operation its left side's and the `group_left` ones), so a legend naming a label the query
//! aggregated away fails too. `instance` and `job` are the labels Prometheus adds to every target
//! at scrape time; they are allowed everywhere.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    time::Duration,
};

use gpud_tests::{Cgroup, Rig, RmProcess, eventually, one_gpu, scenario::Process, spawn_in_cgroup};
use promql_parser::{
    label::MatchOp,
    parser::{self, Expr, LabelModifier, VectorMatchCardinality},
};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const ID: &str = "4f2c1e9d8b7a65432100fedcba98765432100123456789abcdef0123456789ab";

/// Labels a Prometheus server attaches to every series of a target.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

/// Grafana's interval macros, as a Prometheus range.
const MACROS: [&str; 4] = [
    "$__rate_interval",
    "$__interval",
    "$__range",
    "${__rate_interval}",
];

/// One query of the dashboard: where it is, the PromQL, and its legend.
struct Query {
    place: String,
    expr: String,
    legend: String,
}

fn dashboard() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/gpud.json");
    let text = std::fs::read_to_string(&path).expect("read the dashboard");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every query of the dashboard, with Grafana's variables replaced by what they stand for.
fn queries(dash: &Value) -> Vec<Query> {
    let vars: Vec<(String, String)> = dash["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let name = v["name"].as_str().expect("variable name").to_owned();
            // A multi-value variable stands inside a regex matcher: its "All" value.
            let all = v["allValue"].as_str().unwrap_or(".+").to_owned();
            (name, all)
        })
        .collect();
    let substitute = |expr: &str| {
        let mut e = expr.to_owned();
        for m in MACROS {
            e = e.replace(m, "1m");
        }
        for (name, value) in &vars {
            e = e
                .replace(&format!("${{{name}}}"), value)
                .replace(&format!("${name}"), value);
        }
        assert!(!e.contains('$'), "an unknown variable in {expr:?}");
        e
    };
    let mut out = Vec::new();
    let mut panels: Vec<&Value> = dash["panels"].as_array().expect("panels").iter().collect();
    while let Some(p) = panels.pop() {
        if let Some(inner) = p["panels"].as_array() {
            panels.extend(inner);
        }
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(Query {
                place: format!("panel {:?} target {}", p["title"], t["refId"]),
                expr: substitute(t["expr"].as_str().expect("target expr")),
                legend: t["legendFormat"].as_str().unwrap_or("").to_owned(),
            });
        }
    }
    // Query variables: `label_values(<selector>, <label>)` is Grafana's, around PromQL.
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .expect("variable query");
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .and_then(|r| r.rsplit_once(','))
            .unwrap_or_else(|| panic!("variable query {q:?} is not label_values(expr, label)"));
        out.push(Query {
            place: format!("variable {}", v["name"]),
            expr: substitute(inner.0.trim()),
            legend: format!("{{{{{}}}}}", inner.1.trim()),
        });
    }
    out
}

/// What a scrape shows of each metric: label name → the values seen.
type Seen = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn seen_of(text: &str) -> Seen {
    let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .expect("parse the exposition");
    let mut seen = Seen::new();
    for s in parsed.samples {
        let labels = seen.entry(s.metric).or_default();
        for (k, v) in s.labels.iter() {
            labels.entry(k.clone()).or_default().insert(v.clone());
        }
    }
    seen
}

/// Checks `expr` against `seen`: returns the labels its result carries (`None`: a scalar), and
/// pushes every problem onto `errors`.
fn labels_of(expr: &Expr, seen: &Seen, errors: &mut Vec<String>) -> Option<BTreeSet<String>> {
    let target: BTreeSet<String> = TARGET_LABELS.iter().map(|s| (*s).to_owned()).collect();
    let need =
        |what: &str, labels: &[String], have: &BTreeSet<String>, errors: &mut Vec<String>| {
            for l in labels {
                if !have.contains(l) {
                    errors.push(format!("{what}: label {l:?} is not among {have:?}"));
                }
            }
        };
    match expr {
        Expr::VectorSelector(vs) => {
            let Some(name) = &vs.name else {
                errors.push(format!("a selector without a metric name: {vs}"));
                return Some(target);
            };
            let Some(labels) = seen.get(name) else {
                errors.push(format!("metric {name} is not in the scrape"));
                return Some(target);
            };
            for m in vs
                .matchers
                .matchers
                .iter()
                .chain(vs.matchers.or_matchers.iter().flatten())
            {
                if TARGET_LABELS.contains(&m.name.as_str()) {
                    continue;
                }
                let Some(values) = labels.get(&m.name) else {
                    errors.push(format!("{name} has no label {:?}", m.name));
                    continue;
                };
                let must_match = matches!(m.op, MatchOp::Equal | MatchOp::Re(_));
                if must_match && !values.iter().any(|v| m.is_match(v)) {
                    errors.push(format!(
                        "{name}{{{m}}} matches none of the values served: {values:?}"
                    ));
                }
            }
            Some(labels.keys().cloned().chain(target).collect())
        }
        Expr::MatrixSelector(ms) => labels_of(&Expr::VectorSelector(ms.vs.clone()), seen, errors),
        Expr::Paren(p) => labels_of(&p.expr, seen, errors),
        Expr::Unary(u) => labels_of(&u.expr, seen, errors),
        Expr::Subquery(s) => labels_of(&s.expr, seen, errors),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) => None,
        Expr::Call(c) => {
            // The functions dashboards use on vectors (rate, increase, sort_desc, ...) keep
            // their vector argument's labels.
            let mut out = None;
            for a in &c.args.args {
                if let Some(l) = labels_of(a, seen, errors) {
                    out.get_or_insert(l);
                }
            }
            out
        }
        Expr::Aggregate(a) => {
            let input = labels_of(&a.expr, seen, errors).unwrap_or_default();
            if let Some(p) = &a.param {
                labels_of(p, seen, errors);
            }
            match &a.modifier {
                Some(LabelModifier::Include(by)) => {
                    need(&format!("by in {expr}"), &by.labels, &input, errors);
                    Some(by.labels.iter().cloned().collect())
                }
                Some(LabelModifier::Exclude(without)) => {
                    need(
                        &format!("without in {expr}"),
                        &without.labels,
                        &input,
                        errors,
                    );
                    Some(
                        input
                            .into_iter()
                            .filter(|l| !without.labels.contains(l))
                            .collect(),
                    )
                }
                None => Some(BTreeSet::new()),
            }
        }
        Expr::Binary(b) => {
            let lhs = labels_of(&b.lhs, seen, errors);
            let rhs = labels_of(&b.rhs, seen, errors);
            let (Some(l), Some(r)) = (&lhs, &rhs) else {
                // With a scalar side, the vector side's labels.
                return lhs.or(rhs);
            };
            let mut out = l.clone();
            if let Some(m) = &b.modifier {
                if let Some(LabelModifier::Include(on)) = &m.matching {
                    need(&format!("on in {expr} (left)"), &on.labels, l, errors);
                    need(&format!("on in {expr} (right)"), &on.labels, r, errors);
                }
                if let Some(LabelModifier::Exclude(ignoring)) = &m.matching {
                    let both: BTreeSet<String> = l.union(r).cloned().collect();
                    need(
                        &format!("ignoring in {expr}"),
                        &ignoring.labels,
                        &both,
                        errors,
                    );
                }
                match &m.card {
                    VectorMatchCardinality::ManyToOne(extra) => {
                        need(&format!("group_left in {expr}"), &extra.labels, r, errors);
                        out.extend(extra.labels.iter().cloned());
                    }
                    VectorMatchCardinality::OneToMany(extra) => {
                        need(&format!("group_right in {expr}"), &extra.labels, l, errors);
                        out = r.clone();
                        out.extend(extra.labels.iter().cloned());
                    }
                    _ => {}
                }
            }
            Some(out)
        }
        Expr::Extension(_) => {
            errors.push("an extension expression".to_owned());
            None
        }
    }
}

/// The `{{label}}` names of a legend format.
fn legend_labels(legend: &str) -> Vec<String> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|s| s.split_once("}}").map(|(l, _)| l.trim().to_owned()))
        .collect()
}

/// Every problem of the dashboard's queries against a scrape, and the metrics they select.
fn check(queries: &[Query], seen: &Seen) -> (Vec<String>, BTreeSet<String>) {
    let mut errors = Vec::new();
    let mut metrics = BTreeSet::new();
    for q in queries {
        let expr = match parser::parse(&q.expr) {
            Ok(e) => e,
            Err(e) => {
                errors.push(format!("{}: {:?} does not parse: {e}", q.place, q.expr));
                continue;
            }
        };
        collect_metrics(&expr, &mut metrics);
        let mut errs = Vec::new();
        let out = labels_of(&expr, seen, &mut errs).unwrap_or_default();
        for l in legend_labels(&q.legend) {
            if !out.contains(&l) {
                errs.push(format!("legend {{{{{l}}}}}: the result has only {out:?}"));
            }
        }
        errors.extend(errs.into_iter().map(|e| format!("{}: {e}", q.place)));
    }
    (errors, metrics)
}

fn collect_metrics(expr: &Expr, out: &mut BTreeSet<String>) {
    match expr {
        Expr::VectorSelector(vs) => out.extend(vs.name.clone()),
        Expr::MatrixSelector(ms) => out.extend(ms.vs.name.clone()),
        Expr::Paren(p) => collect_metrics(&p.expr, out),
        Expr::Unary(u) => collect_metrics(&u.expr, out),
        Expr::Subquery(s) => collect_metrics(&s.expr, out),
        Expr::Call(c) => c.args.args.iter().for_each(|a| collect_metrics(a, out)),
        Expr::Aggregate(a) => collect_metrics(&a.expr, out),
        Expr::Binary(b) => {
            collect_metrics(&b.lhs, out);
            collect_metrics(&b.rhs, out);
        }
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// The checker itself, on a hand-made scrape: what the dashboard does right passes, and each
/// kind of mistake is reported.
#[test]
fn the_checker_reports_unknown_metrics_labels_values_and_legends() {
    let text = "\
# TYPE gpud_cgroup_memory_bytes gauge
gpud_cgroup_memory_bytes{cgroup=\"/a\",container_id=\"\",gpu=\"0\"} 1
# TYPE gpud_kernel_events counter
gpud_kernel_events_total{event=\"events_lost\"} 0
# EOF
";
    let seen = seen_of(text);
    let q = |expr: &str, legend: &str| Query {
        place: "test".into(),
        expr: expr.into(),
        legend: legend.into(),
    };
    let good = [
        q(
            "sum by (instance, gpu) (gpud_cgroup_memory_bytes{container_id!=\"\"})",
            "{{instance}} {{gpu}}",
        ),
        q(
            "increase(gpud_kernel_events_total{event=\"events_lost\"}[1m])",
            "{{event}}",
        ),
    ];
    let (errors, metrics) = check(&good, &seen);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(metrics.len(), 2);
    for (bad, legend, says) in [
        ("gpud_cgroup_memory_byte", "", "not in the scrape"),
        (
            "gpud_cgroup_memory_bytes{pod=\"x\"}",
            "",
            "has no label \"pod\"",
        ),
        (
            "gpud_kernel_events_total{event=\"event_lost\"}",
            "",
            "matches none",
        ),
        (
            "sum by (pod) (gpud_cgroup_memory_bytes)",
            "",
            "label \"pod\"",
        ),
        (
            "sum by (gpu) (gpud_cgroup_memory_bytes)",
            "{{cgroup}}",
            "legend {{cgroup}}",
        ),
        (
            "gpud_cgroup_memory_bytes / on (event) gpud_kernel_events_total",
            "",
            "on in",
        ),
        ("rate(gpud_cgroup_memory_bytes[1m]", "", "does not parse"),
    ] {
        let (errors, _) = check(&[q(bad, legend)], &seen);
        assert!(
            errors.iter().any(|e| e.contains(says)),
            "{bad:?}: {errors:?}"
        );
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn scrape(port: u16) -> String {
    ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .expect("scrape /metrics")
        .body_mut()
        .read_to_string()
        .expect("metrics body")
}

#[tokio::test(flavor = "multi_thread")]
async fn every_metric_and_label_the_dashboard_queries_is_served() {
    let dash = dashboard();
    let queries = queries(&dash);
    assert!(queries.len() >= 20, "only {} queries", queries.len());

    let Some(mut rig) = Rig::new("dashboard").fake_device(1).map(Rig::fake_nvml) else {
        return;
    };
    // A docker-style container that allocates on the fake device, with a memory limit.
    let parent = Cgroup::new("dashboard");
    let ctr_cg = parent.child(&format!("docker-{ID}.scope"));
    let ctr = ctr_cg.rel.clone();
    let mut rm = RmProcess::spawn(Some(&ctr_cg.dir), &rig.ctl());
    let (c, d) = rm.client_device(0);
    // A simulated GPU user under a compute cap, and an idle holder of NVML memory.
    let burn_cg = parent.child("burner");
    let mut burner = spawn_in_cgroup(&burn_cg, "while :; do :; done");
    let idle_cg = parent.child("idle");
    let mut holder = spawn_in_cgroup(&idle_cg, "sleep 600");
    rig.nvml_scenario(&one_gpu(
        "Simulated GPU",
        [
            Process::on(rm.pid, 0, 3 * GIB),
            Process::on(burner.id(), 0, GIB),
            Process::on(holder.id(), 0, 2 * GIB),
        ],
    ));
    let port = free_port();
    let config = rig
        .config()
        .react_action("notify")
        .set("enforcement.guard_react_action", "report")
        .compute(false)
        .set("idle.threshold_percent", 5)
        .set("idle.min_duration_secs", 1)
        .set("metrics.listen", format!("127.0.0.1:{port}"));
    rig.start(config).await;
    let (_conn, proxy) = rig.proxy().await;
    rig.wait_for_gpus(1).await;

    // Its pod, as a runtime integration names it: the per-pod panels group by these.
    let pod: BTreeMap<String, String> = [
        ("namespace", "ml"),
        ("pod", "train-0"),
        ("container", "main"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .into();
    proxy.set_workload(&ctr, &pod).await.expect("SetWorkload");
    rm.ok(&format!("alloc {c} {d} {} nvos64", 6 * MIB));
    rig.set_limit(&ctr, "all", "memory_max", "64Mi").await;
    rig.set_limit(&ctr, "0", "memory_max", "32Mi").await;
    // Past the limit: reported (notify), counted.
    rm.cmd(&format!("alloc {c} {d} {} nvos64", 64 * MIB));
    let cap = BTreeMap::from([("compute_max", zbus::Variant::from(20u32))]);
    proxy
        .set_limits(&burn_cg.rel, "0", cap)
        .await
        .expect("SetLimits compute_max");
    // A tenant's scheduling control: the guard reports it.
    let g = rm.handle(&format!("channel-group {c} {d}"));
    rm.cmd(&format!("timeslice {c} {g} 1000000"));

    let metrics_needed = {
        let (_, m) = check(&queries, &Seen::new());
        m
    };
    let seen = eventually(Duration::from_secs(30), || async {
        let text = tokio::task::spawn_blocking(move || scrape(port))
            .await
            .ok()?;
        let seen = seen_of(&text);
        metrics_needed
            .iter()
            .all(|m| seen.contains_key(m))
            .then_some(seen)
    })
    .await;
    let seen = seen.unwrap_or_else(|| {
        let text = scrape(port);
        let missing: Vec<&String> = metrics_needed
            .iter()
            .filter(|m| !seen_of(&text).contains_key(*m))
            .collect();
        panic!(
            "the scenario never served a series of {missing:?}:\n{text}\n{}",
            rig.log_text()
        )
    });
    let (errors, metrics) = check(&queries, &seen);
    println!(
        "dashboard: {} queries over {} metrics checked against a live scrape",
        queries.len(),
        metrics.len()
    );
    assert!(
        errors.is_empty(),
        "dashboard errors:\n{}",
        errors.join("\n")
    );
    // The panels the dashboard is for.
    for m in [
        "gpud_gpu_memory_used_bytes",
        "gpud_cgroup_memory_limit_bytes",
        "gpud_cgroup_nvml_memory_bytes",
        "gpud_cgroup_compute_target_percent",
        "gpud_cgroup_compute_measured_percent",
        "gpud_cgroup_compute_throttled_seconds_total",
        "gpud_cgroup_idle_memory_bytes",
        "gpud_scheduler_guard_total",
        "gpud_kernel_events_total",
    ] {
        assert!(metrics.contains(m), "the dashboard shows no {m}");
    }
    assert!(
        queries.iter().any(|q| q.legend.contains("{{pod}}")),
        "the dashboard has no per-pod panel"
    );

    for p in [&mut burner, &mut holder] {
        let _ = p.kill();
        let _ = p.wait();
    }
    rm.finish();
}
