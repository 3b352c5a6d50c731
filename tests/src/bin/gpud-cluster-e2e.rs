//! Test program: gpud end to end on a real single-node Kubernetes (`cargo xtask cluster up`),
//! the way an operator installs it, with the fake control device and the fake NVML standing in
//! for two GPUs on the node. Run by `cargo xtask test` (the "kubernetes (real cluster)" stage)
//! once the cluster is up and gpud's image is in its containerd; exits 0 when every check holds.
//!
//! `gpud-cluster-e2e --kubeconfig K --kubectl KUBECTL --image localhost/gpud:V --update-tag T`
//!
//! 1. The node: a system bus if it has none (the stock `dbus-daemon --system`), the fake
//!    control device (two GPUs of 80 GiB) and the fake NVML following its ledger, under
//!    `/run/gpud-e2e`.
//! 2. `kubectl apply -k` of deploy/kubernetes/gpud (an overlay adds the fakes' paths to the
//!    configuration and mounts them): gpud Ready, its files on the host, `gpudctl` on the host
//!    answering over the host's bus.
//! 3. The DRA flavour: a pod claiming 8 GiB + 30 % runs with exactly those limits on its
//!    container's cgroup; a tenant in it (`gpud-rm`, through `kubectl exec`) crossing 8 GiB is
//!    stopped; its metrics carry its pod's name; a second claim (80 % of compute) lands on the
//!    other GPU.
//! 4. A rolling update of the gpud DaemonSet (the same image under another tag): while the old
//!    pod stops and the new one starts, the limit stays in force (the tenant is stopped at its
//!    limit during the update) and afterwards gpud counts exactly the fake driver's ledger.
//! 5. Deleting the pods clears their limits.
//! 6. The device-plugin flavour in place of DRA: a container granted 8 GiB + 30 % has exactly
//!    those limits (applied by gpud's NRI plugin), its tenant is stopped at 8 GiB, and deleting
//!    it clears them.
//! 7. Deleting the flavours and gpud leaves the node as it was (no host file, pin, state or
//!    bus name of gpud).
//!
//! Prints what it did, with `kubectl get pods -A -o wide` and `gpudctl list --json` along the
//! way.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use gpud_tests::{
    LedgerNvml,
    fakenv::{self, Options},
    install_fake_nvml,
};
use serde_json::{Value, json};

/// Where the node's fakes live (a host path the pods mount).
const FAKES: &str = "/run/gpud-e2e";
const GIB: u64 = 1 << 30;
/// The claim of the first pod, as the example ResourceClaimTemplate has it.
const CLAIM_MEMORY: u64 = 8 * GIB;

#[derive(Parser)]
struct Cli {
    #[arg(long)]
    kubeconfig: PathBuf,
    #[arg(long)]
    kubectl: PathBuf,
    /// gpud's image as imported into the node's containerd.
    #[arg(long)]
    image: String,
    /// A second tag of the same image, for the rolling update.
    #[arg(long)]
    update_tag: String,
}

struct E2e {
    cli: Cli,
    repo: PathBuf,
    work: PathBuf,
    started: Instant,
}

impl E2e {
    fn step(&self, what: &str) {
        println!("\n[{:>6.1}s] {what}", self.started.elapsed().as_secs_f64());
    }

    fn kubectl(&self) -> Command {
        let mut c = Command::new(&self.cli.kubectl);
        c.arg("--kubeconfig").arg(&self.cli.kubeconfig);
        c
    }

    /// `kubectl ARGS` (stdin from `input`): its stdout, or an error with its stderr.
    fn k_in(&self, args: &[&str], input: Option<&str>) -> anyhow::Result<String> {
        let mut cmd = self.kubectl();
        cmd.args(args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting kubectl")?;
        if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
            stdin.write_all(text.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        ensure!(
            out.status.success(),
            "kubectl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn k(&self, args: &[&str]) -> anyhow::Result<String> {
        self.k_in(args, None)
    }

    fn k_json(&self, args: &[&str]) -> anyhow::Result<Value> {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        Ok(serde_json::from_str(&self.k(&a)?)?)
    }

    /// Prints `kubectl get pods -A -o wide`.
    fn show_pods(&self) {
        match self.k(&["get", "pods", "-A", "-o", "wide"]) {
            Ok(s) => print!("$ kubectl get pods -A -o wide\n{s}"),
            Err(e) => println!("kubectl get pods: {e:#}"),
        }
    }

    /// The host's gpudctl (installed by the DaemonSet), over the host's system bus.
    fn gpudctl(&self, args: &[&str]) -> anyhow::Result<String> {
        node_command("/opt/gpud/bin/gpudctl", args)
    }

    /// `gpudctl --json list`'s rows.
    fn cgroups(&self) -> anyhow::Result<Vec<Value>> {
        let v: Value = serde_json::from_str(&self.gpudctl(&["--json", "list"])?)?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }

    /// The `gpudctl --json list` row of `cgroup`.
    fn row_at(&self, cgroup: &str) -> anyhow::Result<Option<Value>> {
        Ok(self.cgroups()?.into_iter().find(|r| r["path"] == cgroup))
    }

    /// The `gpudctl --json limits` entry on the cgroup of the pod with `uid` or one of its
    /// containers (cgroupfs names the pod's `pod<uid>`, systemd `…pod<uid with _>.slice`).
    fn limits_of(&self, uid: &str) -> anyhow::Result<Option<Value>> {
        let v: Value = serde_json::from_str(&self.gpudctl(&["--json", "limits"])?)?;
        let (a, b) = (format!("pod{uid}"), format!("pod{}", uid.replace('-', "_")));
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .find(|l| {
                l["cgroup"].as_str().is_some_and(|c| {
                    c.split('/')
                        .any(|part| part == a || (part.starts_with(&b) && part.ends_with(".slice")))
                })
            })
            .cloned())
    }

    /// Starts the tenant pod `name` (the image, `sleep infinity`, the fake device and `gpud-rm`
    /// mounted) with its GPU share, waits until it runs; its UID.
    fn run_tenant(&self, name: &str, gets: TenantGets) -> anyhow::Result<String> {
        let mut container = json!({
            "name": "tenant",
            "image": self.cli.image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["sleep", "infinity"],
            "volumeMounts": [
                { "name": "fakes", "mountPath": FAKES },
                { "name": "rm", "mountPath": "/e2e/gpud-rm" },
            ],
        });
        let mut spec = json!({
            "terminationGracePeriodSeconds": 1,
            "volumes": [
                { "name": "fakes", "hostPath": { "path": FAKES, "type": "Directory" } },
                { "name": "rm", "hostPath": {
                    "path": gpud_tests::bin_dir().join("gpud-rm"), "type": "File" } },
            ],
        });
        match gets {
            TenantGets::Claim(template) => {
                spec["resourceClaims"] =
                    json!([{ "name": "gpu", "resourceClaimTemplateName": template }]);
                container["resources"] = json!({ "claims": [{ "name": "gpu" }] });
            }
            TenantGets::Granted => {
                container["resources"] = json!({ "limits": {
                    "gpud.dev/gpu-memory": (CLAIM_MEMORY / GIB).to_string(),
                    "gpud.dev/gpu-compute": "30",
                } });
            }
        }
        spec["containers"] = json!([container]);
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": name, "namespace": "default" },
            "spec": spec,
        });
        self.k_in(&["apply", "-f", "-"], Some(&pod.to_string()))?;
        self.k(&[
            "wait",
            "--for=condition=Ready",
            &format!("pod/{name}"),
            "--timeout=120s",
        ])?;
        Ok(self
            .k(&["get", "pod", name, "-o", "jsonpath={.metadata.uid}"])?
            .trim()
            .to_owned())
    }

    /// Waits for the limits gpud got for the pod with `uid` and checks they are exactly the
    /// claim's 8 GiB and 30 %; the cgroup they are on.
    fn exact_limits(&self, uid: &str, pod: &str) -> anyhow::Result<String> {
        let limit = wait(&format!("{pod}'s limits"), Duration::from_secs(30), || {
            self.limits_of(uid)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("no limit on a cgroup of pod {uid}"))
        })?;
        let cgroup = limit["cgroup"].as_str().unwrap_or_default().to_owned();
        println!("{pod}: cgroup {cgroup}, limits {limit}");
        ensure!(
            limit["limits"]["memory_max"] == CLAIM_MEMORY && limit["limits"]["compute_max"] == 30,
            "the limits on {cgroup} are not exactly 8 GiB and 30 %: {limit}"
        );
        Ok(cgroup)
    }

    /// A tenant in `pod` takes 3 GiB three times on `gpu`: the third crosses 8 GiB, and the
    /// fake driver must hold no more than 8 GiB afterwards.
    fn cross_the_limit(
        &self,
        nv: &fakenv::FakeNv,
        pod: &str,
        client: u32,
        gpu: u32,
    ) -> anyhow::Result<()> {
        let (mut attacker, dev) = Holder::open_gpu(self, pod, client, gpu)?;
        for _ in 0..3 {
            let answer = attacker.say(&format!("alloc {client:#x} {dev} 3G"))?;
            if answer.is_empty() {
                println!("alloc 3G: (no answer: the tenant is gone)");
            } else {
                println!("alloc 3G: {answer}");
            }
        }
        drop(attacker);
        within_limit(nv, gpu, &format!("after {pod}'s tenant crossed it"))
    }

    /// Waits until no limit is listed on `cgroup`.
    fn limits_gone(&self, cgroup: &str) -> anyhow::Result<()> {
        wait(
            &format!("the limits of {cgroup} to go"),
            Duration::from_secs(30),
            || {
                let limits = self
                    .gpudctl(&["--json", "limits"])
                    .map_err(|e| e.to_string())?;
                if limits.contains(cgroup) {
                    Err(format!("still listed: {limits}"))
                } else {
                    Ok(())
                }
            },
        )
    }

    fn apply_k(&self, dir: &Path) -> anyhow::Result<()> {
        let out = self.k(&["apply", "-k", &dir.to_string_lossy()])?;
        print!("{out}");
        Ok(())
    }

    /// Writes a kustomize overlay in `work/NAME` over `base` (a directory of
    /// deploy/kubernetes) with the image tag and any further kustomization text.
    fn overlay(&self, name: &str, base: &str, tag: &str, extra: &str) -> anyhow::Result<PathBuf> {
        let dir = self.work.join(name);
        std::fs::create_dir_all(&dir)?;
        let base = self.repo.join("deploy/kubernetes").join(base);
        let (repo, new_tag) = self.cli.image.rsplit_once(':').context("--image: no tag")?;
        let new_tag = if tag.is_empty() { new_tag } else { tag };
        std::fs::write(
            dir.join("kustomization.yaml"),
            format!(
                "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
                 resources:\n  - {}\nimages:\n  - name: localhost/gpud\n    newName: {repo}\n    newTag: {new_tag}\n{extra}",
                relative(&dir, &base).display()
            ),
        )?;
        Ok(dir)
    }
}

/// How a tenant pod gets its GPU share.
enum TenantGets<'a> {
    /// A DRA claim from this ResourceClaimTemplate.
    Claim(&'a str),
    /// The device plugin's resources: 8 units of `gpud.dev/gpu-memory` (1 GiB each) and 30 of
    /// `gpud.dev/gpu-compute`.
    Granted,
}

/// A ResourceClaimTemplate of the class `gpud-gpu` for 8 GiB and `compute` percent.
fn claim_template(name: &str, compute: u32) -> String {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "spec": { "devices": { "requests": [{
            "name": "gpu",
            "exactly": {
                "deviceClassName": "gpud-gpu",
                "capacity": { "requests": {
                    "memory": format!("{}Gi", CLAIM_MEMORY / GIB),
                    "compute": compute.to_string(),
                } },
            },
        }] } } },
    })
    .to_string()
}

/// `to` as a path relative to `from` (kustomize takes bases outside its root only so).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<_> = from.components().collect();
    let to: Vec<_> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut p = PathBuf::new();
    for _ in common..from.len() {
        p.push("..");
    }
    for c in &to[common..] {
        p.push(c);
    }
    p
}

/// Polls `check` every half second until it returns `Some`, or fails naming `what` and the
/// last reason `check` gave.
fn wait<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> anyhow::Result<T> {
    let start = Instant::now();
    loop {
        match check() {
            Ok(v) => return Ok(v),
            Err(why) if start.elapsed() > timeout => {
                bail!("{what}: not within {timeout:?}: {why}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// The node's system bus: the running one, or a stock `dbus-daemon --system` started here (a
/// node without systemd, such as this test machine), stopped when dropped.
struct SystemBus(Option<std::process::Child>);

impl SystemBus {
    fn ensure() -> anyhow::Result<Self> {
        let socket = Path::new("/run/dbus/system_bus_socket");
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            println!("the node's system bus runs");
            return Ok(Self(None));
        }
        let _ = std::fs::remove_file(socket);
        std::fs::create_dir_all("/run/dbus")?;
        let child = Command::new("dbus-daemon")
            .args(["--system", "--nofork", "--nopidfile"])
            .spawn()
            .context("starting dbus-daemon --system")?;
        wait("the system bus's socket", Duration::from_secs(10), || {
            std::os::unix::net::UnixStream::connect(socket)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })?;
        println!("started the node's system bus (dbus-daemon --system, its stock configuration)");
        Ok(Self(Some(child)))
    }
}

impl Drop for SystemBus {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = std::fs::remove_file("/run/dbus/system_bus_socket");
        }
    }
}

/// What gpud leaves on a node, as paths: none of them exists before the install and after the
/// uninstall.
const NODE_TRACES: &[&str] = &[
    "/etc/dbus-1/system.d/dev.gpud.Daemon1.conf",
    "/opt/gpud",
    "/etc/containers/oci/hooks.d/50-gpud-create.json",
    "/sys/fs/bpf/gpud",
    "/var/lib/gpud",
    "/run/gpud",
];

/// The node's fakes and bus, owned outside [`run`]: on a failure the pods still hold the fake
/// device's mount, so its server must not wait for them (the process exits instead, and
/// `cargo xtask cluster e2e` removes what is left once the cluster is down).
#[derive(Default)]
struct Node {
    bus: Option<SystemBus>,
    nv: Option<fakenv::FakeNv>,
    nvml: Option<LedgerNvml>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let repo = repo.canonicalize().unwrap_or(repo);
    let work = repo.join("target/cluster/e2e");
    let _ = std::fs::remove_dir_all(&work);
    let e = E2e {
        cli,
        repo,
        work,
        started: Instant::now(),
    };
    let mut node = Node::default();
    match run(&e, &mut node) {
        Ok(()) => {
            println!(
                "\nE2E RESULT: PASS ({:.0} s)",
                e.started.elapsed().as_secs_f64()
            );
            drop(node);
            let _ = std::fs::remove_dir_all(FAKES);
            std::process::ExitCode::SUCCESS
        }
        Err(err) => {
            println!("\nE2E RESULT: FAIL: {err:#}");
            e.show_pods();
            if let Ok(s) = e.k(&[
                "-n",
                "gpud-system",
                "logs",
                "-l",
                "app.kubernetes.io/part-of=gpud",
                "--all-containers",
                "--tail",
                "40",
                "--prefix",
            ]) {
                println!("--- gpud-system's logs:\n{s}");
            }
            if let Ok(s) = e.k(&["get", "events", "-A", "--sort-by=.lastTimestamp"]) {
                println!("--- events:\n{s}");
            }
            drop(node.nvml.take());
            drop(node.bus.take());
            std::mem::forget(node.nv.take());
            let _ = std::io::stdout().flush();
            std::process::exit(1)
        }
    }
}

fn run(e: &E2e, node: &mut Node) -> anyhow::Result<()> {
    std::fs::create_dir_all(&e.work)?;
    e.step("the node: its system bus, two fake GPUs and the fake NVML");
    for t in NODE_TRACES {
        ensure!(
            !Path::new(t).exists(),
            "{t} exists before gpud is installed: this node is not clean (gpud's package, or \
             an earlier run?)"
        );
    }
    node.bus = Some(SystemBus::ensure()?);
    let fakes = Path::new(FAKES);
    let nv_dir = fakes.join("nv");
    let nvml_dir = fakes.join("nvml");
    let nv = node.nv.insert(
        fakenv::mount(
            &nv_dir,
            Options {
                gpus: 2,
                ..Options::default()
            },
        )
        .context("mounting the fake control device")?,
    );
    install_fake_nvml(&nvml_dir);
    node.nvml = Some(LedgerNvml::follow(&nv_dir, &nvml_dir, 2));
    e.k(&[
        "label",
        "node",
        "--all",
        "--overwrite",
        "gpud.dev/sharing=true",
    ])?;

    e.step("kubectl apply -k deploy/kubernetes/gpud (overlay: the fakes' paths)");
    let config = format!(
        "[daemon]\nready_file = \"/run/gpud/ready\"\n\n[metrics]\nlisten = \"127.0.0.1:9400\"\n\n\
         [devices]\nextra_paths = [\"{nv}\"]\n\n[nvml]\nlibrary_path = \"{lib}\"\n",
        nv = nv_dir.join("nvidiactl").display(),
        lib = nvml_dir.join("libnvidia-ml.so.1").display(),
    );
    let patch = format!(
        "configMapGenerator:\n  - name: gpud-config\n    namespace: gpud-system\n    behavior: replace\n    files:\n      - gpud.toml\n\
         patches:\n  - target: {{ kind: DaemonSet, name: gpud }}\n    patch: |-\n\
         \x20     - op: add\n        path: /spec/template/spec/volumes/-\n        value: {{ name: fakes, hostPath: {{ path: {FAKES}, type: Directory }} }}\n\
         \x20     - op: add\n        path: /spec/template/spec/containers/0/volumeMounts/-\n        value: {{ name: fakes, mountPath: {FAKES} }}\n"
    );
    let gpud_overlay = e.overlay("gpud", "gpud", "", &patch)?;
    std::fs::write(gpud_overlay.join("gpud.toml"), &config)?;
    e.apply_k(&gpud_overlay)?;
    e.k(&[
        "-n",
        "gpud-system",
        "rollout",
        "status",
        "ds/gpud",
        "--timeout=180s",
    ])?;
    for f in [
        "/etc/dbus-1/system.d/dev.gpud.Daemon1.conf",
        "/opt/gpud/bin/gpud-oci-hook",
        "/opt/gpud/bin/gpudctl",
        "/run/gpud/ready",
        // On the host's bpffs, where they outlive the pod.
        "/sys/fs/bpf/gpud",
    ] {
        ensure!(
            Path::new(f).exists(),
            "{f}: not on the node after the install"
        );
    }
    let status = e.gpudctl(&["status"])?;
    print!("$ /opt/gpud/bin/gpudctl status (on the node, over its system bus)\n{status}");
    // busctl, as an operator on the node would (the policy lets anyone read).
    let version = busctl(&[
        "get-property",
        gpud_api::BUS_NAME,
        gpud_api::OBJECT_PATH,
        "dev.gpud.Manager1",
        "Version",
    ])?;
    println!(
        "$ busctl --system get-property dev.gpud.Daemon1 … Version\n{}",
        version.trim()
    );
    e.show_pods();

    e.step("the DRA flavour: kubectl apply -k deploy/kubernetes/dra");
    let dra_overlay = e.overlay("dra", "dra", "", "")?;
    e.apply_k(&dra_overlay)?;
    e.k(&[
        "-n",
        "gpud-system",
        "rollout",
        "status",
        "ds/gpud-k8s-dra",
        "--timeout=180s",
    ])?;
    wait("the node's ResourceSlice", Duration::from_secs(60), || {
        let v = e
            .k_json(&["get", "resourceslices"])
            .map_err(|e| e.to_string())?;
        let n = v["items"].as_array().map_or(0, Vec::len);
        if n > 0 {
            Ok(())
        } else {
            Err("none yet".into())
        }
    })?;

    // A pod whose claim the kubelet cannot prepare yet is retried with a growing back-off: wait
    // for the kubelet to have registered the driver first.
    wait(
        "the DRA driver's registration with the kubelet",
        Duration::from_secs(60),
        || {
            let logs = e
                .k(&["-n", "gpud-system", "logs", "ds/gpud-k8s-dra", "-c", "dra"])
                .map_err(|e| e.to_string())?;
            if logs.contains("registered with the kubelet") {
                Ok(())
            } else {
                Err("not yet".into())
            }
        },
    )?;

    e.step("a pod claiming 8 GiB + 30 %");
    e.k_in(
        &["apply", "-f", "-"],
        Some(&claim_template("gpu-8g-30", 30)),
    )?;
    // The claim's limits go on the pod's cgroup (every container of the pod shares the claim).
    let uid = e.run_tenant("tenant-a", TenantGets::Claim("gpu-8g-30"))?;
    let gpu_a = allocated_gpu(e, "tenant-a")?;
    let cgroup = e.exact_limits(&uid, "tenant-a")?;

    e.step("the tenant crosses 8 GiB from inside the pod (kubectl exec gpud-rm)");
    e.cross_the_limit(nv, "tenant-a", 0xc1, gpu_a)?;
    let row = e
        .row_at(&cgroup)?
        .context("tenant-a's pod cgroup in gpudctl list")?;
    println!("tenant-a's pod after the attack: {row}");
    ensure!(
        row["workload"]["pod"] == "tenant-a" && row["workload"]["namespace"] == "default",
        "tenant-a's pod cgroup does not carry its names: {}",
        row["workload"]
    );
    ensure!(
        row["memory_events"].as_u64().unwrap_or(0) >= 1,
        "no memory event counted on tenant-a's cgroup"
    );

    e.step("its metrics carry its pod's name");
    let scrape = ureq::get("http://127.0.0.1:9400/metrics")
        .call()
        .context("scraping gpud's metrics")?
        .into_body()
        .read_to_string()?;
    let labelled: Vec<&str> = scrape
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("pod=\"tenant-a\""))
        .collect();
    println!("{} series name pod=\"tenant-a\", e.g.:", labelled.len());
    for l in labelled.iter().take(4) {
        println!("  {l}");
    }
    ensure!(
        labelled.iter().any(|l| l.contains("namespace=\"default\"")),
        "no series labelled with tenant-a's namespace and pod"
    );

    e.step("a second claim (80 % of compute) lands on the other GPU");
    e.k_in(
        &["apply", "-f", "-"],
        Some(&claim_template("gpu-8g-80", 80)),
    )?;
    e.run_tenant("tenant-b", TenantGets::Claim("gpu-8g-80"))?;
    let gpu_b = allocated_gpu(e, "tenant-b")?;
    ensure!(gpu_b != gpu_a, "both claims on GPU {gpu_a}");
    println!("tenant-b: GPU {gpu_b}");
    e.show_pods();
    println!("$ gpudctl --json list\n{}", e.gpudctl(&["--json", "list"])?);

    e.step("a rolling update of gpud (another tag) while tenant-a holds 6 GiB");
    let (mut holder, held_dev) = Holder::open_gpu(e, "tenant-a", 0xc3, gpu_a)?;
    for _ in 0..2 {
        let line = format!("alloc 0xc3 {held_dev} 3G");
        let answer = holder.say(&line)?;
        ensure!(answer.contains("\"ok\":true"), "{line}: {answer}");
    }
    let counted = |row: &Value| {
        row["memory_current"][gpu_a.to_string()]
            .as_u64()
            .unwrap_or(0)
    };
    let shares_before = e.limits_of(uid.trim())?.context("tenant-a's limits")?;
    // tenant-a's row once gpud counts what the fake driver holds on its GPU.
    let as_ledger = |what: &str, timeout| {
        wait(what, timeout, || {
            let row = e
                .row_at(&cgroup)
                .map_err(|e| e.to_string())?
                .ok_or("no row")?;
            let ledger = nv.snapshot().used(gpu_a);
            if counted(&row) == ledger {
                Ok(row)
            } else {
                Err(format!(
                    "gpud counts {}, the ledger holds {ledger}",
                    counted(&row)
                ))
            }
        })
    };
    let before = as_ledger("gpud to count the holder", Duration::from_secs(10))?;
    println!(
        "before: gpud counts {} on GPU {gpu_a}, the fake driver holds {}; limits {}",
        counted(&before),
        nv.snapshot().used(gpu_a),
        before["memory_max"]
    );
    let updated = e.overlay("gpud-update", "gpud", &e.cli.update_tag, &patch)?;
    std::fs::write(updated.join("gpud.toml"), &config)?;
    e.apply_k(&updated)?;
    // Until the new pod is ready: a tenant crossing the limit meanwhile is stopped by the
    // programs gpud left attached, whether or not a gpud runs at that moment.
    let update_started = Instant::now();
    let (mut tries, mut while_down) = (0, 0);
    loop {
        let down = e.gpudctl(&["status"]).is_err();
        let (mut t, dev) = Holder::open_gpu(e, "tenant-a", 0xc4, gpu_a)?;
        let answers = t.say(&format!("alloc 0xc4 {dev} 3G"))?;
        drop(t);
        tries += 1;
        while_down += usize::from(down);
        within_limit(
            nv,
            gpu_a,
            &format!("an attempt during the update ({answers:?})"),
        )?;
        let done = e
            .k(&[
                "-n",
                "gpud-system",
                "rollout",
                "status",
                "ds/gpud",
                "--timeout=1s",
            ])
            .is_ok();
        if done || update_started.elapsed() > Duration::from_secs(180) {
            break;
        }
    }
    e.k(&[
        "-n",
        "gpud-system",
        "rollout",
        "status",
        "ds/gpud",
        "--timeout=60s",
    ])?;
    println!(
        "the update took {:.1} s: {tries} tries to cross the limit, {while_down} of them while \
         gpudctl status got no answer, all stopped",
        update_started.elapsed().as_secs_f64()
    );
    let after = as_ledger(
        "gpud to count the holder after the update",
        Duration::from_secs(30),
    )?;
    println!(
        "after: gpud counts {} on GPU {gpu_a} (the ledger: {}), limits {}",
        counted(&after),
        nv.snapshot().used(gpu_a),
        after["memory_max"]
    );
    ensure!(
        counted(&after) == 6 * GIB,
        "the holder's 6 GiB are not counted after the update"
    );
    ensure!(
        after["memory_max"] == before["memory_max"],
        "the limit changed across the update: {} then {}",
        before["memory_max"],
        after["memory_max"]
    );
    let shares_after = e
        .limits_of(uid.trim())?
        .context("tenant-a's limits after the update")?;
    ensure!(
        shares_after == shares_before,
        "tenant-a's limits and compute shares changed across the update: {shares_before} then {shares_after}"
    );
    println!("its limits and compute shares, before and after: {shares_after}");
    let answer = holder.say(&format!("alloc 0xc3 {held_dev} 3G"))?;
    within_limit(
        nv,
        gpu_a,
        &format!("the holder's crossing after the update ({answer})"),
    )?;
    drop(holder);

    e.step("deleting the pods clears their limits");
    e.k(&[
        "delete",
        "pod",
        "tenant-a",
        "tenant-b",
        "--wait=true",
        "--timeout=60s",
    ])?;
    e.limits_gone(&cgroup)?;

    e.step("the device-plugin flavour instead of DRA: a container granted 8 GiB + 30 %");
    e.k(&["delete", "resourceclaimtemplate", "gpu-8g-30", "gpu-8g-80"])?;
    // Only the DRA plugin's DaemonSet and class: the namespace (and gpud) stay.
    e.k(&[
        "-n",
        "gpud-system",
        "delete",
        "ds",
        "gpud-k8s-dra",
        "--wait=true",
        "--timeout=60s",
    ])?;
    e.k(&["delete", "deviceclass", "gpud-gpu"])?;
    let dp_overlay = e.overlay("device-plugin", "device-plugin", "", "")?;
    e.apply_k(&dp_overlay)?;
    e.k(&[
        "-n",
        "gpud-system",
        "rollout",
        "status",
        "ds/gpud-k8s",
        "--timeout=180s",
    ])?;
    wait(
        "the node's gpud.dev/gpu-memory",
        Duration::from_secs(60),
        || {
            let n = e
                .k(&[
                    "get",
                    "nodes",
                    "-o",
                    r"jsonpath={.items[0].status.allocatable.gpud\.dev/gpu-memory}",
                ])
                .map_err(|e| e.to_string())?;
            if n.trim().parse::<u64>().unwrap_or(0) > 0 {
                Ok(())
            } else {
                Err(format!("allocatable: {n:?}"))
            }
        },
    )?;
    let uid_c = e.run_tenant("tenant-c", TenantGets::Granted)?;
    let cgroup_c = e.exact_limits(&uid_c, "tenant-c")?;
    // Its GPU: the one the device plugin handed it (NVIDIA_VISIBLE_DEVICES, a UUID).
    let visible = e.k(&[
        "exec",
        "tenant-c",
        "--",
        "printenv",
        "NVIDIA_VISIBLE_DEVICES",
    ])?;
    let status: Value = serde_json::from_str(&e.gpudctl(&["--json", "status"])?)?;
    let gpu_c = status["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|g| g["uuid"] == visible.trim())
        .and_then(|g| g["index"].as_u64())
        .with_context(|| {
            format!("NVIDIA_VISIBLE_DEVICES={visible:?}: no such GPU in gpudctl status")
        })?;
    let gpu_c = u32::try_from(gpu_c)?;
    e.cross_the_limit(nv, "tenant-c", 0xc5, gpu_c)?;
    e.k(&["delete", "pod", "tenant-c", "--wait=true", "--timeout=60s"])?;
    e.limits_gone(&cgroup_c)?;

    e.step("uninstall: kubectl delete -k of the flavours, then of gpud");
    // The namespace is common to all: deleting a flavour takes gpud's DaemonSet with it (its
    // preStop hook then finds the namespace going), and the later deletes find what is left.
    for overlay in [&dp_overlay, &dra_overlay, &updated] {
        e.k(&[
            "delete",
            "-k",
            &overlay.to_string_lossy(),
            "--ignore-not-found",
            "--wait=true",
            "--timeout=120s",
        ])?;
    }
    wait("gpud's pods to go", Duration::from_secs(120), || {
        let pods = e
            .k(&[
                "get",
                "pods",
                "-A",
                "-l",
                "app.kubernetes.io/part-of=gpud",
                "-o",
                "name",
            ])
            .map_err(|e| e.to_string())?;
        if pods.trim().is_empty() {
            Ok(())
        } else {
            Err(pods)
        }
    })?;
    let left: Vec<&&str> = NODE_TRACES
        .iter()
        .filter(|t| Path::new(t).exists())
        .collect();
    ensure!(
        left.is_empty(),
        "gpud left on the node after the uninstall: {left:?}"
    );
    let names = busctl(&["list", "--acquired"])?;
    ensure!(
        !names.contains(gpud_api::BUS_NAME),
        "{} still owned on the node's bus after the uninstall:\n{names}",
        gpud_api::BUS_NAME
    );
    e.k(&["label", "node", "--all", "gpud.dev/sharing-"])?;
    e.show_pods();
    Ok(())
}

/// Waits (a few seconds: a react tier kills at once, but asynchronously) until the fake driver
/// holds no more than the claim on `gpu`.
fn within_limit(nv: &fakenv::FakeNv, gpu: u32, when: &str) -> anyhow::Result<()> {
    wait(
        &format!("GPU {gpu} within the limit {when}"),
        Duration::from_secs(5),
        || {
            let used = nv.snapshot().used(gpu);
            if used <= CLAIM_MEMORY {
                Ok(())
            } else {
                Err(format!("the fake driver holds {used} bytes"))
            }
        },
    )
}

/// A `gpud-rm` in a pod that lives across steps: `kubectl exec -i` with its standard input kept
/// open, one answer line per command.
struct Holder {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Holder {
    fn start(e: &E2e, pod: &str) -> anyhow::Result<Self> {
        let nv = Path::new(FAKES).join("nv/nvidiactl");
        let mut child = e
            .kubectl()
            .args(["exec", "-i", pod, "--", "/e2e/gpud-rm", "--file"])
            .arg(&nv)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("kubectl exec")?;
        let stdin = child.stdin.take();
        let stdout = std::io::BufReader::new(child.stdout.take().context("stdout")?);
        Ok(Self {
            child,
            stdin,
            stdout,
        })
    }

    /// A tenant in `pod` with a client `client` and a device on `gpu`: the device's handle.
    fn open_gpu(e: &E2e, pod: &str, client: u32, gpu: u32) -> anyhow::Result<(Self, String)> {
        let mut h = Self::start(e, pod)?;
        let answer = h.say(&format!("client {client:#x}"))?;
        ensure!(answer.contains("\"ok\":true"), "client: {answer:?}");
        let answer = h.say(&format!("device {client:#x} {gpu}"))?;
        let v: Value =
            serde_json::from_str(&answer).with_context(|| format!("device: {answer:?}"))?;
        ensure!(v["ok"] == true, "device: {answer}");
        let handle = v["handle"].as_u64().context("device: no handle")?;
        Ok((h, format!("{handle:#x}")))
    }

    /// Sends one command; its answer line, or "" once the tenant is gone (killed by gpud).
    fn say(&mut self, line: &str) -> anyhow::Result<String> {
        use std::io::BufRead as _;
        let stdin = self.stdin.as_mut().context("closed")?;
        if writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .is_err()
        {
            return Ok(String::new());
        }
        let mut answer = String::new();
        self.stdout.read_line(&mut answer)?;
        Ok(answer.trim().to_owned())
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // End of input: gpud-rm exits, its file closes, the driver frees what it held.
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// `busctl --system ARGS` on the node, as root: its output.
fn busctl(args: &[&str]) -> anyhow::Result<String> {
    node_command("busctl", &[&["--system"], args].concat())
}

/// `program ARGS` on the node, as root: its standard output, or an error with its standard
/// error.
fn node_command(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program}"))?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The GPU index the DRA driver allocated to `pod`'s claim (its device `gpu-N`).
fn allocated_gpu(e: &E2e, pod: &str) -> anyhow::Result<u32> {
    let p = e.k_json(&["get", "pod", pod])?;
    let claim = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .context("the pod names no claim")?
        .to_owned();
    let c = e.k_json(&["get", "resourceclaim", &claim])?;
    let device = c["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .context("the claim is not allocated")?;
    device
        .strip_prefix("gpu-")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("device {device}: not gpu-N"))
}
