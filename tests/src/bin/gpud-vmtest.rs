//! Runs inside the Debian-kernel VM (`cargo xtask test` boots it under qemu), where BPF
//! trampolines and BPF-LSM load: checks attribution in **fentry** mode (and tracepoint mode on
//! the same kernel) through gpud's own probes and attribution code, with real cgroups and real
//! processes. D-Bus is covered by the host tests; this is about the kernel side.
//!
//! Prints `VMTEST RESULT: PASS` when every check holds.

use std::path::PathBuf;

use anyhow::{Context as _, anyhow, bail, ensure};
use clap::Parser;
use gpud::{
    attribution::Attribution,
    config::{AttachPreference, DenyHookPreference, TierPreference},
    daemon::core::Opened,
    probes::{
        AttachMode, MemoryInfoState, Probes, Tier,
        events::{KernelEvent, Record},
    },
    report::Chain,
};
use gpud_api::CgroupRecord;
use gpud_common::{nv, rm::fb};
use gpud_tests::{
    TestConfig, class_counts,
    inproc::{self, fork_held},
};

fn scenario(pref: AttachPreference, want: AttachMode) -> anyhow::Result<()> {
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
    let mut attribution = core.attribution;
    let probes = attribution.probes();
    println!("[{tag}] capabilities: {:?}", probes.caps());
    ensure!(
        probes.mode() == want,
        "attached in {:?}, wanted {want:?}",
        probes.mode()
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
        if let Ok(null) = std::fs::File::open("/dev/null") {
            inproc::issue(inproc::fd(&null), 0xc030_462b, 4);
        }
        "ok".into()
    })?;
    ensure!(held.report == "ok", "child A: {}", held.report);
    let want_a = class_counts(&[
        ("alloc", 7),
        ("free", 3),
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

    attribution.shutdown(false);
    let _ = std::fs::remove_dir(&cg_a);
    let _ = std::fs::remove_dir(&cg_b);
    println!("[{tag}] attribution checks passed");
    Ok(())
}

/// gpud's kernel stack as the daemon opens it (`gpud::daemon::core::open`: the one rig), from
/// the tests' configuration: its state and bpffs under `/tmp/vmtest-stack-<tag>` (an earlier
/// run's pins and limits removed first; pins removed at the end), `device` as its extra device
/// file, NVML off, the shipped defaults (memory view on, guard enforcing, guard reaction `kill`)
/// and `keys` on top.
fn open_stack(
    tag: &str,
    device: &std::path::Path,
    keys: &[(&str, &str)],
) -> anyhow::Result<Opened> {
    let dir = PathBuf::from(format!("/tmp/vmtest-stack-{tag}"));
    std::fs::create_dir_all(&dir)?;
    let _ = std::fs::remove_dir_all(Probes::pin_base(&dir.join("bpffs")));
    let _ = std::fs::remove_dir_all(dir.join("state"));
    let mut config = TestConfig::new(&dir)
        .extra_paths([device])
        .nvml_off()
        .react_action("notify");
    for (k, v) in keys {
        config = config.set(k, *v);
    }
    gpud::daemon::core::open(&config.parsed()).map_err(|e| anyhow!("{}", Chain(&e)))
}

/// The fake NVIDIA device mounted at `at`, and its control file.
fn stage(at: &str) -> anyhow::Result<(gpud_tests::fakenv::FakeNv, PathBuf)> {
    let fake = gpud_tests::fakenv::mount(
        std::path::Path::new(at),
        gpud_tests::fakenv::Options::default(),
    )
    .context("mounting the fake NVIDIA device")?;
    let ctl = fake.ctl();
    Ok((fake, ctl))
}

/// In a forked child: joins `cgroup`, opens the control device `ctl` and makes a client and
/// device 0 there (file, client, device); what failed, as the child's report, otherwise.
fn device_in(
    ctl: &std::path::Path,
    cgroup: &std::path::Path,
) -> Result<(std::fs::File, u32, u32), String> {
    inproc::join_cgroup(cgroup).map_err(|e| format!("join: {e}"))?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(ctl)
        .map_err(|e| format!("open: {e}"))?;
    let rm = gpud_tests::rm::Ctl::new(&f);
    let client = rm.alloc_client().handle;
    let dev = rm.alloc_device(client, 0).handle;
    Ok((f, client, dev))
}

/// Drains the probes' ring buffer into the attribution (the daemon's event loop does this).
fn pump(ring: &mut aya::maps::RingBuf<aya::maps::MapData>, attribution: &mut Attribution) -> usize {
    let mut n = 0;
    while let Some(item) = ring.next() {
        if let Ok(Record::Event(ev)) = Record::decode(&item) {
            attribution.on_kernel_event(&ev);
            n += 1;
        }
    }
    n
}

/// GPU memory in the fentry mode with the `deny` tier: a real BPF-LSM `file_ioctl` program
/// refuses, with ENOMEM and before the (fake) driver sees it, the allocation that would take a
/// cgroup over its limit; accounting follows allocations, and `security_file_free` releases a
/// closed file's clients. The fake NVIDIA control device (FUSE) answers the real RM ABI.
fn memory_deny(hook: DenyHookPreference) -> anyhow::Result<()> {
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
    let mut attribution = core.attribution;
    let probes = attribution.probes();
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
    attribution.set_kernel_limit(id, gpud_common::GPU_ALL, 8 * MIB)?;

    let c = ctl.clone();
    let dir = cg.clone();
    let held = fork_held(move || {
        use gpud_tests::rm::{Ctl, Form};
        let (f, client, dev) = match device_in(&c, &dir) {
            Ok(t) => t,
            Err(e) => return e,
        };
        let rm = Ctl::new(&f);
        let first = rm.alloc_vidmem(client, dev, 4 * MIB, Form::Nvos64);
        let denied = rm.alloc_vidmem(client, dev, 6 * MIB, Form::Nvos21);
        let xfer_denied = rm.alloc_vidmem(client, dev, 6 * MIB, Form::Xfer64);
        let fits = rm.alloc_vidmem(client, dev, 2 * MIB, Form::VidHeap);
        let out = format!(
            "first={} denied={}/{} xfer={}/{} fits={}",
            first.ok(),
            denied.ret,
            denied.errno,
            xfer_denied.ret,
            xfer_denied.errno,
            fits.ok()
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
        "first=true denied=-1/{e} xfer=-1/{e} fits=true",
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
        m.current.get("all") == Some(&(6 * MIB)) && m.events == 2,
        "accounting after denials: {m:?}"
    );
    let stats = attribution.counters()?.stats();
    ensure!(
        stats.get("allocs_denied") == Some(&2),
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
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        pump(&mut ring, &mut attribution);
        if attribution.memory_of(id).current.get("all") == Some(&0) {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "memory not released after the file closed: {:?}",
            attribution.memory_of(id)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    attribution.shutdown(false);
    drop(fake);
    let _ = std::fs::remove_dir(&cg);
    println!("[{tag}] memory checks passed");
    Ok(())
}

/// The FB info indices a tenant asks for: every size and free index the view lowers, and two it
/// leaves alone (the bus width and the vGPU tax).
const VIEW_INDICES: [u32; 9] = [
    fb::HEAP_SIZE,
    fb::TOTAL_RAM_SIZE,
    fb::RAM_SIZE,
    fb::USABLE_RAM_SIZE,
    fb::MAPPABLE_HEAP_SIZE,
    fb::HEAP_FREE,
    fb::LARGEST_FREE_REGION_SIZE_KB,
    fb::BUS_WIDTH,
    fb::FB_TAX_SIZE_KB,
];

/// What a tenant read: FB info value by index, and the VID_HEAP_CONTROL INFO figures.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    fb: std::collections::BTreeMap<u32, u64>,
    heap: [u64; 3],
}

impl Seen {
    /// What the driver says of a GPU of `capacity` bytes with `used` allocated (in KiB for the
    /// list; the fake models the H100's 480 MiB reserve and 5120-bit bus).
    fn real(capacity: u64, used: u64) -> Self {
        Self::of(capacity, capacity + (480 << 20), capacity - used)
    }

    /// A view: heap `total`, whole memory `ram`, `free`, all in bytes.
    fn of(total: u64, ram: u64, free: u64) -> Self {
        let k = |b: u64| b >> 10;
        let fb = [
            (fb::HEAP_SIZE, k(total)),
            (fb::TOTAL_RAM_SIZE, k(ram)),
            (fb::RAM_SIZE, k(ram)),
            (fb::USABLE_RAM_SIZE, k(ram)),
            (fb::MAPPABLE_HEAP_SIZE, k(total)),
            (fb::HEAP_FREE, k(free)),
            (fb::LARGEST_FREE_REGION_SIZE_KB, k(free)),
            (fb::BUS_WIDTH, 5120),
            (fb::FB_TAX_SIZE_KB, 0),
        ]
        .into_iter()
        .collect();
        Self {
            fb,
            heap: [total, free, free],
        }
    }

    /// The view of a cgroup limited to `limit` with `headroom` left: every size is the limit.
    fn limited(limit: u64, headroom: u64) -> Self {
        Self::of(limit, limit, headroom)
    }

    fn parse(reply: &str) -> anyhow::Result<Self> {
        let mut fb = std::collections::BTreeMap::new();
        let mut heap = [0; 3];
        for (i, word) in reply.split_whitespace().enumerate() {
            let (k, v) = word.split_once('=').context(reply.to_owned())?;
            let v: u64 = v.parse().context(reply.to_owned())?;
            match k {
                "st" | "hst" => ensure!(v == 0, "status {v} in {reply}"),
                "total" => heap[0] = v,
                "free" => heap[1] = v,
                "largest" => heap[2] = v,
                _ => {
                    fb.insert(k.parse().context(reply.to_owned())?, v);
                }
            }
            ensure!(i < 32, "long reply {reply}");
        }
        Ok(Self { fb, heap })
    }
}

/// A process in a cgroup with its own client, device 0 and subdevice on the fake control device,
/// answering `alloc MIB`, `view` and `malformed`.
fn tenant(ctl: &std::path::Path, cgroup: &std::path::Path) -> anyhow::Result<inproc::Serving> {
    use gpud_tests::rm::{Ctl, Form};
    const MIB: u64 = 1 << 20;
    let (c, dir) = (ctl.to_owned(), cgroup.to_owned());
    let setup = move || inproc::rm_tenant(&c, &dir);
    let serve = |s: &mut (std::fs::File, [u32; 3]), req: &str| -> String {
        let rm = Ctl::new(&s.0);
        let [client, dev, sub] = s.1;
        match req.split_whitespace().collect::<Vec<_>>()[..] {
            ["alloc", mib] => {
                let mib: u64 = mib.parse().unwrap_or(0);
                let r = rm.alloc_vidmem(client, dev, mib * MIB, Form::Nvos64);
                if r.ok() {
                    "ok".into()
                } else {
                    format!("refused errno={} status={}", r.errno, r.status)
                }
            }
            ["view"] => {
                let (r, pairs) = rm.fb_info_v2(client, sub, &VIEW_INDICES);
                let (h, [total, free, largest]) = rm.vidheap_info(client, dev);
                let mut out = format!("st={} hst={}", r.status, h.status);
                for (i, v) in pairs {
                    out += &format!(" {i}={v}");
                }
                out + &format!(" total={total} free={free} largest={largest}")
            }
            ["malformed"] => malformed(&rm, client, sub),
            _ => format!("unknown request {req:?}"),
        }
    };
    Ok(inproc::fork_serving(setup, serve)?)
}

/// Calls the driver refuses (empty list, a list past the maximum, parameters shorter than the
/// struct, a null parameter pointer): the replies must stay as the caller wrote them. `ok`, or
/// what went wrong.
fn malformed(rm: &gpud_tests::rm::Ctl<'_>, client: u32, sub: u32) -> String {
    const SENTINEL: u32 = 0xdead_beef;
    let mut bad = Vec::new();
    for (name, count, size) in [
        ("empty list", 0u32, 1028u32),
        ("list past the maximum", 200, 1028),
        ("short parameters", 1, 12),
        ("null parameters", 1, 1028),
    ] {
        let mut p = fb::GetInfoV2Params {
            list_size: count,
            ..Default::default()
        };
        for e in &mut p.list {
            *e = fb::Info {
                index: fb::HEAP_SIZE,
                data: SENTINEL,
            };
        }
        let ptr = if name == "null parameters" {
            std::ptr::null_mut()
        } else {
            gpud_tests::rm::bytes_of_mut(&mut p).as_mut_ptr()
        };
        // SAFETY: `p` is 1028 bytes, at least `size`; a null pointer is the driver's to refuse.
        let r = unsafe { rm.control_raw(client, sub, fb::GET_INFO_V2, ptr, size) };
        if r.ret != 0 || r.status == 0 {
            bad.push(format!("{name}: accepted or failed ({r:?})"));
        }
        if p.list.iter().any(|e| e.data != SENTINEL) {
            bad.push(format!("{name}: the reply was written"));
        }
    }
    if bad.is_empty() {
        "ok".into()
    } else {
        bad.join("; ")
    }
}

/// The in-container memory view on the fake control device: limited cgroups read their limit as
/// the GPU's size and their headroom as its free memory (the smallest over their ancestors),
/// following allocations and limit changes while they run; an unlimited sibling reads the
/// driver's figures; indices the view does not own, and refused calls, are left as they are;
/// turning the view off (a reload) or clearing the limits gives the real figures back.
fn memory_view(pref: AttachPreference, want: AttachMode) -> anyhow::Result<()> {
    const MIB: u64 = 1 << 20;
    let tag = want.as_str();
    // A hang in the VM prints where every thread and child waits instead of timing out mute.
    let _watchdog = inproc::Watchdog::arm(std::time::Duration::from_secs(150));
    let opts = gpud_tests::fakenv::Options::default();
    let capacity = opts.capacity;
    let fake =
        gpud_tests::fakenv::mount(std::path::Path::new(&format!("/tmp/vm-view-{tag}")), opts)
            .context("mounting the fake NVIDIA device")?;
    let ctl = fake.ctl();
    let Opened { core, .. } = open_stack(
        &format!("view-{tag}"),
        &ctl,
        &[("probes.attach", pref.as_str())],
    )
    .context("opening gpud's kernel stack")?;
    let mut attribution = core.attribution;
    let root = attribution.cgroup_root().to_owned();
    let probes = attribution.probes();
    ensure!(probes.mode() == want, "mode {:?}", probes.mode());
    ensure!(
        probes.caps().probe_write_user && *probes.memory_info() == MemoryInfoState::On,
        "memory view {:?} (caps {:?})",
        probes.memory_info(),
        probes.caps()
    );
    let deny = probes.tier() == Tier::Deny;
    let parent = format!("/vm-view-{tag}");
    let (pc, pd, sib) = (
        format!("{parent}/c"),
        format!("{parent}/d"),
        format!("{parent}-sibling"),
    );
    for p in [&parent, &pc, &pd, &sib] {
        std::fs::create_dir_all(root.join(&p[1..]))?;
    }
    let (_, id_parent) = attribution.id_of(&parent)?;
    let (_, id_c) = attribution.id_of(&pc)?;
    attribution.set_kernel_limit(id_parent, gpud_common::GPU_ALL, 32 * MIB)?;
    attribution.set_kernel_limit(id_c, 0, 48 * MIB)?;

    println!("[view-{tag}] probes attached, starting tenants");
    let mut c = tenant(&ctl, &root.join(&pc[1..]))?;
    let mut d = tenant(&ctl, &root.join(&pd[1..]))?;
    let mut s = tenant(&ctl, &root.join(&sib[1..]))?;
    println!("[view-{tag}] tenants ready");
    let view = |t: &mut inproc::Serving| -> anyhow::Result<Seen> { Seen::parse(&t.ask("view")?) };
    ensure!(
        c.ask("alloc 8")? == "ok" && d.ask("alloc 4")? == "ok",
        "first allocations"
    );
    // The parent's 32 MiB is the smallest limit above both; its headroom (32 - 12) the smallest.
    let want_cd = Seen::limited(32 * MIB, 20 * MIB);
    ensure!(view(&mut c)? == want_cd, "c: {:?}", view(&mut c)?);
    ensure!(view(&mut d)? == want_cd, "d: {:?}", view(&mut d)?);
    let real = |f: &gpud_tests::fakenv::FakeNv| Seen::real(capacity, f.snapshot().used_total());
    ensure!(view(&mut s)? == real(&fake), "sibling: {:?}", view(&mut s)?);

    // c's own limit drops below its parent's while it runs.
    println!("[view-{tag}] nested limits hold");
    attribution.set_kernel_limit(id_c, 0, 16 * MIB)?;
    ensure!(
        view(&mut c)? == Seen::limited(16 * MIB, 8 * MIB),
        "c at 16 MiB: {:?}",
        view(&mut c)?
    );
    ensure!(
        view(&mut d)? == want_cd,
        "d after c's change: {:?}",
        view(&mut d)?
    );
    // 10 MiB more: refused by the deny tier, or charged by react: never a negative headroom.
    let r = c.ask("alloc 10")?;
    let headroom = if deny {
        ensure!(r.starts_with("refused errno=12"), "deny tier: {r}");
        8 * MIB
    } else {
        ensure!(r == "ok", "react tier: {r}");
        0
    };
    ensure!(
        view(&mut c)? == Seen::limited(16 * MIB, headroom),
        "c over its limit: {:?}",
        view(&mut c)?
    );
    println!("[view-{tag}] a changed limit holds");
    let r = c.ask("malformed")?;
    ensure!(r == "ok", "malformed calls: {r}");

    // A reload turns the view off and on again.
    println!("[view-{tag}] malformed calls left alone");
    attribution.set_memory_info(false)?;
    println!("[view-{tag}] view turned off");
    ensure!(
        attribution.memory_info() == "off",
        "{}",
        attribution.memory_info()
    );
    ensure!(
        view(&mut c)? == real(&fake),
        "view off: {:?}",
        view(&mut c)?
    );
    attribution.set_memory_info(true)?;
    ensure!(
        view(&mut c)? == Seen::limited(16 * MIB, headroom),
        "view on again: {:?}",
        view(&mut c)?
    );
    // No limit left: the driver's figures.
    attribution.clear_kernel_limit(id_c, 0)?;
    attribution.clear_kernel_limit(id_parent, gpud_common::GPU_ALL)?;
    ensure!(
        view(&mut c)? == real(&fake),
        "limits cleared: {:?}",
        view(&mut c)?
    );
    let stats = attribution.counters()?.stats();
    ensure!(
        // Six views by limited tenants while the view was on, two replies each.
        stats.get("memory_info_rewritten") == Some(&12)
            && stats.get("memory_info_skipped") == Some(&0),
        "kernel stats {stats:?}"
    );
    for t in [c, d, s] {
        t.release();
    }
    attribution.shutdown(false);
    drop(fake);
    for p in [&pc, &pd, &parent, &sib] {
        let _ = std::fs::remove_dir(root.join(&p[1..]));
    }
    println!("[view-{tag}] memory view checks passed");
    Ok(())
}

/// A tenant for the scheduler guard: its own client, device 0, subdevice, channel group and
/// channel on the fake control device, answering `ids`, `ts US` (set, then read back), `get`,
/// `schedule 0|1` (its group off or on the runlist), `fuzz SEED N CLIENT CHANNEL` (see
/// [`guard_fuzz`]),
/// `disable|enable CLIENT CHANNEL`, `ctl NAME` (a control tenants may not use) and `malformed`.
fn guard_tenant(
    ctl: &std::path::Path,
    cgroup: &std::path::Path,
) -> anyhow::Result<inproc::Serving> {
    use gpud_common::rm::{sched, tsg};
    use gpud_tests::rm::{Ctl, Reply};
    let (c, dir) = (ctl.to_owned(), cgroup.to_owned());
    let setup = move || {
        let (f, [client, dev, sub]) = inproc::rm_tenant(&c, &dir)?;
        let rm = Ctl::new(&f);
        let tsg = rm.alloc_channel_group(client, dev);
        if !tsg.ok() {
            return Err(format!("channel group: {tsg:?}"));
        }
        let chan = rm
            .alloc_channel(client, tsg.handle)
            .map_err(|r| format!("channel: {r:?}"))?;
        Ok((f, [client, sub, tsg.handle, chan]))
    };
    let said = |r: Reply| format!("errno={} status={:#x}", r.errno, r.status);
    let serve = move |s: &mut (std::fs::File, [u32; 4]), req: &str| -> String {
        let rm = Ctl::new(&s.0);
        let [client, sub, tsg, chan] = s.1;
        let num = |v: &str| u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap_or(0);
        match req.split_whitespace().collect::<Vec<_>>()[..] {
            ["ids"] => format!("{client:#x} {tsg:#x} {chan:#x}"),
            ["ts", us] => {
                let r = rm.set_timeslice(client, tsg, us.parse().unwrap_or(0));
                let (_, got) = rm.get_timeslice(client, tsg);
                format!("{} got={got}", said(r))
            }
            ["get"] => rm.get_timeslice(client, tsg).1.to_string(),
            ["schedule", on] => {
                let mut p = tsg::ScheduleParams {
                    enable: u8::from(on == "1"),
                    ..Default::default()
                };
                said(rm.control(client, tsg, tsg::GPFIFO_SCHEDULE, &mut p))
            }
            [verb @ ("disable" | "enable"), c, h] => said(rm.disable_channels(
                client,
                sub,
                verb == "disable",
                &[(num(c) as u32, num(h) as u32)],
            )),
            ["ctl", name] => {
                let (object, cmd, mut params, flags) = match name {
                    "interleave" => (tsg, sched::TSG_SET_INTERLEAVE_LEVEL, vec![2, 0, 0, 0], 0),
                    "realtime" => (tsg, sched::TSG_MAKE_REALTIME, vec![1], 0),
                    "sched-policy" => (sub, sched::RUNLIST_SET_SCHED_POLICY, vec![0; 8], 0),
                    // SET_TIMESLICE of 1 s on the driver's legacy path, and serialized.
                    "legacy" => (
                        tsg,
                        tsg::SET_TIMESLICE | sched::LEGACY_BIT,
                        vec![0x40; 8],
                        0,
                    ),
                    "flags" => (
                        tsg,
                        tsg::SET_TIMESLICE,
                        1_000_000u64.to_ne_bytes().to_vec(),
                        4,
                    ),
                    _ => return format!("unknown control {name}"),
                };
                let mut p = gpud_common::rm::Nvos54 {
                    h_client: client,
                    h_object: object,
                    cmd,
                    flags,
                    params: params.as_mut_ptr() as u64,
                    params_size: params.len() as u32,
                    status: 0,
                };
                // SAFETY: `params` is live and exactly `params_size` bytes.
                said(unsafe { rm.control_nvos54(&mut p) })
            }
            ["malformed"] => guard_malformed(&rm, client, sub, tsg),
            ["fuzz", seed, n, bc, bch] => guard_fuzz(
                &rm,
                [client, sub, tsg, chan],
                (num(bc) as u32, num(bch) as u32),
                seed.parse().unwrap_or(1),
                n.parse().unwrap_or(0),
            ),
            _ => format!("unknown request {req:?}"),
        }
    };
    Ok(inproc::fork_serving(setup, serve)?)
}

/// Guarded controls the driver refuses itself (short or null parameters, an over-long list):
/// the guard leaves them alone, so each comes back refused by the driver with the caller's
/// bytes as they were. `ok`, or what went wrong.
fn guard_malformed(rm: &gpud_tests::rm::Ctl<'_>, client: u32, sub: u32, tsg: u32) -> String {
    use gpud_common::rm::{sched, tsg as t};
    let mut bad = Vec::new();
    let mut short = [0xffu8; 4];
    let r = rm.sched_control(client, tsg, t::SET_TIMESLICE, &mut short);
    if r.ret != 0 || r.status == 0 || short != [0xff; 4] {
        bad.push(format!("short timeslice: {r:?} {short:?}"));
    }
    let r = rm.sched_control(client, tsg, t::SET_TIMESLICE, &mut []);
    if r.ret != 0 || r.status == 0 {
        bad.push(format!("null timeslice: {r:?}"));
    }
    // 65 channels, one past the lists: the driver's to refuse.
    let mut p = sched::DisableChannelsParams {
        disable: 1,
        num_channels: 65,
        ..Default::default()
    };
    let r = rm.control(client, sub, sched::DISABLE_CHANNELS, &mut p);
    if r.ret != 0 || r.status == 0 || p.num_channels != 65 {
        bad.push(format!("over-long list: {r:?}"));
    }
    if bad.is_empty() {
        "ok".into()
    } else {
        bad.join("; ")
    }
}

/// N corrupted guarded controls (seeded): any guarded command or its legacy alias, random
/// flags, sizes and parameter bytes (timeslices, channel lists naming the caller's own and the
/// given neighbour's client and channel), pointers valid, null or in the kernel half, directly or
/// wrapped in an XFER. The guard may only ever write the caller's own `NVOS54` and parameters;
/// what the driver ends up with is checked by the caller. `ok accepted=K`.
fn guard_fuzz(
    rm: &gpud_tests::rm::Ctl<'_>,
    [client, sub, tsg, chan]: [u32; 4],
    (bc, bch): (u32, u32),
    seed: u64,
    n: u64,
) -> String {
    use gpud_common::rm::{self as r, sched};
    let mut next = gpud_tests::rm::xorshift(seed);
    let mut accepted = 0u64;
    for _ in 0..n {
        let row = sched::CONTROLS[(next() % sched::CONTROLS.len() as u64) as usize];
        let mut params = [0u8; 600];
        for b in params.iter_mut() {
            *b = next() as u8;
        }
        match row.cmd {
            r::tsg::SET_TIMESLICE => {
                params[..8].copy_from_slice(&(next() % 4_000_000).to_ne_bytes());
            }
            sched::DISABLE_CHANNELS => {
                let count = (next() % 70) as u32;
                params[4..8].copy_from_slice(&count.to_ne_bytes());
                params[16..24].copy_from_slice(&[0; 8]);
                for i in 0..64 {
                    let (c, h) = match next() % 3 {
                        0 => (bc, bch),
                        1 => (client, chan),
                        _ => (next() as u32, next() as u32),
                    };
                    params[24 + 4 * i..28 + 4 * i].copy_from_slice(&c.to_ne_bytes());
                    params[280 + 4 * i..284 + 4 * i].copy_from_slice(&h.to_ne_bytes());
                }
            }
            _ => {}
        }
        let cmd = if next().is_multiple_of(8) {
            row.cmd | sched::LEGACY_BIT
        } else {
            row.cmd
        };
        let size = match next() % 6 {
            0 => 0,
            1 => (next() % 600) as u32,
            _ => row.size,
        };
        let ptr = match next() % 10 {
            0 => 0,
            1 => next() | 1 << 63,
            _ => params.as_mut_ptr() as u64,
        };
        let mut p = r::Nvos54 {
            h_client: client,
            h_object: if next().is_multiple_of(2) { tsg } else { sub },
            cmd,
            flags: if next().is_multiple_of(10) {
                next() as u32 & 7
            } else {
                0
            },
            params: ptr,
            params_size: size,
            status: next() as u32,
        };
        let (ret, _) = if next().is_multiple_of(4) {
            let mut xfer = r::NvIoctlXfer {
                cmd: nv::NV_ESC_RM_CONTROL,
                size: nv::NVOS54_SIZE,
                ptr: (&mut p as *mut r::Nvos54) as u64,
            };
            let c = nv::nv_iowr(nv::NV_ESC_IOCTL_XFER_CMD, nv::NV_IOCTL_XFER_SIZE);
            // SAFETY: `xfer`, `p` and `params` (600 bytes, more than any size used) live
            // across the call; other pointers are null or kernel-half garbage.
            unsafe { rm.raw(c, (&mut xfer as *mut r::NvIoctlXfer).cast()) }
        } else {
            let c = nv::nv_iowr(nv::NV_ESC_RM_CONTROL, nv::NVOS54_SIZE);
            // SAFETY: as above.
            unsafe { rm.raw(c, (&mut p as *mut r::Nvos54).cast()) }
        };
        if ret == 0 && p.status == 0 {
            accepted += 1;
        }
    }
    format!("ok accepted={accepted}")
}

/// The scheduler guard on the fake control device: a tenant's timeslice is lowered to its
/// allowance (the default, a latency-critical cgroup's longer one, the least over the ancestry)
/// and read back so; controls tenants may not use, legacy-path and serialized aliases are
/// refused (`EPERM` in the deny tier, turned into calls the driver rejects elsewhere); a
/// disable-channels call naming a neighbour's channel leaves it running while one naming the
/// caller's own acts; malformed calls are left to the driver; gpud's own timeslice passes;
/// `audit` lets everything through and reports it; `off` reports nothing.
fn scheduler_guard(
    pref: AttachPreference,
    tier: TierPreference,
    hook: DenyHookPreference,
    want: AttachMode,
) -> anyhow::Result<()> {
    use gpud::{enforcement::guard, notice::GuardNotice};
    let tag = format!(
        "{}-{}-{}",
        want.as_str(),
        format!("{tier:?}").to_lowercase(),
        hook.as_str()
    );
    let _watchdog = inproc::Watchdog::arm(std::time::Duration::from_secs(150));
    let (fake, ctl) = stage(&format!("/tmp/vm-guard-{tag}"))?;
    let Opened {
        core,
        events: mut ring,
        held,
        matcher,
        ..
    } = open_stack(
        &format!("guard-{tag}"),
        &ctl,
        &[
            ("probes.attach", pref.as_str()),
            ("enforcement.tier", tier.as_str()),
            ("enforcement.deny_hook", hook.as_str()),
        ],
    )
    .context("opening gpud's kernel stack")?;
    let mut attribution = core.attribution;
    let root = attribution.cgroup_root().to_owned();
    let probes = attribution.probes();
    ensure!(probes.mode() == want, "mode {:?}", probes.mode());
    let deny = probes.tier() == Tier::Deny;
    let held = gpud::enforcement::compute::channel::HeldGroups::new(held);
    let want_state = if deny {
        "enforce (deny, rewrite)"
    } else {
        "enforce (rewrite)"
    };
    ensure!(
        probes.guard().describe() == want_state,
        "guard {}",
        probes.guard().describe()
    );
    let base = format!("/vm-guard-{tag}");
    let (pa, pb, lc, be) = (
        format!("{base}/a"),
        format!("{base}/b"),
        format!("{base}/lc"),
        format!("{base}/lc/be"),
    );
    for p in [&base, &pa, &pb, &lc, &be] {
        std::fs::create_dir_all(root.join(&p[1..]))?;
    }
    let (_, id_lc) = attribution.id_of(&lc)?;
    let (_, id_be) = attribution.id_of(&be)?;
    let (lc_us, be_us) = (16_384, 128);
    attribution.set_sched_allowance(id_lc, Some(lc_us))?;
    attribution.set_sched_allowance(id_be, Some(be_us))?;
    let mut drain = |attribution: &mut Attribution| -> Vec<GuardNotice> {
        let mut out = Vec::new();
        while let Some(item) = ring.next() {
            match Record::decode(&item) {
                Ok(Record::Event(KernelEvent::SchedulerGuarded(g))) => {
                    out.push(guard::on_event(attribution, &g));
                }
                Ok(Record::Event(ev)) => attribution.on_kernel_event(&ev),
                _ => {}
            }
        }
        out
    };
    let seen = |n: &[GuardNotice]| {
        n.iter()
            .map(|n| format!("{}:{}:{}", n.control, n.action, n.reason))
            .collect::<Vec<_>>()
            .join(",")
    };

    println!("[guard-{tag}] probes attached, starting tenants");
    let mut a = guard_tenant(&ctl, &root.join(&pa[1..]))?;
    let mut b = guard_tenant(&ctl, &root.join(&pb[1..]))?;
    let mut l = guard_tenant(&ctl, &root.join(&lc[1..]))?;
    let mut e = guard_tenant(&ctl, &root.join(&be[1..]))?;
    let ids = |t: &mut inproc::Serving| -> anyhow::Result<Vec<String>> {
        Ok(t.ask("ids")?.split(' ').map(str::to_owned).collect())
    };
    let (ia, ib) = (ids(&mut a)?, ids(&mut b)?);
    drain(&mut attribution);

    // Timeslices: at most the allowance, read back as such; below it, untouched.
    let ok_got = |us: u64| format!("errno=0 status=0x0 got={us}");
    ensure!(a.ask("ts 1000")? == ok_got(1000), "a: 1000 µs");
    ensure!(a.ask("ts 1000000")? == ok_got(2048), "a: 1 s");
    ensure!(l.ask("ts 10000")? == ok_got(10_000), "lc: 10 ms");
    ensure!(l.ask("ts 1000000")? == ok_got(lc_us), "lc: 1 s");
    ensure!(e.ask("ts 1000000")? == ok_got(be_us), "be under lc: 1 s");
    let n = drain(&mut attribution);
    ensure!(
        seen(&n) == ["SET_TIMESLICE:clamped:timeslice"; 3].join(","),
        "timeslice reports: {n:?}"
    );
    ensure!(
        n[0].cgroup == pa && n[0].requested == 1_000_000 && n[0].allowed == 2048,
        "report: {:?}",
        n[0]
    );
    println!("[guard-{tag}] timeslices lowered to the allowances");

    // A neighbour's channel: refused; the caller's own: done.
    let refused = if deny {
        "errno=1 status=0x0".to_owned()
    } else {
        format!(
            "errno=0 status={:#x}",
            gpud_common::rm::status::NV_ERR_INVALID_ARGUMENT
        )
    };
    let chan_enabled = |f: &gpud_tests::fakenv::FakeNv, ids: &[String]| {
        f.snapshot()
            .channels
            .iter()
            .find(|c| format!("{:#x}", c.handle) == ids[2] && format!("{:#x}", c.client) == ids[0])
            .map(|c| c.enabled)
    };
    let r = a.ask(&format!("disable {} {}", ib[0], ib[2]))?;
    ensure!(r == refused, "a disables b's channel: {r}");
    ensure!(
        chan_enabled(&fake, &ib) == Some(true),
        "b's channel was disabled"
    );
    let r = a.ask(&format!("disable {} {}", ia[0], ia[2]))?;
    ensure!(r == "errno=0 status=0x0", "a disables its own channel: {r}");
    ensure!(
        chan_enabled(&fake, &ia) == Some(false),
        "a's channel still enabled"
    );
    ensure!(
        a.ask(&format!("enable {} {}", ia[0], ia[2]))? == "errno=0 status=0x0",
        "a enables its own channel"
    );
    let n = drain(&mut attribution);
    ensure!(
        seen(&n)
            == format!(
                "FIFO_DISABLE_CHANNELS:{}:foreign-client",
                if deny { "denied" } else { "refused" }
            ),
        "disable-channels reports: {n:?}"
    );
    println!("[guard-{tag}] a neighbour's channels are out of reach");

    // Controls no tenant may use, and the aliases that would hide one.
    let before = fake.snapshot().controls;
    for name in ["interleave", "realtime", "sched-policy", "legacy", "flags"] {
        let r = a.ask(&format!("ctl {name}"))?;
        if deny {
            ensure!(r == refused, "{name}: {r}");
        } else {
            ensure!(
                r.starts_with("errno=0 status=0x") && r != "errno=0 status=0x0",
                "{name}: {r}"
            );
        }
    }
    ensure!(
        fake.snapshot().controls == before,
        "a refused control reached the driver"
    );
    ensure!(
        a.ask("get")? == "2048",
        "a's timeslice changed: {}",
        a.ask("get")?
    );
    let n = drain(&mut attribution);
    let act = if deny { "denied" } else { "refused" };
    ensure!(
        seen(&n)
            == format!(
                "TSG_SET_INTERLEAVE_LEVEL:{act}:forbidden,MAKE_REALTIME:{act}:forbidden,\
                 FIFO_RUNLIST_SET_SCHED_POLICY:{act}:forbidden,\
                 SET_TIMESLICE(legacy 0xa06c8103):{act}:legacy-path,SET_TIMESLICE:{act}:flags"
            ),
        "refusal reports: {n:?}"
    );
    ensure!(a.ask("malformed")? == "ok", "malformed calls");
    ensure!(
        drain(&mut attribution).is_empty(),
        "malformed calls reported"
    );
    println!("[guard-{tag}] forbidden controls refused, malformed ones left to the driver");

    // gpud's own control, issued through the tenant's file as the compute law does.
    let pid_a = a.pid;
    let groups = attribution
        .tenant_objects(&[pid_a].into())
        .remove(&pid_a)
        .unwrap_or_default()
        .groups;
    ensure!(groups.len() == 1, "a's channel groups: {groups:?}");
    let mut controls = gpud::enforcement::compute::channel::Controls::new(matcher, Some(held));
    controls
        .timeslice(&groups[0], 1_000_000)
        .map_err(|e| anyhow::anyhow!("gpud's own timeslice: {e}"))?;
    ensure!(
        a.ask("get")? == "1000000",
        "gpud's own timeslice: {}",
        a.ask("get")?
    );
    ensure!(
        drain(&mut attribution).is_empty(),
        "gpud's own call reported"
    );
    println!("[guard-{tag}] gpud's own control passes");

    // A group gpud holds off the runlist: its owner's enable does nothing until gpud puts it
    // back; its own disable, and enables outside the hold, pass.
    let on_runlist = |f: &gpud_tests::fakenv::FakeNv| {
        f.snapshot()
            .channel_groups
            .iter()
            .find(|g| g.client == groups[0].client && g.handle == groups[0].handle)
            .map(|g| g.enabled)
    };
    let ok = "errno=0 status=0x0";
    controls
        .schedule(&groups[0], false)
        .map_err(|e| anyhow::anyhow!("gpud holds a's group off: {e}"))?;
    ensure!(on_runlist(&fake) == Some(false), "gpud's hold");
    ensure!(a.ask("schedule 1")? == ok, "a's enable while held");
    ensure!(
        on_runlist(&fake) == Some(false),
        "a put its group back while held"
    );
    let n = drain(&mut attribution);
    ensure!(
        seen(&n) == "TSG_GPFIFO_SCHEDULE:refused:held-off",
        "hold reports: {n:?}"
    );
    controls
        .schedule(&groups[0], true)
        .map_err(|e| anyhow::anyhow!("gpud puts a's group back: {e}"))?;
    ensure!(
        a.ask("schedule 0")? == ok && a.ask("schedule 1")? == ok,
        "a's own schedule"
    );
    ensure!(on_runlist(&fake) == Some(true), "a's group after the hold");
    ensure!(
        drain(&mut attribution).is_empty(),
        "schedules outside a hold reported"
    );
    println!("[guard-{tag}] a group gpud holds off stays off");

    // Channels gpud holds disabled (its lever where the firmware ignores the runlist): their
    // owner's own enable does nothing until gpud enables them; outside the hold it passes.
    let objs = attribution
        .tenant_objects(&[pid_a].into())
        .remove(&pid_a)
        .unwrap_or_default();
    ensure!(
        objs.channels.len() == 1 && objs.subdevices.len() == 1,
        "a's channels and subdevices: {objs:?}"
    );
    let hold = |controls: &mut gpud::enforcement::compute::channel::Controls, on: bool| {
        controls
            .disable_channels(pid_a, objs.subdevices[0], &objs.channels, on)
            .map_err(|e| anyhow::anyhow!("gpud's FIFO_DISABLE_CHANNELS {on}: {e}"))
    };
    hold(&mut controls, true)?;
    ensure!(
        chan_enabled(&fake, &ia) == Some(false),
        "gpud's channel hold"
    );
    ensure!(
        a.ask(&format!("enable {} {}", ia[0], ia[2]))? == ok,
        "a's channel enable while held"
    );
    ensure!(
        chan_enabled(&fake, &ia) == Some(false),
        "a enabled its channel while held"
    );
    let n = drain(&mut attribution);
    ensure!(
        seen(&n) == "FIFO_DISABLE_CHANNELS:refused:held-off",
        "channel hold reports: {n:?}"
    );
    hold(&mut controls, false)?;
    ensure!(
        chan_enabled(&fake, &ia) == Some(true),
        "a's channel after the hold"
    );
    ensure!(
        a.ask(&format!("disable {} {}", ia[0], ia[2]))? == ok
            && a.ask(&format!("enable {} {}", ia[0], ia[2]))? == ok,
        "a's own disable and enable"
    );
    ensure!(
        drain(&mut attribution).is_empty(),
        "channel controls outside a hold reported"
    );
    println!("[guard-{tag}] channels gpud holds disabled stay disabled");

    // audit: everything through, and reported; off: nothing looked at.
    attribution.set_scheduler_guard(gpud::config::GuardMode::Audit)?;
    ensure!(a.ask("ts 1000000")? == ok_got(1_000_000), "audit: 1 s");
    let r = a.ask(&format!("disable {} {}", ib[0], ib[2]))?;
    ensure!(
        r == "errno=0 status=0x0",
        "audit: a disables b's channel: {r}"
    );
    ensure!(
        chan_enabled(&fake, &ib) == Some(false),
        "audit: b's channel still enabled"
    );
    ensure!(
        a.ask(&format!("enable {} {}", ib[0], ib[2]))? == "errno=0 status=0x0",
        "audit: a enables b's channel again"
    );
    let n = drain(&mut attribution);
    ensure!(
        seen(&n)
            == "SET_TIMESLICE:audited:timeslice,FIFO_DISABLE_CHANNELS:audited:foreign-client,\
                FIFO_DISABLE_CHANNELS:audited:foreign-client",
        "audit reports: {n:?}"
    );
    attribution.set_scheduler_guard(gpud::config::GuardMode::Off)?;
    ensure!(a.ask("ts 999999")? == ok_got(999_999), "off: timeslice");
    ensure!(drain(&mut attribution).is_empty(), "off: reported");
    let stats = attribution.counters()?.stats();
    ensure!(
        // 3 lowered, 1 foreign list, 5 refusals, 1 held group, 1 held channel, 3 in audit.
        stats.get("sched_guarded") == Some(&14),
        "kernel stats {stats:?}"
    );

    // Corrupted calls from the best-effort tenant, guard enforcing: whatever got through, the
    // driver holds no timeslice above its allowance, no interleave or realtime, and the
    // neighbour's channel runs.
    attribution.set_scheduler_guard(gpud::config::GuardMode::Enforce)?;
    let ie = ids(&mut e)?;
    let hex = |s: &str| u32::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or(0);
    let (ec, eg) = (hex(&ie[0]), hex(&ie[1]));
    let refused_before: Vec<u64> = {
        let snap = fake.snapshot();
        gpud_common::rm::sched::CONTROLS
            .iter()
            .filter(|c| c.rule == gpud_common::rm::sched::Rule::Refuse)
            .map(|c| snap.control_count(c.cmd))
            .collect()
    };
    for seed in [3u64, 17, 2026] {
        let r = e.ask(&format!("fuzz {seed} 300 {} {}", ib[0], ib[2]))?;
        ensure!(r.starts_with("ok accepted="), "fuzz {seed}: {r}");
        let snap = fake.snapshot();
        let g = snap
            .channel_group(ec, eg)
            .ok_or_else(|| anyhow::anyhow!("e's group gone after fuzz {seed}"))?;
        ensure!(
            g.timeslice_us <= be_us && g.interleave == 0 && !g.realtime,
            "fuzz {seed}: e's group {g:?}"
        );
        ensure!(
            chan_enabled(&fake, &ib) == Some(true),
            "fuzz {seed}: b's channel disabled"
        );
        let refused_now: Vec<u64> = gpud_common::rm::sched::CONTROLS
            .iter()
            .filter(|c| c.rule == gpud_common::rm::sched::Rule::Refuse)
            .map(|c| snap.control_count(c.cmd))
            .collect();
        ensure!(
            refused_now == refused_before,
            "fuzz {seed}: a refused control reached the driver"
        );
    }
    drain(&mut attribution);
    println!("[guard-{tag}] corrupted calls: nothing past the guard");

    for t in [a, b, l, e] {
        t.release();
    }
    attribution.shutdown(false);
    drop(fake);
    for p in [&be, &lc, &pa, &pb, &base] {
        let _ = std::fs::remove_dir(root.join(&p[1..]));
    }
    println!("[guard-{tag}] scheduler guard checks passed");
    Ok(())
}

/// What each row of the kernel matrix must show (xtask boots the VM once per row with the
/// row's kernel command line; `host` runs on the machine itself): the hook, the memory tier, what
/// the guard does to a tenant's 1 s timeslice, and whether the memory view runs.
const MATRIX: &[(&str, &str)] = &[
    // Debian's kernel with `bpf` in lsm=: BPF-LSM.
    ("debian", "rung=lsm memory=deny guard=clamp view=yes"),
    // Ubuntu's default LSM list (no `bpf`): BPF-LSM programs never run; fmod_ret does.
    ("ubuntu", "rung=fmod_ret memory=deny guard=clamp view=yes"),
    // The same under Secure Boot's lockdown=integrity: no bpf_probe_write_user, so no view and
    // no rewrite; the hook still refuses.
    (
        "ubuntu-secure-boot",
        "rung=fmod_ret memory=deny guard=deny view=no",
    ),
    // Tracepoints only (`probes.attach = "tracepoint"`, as on a kernel without BPF trampolines)
    // under Secure Boot's lockdown: the lent GPU machines. The JIT off does not take trampolines
    // away on x86-64 (measured: fentry and BPF-LSM still load and run with
    // net.core.bpf_jit_enable=0, the trampoline is emitted by the arch code and calls the
    // interpreter), so the attach preference stands in for it.
    (
        "tracepoint-only",
        "rung=none memory=react guard=restore view=no",
    ),
    // The machine the tests run on: what it must show follows from what its kernel offers
    // (`host_expectation`); on this project's CI host (tracepoints only, under lockdown)
    // `rung=none memory=react guard=restore view=no`.
    ("host", ""),
];

/// What the host row must show, from what its kernel accepted: the strongest hook it loads, deny
/// with a hook, react without; the guard refuses (a hook, no rewrite), clamps (a rewrite) or
/// reacts and restores (neither); the view where the rewrite is allowed.
fn host_expectation(caps: &gpud::probes::KernelCaps) -> String {
    let rung = if caps.bpf_lsm {
        "lsm"
    } else if caps.fmod_ret {
        "fmod_ret"
    } else {
        "none"
    };
    let hook = rung != "none";
    let guard = match (hook, caps.probe_write_user) {
        (_, true) => "clamp",
        (true, false) => "deny",
        (false, false) => "restore",
    };
    format!(
        "rung={rung} memory={} guard={guard} view={}",
        if hook { "deny" } else { "react" },
        if caps.probe_write_user { "yes" } else { "no" }
    )
}

/// One row of the kernel matrix: what gpud picks on this kernel and what holds, as the line
/// `kernel-matrix: <row>: rung=… memory=… guard=… view=…`; fails where the row's expectation
/// ([`MATRIX`]) does not hold, or memory goes over its limit by a byte (deny rows), or the
/// crossing process lives on (react rows).
fn matrix_row(row: &str) -> anyhow::Result<String> {
    use gpud_tests::rm::{Ctl, Form};
    const MIB: u64 = 1 << 20;
    let want = MATRIX
        .iter()
        .find(|(r, _)| *r == row)
        .map(|(_, w)| *w)
        .with_context(|| format!("no matrix row {row:?}"))?;
    let attach = if row == "tracepoint-only" {
        AttachPreference::Tracepoint
    } else {
        AttachPreference::Auto
    };
    let _watchdog = inproc::Watchdog::arm(std::time::Duration::from_secs(120));
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only sets a flag of this process.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let tag = format!("matrix-{row}");
    let (fake, ctl) = stage(&format!("/tmp/{tag}-fake"))?;
    // As the daemon starts by default: every choice `auto`, the react action `kill`; its own
    // bpffs, mounted by the probes (the host may have none at /sys/fs/bpf).
    let Opened {
        core,
        events: mut ring,
        mut restorer,
        ..
    } = open_stack(
        &tag,
        &ctl,
        &[
            ("probes.attach", attach.as_str()),
            ("enforcement.react_action", "kill"),
        ],
    )
    .context("opening gpud's kernel stack with the defaults")?;
    let mut attribution = core.attribution;
    let root = attribution.cgroup_root().to_owned();
    let probes = attribution.probes();
    let rung = probes.ladder().in_force.as_str();
    let caps = probes.caps().clone();
    let deny = probes.tier() == Tier::Deny;
    let view = match probes.memory_info() {
        gpud::probes::MemoryInfoState::Unavailable(why) => format!("no ({why})"),
        _ => "yes".to_owned(),
    };
    for (hook, why) in &probes.ladder().refused {
        println!("[{tag}] {} not used: {why}", hook.as_str());
    }
    let reacts = probes.guard().reacts();
    // The daemon's restorer, run here in turn with the ring (the tenants are forked: no threads).
    ensure!(
        restorer.is_some() == reacts,
        "the guard reacts: {reacts}, a restorer: {}",
        restorer.is_some()
    );
    let mut undone = 0;
    let mut pump_all = |ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
                        attribution: &mut Attribution|
     -> anyhow::Result<()> {
        while let Some(item) = ring.next() {
            let record = Record::decode(&item);
            if let Ok(Record::Restore(r)) = record {
                let restorer = restorer
                    .as_mut()
                    .context("an undo asked of a guard that rewrites")?;
                restorer.apply(&r).with_context(|| {
                    format!(
                        "undoing a tenant's control (pid {}, verdict {:#x}, object {:#x})",
                        r.tgid, r.verdict, r.object
                    )
                })?;
                undone += 1;
            } else if let Ok(Record::Event(ev)) = record {
                attribution.on_kernel_event(&ev);
            }
        }
        Ok(())
    };
    let cg = root.join(&tag);
    std::fs::create_dir_all(&cg)?;
    let (_, id) = attribution.id_of(&format!("/{tag}"))?;
    attribution.set_kernel_limit(id, gpud_common::GPU_ALL, 8 * MIB)?;

    // Memory: 4 MiB, then 6 MiB that would take the cgroup to 10 over a limit of 8, then 2 MiB
    // that fits (the driver, and the fake, round to 2 MiB pages).
    let (c, dir) = (ctl.clone(), cg.clone());
    let held = inproc::fork_held(move || {
        let (f, client, dev) = match device_in(&c, &dir) {
            Ok(t) => t,
            Err(e) => return e,
        };
        let rm = Ctl::new(&f);
        let first = rm.alloc_vidmem(client, dev, 4 * MIB, Form::Nvos64);
        let second = rm.alloc_vidmem(client, dev, 6 * MIB, Form::Nvos21);
        // Reached only if the crossing call returned to this process.
        let after = rm.alloc_vidmem(client, dev, 2 * MIB, Form::Nvos64);
        std::mem::forget(f);
        format!(
            "first={} second={}/{} after={}",
            first.ok(),
            second.ret,
            second.errno,
            after.ok()
        )
    })?;
    let memory = if deny {
        let expect = format!("first=true second=-1/{} after=true", libc::ENOMEM);
        ensure!(
            held.report == expect,
            "child: {} (wanted {expect})",
            held.report
        );
        let used = fake.snapshot().used_total();
        ensure!(
            used == 6 * MIB,
            "the driver holds {used} bytes for the cgroup (limit 8 MiB, 0 over)"
        );
        held.release();
        "deny"
    } else {
        // The kill is sent from the probe before the crossing call returns: the child never
        // reports, and dies of SIGKILL.
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(held.pid as i32, &mut status, 0) };
        ensure!(
            held.report.is_empty(),
            "the crossing process went on: {}",
            held.report
        );
        ensure!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
            "the crossing process was not killed (status {status:#x})"
        );
        drop(held);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            pump_all(&mut ring, &mut attribution)?;
            attribution.release_closed_files();
            if attribution.memory_of(id).current.get("all") == Some(&0) {
                break;
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "the killed process's memory is still charged: {:?}",
                attribution.memory_of(id)
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        "react"
    };

    // The guard: a tenant asks for a 1 s timeslice; what is in force 5 ms later.
    let allowance = gpud::enforcement::guard::allowance(None);
    let mut a = guard_tenant(&ctl, &cg)?;
    let mut b = guard_tenant(&ctl, &cg)?;
    let set = a.ask("ts 1000000")?;
    pump_all(&mut ring, &mut attribution)?;
    std::thread::sleep(std::time::Duration::from_millis(5));
    let later: u64 = a.ask("get")?.parse().context("GET_TIMESLICE")?;
    let guard = if set.starts_with(&format!("errno={} ", libc::EPERM)) {
        "deny"
    } else if set.ends_with(&format!(" got={allowance}")) {
        "clamp"
    } else if later == allowance {
        "restore"
    } else {
        "report"
    };
    ensure!(
        guard == "report" || later <= allowance,
        "a timeslice of {later} µs in force 5 ms after a {guard} (allowance {allowance})"
    );
    // A neighbour's channels: disabled by a tenant naming them, and whether they stay so.
    let ib: Vec<String> = b.ask("ids")?.split(' ').map(str::to_owned).collect();
    // Killed before it answers where the guard reacts with `kill`.
    let r = a
        .ask(&format!("disable {} {}", ib[0], ib[2]))
        .unwrap_or_else(|e| format!("no answer: {e}"));
    pump_all(&mut ring, &mut attribution)?;
    std::thread::sleep(std::time::Duration::from_millis(5));
    let enabled = fake
        .snapshot()
        .channels
        .iter()
        .find(|c| format!("{:#x}", c.handle) == ib[2] && format!("{:#x}", c.client) == ib[0])
        .map(|c| c.enabled);
    let neighbour = match enabled {
        Some(true) => "kept",
        Some(false) => "left disabled",
        None => "gone",
    };
    println!("[{tag}] a neighbour's channels after a foreign disable ({r}): {neighbour}");
    if reacts {
        // Under the default react action the caller of the foreign disable was killed.
        let caller_gone = a.ask("get").is_err();
        println!("[{tag}] the foreign disable's caller killed: {caller_gone}; undone: {undone}");
        ensure!(caller_gone, "the caller of a foreign disable lives on");
    }
    drop((a, b));
    attribution.shutdown(false);
    drop(fake);
    let _ = std::fs::remove_dir(&cg);

    let line = format!("rung={rung} memory={memory} guard={guard} view={view}");
    let derived;
    let want = if want.is_empty() {
        derived = host_expectation(&caps);
        derived.as_str()
    } else {
        want
    };
    let expected_view = want.rsplit_once("view=").map_or("", |(_, v)| v);
    let (got_head, got_view) = line.rsplit_once(" view=").unwrap_or((&line, ""));
    let (want_head, _) = want.rsplit_once(" view=").unwrap_or((want, ""));
    ensure!(
        got_head == want_head && got_view.starts_with(expected_view),
        "kernel-matrix: {row}: {line} (wanted {want})"
    );
    // Where a hook or the rewrite acts, a neighbour's channels are never left disabled.
    ensure!(
        guard == "report" || neighbour == "kept",
        "a neighbour's channels were {neighbour} on a row whose guard acts ({guard})"
    );
    Ok(format!("kernel-matrix: {row}: {line}"))
}

/// The kernel-side checks, run inside the VM (see the module docs)./// The kernel-side checks, run inside the VM (see the module docs).
#[derive(Parser)]
#[command(name = "gpud-vmtest")]
enum Cli {
    /// Runs every check; prints `VMTEST RESULT: PASS` when all hold, and the `debian` row of
    /// the kernel matrix.
    Test,
    /// Runs one row of the kernel matrix on the running kernel (`debian`, `ubuntu`,
    /// `ubuntu-secure-boot`, `tracepoint-only`, `host`); prints its `kernel-matrix:` line and
    /// `VMTEST RESULT: PASS` when the row's expectation holds.
    Row { name: String },
}

fn main() -> std::process::ExitCode {
    let row = match Cli::parse() {
        Cli::Test => None,
        Cli::Row { name } => Some(name),
    };
    if let Some(name) = row {
        let lsm = std::fs::read_to_string("/sys/kernel/security/lsm").unwrap_or_default();
        let lockdown = std::fs::read_to_string("/sys/kernel/security/lockdown").unwrap_or_default();
        println!("kernel LSMs: {}; lockdown: {}", lsm.trim(), lockdown.trim());
        return match matrix_row(&name) {
            Ok(line) => {
                println!("{line}");
                println!("VMTEST RESULT: PASS");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                println!("kernel-matrix: {name}: FAILED: {e:#}");
                println!("VMTEST RESULT: FAIL ({name})");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let mut failed = Vec::new();
    let lsm = std::fs::read_to_string("/sys/kernel/security/lsm").unwrap_or_default();
    println!("kernel LSMs: {}", lsm.trim());
    for (pref, want) in [
        (AttachPreference::Fentry, AttachMode::Fentry),
        (AttachPreference::Tracepoint, AttachMode::Tracepoint),
    ] {
        if let Err(e) = scenario(pref, want) {
            println!("[{}] FAILED: {e:#}", want.as_str());
            failed.push(want.as_str());
        }
    }
    if gpud_tests::fakenv::available() {
        for hook in [DenyHookPreference::Lsm, DenyHookPreference::FmodRet] {
            if let Err(e) = memory_deny(hook) {
                println!("[deny-{}] FAILED: {e:#}", hook.as_str());
                failed.push("deny");
            }
        }
        for (pref, want, name) in [
            (AttachPreference::Auto, AttachMode::Fentry, "view-fentry"),
            (
                AttachPreference::Tracepoint,
                AttachMode::Tracepoint,
                "view-tracepoint",
            ),
        ] {
            if let Err(e) = memory_view(pref, want) {
                println!("[{name}] FAILED: {e:#}");
                failed.push(name);
            }
        }
        for (pref, tier, hook, want, name) in [
            (
                AttachPreference::Auto,
                TierPreference::Deny,
                DenyHookPreference::Lsm,
                AttachMode::Fentry,
                "guard-deny-lsm",
            ),
            (
                AttachPreference::Auto,
                TierPreference::Deny,
                DenyHookPreference::FmodRet,
                AttachMode::Fentry,
                "guard-deny-fmod_ret",
            ),
            (
                AttachPreference::Tracepoint,
                TierPreference::React,
                DenyHookPreference::Auto,
                AttachMode::Tracepoint,
                "guard-tracepoint",
            ),
        ] {
            if let Err(e) = scheduler_guard(pref, tier, hook, want) {
                println!("[{name}] FAILED: {e:#}");
                failed.push(name);
            }
        }
    } else {
        println!("[deny] FAILED: /dev/fuse is absent in the VM");
        failed.push("deny");
    }
    // The capability report must see BPF-LSM on this kernel (booted with lsm=...,bpf).
    if let Err(e) = check_lsm_probe() {
        println!("[caps] FAILED: {e:#}");
        failed.push("caps");
    }
    if gpud_tests::fakenv::available() {
        match matrix_row("debian") {
            Ok(line) => println!("{line}"),
            Err(e) => {
                println!("kernel-matrix: debian: FAILED: {e:#}");
                failed.push("matrix");
            }
        }
    }
    if failed.is_empty() {
        println!("VMTEST RESULT: PASS");
        std::process::ExitCode::SUCCESS
    } else {
        println!("VMTEST RESULT: FAIL ({})", failed.join(", "));
        std::process::ExitCode::FAILURE
    }
}

fn check_lsm_probe() -> anyhow::Result<()> {
    let standin = PathBuf::from("/tmp/vmtest-caps-standin");
    std::fs::write(&standin, b"")?;
    let Opened { core, .. } = open_stack("caps", &standin, &[("enforcement.tier", "react")])?;
    let caps = core.attribution.probes().caps().clone();
    let mode = core.attribution.probes().mode();
    core.close(false);
    if !(caps.fentry && caps.bpf_lsm && caps.tracepoint) {
        bail!("expected fentry, bpf_lsm and tracepoint on this kernel: {caps:?}");
    }
    ensure!(
        mode == AttachMode::Fentry,
        "auto chose {mode:?} although fentry loads"
    );
    Ok(())
}
