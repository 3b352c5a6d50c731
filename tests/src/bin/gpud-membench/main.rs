//! `gpud-membench --mode tracepoint|fentry [--pairs N] [--rounds R] [--samples S]`: what GPU-memory
//! accounting and enforcement cost and how fast they act, measured in one run (run by
//! `cargo xtask bench`; method in docs/benchmarks.md).
//!
//! The fake NVIDIA control device runs as a separate process (this binary re-executed with
//! `--serve-fake DIR`, FUSE), so the measuring process has one thread and may fork; and the one
//! binary is all the VM needs. gpud's probes and its state code (attribution, limits,
//! the freeze action) run in this process, as the daemon's state task would run them.
//!
//! - `alloc_free_ns`: time of one RM_ALLOC of video memory plus its RM_FREE by a process in a
//!   cgroup, without probes and with gpud's probes attached (accounting both calls); fastest of R
//!   rounds of N pairs, per pair. The fake answers through FUSE (tens of µs, noisy), which is far
//!   slower than the real driver, so this wall-clock difference is only a sanity check.
//! - `pair_cpu_ns`: what a pair costs its caller, from the calling thread's CPU time
//!   (`CLOCK_THREAD_CPUTIME_ID`: its system calls, gpud's programs and their dispatch included,
//!   the fake's server and the waits for it not), fastest of R rounds, per pair: a run with gpud's
//!   probes attached and the run-time statistics off, against the mean of a run before the attach
//!   and one after the detach; `added` is the median of the five cycles' differences (each in
//!   `added_by_cycle`). No program statistic and no estimate of other processes' runs enters it.
//! - `probe_ns_per_pair`: the kernel's own run-time statistics of gpud's ioctl-path programs
//!   (`BPF_ENABLE_STATS`), summed over the programs that ran during the pairs, per pair (the entry
//!   and return programs of both ioctls, charge and uncharge included; other processes' ioctls
//!   during the run are in the sum too, so it is an upper bound), with the per-program ns per run
//!   beside it (averaged over every run on the host, matched or not). Where the ioctl programs
//!   are on the raw `sys_enter`/`sys_exit` tracepoints, every system call on the host runs them
//!   (the fake's FUSE server makes several per ioctl): runs beyond the phase's ioctls are taken
//!   out at what a run costs on a `getppid` loop of this process (`unfollowed_run_ns`), which is
//!   less than the same run costs interleaved with other work (cold caches), so the figure stays
//!   an upper bound. The hooks' dispatch cost is not in it (see `gpud-bench`, whose wall-clock
//!   `matched_ioctl` holds programs and dispatch together). The statistics' own clock reading,
//!   which every timed run holds (`stats_clock_ns_per_run`: what they give an empty program), is
//!   taken out of `probe_net_ns_per_pair` and the breakdown's `programs_net_ns_per_pair`.
//! - `pair_breakdown`: where a pair's time goes: a process in the cgroup makes N = pairs × rounds
//!   allocations (2 MiB, NVOS64, kept), then frees them, three times; the kernel's run-time
//!   statistics of each of gpud's ioctl programs over each phase, per call (median of the three;
//!   the entry and the return program apart), the ring-buffer records the calls sent (as the
//!   notices gpud's state code made of them) and that code's time handling them, per call.
//!   `pair_breakdown_depth5`: the same from a cgroup five levels deep (the root and four below
//!   it, as a Kubernetes container's: `kubepods`, the QoS class, the pod, the container), each
//!   level charged and walked for limits at every call.
//! - `kill_ns`: a process whose cgroup is over its limit allocates; from just before its ioctl to
//!   its reaping by the parent (it is killed inside the ioctl's return path), minus the median
//!   time of the same ioctl without a limit: the time the kill adds after the ioctl's work.
//! - `freeze_ns`: `react_action = freeze`: from the crossing ioctl's return in the allocating
//!   process (its own clock reading) to `cgroup.events` showing `frozen 1`, with the ring-buffer
//!   event handled by gpud's enforcement code in a polling loop (the daemon's state task adds a
//!   channel hop, not measured here).
//!
//! - `file_check_ns`: the release rule's check of control files (`Attribution::
//!   release_closed_files`, which the daemon runs at every sweep and after exits): H processes in
//!   the cgroup each hold their own control file with a client, a device and 2 MiB; the check's
//!   time over all their files (one `gpud_file_held` run each, plus the object-table walk), median
//!   of 5, and per file.
//!
//! - `memory_info_ns_per_call`: the in-container memory view: a process in the cgroup issues
//!   `FB_GET_INFO_V2` as `cuMemGetInfo` does (HEAP_FREE, HEAP_SIZE, FB_TAX), `--calls` times per
//!   phase, the three phases alternated 3 times (median per phase), and the kernel's run-time
//!   statistics of gpud's ioctl programs give their time per call: no limit (`unlimited`), a limit with the view off (`limited_view_off`: the command
//!   is compared, nothing noted) and on (`limited_view_on`: noted at entry, the reply rewritten
//!   at the exit; only where the kernel allows `bpf_probe_write_user`, else `null`, the reason
//!   in `memory_view`). Each phase also checks what the process read.
//!
//! - `scheduler_guard_ns_per_call`: the scheduler guard's cost, measured the same way (`--calls`
//!   calls per phase, three phases alternated 3 times, median), with the memory view off: an
//!   ordinary RM control (`FB_GET_INFO_V2`) with the guard `off` (`ordinary_guard_off`: the
//!   configuration's flags are read, nothing else) and `enforce` (`ordinary_guard_on`: the
//!   `NVOS54` is read and its command matched), and a tenant's `SET_TIMESLICE` of 1 s the guard
//!   acts on (`set_timeslice_guarded`: the allowance looked up, the value lowered where the kernel
//!   allows `bpf_probe_write_user`, and an event sent). `scheduler_guard` says what the guard
//!   could do on this kernel.
//!
//! Prints one line `BENCH JSON: {...}`.

mod costs;

use std::{
    io::BufRead as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};
use clap::Parser;
use gpud::{
    cgroupfs::CgroupFs,
    config::ReactAction,
    daemon::core::{Core, Opened},
    probes::AttachMode,
    report::Chain,
};
use gpud_tests::{
    TestConfig, inproc,
    rm::{Ctl, Form},
};
use serde_json::json;

use costs::{memory_info_cost, pair_breakdown, scheduler_guard_cost};

const MIB: u64 = 1 << 20;
/// What the stand-in device holds: the breakdown keeps `--pairs` × `--rounds` allocations of
/// 2 MiB at once.
const FAKE_CAPACITY: u64 = 64 << 30;

/// What GPU-memory accounting and enforcement cost and how fast they act; prints one
/// `BENCH JSON: {…}` line.
#[derive(Parser)]
#[command(name = "gpud-membench")]
struct Opts {
    /// How gpud's probes attach: tracepoint or fentry.
    #[arg(long, default_value = "tracepoint", value_parser = inproc::attach_mode)]
    mode: AttachMode,
    /// Allocation/free pairs per round.
    #[arg(long, default_value_t = 500)]
    pairs: u64,
    /// Rounds of pairs (the fastest counts).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Samples of the kill and freeze latencies.
    #[arg(long, default_value_t = 15)]
    samples: usize,
    /// Calls per phase of the memory view's and the scheduler guard's costs.
    #[arg(long, default_value_t = 10_000)]
    calls: u64,
    /// Processes holding a control file each while the check of control files is timed.
    #[arg(long, default_value_t = 1000)]
    holders: usize,
    /// Only the accounting cost: the pair loop and the breakdown at depth 2, printed alone. For
    /// comparing two builds, whose figures move with the host between sittings: many short runs
    /// of each, alternated (docs/benchmarks.md).
    #[arg(long)]
    only_pairs: bool,
    /// Serves the fake NVIDIA device at DIR until standard input closes (the measuring run
    /// starts this binary so).
    #[arg(long, value_name = "DIR", hide = true)]
    serve_fake: Option<PathBuf>,
}

/// Clock `id` in ns.
fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes into ts.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in ns: comparable between processes, unlike `Instant`.
fn mono_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// A page of memory shared with forked children, for clock readings.
struct Shared(*mut u64);

impl Shared {
    fn new() -> anyhow::Result<Self> {
        // SAFETY: an anonymous shared mapping of one page.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        ensure!(p != libc::MAP_FAILED, "mmap failed");
        Ok(Self(p.cast()))
    }
    fn set(&self, i: usize, v: u64) {
        // SAFETY: i < 512 within the page.
        unsafe { self.0.add(i).write_volatile(v) }
    }
    fn get(&self, i: usize) -> u64 {
        // SAFETY: as above.
        unsafe { self.0.add(i).read_volatile() }
    }
}

struct Fake {
    child: std::process::Child,
    ctl: PathBuf,
}

impl Fake {
    fn start(dir: &Path) -> anyhow::Result<Self> {
        let bin = std::env::current_exe()?;
        let mut child = Command::new(&bin)
            .arg("--serve-fake")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
        ensure!(line.trim() == "READY", "fake device said {line:?}");
        Ok(Self {
            child,
            ctl: dir.join("nvidiactl"),
        })
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        // End of stdin unmounts and exits.
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// What one [`alloc_free`] run measured, ns per pair, each the fastest of its rounds.
#[derive(Clone, Copy)]
struct PairTimes {
    /// Wall-clock time.
    wall: f64,
    /// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`): its system calls, gpud's
    /// programs on them included, without the fake's server's time or its waits for it.
    cpu: f64,
}

/// The calling thread's CPU time, ns.
fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Rounds of `pairs` alloc+free pairs in a child in `cg`: the fastest round's wall-clock and
/// CPU time per pair.
fn alloc_free(ctl: &Path, cg: &Path, pairs: u64, rounds: usize) -> anyhow::Result<PairTimes> {
    let ctl = ctl.to_owned();
    let cg = cg.to_owned();
    let report = inproc::in_child(move || {
        if let Err(e) = inproc::join_cgroup(&cg) {
            return format!("join: {e}");
        }
        let f = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&ctl)
        {
            Ok(f) => f,
            Err(e) => return format!("open: {e}"),
        };
        let rm = Ctl::new(&f);
        let c = rm.alloc_client().handle;
        let d = rm.alloc_device(c, 0).handle;
        let (mut wall, mut cpu) = (f64::MAX, f64::MAX);
        for _ in 0..rounds {
            let (t, c0) = (Instant::now(), thread_cpu_ns());
            for _ in 0..pairs {
                let a = rm.alloc_vidmem(c, d, 2 * MIB, Form::Nvos64);
                rm.free(c, a.handle);
            }
            let spent = thread_cpu_ns().saturating_sub(c0);
            wall = wall.min(t.elapsed().as_nanos() as f64 / pairs as f64);
            cpu = cpu.min(spent as f64 / pairs as f64);
        }
        format!("{wall} {cpu}")
    })?;
    let mut it = report.split(' ').map(str::parse::<f64>);
    match (it.next(), it.next()) {
        (Some(Ok(wall)), Some(Ok(cpu))) => Ok(PairTimes { wall, cpu }),
        _ => anyhow::bail!("child: {report}"),
    }
}

/// `n` children in `cg`, each holding its own control file with a client, a device and 2 MiB,
/// until killed; returns their pids once all are ready.
fn spawn_holders(ctl: &Path, cg: &Path, n: usize) -> anyhow::Result<Vec<i32>> {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) writes two descriptors.
    ensure!(unsafe { libc::pipe(fds.as_mut_ptr()) } == 0, "pipe failed");
    let mut pids = Vec::with_capacity(n);
    for _ in 0..n {
        // SAFETY: this process is single-threaded; the child only makes RM calls, writes one
        // byte and sleeps until killed.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let ok = inproc::join_cgroup(cg).is_ok()
                && std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(ctl)
                    .map(|f| {
                        let rm = Ctl::new(&f);
                        let c = rm.alloc_client().handle;
                        let d = rm.alloc_device(c, 0).handle;
                        let _ = rm.alloc_vidmem(c, d, 2 * MIB, Form::Nvos64);
                        std::mem::forget(f);
                    })
                    .is_ok();
            let byte = [u8::from(ok)];
            // SAFETY: one byte to the pipe, then sleep until killed.
            unsafe {
                libc::write(fds[1], byte.as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        ensure!(pid > 0, "fork failed");
        pids.push(pid);
    }
    // SAFETY: the write end is the children's now.
    unsafe { libc::close(fds[1]) };
    for _ in 0..n {
        let mut byte = [0u8];
        // SAFETY: reads one byte from the pipe.
        let r = unsafe { libc::read(fds[0], byte.as_mut_ptr().cast(), 1) };
        ensure!(r == 1 && byte[0] == 1, "a holder failed to set up");
    }
    // SAFETY: done with the read end.
    unsafe { libc::close(fds[0]) };
    Ok(pids)
}

/// Run time (ns) and run count of every loaded gpud program, by name.
fn prog_stats() -> std::collections::BTreeMap<String, (u64, u64)> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter_map(|p| {
            let name = p.name_as_str()?.to_owned();
            name.starts_with("gpud_")
                .then(|| (name, (p.run_time().as_nanos() as u64, p.run_count())))
        })
        .fold(Default::default(), |mut m, (k, (t, n))| {
            let e: &mut (u64, u64) = m.entry(k).or_default();
            e.0 += t;
            e.1 += n;
            m
        })
}

/// Whether `name` is one of gpud's programs on the ioctl path: the `syscalls:*` events' ioctl
/// programs or the raw system-call ones (names are cut to 15 bytes in the kernel).
fn ioctl_program(name: &str) -> bool {
    name.contains("_ioc") || raw_syscall_program(name)
}

/// The raw `sys_enter` and `sys_exit` programs, which run for every system call on the host.
fn raw_syscall_program(name: &str) -> bool {
    name.starts_with("gpud_tp_sys_e")
}

/// What a raw system-call program costs on a system call it does not follow, by program (ns per
/// run): measured on `getppid` calls of this process, which holds no NVIDIA file, with the run
/// statistics on. Every system call on the host runs those programs, so a phase's figures take
/// the runs beyond its own ioctls out at this cost ([`on_ioctls`]). In a tight loop a run finds
/// what it reads in cache; the fake's server's runs, between its round trips, cost more (a
/// loop of reads of the fake's `state` file read 5–35 ns more a run: docs/benchmarks.md), so
/// what is left of them in a phase's figure makes it an upper bound.
fn unfollowed_run_ns() -> std::collections::BTreeMap<String, f64> {
    const CALLS: u64 = 200_000;
    let before = prog_stats();
    for _ in 0..CALLS {
        // SAFETY: no arguments, no memory.
        unsafe { libc::getppid() };
    }
    prog_stats()
        .into_iter()
        .filter(|(k, _)| raw_syscall_program(k))
        .filter_map(|(k, (t, n))| {
            let (t0, n0) = before.get(&k).copied().unwrap_or((0, 0));
            let runs = n.saturating_sub(n0);
            (runs > 0).then(|| (k, t.saturating_sub(t0) as f64 / runs as f64))
        })
        .collect()
}

/// What the run-time statistics add to each run they time, ns: the kernel reads its clock
/// around every program run while they are on (`BPF_ENABLE_STATS`), and the run's time holds
/// about one reading, which no run costs with them off. Measured as the time the statistics
/// give an empty program (gpud's own benchmark reference, `gpud_noop_*`) on the hook the mode's
/// ioctl programs use, over ioctls on `/dev/null` (which reach both hooks): what is left is
/// that reading and the program's call, which the hooks' dispatch (`gpud-bench`'s
/// `noop_program_added_ns`) holds already. Loaded into a bpffs of its own, its pins removed
/// with it.
fn stats_clock_ns(mode: AttachMode) -> anyhow::Result<f64> {
    use gpud::probes::{self, BPF_FS_MAGIC};
    const CALLS: u64 = 200_000;
    let bpffs = setup_dir("clock").join("bpffs");
    std::fs::create_dir_all(&bpffs)?;
    probes::ensure_mounted(&bpffs, "bpf", BPF_FS_MAGIC)?;
    let (mut ebpf, btf) = inproc::reference_object(&bpffs)?;
    let name = inproc::attach_noop_entry(&mut ebpf, &btf, mode, &["sys_enter"])?;
    let null = std::fs::File::open("/dev/null")?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&null);
    let before = prog_stats();
    for _ in 0..CALLS {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int; /dev/null refuses it, after both hooks ran.
        unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    }
    // The kernel keeps 15 bytes of a program's name.
    let short: String = name.chars().take(15).collect();
    let (t, n) = stats_since(&before)
        .get(&short)
        .copied()
        .unwrap_or_default();
    drop(ebpf);
    gpud_tests::remove_state_dir(&setup_dir("clock"));
    ensure!(n > 0, "{name} never ran");
    Ok(t as f64 / n as f64)
}

/// The ns gpud's ioctl-path programs spent on a phase's `ioctls` calls, by program, from their
/// run time and runs over the phase (`spent`): a raw system-call program's runs beyond those
/// calls were other system calls (the fake's server, the host), taken out at the cost
/// [`unfollowed_run_ns`] measured.
fn on_ioctls(
    spent: &std::collections::BTreeMap<String, (u64, u64)>,
    ioctls: u64,
    unfollowed: &std::collections::BTreeMap<String, f64>,
) -> std::collections::BTreeMap<String, f64> {
    spent
        .iter()
        .filter(|(k, _)| ioctl_program(k))
        .map(|(k, &(t, n))| {
            let others =
                n.saturating_sub(ioctls) as f64 * unfollowed.get(k).copied().unwrap_or(0.0);
            let ns = (t as f64 - others).max(0.0);
            (k.clone(), ns)
        })
        .collect()
}

/// Each program's (run time, runs) between two [`prog_stats`] readings.
fn stats_since(
    before: &std::collections::BTreeMap<String, (u64, u64)>,
) -> std::collections::BTreeMap<String, (u64, u64)> {
    prog_stats()
        .into_iter()
        .map(|(k, (t, n))| {
            let (t0, n0) = before.get(&k).copied().unwrap_or((0, 0));
            (k, (t.saturating_sub(t0), n.saturating_sub(n0)))
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

/// One allocation from a fresh child in `cg`; returns (ns from before the ioctl to reaping,
/// whether it was killed, ns the ioctl took when it returned).
fn one_alloc(ctl: &Path, cg: &Path, shared: &Shared) -> anyhow::Result<(u64, bool, u64)> {
    shared.set(0, 0);
    shared.set(1, 0);
    let ready = inproc::fork_held(|| {
        if let Err(e) = inproc::join_cgroup(cg) {
            return format!("join: {e}");
        }
        "ok".into()
    })?;
    // The held child is only used to make sure the cgroup exists and is joinable.
    ready.release();
    // SAFETY: the child only issues RM calls and writes to the shared page, then _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            inproc::join_cgroup(cg).ok()?;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(ctl)
                .ok()?;
            let rm = Ctl::new(&f);
            let c = rm.alloc_client().handle;
            let d = rm.alloc_device(c, 0).handle;
            let t0 = mono_ns();
            shared.set(0, t0);
            let r = rm.alloc_vidmem(c, d, 4 * MIB, Form::Nvos64);
            shared.set(1, mono_ns() - t0);
            Some(i32::from(!r.ok()))
        })()
        .unwrap_or(2);
        // SAFETY: leave without running destructors.
        unsafe { libc::_exit(code) };
    }
    ensure!(pid > 0, "fork failed");
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let t1 = mono_ns();
    let killed = libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL;
    ensure!(
        killed || (libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0),
        "child ended with status {status:#x}"
    );
    Ok((t1.saturating_sub(shared.get(0)), killed, shared.get(1)))
}

fn setup(
    o: &Opts,
    ctl: &Path,
    action: ReactAction,
    tag: &str,
) -> anyhow::Result<(Core, aya::maps::RingBuf<aya::maps::MapData>)> {
    // The daemon's own kernel stack (gpud::daemon::core::open), its state and bpffs apart.
    let dir = setup_dir(tag);
    let config = TestConfig::new(&dir)
        .extra_paths([ctl])
        .nvml_off()
        .set("probes.attach", o.mode.as_str())
        .set("enforcement.tier", "react")
        .react_action(&format!("{action:?}").to_lowercase())
        .parsed();
    let Opened { core, events, .. } =
        gpud::daemon::core::open(&config).map_err(|e| anyhow::anyhow!("{}", Chain(&e)))?;
    let mode = core.probes.mode();
    ensure!(mode == o.mode, "attached in {mode:?}");
    Ok((core, events))
}

/// The setups' tags: each has its own directory ([`setup_dir`]).
const SETUPS: [&str; 8] = [
    "acct", "kill", "freeze", "pair", "view", "guard", "files", "clock",
];

/// Where the setup `tag` keeps gpud's state and mounts its bpffs.
fn setup_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gpud-membench-{}-{tag}", std::process::id()))
}

/// What the benchmark made on the host, taken away when it ends, failed or not: each setup's
/// bpffs is unmounted (a phase that failed before closing its probes left them pinned there,
/// attached to every process on the host) and its directory removed, and the benchmark's
/// cgroup removed.
struct Cleanup {
    cgroup: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        clean_up(&self.cgroup);
    }
}

fn clean_up(cgroup: &Path) {
    for tag in SETUPS {
        gpud_tests::remove_state_dir(&setup_dir(tag));
    }
    // Interrupted, forked callers may still be in it (frozen, or waiting for a word from us).
    let _ = std::fs::write(cgroup.join("cgroup.kill"), "1");
    for _ in 0..50 {
        if std::fs::remove_dir(cgroup).is_ok() || !cgroup.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--serve-fake DIR`: serves the fake device until standard input closes.
fn serve_fake(dir: &Path) -> anyhow::Result<()> {
    use std::io::{Read as _, Write as _};
    let opts = gpud_tests::fakenv::Options {
        capacity: FAKE_CAPACITY,
        ..Default::default()
    };
    let fake = gpud_tests::fakenv::mount(dir, opts).context("mounting the fake device")?;
    println!("READY");
    std::io::stdout().flush()?;
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    fake.unmount()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let o = Opts::parse();
    if let Some(dir) = &o.serve_fake {
        return serve_fake(dir);
    }
    let kept = o.pairs.saturating_mul(o.rounds as u64);
    ensure!(
        kept.saturating_mul(2 * MIB) <= FAKE_CAPACITY,
        "--pairs {} × --rounds {}: the breakdown keeps {kept} allocations of 2 MiB at once, more \
         than the stand-in device's {} GiB hold ({} at most)",
        o.pairs,
        o.rounds,
        FAKE_CAPACITY >> 30,
        FAKE_CAPACITY / (2 * MIB)
    );
    let work = std::env::temp_dir().join(format!("gpud-membench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    inproc::refuse_foreign_probes()?;
    let fake = Fake::start(&work.join("fake"))?;
    let cg_root = CgroupFs::discover()?.root().to_owned();
    let cg = cg_root.join(format!("gpud-membench-{}", std::process::id()));
    std::fs::create_dir_all(&cg)?;
    let _cleanup = Cleanup { cgroup: cg.clone() };
    {
        let (cg, work) = (cg.clone(), work.clone());
        inproc::on_interrupt(move || {
            clean_up(&cg);
            // The stand-in device's mount too, where its server was interrupted with us.
            gpud_tests::unmount_under(&work, None);
            let _ = std::fs::remove_dir_all(&work);
        })?;
    }
    let rel = format!("/{}", cg.file_name().unwrap_or_default().to_string_lossy());

    // Accounting overhead, cycles of: a run without probes; gpud's probes attached, a run with
    // the programs' run-time statistics on (what each program spends) and one with them off
    // (what the caller pays, as on a host that keeps them off); detached, a run without again.
    // The CPU time a pair adds is the run with probes against the mean of the two around it.
    let clock = {
        let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .context("enabling BPF run-time statistics")?;
        stats_clock_ns(o.mode).context("timing an empty program's runs")?
    };
    let mut base = Vec::new();
    let mut with = Vec::new();
    let (mut cpu_base, mut cpu_with, mut cpu_added) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_prog: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    let mut probe_ns: std::collections::BTreeMap<String, f64> = Default::default();
    let mut unfollowed_last = Default::default();
    for _ in 0..5 {
        let before_attach = alloc_free(&fake.ctl, &cg, o.pairs, o.rounds)?;
        base.push(before_attach.wall);
        let (core, _ring) = setup(&o, &fake.ctl, ReactAction::Notify, "acct")?;
        let stats_fd = aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .context("enabling BPF run-time statistics")?;
        let unfollowed = unfollowed_run_ns();
        let before = prog_stats();
        with.push(alloc_free(&fake.ctl, &cg, o.pairs, o.rounds)?.wall);
        let spent = stats_since(&before);
        drop(stats_fd);
        let attached = alloc_free(&fake.ctl, &cg, o.pairs, o.rounds)?;
        core.close(false);
        let after_detach = alloc_free(&fake.ctl, &cg, o.pairs, o.rounds)?;
        let around = (before_attach.cpu + after_detach.cpu) / 2.0;
        cpu_base.push(around);
        cpu_with.push(attached.cpu);
        cpu_added.push(attached.cpu - around);
        // Two ioctls per pair, and the client's and the device's.
        let ioctls = 2 * (o.rounds as u64 * o.pairs + 1);
        for (name, ns) in on_ioctls(&spent, ioctls, &unfollowed) {
            *probe_ns.entry(name).or_default() += ns;
        }
        unfollowed_last = unfollowed;
        for (name, (t, n)) in spent {
            let e = per_prog.entry(name).or_default();
            e.0 += t;
            e.1 += n;
        }
    }
    let (base, with) = (median(base), median(with));
    // Each alloc_free run issues client + device + rounds × pairs pairs.
    let pairs_run = 5.0 * (o.rounds as f64 * o.pairs as f64 + 1.0);
    // The ioctl programs' time during the runs; other processes' ioctls on the host (which leave
    // after the first check) are in it too, so this is an upper bound for the matched path.
    let probe_total: f64 = probe_ns.values().sum();
    let per_prog_json: serde_json::Map<String, serde_json::Value> = per_prog
        .iter()
        .filter(|(_, (_, n))| *n > 0)
        .map(|(k, (t, n))| {
            (
                k.clone(),
                json!({"runs": n, "ns_per_run": *t as f64 / *n as f64}),
            )
        })
        .collect();

    // The accounting cost's figures, which `--only-pairs` prints alone.
    let mut result = json!({
        "mode": o.mode.as_str(),
        "pairs": o.pairs,
        "rounds": o.rounds,
        "alloc_free_ns": { "without_probes": base, "with_probes": with, "added": with - base },
        "pair_cpu_ns": {
            "without_probes": median(cpu_base),
            "with_probes": median(cpu_with),
            "added": median(cpu_added.clone()),
            "added_by_cycle": cpu_added,
        },
        "probe_ns_per_pair": probe_total / pairs_run,
        // Four program runs a pair (each ioctl's entry and return), each timed with the clock.
        "probe_net_ns_per_pair": probe_total / pairs_run - 4.0 * clock,
        "stats_clock_ns_per_run": clock,
        "unfollowed_run_ns": unfollowed_last,
        "programs": per_prog_json,
    });
    if o.only_pairs {
        result["pair_breakdown"] = pair_breakdown(&o, &fake.ctl, &cg, clock)?;
        println!("BENCH JSON: {result}");
        return Ok(());
    }

    // Kill: baseline ioctl time without a limit, then with the cgroup already over its limit.
    let shared = Shared::new()?;
    let (mut core, _ring) = setup(&o, &fake.ctl, ReactAction::Kill, "kill")?;
    let (_, id) = core.attribution.id_of(&rel)?;
    let mut ioctl_ns = Vec::new();
    for _ in 0..o.samples {
        let (_, killed, took) = one_alloc(&fake.ctl, &cg, &shared)?;
        ensure!(!killed, "killed without a limit");
        ioctl_ns.push(took as f64);
    }
    core.settings.set_limit(id, gpud_common::GPU_ALL, MIB)?;
    let mut kill_ns = Vec::new();
    for _ in 0..o.samples {
        let (total, killed, _) = one_alloc(&fake.ctl, &cg, &shared)?;
        ensure!(killed, "not killed over the limit");
        kill_ns.push(total as f64);
    }
    core.settings.clear_limit(id, gpud_common::GPU_ALL)?;
    core.close(false);
    let ioctl_median = median(ioctl_ns);
    let kill_after: Vec<f64> = kill_ns.iter().map(|t| t - ioctl_median).collect();

    // Freeze: the daemon's enforcement code reacts to the ring-buffer event.
    let (mut core, mut ring) = setup(&o, &fake.ctl, ReactAction::Freeze, "freeze")?;
    let (_, id) = core.attribution.id_of(&rel)?;
    let mut freeze_ns = Vec::new();
    for _ in 0..o.samples {
        core.settings.set_limit(id, gpud_common::GPU_ALL, MIB)?;
        shared.set(0, 0);
        shared.set(1, 0);
        // SAFETY: the child issues RM calls, writes the shared page and spins until frozen,
        // thawed and told to leave.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let _ = inproc::join_cgroup(&cg);
            if let Ok(f) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&fake.ctl)
            {
                let rm = Ctl::new(&f);
                let c = rm.alloc_client().handle;
                let d = rm.alloc_device(c, 0).handle;
                let _ = rm.alloc_vidmem(c, d, 4 * MIB, Form::Nvos64);
                shared.set(0, mono_ns());
                while shared.get(1) == 0 {
                    std::hint::spin_loop();
                }
            }
            // SAFETY: leave without running destructors.
            unsafe { libc::_exit(0) };
        }
        ensure!(pid > 0, "fork failed");
        let deadline = Instant::now() + Duration::from_secs(10);
        let events = cg.join("cgroup.events");
        let frozen_at = loop {
            core.drain(&mut ring, |_| ());
            if std::fs::read_to_string(&events)
                .map(|t| t.lines().any(|l| l == "frozen 1"))
                .unwrap_or(false)
            {
                break mono_ns();
            }
            ensure!(Instant::now() < deadline, "never frozen");
        };
        let returned = shared.get(0);
        ensure!(returned != 0, "frozen before the ioctl returned?");
        freeze_ns.push(frozen_at.saturating_sub(returned) as f64);
        std::fs::write(cg.join("cgroup.freeze"), "0")?;
        shared.set(1, 1);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        core.settings.clear_limit(id, gpud_common::GPU_ALL)?;
    }
    core.close(false);

    // Where a pair's time goes: allocations and frees apart, program by program.
    let breakdown = pair_breakdown(&o, &fake.ctl, &cg, clock)?;
    // The same at a Kubernetes container's depth: the root, this cgroup (as `kubepods`), a QoS
    // class, a pod and the container, five levels that every pair charges and walks for limits.
    let levels = ["burstable", "pod", "container"];
    let deep = levels.iter().fold(cg.clone(), |at, l| at.join(l));
    std::fs::create_dir_all(&deep)?;
    let deep_breakdown = pair_breakdown(&o, &fake.ctl, &deep, clock);
    for n in (1..=levels.len()).rev() {
        let _ = std::fs::remove_dir(levels[..n].iter().fold(cg.clone(), |at, l| at.join(l)));
    }
    let deep_breakdown = deep_breakdown?;

    // The memory view: gpud's ioctl programs' time per FB_GET_INFO_V2 call.
    let (view_phases, memory_view) = memory_info_cost(&o, &fake.ctl, &cg, &rel)?;

    // The scheduler guard: gpud's ioctl programs' time per RM control.
    let (guard_phases, guard_state) = scheduler_guard_cost(&o, &fake.ctl, &cg)?;

    // The release rule's check of control files, with `holders` files held.
    let (mut core, _ring) = setup(&o, &fake.ctl, ReactAction::Notify, "files")?;
    let holders = spawn_holders(&fake.ctl, &cg, o.holders)?;
    let mut check_ns = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let released = core.attribution.release_closed_files();
        check_ns.push(t.elapsed().as_nanos() as f64);
        ensure!(released == 0, "the check released {released} held objects");
    }
    for pid in &holders {
        // SAFETY: kill(2) and waitpid(2) of our own children.
        unsafe {
            libc::kill(*pid, libc::SIGKILL);
            libc::waitpid(*pid, std::ptr::null_mut(), 0);
        }
    }
    core.close(false);
    let check_median = median(check_ns);

    drop(fake);
    let _ = std::fs::remove_dir_all(&work);

    let rest = json!({
        "samples": o.samples,
        "pair_breakdown": breakdown,
        "pair_breakdown_depth5": deep_breakdown,
        "kill_ns": {
            "ioctl_alone_median": ioctl_median,
            "added_p50": percentile(kill_after.clone(), 0.5),
            "added_p90": percentile(kill_after, 0.9),
        },
        "memory_view": memory_view,
        "memory_info_ns_per_call": view_phases,
        "scheduler_guard": guard_state,
        "scheduler_guard_ns_per_call": guard_phases,
        "file_check_ns": {
            "holders": o.holders,
            "median": check_median,
            "per_file": check_median / o.holders.max(1) as f64,
        },
        "freeze_ns": {
            "p50": percentile(freeze_ns.clone(), 0.5),
            "p90": percentile(freeze_ns.clone(), 0.9),
            "max": percentile(freeze_ns, 1.0),
        },
    });
    if let (Some(all), serde_json::Value::Object(rest)) = (result.as_object_mut(), rest) {
        all.extend(rest);
    }
    println!("BENCH JSON: {result}");
    Ok(())
}
