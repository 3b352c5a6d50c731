//! gpud-k8s's device plugin against a test kubelet speaking the real device-plugin API v1beta1
//! (gRPC on unix sockets): registration, ListAndWatch, GetPreferredAllocation, Allocate and
//! PreStartContainer, with the real `gpud-k8s` binary, the real gpud on a private bus and the fake
//! NVML (tests/fake-nvml) as the node's GPUs. The Allocate answer's annotations go through the
//! real `gpud-nri` over the NRI test runtime to gpud, which enforces them on a real cgroup.

mod dra;
mod dra_api;

use std::{collections::BTreeMap, time::Duration};

use gpud_runtime::nri::api::nri::{self, ContainerState};
use gpud_tests::scenario::{Event, Gpu, Scenario, uuid};
use gpud_tests::{
    Cgroup, Rig, eventually,
    kubelet::{DevicePluginProcess, PluginEndpoint, TestKubelet, admit},
    runtime::{NriPlugin, Sleeper, TestRuntime, container, ctx, pod},
};

const GIB: u64 = 1 << 30;
const WAIT: Duration = Duration::from_secs(20);
const MEMORY: &str = "gpud.dev/gpu-memory";
const COMPUTE: &str = "gpud.dev/gpu-compute";

/// `n` test GPUs (`scenario::Gpu::test`) of `gib` GiB; `extra(i, gpu)` changes GPU `i`
/// (topology).
fn scenario(n: u32, gib: u64, extra: impl Fn(u32, &mut Gpu)) -> Scenario {
    let mut s = Scenario::gpus(n);
    for (i, g) in (0..).zip(&mut s.gpus) {
        g.memory_total = gib * GIB;
        extra(i, g);
    }
    s
}

/// gpud (on the rig, with the fake NVML), a test kubelet and the device plugin on one "node".
struct Node {
    rig: Rig,
    kubelet: TestKubelet,
    plugin: DevicePluginProcess,
    starts: u32,
}

impl Node {
    async fn start(tag: &str, scenario: &Scenario) -> Self {
        let mut rig = Rig::new(tag).fake_nvml();
        rig.nvml_scenario(scenario);
        rig.start(
            rig.config()
                .set("attribution.sweep_interval_secs", 3600)
                .set("nvml.sample_interval_ms", 100)
                .set("nvml.retry_interval_secs", 1),
        )
        .await;
        let kubelet = TestKubelet::start(&rig.path().join("device-plugins"));
        let plugin = Self::plugin(&rig, 0);
        Self {
            rig,
            kubelet,
            plugin,
            starts: 1,
        }
    }

    fn plugin(rig: &Rig, n: u32) -> DevicePluginProcess {
        let lib = rig
            .nvml_dir()
            .join("libnvidia-ml.so.1")
            .display()
            .to_string();
        DevicePluginProcess::start(
            &rig.bus.address,
            &rig.path().join("device-plugins"),
            &["--nvml-library", &lib],
            &rig.path().join(format!("gpud-k8s-{n}.log")),
        )
    }

    fn restart_plugin(&mut self) -> Option<i32> {
        let code = self.plugin.stop();
        self.plugin = Self::plugin(&self.rig, self.starts);
        self.starts += 1;
        code
    }
    /// Both registrations (memory, compute), checked against the API's rules, and the kubelet's
    /// connections to them.
    async fn endpoints(&mut self) -> Vec<PluginEndpoint> {
        let mut regs = BTreeMap::new();
        for _ in 0..2 {
            let r = self.kubelet.registration(WAIT).await;
            regs.insert(r.resource_name.clone(), r);
        }
        let mut out = Vec::new();
        for (name, socket) in [
            (MEMORY, "gpud-gpu-memory.sock"),
            (COMPUTE, "gpud-gpu-compute.sock"),
        ] {
            let r = regs
                .remove(name)
                .unwrap_or_else(|| panic!("{name} not registered: {}", self.plugin.log_text()));
            assert_eq!(
                (r.version.as_str(), r.endpoint.as_str()),
                ("v1beta1", socket)
            );
            let o = r.options.unwrap_or_default();
            assert!(
                o.get_preferred_allocation_available && o.pre_start_required,
                "{o:?}"
            );
            out.push(PluginEndpoint::connect(&self.kubelet.dir, r).await);
        }
        out
    }

    async fn limits(&self, cgroup: &str) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.rig.limits(cgroup).await
    }
}

/// What deploy/kubernetes/examples/pod.yaml's container asks of `resource`.
fn example_pod_limit(resource: &str) -> usize {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/kubernetes/examples/pod.yaml");
    let text = std::fs::read_to_string(&path).expect("the example pod");
    let pod: serde_json::Value = serde_saphyr::from_str(&text).expect("YAML");
    let limit = &pod["spec"]["containers"][0]["resources"]["limits"][resource];
    limit
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{resource} in {}: {limit}", path.display()))
}

fn healthy(d: &[gpud_k8s::api::deviceplugin::Device]) -> usize {
    d.iter().filter(|x| x.health == "Healthy").count()
}

/// The GPUs (UUIDs) of some device IDs with their unit counts.
fn per_gpu(ids: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for id in ids {
        let (u, _) = id.rsplit_once("::").unwrap_or((id, ""));
        *m.entry(u.to_owned()).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_asking_8_units_and_30_percent_gets_them_on_one_gpu_enforced_by_gpud() {
    let mut node = Node::start("k8s-e2e", &scenario(2, 16, |_, _| ())).await;
    let mut eps = node.endpoints().await;
    eps[0].devices_where(WAIT, |d| healthy(d) == 32).await;
    eps[1].devices_where(WAIT, |d| healthy(d) == 200).await;

    // The container of the example pod docs/kubernetes.md gives: gpud.dev/gpu-memory: 8 and
    // gpud.dev/gpu-compute: 30.
    let a = admit(
        &mut eps,
        &[
            (0, example_pod_limit(MEMORY)),
            (1, example_pod_limit(COMPUTE)),
        ],
    )
    .await
    .expect("admission");
    let gpu = per_gpu(&a.units[MEMORY]);
    assert_eq!(gpu.len(), 1, "one GPU: {a:?}");
    let (gpu, _) = gpu.into_iter().next().unwrap_or_default();
    assert_eq!(
        per_gpu(&a.units[COMPUTE]),
        [(gpu.clone(), 30)].into(),
        "same GPU: {a:?}"
    );
    assert_eq!(a.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&gpu));
    let want: std::collections::HashMap<String, String> = [
        (format!("gpud.dev/memory-max.{gpu}"), "8Gi".to_owned()),
        (format!("gpud.dev/compute-max.{gpu}"), "30".to_owned()),
    ]
    .into();
    assert_eq!(a.annotations, want);

    // The runtime creates and starts the container with those annotations: the NRI plugin sets
    // them in gpud.
    let rt = TestRuntime::bind(node.rig.path());
    let nri_plugin = NriPlugin::start(
        &[
            "--socket",
            &rt.socket.display().to_string(),
            "--bus-address",
            &node.rig.bus.address,
        ],
        &node.rig.path().join("nri.log"),
    );
    let session = rt.accept(WAIT).await;
    session
        .plugin
        .configure(ctx(), &nri::ConfigureRequest::default())
        .await
        .expect("Configure");
    session
        .plugin
        .synchronize(ctx(), &nri::SynchronizeRequest::default())
        .await
        .expect("Synchronize");
    let cg = Cgroup::new("k8s-ctr");
    let proc_ = Sleeper::start_in(&cg.dir);
    let p = pod("pod1", "train", &[]);
    let annotations: Vec<(&str, &str)> = a
        .annotations
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let c = container(
        "c1",
        &p,
        "train",
        ContainerState::CONTAINER_CREATED,
        proc_.pid,
        "",
        &annotations,
    );
    session
        .create(&p, &c)
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", nri_plugin.log_text()));
    session
        .start(&p, &c)
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}\n{}", nri_plugin.log_text()));
    let want = eight_gib_and_thirty_percent_on(&gpu);
    let got = eventually(WAIT, || async {
        let l = node.limits(&cg.rel).await;
        (l == want).then_some(l)
    })
    .await;
    assert!(
        got.is_some(),
        "limits {:?}\n{}",
        node.limits(&cg.rel).await,
        nri_plugin.log_text()
    );
    let (_conn, proxy) = node.rig.proxy().await;
    let rec = proxy.get_cgroup(&cg.rel).await.expect("GetCgroup");
    assert_eq!(
        rec.memory_max.values().copied().collect::<Vec<_>>(),
        [8 * GIB],
        "{rec:?}"
    );

    // The plugin restarts while the pod runs: it exits cleanly, the limits stay, it registers
    // again, and its next choice counts the running pod (gpud's limits) as taken.
    assert_eq!(node.restart_plugin(), Some(0));
    assert_eq!(
        node.limits(&cg.rel).await,
        want,
        "limits survive the plugin"
    );
    let mut eps2 = node.endpoints().await;
    eps2[0].devices_where(WAIT, |d| healthy(d) == 32).await;
    eps2[1].devices_where(WAIT, |d| healthy(d) == 200).await;
    // The kubelet's checkpoint keeps what was allocated.
    for (new, old) in eps2.iter_mut().zip(&eps) {
        new.allocated = old.allocated.clone();
    }
    // A container asking 80 % compute: the other GPU (only 70 % left on the first).
    let b = admit(&mut eps2, &[(1, 80), (0, 4)])
        .await
        .expect("second admission");
    let other = per_gpu(&b.units[COMPUTE]);
    assert_eq!(other.len(), 1, "{b:?}");
    assert!(!other.contains_key(&gpu), "{b:?}");
    assert_eq!(
        per_gpu(&b.units[MEMORY]),
        per_gpu(&b.units[COMPUTE])
            .into_keys()
            .map(|g| (g, 4))
            .collect()
    );
    drop(nri_plugin);
}

#[tokio::test(flavor = "multi_thread")]
async fn kubelet_restart_reregisters_and_xids_make_a_gpu_unhealthy() {
    let mut node = Node::start("k8s-restart", &scenario(2, 4, |_, _| ())).await;
    let mut eps = node.endpoints().await;
    eps[0].devices_where(WAIT, |d| healthy(d) == 8).await;

    // The kubelet restarts: its socket directory is emptied and kubelet.sock served anew.
    node.kubelet.restart();
    let mut eps = node.endpoints().await;
    eps[0].devices_where(WAIT, |d| healthy(d) == 8).await;
    let before = eps[1].updates();

    // An application's Xid (43) on GPU 0 leaves it healthy; Xid 79 (fell off the bus) on GPU 1
    // makes its units unhealthy in the stream.
    let mut sc = scenario(2, 4, |_, _| ());
    sc.events = vec![Event::xid(0, 43), Event::xid(1, 79)];
    node.rig.nvml_scenario(&sc);
    let gpu1 = uuid(1);
    let d = eps[1].devices_where(WAIT, |d| healthy(d) == 100).await;
    assert!(
        d.iter()
            .all(|x| (x.health == "Healthy") != x.id.starts_with(&gpu1)),
        "GPU 1 unhealthy, GPU 0 healthy"
    );
    assert!(eps[1].updates() > before, "sent as an update of the stream");
    // Allocation avoids it.
    let a = admit(&mut eps, &[(0, 2), (1, 50)])
        .await
        .expect("admission");
    assert_eq!(per_gpu(&a.units[COMPUTE]), [(uuid(0), 50)].into());

    // SIGTERM: a clean exit that removes its sockets.
    assert_eq!(node.plugin.stop(), Some(0), "{}", node.plugin.log_text());
    for s in ["gpud-gpu-memory.sock", "gpud-gpu-compute.sock"] {
        assert!(!node.kubelet.dir.join(s).exists(), "{s} left behind");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_that_cannot_fit_fail_clearly_and_multi_gpu_requests_follow_nvlink() {
    // GPUs 0 and 1 behind one PCIe switch, 2 and 3 joined by two NVLinks, nodes 0 and 1.
    let sc = scenario(4, 8, |i, g| match i {
        0 | 1 => g.pci_switch = Some("sw0".to_owned()),
        2 => (g.numa_node, g.nvlinks) = (1, Some(vec![3, 3])),
        _ => (g.numa_node, g.nvlinks) = (1, Some(vec![2, 2])),
    });
    let mut node = Node::start("k8s-fit", &sc).await;
    let mut eps = node.endpoints().await;
    eps[1].devices_where(WAIT, |d| healthy(d) == 400).await;

    // Two whole GPUs of compute: the NVLink pair.
    let a = admit(&mut eps, &[(1, 200)]).await.expect("200 %");
    assert_eq!(
        per_gpu(&a.units[COMPUTE]),
        [(uuid(2), 100), (uuid(3), 100)].into(),
        "{}",
        node.plugin.log_text()
    );
    // The next two: the PCIe switch pair.
    let b = admit(&mut eps, &[(1, 200)]).await.expect("200 % more");
    assert_eq!(
        per_gpu(&b.units[COMPUTE]),
        [(uuid(0), 100), (uuid(1), 100)].into()
    );
    eps[1].release(&b.units[COMPUTE]);

    // 70 % on each of GPUs 0 and 1: 60 % free on the node, but 40 % fits no single GPU.
    admit(&mut eps, &[(1, 70)]).await.expect("70");
    admit(&mut eps, &[(1, 70)]).await.expect("70");
    let err = admit(&mut eps, &[(1, 40)])
        .await
        .expect_err("40 fits no GPU");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().contains("no GPU has that many free")
            && err.message().contains("gpud.dev/gpu-compute"),
        "{err:?}"
    );
    // More than the node has: the kubelet refuses before asking.
    let err = admit(&mut eps, &[(0, 33)]).await.expect_err("33 of 32");
    assert!(err.message().contains("unavailable"), "{err:?}");
    // Unknown device IDs are refused by the plugin.
    let err = eps[0]
        .client
        .allocate(gpud_k8s::api::deviceplugin::AllocateRequest {
            container_requests: vec![gpud_k8s::api::deviceplugin::ContainerAllocateRequest {
                devices_ids: vec!["nvidia0".into()],
            }],
        })
        .await
        .expect_err("unknown ID");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}

/// The limits the claims and allocations of these tests ask for on `gpu`: 8 GiB and 30 %.
fn eight_gib_and_thirty_percent_on(gpu: &str) -> BTreeMap<String, BTreeMap<String, u64>> {
    BTreeMap::from([(
        gpu.to_owned(),
        BTreeMap::from([
            ("memory_max".to_owned(), 8 * GIB),
            ("compute_max".to_owned(), 30),
        ]),
    )])
}
