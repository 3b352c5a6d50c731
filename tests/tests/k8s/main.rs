//! gpud-k8s's device plugin against a test kubelet speaking the real device-plugin API v1beta1
//! (gRPC on unix sockets): registration, ListAndWatch, GetPreferredAllocation, Allocate and
//! PreStartContainer, with the real `gpud-k8s` binary, the real gpud on a private bus and the fake
//! NVML (tests/fake-nvml) as the node's GPUs. The Allocate answer's annotations go through the
//! real `gpud-nri` over the NRI test runtime to gpud, which enforces them on a real cgroup.

mod dra;

use std::{collections::BTreeMap, path::Path, time::Duration};

use gpud_runtime::nri::api::nri::{self, ContainerState};
use gpud_tests::scenario::{Event, Gpu, Scenario, uuid};
use gpud_tests::{
    Cgroup, Rig,
    apiserver::TestApiServer,
    eventually,
    kubelet::{DevicePluginProcess, PluginEndpoint, TestKubelet, admit},
    runtime::{NriPlugin, Sleeper, TestRuntime, container, ctx, pod},
};
use serde_json::json;

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

    // The container asks for gpud.dev/gpu-memory: 8 and gpud.dev/gpu-compute: 30.
    let a = admit(&mut eps, &[(0, 8), (1, 30)])
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

#[tokio::test(flavor = "multi_thread")]
async fn dra_plugin_registers_publishes_capacity_and_prepares_a_claim_into_gpud_limits() {
    use gpud_k8s::api::{
        dra::{self as pb, dra_plugin_client::DraPluginClient},
        pluginregistration::{self as reg, registration_client::RegistrationClient},
    };
    let node = Node::start("k8s-dra", &scenario(1, 16, |_, _| ())).await;
    let gpu = uuid(0);
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "namespace": "default", "name": "train-gpu", "uid": "uid-1" },
        "spec": { "devices": { "requests": [{ "name": "gpu",
            "exactly": { "deviceClassName": "gpud-gpu" } }] } },
        "status": { "allocation": { "devices": { "results": [
            { "request": "gpu", "driver": "gpu.gpud.dev", "pool": "node1", "device": "gpu-0",
              "consumedCapacity": { "memory": "8Gi", "compute": "30" } } ] } } },
    });
    let api = TestApiServer::start("dra-token").await;
    api.put(claim);
    let d = node.rig.path();
    let kubeconfig = d.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let log = d.join("dra.log");
    let child = std::process::Command::new(gpud_tests::bin_dir().join("gpud-k8s"))
        .args([
            "--log",
            "debug",
            "--bus-address",
            &node.rig.bus.address,
            "dra",
            "--node-name",
            "node1",
        ])
        .arg("--registry-dir")
        .arg(d.join("registry"))
        .arg("--plugin-dir")
        .arg(d.join("plugins"))
        .arg("--cdi-dir")
        .arg(d.join("cdi"))
        .arg("--oci-hook")
        .arg(gpud_tests::bin_dir().join("gpud-oci-hook"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--health-interval-ms", "200"])
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("start gpud-k8s dra");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Kill(child);
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();

    // The ResourceSlice: one device with memory and compute as consumable capacity.
    let slice = eventually(WAIT, || async { api.object("resourceslices", "", SLICE) }).await;
    let slice = slice.unwrap_or_else(|| panic!("no ResourceSlice:\n{}", logs()));
    assert_eq!(slice["spec"]["pool"]["generation"], 1);
    let dev = &slice["spec"]["devices"][0];
    assert_eq!(
        (
            slice["spec"]["driver"].as_str(),
            slice["spec"]["nodeName"].as_str()
        ),
        (Some("gpu.gpud.dev"), Some("node1"))
    );
    assert_eq!(
        dev["capacity"]["memory"]["value"],
        (16u64 << 30).to_string()
    );
    assert_eq!(dev["capacity"]["compute"]["value"], "100");
    assert_eq!(dev["attributes"]["uuid"]["string"], gpu.as_str());

    // The kubelet's plugin watcher: GetInfo on the registration socket, then the status.
    let reg_sock = d.join("registry/gpu.gpud.dev-reg.sock");
    eventually(WAIT, || async { reg_sock.exists().then_some(()) })
        .await
        .expect("registration socket");
    let mut rc = RegistrationClient::new(gpud_k8s::grpc::unix_channel(&reg_sock));
    let info = rc
        .get_info(reg::InfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner();
    assert_eq!(
        (info.r#type.as_str(), info.name.as_str()),
        ("DRAPlugin", "gpu.gpud.dev")
    );
    assert_eq!(info.supported_versions, ["v1.DRAPlugin"]);
    rc.notify_registration_status(reg::RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .expect("NotifyRegistrationStatus");

    // NodePrepareResources: a CDI device whose spec adds the GPU and gpud's hook.
    let mut dra = DraPluginClient::new(gpud_k8s::grpc::unix_channel(Path::new(&info.endpoint)));
    let c = pb::Claim {
        namespace: "default".into(),
        uid: "uid-1".into(),
        name: "train-gpu".into(),
    };
    let resp = dra
        .node_prepare_resources(pb::NodePrepareResourcesRequest {
            claims: vec![c.clone()],
        })
        .await
        .expect("NodePrepareResources")
        .into_inner();
    let r = &resp.claims["uid-1"];
    assert_eq!(r.error, "", "{}", logs());
    assert_eq!(r.devices[0].cdi_device_ids, ["gpud.dev/claim=uid-1-gpu-0"]);
    let spec_path = d.join("cdi/gpud.dev-claim_uid-1.json");
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_path).expect("CDI spec")).expect("CDI JSON");
    let edits = &spec["devices"][0]["containerEdits"];
    assert_eq!(edits["env"][0], format!("NVIDIA_VISIBLE_DEVICES={gpu}"));

    // The runtime runs the spec's hooks: createRuntime sets the limits in gpud, poststop clears.
    let cg = Cgroup::new("k8s-dra");
    let sleeper = Sleeper::start_in(&cg.dir);
    let state = json!({ "ociVersion": "1.0.2", "id": "ctr-dra", "status": "creating",
        "pid": sleeper.pid, "bundle": d.display().to_string(), "annotations": {} });
    let run_hook = |hook: &serde_json::Value| {
        let args: Vec<String> = hook["args"]
            .as_array()
            .into_iter()
            .flatten()
            .skip(1)
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect();
        let mut child = std::process::Command::new(hook["path"].as_str().unwrap_or(""))
            .args(&args)
            .env("GPUD_HOOK_RECORD_DIR", d.join("hook-records"))
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("hook");
        if let Some(mut i) = child.stdin.take() {
            use std::io::Write as _;
            let _ = i.write_all(state.to_string().as_bytes());
        }
        child.wait().expect("hook exit")
    };
    let hooks = edits["hooks"].as_array().cloned().unwrap_or_default();
    assert_eq!(hooks.len(), 2, "{edits}");
    assert!(run_hook(&hooks[0]).success());
    let want = eight_gib_and_thirty_percent_on(&gpu);
    assert_eq!(node.limits(&cg.rel).await, want);
    assert!(run_hook(&hooks[1]).success());
    assert!(node.limits(&cg.rel).await.is_empty(), "poststop cleared");

    // An unknown claim is answered with an error for that claim; unprepare removes the spec.
    let other = pb::Claim {
        namespace: "default".into(),
        uid: "uid-2".into(),
        name: "nope".into(),
    };
    let resp = dra
        .node_prepare_resources(pb::NodePrepareResourcesRequest {
            claims: vec![other],
        })
        .await
        .expect("NodePrepareResources")
        .into_inner();
    assert!(
        resp.claims["uid-2"]
            .error
            .starts_with("claim default/nope not found"),
        "{resp:?}"
    );
    let resp = dra
        .node_unprepare_resources(pb::NodeUnprepareResourcesRequest { claims: vec![c] })
        .await
        .expect("NodeUnprepareResources")
        .into_inner();
    assert_eq!(resp.claims["uid-1"].error, "");
    assert!(!spec_path.exists());

    // The GPU fails (Xid 79): the slice is republished, a generation on, without it.
    let mut sc = scenario(1, 16, |_, _| ());
    sc.events = vec![Event::xid(0, 79)];
    node.rig.nvml_scenario(&sc);
    let slice = eventually(WAIT, || async {
        api.object("resourceslices", "", SLICE)
            .filter(|s| s["spec"]["pool"]["generation"] == 2)
    })
    .await
    .unwrap_or_else(|| panic!("not republished:\n{}", logs()));
    assert_eq!(device_names(&slice), Vec::<String>::new(), "{slice}");

    // The calls the plugin made are exactly what its RBAC rules grant.
    assert_rbac_is_exact(&api);
}

/// The node's ResourceSlice in these tests.
const SLICE: &str = "node1-gpu.gpud.dev";

/// The (group, resource, verb) of every request `api` saw are granted by `gpud_k8s::dra::RBAC`,
/// and every verb RBAC grants was used.
fn assert_rbac_is_exact(api: &TestApiServer) {
    let granted: std::collections::BTreeSet<(String, String, String)> = gpud_k8s::dra::RBAC
        .iter()
        .flat_map(|r| {
            r.verbs
                .iter()
                .map(|v| (r.group.to_owned(), r.resource.to_owned(), (*v).to_owned()))
        })
        .collect();
    let seen = api.verbs_seen();
    assert!(
        api.requests().iter().all(|r| !r.resource.is_empty()),
        "requests outside the resources: {:?}",
        api.requests()
    );
    assert_eq!(seen, granted, "seen (left) and granted (right) differ");
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

/// The device names of a ResourceSlice.
fn device_names(slice: &serde_json::Value) -> Vec<String> {
    slice["spec"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["name"].as_str().map(str::to_owned))
        .collect()
}

/// `gpud-k8s dra` for node1 of `rig`, with the API server of `kubeconfig`; killed when dropped.
struct DraProcess {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl DraProcess {
    fn start(rig: &Rig, kubeconfig: &Path, extra: &[&str], n: u32) -> Self {
        let d = rig.path();
        let log = d.join(format!("dra-{n}.log"));
        let child = std::process::Command::new(gpud_tests::bin_dir().join("gpud-k8s"))
            .args(["--log", "debug", "--bus-address", &rig.bus.address])
            .args(["dra", "--node-name", "node1", "--health-interval-ms", "200"])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--registry-dir")
            .arg(d.join("registry"))
            .arg("--plugin-dir")
            .arg(d.join("plugins"))
            .arg("--cdi-dir")
            .arg(d.join("cdi"))
            .args(extra)
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start gpud-k8s dra");
        Self { child, log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the exit code.
    fn stop(&mut self) -> Option<i32> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(0));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        self.child.wait().ok().and_then(|s| s.code())
    }
}

impl Drop for DraProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn dra_slice_follows_gpu_health_and_inventory_with_a_new_generation_each_time() {
    let node = Node::start("k8s-dra-health", &scenario(2, 16, |_, _| ())).await;
    let api = TestApiServer::start("health-token").await;
    let kubeconfig = node.rig.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let mut plugin = DraProcess::start(&node.rig, &kubeconfig, &[], 0);
    let at = |generation: i64| {
        let api = &api;
        async move {
            eventually(WAIT, || async {
                api.object("resourceslices", "", SLICE)
                    .filter(|s| s["spec"]["pool"]["generation"] == generation)
            })
            .await
        }
    };
    let s = at(1).await;
    let s = s.unwrap_or_else(|| panic!("no slice:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0", "gpu-1"]);

    // Another client writes the slice: the plugin's next replace carries a stale resourceVersion
    // (409 Conflict), so it reads the slice again and replaces that.
    let mut other = s.clone();
    other["metadata"]["labels"] = json!({ "touched-by": "test" });
    api.put(other);

    // GPU 1 leaves gpud's inventory: the next generation lists GPU 0 only.
    node.rig.nvml_scenario(&scenario(1, 16, |_, _| ()));
    let s = at(2).await;
    let s = s.unwrap_or_else(|| panic!("GPU 1 still listed:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0"]);
    let updates: Vec<u16> = api
        .requests()
        .iter()
        .filter(|r| r.verb == "update")
        .map(|r| r.code)
        .collect();
    assert_eq!(updates, [409, 200], "{:?}", api.requests());

    // It comes back.
    node.rig.nvml_scenario(&scenario(2, 16, |_, _| ()));
    let s = at(3).await;
    let s = s.unwrap_or_else(|| panic!("GPU 1 not back:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0", "gpu-1"]);

    // An application's Xid (43) changes nothing; Xid 79 on GPU 0 takes it out of the slice.
    let mut sc = scenario(2, 16, |_, _| ());
    sc.events = vec![Event::xid(1, 43), Event::xid(0, 79)];
    node.rig.nvml_scenario(&sc);
    let s = at(4).await;
    let s = s.unwrap_or_else(|| panic!("GPU 0 still listed:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-1"]);

    // Restarted with device taints (clusters with DRADeviceTaints): the slice goes on from the
    // stored generation and lists GPU 0 again, tainted with why.
    assert_eq!(plugin.stop(), Some(0), "{}", plugin.log_text());
    let plugin = DraProcess::start(
        &node.rig,
        &kubeconfig,
        &["--device-taints", "no-execute"],
        1,
    );
    let s = at(5).await;
    let s = s.unwrap_or_else(|| panic!("not republished:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0", "gpu-1"]);
    let taints = &s["spec"]["devices"][0]["taints"];
    assert_eq!(
        (
            taints[0]["key"].as_str(),
            taints[0]["value"].as_str(),
            taints[0]["effect"].as_str()
        ),
        (
            Some("gpu.gpud.dev/unhealthy"),
            Some("Xid79"),
            Some("NoExecute")
        ),
        "{s}"
    );
    assert_eq!(taints.as_array().map(Vec::len), Some(1));
    assert!(s["spec"]["devices"][1]["taints"].is_null(), "{s}");
}

/// The test API server answers as kube-apiserver does for what it serves: checked with plain
/// HTTP, so a lenient server cannot make the DRA tests pass.
#[tokio::test(flavor = "multi_thread")]
async fn the_test_api_server_refuses_what_kube_apiserver_refuses() {
    let api = TestApiServer::start("secret").await;
    let url = api.url.clone();
    let run = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let call = |method: &str, path: &str, body: Option<&serde_json::Value>, token: &str| {
            let u = format!("{url}{path}");
            let auth = format!("Bearer {token}");
            let resp = match (method, body) {
                ("GET", _) => agent.get(&u).header("Authorization", &auth).call(),
                ("PUT", Some(b)) => agent
                    .put(&u)
                    .header("Authorization", &auth)
                    .header("Content-Type", "application/json")
                    .send(b.to_string()),
                (_, b) => agent
                    .post(&u)
                    .header("Authorization", &auth)
                    .header("Content-Type", "application/json")
                    .send(b.map(ToString::to_string).unwrap_or_default()),
            };
            let mut resp = resp.expect("an answer");
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            (resp.status().as_u16(), v)
        };
        let ok = |method: &str, path: &str, body: Option<&serde_json::Value>| {
            call(method, path, body, "secret")
        };
        let status = |(code, v): (u16, serde_json::Value)| {
            assert_eq!(v["kind"], "Status", "{v}");
            (code, v["reason"].as_str().unwrap_or_default().to_owned())
        };
        let coll = "/apis/resource.k8s.io/v1/resourceslices";
        let item = format!("{coll}/s1");
        let slice = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": { "name": "s1" },
            "spec": { "driver": "gpu.gpud.dev", "nodeName": "n1",
                      "pool": { "name": "n1", "generation": 1, "resourceSliceCount": 1 },
                      "devices": [{ "name": "gpu-0", "capacity": { "memory": { "value": "16Gi" } } }] },
        });
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut s = slice.clone();
            f(&mut s);
            s
        };

        assert_eq!(
            status(call("GET", &item, None, "wrong")),
            (401, "Unauthorized".into())
        );
        assert_eq!(status(ok("GET", &item, None)), (404, "NotFound".into()));
        let bad_version = with(&|s| s["apiVersion"] = "resource.k8s.io/v1beta1".into());
        let bad_kind = with(&|s| s["kind"] = "ResourceClaim".into());
        for bad in [&bad_version, &bad_kind] {
            assert_eq!(
                status(ok("POST", coll, Some(bad))),
                (400, "BadRequest".into())
            );
        }
        let unnamed = with(&|s| s["metadata"] = json!({}));
        assert_eq!(
            status(ok("POST", coll, Some(&unnamed))),
            (422, "Invalid".into())
        );
        let bad_device = with(&|s| s["spec"]["devices"][0]["name"] = "GPU_0".into());
        let (code, v) = ok("POST", coll, Some(&bad_device));
        assert_eq!(
            (code, v["details"]["causes"][0]["field"].as_str()),
            (422, Some("spec.devices[0].name"))
        );
        let bad_taint = with(&|s| {
            s["spec"]["devices"][0]["taints"] =
                json!([{ "key": "k", "effect": "PreferNoSchedule" }])
        });
        assert_eq!(
            status(ok("POST", coll, Some(&bad_taint))),
            (422, "Invalid".into())
        );
        let (code, created) = ok("POST", coll, Some(&slice));
        assert_eq!(code, 201, "{created}");
        let rv = created["metadata"]["resourceVersion"].clone();
        assert!(rv.is_string() && created["metadata"]["uid"].is_string());
        assert_eq!(
            status(ok("POST", coll, Some(&slice))),
            (409, "AlreadyExists".into())
        );
        let with_rv = with(&|s| s["metadata"]["resourceVersion"] = rv.clone());
        assert_eq!(status(ok("POST", coll, Some(&with_rv))).0, 500);

        // Updates: conditional on the resourceVersion, the name and immutable fields kept.
        let next = with(&|s| {
            s["metadata"]["resourceVersion"] = rv.clone();
            s["spec"]["pool"]["generation"] = 2.into();
        });
        let (code, updated) = ok("PUT", &item, Some(&next));
        assert_eq!(code, 200, "{updated}");
        assert_ne!(updated["metadata"]["resourceVersion"], rv);
        assert_eq!(updated["metadata"]["generation"], 2);
        assert_eq!(
            status(ok("PUT", &item, Some(&next))),
            (409, "Conflict".into()),
            "a stale resourceVersion"
        );
        let fresh = updated["metadata"]["resourceVersion"].clone();
        let moved = with(&|s| {
            s["metadata"]["resourceVersion"] = fresh.clone();
            s["spec"]["driver"] = "other.dev".into();
        });
        assert_eq!(
            status(ok("PUT", &item, Some(&moved))),
            (422, "Invalid".into())
        );
        assert_eq!(
            status(ok("PUT", &format!("{coll}/s2"), Some(&slice))),
            (400, "BadRequest".into()),
            "the name differs from the URL's"
        );
        let gone = with(&|s| s["metadata"]["name"] = "s3".into());
        assert_eq!(
            status(ok("PUT", &format!("{coll}/s3"), Some(&gone))),
            (404, "NotFound".into())
        );
        assert_eq!(
            status(ok("GET", &format!("{coll}?watch=true"), None)).0,
            405
        );
        assert_eq!(
            status(ok(
                "GET",
                "/apis/resource.k8s.io/v1/namespaces/default/resourceslices",
                None
            )),
            (404, "NotFound".into()),
            "ResourceSlices are cluster-scoped"
        );
    });
    run.await.expect("the checks");
    let verbs: std::collections::BTreeSet<String> =
        api.verbs_seen().into_iter().map(|(_, _, v)| v).collect();
    assert_eq!(
        verbs,
        ["create", "get", "update", "watch"]
            .map(str::to_owned)
            .into()
    );
}
