//! The OCI hook under the real Podman: Debian's `podman` runs busybox containers with gpud
//! annotations and finds gpud-oci-hook through a hooks.d directory holding the shipped hook
//! definitions (`config/oci-hooks.d`, this build's hook and the test's bus); the real gpud on a
//! private dbus-daemon holds the limits. Podman keeps its storage and state in the test's
//! directory (`gpud_tests::podman`).
//!
//! The daemons here never sweep (`sweep_interval_secs` is an hour), so a limit that disappears
//! after `podman rm` was cleared by the hook's poststop, not by gpud noticing the cgroup gone.

use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, Instant},
};

use gpud::cgroupfs::CgroupFs;
use gpud_tests::{
    Cgroup, Rig, TestConfig, cgroup2_root, eventually, podman::Podman, runtime::hook_args,
};

const GIB: u64 = 1 << 30;

/// A daemon that never sweeps and only reports crossings.
fn config(rig: &Rig) -> TestConfig {
    rig.config()
        .set("attribution.sweep_interval_secs", 3600)
        .react_action("notify")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn podman_container_gets_the_annotated_limits_and_loses_them_on_rm() {
    let mut rig = Rig::new("podman-limits").fake_gpus(1);
    rig.start(config(&rig)).await;
    rig.wait_for_gpus(1).await;
    let dir = rig.path();
    let parent = Cgroup::new("podman");
    let podman = Podman::new(dir, &parent.rel);
    let (records, log) = (dir.join("records"), dir.join("hook.log"));
    let args = hook_args(&rig.bus.address, &records, &log);
    podman.install_gpud_hooks(&args.iter().map(String::as_str).collect::<Vec<_>>());

    let out = podman.run(
        "limited",
        &[
            ("gpud.dev/memory-max", "1Gi"),
            ("gpud.dev/compute-max", "30"),
        ],
        &[],
        &["sleep", "600"],
    );
    assert!(
        out.status.success(),
        "podman run: {}\nhook log:\n{}",
        text(&out),
        read(&log)
    );
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();

    // The container's process is in `<parent>/libpod-<id>` of cgroup v2 (also on a hybrid host,
    // where Podman itself runs in cgroup v1 mode), and that is the cgroup the hook limited.
    let pid: u32 = podman
        .inspect("limited", "{{.State.Pid}}")
        .and_then(|p| p.parse().ok())
        .expect("the container's pid");
    let cg = format!("{}/libpod-{id}", parent.rel);
    assert_eq!(CgroupFs::path_of_pid(pid).as_deref(), Some(cg.as_str()));
    let want = BTreeMap::from([(
        "all".to_owned(),
        BTreeMap::from([
            ("memory_max".to_owned(), GIB),
            ("compute_max".to_owned(), 30),
        ]),
    )]);
    assert_eq!(
        rig.limits(&cg).await,
        want,
        "hook log:\n{}\n{}",
        read(&log),
        rig.log_text()
    );
    assert!(records.join(format!("{id}.json")).exists(), "hook record");

    // The shipped `when` condition: a container without gpud annotations gets no hook at all.
    let out = podman.run(
        "plain",
        &[("io.example/other", "1")],
        &[],
        &["sleep", "600"],
    );
    assert!(out.status.success(), "podman run: {}", text(&out));
    let plain = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        !read(&log).contains(&plain[..12]) && !records.join(format!("{plain}.json")).exists(),
        "the hook ran for a container without gpud annotations:\n{}",
        read(&log)
    );

    // `podman rm --force`: runc removes the cgroup, the poststop hook clears the limits, and
    // that has happened by the time `podman rm` returns.
    let started = Instant::now();
    let out = podman.rm("limited");
    assert!(out.status.success(), "podman rm: {}", text(&out));
    let rm_took = started.elapsed();
    assert!(!cgroup2_root().join(cg.trim_start_matches('/')).exists());
    assert!(
        eventually(Duration::from_secs(5), || async {
            rig.limits(&cg).await.is_empty().then_some(())
        })
        .await
        .is_some(),
        "still limited after podman rm:\n{}\n{}",
        read(&log),
        rig.log_text()
    );
    println!(
        "podman rm took {rm_took:?}; limits cleared {:?} after it began",
        started.elapsed()
    );
    assert!(
        read(&log).contains(&format!("GPU shares of {cg} cleared")),
        "{}",
        read(&log)
    );
    assert!(
        !records.join(format!("{id}.json")).exists(),
        "record removed"
    );
    assert_eq!(podman.all_ids(), vec![plain]);
}

#[tokio::test(flavor = "multi_thread")]
async fn podman_refuses_a_container_with_an_invalid_annotation_and_leaves_nothing_behind() {
    let mut rig = Rig::new("podman-invalid");
    rig.start(config(&rig)).await;
    let dir = rig.path();
    let parent = Cgroup::new("podmanbad");
    let podman = Podman::new(dir, &parent.rel);
    let (records, log) = (dir.join("records"), dir.join("hook.log"));
    let args = hook_args(&rig.bus.address, &records, &log);
    podman.install_gpud_hooks(&args.iter().map(String::as_str).collect::<Vec<_>>());

    // Closed (the default): the hook fails createRuntime, runc fails the container, and Podman's
    // error carries the hook's message naming the annotation.
    let out = podman.run(
        "bad",
        &[("gpud.dev/memory-max", "8GB")],
        &["--rm"],
        &["sleep", "600"],
    );
    let msg = text(&out);
    assert!(!out.status.success(), "podman run succeeded despite 8GB");
    assert!(
        msg.contains("gpud.dev/memory-max") && msg.contains("unknown suffix"),
        "podman's error should carry the hook's message: {msg}"
    );
    assert!(
        read(&log).contains("failing the container (closed)"),
        "{}",
        read(&log)
    );

    // Nothing left: no container (`--rm`), no container cgroup under the parent (on a unified
    // host Podman's `conmon` cgroup may be there: its monitor's, not a container's), no record,
    // no limits.
    assert_eq!(podman.all_ids(), Vec::<String>::new());
    let children: Vec<_> = std::fs::read_dir(&parent.dir)
        .expect("parent cgroup")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir() && e.file_name() != "conmon")
        .map(|e| e.file_name())
        .collect();
    assert!(children.is_empty(), "cgroups left behind: {children:?}");
    let left: Vec<_> = std::fs::read_dir(&records)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "hook records left behind: {left:?}");
    let (_c, proxy) = rig.proxy().await;
    let listed = proxy.list_limits().await.expect("ListLimits");
    assert!(listed.is_empty(), "limits left behind: {listed:?}");
}

/// gpud started before its NVML library is there: a container naming GPU 0 by index and GPU 1
/// by UUID starts with the all-GPU and the index-keyed limits in force at once and the UUID-keyed
/// one stored; once the library appears and NVML names GPU 1, that one is in force too. A limit
/// that waits never costs the container its other limits.
#[tokio::test(flavor = "multi_thread")]
async fn podman_container_gets_every_limit_it_can_while_nvml_is_not_answering() {
    let mut rig = Rig::new("podman-nonvml");
    let lib_dir = rig.path().join("nvml");
    rig.start(config(&rig).nvml(&lib_dir.join("libnvidia-ml.so.1")))
        .await;
    let dir = rig.path();
    let parent = Cgroup::new("podman-nonvml");
    let podman = Podman::new(dir, &parent.rel);
    let (records, log) = (dir.join("records"), dir.join("hook.log"));
    let args = hook_args(&rig.bus.address, &records, &log);
    podman.install_gpud_hooks(&args.iter().map(String::as_str).collect::<Vec<_>>());

    let second = gpud_tests::scenario::uuid(1);
    let by_uuid = format!("gpud.dev/memory-max.{second}");
    let out = podman.run(
        "early",
        &[
            ("gpud.dev/memory-max", "16Gi"),
            ("gpud.dev/memory-max.0", "8Gi"),
            (&by_uuid, "2Gi"),
        ],
        &[],
        &["sleep", "600"],
    );
    assert!(
        out.status.success(),
        "podman run: {}\nhook log:\n{}",
        text(&out),
        read(&log)
    );
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let cg = format!("{}/libpod-{id}", parent.rel);
    let memory = |gib: u64| BTreeMap::from([("memory_max".to_owned(), gib * GIB)]);
    let want = BTreeMap::from([
        ("all".to_owned(), memory(16)),
        ("0".to_owned(), memory(8)),
        (second.clone(), memory(2)),
    ]);
    assert_eq!(
        rig.limits(&cg).await,
        want,
        "hook log:\n{}\n{}",
        read(&log),
        rig.log_text()
    );
    rig.expect_in_force(&cg, &[("all", 16 * GIB), ("0", 8 * GIB)])
        .await;

    gpud_tests::install_fake_nvml(&lib_dir);
    gpud_tests::write_nvml_scenario(&lib_dir, &gpud_tests::scenario::Scenario::gpus(2));
    rig.wait_for_gpus(2).await;
    rig.expect_in_force(&cg, &[("all", 16 * GIB), ("0", 8 * GIB), ("1", 2 * GIB)])
        .await;

    // The hook's record names every GPU it set, the pending one too: poststop clears them all.
    let out = podman.rm("early");
    assert!(out.status.success(), "podman rm: {}", text(&out));
    assert!(
        rig.limits(&cg).await.is_empty(),
        "still limited after podman rm:\n{}\n{}",
        read(&log),
        rig.log_text()
    );
}
