//! The shipped systemd unit (systemd/gpud.service): systemd's own checker accepts it, its
//! hardening exposure stays at most 4.0 (the figure docs/operations.md records), and its
//! capability set is exactly enough: the real gpud run with only those capabilities and
//! `no_new_privs` (as systemd runs it: root, bounding set = the unit's) attaches its probes,
//! attributes processes (also another user's, found by the `/proc` scan), enforces a memory limit
//! on the fake device and freezes and thaws the cgroup; without `CAP_BPF` it refuses to start,
//! naming it.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use gpud_tests::{Cgroup, Rig, RmProcess, TempDir, eventually, gpud_bin, spawn_in_cgroup};

const UNIT: &str = include_str!("../../systemd/gpud.service");
const OPERATIONS_DOC: &str = include_str!("../../docs/operations.md");
const MIB: u64 = 1 << 20;

/// The values of `key=` in the unit (systemd's assignment syntax; the unit holds no
/// continuation lines or quoting for these keys).
fn unit_values(key: &str) -> Vec<String> {
    UNIT.lines()
        .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
        .map(|v| v.trim().to_owned())
        .collect()
}

/// The unit with its binary paths pointing at the built ones (verify insists they exist).
fn unit_copy(dir: &Path) -> PathBuf {
    let text = UNIT.replace("/usr/bin/gpud", &gpud_bin().display().to_string());
    let path = dir.join("gpud.service");
    std::fs::write(&path, text).expect("write unit");
    path
}

#[test]
fn systemd_analyze_verify_accepts_the_unit() {
    let dir = TempDir::new("unit-verify");
    let unit = unit_copy(dir.path());
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .expect("run systemd-analyze (package systemd)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "verify failed: {stderr}");
    assert!(stderr.trim().is_empty(), "verify warned: {stderr}");
    // The shipped unit's own choices the rest of the project relies on.
    assert_eq!(unit_values("Type"), ["notify"]);
    assert_eq!(unit_values("ExecReload"), ["/bin/kill -HUP $MAINPID"]);
    assert_eq!(unit_values("RestartPreventExitStatus"), ["78"]);
    assert!(!unit_values("WatchdogSec").is_empty());
}

/// `systemd-analyze security --offline=true`'s overall exposure of the unit.
fn exposure(unit: &Path) -> f64 {
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(unit)
        .output()
        .expect("run systemd-analyze security");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level for gpud.service:"))
        .unwrap_or_else(|| panic!("no overall exposure in:\n{text}"));
    line.split(':')
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("cannot read the exposure in {line:?}"))
}

#[test]
fn security_exposure_is_at_most_4_and_documented() {
    let dir = TempDir::new("unit-security");
    let e = exposure(&unit_copy(dir.path()));
    assert!(e <= 4.0, "exposure {e} is over 4.0");
    let documented = format!("exposure level {e:.1}");
    assert!(
        OPERATIONS_DOC.contains(&documented),
        "docs/operations.md must record the measured `{documented}`"
    );
}

/// The unit's capability names, lower case without `cap_` (setpriv's and capsh's spelling).
fn unit_caps() -> BTreeSet<String> {
    let caps: BTreeSet<String> = unit_values("CapabilityBoundingSet")
        .iter()
        .flat_map(|v| v.split_whitespace())
        .map(|c| {
            c.strip_prefix("CAP_")
                .unwrap_or_else(|| panic!("unexpected capability {c}"))
                .to_lowercase()
        })
        .collect();
    assert!(!caps.is_empty(), "the unit sets no CapabilityBoundingSet");
    caps
}

/// Runs gpud as systemd would under the unit: root, `no_new_privs`, bounding set `caps`, no
/// inheritable or ambient capabilities (AmbientCapabilities= is empty).
fn setpriv(caps: &BTreeSet<String>) -> Vec<String> {
    let bounding: Vec<String> = caps.iter().map(|c| format!("+{c}")).collect();
    vec![
        "setpriv".into(),
        "--no-new-privs".into(),
        "--inh-caps=-all".into(),
        "--ambient-caps=-all".into(),
        format!("--bounding-set=-all,{}", bounding.join(",")),
        "--".into(),
    ]
}

/// Names in a capability mask, decoded by `capsh`.
fn decode(mask: &str) -> BTreeSet<String> {
    let out = Command::new("capsh")
        .arg(format!("--decode={mask}"))
        .output()
        .expect("run capsh (package libcap2-bin)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .split_once('=')
        .map(|(_, names)| names)
        .unwrap_or("")
        .split(',')
        .filter(|n| !n.is_empty())
        .map(|n| n.trim_start_matches("cap_").to_owned())
        .collect()
}

fn status_field(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().to_owned())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Mounts a bpffs instance at `dir/bpffs` (the unit's gpud has no CAP_SYS_ADMIN to mount one:
/// systemd mounts /sys/fs/bpf); TempDir's drop unmounts it.
fn mount_bpffs(dir: &Path) {
    let target = dir.join("bpffs");
    std::fs::create_dir_all(&target).expect("bpffs dir");
    let status = Command::new("mount")
        .args(["-t", "bpf", "bpf"])
        .arg(&target)
        .status()
        .expect("mount");
    assert!(status.success(), "mount -t bpf");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_units_capabilities_are_enough_and_cap_bpf_is_needed() {
    let Some(mut rig) = Rig::new("unit-caps").fake_device(1) else {
        return;
    };
    let caps = unit_caps();
    mount_bpffs(rig.path());
    let ctl = rig.ctl();
    // A stand-in file held, before the daemon starts, by a root process with every capability
    // (needs CAP_SYS_PTRACE to be read) and by one of another user (CAP_DAC_READ_SEARCH).
    let standin = rig.stand_in("standin");
    let holders = Cgroup::new("unit-holders");
    let mut root_holder =
        spawn_in_cgroup(&holders, &format!("exec sleep 60 < {}", standin.display()));
    let mut nobody_holder = spawn_in_cgroup(
        &holders,
        &format!(
            "exec setpriv --reuid 65534 --regid 65534 --clear-groups sleep 60 < {}",
            standin.display()
        ),
    );
    let config = rig
        .config()
        .extra_paths([&standin])
        .react_action("freeze")
        .nvml_off();
    let env = [("NOTIFY_SOCKET", None), ("RUST_LOG", None)];

    // With exactly the unit's capabilities.
    rig.start_wrapped(config, &env, &setpriv(&caps)).await;
    let pid = rig.pid().expect("pid");
    assert_eq!(
        decode(&status_field(pid, "CapEff:")),
        caps,
        "the daemon's effective set is the unit's"
    );
    assert_eq!(status_field(pid, "NoNewPrivs:"), "1");
    let log = rig.log_text();
    assert!(
        !log.contains("no CAP_"),
        "no capability warning with the unit's set:\n{log}"
    );
    let (_conn, proxy) = rig.proxy().await;
    assert!(
        !proxy.attach_mode().await.expect("AttachMode").is_empty(),
        "probes attached"
    );

    // The start-up scan found both holders.
    let want: BTreeSet<u32> = [root_holder.id(), nobody_holder.id()].into();
    let found = eventually(Duration::from_secs(5), || async {
        let pids: BTreeSet<u32> = proxy
            .get_cgroup(&holders.rel)
            .await
            .ok()?
            .pids
            .into_iter()
            .collect();
        want.is_subset(&pids).then_some(pids)
    })
    .await;
    assert!(
        found.is_some(),
        "scan missed a holder of another user or with more capabilities:\n{}",
        rig.log_text()
    );

    // A real process on the fake device is attributed; crossing its limit freezes its cgroup,
    // raising the limit thaws it.
    let cg = Cgroup::new("unit-caps");
    rig.set_limit(&cg.rel, "all", "memory_max", 4 * MIB).await;
    let mut p = RmProcess::spawn(Some(&cg.dir), &ctl);
    let (c, d) = p.client_device(0);
    p.ok(&format!("alloc {c} {d} {} nvos64", 2 * MIB));
    let attributed = eventually(Duration::from_secs(5), || async {
        let r = proxy.get_cgroup(&cg.rel).await.ok()?;
        (r.memory_current.get("all") == Some(&(2 * MIB)) && r.pids.contains(&p.pid)).then_some(())
    })
    .await;
    assert!(attributed.is_some(), "not attributed:\n{}", rig.log_text());
    p.send(&format!("alloc {c} {d} {} nvos64", 4 * MIB));
    let froze = eventually(Duration::from_secs(5), || async {
        cg.frozen().then_some(())
    })
    .await;
    assert!(froze.is_some(), "not frozen:\n{}", rig.log_text());
    rig.set_limit(&cg.rel, "all", "memory_max", 16 * MIB).await;
    assert!(!cg.frozen(), "still frozen after the limit was raised");
    let a = p.recv();
    assert_eq!(a["ok"], true, "{a}");
    drop(p);
    assert_eq!(rig.stop(), Some(0), "{}", rig.log_text());

    // Without CAP_BPF: refused at start, naming the capability. (CAP_SYS_ADMIN, which the
    // unit grants for the memory view, would stand in for it, so it goes too: the unit minus
    // the view's capability must still need CAP_BPF.)
    let mut fewer = caps.clone();
    assert!(fewer.remove("bpf"), "the unit grants CAP_BPF");
    assert!(fewer.remove("sys_admin"), "the unit grants CAP_SYS_ADMIN");
    let wrapper = setpriv(&fewer);
    let out = Command::new(&wrapper[0])
        .args(&wrapper[1..])
        .arg(gpud_bin())
        .arg("--config")
        .arg(rig.config_path())
        .arg("--bus-address")
        .arg(&rig.bus.address)
        .env_remove("NOTIFY_SOCKET")
        .output()
        .expect("run gpud without CAP_BPF");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("missing CAP_BPF: gpud needs CAP_BPF and CAP_PERFMON"),
        "{stderr}"
    );

    let _ = root_holder.kill();
    let _ = nobody_holder.kill();
    let _ = root_holder.wait();
    let _ = nobody_holder.wait();
}
