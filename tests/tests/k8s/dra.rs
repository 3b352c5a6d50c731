//! The DRA driver against the kubelet as it really speaks: its plugin watcher and DRA manager
//! (gpud_tests::kubelet::plugins) dial with grpc-go's defaults, so every request carries the
//! socket path as `:authority`, as from a real kubelet.

use std::{path::Path, time::Duration};

use gpud_k8s::api::{
    dra as pb,
    pluginregistration::{
        self as reg,
        registration_server::{Registration, RegistrationServer},
    },
};
use gpud_tests::{
    Cgroup, Rig, TempDir, apiserver::TestApiServer, kubelet::plugins::PluginWatcher,
    runtime::Sleeper, scenario::uuid,
};
use serde_json::{Value, json};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use super::{Node, WAIT, eight_gib_and_thirty_percent_on, scenario};

pub(super) const DRIVER: &str = "gpu.gpud.dev";

/// A registration service as any tonic server would answer it.
struct Plain;

#[tonic::async_trait]
impl Registration for Plain {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: DRIVER.into(),
            endpoint: "/nonexistent/dra.sock".into(),
            supported_versions: vec!["v1.DRAPlugin".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        _: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// The failure a real kubelet showed, reproduced: tonic served as is resets grpc-go's GetInfo
/// (PROTOCOL_ERROR, a malformed `:authority`), and the kubelet never registers the driver; the
/// same service through gpud-k8s's server is registered.
#[tokio::test(flavor = "multi_thread")]
async fn the_kubelets_grpc_go_registration_is_reset_by_plain_tonic_and_served_by_gpud_k8s() {
    let dir = TempDir::new("k8s-grpc-go");
    let plain_dir = dir.path().join("plain");
    std::fs::create_dir_all(&plain_dir).expect("dir");
    let sock = plain_dir.join(format!("{DRIVER}-reg.sock"));
    let listener = gpud_k8s::grpc::bind(&sock).expect("bind");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Plain))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let watcher = PluginWatcher::start(&plain_dir);
    let log = watcher
        .wait_registered(DRIVER, Duration::from_secs(3))
        .await
        .expect_err("plain tonic must not register");
    // The real kubelet's log line, word for word.
    let want = format!(
        "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {}, err: rpc error: code = Internal desc = stream terminated by RST_STREAM with error code: PROTOCOL_ERROR",
        sock.display()
    );
    assert_eq!(log.lines().next(), Some(want.as_str()), "{log}");
    // Retried with the kubelet's backoff: 0.5 s, then 1 s, so 2 or 3 tries in 3 s.
    assert!((2..=3).contains(&log.lines().count()), "{log}");

    let fixed_dir = dir.path().join("fixed");
    std::fs::create_dir_all(&fixed_dir).expect("dir");
    let listener =
        gpud_k8s::grpc::bind(&fixed_dir.join(format!("{DRIVER}-reg.sock"))).expect("bind");
    let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(Plain));
    tokio::spawn(gpud_k8s::grpc::serve(
        router,
        listener,
        std::future::pending(),
    ));
    let watcher = PluginWatcher::start(&fixed_dir);
    let r = watcher
        .wait_registered(DRIVER, WAIT)
        .await
        .expect("registered");
    assert_eq!(
        (r.service, r.endpoint.to_str()),
        ("v1.DRAPlugin", Some("/nonexistent/dra.sock"))
    );
    assert!(watcher.log().is_empty(), "{:?}", watcher.log());
}

/// A claim made from the example template docs/kubernetes.md gives
/// (deploy/kubernetes/examples/resourceclaimtemplate.yaml), allocated as the scheduler would:
/// `device` of node1's pool, with the capacity the template requests consumed.
pub(super) fn claim(uid: &str, name: &str, device: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/kubernetes/examples/resourceclaimtemplate.yaml");
    let text = std::fs::read_to_string(&path).expect("the example claim template");
    let template: Value = serde_saphyr::from_str(&text).expect("YAML");
    let spec = template["spec"]["spec"].clone();
    let request = &spec["devices"]["requests"][0];
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "namespace": "default", "name": name, "uid": uid },
        "status": { "allocation": { "devices": { "results": [
            { "request": request["name"], "driver": DRIVER, "pool": "node1", "device": device,
              "consumedCapacity": request["exactly"]["capacity"]["requests"] } ] } } },
        "spec": spec,
    })
}

pub(super) fn pb_claim(uid: &str, name: &str) -> pb::Claim {
    pb::Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

/// `gpud-k8s dra` for node1 of `rig`, with the API server of `kubeconfig`; killed when dropped.
pub(super) struct DraProcess {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl DraProcess {
    pub(super) fn start(rig: &Rig, kubeconfig: &Path, extra: &[&str], n: u32) -> Self {
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
            .arg("--oci-hook")
            .arg(gpud_tests::bin_dir().join("gpud-oci-hook"))
            .args(extra)
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start gpud-k8s dra");
        Self { child, log }
    }

    pub(super) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the exit code.
    pub(super) fn stop(&mut self) -> Option<i32> {
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

/// What the runtime does with a prepared claim's CDI spec: the GPU in the environment and the
/// hooks run with the container's state, here for a process in `cg`.
pub(super) struct Container {
    cg: Cgroup,
    _sleeper: Sleeper,
    state: Value,
    pub(super) hooks: Vec<Value>,
    pub(super) env: Vec<Value>,
}

impl Container {
    pub(super) fn from_spec(spec: &Path, tag: &str, d: &Path) -> Self {
        Self::from_spec_in(spec, Cgroup::new(tag), tag, d)
    }

    /// The same, for a container whose cgroup is `cg` (e.g. under a pod's cgroup).
    pub(super) fn from_spec_in(spec: &Path, cg: Cgroup, tag: &str, d: &Path) -> Self {
        let spec: Value =
            serde_json::from_slice(&std::fs::read(spec).expect("CDI spec")).expect("CDI JSON");
        let edits = &spec["devices"][0]["containerEdits"];
        let sleeper = Sleeper::start_in(&cg.dir);
        let state = json!({ "ociVersion": "1.0.2", "id": tag, "status": "creating",
            "pid": sleeper.pid, "bundle": d.display().to_string(), "annotations": {} });
        Self {
            cg,
            _sleeper: sleeper,
            state,
            hooks: edits["hooks"].as_array().cloned().unwrap_or_default(),
            env: edits["env"].as_array().cloned().unwrap_or_default(),
        }
    }

    /// Runs the spec's hook for `stage` (createRuntime, poststop) as runc does.
    fn run(&self, stage: &str, records: &Path) {
        let hook = self
            .hooks
            .iter()
            .find(|h| h["hookName"] == stage)
            .unwrap_or_else(|| panic!("no {stage} hook in {:?}", self.hooks));
        let args: Vec<&str> = hook["args"]
            .as_array()
            .into_iter()
            .flatten()
            .skip(1)
            .filter_map(Value::as_str)
            .collect();
        let mut child = std::process::Command::new(hook["path"].as_str().unwrap_or(""))
            .args(&args)
            .env("GPUD_HOOK_RECORD_DIR", records)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("hook");
        if let Some(mut i) = child.stdin.take() {
            use std::io::Write as _;
            let _ = i.write_all(self.state.to_string().as_bytes());
        }
        assert!(
            child.wait().expect("hook exit").success(),
            "{stage} hook failed"
        );
    }
}

/// Item 5 of issue 32 on the faithful kubelet: two claims on two GPUs get exactly their limits,
/// unprepare clears them and the spec, a kubelet restart and a removed registration socket are
/// survived, and a claim whose GPU left the inventory is refused clearly.
#[tokio::test(flavor = "multi_thread")]
async fn dra_claims_through_the_kubelets_grpc_go_get_their_limits_and_survive_restarts() {
    let mut node = Node::start("k8s-dra-kubelet", &scenario(2, 16, |_, _| ())).await;
    let api = TestApiServer::start("dra-kubelet-token").await;
    api.put(claim("uid-1", "train", "gpu-0"));
    api.put(claim("uid-2", "serve", "gpu-1"));
    let kubeconfig = node.rig.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let dra = DraProcess::start(&node.rig, &kubeconfig, &[], 0);
    let d = node.rig.path().to_owned();
    let records = d.join("hook-records");
    let mut kubelet = PluginWatcher::start(&d.join("registry"));
    let r = kubelet
        .wait_registered(DRIVER, WAIT)
        .await
        .unwrap_or_else(|log| panic!("not registered:\n{log}\n{}", dra.log_text()));
    assert_eq!(r.endpoint, d.join("plugins/dra.sock"));
    assert!(kubelet.log().is_empty(), "{:?}", kubelet.log());

    // Two claims, as the scheduler allocated them: one on each GPU.
    let resp = kubelet
        .prepare(
            DRIVER,
            vec![pb_claim("uid-1", "train"), pb_claim("uid-2", "serve")],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", dra.log_text()));
    for (uid, dev) in [("uid-1", "gpu-0"), ("uid-2", "gpu-1")] {
        let r = &resp.claims[uid];
        assert_eq!(r.error, "", "{}", dra.log_text());
        assert_eq!(r.devices[0].device_name, dev);
        assert_eq!(
            r.devices[0].cdi_device_ids,
            [format!("gpud.dev/claim={uid}-{dev}")]
        );
    }
    let spec = |uid: &str| d.join(format!("cdi/gpud.dev-claim_{uid}.json"));
    let train = Container::from_spec(&spec("uid-1"), "dra-train", &d);
    let serve = Container::from_spec(&spec("uid-2"), "dra-serve", &d);
    assert_eq!(train.env[0], format!("NVIDIA_VISIBLE_DEVICES={}", uuid(0)));
    assert_eq!(serve.env[0], format!("NVIDIA_VISIBLE_DEVICES={}", uuid(1)));
    train.run("createRuntime", &records);
    serve.run("createRuntime", &records);
    assert_eq!(
        node.limits(&train.cg.rel).await,
        eight_gib_and_thirty_percent_on(&uuid(0))
    );
    assert_eq!(
        node.limits(&serve.cg.rel).await,
        eight_gib_and_thirty_percent_on(&uuid(1))
    );

    // The pod ends: the runtime's poststop, then the kubelet's unprepare.
    train.run("poststop", &records);
    let resp = kubelet
        .unprepare(DRIVER, vec![pb_claim("uid-1", "train")])
        .await
        .expect("NodeUnprepareResources");
    assert_eq!(resp.claims["uid-1"].error, "");
    assert!(node.limits(&train.cg.rel).await.is_empty());
    assert!(!spec("uid-1").exists());
    assert_eq!(
        node.limits(&serve.cg.rel).await,
        eight_gib_and_thirty_percent_on(&uuid(1))
    );

    // The kubelet restarts and finds the socket again; then the socket is removed (a cleared
    // plugins_registry) and gpud-k8s serves it anew.
    kubelet.restart();
    kubelet
        .wait_registered(DRIVER, WAIT)
        .await
        .expect("registered after a restart");
    let reg_sock = d.join(format!("registry/{DRIVER}-reg.sock"));
    std::fs::remove_file(&reg_sock).expect("remove the registration socket");
    kubelet.restart();
    kubelet
        .wait_registered(DRIVER, WAIT)
        .await
        .unwrap_or_else(|log| {
            panic!(
                "not registered after the socket went:\n{log}\n{}",
                dra.log_text()
            )
        });
    assert!(
        dra.log_text().contains("serving it again"),
        "{}",
        dra.log_text()
    );
    let resp = kubelet
        .prepare(DRIVER, vec![pb_claim("uid-1", "train")])
        .await
        .expect("NodePrepareResources after the restarts");
    assert_eq!(resp.claims["uid-1"].error, "");

    // GPU 1 leaves (gpud restarts without it): its claim is refused, naming the device.
    let mut one = scenario(1, 16, |_, _| ());
    one.gpus.truncate(1);
    node.rig.nvml_scenario(&one);
    node.rig.restart().await;
    let resp = kubelet
        .prepare(DRIVER, vec![pb_claim("uid-2", "serve")])
        .await
        .expect("NodePrepareResources");
    let e = &resp.claims["uid-2"].error;
    assert!(e.contains("gpu-1") && e.contains("not on this node"), "{e}");

    // A driver the kubelet does not know fails as the kubelet says it.
    let e = kubelet
        .prepare("other.example.com", vec![pb_claim("uid-1", "train")])
        .await
        .expect_err("unknown driver");
    assert_eq!(e, "DRA driver other.example.com is not registered");
}

/// One claim (512 MiB and 30 % of GPU 0) used by two containers of a pod, and a sidecar of the
/// same pod without the claim that allocates through a GPU file one of them handed it: the claim is one limit, on the
/// pod's cgroup, set once however many of its containers run the claim's hook; the containers
/// together never hold more than the claim, and the sidecar is inside it. The pod keeps the
/// claim's limit until its last user stops.
/// A daemon on the fake device (react `kill`), gpud-k8s's DRA plugin registered with the
/// faithful kubelet, and claim `uid` ("shared": 512 MiB and 30 % of GPU 0) prepared: its CDI
/// spec, and where the hooks keep their records.
struct Prepared {
    rig: Rig,
    _api: TestApiServer,
    dra: DraProcess,
    _kubelet: PluginWatcher,
    spec: std::path::PathBuf,
    records: std::path::PathBuf,
    dir: std::path::PathBuf,
}

async fn prepared_shared_claim(tag: &str, uid: &str) -> Option<Prepared> {
    let mut rig = Rig::new(tag).fake_device(1)?.fake_gpus(1);
    rig.start(
        rig.config()
            .react_action("kill")
            .set("attribution.sweep_interval_secs", 3600)
            .set("nvml.sample_interval_ms", 100),
    )
    .await;
    rig.wait_for_gpus(1).await;
    let api = TestApiServer::start(&format!("{tag}-token")).await;
    let mut shared = claim(uid, "shared", "gpu-0");
    shared["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] =
        json!({ "memory": "512Mi", "compute": "30" });
    api.put(shared);
    let kubeconfig = rig.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let dra = DraProcess::start(&rig, &kubeconfig, &[], 0);
    let d = rig.path().to_owned();
    let kubelet = PluginWatcher::start(&d.join("registry"));
    kubelet
        .wait_registered(DRIVER, WAIT)
        .await
        .unwrap_or_else(|log| panic!("not registered:\n{log}\n{}", dra.log_text()));
    let resp = kubelet
        .prepare(DRIVER, vec![pb_claim(uid, "shared")])
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", dra.log_text()));
    assert_eq!(resp.claims[uid].error, "", "{}", dra.log_text());
    Some(Prepared {
        spec: d.join(format!("cdi/gpud.dev-claim_{uid}.json")),
        records: d.join("hook-records"),
        dir: d,
        rig,
        _api: api,
        dra,
        _kubelet: kubelet,
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn one_claim_in_two_containers_and_a_sidecar_is_one_limit_on_the_pod() {
    const MIB: u64 = 1 << 20;
    let Some(Prepared {
        rig,
        dra,
        spec,
        records,
        dir: d,
        ..
    }) = prepared_shared_claim("k8s-dra-pod", "uid-p").await
    else {
        return;
    };

    // The kubelet's layout: a pod cgroup (cgroupfs driver) with a cgroup per container.
    let kubepods = Cgroup::new("dra-kubepods");
    let pod = kubepods.child("pod0f0b13fe-cea9-4935");
    let a = Container::from_spec_in(&spec, pod.child("a"), "dra-a", &d);
    let b = Container::from_spec_in(&spec, pod.child("b"), "dra-b", &d);
    let sidecar = pod.child("sidecar");
    a.run("createRuntime", &records);
    b.run("createRuntime", &records);
    let claim_limits = std::collections::BTreeMap::from([(
        uuid(0),
        std::collections::BTreeMap::from([
            ("memory_max".to_owned(), 512 * MIB),
            ("compute_max".to_owned(), 30),
        ]),
    )]);
    assert_eq!(
        rig.limits(&pod.rel).await,
        claim_limits,
        "{}",
        dra.log_text()
    );
    for c in [&a, &b] {
        assert!(
            rig.limits(&c.cg.rel).await.is_empty(),
            "{}: the claim is the pod's, not the container's",
            c.cg.rel
        );
    }
    rig.expect_in_force(&pod.rel, &[("0", 512 * MIB)]).await;

    // Both containers allocate, and container a hands its GPU file to the sidecar, which
    // allocates through it: together they never pass the claim.
    let mut in_a = gpud_tests::RmProcess::spawn(Some(&a.cg.dir), &rig.ctl());
    let mut in_b = gpud_tests::RmProcess::spawn(Some(&b.cg.dir), &rig.ctl());
    for t in [&mut in_a, &mut in_b] {
        let (client, device) = t.client_device(0);
        t.ok(&format!("alloc {client} {device} {}", 200 * MIB));
    }
    let mut in_sidecar = gpud_tests::RmProcess::spawn_without_file(Some(&sidecar.dir));
    let socket = rig.path().join("pass.sock");
    in_sidecar.ok(&format!("listen {}", socket.display()));
    in_sidecar.send("recv-fd");
    in_a.ok(&format!("send-fd {}", socket.display()));
    assert_eq!(in_sidecar.recv()["ok"], true, "the sidecar got the file");
    // The sidecar is the file's only holder now (a file another process keeps open outlives
    // the killed caller in the react tier: docs/design.md, the threat model).
    in_a.ok("close");
    let (client, device) = in_sidecar.client_device(0);
    let answer = in_sidecar.try_cmd(&format!("alloc {client} {device} {}", 400 * MIB));
    assert!(
        answer.is_none(),
        "the sidecar took the pod past its claim: {answer:?}\n{}",
        rig.log_text()
    );
    // Its death releases the file, and with it what was allocated through it.
    let within = rig
        .fake()
        .wait(Duration::from_secs(5), |s| s.used_total() <= 512 * MIB);
    assert!(
        within.is_ok(),
        "the pod holds {} bytes",
        rig.fake().snapshot().used_total()
    );

    // The claim stays the pod's while a user is left; the last one takes it away.
    a.run("poststop", &records);
    assert_eq!(rig.limits(&pod.rel).await, claim_limits);
    b.run("poststop", &records);
    assert!(
        rig.limits(&pod.rel).await.is_empty(),
        "{:?}",
        rig.limits(&pod.rel).await
    );
    drop((in_a, in_b));
}

/// One claim referenced by two pods (a shareable claim): the scheduler reserved it once, and
/// each pod's cgroup carries it, so without more the two pods could hold twice its memory. The
/// hook makes the claim a cgroup of its own beside the first pod (`gpud-claim-<claim>`) with the
/// claim's `memory_max`, and has gpud charge each container using it there too: together the
/// pods never pass the claim. The cgroup goes with the claim's last user.
#[tokio::test(flavor = "multi_thread")]
async fn one_claim_in_two_pods_is_one_limit() {
    const MIB: u64 = 1 << 20;
    let Some(Prepared {
        rig,
        spec,
        records,
        dir: d,
        ..
    }) = prepared_shared_claim("k8s-dra-pods", "uid-s").await
    else {
        return;
    };

    // Two pods (the cgroupfs driver's layout), one container each, both using the claim.
    let kubepods = Cgroup::new("dra-pods-kubepods");
    let pod1 = kubepods.child("pod1b0c5e2a-0001");
    let pod2 = kubepods.child("pod1b0c5e2a-0002");
    let a = Container::from_spec_in(&spec, pod1.child("a"), "dra-pa", &d);
    let b = Container::from_spec_in(&spec, pod2.child("b"), "dra-pb", &d);
    a.run("createRuntime", &records);
    b.run("createRuntime", &records);
    let group = format!("{}/gpud-claim-uid-s-gpu-0", kubepods.rel);
    rig.expect_in_force(&group, &[("0", 512 * MIB)]).await;
    for pod in [&pod1, &pod2] {
        rig.expect_in_force(&pod.rel, &[("0", 512 * MIB)]).await;
    }

    // 300 MiB in each pod: the second takes the claim past 512 MiB and is killed in the call.
    let mut in_a = gpud_tests::RmProcess::spawn(Some(&a.cg.dir), &rig.ctl());
    let (client, device) = in_a.client_device(0);
    in_a.ok(&format!("alloc {client} {device} {}", 300 * MIB));
    let mut in_b = gpud_tests::RmProcess::spawn(Some(&b.cg.dir), &rig.ctl());
    let (client, device) = in_b.client_device(0);
    let answer = in_b.try_cmd(&format!("alloc {client} {device} {}", 300 * MIB));
    assert!(
        answer.is_none(),
        "the second pod took the claim past its memory: {answer:?}\n{}",
        rig.log_text()
    );
    let group_view = rig.get_cgroup(&group).await;
    println!(
        "the claim's cgroup: charged {:?}, limit {:?}, crossings {}",
        group_view.memory_current, group_view.memory_max, group_view.memory_events
    );
    assert!(group_view.memory_events > 0, "{group_view:?}");
    let within = rig
        .fake()
        .wait(Duration::from_secs(5), |s| s.used_total() <= 512 * MIB);
    assert!(
        within.is_ok(),
        "the two pods hold {} bytes",
        rig.fake().snapshot().used_total()
    );
    // Within the claim, the second pod allocates (once gpud has released what the killed
    // process held).
    rig.expect_eventually("the killed allocation released", WAIT, || async {
        let g = rig.get_cgroup(&group).await;
        (g.memory_current.get("0").copied().unwrap_or(0) <= 300 * MIB).then_some(())
    })
    .await;
    let mut in_b = gpud_tests::RmProcess::spawn(Some(&b.cg.dir), &rig.ctl());
    let (client, device) = in_b.client_device(0);
    in_b.ok(&format!("alloc {client} {device} {}", 200 * MIB));

    // The claim's cgroup stays while a user is left, and goes with the last.
    drop((in_a, in_b));
    a.run("poststop", &records);
    assert!(
        kubepods.dir.join("gpud-claim-uid-s-gpu-0").is_dir(),
        "b still uses the claim"
    );
    b.run("poststop", &records);
    assert!(
        !kubepods.dir.join("gpud-claim-uid-s-gpu-0").exists(),
        "the claim's cgroup outlived its last user"
    );
}
