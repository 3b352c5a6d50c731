//! `cargo xtask cluster up|down|status`: a real single-node Kubernetes 1.36 on this machine, for
//! tests that need the API server, the scheduler, the kubelet and containerd together (DRA
//! claims, DaemonSets, NRI, CDI).
//!
//! The Kubernetes components come from one static binary (`kube.xz` in `$GPUD_KUBE_BIN`, by
//! default `../shared/k8s`), unpacked once into `target/cluster/bin`; etcd and kubectl from
//! Debian sid and containerd 1.7 from trixie, unpacked by `cargo xtask setup`. Every component
//! runs as a child process with its log in `DIR/logs` and its pid in `DIR/pids`, all state under
//! one directory `DIR` (`$GPUD_CLUSTER_DIR`, by default `target/cluster/run`), and `down` takes
//! everything away again: processes, pods, mounts, cgroups, iptables rules, the bridge.
//!
//! The configuration is what this kind of machine needs: hybrid cgroups (the cgroupfs driver,
//! `failCgroupV1: false`), no swap check, and no `CAP_SYS_RESOURCE` (containerd's
//! `restrict_oom_score_adj`, the kubelet's `oomScoreAdj: 0`). There is no registry: the pods'
//! one image, also the sandbox image, is built from busybox and imported (`image.rs`).

mod conf;
mod down;
mod e2e;
mod image;
mod pki;

use std::{
    collections::BTreeMap,
    ffi::OsString,
    fs::File,
    io::{Read as _, Seek as _, SeekFrom},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use sha2::{Digest as _, Sha256};

pub use down::down;
pub use e2e::e2e;

use crate::{
    Reported, Skipped, setup,
    util::{describe, root, which},
};

/// The API server's port on 127.0.0.1.
const API_PORT: u16 = 6443;
/// The pods' addresses (host-local IPAM on the bridge).
const POD_SUBNET: &str = "10.244.0.0/24";
/// The bridge the CNI makes for the pods.
const BRIDGE: &str = "cni0";
/// The CNI network's name (also the prefix of libcni's cache files in /var/lib/cni/results).
const CNI_NETWORK: &str = "gpud-cluster";
/// Debian's CNI plugins (`containernetworking-plugins`).
const CNI_BIN: &str = "/usr/lib/cni";
/// The image imported into containerd: pause image and test pods' image.
pub const IMAGE: &str = "gpud.test/busybox:1";
/// How long `up` may take, from start to a Ready node.
const UP_DEADLINE: Duration = Duration::from_secs(120);
/// The sha256 of `kube.xz` and of the binary it unpacks to (../shared/k8s/README.md).
const KUBE_XZ_SHA256: &str = "81adc145dcf4091bd80d7d5db98b0d0cbc2e5724316889398610c30076b9afe8";
const KUBE_SHA256: &str = "f50fbbaad51495547dc5955329b054fadd618d53fe687cc885d591a0e4a23baa";
/// The components `kube` dispatches to by name.
const KUBE_COMPONENTS: &[&str] = &[
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
    "kubelet",
];
/// Every supervised process, in start order; `down` stops them in the order of [`down::ORDER`].
const COMPONENTS: &[&str] = &[
    "etcd",
    "containerd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
];
/// Paths that node plugins and runtimes name as such (the kubelet's root, where DRA and device
/// plugins put their sockets; NRI's socket directory), made symbolic links into the cluster
/// directory by `up` and removed by `down`: a DaemonSet's hostPath `/var/lib/kubelet/plugins`
/// then works as on any node. Path, directory under the cluster's.
const NODE_LINKS: [(&str, &str); 2] = [("/var/lib/kubelet", "kubelet"), ("/run/nri", "nri")];
/// Sysctls the kubelet sets at start (`protectKernelDefaults: false`); `up` saves them and `down`
/// puts them back, along with those `up` sets for the bridge.
const SAVED_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/bridge/bridge-nf-call-iptables",
];

/// The cluster's directories and names.
pub struct Cluster {
    /// Everything the cluster writes.
    dir: PathBuf,
    /// The unpacked Kubernetes binaries.
    bin: PathBuf,
    /// The node's name (the host name, as a DNS label).
    node: String,
}

impl Cluster {
    fn new() -> Self {
        let dir = std::env::var_os("GPUD_CLUSTER_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root().join("target/cluster/run"));
        let node: String = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let node = node.trim_matches('-');
        Self {
            dir,
            bin: root().join("target/cluster/bin"),
            node: if node.is_empty() { "node" } else { node }.to_owned(),
        }
    }

    fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{name}.log"))
    }

    fn pid_file(&self, name: &str) -> PathBuf {
        self.dir.join("pids").join(format!("{name}.pid"))
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("containerd/containerd.sock")
    }

    /// Present when `up` made `/` shared (it was private).
    fn root_made_shared(&self) -> PathBuf {
        self.dir.join("root.made-shared")
    }

    /// Why kube-proxy was left out, if it was.
    fn proxy_left_out(&self) -> PathBuf {
        self.dir.join("kube-proxy.left-out")
    }

    /// The pid recorded for `name`, if that process still runs as that component.
    fn running(&self, name: &str) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.pid_file(name))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        down::is_ours(pid, &self.dir).then_some(pid)
    }

    /// `kubectl --kubeconfig admin.kubeconfig ARGS`.
    fn kubectl(&self) -> Command {
        let mut c = Command::new(kube_tool("kubectl"));
        c.arg("--kubeconfig").arg(self.kubeconfig());
        c
    }

    /// `kubectl ARGS`'s stdout, if it succeeds.
    fn kubectl_out(&self, args: &[&str]) -> Option<String> {
        self.kubectl()
            .args(args)
            .args(["--request-timeout", "5s"])
            .stdin(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    }

    /// `ctr --address SOCKET --namespace k8s.io` (the CRI's namespace).
    fn ctr(&self) -> Command {
        let mut c = Command::new(containerd_bin("ctr"));
        c.arg("--address")
            .arg(self.socket())
            .args(["--namespace", "k8s.io"]);
        c
    }

    /// Whether the node reports Ready.
    fn node_ready(&self) -> bool {
        self.kubectl_out(&[
            "get",
            "node",
            &self.node,
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
        ])
        .is_some_and(|s| s.trim() == "True")
    }
}

/// `/opt/gpud-test/kube-tools/usr/bin/NAME` (etcd, kubectl).
fn kube_tool(name: &str) -> PathBuf {
    Path::new(setup::KUBE_TOOLS_PREFIX)
        .join("usr/bin")
        .join(name)
}

/// `/opt/gpud-test/containerd/usr/bin/NAME`.
fn containerd_bin(name: &str) -> PathBuf {
    Path::new(setup::CONTAINERD_PREFIX)
        .join("usr/bin")
        .join(name)
}

/// The host's first global IPv4 address: the node's address, and the API server's advertised
/// one (the `kubernetes` Service's endpoint may not be a loopback address).
fn host_ip() -> Option<String> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains(BRIDGE))
        .find_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "inet")?;
            Some(words.next()?.split('/').next()?.to_owned())
        })
}

/// Hex sha256 of the file at `path`.
fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Makes `bin/kube` and its component links from `$GPUD_KUBE_BIN/kube.xz` (checked against its
/// published sha256) unless done before, or links the components found there one by one. Fails
/// with [`Skipped`] when neither is there.
fn kube_binaries(c: &Cluster) -> anyhow::Result<()> {
    let source = std::env::var_os("GPUD_KUBE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("../shared/k8s"));
    let xz = source.join("kube.xz");
    let kube = c.bin.join("kube");
    let stamp = c.bin.join("kube.sha256");
    std::fs::create_dir_all(&c.bin).with_context(|| format!("creating {}", c.bin.display()))?;
    if xz.is_file() {
        let unpacked = std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == KUBE_SHA256)
            && kube.is_file();
        if !unpacked {
            println!(
                "cluster: unpacking {} into {}",
                xz.display(),
                c.bin.display()
            );
            let got = sha256_file(&xz)?;
            if got != KUBE_XZ_SHA256 {
                bail!(
                    "cluster: {} has sha256 {got}, not the published {KUBE_XZ_SHA256}",
                    xz.display()
                );
            }
            let out =
                File::create(&kube).with_context(|| format!("creating {}", kube.display()))?;
            let status = Command::new("xz")
                .arg("-dc")
                .arg(&xz)
                .stdout(out)
                .status()
                .context("cluster: cannot start xz (Debian xz-utils)")?;
            if !status.success() {
                bail!(
                    "cluster: `xz -dc {}` failed ({})",
                    xz.display(),
                    describe(status)
                );
            }
            let got = sha256_file(&kube)?;
            if got != KUBE_SHA256 {
                bail!(
                    "cluster: {} unpacked to sha256 {got}, not {KUBE_SHA256}",
                    xz.display()
                );
            }
            set_executable(&kube)?;
            std::fs::write(&stamp, KUBE_SHA256).context("cluster: writing the stamp")?;
        }
        for component in KUBE_COMPONENTS {
            link(Path::new("kube"), &c.bin.join(component))?;
        }
        return Ok(());
    }
    // Release binaries, one per component, as a machine that can download them would have.
    if KUBE_COMPONENTS.iter().all(|b| source.join(b).is_file()) {
        for component in KUBE_COMPONENTS {
            link(&source.join(component), &c.bin.join(component))?;
        }
        return Ok(());
    }
    println!(
        "cluster: SKIPPED: no Kubernetes binaries: neither {} nor the component binaries ({}) \
         are in {} (set GPUD_KUBE_BIN to the directory that holds them)",
        xz.display(),
        KUBE_COMPONENTS.join(", "),
        source.display()
    );
    Err(Skipped.into())
}

fn set_executable(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod {}", path.display()))
}

/// Points the symlink `link` at `target`, replacing what is there.
fn link(target: &Path, link: &Path) -> anyhow::Result<()> {
    if std::fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target, link)
        .with_context(|| format!("linking {} to {}", link.display(), target.display()))
}

/// Fails unless running as root.
fn need_root(what: &str) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("cluster {what}: needs root (it runs the kubelet and containerd); run as root");
    }
    Ok(())
}

/// Everything `up` needs besides the Kubernetes binaries, installed by setup's own steps when
/// missing; returns runc's path.
fn tools() -> anyhow::Result<PathBuf> {
    let mut installed = Vec::new();
    setup::kube_tools(&mut installed)?;
    setup::containerd(&mut installed)?;
    if !installed.is_empty() {
        println!("cluster: installed {}", installed.join(", "));
    }
    let missing: Vec<&str> = ["openssl", "iptables", "conntrack", "xz", "ip", "tar"]
        .into_iter()
        .filter(|t| which(t).is_none())
        .collect();
    if !missing.is_empty() || !Path::new(CNI_BIN).join("bridge").is_file() {
        bail!(
            "cluster: missing {} {}: `cargo xtask setup` installs them",
            missing.join(" "),
            if Path::new(CNI_BIN).join("bridge").is_file() {
                ""
            } else {
                "and the CNI plugins (/usr/lib/cni)"
            }
        );
    }
    which("runc").context("cluster: no runc on PATH: `cargo xtask setup` installs it")
}

/// Whether the kernel's overlay filesystem mounts here (not on every backing filesystem).
fn overlay_works(dir: &Path) -> bool {
    let probe = dir.join("overlay-probe");
    let (lower, upper, work, merged) = (
        probe.join("lower"),
        probe.join("upper"),
        probe.join("work"),
        probe.join("merged"),
    );
    let made = [&lower, &upper, &work, &merged]
        .iter()
        .all(|d| std::fs::create_dir_all(d).is_ok());
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    let ok = made && {
        let cstr = |s: &str| std::ffi::CString::new(s).ok();
        match (
            cstr("overlay"),
            cstr(&merged.display().to_string()),
            cstr(&data),
        ) {
            (Some(fs), Some(target), Some(data)) => {
                // SAFETY: NUL-terminated strings that outlive the call.
                let r = unsafe {
                    libc::mount(
                        fs.as_ptr(),
                        target.as_ptr(),
                        fs.as_ptr(),
                        0,
                        data.as_ptr().cast(),
                    )
                };
                if r == 0 {
                    // SAFETY: as above.
                    unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
                }
                r == 0
            }
            _ => false,
        }
    };
    let _ = std::fs::remove_dir_all(&probe);
    ok
}

/// Reads and writes `/proc/sys/NAME`.
fn sysctl(name: &str) -> Option<String> {
    std::fs::read_to_string(Path::new("/proc/sys").join(name))
        .ok()
        .map(|s| s.trim().to_owned())
}

fn set_sysctl(name: &str, value: &str) -> anyhow::Result<()> {
    std::fs::write(Path::new("/proc/sys").join(name), value)
        .with_context(|| format!("cluster: setting {name} to {value}"))
}

/// The started children: `up` watches them so that one that exits fails `up` at once.
struct Children {
    children: BTreeMap<&'static str, Child>,
}

impl Children {
    /// Starts `program ARGS` as `name`: its own process group (an interrupted `up` does not take
    /// it down; `down` does), its output in `DIR/logs/NAME.log`, its pid in `DIR/pids/NAME.pid`.
    fn spawn(
        &mut self,
        c: &Cluster,
        name: &'static str,
        program: &Path,
        args: &[OsString],
    ) -> anyhow::Result<()> {
        let log = c.log(name);
        let file = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let path = format!(
            "{}:{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            containerd_bin("").display(),
            c.bin.display()
        );
        let child = Command::new(program)
            .args(args)
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .process_group(0)
            .spawn()
            .with_context(|| format!("cluster: starting {name} ({})", program.display()))?;
        std::fs::write(c.pid_file(name), format!("{}\n", child.id()))
            .with_context(|| format!("cluster: writing {name}'s pid file"))?;
        self.children.insert(name, child);
        Ok(())
    }

    /// Fails, naming its log's tail, if a child has exited.
    fn check(&mut self, c: &Cluster) -> anyhow::Result<()> {
        for (name, child) in &mut self.children {
            if let Ok(Some(status)) = child.try_wait() {
                bail!(
                    "cluster up: {name} exited ({}); {}",
                    describe(status),
                    tails(c, &[name])
                );
            }
        }
        Ok(())
    }

    /// Stops watching `name` (left running, or stopped by the caller).
    fn forget(&mut self, name: &str) -> Option<Child> {
        self.children.remove(name)
    }
}

/// The last lines of the named components' logs, for an error message.
fn tails(c: &Cluster, names: &[&str]) -> String {
    let mut text = String::new();
    for name in names {
        let path = c.log(name);
        let tail = read_tail(&path, 4096);
        let lines: Vec<&str> = tail.lines().collect();
        let start = lines.len().saturating_sub(12);
        text.push_str(&format!(
            "\n--- last lines of {} ---\n{}",
            path.display(),
            lines[start..].join("\n")
        ));
    }
    text
}

/// The last `max` bytes of `path`, lossily.
fn read_tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Polls `ready` every 250 ms until it holds; fails at `deadline`, naming `logs`' tails, or as
/// soon as a child exits.
fn wait_for(
    c: &Cluster,
    children: &mut Children,
    what: &str,
    deadline: Instant,
    logs: &[&str],
    mut ready: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    loop {
        children.check(c)?;
        if ready() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "cluster up: {what}: not within {} s; {}",
                UP_DEADLINE.as_secs(),
                tails(c, logs)
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

fn path_arg(flag: &str, path: &Path) -> OsString {
    let mut s = OsString::from(flag);
    s.push("=");
    s.push(path);
    s
}

/// `cargo xtask cluster up`.
pub fn up() -> anyhow::Result<()> {
    need_root("up")?;
    let c = Cluster::new();
    kube_binaries(&c)?;
    let runc = tools()?;
    // A partial or earlier cluster goes first, so that this one starts clean.
    if COMPONENTS.iter().any(|n| c.pid_file(n).exists()) || c.dir.join("pki").exists() {
        println!("cluster: taking down what an earlier `up` left");
        down::teardown(&c, true)?;
    }
    let started = Instant::now();
    let deadline = started + UP_DEADLINE;
    for d in [
        "logs",
        "pids",
        "etcd",
        "containerd/cdi",
        "cni/conf",
        "cni/ipam",
        "kubelet/pki",
    ] {
        let d = c.dir.join(d);
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    }
    make_root_shared(&c)?;
    link_node_paths(&c)?;
    let host_ip = host_ip();
    pki::ensure(&c.dir.join("pki"), &c.node)?;
    for name in [
        "admin",
        "controller-manager",
        "scheduler",
        "kubelet",
        "kube-proxy",
    ] {
        let path = c.dir.join(format!("{name}.kubeconfig"));
        std::fs::write(&path, conf::kubeconfig(&c, name))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let snapshotter = if overlay_works(&c.dir) {
        "overlayfs"
    } else {
        "native"
    };
    let files = [
        (
            "containerd/config.toml",
            conf::containerd(&c, snapshotter, &runc),
        ),
        ("cni/conf/10-gpud-cluster.conflist", conf::cni(&c)),
        ("kubelet.yaml", conf::kubelet(&c)),
        ("kube-proxy.yaml", conf::kube_proxy(&c)),
    ];
    for (name, text) in files {
        std::fs::write(c.dir.join(name), text).with_context(|| format!("writing {name}"))?;
    }
    save_sysctls(&c)?;
    // Pods on the bridge reach Services and the world through the host's forwarding, and
    // kube-proxy's rules see bridged traffic only with bridge-nf-call-iptables.
    set_sysctl("net/ipv4/ip_forward", "1")?;
    if sysctl("net/bridge/bridge-nf-call-iptables").is_some() {
        set_sysctl("net/bridge/bridge-nf-call-iptables", "1")?;
    }

    let mut children = Children {
        children: BTreeMap::new(),
    };
    let pki = c.dir.join("pki");
    let p = |f: &str| pki.join(f);
    let mut etcd = os(&[
        "--name=default",
        "--listen-client-urls=http://127.0.0.1:2379",
        "--advertise-client-urls=http://127.0.0.1:2379",
        "--listen-peer-urls=http://127.0.0.1:2380",
        "--initial-advertise-peer-urls=http://127.0.0.1:2380",
        "--initial-cluster=default=http://127.0.0.1:2380",
        // A throwaway test cluster: fsync per write only slows a small machine down.
        "--unsafe-no-fsync=true",
    ]);
    etcd.push(path_arg("--data-dir", &c.dir.join("etcd")));
    children.spawn(&c, "etcd", &kube_tool("etcd"), &etcd)?;
    children.spawn(
        &c,
        "containerd",
        &containerd_bin("containerd"),
        &[path_arg("--config", &c.dir.join("containerd/config.toml"))],
    )?;
    let advertise = host_ip.clone().unwrap_or_else(|| "127.0.0.1".into());
    let mut apiserver = os(&[
        "--etcd-servers=http://127.0.0.1:2379",
        "--secure-port=6443",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        "--enable-admission-plugins=NodeRestriction",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        "--profiling=false",
    ]);
    apiserver.push(format!("--service-cluster-ip-range={}", conf::SERVICE_RANGE).into());
    // Pods reach the API server through the `kubernetes` Service, whose endpoint is the
    // advertised address: listen there too when the host has one.
    apiserver.push(
        format!(
            "--bind-address={}",
            if host_ip.is_some() {
                "0.0.0.0"
            } else {
                "127.0.0.1"
            }
        )
        .into(),
    );
    apiserver.push(format!("--advertise-address={advertise}").into());
    if host_ip.is_none() {
        apiserver.push("--endpoint-reconciler-type=none".into());
    }
    for (flag, file) in [
        ("--client-ca-file", "ca.crt"),
        ("--tls-cert-file", "apiserver.crt"),
        ("--tls-private-key-file", "apiserver.key"),
        (
            "--kubelet-client-certificate",
            "apiserver-kubelet-client.crt",
        ),
        ("--kubelet-client-key", "apiserver-kubelet-client.key"),
        ("--service-account-key-file", "sa.pub"),
        ("--service-account-signing-key-file", "sa.key"),
    ] {
        apiserver.push(path_arg(flag, &p(file)));
    }
    children.spawn(
        &c,
        "kube-apiserver",
        &c.bin.join("kube-apiserver"),
        &apiserver,
    )?;

    // While the API server starts: the image, into containerd.
    wait_for(
        &c,
        &mut children,
        "containerd's socket",
        deadline,
        &["containerd"],
        || {
            c.ctr()
                .arg("version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        },
    )?;
    let archive = image::build(&c.dir.join("image"), IMAGE)?;
    let out = c
        .ctr()
        .args(["images", "import", "--snapshotter", snapshotter])
        .arg(&archive)
        .output()
        .context("cluster: cannot start ctr")?;
    if !out.status.success() {
        bail!(
            "cluster up: `ctr images import` failed ({}): {}",
            describe(out.status),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }

    wait_for(
        &c,
        &mut children,
        "the API server's /readyz",
        deadline,
        &["kube-apiserver", "etcd"],
        || c.kubectl_out(&["get", "--raw", "/readyz"]).is_some(),
    )?;
    let kubeconfig =
        |name: &str| path_arg("--kubeconfig", &c.dir.join(format!("{name}.kubeconfig")));
    let delegated = |name: &str| {
        let file = c.dir.join(format!("{name}.kubeconfig"));
        [
            path_arg("--authentication-kubeconfig", &file),
            path_arg("--authorization-kubeconfig", &file),
        ]
    };
    let mut cm = os(&[
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
        "--use-service-account-credentials=true",
        // Every default controller: node-lifecycle, daemonset, resourceclaim among them.
        "--controllers=*",
    ]);
    cm.push(format!("--service-cluster-ip-range={}", conf::SERVICE_RANGE).into());
    cm.push(kubeconfig("controller-manager"));
    cm.extend(delegated("controller-manager"));
    for (flag, file) in [
        ("--service-account-private-key-file", "sa.key"),
        ("--root-ca-file", "ca.crt"),
        ("--cluster-signing-cert-file", "ca.crt"),
        ("--cluster-signing-key-file", "ca.key"),
    ] {
        cm.push(path_arg(flag, &p(file)));
    }
    children.spawn(
        &c,
        "kube-controller-manager",
        &c.bin.join("kube-controller-manager"),
        &cm,
    )?;
    let mut scheduler = os(&["--bind-address=127.0.0.1", "--leader-elect=false"]);
    scheduler.push(kubeconfig("scheduler"));
    scheduler.extend(delegated("scheduler"));
    children.spawn(
        &c,
        "kube-scheduler",
        &c.bin.join("kube-scheduler"),
        &scheduler,
    )?;
    let mut kubelet = vec![
        path_arg("--config", &c.dir.join("kubelet.yaml")),
        kubeconfig("kubelet"),
        path_arg("--root-dir", &c.dir.join("kubelet")),
        path_arg("--cert-dir", &c.dir.join("kubelet/pki")),
        format!(
            "--container-runtime-endpoint=unix://{}",
            c.socket().display()
        )
        .into(),
        format!("--hostname-override={}", c.node).into(),
    ];
    if let Some(ip) = &host_ip {
        kubelet.push(format!("--node-ip={ip}").into());
    }
    children.spawn(&c, "kubelet", &c.bin.join("kubelet"), &kubelet)?;
    children.spawn(
        &c,
        "kube-proxy",
        &c.bin.join("kube-proxy"),
        &[path_arg("--config", &c.dir.join("kube-proxy.yaml"))],
    )?;

    let all = [
        "kubelet",
        "containerd",
        "kube-controller-manager",
        "kube-apiserver",
    ];
    wait_for(&c, &mut children, "node Ready", deadline, &all, || {
        c.node_ready()
    })?;
    // The node-lifecycle controller removes the not-ready taint; by hand only if it has not
    // within a few seconds of the node turning Ready.
    let ready_at = Instant::now();
    let taint = "node.kubernetes.io/not-ready";
    wait_for(
        &c,
        &mut children,
        "the not-ready taint's removal",
        deadline,
        &all,
        || {
            let taints = c
                .kubectl_out(&[
                    "get",
                    "node",
                    &c.node,
                    "-o",
                    "jsonpath={.spec.taints[*].key}",
                ])
                .unwrap_or_default();
            if !taints.contains(taint) {
                return true;
            }
            if ready_at.elapsed() > Duration::from_secs(15) {
                println!(
                    "cluster: the node-lifecycle controller left {taint}: removing it by hand"
                );
                let _ = c.kubectl_out(&["taint", "node", &c.node, &format!("{taint}-")]);
            }
            false
        },
    )?;
    // Pods are refused until their namespace's service account exists.
    wait_for(
        &c,
        &mut children,
        "the default service account",
        deadline,
        &["kube-controller-manager"],
        || {
            c.kubectl_out(&["get", "serviceaccount", "default", "-o", "name"])
                .is_some()
        },
    )?;
    let dra = c
        .kubectl_out(&["api-versions"])
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("resource.k8s.io/"))
        .map(str::to_owned)
        .collect::<Vec<_>>();
    if dra.is_empty() {
        bail!("cluster up: the API server does not serve resource.k8s.io (DRA)");
    }
    // kube-proxy works when it has written its Service chains; where this kernel refuses its
    // rules it is left out, and `status` says so.
    let proxy = wait_for(
        &c,
        &mut children,
        "kube-proxy's rules",
        deadline.min(Instant::now() + Duration::from_secs(20)),
        &["kube-proxy"],
        || {
            Command::new("iptables")
                .args(["-w", "-t", "nat", "-S", "KUBE-SERVICES"])
                .output()
                .is_ok_and(|o| {
                    o.status.success() && String::from_utf8_lossy(&o.stdout).contains("KUBE-SVC-")
                })
        },
    );
    if let Err(e) = proxy {
        let why = format!("{e:#}");
        println!("cluster: kube-proxy does not work here, leaving it out: {why}");
        if let Some(mut child) = children.forget("kube-proxy") {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(c.pid_file("kube-proxy"));
        std::fs::write(c.proxy_left_out(), &why)
            .context("cluster: recording kube-proxy's state")?;
    }
    children.check(&c)?;
    println!(
        "cluster: up in {:.1} s: node {} Ready, {snapshotter} snapshotter, DRA {}, image {IMAGE}",
        started.elapsed().as_secs_f64(),
        c.node,
        dra.join(" ")
    );
    println!("export KUBECONFIG={}", c.kubeconfig().display());
    Ok(())
}

/// Makes each of [`NODE_LINKS`] a link into the cluster directory; refuses a path that is
/// something else (another kubelet or runtime on this machine).
fn link_node_paths(c: &Cluster) -> anyhow::Result<()> {
    for (path, dir) in NODE_LINKS {
        let (path, target) = (Path::new(path), c.dir.join(dir));
        std::fs::create_dir_all(&target)
            .with_context(|| format!("creating {}", target.display()))?;
        match std::fs::read_link(path) {
            Ok(t) if t == target => continue,
            Ok(t) => bail!(
                "cluster up: {} points to {}, not into this cluster: another cluster's? (`down` \
                 of that one removes it)",
                path.display(),
                t.display()
            ),
            Err(_) if path.symlink_metadata().is_ok() => bail!(
                "cluster up: {} exists: this machine runs another kubelet or runtime",
                path.display()
            ),
            Err(_) => {}
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::os::unix::fs::symlink(&target, path)
            .with_context(|| format!("linking {} to {}", path.display(), target.display()))?;
    }
    Ok(())
}

/// Whether `/` is a shared mount (mountinfo's optional field `shared:N`).
fn root_is_shared() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/"))
        .is_some_and(|l| l.split(" - ").next().unwrap_or("").contains(" shared:"))
}

/// Makes `/` shared, as systemd does on every node: pods' `Bidirectional` mounts (the gpud
/// DaemonSet's bpffs) need it. `down` makes it private again when `up` changed it.
fn make_root_shared(c: &Cluster) -> anyhow::Result<()> {
    if root_is_shared() {
        return Ok(());
    }
    crate::util::run(
        "mount --make-rshared /",
        Command::new("mount").args(["--make-rshared", "/"]),
    )?;
    std::fs::write(c.root_made_shared(), "").context("cluster: recording that / was made shared")
}

/// Records the sysctls the cluster changes, once per `up`.
fn save_sysctls(c: &Cluster) -> anyhow::Result<()> {
    let path = c.dir.join("sysctl.saved");
    if path.exists() {
        return Ok(());
    }
    let text: String = SAVED_SYSCTLS
        .iter()
        .filter_map(|name| Some(format!("{name}={}\n", sysctl(name)?)))
        .collect();
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// `cargo xtask cluster status`.
pub fn status() -> anyhow::Result<()> {
    let c = Cluster::new();
    let mut all = true;
    for name in COMPONENTS {
        match c.running(name) {
            Some(pid) => println!("{name:<24} running (pid {pid})"),
            None if *name == "kube-proxy" && c.proxy_left_out().exists() => println!(
                "{name:<24} left out: {}",
                std::fs::read_to_string(c.proxy_left_out())
                    .unwrap_or_default()
                    .trim()
            ),
            None => {
                all = false;
                println!("{name:<24} not running");
            }
        }
    }
    if c.running("kube-apiserver").is_some() {
        println!(
            "node {}: {}",
            c.node,
            if c.node_ready() { "Ready" } else { "not Ready" }
        );
        let nodes = c.kubectl_out(&["get", "nodes", "-o", "wide"]);
        print!(
            "{}",
            nodes.as_deref().unwrap_or("kubectl get nodes failed\n")
        );
        all &= c.node_ready();
        println!("export KUBECONFIG={}", c.kubeconfig().display());
    }
    if all {
        Ok(())
    } else {
        println!("cluster: not (fully) up");
        Err(Reported.into())
    }
}
