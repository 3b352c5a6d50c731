//! `cargo xtask cluster down`: stops everything `up` started and removes what it left on the host,
//! then checks that nothing is left. Idempotent: every step looks first.
//!
//! Order: the kubelet first (so nothing restarts pods), then the pods through containerd (their
//! network namespaces noted first), containerd and its shims, kube-proxy and the control plane,
//! etcd; then mounts, the `kubepods` cgroups in every hierarchy, the KUBE-*/CNI-* iptables
//! chains, the bridge, the sysctls, and the state directory (its logs stay).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{BRIDGE, CNI_NETWORK, Cluster};
use crate::util::which;

/// The order processes are stopped in.
const ORDER: &[&str] = &[
    "kubelet",
    "containerd",
    "kube-proxy",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
];

/// The program names the cluster's processes run as (`kube-*` and `kubelet` are links to one
/// binary, argv[0] keeps the name).
const PROGRAMS: &[&str] = &[
    "etcd",
    "containerd",
    "containerd-shim-runc-v2",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
    "kubelet",
];

/// Where containerd 1.7's CRI puts pod network namespaces (not configurable). Only a CNI-using
/// containerd makes `cni-*` ones; the tests' own containerd runs host-network pods.
const NETNS_DIR: &str = "/run/netns";

/// The processes of the cluster in `dir`: one of [`PROGRAMS`] whose command line names `dir`
/// (every component gets a path in it; the shims get containerd's socket).
fn ours(dir: &Path) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id())
        .filter_map(|pid| Some((pid, program_of(pid, dir)?)))
        .collect()
}

/// The program name of `pid` if it is one of the cluster in `dir`.
fn program_of(pid: u32, dir: &Path) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv0 = cmdline.split(|&b| b == 0).next()?;
    let name = String::from_utf8_lossy(argv0);
    let name = name.rsplit('/').next()?.to_owned();
    let needle = dir.as_os_str().as_encoded_bytes();
    (PROGRAMS.contains(&name.as_str()) && cmdline.windows(needle.len()).any(|w| w == needle))
        .then_some(name)
}

/// Whether `pid` is a process of the cluster in `dir` (a pid file's pid may have been reused).
pub fn is_ours(pid: u32, dir: &Path) -> bool {
    program_of(pid, dir).is_some()
}

fn kill(pid: u32, signal: i32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) on a pid read from /proc; no memory is involved.
        unsafe { libc::kill(pid, signal) };
    }
}

/// SIGTERM to each of `pids`, SIGKILL to those still there after `grace`; waits for them to go.
fn stop(pids: &[u32], dir: &Path, grace: Duration) {
    for &pid in pids {
        kill(pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while pids.iter().any(|&p| is_ours(p, dir)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for &pid in pids.iter().filter(|&&p| is_ours(p, dir)) {
        kill(pid, libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| is_ours(p, dir)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops the processes running as `program` (by pid file and by scanning, so that one whose pid
/// file was lost goes too).
fn stop_program(c: &Cluster, program: &str, grace: Duration) {
    let pids: Vec<u32> = ours(&c.dir)
        .into_iter()
        .filter(|(_, name)| name == program)
        .map(|(pid, _)| pid)
        .collect();
    stop(&pids, &c.dir, grace);
    let _ = std::fs::remove_file(c.pid_file(program));
}

/// The pods' containers through containerd while it still runs: kill the tasks, delete them and
/// the containers. Returns the network namespaces the sandboxes used.
fn remove_pods(c: &Cluster) -> Vec<PathBuf> {
    // Without its socket ctr would spend its whole dial timeout.
    let socket_up = c.socket().exists()
        && c.ctr()
            .arg("version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !socket_up {
        return Vec::new();
    }
    let list = |args: &[&str]| -> Vec<String> {
        c.ctr()
            .args(args)
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let containers = list(&["containers", "list", "-q"]);
    let mut netns = Vec::new();
    for id in &containers {
        let info = c.ctr().args(["containers", "info", id]).output();
        let Ok(info) = info else { continue };
        let Ok(json) = serde_json::from_slice::<serde_json::Value>(&info.stdout) else {
            continue;
        };
        let namespaces = json["Spec"]["linux"]["namespaces"].as_array().cloned();
        for ns in namespaces.unwrap_or_default() {
            if ns["type"] == "network"
                && let Some(path) = ns["path"].as_str()
                && !path.is_empty()
            {
                netns.push(PathBuf::from(path));
            }
        }
    }
    for id in list(&["tasks", "list", "-q"]) {
        let _ = c
            .ctr()
            .args(["tasks", "kill", "--all", "--signal", "SIGKILL", &id])
            .output();
    }
    for id in list(&["tasks", "list", "-q"]) {
        let _ = c.ctr().args(["tasks", "delete", "--force", &id]).output();
    }
    for id in &containers {
        let _ = c.ctr().args(["containers", "delete", id]).output();
    }
    netns.sort();
    netns.dedup();
    netns
}

/// The mount points in /proc/self/mountinfo (octal escapes decoded).
fn mount_points() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .collect()
}

/// Decodes mountinfo's `\ooo` escapes (space, tab, newline, backslash).
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mounts that are the cluster's: under its directory, and its pods' network namespaces.
fn our_mounts(c: &Cluster) -> Vec<String> {
    let dir = format!("{}/", c.dir.display());
    let netns = format!("{NETNS_DIR}/cni-");
    mount_points()
        .into_iter()
        .filter(|m| m.starts_with(&dir) || m.starts_with(&netns))
        .collect()
}

/// Unmounts the cluster's mounts, innermost first, until none is left (mounts stack).
fn unmount(c: &Cluster) {
    for _ in 0..10 {
        let mut mounts = our_mounts(c);
        if mounts.is_empty() {
            break;
        }
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            if let Ok(path) = std::ffi::CString::new(m) {
                // SAFETY: a NUL-terminated path that outlives the call.
                unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

/// Every cgroup hierarchy's mount point (v1 controllers and cgroup2), from mountinfo.
fn cgroup_mounts() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (_, fs) = l.split_once(" - ")?;
            let fstype = fs.split(' ').next()?;
            let point = l.split(' ').nth(4)?;
            matches!(fstype, "cgroup" | "cgroup2").then(|| unescape(point))
        })
        .map(PathBuf::from)
        .collect()
}

/// The kubelet's `kubepods` cgroup in each hierarchy that has one (cgroupfs driver, root `/`).
fn kubepods() -> Vec<PathBuf> {
    cgroup_mounts()
        .into_iter()
        .map(|m| m.join("kubepods"))
        .filter(|p| p.is_dir())
        .collect()
}

/// `dir`'s descendant cgroups, children before parents, `dir` last.
fn cgroup_tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(cgroup_tree(&entry.path()));
        }
    }
    out.push(dir.to_owned());
    out
}

/// Kills what still runs in the `kubepods` cgroups (containers whose shim is gone) and removes
/// them in every hierarchy.
fn remove_cgroups() {
    for _ in 0..100 {
        let roots = kubepods();
        if roots.is_empty() {
            return;
        }
        for root in roots {
            // cgroup2 kills the whole subtree at once; v1 needs the pids.
            let _ = std::fs::write(root.join("cgroup.kill"), "1");
            for cg in cgroup_tree(&root) {
                let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
                for pid in procs.lines().filter_map(|p| p.trim().parse().ok()) {
                    kill(pid, libc::SIGKILL);
                }
                let _ = std::fs::remove_dir(&cg);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The iptables front ends present (both backends: kube-proxy picks one by what it finds).
fn iptables_tools() -> Vec<&'static str> {
    [
        "iptables",
        "ip6tables",
        "iptables-legacy",
        "ip6tables-legacy",
    ]
    .into_iter()
    .filter(|t| which(t).is_some())
    .collect()
}

const TABLES: &[&str] = &["filter", "nat", "mangle", "raw"];

/// Whether `chain` is one kube-proxy, the kubelet or the CNI plugins made.
fn our_chain(chain: &str) -> bool {
    chain.starts_with("KUBE-") || chain.starts_with("CNI-")
}

/// `iptables -S`'s words, with double-quoted ones (comments) joined and unquoted.
fn split_rule(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let (mut quoted, mut escaped, mut any) = (false, false, false);
    for ch in line.chars() {
        match ch {
            _ if escaped => {
                word.push(ch);
                escaped = false;
            }
            '\\' if quoted => escaped = true,
            '"' => {
                quoted = !quoted;
                any = true;
            }
            ' ' if !quoted => {
                if any || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                any = false;
            }
            _ => word.push(ch),
        }
    }
    if any || !word.is_empty() {
        words.push(word);
    }
    words
}

/// `TOOL -t TABLE -S`'s lines, if it works.
fn rules(tool: &str, table: &str) -> Vec<String> {
    Command::new(tool)
        .args(["-w", "-t", table, "-S"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Removes the rules that jump to KUBE-*/CNI-* chains from other chains, then those chains.
fn remove_iptables() {
    for tool in iptables_tools() {
        for table in TABLES {
            let lines = rules(tool, table);
            for line in &lines {
                let words = split_rule(line);
                let [verb, chain, rest @ ..] = words.as_slice() else {
                    continue;
                };
                let jumps_to_ours = rest
                    .windows(2)
                    .any(|w| (w[0] == "-j" || w[0] == "-g") && our_chain(&w[1]));
                if verb == "-A" && !our_chain(chain) && jumps_to_ours {
                    let _ = Command::new(tool)
                        .args(["-w", "-t", table, "-D", chain])
                        .args(rest)
                        .output();
                }
            }
            let chains: Vec<String> = lines
                .iter()
                .filter_map(|l| l.strip_prefix("-N "))
                .filter(|c| our_chain(c))
                .map(str::to_owned)
                .collect();
            for flag in ["-F", "-X"] {
                for chain in &chains {
                    let _ = Command::new(tool)
                        .args(["-w", "-t", table, flag, chain])
                        .output();
                }
            }
        }
    }
}

/// The iptables lines of the cluster still there.
fn iptables_left() -> Vec<String> {
    let mut left = Vec::new();
    for tool in iptables_tools() {
        for table in TABLES {
            left.extend(
                rules(tool, table)
                    .into_iter()
                    .filter(|l| l.contains("KUBE-") || l.contains("CNI-"))
                    .map(|l| format!("{tool} -t {table}: {l}")),
            );
        }
    }
    left
}

fn bridge_exists() -> bool {
    Path::new("/sys/class/net").join(BRIDGE).exists()
}

/// Puts back the sysctls `up` saved.
fn restore_sysctls(c: &Cluster) {
    let saved = std::fs::read_to_string(c.dir.join("sysctl.saved")).unwrap_or_default();
    for (name, value) in saved.lines().filter_map(|l| l.split_once('=')) {
        if super::sysctl(name).as_deref() != Some(value) {
            let _ = super::set_sysctl(name, value);
        }
    }
}

/// The shims' sockets in /run/containerd/s (containerd 1.7 does not let them move): each task's
/// `address` file names one.
fn remove_shim_sockets(c: &Cluster) {
    let tasks = c.dir.join("containerd/state/io.containerd.runtime.v2.task");
    for ns in std::fs::read_dir(&tasks).into_iter().flatten().flatten() {
        for task in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            if let Ok(address) = std::fs::read_to_string(task.path().join("address")) {
                let socket = address.trim().trim_start_matches("unix://");
                if socket.starts_with("/run/containerd/s/") {
                    let _ = std::fs::remove_file(socket);
                }
            }
        }
    }
}

/// The kubelet's links to its pods' logs in /var/log/containers (a fixed path) that point into
/// the cluster directory.
fn container_log_links(c: &Cluster) -> Vec<PathBuf> {
    std::fs::read_dir("/var/log/containers")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_link(p).is_ok_and(|t| t.starts_with(&c.dir)))
        .collect()
}

/// Everything of the cluster still on the host.
fn leftovers(c: &Cluster) -> Vec<String> {
    let mut left: Vec<String> = ours(&c.dir)
        .into_iter()
        .map(|(pid, name)| format!("process {name} (pid {pid})"))
        .collect();
    left.extend(our_mounts(c).into_iter().map(|m| format!("mount {m}")));
    left.extend(
        kubepods()
            .into_iter()
            .map(|p| format!("cgroup {}", p.display())),
    );
    left.extend(iptables_left());
    if bridge_exists() {
        left.push(format!("interface {BRIDGE}"));
    }
    left.extend(
        container_log_links(c)
            .into_iter()
            .map(|l| format!("log link {}", l.display())),
    );
    left.extend(
        super::NODE_LINKS
            .iter()
            .filter(|(path, dir)| std::fs::read_link(path).is_ok_and(|t| t == c.dir.join(dir)))
            .map(|(path, _)| format!("link {path}")),
    );
    left
}

/// Takes the cluster down; with `quiet`, prints nothing when there was nothing to do.
pub fn teardown(c: &Cluster, quiet: bool) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut netns = Vec::new();
    for name in ORDER {
        if *name == "containerd" {
            netns = remove_pods(c);
            remove_shim_sockets(c);
            stop_program(c, "containerd", Duration::from_secs(5));
            // Shims outlive containerd by design.
            stop_program(c, "containerd-shim-runc-v2", Duration::from_secs(2));
        } else {
            stop_program(c, name, Duration::from_secs(10));
        }
    }
    remove_cgroups();
    unmount(c);
    let stale = std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("cni-"))
        .map(|e| e.path());
    for ns in netns.into_iter().chain(stale) {
        let _ = std::fs::remove_file(ns);
    }
    remove_iptables();
    if bridge_exists() {
        let _ = Command::new("ip").args(["link", "delete", BRIDGE]).output();
    }
    // libcni's result cache, outside the cluster directory.
    let results = Path::new("/var/lib/cni/results");
    for e in std::fs::read_dir(results).into_iter().flatten().flatten() {
        if e.file_name()
            .to_string_lossy()
            .starts_with(&format!("{CNI_NETWORK}-"))
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
    for link in container_log_links(c) {
        let _ = std::fs::remove_file(link);
    }
    restore_sysctls(c);
    for (path, dir) in super::NODE_LINKS {
        if std::fs::read_link(path).is_ok_and(|t| t == c.dir.join(dir)) {
            let _ = std::fs::remove_file(path);
        }
    }
    if c.root_made_shared().exists() {
        let _ = Command::new("mount")
            .args(["--make-rprivate", "/"])
            .output();
    }
    // A mount still there would take what it shows with it.
    let mounted = our_mounts(c);
    if !mounted.is_empty() {
        bail!(
            "cluster down: cannot unmount, so {} stays:\n  {}",
            c.dir.display(),
            mounted.join("\n  ")
        );
    }
    // Everything but the logs (the last run's, for reading after `down`).
    for e in std::fs::read_dir(&c.dir).into_iter().flatten().flatten() {
        if e.file_name() != "logs" {
            let path = e.path();
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.with_context(|| format!("cluster down: removing {}", path.display()))?;
        }
    }
    let left = leftovers(c);
    if !left.is_empty() {
        bail!(
            "cluster down: still there afterwards:\n  {}",
            left.join("\n  ")
        );
    }
    if !quiet {
        println!(
            "cluster: down in {:.1} s; no process, mount, cgroup, iptables rule or bridge of it \
             is left",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// `cargo xtask cluster down`.
pub fn down() -> anyhow::Result<()> {
    super::need_root("down")?;
    teardown(&Cluster::new(), false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_split_with_quoted_comments() {
        let line =
            r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#;
        assert_eq!(
            split_rule(line),
            [
                "-A",
                "PREROUTING",
                "-m",
                "comment",
                "--comment",
                "kubernetes service portals",
                "-j",
                "KUBE-SERVICES"
            ]
        );
        assert_eq!(
            split_rule(r#"-A X --comment """#),
            ["-A", "X", "--comment", ""]
        );
    }

    #[test]
    fn mountinfo_escapes_decode() {
        assert_eq!(unescape(r"/run/a\040b"), "/run/a b");
        assert_eq!(unescape(r"/x\\y"), r"/x\\y");
    }
}
