//! The NRI plugin against a test runtime: the real `gpud-nri` binary connects to a unix socket
//! where the test plays the container runtime over the real NRI protocol (NRI's connection
//! multiplexing, ttrpc, the `nri.pkg.api.v1alpha1` services), and sets limits in the real gpud
//! on a private dbus-daemon, on real cgroups.
//!
//! One test speaks the protocol byte by byte (frames, ttrpc headers, protobuf), independently of
//! gpud's own multiplexer, to pin the wire format; the others drive the plugin through the same
//! generated ttrpc code it uses.
//!
//! The daemons never sweep (`sweep_interval_secs` is an hour): limits that disappear were
//! cleared by the plugin.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use gpud_runtime::nri::{
    api::nri::{self, ContainerState},
    mux,
};
use gpud_tests::{
    Cgroup, Daemon, Rig, TempDir, eventually,
    runtime::{NriPlugin, Sleeper, TestRuntime, configure_request, container, ctx, pod},
};
use protobuf::Message as _;
use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const WAIT: Duration = Duration::from_secs(10);

/// CREATE_CONTAINER (4), START_CONTAINER (6), STOP_CONTAINER (10), REMOVE_CONTAINER (11): bit
/// `event - 1` each.
const EVENTS: i32 = (1 << 3) | (1 << 5) | (1 << 9) | (1 << 10);

/// A daemon that never sweeps, and the test runtime in the same directory.
async fn started(tag: &str) -> (Rig, TestRuntime) {
    // Annotations name GPUs 0 and 1: gpud checks them against NVML.
    let mut rig = Rig::new(tag).fake_gpus(2);
    rig.start(rig.config().set("attribution.sweep_interval_secs", 3600))
        .await;
    rig.wait_for_gpus(2).await;
    let rt = TestRuntime::bind(rig.path());
    (rig, rt)
}

/// memory_max by GPU in force on `cgroup`.
async fn limits_of(d: &Daemon, cgroup: &str) -> BTreeMap<String, u64> {
    d.limits(cgroup)
        .await
        .into_iter()
        .filter_map(|(gpu, l)| l.get("memory_max").map(|m| (gpu, *m)))
        .collect()
}

async fn expect_limits(d: &Daemon, plugin: &NriPlugin, cgroup: &str, want: &[(&str, u64)]) {
    let want: BTreeMap<String, u64> = want.iter().map(|(g, b)| ((*g).to_owned(), *b)).collect();
    let got = eventually(WAIT, || async {
        let have = limits_of(d, cgroup).await;
        (have == want).then_some(())
    })
    .await;
    if got.is_none() {
        panic!(
            "{cgroup}: wanted {want:?}, have {:?}\nplugin log:\n{}\ngpud log:\n{}",
            limits_of(d, cgroup).await,
            plugin.log_text(),
            d.log_text()
        );
    }
}

/// A plugin the runtime launched gets no flags: its settings come in `Configure`, from its file
/// in the runtime's NRI configuration directory. Invalid settings are refused and change
/// nothing; valid ones point the plugin at gpud.
#[tokio::test(flavor = "multi_thread")]
async fn the_runtimes_configuration_sets_the_bus_and_bad_configuration_is_refused() {
    let (rig, rt) = started("nri-conf").await;
    let dir = TempDir::new("nri-conf");
    let nowhere = format!("unix:path={}", dir.path().join("no-bus").display());
    let plugin = start_plugin(rig.path(), &rt.socket, &nowhere, &[]);
    let session = rt.accept(WAIT).await;
    #[rustfmt::skip]
    let bad = [
        ("bus = \"unix:path=/x\"", "unknown field `bus`"),
        ("timeout_ms = 0", "timeout_ms must be 1 to 60000"),
        ("on_invalid = \"maybe\"", "unknown variant `maybe`"),
        ("bus_address = 5", "invalid type"),
        ("bus_address = \"a\"\nbus_address = \"b\"", "duplicate key"),
        ("[nri]\nbus_address = \"x\"", "unknown field `nri`"),
    ];
    for (text, says) in bad {
        let err = session
            .configure_with(text)
            .await
            .expect_err("invalid configuration accepted");
        let (code, msg) = status_of(&err);
        assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{text:?}: {msg}");
        assert!(msg.contains(says), "{text:?}: {msg:?} lacks {says:?}");
    }
    // Still pointed nowhere, and open: the container runs without shares.
    session.configure().await.expect("Configure");
    let parent = Cgroup::new("nriconf");
    let (p, c) = one_container(&parent, "1Gi");
    session.start(&p, &c).await.expect("open while unreachable");
    assert!(limits_of(&rig, &parent.rel).await.is_empty());

    let text = format!(
        "# /etc/nri/conf.d/50-gpud.conf\nbus_address = \"{}\"\ntimeout_ms = 1500\non_unreachable = \"closed\"\n",
        rig.bus.address
    );
    session.configure_with(&text).await.expect("Configure");
    session.start(&p, &c).await.expect("StartContainer");
    expect_limits(&rig, &plugin, &parent.rel, &[("all", 1 << 30)]).await;
    assert!(
        plugin
            .log_text()
            .contains("configuration from the runtime applied"),
        "{}",
        plugin.log_text()
    );
}

/// gpud down while a container starts (open: it runs without shares), e.g. restarted after an
/// upgrade, or started after the runtime: the plugin sets the shares once gpud answers again.
#[tokio::test(flavor = "multi_thread")]
async fn shares_missed_while_gpud_was_down_are_set_when_it_is_back() {
    let (mut rig, rt) = started("nri-late").await;
    let plugin = start_plugin(rig.path(), &rt.socket, &rig.bus.address.clone(), &[]);
    let session = rt.accept(WAIT).await;
    session.configure().await.expect("Configure");
    rig.stop();
    let parent = Cgroup::new("nrilate");
    let (p, c) = one_container(&parent, "3Gi");
    session
        .start(&p, &c)
        .await
        .expect("open: the container starts");
    rig.restart().await;
    expect_limits(&rig, &plugin, &parent.rel, &[("all", 3 << 30)]).await;
    // The plugin says so once its calls for the container are done, after the limits are in.
    let said = eventually(WAIT, || async {
        plugin
            .log_text()
            .contains("GPU shares set late")
            .then_some(())
    })
    .await;
    assert!(said.is_some(), "{}", plugin.log_text());
}

/// A pod asking for `memory_max` of `max` and its one created container in `parent`.
fn one_container(parent: &Cgroup, max: &str) -> (nri::PodSandbox, nri::Container) {
    let p = pod("p", "p", &[("gpud.dev/memory-max", max)]);
    let c = container(
        "c",
        &p,
        "c",
        ContainerState::CONTAINER_CREATED,
        0,
        &parent.rel,
        &[],
    );
    (p, c)
}

fn plugin_args<'a>(socket: &'a Path, bus: &'a str, extra: &[&'a str]) -> Vec<String> {
    let mut v = vec![
        "--socket".to_owned(),
        socket.display().to_string(),
        "--bus-address".to_owned(),
        bus.to_owned(),
    ];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

fn start_plugin(dir: &Path, socket: &Path, bus: &str, extra: &[&str]) -> NriPlugin {
    let args = plugin_args(socket, bus, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    NriPlugin::start(&args, &dir.join("plugin.log"))
}

/// systemd-style cgroups (`<slice>:<prefix>:<name>`) made for real under the v2 root, removed on
/// drop.
struct SystemdStyle {
    dirs: Vec<PathBuf>,
    cgroups_path: String,
    rel: String,
}

impl SystemdStyle {
    fn new(tag: &str, id: &str) -> Self {
        let base = format!("gpudt{}{tag}", std::process::id());
        let slice = format!("{base}-pods.slice");
        let rel = format!("/{base}.slice/{slice}/cri-containerd-{id}.scope");
        let root = gpud_tests::cgroup2_root();
        let mut dirs = Vec::new();
        let mut path = root.clone();
        for part in rel.trim_start_matches('/').split('/') {
            path = path.join(part);
            std::fs::create_dir_all(&path).expect("systemd-style cgroup");
            dirs.push(path.clone());
        }
        Self {
            dirs,
            cgroups_path: format!("{slice}:cri-containerd:{id}"),
            rel,
        }
    }
}

impl Drop for SystemdStyle {
    fn drop(&mut self) {
        for d in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn registration_configuration_and_synchronize_of_existing_containers() {
    let (rig, rt) = started("nri-sync").await;
    let mut plugin = start_plugin(
        rig.path(),
        &rt.socket,
        &rig.bus.address,
        &["--name", "gpud-test", "--idx", "10"],
    );
    let session = rt.accept(WAIT).await;
    assert_eq!(session.registration.plugin_name, "gpud-test");
    assert_eq!(session.registration.plugin_idx, "10");
    let cfg = session.configure().await.expect("Configure");
    assert_eq!(cfg.events, EVENTS);

    // Containers that existed before the plugin: a running one with a pid; one known only by
    // its cgroupfs path; one by a systemd-style path; one with an invalid annotation; a
    // stopped one; one without annotations.
    let parent = Cgroup::new("nri");
    let [cg_a, cg_b, cg_c, cg_d, cg_e] = ["a", "b", "c", "d", "e"].map(|n| parent.child(n));
    let [a, b, c, d, e] = [&cg_a, &cg_b, &cg_c, &cg_d, &cg_e].map(|cg| cg.rel.clone());
    let f = SystemdStyle::new("sync", "f0123");
    let a_proc = Sleeper::start_in(&cg_a.dir);
    let c_proc = Sleeper::start_in(&cg_c.dir);
    let p1 = pod(
        "p1",
        "train",
        &[
            ("gpud.dev/memory-max", "2Gi"),
            ("b.container.gpud.dev/memory-max", "1Gi"),
        ],
    );
    let p2 = pod("p2", "infer", &[]);
    use ContainerState::*;
    let first = nri::SynchronizeRequest {
        pods: vec![p1.clone()],
        containers: vec![
            container("ca", &p1, "a", CONTAINER_RUNNING, a_proc.pid, "", &[]),
            container("cb", &p1, "b", CONTAINER_CREATED, 0, &b, &[]),
        ],
        more: true,
        ..Default::default()
    };
    let rpl = session
        .plugin
        .synchronize(ctx(), &first)
        .await
        .expect("Synchronize 1/2");
    assert!(
        rpl.more,
        "a plugin answers `more` as asked while more follows"
    );
    let rest = nri::SynchronizeRequest {
        pods: vec![p2.clone()],
        containers: vec![
            container(
                "cc",
                &p2,
                "c",
                CONTAINER_RUNNING,
                c_proc.pid,
                "",
                &[("gpud.dev/memory-max", "lots")],
            ),
            container(
                "cd",
                &p2,
                "d",
                CONTAINER_STOPPED,
                0,
                &d,
                &[("gpud.dev/memory-max", "1Gi")],
            ),
            container("ce", &p2, "e", CONTAINER_RUNNING, 0, &e, &[]),
            container(
                "cf",
                &p2,
                "f",
                CONTAINER_RUNNING,
                0,
                &f.cgroups_path,
                &[("gpud.dev/memory-max.0", "512Mi")],
            ),
        ],
        more: false,
        ..Default::default()
    };
    let rpl = session
        .plugin
        .synchronize(ctx(), &rest)
        .await
        .expect("Synchronize 2/2 (malformed annotations do not fail it)");
    assert!(!rpl.more);

    expect_limits(&rig, &plugin, &a, &[("all", 2 * GIB)]).await;
    expect_limits(&rig, &plugin, &b, &[("all", GIB)]).await;
    expect_limits(&rig, &plugin, &f.rel, &[("0", 512 * MIB)]).await;
    for (cgroup, why) in [(&c, "invalid"), (&d, "stopped"), (&e, "no annotations")] {
        assert!(limits_of(&rig, cgroup).await.is_empty(), "{why}");
    }
    let log = plugin.log_text();
    assert!(
        log.contains("annotation gpud.dev/memory-max=\"lots\""),
        "the invalid container is reported:\n{log}"
    );

    // The runtime shuts down: the plugin exits cleanly. Limits stay (containers outlive a
    // plugin restart; the next synchronize sets them again).
    session
        .plugin
        .shutdown(ctx(), &nri::Empty::default())
        .await
        .expect("Shutdown");
    assert_eq!(plugin.wait(WAIT).await, Some(0), "{}", plugin.log_text());
    expect_limits(&rig, &plugin, &a, &[("all", 2 * GIB)]).await;
}

fn status_of(e: &ttrpc::Error) -> (ttrpc::Code, String) {
    match e {
        ttrpc::Error::RpcStatus(s) => (
            s.code.enum_value().unwrap_or(ttrpc::Code::UNKNOWN),
            s.message.clone(),
        ),
        other => panic!("not an RPC status: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn container_events_validate_apply_and_clear() {
    let (rig, rt) = started("nri-events").await;
    let plugin = start_plugin(rig.path(), &rt.socket, &rig.bus.address, &[]);
    let session = rt.accept(WAIT).await;
    assert_eq!(
        (
            session.registration.plugin_name.as_str(),
            session.registration.plugin_idx.as_str()
        ),
        ("gpud", "50"),
        "defaults"
    );
    session.configure().await.expect("Configure");
    session
        .plugin
        .synchronize(ctx(), &nri::SynchronizeRequest::default())
        .await
        .expect("Synchronize");

    let parent = Cgroup::new("nriev");
    let p = pod(
        "pod1",
        "web",
        &[
            ("gpud.dev/memory-max", "4Gi"),
            ("gpud.dev/compute-weight", "50"),
        ],
    );

    // CreateContainer with a malformed annotation: refused (closed), naming it.
    let bad = container(
        "bad",
        &p,
        "bad",
        ContainerState::CONTAINER_UNKNOWN,
        0,
        "",
        &[("gpud.dev/memory-max.GPU-zz", "1Gi")],
    );
    let err = session
        .create(&p, &bad)
        .await
        .expect_err("an invalid annotation fails CreateContainer");
    let (code, msg) = status_of(&err);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    assert!(msg.contains("gpud.dev/memory-max.GPU-zz"), "{msg}");
    // The pod's own malformed annotation fails every container of it.
    let bad_pod = pod("pod2", "x", &[("gpud.dev/priority", "urgent")]);
    let plain = container(
        "plain",
        &bad_pod,
        "plain",
        ContainerState::CONTAINER_UNKNOWN,
        0,
        "",
        &[],
    );
    let err = session
        .create(&bad_pod, &plain)
        .await
        .expect_err("invalid pod annotation");
    assert!(status_of(&err).1.contains("gpud.dev/priority"), "{err:?}");

    // Create, then start (the dedicated RPC of NRI >= 0.12): the limits are set at start.
    let cg_a = parent.child("a");
    let a = &cg_a.rel;
    let a_proc = Sleeper::start_in(&cg_a.dir);
    let ca = container(
        "ca",
        &p,
        "a",
        ContainerState::CONTAINER_CREATED,
        a_proc.pid,
        "",
        &[("gpud.dev/memory-max.1", "1Gi")],
    );
    session.create(&p, &ca).await.expect("CreateContainer");
    assert!(limits_of(&rig, a).await.is_empty(), "nothing before start");
    session.start(&p, &ca).await.expect("StartContainer");
    expect_limits(&rig, &plugin, a, &[("1", GIB), ("all", 4 * GIB)]).await;
    // The compute share went to gpud as well (a weight below the default: a pod's annotations
    // only narrow on a Kubernetes node).
    let weight = rig
        .limits(a)
        .await
        .get("all")
        .and_then(|l| l.get("compute_weight").copied());
    assert_eq!(weight, Some(50), "{}", plugin.log_text());
    // Stop clears.
    session.stop(&p, &ca).await.expect("StopContainer");
    expect_limits(&rig, &plugin, a, &[]).await;

    // Older runtimes deliver start and remove as StateChange events.
    let cg_b = parent.child("b");
    let b = &cg_b.rel;
    let cb = container("cb", &p, "b", ContainerState::CONTAINER_CREATED, 0, b, &[]);
    session
        .state_change(nri::Event::START_CONTAINER, &p, &cb)
        .await
        .expect("StateChange start");
    expect_limits(&rig, &plugin, b, &[("all", 4 * GIB)]).await;
    session
        .state_change(nri::Event::REMOVE_CONTAINER, &p, &cb)
        .await
        .expect("StateChange remove");
    expect_limits(&rig, &plugin, b, &[]).await;

    // RemoveContainer clears a container that was never stopped; its cgroup is already gone.
    let cg_c = parent.child("c");
    let c = &cg_c.rel;
    let cc = container("cc", &p, "c", ContainerState::CONTAINER_CREATED, 0, c, &[]);
    session.start(&p, &cc).await.expect("StartContainer c");
    expect_limits(&rig, &plugin, c, &[("all", 4 * GIB)]).await;
    std::fs::remove_dir(&cg_c.dir).expect("remove cgroup c");
    session.remove(&p, &cc).await.expect("RemoveContainer");
    expect_limits(&rig, &plugin, c, &[]).await;

    // Start of a container whose cgroup cannot be found: closed by default.
    let lost = container(
        "lost",
        &p,
        "lost",
        ContainerState::CONTAINER_CREATED,
        0,
        "/gpud-no-such-cgroup/x",
        &[],
    );
    let err = session.start(&p, &lost).await.expect_err("no such cgroup");
    let (code, msg) = status_of(&err);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("NotFound"), "{msg}");
}

/// Every limit in force on `cgroup`, by GPU, once it equals `want` (or panics with the log).
async fn expect_all_limits(
    d: &Daemon,
    plugin: &NriPlugin,
    cgroup: &str,
    want: &[(&str, &[(&str, u64)])],
) {
    let want: BTreeMap<String, BTreeMap<String, u64>> = want
        .iter()
        .map(|(g, l)| {
            let l = l.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
            ((*g).to_owned(), l)
        })
        .collect();
    let got = eventually(WAIT, || async {
        (d.limits(cgroup).await == want).then_some(())
    })
    .await;
    if got.is_none() {
        panic!(
            "{cgroup}: wanted {want:?}, have {:?}\nplugin log:\n{}",
            d.limits(cgroup).await,
            plugin.log_text()
        );
    }
}

/// A pod whose device-plugin grant is a 30 % cap and 8 GiB (the container's own annotations, as
/// the kubelet hands them over) writes pod annotations asking for more: `pod_asks`. The
/// container, started, has `want` in force and the plugin's log names every ignored key.
async fn pod_asks_beyond_its_grant(
    tag: &str,
    pod_asks: &[(&str, &str)],
    want: &[(&str, u64)],
    ignored: &[&str],
) {
    let (rig, rt) = started(tag).await;
    let plugin = start_plugin(rig.path(), &rt.socket, &rig.bus.address, &[]);
    let session = rt.accept(WAIT).await;
    session.configure().await.expect("Configure");
    let parent = Cgroup::new(tag);
    let p = pod("p", "web", pod_asks);
    let proc_ = Sleeper::start_in(&parent.dir);
    let grant = [
        ("gpud.dev/compute-max", "30"),
        ("gpud.dev/memory-max", "8Gi"),
    ];
    // The runtime also copied the pod's annotations into the container's (containerd's
    // `pod_annotations`): copies count as the pod's.
    let mut own: Vec<(&str, &str)> = grant.to_vec();
    own.extend(
        pod_asks
            .iter()
            .filter(|(k, _)| !grant.iter().any(|(g, _)| g == k)),
    );
    let c = container(
        "c",
        &p,
        "app",
        ContainerState::CONTAINER_CREATED,
        proc_.pid,
        "",
        &own,
    );
    session.create(&p, &c).await.expect("CreateContainer");
    session.start(&p, &c).await.expect("StartContainer");
    expect_all_limits(&rig, &plugin, &parent.rel, &[("all", want)]).await;
    let log = plugin.log_text();
    for key in ignored {
        assert!(
            log.contains(&format!("annotation {key}=")) && log.contains("ignored"),
            "{key} not reported:\n{log}"
        );
    }
}

/// A pod sold 30 % of a GPU gives itself the top class: on a Kubernetes node the class is not
/// applied and the cluster's cap stays.
#[tokio::test(flavor = "multi_thread")]
async fn a_pods_priority_annotation_is_ignored_and_the_granted_cap_kept() {
    pod_asks_beyond_its_grant(
        "nritrustprio",
        &[
            ("gpud.dev/priority", "latency-critical"),
            ("gpud.dev/compute-max", "100"),
        ],
        &[("memory_max", 8 * GIB), ("compute_max", 30)],
        &["gpud.dev/priority", "gpud.dev/compute-max"],
    )
    .await;
}

/// A guarantee is the cluster's to give: `compute-min` from an annotation is not applied (it
/// would make every later guarantee on the GPU fail); a lower memory cap is.
#[tokio::test(flavor = "multi_thread")]
async fn a_compute_guarantee_from_an_annotation_is_ignored() {
    pod_asks_beyond_its_grant(
        "nritrustmin",
        &[
            ("gpud.dev/compute-min", "25"),
            ("gpud.dev/memory-max", "2Gi"),
        ],
        &[("memory_max", 2 * GIB), ("compute_max", 30)],
        &["gpud.dev/compute-min"],
    )
    .await;
}

/// With gpud unreachable, a container whose shares the cluster granted (the device plugin's
/// annotations) does not start unenforced by default; one with only the pod's annotations does.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_gpud_fails_a_granted_container_by_default() {
    let dir = TempDir::new("nri-unreach-granted");
    let nowhere = format!("unix:path={}", dir.path().join("no-bus").display());
    let parent = Cgroup::new("nriungrant");
    let rt = TestRuntime::bind(dir.path());
    let _plugin = start_plugin(dir.path(), &rt.socket, &nowhere, &[]);
    let session = rt.accept(WAIT).await;
    session.configure().await.expect("Configure");
    let p = pod("p", "p", &[]);
    let c = container(
        "c",
        &p,
        "c",
        ContainerState::CONTAINER_CREATED,
        0,
        &parent.rel,
        &[("gpud.dev/memory-max", "1Gi")],
    );
    let err = session
        .start(&p, &c)
        .await
        .expect_err("a granted container must not run unenforced");
    let (code, msg) = status_of(&err);
    assert_eq!(code, ttrpc::Code::UNAVAILABLE, "{msg}");
}

/// Two containers of a Kubernetes pod with device-plugin grants (1 GiB and 2 GiB) and a sidecar
/// without one: the pod's cgroup carries the sum, so the sidecar (handed the GPU file, say) is
/// inside the pod's grants; each container keeps its own; a stopped container's grant leaves the
/// pod, the last one takes the pod's limit away. gpud learns each cgroup's workload names.
#[tokio::test(flavor = "multi_thread")]
async fn a_pods_cgroup_carries_the_sum_of_its_containers_grants() {
    let (rig, rt) = started("nri-podsum").await;
    let plugin = start_plugin(rig.path(), &rt.socket, &rig.bus.address, &[]);
    let session = rt.accept(WAIT).await;
    session.configure().await.expect("Configure");
    let kubepods = Cgroup::new("nri-kubepods");
    let pod_cg = kubepods.child("pod0f0b13fe-cea9");
    let p = pod("p", "web", &[]);
    let mut procs = Vec::new();
    let mut containers = Vec::new();
    for (name, grant) in [("a", "1Gi"), ("b", "2Gi")] {
        let cg = pod_cg.child(name);
        let proc_ = Sleeper::start_in(&cg.dir);
        let c = container(
            name,
            &p,
            name,
            ContainerState::CONTAINER_CREATED,
            proc_.pid,
            "",
            &[("gpud.dev/memory-max", grant)],
        );
        session.start(&p, &c).await.expect("StartContainer");
        procs.push((cg, proc_));
        containers.push(c);
    }
    let sidecar = pod_cg.child("sidecar");
    expect_limits(&rig, &plugin, &pod_cg.rel, &[("all", 3 * GIB)]).await;
    expect_limits(&rig, &plugin, &procs[0].0.rel, &[("all", GIB)]).await;
    expect_limits(&rig, &plugin, &procs[1].0.rel, &[("all", 2 * GIB)]).await;
    rig.expect_in_force(&pod_cg.rel, &[("all", 3 * GIB)]).await;
    assert!(limits_of(&rig, &sidecar.rel).await.is_empty());
    let names = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    assert_eq!(
        rig.get_cgroup(&procs[0].0.rel).await.workload,
        names(&[("namespace", "default"), ("pod", "web"), ("container", "a")]),
        "{}",
        plugin.log_text()
    );
    assert_eq!(
        rig.get_cgroup(&pod_cg.rel).await.workload,
        names(&[("namespace", "default"), ("pod", "web")])
    );

    session
        .stop(&p, &containers[0])
        .await
        .expect("StopContainer a");
    expect_limits(&rig, &plugin, &pod_cg.rel, &[("all", 2 * GIB)]).await;
    session
        .stop(&p, &containers[1])
        .await
        .expect("StopContainer b");
    expect_limits(&rig, &plugin, &pod_cg.rel, &[]).await;
}

/// `mode`: the plugin's `--on-unreachable`, `None` for its default.
#[rstest]
#[case::open_by_default(None)]
#[case::closed_on_request(Some("closed"))]
#[tokio::test(flavor = "multi_thread")]
async fn unreachable_gpud_is_open_by_default_and_closed_on_request(#[case] mode: Option<&str>) {
    let label = mode.unwrap_or("default");
    let dir = TempDir::new(&format!("nri-unreach-{label}"));
    let nowhere = format!("unix:path={}", dir.path().join("no-bus").display());
    let parent = Cgroup::new(&format!("nriun-{label}"));
    let (p, c) = one_container(&parent, "1Gi");
    let rt = TestRuntime::bind(dir.path());
    let extra: Vec<&str> = match mode {
        Some(m) => vec!["--on-unreachable", m],
        None => vec![],
    };
    let plugin = start_plugin(dir.path(), &rt.socket, &nowhere, &extra);
    let session = rt.accept(WAIT).await;
    session.configure().await.expect("Configure");
    let r = session.start(&p, &c).await;
    if mode == Some("closed") {
        let err = r.expect_err("closed: the container fails");
        let (code, msg) = status_of(&err);
        assert_eq!(code, ttrpc::Code::UNAVAILABLE, "{msg}");
        assert!(msg.contains("gpud unreachable"), "{msg}");
    } else {
        r.expect("open: the container starts");
        assert!(
            plugin.log_text().contains("runs without GPU shares (open)"),
            "{}",
            plugin.log_text()
        );
    }
}

/// Reads one mux frame: (connection id, payload).
async fn read_frame(s: &mut tokio::net::UnixStream) -> (u32, Vec<u8>) {
    let mut h = [0u8; mux::HEADER_LEN];
    tokio::time::timeout(WAIT, s.read_exact(&mut h))
        .await
        .expect("a frame in time")
        .expect("frame header");
    let id = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).await.expect("frame payload");
    (id, p)
}

/// Reads frames of connection `id` until one whole ttrpc message is in: (stream id, type,
/// payload); asserts every frame is at most 4096 bytes.
async fn read_ttrpc(s: &mut tokio::net::UnixStream, id: u32) -> (u32, u8, Vec<u8>) {
    let mut buf = Vec::new();
    loop {
        let (cid, p) = read_frame(s).await;
        assert_eq!(cid, id, "frame on connection {cid}, expected {id}");
        assert!(
            p.len() <= mux::MAX_WRITE_FRAME,
            "frame of {} bytes",
            p.len()
        );
        buf.extend(p);
        if buf.len() >= 10 {
            let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if buf.len() >= 10 + len {
                assert_eq!(buf.len(), 10 + len, "one message, nothing after it");
                let stream = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
                return (stream, buf[8], buf[10..].to_vec());
            }
        }
    }
}

/// A ttrpc message (10-byte header: length, stream id, type, flags) in mux frames, split the way
/// Go's ttrpc writes through its 4096-byte buffer: a first frame of 4096 bytes, then the rest in
/// one frame.
fn frames(conn: u32, stream: u32, kind: u8, body: &[u8]) -> Vec<u8> {
    let mut msg = Vec::new();
    msg.extend((body.len() as u32).to_be_bytes());
    msg.extend(stream.to_be_bytes());
    msg.extend([kind, 0]);
    msg.extend(body);
    let mut out = Vec::new();
    let (head, tail) = msg.split_at(msg.len().min(4096));
    for chunk in [head, tail] {
        if !chunk.is_empty() {
            out.extend(mux::header(conn, chunk.len()));
            out.extend(chunk);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_plugin_speaks_nri_on_the_wire() {
    let dir = TempDir::new("nri-wire");
    let rt = TestRuntime::bind(dir.path());
    let nowhere = format!("unix:path={}", dir.path().join("no-bus").display());
    let mut plugin = start_plugin(dir.path(), &rt.socket, &nowhere, &[]);
    let mut s = rt.accept_raw(WAIT).await;

    // First thing on the wire: RegisterPlugin, a ttrpc request on connection 2.
    let (stream, kind, payload) = read_ttrpc(&mut s, mux::RUNTIME_SERVICE_CONN).await;
    assert_eq!(kind, 1, "a request");
    assert_eq!(stream % 2, 1, "client streams are odd");
    let req = ttrpc::Request::parse_from_bytes(&payload).expect("ttrpc Request");
    assert_eq!(req.service, "nri.pkg.api.v1alpha1.Runtime");
    assert_eq!(req.method, "RegisterPlugin");
    let reg = nri::RegisterPluginRequest::parse_from_bytes(&req.payload).expect("RegisterPlugin");
    assert_eq!(
        (reg.plugin_name.as_str(), reg.plugin_idx.as_str()),
        ("gpud", "50")
    );

    // Answer it: a ttrpc response (type 2) with an OK status and an empty payload.
    let mut resp = ttrpc::Response::new();
    resp.status = Some(ttrpc::get_status(ttrpc::Code::OK, "")).into();
    resp.payload = nri::Empty::new().write_to_bytes().expect("Empty");
    let body = resp.write_to_bytes().expect("Response");
    s.write_all(&frames(mux::RUNTIME_SERVICE_CONN, stream, 2, &body))
        .await
        .expect("write");

    // Configure, sent as Go's runtime would, big enough (a 6000-byte config) to span frames,
    // with a frame for a connection nobody opened in between (dropped).
    let mut cfg = configure_request();
    cfg.config = "#".repeat(6000);
    let mut req = ttrpc::Request::new();
    req.service = "nri.pkg.api.v1alpha1.Plugin".into();
    req.method = "Configure".into();
    req.payload = cfg.write_to_bytes().expect("ConfigureRequest");
    req.timeout_nano = 2_000_000_000;
    let body = req.write_to_bytes().expect("Request");
    let mut wire = mux::header(9, 4).to_vec();
    wire.extend(b"junk");
    wire.extend(frames(mux::PLUGIN_SERVICE_CONN, 1, 1, &body));
    s.write_all(&wire).await.expect("write");
    let (stream, kind, payload) = read_ttrpc(&mut s, mux::PLUGIN_SERVICE_CONN).await;
    assert_eq!((stream, kind), (1, 2), "the response to stream 1");
    let resp = ttrpc::Response::parse_from_bytes(&payload).expect("ttrpc Response");
    let code = resp
        .status
        .code
        .enum_value()
        .unwrap_or(ttrpc::Code::UNKNOWN);
    assert_eq!(code, ttrpc::Code::OK, "{:?}", resp.status.message);
    let cfg = nri::ConfigureResponse::parse_from_bytes(&resp.payload).expect("ConfigureResponse");
    assert_eq!(cfg.events, EVENTS);

    // An unknown method is answered with an error status, not a dropped connection.
    let mut req = ttrpc::Request::new();
    req.service = "nri.pkg.api.v1alpha1.Plugin".into();
    req.method = "ValidateContainerAdjustment".into();
    let body = req.write_to_bytes().expect("Request");
    s.write_all(&frames(mux::PLUGIN_SERVICE_CONN, 3, 1, &body))
        .await
        .expect("write");
    let (stream, _, payload) = read_ttrpc(&mut s, mux::PLUGIN_SERVICE_CONN).await;
    assert_eq!(stream, 3);
    let resp = ttrpc::Response::parse_from_bytes(&payload).expect("ttrpc Response");
    assert_ne!(
        resp.status.code.enum_value().unwrap_or(ttrpc::Code::OK),
        ttrpc::Code::OK
    );

    // The runtime goes away: the plugin notices and exits (1: connection lost).
    drop(s);
    assert_eq!(plugin.wait(WAIT).await, Some(1), "{}", plugin.log_text());
    assert!(plugin.log_text().contains("connection to the runtime lost"));

    // A name or index NRI would refuse is refused before connecting.
    let mut bad = start_plugin(dir.path(), &rt.socket, &nowhere, &["--idx", "5"]);
    assert_eq!(bad.wait(WAIT).await, Some(1));
    assert!(
        bad.log_text().contains("invalid plugin index"),
        "{}",
        bad.log_text()
    );
}

/// One GPU's limit that gpud refuses (a UUID NVML does not report) never costs the container
/// its other limits: with `--on-invalid open` the container runs with them; closed (the
/// default) it fails, and what was set is still cleared when the runtime removes it.
#[rstest]
#[case::closed_by_default(None)]
#[case::open_on_request(Some("open"))]
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_gpu_limit_never_drops_the_containers_other_limits(#[case] mode: Option<&str>) {
    let label = mode.unwrap_or("default");
    let (rig, rt) = started(&format!("nri-partial-{label}")).await;
    let extra: Vec<&str> = mode.map(|m| vec!["--on-invalid", m]).unwrap_or_default();
    let plugin = start_plugin(rig.path(), &rt.socket, &rig.bus.address, &extra);
    let session = rt.accept(WAIT).await;
    session.configure().await.expect("Configure");
    let parent = Cgroup::new(&format!("nripart-{label}"));
    let p = pod("pod1", "web", &[("gpud.dev/memory-max", "4Gi")]);
    let unknown = "GPU-deadbeef-0000-0000-0000-000000000000";
    let by_unknown = format!("gpud.dev/memory-max.{unknown}");
    let c = container(
        "c",
        &p,
        "c",
        ContainerState::CONTAINER_CREATED,
        0,
        &parent.rel,
        &[("gpud.dev/memory-max.1", "1Gi"), (&by_unknown, "2Gi")],
    );
    let r = session.start(&p, &c).await;
    if mode == Some("open") {
        r.expect("open: the container starts");
    } else {
        let (code, msg) = status_of(&r.expect_err("closed: the container fails"));
        assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
        assert!(msg.contains("no GPU with this UUID"), "{msg}");
    }
    expect_limits(&rig, &plugin, &parent.rel, &[("1", GIB), ("all", 4 * GIB)]).await;
    assert!(
        plugin.log_text().contains(unknown),
        "the refusal names the GPU:\n{}",
        plugin.log_text()
    );
    session.remove(&p, &c).await.expect("RemoveContainer");
    expect_limits(&rig, &plugin, &parent.rel, &[]).await;
}
