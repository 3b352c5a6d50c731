//! GPU-memory limits through a pre-driver hook (the deny tier): the crossing allocation refused before the driver sees it, accounting exact, releases on close.

#[allow(unused_imports)]
use super::*;

/// GPU memory in the fentry mode with the `deny` tier: a real BPF-LSM `file_ioctl` program
/// refuses, with ENOMEM and before the (fake) driver sees it, the allocation that would take a
/// cgroup over its limit; accounting follows allocations, and `security_file_free` releases a
/// closed file's clients. The fake NVIDIA control device (FUSE) answers the real RM ABI.
pub(super) fn memory_deny(hook: DenyHookPreference) -> anyhow::Result<()> {
    let tag = format!("deny-{}", hook.as_str());
    const MIB: u64 = 1 << 20;
    // Orphans (the heir below) are re-parented here, so they can be reaped.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only sets a flag of this process.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let (fake, ctl) = stage(&format!("/tmp/vm-fake-{tag}"))?;
    let Opened {
        core,
        events: mut ring,
        ..
    } = open_stack(
        &tag,
        &ctl,
        &[
            ("enforcement.tier", "deny"),
            ("enforcement.deny_hook", hook.as_str()),
        ],
    )
    .with_context(|| {
        format!(
            "opening gpud's kernel stack with enforcement.tier = deny, deny_hook = {}",
            hook.as_str()
        )
    })?;
    let probes = core.probes;
    let mut attribution = core.attribution;
    let mut settings = core.settings;
    ensure!(probes.tier() == Tier::Deny, "tier {:?}", probes.tier());
    if hook != DenyHookPreference::Auto {
        ensure!(
            probes.ladder().in_force.as_str() == hook.as_str(),
            "hook in force: {:?}",
            probes.ladder()
        );
    }
    let root = attribution.cgroup_root().to_owned();
    let cg = root.join(&tag);
    std::fs::create_dir_all(&cg)?;
    let (_, id) = attribution.id_of(&format!("/{tag}"))?;
    settings.set_limit(id, gpud_common::GPU_ALL, 8 * MIB)?;

    let c = ctl.clone();
    let dir = cg.clone();
    let held = fork_held(move || {
        use gpud_tests::rm::Form;
        let steps = [
            (4 * MIB, Form::Nvos64),
            (6 * MIB, Form::Nvos21),
            (6 * MIB, Form::Xfer64),
            (2 * MIB, Form::VidHeap),
        ];
        let (f, client, dev) = match super::device_in(&c, &dir) {
            Ok(t) => t,
            Err(e) => return e,
        };
        let rm = gpud_tests::rm::Ctl::new(&f);
        let r: Vec<_> = steps
            .iter()
            .map(|&(size, form)| rm.alloc_vidmem(client, dev, size, form))
            .collect();
        // Of no size the entry side can read: refused under any limit.
        let mut finn = gpud_tests::rm::MemRequest::vidmem(client, dev, MIB, Form::Nvos64);
        finn.nvos64_flags = gpud_common::rm::NVOS64_FLAGS_FINN_SERIALIZED;
        let unsized_ = rm.alloc_memory(&finn);
        let (first, denied, xfer_denied, fits) = (&r[0], &r[1], &r[2], &r[3]);
        let out = format!(
            "first={} denied={}/{} xfer={}/{} fits={} unsized={}/{}",
            first.ok(),
            denied.ret,
            denied.errno,
            xfer_denied.ret,
            xfer_denied.errno,
            fits.ok(),
            unsized_.ret,
            unsized_.errno
        );
        // A grandchild inherits the file and outlives its creator (a daemon's fork): the
        // driver keeps the client while it holds the file.
        // SAFETY: the grandchild only sleeps until it is killed.
        let keep = std::os::fd::AsRawFd::as_raw_fd(&f);
        let heir = unsafe { libc::fork() };
        if heir == 0 {
            // Only the control file: the report and release pipes must close with the child.
            for fd in 3..1024 {
                if fd != keep {
                    // SAFETY: closes descriptors this process does not use.
                    unsafe { libc::close(fd) };
                }
            }
            loop {
                // SAFETY: waits for a signal.
                unsafe { libc::pause() };
            }
        }
        // Keep the file open while the parent checks; it is closed when the child exits.
        std::mem::forget(f);
        format!("{out} heir={heir}")
    })?;
    let want = format!(
        "first=true denied=-1/{e} xfer=-1/{e} fits=true unsized=-1/{e}",
        e = libc::ENOMEM
    );
    let (report, heir) = held
        .report
        .rsplit_once(" heir=")
        .context("no heir in the child's report")?;
    let heir: i32 = heir.parse().context("heir pid")?;
    ensure!(report == want, "child: {report} (wanted {want})");
    ensure!(
        fake.snapshot().used_total() == 6 * MIB,
        "the driver saw a refused allocation: {:?}",
        fake.snapshot()
    );
    pump(&mut ring, &mut attribution);
    let m = attribution.memory_of(id);
    ensure!(
        m.current.get("all") == Some(&(6 * MIB)) && m.events == 3,
        "accounting after denials: {m:?}"
    );
    let stats = attribution.counters()?.stats();
    ensure!(
        stats.get("allocs_denied") == Some(&3),
        "kernel stats {stats:?}"
    );
    // The creator exits; the heir still holds the file, so the memory stays charged, and the
    // release rule's check of the file (`gpud_file_held`, this kernel's `f_count`) agrees.
    held.release();
    pump(&mut ring, &mut attribution);
    let released = attribution.release_closed_files();
    let m = attribution.memory_of(id);
    ensure!(
        released == 0 && m.current.get("all") == Some(&(6 * MIB)),
        "the creator's exit released memory the heir's file still holds: {released} released, {m:?}"
    );
    // The heir goes: the file's last reference with it. The check alone (before any event is
    // read) finds the file released.
    // SAFETY: kill(2) and waitpid(2) of our adopted grandchild (this process is a subreaper).
    unsafe {
        libc::kill(heir, libc::SIGKILL);
        libc::waitpid(heir, std::ptr::null_mut(), 0);
    }
    let released = attribution.release_closed_files();
    ensure!(
        released > 0 && attribution.memory_of(id).current.get("all") == Some(&0),
        "the check did not find the file released: {released} released, {:?}",
        attribution.memory_of(id)
    );
    wait_uncharged(
        &mut attribution,
        id,
        "memory not released after the file closed",
        |a| {
            pump(&mut ring, a);
            Ok(())
        },
    )?;
    drop(attribution);
    probes.shutdown(false);
    drop(fake);
    let _ = std::fs::remove_dir(&cg);
    println!("[{tag}] memory checks passed");
    Ok(())
}
