use super::*;

const UUID: &str = "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42";

fn shares(pairs: &[(&str, &str)]) -> Shares {
    let granted = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    annotations::resolve(&std::collections::HashMap::new(), &granted, None).expect("valid")
}

#[test]
fn pod_cgroups_as_the_kubelet_names_them() {
    for (container, pod) in [
        (
            "/kubepods/burstable/pod0f0b13fe-cea9-4935/abc123",
            Some("/kubepods/burstable/pod0f0b13fe-cea9-4935"),
        ),
        (
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f0b_13fe.slice/cri-containerd-ab.scope",
            Some(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f0b_13fe.slice",
            ),
        ),
        ("/kubepods/pod12ab/c", Some("/kubepods/pod12ab")),
        ("/system.slice/podman-1.scope", None),
        ("/gpud-test-1-dra-train", None),
        ("/kubepods/pod/c", None),
        ("/kubepods/podzz/c", None),
        ("/c", None),
    ] {
        assert_eq!(pod_cgroup_of(container).as_deref(), pod, "{container}");
    }
}

/// One claim used by two containers is one limit; a second claim on the same GPU adds to it;
/// the claims go with their last container.
#[test]
fn claims_count_once_and_add_up() {
    let dir = std::env::temp_dir().join(format!("gpud-pod-ledger-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ledger = Ledger::new(&dir);
    let pod = "/kubepods/pod12ab";
    let mem = format!("gpud.dev/memory-max.{UUID}");
    let cap = format!("gpud.dev/compute-max.{UUID}");
    let claim = shares(&[(&mem, "8Gi"), (&cap, "30")]);
    let uuid = GpuSelector::Uuid(UUID.into());
    let on = |s: &Shares, k| s.get(&uuid, k).cloned();

    let c = ledger.join(pod, "uid-1", "a", &claim).expect("join a");
    assert!(c.before.is_empty());
    assert_eq!(
        on(&c.after, LimitKind::MemoryMax),
        Some(LimitValue::Number(8 << 30))
    );
    let c = ledger.join(pod, "uid-1", "b", &claim).expect("join b");
    assert_eq!(
        c.before, c.after,
        "the same claim in a second container changes nothing"
    );

    let other = shares(&[(&mem, "2Gi"), (&cap, "80")]);
    let c = ledger.join(pod, "uid-2", "c", &other).expect("join c");
    assert_eq!(
        on(&c.after, LimitKind::MemoryMax),
        Some(LimitValue::Number(10 << 30))
    );
    assert_eq!(
        on(&c.after, LimitKind::ComputeMax),
        Some(LimitValue::Number(100))
    );

    let c = ledger.leave(pod, "a").expect("a leaves");
    assert_eq!(c.before, c.after, "b still uses the claim");
    let c = ledger.leave(pod, "b").expect("b leaves");
    assert_eq!(
        on(&c.after, LimitKind::MemoryMax),
        Some(LimitValue::Number(2 << 30))
    );
    assert!(removed(&c.before, &c.after).is_empty());
    let c = ledger.leave(pod, "c").expect("c leaves");
    assert!(c.after.is_empty());
    assert_eq!(
        removed(&c.before, &c.after),
        vec![(uuid, vec![LimitKind::MemoryMax, LimitKind::ComputeMax])]
    );
    assert_eq!(
        std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0),
        0,
        "no record left"
    );
    // Leaving a pod with no record is nothing.
    assert!(ledger.leave(pod, "z").expect("no record").after.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
