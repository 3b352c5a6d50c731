//! End-to-end attribution on the real kernel: real cgroups, real processes issuing NVIDIA-encoded
//! ioctls on stand-in device files (`devices.extra_paths`), the real gpud binary, read back over a
//! real dbus-daemon.

use std::time::Duration;

use gpud_common::nv::{self, nv_iowr};
use gpud_tests::{Cgroup, Issuer, Rig, class_counts, eventually, gpudctl_bin};

const ALLOC: u32 = 0xc030_462b; // NVOS64
const ALLOC21: u32 = 0xc020_462b; // NVOS21
const FREE: u32 = 0xc010_4629;
const CONTROL: u32 = 0xc020_462a;
const VID_HEAP: u32 = 0xc0b8_464a;
const MAP: u32 = 0xc038_464e;
const UNMAP_DMA: u32 = 0xc030_4658;

fn ioctl_arg(cmd: u32, n: u64) -> String {
    format!("0x{cmd:x}:{n}")
}

/// `gpudctl --bus-address A list --json`, parsed.
/// Runs gpud with `config` on `bus` to its end (a start-up that fails).
fn run_gpud(config: &std::path::Path, bus: &str) -> std::process::Output {
    std::process::Command::new(gpud_tests::gpud_bin())
        .arg("--config")
        .arg(config)
        .args(["--bus-address", bus])
        .output()
        .expect("run gpud")
}

fn gpudctl_out(bus: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(gpudctl_bin())
        .args(["--bus-address", bus])
        .args(args)
        .output()
        .expect("run gpudctl")
}

fn gpudctl_list(bus: &str) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(gpudctl_bin())
        .args(["--bus-address", bus, "list", "--json"])
        .output()
        .expect("run gpudctl");
    assert!(out.status.success(), "gpudctl failed: {out:?}");
    serde_json::from_slice(&out.stdout).expect("gpudctl JSON")
}

/// A rig whose daemon counts ioctls on the stand-in `ctl`, which it returns.
async fn started(tag: &str) -> (Rig, std::path::PathBuf) {
    let mut rig = Rig::new(tag);
    let ctl = rig.stand_in("ctl");
    rig.start(rig.config().extra_paths([&ctl])).await;
    (rig, ctl)
}

#[tokio::test(flavor = "multi_thread")]
async fn counts_are_exact_per_cgroup_and_class_and_survive_restart() {
    let mut rig = Rig::new("exact");
    let ctl = rig.stand_in("nvidiactl-standin");
    let other_file = rig.stand_in("not-listed");
    // Kept pinned: the restart below resumes the kernel's counts.
    rig.start(rig.config().extra_paths([&ctl]).keep_pinned(true))
        .await;
    let a = Cgroup::new("a");
    let b = Cgroup::new("b");

    let alloc = ioctl_arg(ALLOC, 5);
    let alloc21 = ioctl_arg(ALLOC21, 1);
    let free = ioctl_arg(FREE, 3);
    let control = ioctl_arg(CONTROL, 2);
    let vid = ioctl_arg(VID_HEAP, 1);
    let map = ioctl_arg(MAP, 4);
    let unmap = ioctl_arg(UNMAP_DMA, 1);
    // An RM_ALLOC with a size the driver refuses is not an allocation.
    let bad = ioctl_arg(nv_iowr(nv::NV_ESC_RM_ALLOC, 36), 2);
    let xfer = format!("{}:48:2", nv::NV_ESC_RM_ALLOC);
    let unmatched_dev = "/dev/null:7".to_owned();
    let unmatched_file = format!("{}:3", other_file.display());
    let in_a = Issuer::in_cgroup(
        &a,
        &ctl,
        &[
            "--ioctl",
            &alloc,
            "--ioctl",
            &alloc21,
            "--ioctl",
            &free,
            "--ioctl",
            &control,
            "--ioctl",
            &vid,
            "--ioctl",
            &map,
            "--ioctl",
            &unmap,
            "--ioctl",
            &bad,
            "--xfer",
            &xfer,
            "--unmatched",
            &unmatched_dev,
            "--unmatched",
            &unmatched_file,
        ],
    );
    let two_allocs = ioctl_arg(ALLOC, 2);
    let in_b = Issuer::in_cgroup(&b, &ctl, &["--ioctl", &two_allocs]);

    let want_a = class_counts(&[
        ("alloc", 8),
        ("free", 3),
        ("control", 2),
        ("vid_heap", 1),
        ("map", 5),
        ("other", 2),
    ]);
    let want_b = class_counts(&[("alloc", 2)]);
    let ra = rig.get_cgroup(&a.rel).await;
    assert_eq!(ra.ioctls, want_a, "{}", rig.log_text());
    assert_eq!(ra.pids, vec![in_a.pid]);
    assert_eq!(ra.path, a.rel);
    let rb = rig.get_cgroup(&b.rel).await;
    assert_eq!(rb.ioctls, want_b);
    assert_eq!(rb.pids, vec![in_b.pid]);
    assert_ne!(ra.id, rb.id);

    // The acceptance path: gpudctl list --json.
    let list = gpudctl_list(&rig.bus.address);
    let entry = |rel: &str| {
        list.iter()
            .find(|e| e["path"] == rel)
            .unwrap_or_else(|| panic!("{rel} not listed: {list:?}"))
            .clone()
    };
    let ea = entry(&a.rel);
    assert_eq!(ea["id"], ra.id);
    assert_eq!(ea["pids"], serde_json::json!([in_a.pid]));
    assert_eq!(ea["ioctls"], serde_json::to_value(&want_a).unwrap());
    assert_eq!(
        entry(&b.rel)["ioctls"],
        serde_json::to_value(&want_b).unwrap()
    );

    // Per-process counts.
    let (_conn, p) = rig.proxy().await;
    let procs = p.list_processes().await.unwrap();
    let pa = procs
        .iter()
        .find(|r| r.pid == in_a.pid)
        .expect("process A listed");
    assert_eq!((pa.cgroup.as_str(), pa.cgroup_id), (a.rel.as_str(), ra.id));
    assert_eq!(pa.ioctls, want_a);
    let pb = procs
        .iter()
        .find(|r| r.pid == in_b.pid)
        .expect("process B listed");
    assert_eq!(pb.ioctls, want_b);

    // Exited processes disappear; their cgroup's counts stay.
    let in_a_pid = in_a.pid;
    in_a.finish();
    let gone = eventually(Duration::from_secs(5), || async {
        let r = rig.get_cgroup(&a.rel).await;
        r.pids.is_empty().then_some(r)
    })
    .await
    .expect("exited process still listed");
    assert_eq!(gone.ioctls, want_a);
    let procs = p.list_processes().await.unwrap();
    assert!(
        !procs.iter().any(|r| r.pid == in_a_pid),
        "exited process still in ListProcesses"
    );

    // A restarted daemon adopts the pinned probes and maps: same counts, still counting.
    assert_eq!(rig.stop(), Some(0), "{}", rig.log_text());
    let more = ioctl_arg(FREE, 4);
    let while_down = Issuer::in_cgroup(&a, &ctl, &["--ioctl", &more]);
    rig.restart().await;
    let (_c, p) = rig.proxy().await;
    assert!(p.probes_resumed().await.unwrap(), "{}", rig.log_text());
    let ra2 = rig.get_cgroup(&a.rel).await;
    let mut want = want_a.clone();
    *want.get_mut("free").unwrap() += 4;
    assert_eq!(ra2.ioctls, want, "counts lost or doubled across restart");
    assert_eq!(ra2.pids, vec![while_down.pid]);
    assert_eq!(rig.get_cgroup(&b.rel).await.ioctls, want_b);
    while_down.finish();
    in_b.finish();
}

#[tokio::test(flavor = "multi_thread")]
async fn unmatched_files_and_unrelated_cgroups_are_not_counted() {
    let (rig, _ctl) = started("unmatched").await;
    let plain = rig.stand_in("plain");
    let c = Cgroup::new("unmatched");
    let a100 = ioctl_arg(ALLOC, 100);
    let p = Issuer::in_cgroup(
        &c,
        &plain,
        &["--ioctl", &a100, "--unmatched", "/dev/null:50"],
    );
    let r = rig.get_cgroup(&c.rel).await;
    assert_eq!(r.ioctls, class_counts(&[]));
    assert!(r.pids.is_empty());
    assert!(
        !gpudctl_list(&rig.bus.address)
            .iter()
            .any(|e| e["path"] == c.rel.as_str()),
        "a cgroup that never touched a device must not be listed"
    );
    p.finish();
}

#[tokio::test(flavor = "multi_thread")]
async fn processes_holding_a_device_before_start_and_forked_children_are_attributed() {
    let mut rig = Rig::new("scan");
    let ctl = rig.stand_in("ctl");
    let c = Cgroup::new("scan");
    // Opens the file (and issues 2 allocs) before any daemon runs: found by the start-up scan
    // of /proc/*/fd, and its later ioctls are counted (in tracepoint mode only because the scan
    // marked it for the probes).
    let two = ioctl_arg(ALLOC, 2);
    let mut early = Issuer::in_cgroup(&c, &ctl, &["--ioctl", &two]);
    rig.start(rig.config().extra_paths([&ctl])).await;
    let r = rig.get_cgroup(&c.rel).await;
    assert_eq!(r.pids, vec![early.pid], "{}", rig.log_text());
    assert_eq!(
        r.ioctls,
        class_counts(&[]),
        "nothing was counted before the daemon ran"
    );
    early.again();
    let r = rig.get_cgroup(&c.rel).await;
    assert_eq!(
        r.ioctls,
        class_counts(&[("alloc", 2)]),
        "{}",
        rig.log_text()
    );
    early.finish();

    // A child inherits the descriptor without opening anything; its ioctls still count.
    let f = Cgroup::new("fork");
    let three = ioctl_arg(CONTROL, 3);
    let parent = Issuer::in_cgroup(&f, &ctl, &["--ioctl", &three, "--fork-child"]);
    let r = rig.get_cgroup(&f.rel).await;
    assert_eq!(
        r.ioctls,
        class_counts(&[("control", 6)]),
        "{}",
        rig.log_text()
    );
    let mut pids = vec![parent.pid, parent.child_pid.unwrap()];
    pids.sort_unstable();
    assert_eq!(r.pids, pids);
    parent.finish();
}

#[tokio::test(flavor = "multi_thread")]
async fn busctl_introspection_shows_the_documented_interface() {
    let (rig, _ctl) = started("introspect").await;
    let out = std::process::Command::new("busctl")
        .args([
            &format!("--address={}", rig.bus.address),
            "introspect",
            "dev.gpud.Daemon1",
            "/dev/gpud/Daemon1",
            "dev.gpud.Manager1",
        ])
        .output()
        .expect("busctl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for member in [
        ".ListCgroups",
        ".ListProcesses",
        ".GetCgroup",
        ".GetKernelStats",
        ".Version",
        ".AttachMode",
        ".KernelCapabilities",
        ".DenyHook",
        ".DenyHookRefusals",
        ".DriverLimits",
        ".CgroupRoot",
        ".ProbesResumed",
    ] {
        assert!(text.contains(member), "{member} missing from:\n{text}");
    }
    let (_c, p) = rig.proxy().await;
    let caps = p.kernel_capabilities().await.unwrap();
    for k in ["tracepoint", "fentry", "bpf_lsm", "dmem_cgroup"] {
        assert!(caps.contains_key(k), "{k} not reported");
    }
    // On a kernel without trampolines the daemon must have fallen back to tracepoints.
    let mode = p.attach_mode().await.unwrap();
    assert_eq!(mode == "fentry", caps["fentry"]);

    // The ladder of pre-driver hooks: the hook in force, and the kernel's reason for each hook
    // above it, on D-Bus and in `gpudctl status` (text and JSON).
    let hook = p.deny_hook().await.unwrap();
    let refusals = p.deny_hook_refusals().await.unwrap();
    let ladder = ["lsm", "fmod_ret", "kprobe", "none"];
    let at = ladder
        .iter()
        .position(|h| *h == hook)
        .expect("a rung of the ladder");
    let above: Vec<&str> = refusals.keys().map(String::as_str).collect();
    let mut want = ladder[..at].to_vec();
    want.sort_unstable();
    assert_eq!(
        above, want,
        "refusals for the hooks above {hook}: {refusals:?}"
    );
    assert!(
        refusals.values().all(|why| !why.is_empty()),
        "each refusal says why: {refusals:?}"
    );
    assert_eq!(
        caps["fmod_ret"],
        hook == "fmod_ret" || (hook == "lsm" && caps["fmod_ret"])
    );
    if !caps["fentry"] {
        // Both hooks run on trampolines: the kernel's refusal of them is the reason.
        assert_eq!(hook, "none");
        for h in ["lsm", "fmod_ret"] {
            assert!(refusals[h].contains("trampolines"), "{h}: {}", refusals[h]);
        }
    }
    assert!(refusals["kprobe"].starts_with("not built"), "{refusals:?}");
    // The driver's own limits: where dmem.capacity lists no NVIDIA region, none, and why.
    let driver = p.driver_limits().await.unwrap();
    assert_eq!(
        driver.starts_with("dmem: "),
        caps["dmem_nvidia"],
        "{driver}"
    );
    let status = gpudctl_out(&rig.bus.address, &["status"]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{status:?}");
    assert!(
        text.contains(&format!("pre-driver hook:  {hook}\n")),
        "no hook line in:\n{text}"
    );
    assert!(
        text.contains(&format!("driver limits:    {driver}\n")),
        "no driver limits line in:\n{text}"
    );
    for (h, why) in &refusals {
        assert!(
            text.contains(&format!("    {h:<9} {why}\n")),
            "no line for {h} in:\n{text}"
        );
    }
    let json = gpudctl_out(&rig.bus.address, &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("status JSON");
    assert_eq!(v["deny_hook"], hook.as_str());
    assert_eq!(
        v["deny_hook_refusals"]["kprobe"],
        refusals["kprobe"].as_str()
    );
}

/// A hook named in the configuration that the kernel refuses is a start-up error that names the
/// kernel's refusal; `kprobe` (not built) always is.
#[tokio::test(flavor = "multi_thread")]
async fn a_named_hook_the_kernel_refuses_fails_start_up_with_its_reason() {
    let mut rig = Rig::new("denyhook");
    rig.start(rig.config()).await;
    let caps = {
        let (_c, p) = rig.proxy().await;
        p.kernel_capabilities().await.unwrap()
    };
    let mut refused = vec!["kprobe"];
    if !caps["fmod_ret"] {
        refused.push("fmod_ret");
    }
    if !caps["bpf_lsm"] {
        refused.push("lsm");
    }
    for hook in refused {
        let cfg = rig
            .config()
            .set("enforcement.deny_hook", hook)
            // Its own pins: nothing of the running daemon's is touched.
            .set_path("probes.bpffs", rig.path().join(format!("bpffs-{hook}")))
            .write_as(&format!("{hook}.toml"));
        let out = run_gpud(&cfg, &rig.bus.address);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{hook}: gpud started: {err}");
        assert!(
            err.contains(&format!("enforcement.deny_hook = \"{hook}\" but ")),
            "{hook}: {err}"
        );
        let reason = match hook {
            "kprobe" => "not built",
            _ if !caps["fentry"] => "trampolines",
            "lsm" => "LSM",
            _ => "refused",
        };
        assert!(err.contains(reason), "{hook}: no {reason:?} in {err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_config_is_refused_with_a_clear_error() {
    let rig = Rig::new("badcfg");
    let cfg = rig.path().join("bad.toml");
    std::fs::write(&cfg, "[probes]\nattach = \"kprobe\"\n").unwrap();
    let out = run_gpud(&cfg, &rig.bus.address);
    assert_eq!(out.status.code(), Some(78));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.toml") && err.contains("kprobe"), "{err}");

    let missing = rig.path().join("missing.toml");
    std::fs::write(
        &cfg,
        // The state directory in the rig: the default (/var/lib/gpud) is made before the device
        // paths are opened, and a test leaves nothing on the host.
        format!(
            "[daemon]\nstate_dir = {:?}\n[devices]\nextra_paths = [{:?}]\n",
            rig.path().join("state").display().to_string(),
            missing.display().to_string()
        ),
    )
    .unwrap();
    let out = run_gpud(&cfg, &rig.bus.address);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing.toml"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn pinned_maps_of_another_layout_are_replaced_not_used() {
    let mut rig = Rig::new("layout");
    let ctl = rig.stand_in("ctl");
    // A CGROUPS map pinned by some other build: 8-byte keys but 4-byte values.
    let bpffs = rig.path().join("bpffs");
    gpud::probes::ensure_mounted(&bpffs, "bpf", gpud::probes::BPF_FS_MAGIC).unwrap();
    let base = rig.pins();
    std::fs::create_dir_all(&base).unwrap();
    let opts = libbpf_sys::bpf_map_create_opts {
        sz: size_of::<libbpf_sys::bpf_map_create_opts>() as _,
        ..Default::default()
    };
    let mut foreign = libbpf_rs::MapHandle::create(
        libbpf_rs::MapType::Hash,
        Some(gpud_common::maps::CGROUPS),
        8,
        4,
        16,
        &opts,
    )
    .unwrap();
    foreign.pin(base.join(gpud_common::maps::CGROUPS)).unwrap();
    drop(foreign);

    rig.start(rig.config().extra_paths([&ctl])).await;
    assert!(
        rig.log_text().contains("another layout"),
        "{}",
        rig.log_text()
    );
    let c = Cgroup::new("layout");
    let three = ioctl_arg(CONTROL, 3);
    let p = Issuer::in_cgroup(&c, &ctl, &["--ioctl", &three]);
    assert_eq!(
        rig.get_cgroup(&c.rel).await.ioctls,
        class_counts(&[("control", 3)])
    );
    p.finish();
}

/// Reads come from the daemon's published view, never older than what was done before them:
/// a listing right after ioctls shows them, right after a limit change shows the limit, and
/// every reader in between gets the same answer without the daemon rebuilding anything.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_never_returns_state_older_than_what_came_before_it() {
    let (rig, ctl) = started("fresh").await;
    let cg = Cgroup::new("fresh");
    let one_alloc = ioctl_arg(ALLOC, 1);
    let mut issuer = Issuer::in_cgroup(&cg, &ctl, &["--ioctl", &one_alloc]);
    let (_conn, proxy) = rig.proxy().await;
    let find = |list: Vec<gpud_api::CgroupRecord>| {
        list.into_iter()
            .find(|r| r.path == cg.rel)
            .expect("the cgroup is listed")
    };
    for round in 1..=5u64 {
        // Listed (a whole view) right after the ioctls, with no wait in between.
        let listed = find(proxy.list_cgroups().await.expect("ListCgroups"));
        assert_eq!(listed.ioctls["alloc"], round, "round {round}");
        // The same view serves a second reader unchanged.
        let again = find(proxy.list_cgroups().await.expect("ListCgroups"));
        assert_eq!(again, listed);
        let max = round * 1024 * 1024;
        let limits = std::collections::BTreeMap::from([("memory_max", zbus::Variant::from(max))]);
        proxy
            .set_limits(&cg.rel, "all", limits)
            .await
            .expect("SetLimits");
        // Read-your-writes: the limit is in the next listing and in ListLimits.
        let listed = find(proxy.list_cgroups().await.expect("ListCgroups"));
        assert_eq!(listed.memory_max.get("all"), Some(&max), "round {round}");
        let limits = proxy.list_limits().await.expect("ListLimits");
        assert!(
            limits
                .iter()
                .any(|l| l.cgroup == cg.rel && l.limits.get("memory_max") == Some(&max)),
            "round {round}: {limits:?}"
        );
        issuer.again();
    }
}
