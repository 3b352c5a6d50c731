//! The OCI hook end to end: real `runc` (Debian's) runs containers from a busybox rootfs whose
//! `config.json` carries gpud-oci-hook as `createRuntime` and `poststop` hooks and gpud
//! annotations; the real gpud binary on a private dbus-daemon holds the limits. What the tests
//! read back comes from gpud over D-Bus and from the kernel (`/proc/<pid>/cgroup`).
//!
//! The daemons here never sweep (`sweep_interval_secs` is an hour), so a limit that disappears
//! after `runc delete` was cleared by the hook's poststop, not by gpud noticing the cgroup gone.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    path::Path,
    process::Stdio,
    time::Duration,
};

use gpud::cgroupfs::CgroupFs;
use gpud_tests::{
    Cgroup, Rig, TempDir, TestConfig, bin_dir, cgroup2_root, eventually,
    runtime::{Bundle, Runc, hook_args},
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A daemon that never sweeps, rescans `/proc` every second, and only reports crossings.
fn config(rig: &Rig) -> TestConfig {
    rig.config()
        .set("attribution.sweep_interval_secs", 3600)
        .set("attribution.rescan_interval_secs", 1)
        .react_action("notify")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The host pid of a running container's process, from `runc state`.
fn container_pid(runc: &Runc, id: &str) -> u32 {
    let state = runc.state(id).expect("runc state");
    state["pid"].as_u64().expect("pid in runc state") as u32
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn runc_container_gets_the_annotated_limits_and_loses_them_on_delete() {
    // The annotations name GPU 0: gpud checks it against NVML.
    let mut rig = Rig::new("oci-limits").fake_gpus(1);
    rig.start(config(&rig)).await;
    rig.wait_for_gpus(1).await;
    let dir = rig.path();
    let runc = Runc::new(dir);
    let parent = Cgroup::new("oci");
    let cg = format!("{}/ctr1", parent.rel);
    let (records, log) = (dir.join("records"), dir.join("hook.log"));

    let bundle = Bundle::busybox(&dir.join("b1"), &["sleep", "600"], &cg);
    bundle.set_annotations(&[
        ("gpud.dev/memory-max", "8Gi"),
        ("gpud.dev/memory-max.0", "1073741824"),
        ("gpud.dev/compute-max", "30"),
        ("gpud.dev/priority", "best-effort"),
        ("io.example/unrelated", "whatever"),
    ]);
    bundle.set_gpud_hooks(&strs(&hook_args(&rig.bus.address, &records, &log)), &[]);
    let (status, stderr) = runc.run_detached(&bundle, "c1", Stdio::null(), Stdio::null());
    assert!(
        status.success(),
        "runc run: {stderr}\nhook log:\n{}",
        read(&log)
    );

    // runc put the container's process into the cgroup v2 path of its cgroupsPath (also on a
    // hybrid host), and that is the cgroup the hook limited.
    let pid = container_pid(&runc, "c1");
    assert_eq!(CgroupFs::path_of_pid(pid).as_deref(), Some(cg.as_str()));
    let want = BTreeMap::from([
        (
            "0".to_owned(),
            BTreeMap::from([("memory_max".to_owned(), GIB)]),
        ),
        (
            "all".to_owned(),
            BTreeMap::from([
                ("memory_max".to_owned(), 8 * GIB),
                ("compute_max".to_owned(), 30),
                // ListLimits numbers priorities: 2 is best-effort.
                ("priority".to_owned(), 2),
            ]),
        ),
    ]);
    assert_eq!(rig.limits(&cg).await, want, "{}", read(&log));
    let rec = rig.get_cgroup(&cg).await;
    assert_eq!(
        rec.memory_max,
        BTreeMap::from([("0".to_owned(), GIB), ("all".to_owned(), 8 * GIB)])
    );
    let hook_log = read(&log);
    assert!(
        hook_log.contains(&format!("GPU shares set on {cg} (GPU all, 0)")),
        "{hook_log}"
    );
    let record: serde_json::Value =
        serde_json::from_str(&read(&records.join("c1.json"))).expect("hook record");
    assert_eq!(record["cgroup"], cg.as_str());

    // Delete: runc removes the cgroup, then runs poststop, which clears the limits.
    let out = runc.kill_and_delete("c1");
    assert!(
        out.status.success(),
        "runc delete: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(runc.state("c1").is_none());
    assert!(!cgroup2_root().join(cg.trim_start_matches('/')).exists());
    assert!(
        rig.limits(&cg).await.is_empty(),
        "still limited after delete:\n{}\n{}",
        read(&log),
        rig.log_text()
    );
    assert!(read(&log).contains(&format!("GPU shares of {cg} cleared (GPU all, 0)")));
    assert!(!records.join("c1.json").exists(), "record removed");
    // Nothing left to clear: gpud now answers NotFound for that cgroup.
    let (_c, p) = rig.proxy().await;
    match p.clear_limits(&cg, "all", &[]).await {
        Err(zbus::Error::MethodError(name, _, _)) => {
            assert_eq!(name.as_str(), "dev.gpud.Error.NotFound")
        }
        other => panic!("ClearLimits of a removed cgroup without limits: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_annotations_fail_the_container_unless_open_and_an_unreachable_gpud_does_not() {
    let mut rig = Rig::new("oci-fail");
    rig.start(config(&rig)).await;
    let (dir, bus) = (rig.path(), &rig.bus);
    let runc = Runc::new(dir);
    let parent = Cgroup::new("ocifail");
    let records = dir.join("records");

    // Closed (the default) for an invalid annotation: runc run fails with the hook's message,
    // which names the annotation, and no container is left.
    let cg = format!("{}/bad", parent.rel);
    let log = dir.join("bad.log");
    let bundle = Bundle::busybox(&dir.join("bad"), &["sleep", "600"], &cg);
    bundle.set_annotations(&[("gpud.dev/memory-max", "8GB")]);
    bundle.set_gpud_hooks(&strs(&hook_args(&bus.address, &records, &log)), &[]);
    let (status, stderr) = runc.run_detached(&bundle, "bad", Stdio::null(), Stdio::null());
    assert!(!status.success(), "runc run succeeded despite 8GB");
    assert!(
        // (runc's log line escapes the quotes)
        stderr.contains("annotation gpud.dev/memory-max=")
            && stderr.contains("8GB")
            && stderr.contains("unknown suffix"),
        "runc's error should carry the hook's message: {stderr}"
    );
    assert!(
        read(&log).contains("failing the container (closed)"),
        "{}",
        read(&log)
    );
    assert!(runc.state("bad").is_none(), "no container left behind");
    assert!(rig.limits(&cg).await.is_empty());

    // Open for invalid annotations, set in the hook's environment: the container runs, unlimited.
    let cg = format!("{}/open", parent.rel);
    let log = dir.join("open.log");
    let bundle = Bundle::busybox(&dir.join("open"), &["sleep", "600"], &cg);
    bundle.set_annotations(&[("gpud.dev/compute-weight", "0")]);
    bundle.set_gpud_hooks(
        &strs(&hook_args(&bus.address, &records, &log)),
        &["GPUD_ON_INVALID=open"],
    );
    let (status, stderr) = runc.run_detached(&bundle, "open", Stdio::null(), Stdio::null());
    assert!(status.success(), "{stderr}\n{}", read(&log));
    let text = read(&log);
    assert!(
        text.contains("gpud.dev/compute-weight=\"0\"")
            && text.contains("the container runs without GPU shares (open)"),
        "{text}"
    );
    assert!(rig.limits(&cg).await.is_empty());
    runc.kill_and_delete("open");

    // gpud unreachable (nothing listens at the address): open by default, the container runs.
    let nowhere = format!("unix:path={}", dir.join("no-bus").display());
    let cg = format!("{}/unreach", parent.rel);
    let log = dir.join("unreach.log");
    let bundle = Bundle::busybox(&dir.join("unreach"), &["sleep", "600"], &cg);
    bundle.set_annotations(&[("gpud.dev/memory-max", "1Gi")]);
    bundle.set_gpud_hooks(&strs(&hook_args(&nowhere, &records, &log)), &[]);
    let (status, stderr) = runc.run_detached(&bundle, "unreach", Stdio::null(), Stdio::null());
    assert!(status.success(), "{stderr}\n{}", read(&log));
    let text = read(&log);
    assert!(
        text.contains("gpud unreachable") && text.contains("(open)"),
        "{text}"
    );
    runc.kill_and_delete("unreach");

    // ... and closed when asked: the container fails.
    let log = dir.join("unreach-closed.log");
    let mut args = hook_args(&nowhere, &records, &log);
    args.extend(["--on-unreachable".into(), "closed".into()]);
    bundle.set_gpud_hooks(&strs(&args), &[]);
    let (status, stderr) = runc.run_detached(&bundle, "unreach2", Stdio::null(), Stdio::null());
    assert!(!status.success(), "{}", read(&log));
    assert!(stderr.contains("gpud unreachable"), "{stderr}");
    assert!(runc.state("unreach2").is_none());
}

/// A DRA claim granted 8 GiB and 30 % (the hook's `--annotation` arguments, from the claim's CDI
/// spec); the pod's author, whose annotations the runtime copied into the OCI spec, asks for the
/// whole GPU, a guarantee and the top class. On a Kubernetes container (the runtime's markers in
/// the spec) annotations only narrow: the grant holds and every widening key is reported in the
/// hook's log, and gpud learns the workload's names from the runtime's. With gpud unreachable,
/// such a container does not start unenforced.
#[tokio::test(flavor = "multi_thread")]
async fn a_pods_annotations_never_widen_what_its_claim_granted() {
    let mut rig = Rig::new("oci-trust");
    rig.start(config(&rig)).await;
    let (dir, bus) = (rig.path(), &rig.bus);
    let runc = Runc::new(dir);
    let parent = Cgroup::new("ocitrust");
    let records = dir.join("records");
    let pod_asks = [
        ("io.kubernetes.cri.sandbox-id", "0123abcd"),
        ("io.kubernetes.cri.sandbox-namespace", "ml"),
        ("io.kubernetes.cri.sandbox-name", "train-0"),
        ("io.kubernetes.cri.container-name", "app"),
        ("gpud.dev/compute-max", "100"),
        ("gpud.dev/compute-min", "20"),
        ("gpud.dev/priority", "latency-critical"),
        ("gpud.dev/memory-max", "4Gi"),
    ];
    let granted = |bus: &str, log: &Path| {
        let mut args = hook_args(bus, &records, log);
        for a in ["gpud.dev/compute-max=30", "gpud.dev/memory-max=8Gi"] {
            args.extend(["--annotation".to_owned(), a.to_owned()]);
        }
        args
    };

    let cg = format!("{}/app", parent.rel);
    let log = dir.join("app.log");
    let bundle = Bundle::busybox(&dir.join("app"), &["sleep", "600"], &cg);
    bundle.set_annotations(&pod_asks);
    bundle.set_gpud_hooks(&strs(&granted(&bus.address, &log)), &[]);
    let (status, stderr) = runc.run_detached(&bundle, "app", Stdio::null(), Stdio::null());
    assert!(status.success(), "{stderr}\n{}", read(&log));
    // The grant's cap, the pod's lower memory cap; no guarantee, no class.
    let want = BTreeMap::from([(
        "all".to_owned(),
        BTreeMap::from([
            ("memory_max".to_owned(), 4 * GIB),
            ("compute_max".to_owned(), 30),
        ]),
    )]);
    assert_eq!(rig.limits(&cg).await, want, "{}", read(&log));
    let text = read(&log);
    for key in [
        "gpud.dev/compute-max",
        "gpud.dev/compute-min",
        "gpud.dev/priority",
    ] {
        assert!(
            text.contains(&format!("annotation {key}=")) && text.contains("ignored"),
            "{key} not reported: {text}"
        );
    }
    assert!(!text.contains("annotation gpud.dev/memory-max="), "{text}");
    let names = [
        ("namespace", "ml"),
        ("pod", "train-0"),
        ("container", "app"),
    ];
    assert_eq!(
        rig.get_cgroup(&cg).await.workload,
        BTreeMap::from(names.map(|(k, v)| (k.to_owned(), v.to_owned()))),
        "{text}"
    );
    runc.kill_and_delete("app");

    // The same container with gpud unreachable: closed, since the cluster granted its shares.
    let nowhere = format!("unix:path={}", dir.join("no-bus").display());
    let log = dir.join("unreach.log");
    bundle.set_gpud_hooks(&strs(&granted(&nowhere, &log)), &[]);
    let (status, stderr) = runc.run_detached(&bundle, "app2", Stdio::null(), Stdio::null());
    assert!(!status.success(), "started unenforced: {}", read(&log));
    assert!(stderr.contains("gpud unreachable"), "{stderr}");
    assert!(runc.state("app2").is_none());
}

/// The container's `gpud-rm`, spoken to through the pipes runc passed through.
struct InContainer {
    to: std::io::PipeWriter,
    from: BufReader<std::io::PipeReader>,
}

impl InContainer {
    fn send(&mut self, line: &str) -> serde_json::Value {
        writeln!(self.to, "{line}").expect("write to the container");
        self.to.flush().expect("flush");
        let mut out = String::new();
        self.from
            .read_line(&mut out)
            .expect("read from the container");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{line:?} answered {out:?}: {e}"))
    }

    fn ok(&mut self, line: &str) -> u64 {
        let v = self.send(line);
        assert_eq!(v["ok"], true, "{line:?} answered {v}");
        v["handle"].as_u64().unwrap_or(0)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runc_container_using_the_gpu_is_attributed_and_held_to_its_annotated_limit() {
    let Some(mut rig) = Rig::new("oci-gpu").fake_device(1) else {
        return;
    };
    rig.start(config(&rig)).await;
    let (dir, ctl) = (rig.path(), rig.ctl());
    let runc = Runc::new(dir);
    let parent = Cgroup::new("ocigpu");
    let cg = format!("{}/ctr", parent.rel);
    let (records, log) = (dir.join("records"), dir.join("hook.log"));

    // The container runs the RM fixture on the fake control device, bound in as /dev/nvidiactl.
    let bundle = Bundle::busybox(
        &dir.join("b"),
        &["/gpud-rm", "--file", "/dev/nvidiactl"],
        &cg,
    );
    bundle.with_host_libraries();
    bundle.bind(&bin_dir().join("gpud-rm"), "/gpud-rm", true);
    bundle.bind(&ctl, "/dev/nvidiactl", false);
    bundle.set_annotations(&[("gpud.dev/memory-max", "8Mi")]);
    bundle.set_gpud_hooks(&strs(&hook_args(&rig.bus.address, &records, &log)), &[]);
    let (to_reader, to) = std::io::pipe().expect("pipe");
    let (from, from_writer) = std::io::pipe().expect("pipe");
    let (status, stderr) = runc.run_detached(&bundle, "gpu", to_reader.into(), from_writer.into());
    assert!(
        status.success(),
        "runc run: {stderr}\nhook log:\n{}",
        read(&log)
    );
    let mut c = InContainer {
        to,
        from: BufReader::new(from),
    };
    let pid = container_pid(&runc, "gpu");
    assert_eq!(
        c.send("pid")["pid"],
        serde_json::json!(1),
        "pid 1 in its pid namespace"
    );
    assert_eq!(
        rig.limits(&cg)
            .await
            .get("all")
            .and_then(|l| l.get("memory_max")),
        Some(&(8 * MIB))
    );

    // 4 MiB on GPU 0: charged to the container's cgroup; its process is attributed.
    let client = c.ok("client");
    let device = c.ok(&format!("device {client} 0"));
    c.ok(&format!("alloc {client} {device} {}", 4 * MIB));
    let r = rig.expect_memory(&cg, &[("all", 4 * MIB)]).await;
    assert_eq!(r.pids, vec![pid], "{}", rig.log_text());
    assert_eq!(r.memory_max.get("all"), Some(&(8 * MIB)));
    assert_eq!(r.memory_events, 0);

    // 8 MiB more crosses the container's 8 MiB: refused (deny tier) or reported (react tier,
    // action notify). Either way it is the container's limit that counts the crossing.
    let (_conn, proxy) = rig.proxy().await;
    let tier = proxy.enforcement_tier().await.expect("EnforcementTier");
    let crossing = c.send(&format!("alloc {client} {device} {}", 8 * MIB));
    let want_current = if tier == "deny" {
        assert_eq!(crossing["ok"], false, "{crossing}");
        4 * MIB
    } else {
        assert_eq!(crossing["ok"], true, "{crossing}");
        12 * MIB
    };
    let r = eventually(Duration::from_secs(5), || async {
        let r = rig.get_cgroup(&cg).await;
        (r.memory_events == 1).then_some(r)
    })
    .await
    .unwrap_or_else(|| panic!("crossing not counted ({tier}):\n{}", rig.log_text()));
    assert_eq!(r.memory_current.get("all"), Some(&want_current), "{tier}");
    assert_eq!(
        rig.fake().snapshot().used_total(),
        want_current,
        "the fake driver agrees"
    );

    // Delete: the container's memory is released with its file, and the limit cleared.
    drop(c);
    let out = runc.kill_and_delete("gpu");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(rig.limits(&cg).await.is_empty(), "{}", read(&log));
    assert_eq!(rig.fake().snapshot().used_total(), 0);
}

/// The hooks.d files shipped for CRI-O and Podman: their schema, the hook's arguments as the real
/// hook binary takes them, and the annotation condition.
#[test]
fn the_hooks_d_files_run_the_hook_for_containers_with_gpud_annotations() {
    let dir = TempDir::new("hooks-d");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/oci-hooks.d");
    for (file, stage) in [
        ("50-gpud-create.json", "createRuntime"),
        ("50-gpud-poststop.json", "poststop"),
    ] {
        let v: serde_json::Value =
            serde_json::from_str(&read(&root.join(file))).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(v["version"], "1.0.0", "{file}");
        assert_eq!(v["stages"], serde_json::json!([stage]), "{file}");
        let args: Vec<String> = serde_json::from_value(v["hook"]["args"].clone()).expect("args");
        assert_eq!(args.first().map(String::as_str), Some("gpud-oci-hook"));
        assert_eq!(args.last().map(String::as_str), Some(stage), "{file}");
        assert!(
            v["hook"]["path"]
                .as_str()
                .is_some_and(|p| p.ends_with("/gpud-oci-hook"))
        );

        // The condition: a gpud annotation, pod-level or container-scoped, and nothing else.
        let when = v["when"]["annotations"]
            .as_object()
            .expect("when.annotations");
        assert_eq!(when.len(), 1, "{file}");
        let (key, value) = when.iter().next().expect("one condition");
        let (key, value) = (
            regex::Regex::new(key).expect("key pattern"),
            regex::Regex::new(value.as_str().expect("value pattern")).expect("value pattern"),
        );
        for k in [
            "gpud.dev/memory-max",
            "gpud.dev/compute-max.0",
            "train.container.gpud.dev/priority",
        ] {
            assert!(key.is_match(k) && value.is_match("8Gi"), "{file}: {k}");
        }
        for k in [
            "example.com/memory-max",
            "notgpud.dev/memory-max",
            "io.kubernetes.pod.name",
        ] {
            assert!(!key.is_match(k), "{file}: {k}");
        }

        // The real hook takes these arguments (the log file redirected here).
        let log = dir.path().join(format!("{stage}.log"));
        let mut argv: Vec<String> = args[1..].to_vec();
        if let Some(i) = argv.iter().position(|a| a == "--log-file") {
            argv[i + 1] = log.display().to_string();
        }
        argv.splice(
            0..0,
            ["--record-dir".to_owned(), dir.path().display().to_string()],
        );
        let mut child = std::process::Command::new(bin_dir().join("gpud-oci-hook"))
            .args(&argv)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run gpud-oci-hook");
        let state = r#"{"ociVersion":"1.0.2","id":"x1","status":"creating","pid":1,"bundle":"/","annotations":{"gpud.dev/memory-max":"8 GiB"}}"#;
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(state.as_bytes())
            .expect("state");
        let out = child.wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stage == "createRuntime" {
            // Invalid: refused before anything else (closed).
            assert_eq!(out.status.code(), Some(1), "{stderr}");
            assert!(stderr.contains("gpud.dev/memory-max"), "{stderr}");
            assert!(read(&log).contains("failing the container (closed)"));
        } else {
            // Nothing was recorded for x1: nothing to clear, no daemon needed.
            assert_eq!(out.status.code(), Some(0), "{stderr}");
        }
    }
}
