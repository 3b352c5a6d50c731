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
const WAIT: Duration = Duration::from_secs(10);

fn annotations(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A pod in the host's network namespace (no CNI) whose cgroups go under `cgroup_parent`.
fn pod_config(name: &str, cgroup_parent: &str) -> cri::PodSandboxConfig {
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
        annotations: HashMap::new(),
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

fn container_config(name: &str, annotations: HashMap<String, String>) -> cri::ContainerConfig {
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
        annotations,
        log_path: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn containerd_container_gets_the_annotated_limits_and_loses_them_on_removal() {
    let mut rig = Rig::new("containerd").fake_gpus(1);
    rig.start(rig.config().set("attribution.sweep_interval_secs", 3600))
        .await;
    rig.wait_for_gpus(1).await;
    let dir = rig.path();
    let parent = Cgroup::new("containerd");
    let containerd = Containerd::start(dir, &parent.rel);
    let plugin = NriPlugin::start(
        &[
            "--socket",
            &containerd.nri_socket.display().to_string(),
            "--bus-address",
            &rig.bus.address,
        ],
        &dir.join("gpud-nri.log"),
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
    let context = || {
        format!(
            "gpud-nri:\n{}\ncontainerd:\n{}",
            plugin.log_text(),
            containerd.log_text()
        )
    };

    let mut cri = containerd.cri();
    let pod = pod_config("work", &parent.rel);
    let pod_id = cri
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(pod.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", context()))
        .into_inner()
        .pod_sandbox_id;

    // An invalid annotation: the plugin refuses CreateContainer, containerd fails it with the
    // plugin's message, and no container is left.
    let refused = cri
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod_id.clone(),
            config: Some(container_config(
                "bad",
                annotations(&[("gpud.dev/memory-max", "8GB")]),
            )),
            sandbox_config: Some(pod.clone()),
        })
        .await;
    let status = refused.expect_err("CreateContainer succeeded despite 8GB");
    assert!(
        status.message().contains("gpud.dev/memory-max") && status.message().contains("8GB"),
        "containerd's error should carry the plugin's message: {status}"
    );

    // A valid one: limits set at StartContainer on the container's own cgroup.
    let id = cri
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod_id.clone(),
            config: Some(container_config(
                "limited",
                annotations(&[
                    ("gpud.dev/memory-max", "1Gi"),
                    ("gpud.dev/compute-max", "30"),
                ]),
            )),
            sandbox_config: Some(pod.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", context()))
        .into_inner()
        .container_id;
    let listed = cri
        .list_containers(cri::ListContainersRequest {
            filter: Some(cri::ContainerFilter {
                id: String::new(),
                pod_sandbox_id: pod_id.clone(),
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
    cri.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", context()));

    // The CRI's cgroupfs driver puts the container at `<pod cgroup parent>/<container id>`.
    let cg = format!("{}/{id}", parent.rel);
    let procs = std::fs::read_to_string(
        cgroup2_root()
            .join(cg.trim_start_matches('/'))
            .join("cgroup.procs"),
    )
    .unwrap_or_default();
    let pid: u32 = procs
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("no process in {cg}\n{}", context()));
    assert_eq!(CgroupFs::path_of_pid(pid).as_deref(), Some(cg.as_str()));
    let want = BTreeMap::from([(
        "all".to_owned(),
        BTreeMap::from([
            ("memory_max".to_owned(), GIB),
            ("compute_max".to_owned(), 30),
        ]),
    )]);
    let set = eventually(WAIT, || async {
        (rig.limits(&cg).await == want).then_some(())
    })
    .await;
    assert!(
        set.is_some(),
        "{cg}: wanted {want:?}, have {:?}\n{}",
        rig.limits(&cg).await,
        context()
    );

    // Stop and remove, as the kubelet does: the plugin clears the limits.
    let started = Instant::now();
    cri.stop_container(cri::StopContainerRequest {
        container_id: id.clone(),
        timeout: 0,
    })
    .await
    .unwrap_or_else(|e| panic!("StopContainer: {e}\n{}", context()));
    cri.remove_container(cri::RemoveContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap_or_else(|e| panic!("RemoveContainer: {e}\n{}", context()));
    let removed = started.elapsed();
    let cleared = eventually(WAIT, || async {
        rig.limits(&cg).await.is_empty().then_some(())
    })
    .await;
    assert!(
        cleared.is_some(),
        "still limited after removal\n{}",
        context()
    );
    println!(
        "stop and remove took {removed:?}; limits cleared {:?} after the stop began",
        started.elapsed()
    );

    cri.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod_id.clone(),
    })
    .await
    .expect("StopPodSandbox");
    cri.remove_pod_sandbox(cri::RemovePodSandboxRequest {
        pod_sandbox_id: pod_id,
    })
    .await
    .expect("RemovePodSandbox");
    let (_c, proxy) = rig.proxy().await;
    let left = proxy.list_limits().await.expect("ListLimits");
    assert!(left.is_empty(), "limits left behind: {left:?}");
}
