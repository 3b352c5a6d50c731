//! The kernel matrix: one row per way a kernel is booted (Debian, Ubuntu's LSM list, Secure Boot's lockdown, tracepoints only, the host), what gpud picks there and what holds; and the check that `auto` picks fentry where BPF-LSM loads.

#[allow(unused_imports)]
use super::*;

/// What each row of the kernel matrix must show (xtask boots the VM once per row with the
/// row's kernel command line; `host` runs on the machine itself): the hook, the memory tier, what
/// the guard does to a tenant's 1 s timeslice, and whether the memory view runs.
pub(super) const MATRIX: &[(&str, &str)] = &[
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
    // under Secure Boot's lockdown: the GPU cloud VMs (Firecracker guests). The JIT off does not take trampolines
    // away on x86-64 (measured: fentry and BPF-LSM still load and run with
    // net.core.bpf_jit_enable=0, the trampoline is emitted by the arch code and calls the
    // interpreter), so the attach preference stands in for it.
    (
        "tracepoint-only",
        "rung=none memory=react guard=restore view=no",
    ),
    // The newest kernel Debian ships (sid; xtask boots it for these two rows), as Debian and
    // as Ubuntu would boot it: what holds there must be what holds on the older one.
    ("sid-debian", "rung=lsm memory=deny guard=clamp view=yes"),
    (
        "sid-ubuntu",
        "rung=fmod_ret memory=deny guard=clamp view=yes",
    ),
    // The machine the tests run on: what it must show follows from what its kernel offers
    // (`host_expectation`); on this project's CI host (tracepoints only, under lockdown)
    // `rung=none memory=react guard=restore view=no`.
    ("host", ""),
];

/// What the host row must show, from what its kernel accepted: the strongest hook it loads, deny
/// with a hook, react without; the guard refuses (a hook, no rewrite), clamps (a rewrite) or
/// reacts and restores (neither); the view where the rewrite is allowed.
pub(super) fn host_expectation(caps: &gpud::probes::KernelCaps) -> String {
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
pub(super) fn matrix_row(row: &str) -> anyhow::Result<String> {
    use gpud_tests::rm::Form;
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
        restorer,
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
    let (probes, mut attribution, mut settings, root) = parts(core, None)?;
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
    // The daemon's restorer, run here in turn with the ring (the tenants are forked: no threads):
    // undoes where the guard reacts, reads back on every row.
    let mut restorer = restorer.context("no restorer")?;
    let (undone, read_back, swept) = (
        std::cell::Cell::new(0u32),
        std::cell::Cell::new(0u32),
        std::cell::Cell::new(0u32),
    );
    let mut pump_all = |ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
                        attribution: &mut Attribution|
     -> anyhow::Result<()> {
        while let Some(item) = ring.next() {
            let record = Record::decode(&item);
            if let Ok(Record::SizeCheck(c)) = record {
                restorer
                    .check_size(&c)
                    .with_context(|| format!("reading back an allocation (pid {})", c.pid))?;
            } else if let Ok(Record::DeviceCheck(c)) = record {
                restorer
                    .check_device(&c)
                    .with_context(|| format!("reading back a device (pid {})", c.pid))?;
            } else if let Ok(Record::FreeCheck(c)) = record {
                restorer
                    .check_free(&c)
                    .with_context(|| format!("reading back a free (pid {})", c.pid))?;
            } else if let Ok(Record::ReadBack(r)) = record {
                restorer
                    .read_back(&r)
                    .with_context(|| format!("reading back a tenant's groups (pid {})", r.pid))?;
                read_back.set(read_back.get() + 1);
                restorer.ask_sweep();
            } else if let Ok(Record::Undo(r)) = record {
                ensure!(reacts, "an undo asked of a guard that rewrites");
                restorer
                    .apply(&r)
                    .with_context(|| format!("undoing a tenant's control: {r:?}"))?;
                undone.set(undone.get() + 1);
            } else if let Ok(Record::Event(ev)) = record {
                attribution.on_kernel_event(&ev);
            }
        }
        if restorer
            .sweep_due()
            .is_some_and(|due| due <= std::time::Instant::now())
        {
            restorer.sweep().context("sweeping the channel groups")?;
            swept.set(swept.get() + 1);
        }
        Ok(())
    };
    let cg = root.join(&tag);
    std::fs::create_dir_all(&cg)?;
    let (_, id) = attribution.id_of(&format!("/{tag}"))?;
    settings.set_limit(id, gpud_common::GPU_ALL, 8 * MIB)?;

    // Memory: 4 MiB, then 6 MiB that would take the cgroup to 10 over a limit of 8, then 2 MiB
    // that fits (the driver, and the fake, round to 2 MiB pages).
    let (c, dir) = (ctl.clone(), cg.clone());
    let held = inproc::fork_held(move || {
        // The third is reached only if the crossing call returned to this process.
        let steps = [
            (4 * MIB, Form::Nvos64),
            (6 * MIB, Form::Nvos21),
            (2 * MIB, Form::Nvos64),
        ];
        let (f, r) = match allocs_in(&c, &dir, &steps) {
            Ok(t) => t,
            Err(e) => return e,
        };
        std::mem::forget(f);
        let (first, second, after) = (&r[0], &r[1], &r[2]);
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
        wait_uncharged(
            &mut attribution,
            id,
            "the killed process's memory is still charged",
            |a| {
                pump_all(&mut ring, a)?;
                a.release_closed_files();
                Ok(())
            },
        )?;
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
    // The same through a second thread that turns the tenant's `GET_TIMESLICE` into the 1 s
    // `SET_TIMESLICE` after the guard read it: the driver's state is read back after the calls.
    let sets_before = group_sets(&fake, &mut a)?;
    let raced = a.ask("race 1000000 2000")?;
    pump_all(&mut ring, &mut attribution)?;
    std::thread::sleep(std::time::Duration::from_millis(5));
    let raced_later: u64 = a.ask("get")?.parse().context("GET_TIMESLICE")?;
    println!(
        "[{tag}] raced timeslice ({raced}; SET_TIMESLICE reaching the driver: {}; read-backs \
         so far: {}): {raced_later} µs in force 5 ms later",
        group_sets(&fake, &mut a)? - sets_before,
        read_back.get()
    );
    ensure!(
        guard == "report" || raced_later <= allowance,
        "a timeslice of {raced_later} µs in force 5 ms after a raced SET_TIMESLICE (allowance \
         {allowance})"
    );
    // A neighbour's channels: disabled by a tenant naming them, and whether they stay so.
    let ib: Vec<String> = b.ask("ids")?.split(' ').map(str::to_owned).collect();
    let b_channel = |fake: &gpud_tests::fakenv::FakeNv| {
        fake.snapshot()
            .channels
            .iter()
            .find(|c| format!("{:#x}", c.handle) == ib[2] && format!("{:#x}", c.client) == ib[0])
            .map(|c| (c.enabled, c.disabled_times))
    };
    // First through a second thread that points the tenant's disable of its own channel at
    // the neighbour's after the guard read it: gpud puts the groups back on the runlist. The
    // neighbour's context is made first (its group put on the runlist, CUDA's last step).
    ensure!(
        b.ask("schedule 1")? == "errno=0 status=0x0",
        "the neighbour's group"
    );
    let disables_before = b_channel(&fake).map_or(0, |c| c.1);
    // Widened so that it wins: the driver answers 50 ms late, the list turned 10 ms into each
    // call (the guard has read the caller's own channel there by then).
    fake.inject("delay-ioctl-ms 50")
        .map_err(anyhow::Error::msg)?;
    let raced = a
        .ask(&format!("race-disable {} {} 4 10", ib[0], ib[2]))
        .unwrap_or_else(|e| format!("no answer: {e}"));
    fake.inject("delay-ioctl-ms 0")
        .map_err(anyhow::Error::msg)?;
    let started = std::time::Instant::now();
    let mut back = false;
    while started.elapsed() < std::time::Duration::from_secs(1) {
        pump_all(&mut ring, &mut attribution)?;
        if b_channel(&fake).is_some_and(|c| c.0) {
            back = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let reached = b_channel(&fake).map_or(0, |c| c.1) - disables_before;
    println!(
        "[{tag}] raced disable ({raced}; the neighbour's disables reaching the driver: \
         {reached}; sweeps: {}): the neighbour {} after {:?}",
        swept.get(),
        if back { "enabled" } else { "still disabled" },
        started.elapsed()
    );
    ensure!(
        reached > 0,
        "no raced disable reached the neighbour's channel ({raced})"
    );
    ensure!(
        back,
        "the neighbour's channel left disabled 1 s after a raced FIFO_DISABLE_CHANNELS"
    );
    // Killed before it answers where the guard reacts with `kill`.
    let r = a
        .ask(&format!("disable {} {}", ib[0], ib[2]))
        .unwrap_or_else(|e| format!("no answer: {e}"));
    pump_all(&mut ring, &mut attribution)?;
    std::thread::sleep(std::time::Duration::from_millis(5));
    let enabled = b_channel(&fake).map(|c| c.0);
    let neighbour = match enabled {
        Some(true) => "kept",
        Some(false) => "left disabled",
        None => "gone",
    };
    println!("[{tag}] a neighbour's channels after a foreign disable ({r}): {neighbour}");
    if reacts {
        // Under the default react action the caller of the foreign disable was killed.
        let caller_gone = a.ask("get").is_err();
        println!(
            "[{tag}] the foreign disable's caller killed: {caller_gone}; undone: {}",
            undone.get()
        );
        ensure!(caller_gone, "the caller of a foreign disable lives on");
    }
    drop((a, b));
    // The red-team tenant's attacks under a 64 MiB limit, each in its own cgroup.
    let mut through = Vec::new();
    for name in gpud_tests::rm::attack::NAMES {
        let held = red_team(
            &tag,
            name,
            &ctl,
            &root,
            &fake,
            &mut attribution,
            &mut settings,
            &mut |a| pump_all(&mut ring, a),
        )?;
        println!(
            "[{tag}] red team {name}: the driver holds {} MiB for it",
            held / MIB
        );
        if held > RED_TEAM_LIMIT {
            through.push(name);
        }
    }
    let redteam = if through.is_empty() {
        "pass".to_owned()
    } else {
        through.join(",")
    };
    drop(attribution);
    probes.shutdown(false);
    drop(fake);
    let _ = std::fs::remove_dir(&cg);
    // Its bpffs and state too: on the host row they would stay mounted after the run.
    gpud_tests::remove_state_dir(&super::stack_dir(&tag));

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
    ensure!(
        through.is_empty(),
        "kernel-matrix: {row}: attacks got through: {redteam}"
    );
    Ok(format!("kernel-matrix: {row}: {line} redteam={redteam}"))
}

/// `SET_TIMESLICE` controls that reached the channel group of guard tenant `t` in the fake.
fn group_sets(fake: &gpud_tests::fakenv::FakeNv, t: &mut inproc::Serving) -> anyhow::Result<u64> {
    let ids = t.ask("ids")?;
    let mut ids = ids.split(' ');
    let (client, group) = (ids.next().unwrap_or(""), ids.next().unwrap_or(""));
    fake.snapshot()
        .channel_groups
        .iter()
        .find(|g| format!("{:#x}", g.client) == client && format!("{:#x}", g.handle) == group)
        .map(|g| g.timeslice_sets)
        .context("the tenant's channel group is not in the fake")
}

/// The limit the red-team tenant attacks.
const RED_TEAM_LIMIT: u64 = 64 << 20;

/// Attack `name` ([`gpud_tests::rm::attack`]) by a tenant forked into a cgroup of its own under a
/// 64 MiB limit, 16 MiB at a time, 12 times: the bytes the fake driver holds for it once it is
/// done, or once it was killed and its file released. More than the limit: the attack got
/// through (deny rows refuse the crossing allocation; react rows kill in it).
#[allow(clippy::too_many_arguments)]
fn red_team(
    tag: &str,
    name: &str,
    ctl: &std::path::Path,
    root: &std::path::Path,
    fake: &gpud_tests::fakenv::FakeNv,
    attribution: &mut Attribution,
    settings: &mut gpud::probes::KernelSettings,
    pump_all: &mut dyn FnMut(&mut Attribution) -> anyhow::Result<()>,
) -> anyhow::Result<u64> {
    let rel = format!("{tag}-rt-{name}");
    let dir = root.join(&rel);
    std::fs::create_dir_all(&dir)?;
    let (_, id) = attribution.id_of(&format!("/{rel}"))?;
    let key = if gpud_tests::rm::attack::per_gpu_limit(name) {
        gpud_tests::rm::attack::LIMITED_GPU
    } else {
        gpud_common::GPU_ALL
    };
    settings.set_limit(id, key, RED_TEAM_LIMIT)?;
    // The driver's copy of the request is what these race: widened so that they win.
    let racing = gpud_tests::rm::attack::RACING_THE_DRIVER.contains(&name);
    if racing {
        fake.inject("delay-ioctl-ms 50")
            .map_err(anyhow::Error::msg)?;
    }
    let (c, d, attack) = (ctl.to_owned(), dir.clone(), name.to_owned());
    let held = fork_held(move || {
        let (f, client, dev) = match device_in(&c, &d) {
            Ok(t) => t,
            Err(e) => return e,
        };
        let rm = gpud_tests::rm::Ctl::new(&f);
        let out = gpud_tests::rm::attack::run(&rm, &attack, client, dev, 16 << 20, 12);
        // The file stays open until the parent has read the ledger.
        std::mem::forget(f);
        format!("{out:?}")
    })?;
    if racing {
        fake.inject("delay-ioctl-ms 0")
            .map_err(anyhow::Error::msg)?;
    }
    let pid = held.pid;
    // The restorer reads back what the driver holds (here, in turn with the ring, once the
    // tenant is done) and kills it where that crosses the limit.
    pump_all(attribution)?;
    // A tenant killed in (or right after) its crossing call held that allocation at its death:
    // the driver gives it back with the file, in a moment.
    let killed = held.report.is_empty();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut bytes = fake.snapshot().held_by(&[pid]);
    while bytes > RED_TEAM_LIMIT && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        bytes = fake.snapshot().held_by(&[pid]);
    }
    let report = if killed { "killed" } else { &held.report };
    println!("[{tag}] red team {name}: {report}");
    held.release();
    let _ = std::fs::remove_dir(&dir);
    Ok(bytes)
}

pub(super) fn check_lsm_probe() -> anyhow::Result<()> {
    let standin = PathBuf::from("/tmp/vmtest-caps-standin");
    std::fs::write(&standin, b"")?;
    let Opened { core, .. } = open_stack("caps", &standin, &[("enforcement.tier", "react")])?;
    let caps = core.probes.caps().clone();
    let mode = core.probes.mode();
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
