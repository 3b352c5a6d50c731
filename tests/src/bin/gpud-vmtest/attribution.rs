//! The attribution checks in each attach mode: ioctl counts by class and processes per cgroup, from real children in real cgroups, through gpud's own probes and attribution.

#[allow(unused_imports)]
use super::*;

pub(super) fn scenario(pref: AttachPreference, want: AttachMode) -> anyhow::Result<()> {
    let tag = want.as_str();
    let work = PathBuf::from(format!("/tmp/vmtest-{tag}"));
    std::fs::create_dir_all(&work)?;
    let standin = work.join("nvidiactl");
    std::fs::write(&standin, b"")?;

    let Opened { core, .. } = open_stack(
        tag,
        &standin,
        &[
            ("probes.attach", pref.as_str()),
            ("enforcement.tier", "react"),
        ],
    )
    .context("opening gpud's kernel stack")?;
    let probes = core.probes;
    let mut attribution = core.attribution;
    println!("[{tag}] capabilities: {:?}", probes.caps());
    ensure!(
        probes.mode() == want,
        "attached in {:?}, wanted {want:?}",
        probes.mode()
    );
    // fentry attaches the compat hooks, tracepoint mode the raw syscall tracepoints where it can
    // tell 32-bit calls apart (x86-64): no call goes unseen.
    let unseen = probes.unseen_calls();
    let compat_seen = want == AttachMode::Fentry || probes.caps().compat_syscalls;
    ensure!(
        unseen.is_empty() == compat_seen,
        "[{tag}] unseen calls {unseen:?}, with compat_syscalls {}",
        probes.caps().compat_syscalls
    );
    let root = attribution.cgroup_root().to_owned();

    let cg_a = root.join(format!("vm-{tag}-a"));
    let cg_b = root.join(format!("vm-{tag}-b"));
    std::fs::create_dir_all(&cg_a)?;
    std::fs::create_dir_all(&cg_b)?;
    let rel = |p: &PathBuf| format!("/{}", p.file_name().unwrap_or_default().to_string_lossy());

    let s = standin.clone();
    let a = cg_a.clone();
    let held = fork_held(move || {
        if let Err(e) = inproc::join_cgroup(&a) {
            return format!("join: {e}");
        }
        let f = match std::fs::File::open(&s) {
            Ok(f) => f,
            Err(e) => return format!("open: {e}"),
        };
        let fd = inproc::fd(&f);
        inproc::issue(fd, 0xc030_462b, 5);
        inproc::issue(fd, 0xc010_4629, 3);
        inproc::issue(fd, 0xc020_462a, 2);
        inproc::issue(fd, 0xc0b8_464a, 1);
        inproc::issue(fd, nv::nv_iowr(nv::NV_ESC_RM_ALLOC, 36), 1);
        inproc::issue_xfer(fd, nv::NV_ESC_RM_ALLOC, 48, 2);
        // More as 32-bit processes make them, where the kernel has those entries: two
        // allocations through the i386 entry, two frees through the x32 one.
        let ia32 = inproc::issue_32(fd, 0xc030_462b, 2);
        let x32 = inproc::issue_x32(fd, 0xc010_4629, 2);
        if let Ok(null) = std::fs::File::open("/dev/null") {
            inproc::issue(inproc::fd(&null), 0xc030_462b, 4);
        }
        format!("ok ia32={ia32} x32={x32}")
    })?;
    ensure!(held.report.starts_with("ok"), "child A: {}", held.report);
    let (ia32, x32) = (
        held.report.contains("ia32=true"),
        held.report.contains("x32=true"),
    );
    println!("[{tag}] 32-bit ioctls issued: i386 {ia32}, x32 {x32}");
    let seen = |issued: bool| if issued && compat_seen { 2 } else { 0 };
    let want_a = class_counts(&[
        ("alloc", 7 + seen(ia32)),
        ("free", 3 + seen(x32)),
        ("control", 2),
        ("vid_heap", 1),
        ("other", 1),
    ]);
    let ra = CgroupRecord::from(attribution.get(&rel(&cg_a))?);
    ensure!(
        ra.ioctls == want_a,
        "A counts {:?} != {want_a:?}",
        ra.ioctls
    );
    ensure!(
        ra.pids == vec![held.pid],
        "A pids {:?} != [{}]",
        ra.pids,
        held.pid
    );

    let s = standin.clone();
    let b = cg_b.clone();
    let report = inproc::in_child(move || {
        if inproc::join_cgroup(&b).is_err() {
            return "join".into();
        }
        match std::fs::File::open(&s) {
            Ok(f) => inproc::issue(inproc::fd(&f), 0xc020_462b, 2),
            Err(e) => return format!("open: {e}"),
        }
        "ok".into()
    })?;
    ensure!(report == "ok", "child B: {report}");
    let rb = CgroupRecord::from(attribution.get(&rel(&cg_b))?);
    ensure!(
        rb.ioctls == class_counts(&[("alloc", 2)]),
        "B counts {:?}",
        rb.ioctls
    );
    ensure!(rb.pids.is_empty(), "B exited but pids {:?}", rb.pids);

    held.release();
    let ra = CgroupRecord::from(attribution.get(&rel(&cg_a))?);
    ensure!(ra.pids.is_empty(), "A exited but pids {:?}", ra.pids);
    ensure!(
        ra.ioctls == want_a,
        "A counts changed after exit: {:?}",
        ra.ioctls
    );
    let listed: Vec<String> = attribution.list().into_iter().map(|r| r.path).collect();
    ensure!(
        listed.contains(&rel(&cg_a)) && listed.contains(&rel(&cg_b)),
        "list {listed:?}"
    );

    drop(attribution);
    probes.shutdown(false);
    let _ = std::fs::remove_dir(&cg_a);
    let _ = std::fs::remove_dir(&cg_b);
    println!("[{tag}] attribution checks passed");
    Ok(())
}
