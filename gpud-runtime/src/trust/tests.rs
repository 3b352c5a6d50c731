use super::*;
use gpud_api::limits::GpuSelector;

const UUID: &str = "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42";

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn decided(asked: &[(&str, &str)], granted: &[(&str, &str)], trust: Trust) -> Decision {
    let (asked, granted) = (map(asked), map(granted));
    decide(
        &Sources {
            asked: &asked,
            granted: &granted,
            name: Some("app"),
            kubernetes: true,
        },
        trust,
    )
    .expect("valid annotations")
}

fn uuid() -> GpuSelector {
    GpuSelector::Uuid(UUID.into())
}

/// A pod sold a 30 % cap and 8 GiB on one GPU asks for more of everything: under `narrow` the
/// grant holds and each widening key is reported; under `full` the pod's word wins, as before.
#[test]
fn annotations_never_widen_a_grant_where_they_only_narrow() {
    let cap = format!("gpud.dev/compute-max.{UUID}");
    let mem = format!("gpud.dev/memory-max.{UUID}");
    let prio = format!("gpud.dev/priority.{UUID}");
    let min = format!("gpud.dev/compute-min.{UUID}");
    let weight = format!("gpud.dev/compute-weight.{UUID}");
    let asked = [
        (cap.as_str(), "100"),
        (mem.as_str(), "64Gi"),
        (prio.as_str(), "latency-critical"),
        (min.as_str(), "20"),
        (weight.as_str(), "10000"),
    ];
    let granted = [(cap.as_str(), "30"), (mem.as_str(), "8Gi")];
    let d = decided(&asked, &granted, Trust::Narrow);
    let on = |k| d.shares.get(&uuid(), k).cloned();
    assert_eq!(on(LimitKind::ComputeMax), Some(LimitValue::Number(30)));
    assert_eq!(on(LimitKind::MemoryMax), Some(LimitValue::Number(8 << 30)));
    for k in [
        LimitKind::Priority,
        LimitKind::ComputeMin,
        LimitKind::ComputeWeight,
    ] {
        assert_eq!(on(k), None, "{k}");
    }
    let mut keys: Vec<&str> = d.ignored.iter().map(|i| i.key.as_str()).collect();
    keys.sort_unstable();
    let mut want = vec![&*cap, &*mem, &*prio, &*min, &*weight];
    want.sort_unstable();
    assert_eq!(keys, want);
    assert!(d.granted());
    let text = d
        .ignored
        .iter()
        .find(|i| i.key == cap)
        .expect("cap ignored")
        .to_string();
    assert!(
        text.contains("above the compute_max the cluster granted (30)"),
        "{text}"
    );

    let full = decided(&asked, &granted, Trust::Full);
    assert!(full.ignored.is_empty());
    assert_eq!(
        full.shares.get(&uuid(), LimitKind::ComputeMax),
        Some(&LimitValue::Number(30)),
        "full: the grant is still over the pod's annotations, key by key"
    );
    assert_eq!(
        full.shares.get(&uuid(), LimitKind::Priority),
        Some(&LimitValue::Priority(Priority::LatencyCritical))
    );
}

/// What narrows is applied: lower caps, a cap where none was granted, a lower class, a lower
/// weight, a lower guarantee than granted.
#[test]
fn narrowing_annotations_are_applied() {
    let cap = format!("gpud.dev/compute-max.{UUID}");
    let min = format!("gpud.dev/compute-min.{UUID}");
    let d = decided(
        &[
            (&cap, "20"),
            ("gpud.dev/memory-max", "4Gi"),
            ("gpud.dev/priority", "best-effort"),
            ("gpud.dev/compute-weight", "50"),
            (&min, "10"),
            ("app.container.gpud.dev/compute-max", "60"),
        ],
        &[(&cap, "30"), (&min, "20")],
        Trust::Narrow,
    );
    assert_eq!(d.ignored, vec![]);
    let all = GpuSelector::All;
    assert_eq!(
        d.shares.get(&uuid(), LimitKind::ComputeMax),
        Some(&LimitValue::Number(20))
    );
    assert_eq!(
        d.shares.get(&uuid(), LimitKind::ComputeMin),
        Some(&LimitValue::Number(10))
    );
    assert_eq!(
        d.shares.get(&all, LimitKind::MemoryMax),
        Some(&LimitValue::Number(4 << 30))
    );
    assert_eq!(
        d.shares.get(&all, LimitKind::ComputeMax),
        Some(&LimitValue::Number(60))
    );
    assert_eq!(
        d.shares.get(&all, LimitKind::Priority),
        Some(&LimitValue::Priority(Priority::BestEffort))
    );
    assert_eq!(
        d.shares.get(&all, LimitKind::ComputeWeight),
        Some(&LimitValue::Number(50))
    );
}

/// With nothing granted (no DRA claim, no device plugin), a Kubernetes pod's annotations may cap
/// it but not raise its class, weight or guarantee.
#[test]
fn without_a_grant_only_caps_and_lower_classes_pass() {
    let d = decided(
        &[
            ("gpud.dev/memory-max", "4Gi"),
            ("gpud.dev/compute-max", "50"),
            ("gpud.dev/compute-min", "100"),
            ("gpud.dev/priority", "latency-critical"),
            ("gpud.dev/compute-weight", "101"),
        ],
        &[],
        Trust::Auto,
    );
    assert!(!d.granted());
    let mut kept: Vec<LimitKind> = d.shares.gpus[&GpuSelector::All].keys().copied().collect();
    kept.sort();
    assert_eq!(kept, vec![LimitKind::MemoryMax, LimitKind::ComputeMax]);
    assert_eq!(d.ignored.len(), 3, "{:?}", d.ignored);
    let min = d
        .ignored
        .iter()
        .find(|i| i.key == "gpud.dev/compute-min")
        .expect("compute-min ignored");
    assert!(min.reason.contains("the cluster's to grant"), "{min}");
}

/// `auto` trusts annotations fully outside Kubernetes (their author administers the container).
#[test]
fn auto_is_full_outside_kubernetes() {
    let asked = map(&[("gpud.dev/priority", "latency-critical")]);
    let none = HashMap::new();
    let d = decide(
        &Sources {
            asked: &asked,
            granted: &none,
            name: None,
            kubernetes: false,
        },
        Trust::Auto,
    )
    .expect("valid");
    assert!(d.ignored.is_empty());
    assert_eq!(
        d.shares.get(&GpuSelector::All, LimitKind::Priority),
        Some(&LimitValue::Priority(Priority::LatencyCritical))
    );
}

/// Malformed annotations fail whoever wrote them, and a narrowed cap below a granted guarantee
/// is refused as the conflict it is.
#[test]
fn errors_do_not_depend_on_trust() {
    for trust in [Trust::Narrow, Trust::Full] {
        let asked = map(&[("gpud.dev/priority", "urgent")]);
        let none = HashMap::new();
        let src = Sources {
            asked: &asked,
            granted: &none,
            name: None,
            kubernetes: true,
        };
        assert!(decide(&src, trust).is_err(), "{trust}");
    }
    let granted = map(&[
        ("gpud.dev/compute-min", "30"),
        ("gpud.dev/compute-max", "50"),
    ]);
    let asked = map(&[("gpud.dev/compute-max", "20")]);
    let err = decide(
        &Sources {
            asked: &asked,
            granted: &granted,
            name: None,
            kubernetes: true,
        },
        Trust::Narrow,
    )
    .expect_err("cap below the granted guarantee");
    assert!(matches!(err, AnnotationError::MinAboveMax { .. }), "{err}");
}

#[test]
fn copies_of_pod_annotations_are_the_pods() {
    let pod = map(&[("gpud.dev/priority", "latency-critical"), ("x", "1")]);
    let container = map(&[
        ("gpud.dev/priority", "latency-critical"),
        ("gpud.dev/memory-max", "8Gi"),
    ]);
    let own = without_pod_copies(&container, &pod);
    assert_eq!(own, map(&[("gpud.dev/memory-max", "8Gi")]));
}

#[test]
fn kubernetes_markers() {
    assert!(kubernetes_container(&map(&[(
        "io.kubernetes.cri.sandbox-id",
        "abc"
    )])));
    assert!(!kubernetes_container(&map(&[("nerdctl/name", "x")])));
}
