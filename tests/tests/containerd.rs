//! The NRI plugin under the real containerd 1.7: `gpud-nri` connects to the NRI socket of a
//! containerd started by the test (`gpud_tests::containerd`), and the test drives containerd's
//! CRI as a kubelet would: a pod sandbox, then a container with gpud annotations. The real gpud
//! on a private dbus-daemon holds the limits.
//!
//! The daemon never sweeps (`sweep_interval_secs` is an hour), so limits that disappear were
//! cleared by the plugin.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use gpud::cgroupfs::CgroupFs;
use gpud_tests::{
    Cgroup, Rig, cgroup2_root,
    containerd::{Containerd, IMAGE, cri},
    eventually,
    runtime::NriPlugin,
};

const GIB: u64 = 1 << 30;

type Cri = cri::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>;
const WAIT: Duration = Duration::from_secs(10);

/// A pod in the host's network namespace (no CNI) whose cgroups go under `cgroup_parent`, with
/// pod annotations.
fn pod_config(
    name: &str,
    cgroup_parent: &str,
    annotations: &[(&str, &str)],
) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.to_owned(),
            uid: format!("uid-{name}"),
            namespace: "default".to_owned(),
            attempt: 0,
        }),
        hostname: String::new(),
        log_directory: String::new(),
        labels: HashMap::new(),
        annotations: annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: cgroup_parent.to_owned(),
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node.into(),
                    pid: cri::NamespaceMode::Container.into(),
                    ipc: cri::NamespaceMode::Pod.into(),
                }),
            }),
        }),
    }
}

fn container_config(name: &str, annotations: &[(&str, &str)]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.to_owned(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: IMAGE.to_owned(),
        }),
        command: vec!["sleep".to_owned(), "600".to_owned()],
        args: Vec::new(),
        labels: HashMap::new(),
        annotations: annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        log_path: String::new(),
    }
}

/// gpud (never sweeping, one fake GPU), a test cgroup for the pods, and containerd.
async fn started(tag: &str) -> (Rig, Cgroup, Containerd) {
    let mut rig = Rig::new(tag).fake_gpus(1);
    rig.start(rig.config().set("attribution.sweep_interval_secs", 3600))
        .await;
    rig.wait_for_gpus(1).await;
    let parent = Cgroup::new(tag);
    let containerd = Containerd::start(rig.path(), &parent.rel);
    (rig, parent, containerd)
}

/// `gpud-nri` on containerd's NRI socket, once registered and synchronized.
async fn plugin(rig: &Rig, containerd: &Containerd) -> NriPlugin {
    let plugin = NriPlugin::start(
        &[
            "--socket",
            &containerd.nri_socket.display().to_string(),
            "--bus-address",
            &rig.bus.address,
        ],
        &rig.path().join("gpud-nri.log"),
    );
    eventually(WAIT, || async {
        plugin
            .log_text()
            .contains("synchronized with the runtime")
            .then_some(())
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "gpud-nri did not register:\n{}\ncontainerd:\n{}",
            plugin.log_text(),
            containerd.log_text()
        )
    });
    plugin
}

/// `RunPodSandbox` of a pod named `name`: its id and configuration.
async fn run_pod(
    cri: &mut Cri,
    name: &str,
    cgroup_parent: &str,
) -> (String, cri::PodSandboxConfig) {
    run_annotated_pod(cri, name, cgroup_parent, &[]).await
}

/// [`run_pod`] with pod annotations.
async fn run_annotated_pod(
    cri: &mut Cri,
    name: &str,
    cgroup_parent: &str,
    annotations: &[(&str, &str)],
) -> (String, cri::PodSandboxConfig) {
    let pod = pod_config(name, cgroup_parent, annotations);
    let id = cri
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(pod.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}"))
        .into_inner()
        .pod_sandbox_id;
    (id, pod)
}

/// `CreateContainer` of `sleep 600` named `name` in the pod, with `annotations`.
async fn create(
    cri: &mut Cri,
    pod: &(String, cri::PodSandboxConfig),
    name: &str,
    annotations: &[(&str, &str)],
) -> Result<String, tonic::Status> {
    cri.create_container(cri::CreateContainerRequest {
        pod_sandbox_id: pod.0.clone(),
        config: Some(container_config(name, annotations)),
        sandbox_config: Some(pod.1.clone()),
    })
    .await
    .map(|r| r.into_inner().container_id)
}

/// `StartContainer`; the container's cgroup, which the CRI's cgroupfs driver puts at
/// `<pod cgroup parent>/<container id>`, checked against its process's.
async fn start(cri: &mut Cri, id: &str, cgroup_parent: &str) -> String {
    cri.start_container(cri::StartContainerRequest {
        container_id: id.to_owned(),
    })
    .await
    .unwrap_or_else(|e| panic!("StartContainer: {e}"));
    let cg = format!("{cgroup_parent}/{id}");
    let procs = cgroup2_root()
        .join(cg.trim_start_matches('/'))
        .join("cgroup.procs");
    let pid: u32 = std::fs::read_to_string(&procs)
        .unwrap_or_default()
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("no process in {cg}"));
    assert_eq!(CgroupFs::path_of_pid(pid).as_deref(), Some(cg.as_str()));
    cg
}

/// `StopContainer` (no grace period) and `RemoveContainer`, as the kubelet does.
async fn stop_and_remove(cri: &mut Cri, id: &str) {
    cri.stop_container(cri::StopContainerRequest {
        container_id: id.to_owned(),
        timeout: 0,
    })
    .await
    .unwrap_or_else(|e| panic!("StopContainer: {e}"));
    cri.remove_container(cri::RemoveContainerRequest {
        container_id: id.to_owned(),
    })
    .await
    .unwrap_or_else(|e| panic!("RemoveContainer: {e}"));
}

/// `StopPodSandbox` and `RemovePodSandbox`.
async fn remove_pod(cri: &mut Cri, pod: &(String, cri::PodSandboxConfig)) {
    cri.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod.0.clone(),
    })
    .await
    .expect("StopPodSandbox");
    cri.remove_pod_sandbox(cri::RemovePodSandboxRequest {
        pod_sandbox_id: pod.0.clone(),
    })
    .await
    .expect("RemovePodSandbox");
}

/// What `memory-max: 1Gi` and `compute-max: 30` set.
fn want() -> BTreeMap<String, BTreeMap<String, u64>> {
    BTreeMap::from([(
        "all".to_owned(),
        BTreeMap::from([
            ("memory_max".to_owned(), GIB),
            ("compute_max".to_owned(), 30),
        ]),
    )])
}

const ANNOTATIONS: &[(&str, &str)] = &[
    ("gpud.dev/memory-max", "1Gi"),
    ("gpud.dev/compute-max", "30"),
];

/// Waits until gpud holds `want` for `cg`; panics with the logs if it does not.
async fn expect_limits(
    rig: &Rig,
    cg: &str,
    want: &BTreeMap<String, BTreeMap<String, u64>>,
    plugin: &NriPlugin,
    containerd: &Containerd,
) {
    let got = eventually(WAIT, || async {
        (rig.limits(cg).await == *want).then_some(())
    })
    .await;
    if got.is_none() {
        panic!(
            "{cg}: wanted {want:?}, have {:?}\ngpud-nri:\n{}\ncontainerd:\n{}",
            rig.limits(cg).await,
            plugin.log_text(),
            containerd.log_text()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn containerd_container_gets_the_annotated_limits_and_loses_them_on_removal() {
    let (rig, parent, containerd) = started("containerd").await;
    let plugin = plugin(&rig, &containerd).await;
    let mut cri = containerd.cri();
    let pod = run_pod(&mut cri, "work", &parent.rel).await;

    // An invalid annotation: the plugin refuses CreateContainer, containerd fails it with the
    // plugin's message, and no container is left.
    let status = create(&mut cri, &pod, "bad", &[("gpud.dev/memory-max", "8GB")])
        .await
        .expect_err("CreateContainer succeeded despite 8GB");
    assert!(
        status.message().contains("gpud.dev/memory-max") && status.message().contains("8GB"),
        "containerd's error should carry the plugin's message: {status}"
    );

    // A valid one: limits set at StartContainer on the container's own cgroup.
    let id = create(&mut cri, &pod, "limited", ANNOTATIONS)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", plugin.log_text()));
    let listed = cri
        .list_containers(cri::ListContainersRequest {
            filter: Some(cri::ContainerFilter {
                id: String::new(),
                pod_sandbox_id: pod.0.clone(),
            }),
        })
        .await
        .expect("ListContainers")
        .into_inner()
        .containers;
    assert_eq!(
        listed.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
        vec![id.as_str()],
        "only the valid container exists"
    );
    let cg = start(&mut cri, &id, &parent.rel).await;
    expect_limits(&rig, &cg, &want(), &plugin, &containerd).await;

    // Stop and remove: the plugin clears the limits.
    let started = Instant::now();
    stop_and_remove(&mut cri, &id).await;
    let removed = started.elapsed();
    expect_limits(&rig, &cg, &BTreeMap::new(), &plugin, &containerd).await;
    println!(
        "stop and remove took {removed:?}; limits cleared {:?} after the stop began",
        started.elapsed()
    );
    remove_pod(&mut cri, &pod).await;
    let (_c, proxy) = rig.proxy().await;
    let left = proxy.list_limits().await.expect("ListLimits");
    assert!(left.is_empty(), "limits left behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn containerd_container_started_before_the_plugin_gets_its_limits_when_it_registers() {
    let (rig, parent, containerd) = started("containerd-sync").await;
    let mut cri = containerd.cri();
    let pod = run_pod(&mut cri, "early", &parent.rel).await;
    let id = create(&mut cri, &pod, "early", ANNOTATIONS)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
    let cg = start(&mut cri, &id, &parent.rel).await;
    assert!(rig.limits(&cg).await.is_empty(), "no plugin yet");

    // The plugin registers; containerd's Synchronize lists the running container.
    let plugin = plugin(&rig, &containerd).await;
    expect_limits(&rig, &cg, &want(), &plugin, &containerd).await;
    assert!(
        plugin.log_text().contains("with_shares=1"),
        "{}",
        plugin.log_text()
    );

    stop_and_remove(&mut cri, &id).await;
    expect_limits(&rig, &cg, &BTreeMap::new(), &plugin, &containerd).await;
    remove_pod(&mut cri, &pod).await;
}

/// The example pod of docs/runtime-integration.md ("A pod"), plus a limit on the second GPU by
/// UUID, started while gpud's NVML library is not there yet (as at boot, before the driver's
/// library is installed or answers): every limit that needs no NVML is in force at once (all GPUs,
/// GPU 0 by index, the container-scoped compute cap and the lower priority class; the higher one
/// is the pod's own word and ignored on a Kubernetes pod); the UUID-keyed one is
/// stored and pending, and in force once NVML appears and names the GPU. Nothing is rolled back
/// because one GPU's limit waits.
#[tokio::test(flavor = "multi_thread")]
async fn containerd_pod_gets_every_limit_it_can_while_nvml_is_not_answering() {
    let mut rig = Rig::new("containerd-nonvml");
    let lib_dir = rig.path().join("nvml");
    rig.start(
        rig.config()
            .nvml(&lib_dir.join("libnvidia-ml.so.1"))
            .set("attribution.sweep_interval_secs", 3600),
    )
    .await;
    let parent = Cgroup::new("containerd-nonvml");
    let containerd = Containerd::start(rig.path(), &parent.rel);
    let plugin = plugin(&rig, &containerd).await;
    let mut cri = containerd.cri();

    let second = gpud_tests::scenario::uuid(1);
    let by_uuid = format!("gpud.dev/memory-max.{second}");
    let pod = run_annotated_pod(
        &mut cri,
        "train-and-serve",
        &parent.rel,
        &[
            ("gpud.dev/memory-max", "16Gi"),
            ("gpud.dev/memory-max.0", "8Gi"),
            (&by_uuid, "2Gi"),
            ("serve.container.gpud.dev/memory-max", "4Gi"),
            ("serve.container.gpud.dev/priority", "latency-critical"),
            ("train.container.gpud.dev/compute-max", "70"),
            ("train.container.gpud.dev/priority", "best-effort"),
        ],
    )
    .await;
    let mut cgroups = BTreeMap::new();
    for name in ["train", "serve"] {
        let id = create(&mut cri, &pod, name, &[])
            .await
            .unwrap_or_else(|e| panic!("CreateContainer {name}: {e}\n{}", plugin.log_text()));
        cgroups.insert(name, (id.clone(), start(&mut cri, &id, &parent.rel).await));
    }
    let limits = |all: &[(&str, u64)]| {
        BTreeMap::from([
            (
                "all".to_owned(),
                all.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
            ),
            (
                "0".to_owned(),
                BTreeMap::from([("memory_max".to_owned(), 8 * GIB)]),
            ),
            (
                second.clone(),
                BTreeMap::from([("memory_max".to_owned(), 2 * GIB)]),
            ),
        ])
    };
    // Priority as listed: 0 latency-critical, 2 best-effort.
    let train = limits(&[
        ("memory_max", 16 * GIB),
        ("compute_max", 70),
        ("priority", 2),
    ]);
    // serve's latency-critical is the pod's own word on a Kubernetes pod: not applied (only the
    // cluster grants a class above normal), and said in the plugin's log.
    let serve = limits(&[("memory_max", 4 * GIB)]);
    let (train_cg, serve_cg) = (&cgroups["train"].1, &cgroups["serve"].1);
    expect_limits(&rig, train_cg, &train, &plugin, &containerd).await;
    expect_limits(&rig, serve_cg, &serve, &plugin, &containerd).await;
    assert!(
        !plugin.log_text().contains("without GPU shares"),
        "{}",
        plugin.log_text()
    );
    assert!(
        plugin
            .log_text()
            .contains(r#"annotation serve.container.gpud.dev/priority="latency-critical" ignored"#),
        "{}",
        plugin.log_text()
    );
    // In the kernel now: all GPUs and GPU 0; GPU 1 (the UUID) waits for NVML.
    for (cg, all) in [(train_cg, 16 * GIB), (serve_cg, 4 * GIB)] {
        rig.expect_in_force(cg, &[("all", all), ("0", 8 * GIB)])
            .await;
    }

    // NVML appears (the library installed, two GPUs): the UUID names GPU 1, in force there.
    gpud_tests::install_fake_nvml(&lib_dir);
    gpud_tests::write_nvml_scenario(&lib_dir, &gpud_tests::scenario::Scenario::gpus(2));
    rig.wait_for_gpus(2).await;
    for (cg, all) in [(train_cg, 16 * GIB), (serve_cg, 4 * GIB)] {
        rig.expect_in_force(cg, &[("all", all), ("0", 8 * GIB), ("1", 2 * GIB)])
            .await;
    }

    for name in ["train", "serve"] {
        stop_and_remove(&mut cri, &cgroups[name].0).await;
    }
    expect_limits(&rig, train_cg, &BTreeMap::new(), &plugin, &containerd).await;
    expect_limits(&rig, serve_cg, &BTreeMap::new(), &plugin, &containerd).await;
    remove_pod(&mut cri, &pod).await;
}
