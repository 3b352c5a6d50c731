//! `gpud-bench --mode tracepoint|fentry [--hook none|lsm|fmod_ret[,…]] [--calls N] [--rounds R]
//! [--cycles C]`: the added cost per syscall of
//! gpud's probes, measured in one run (run by `cargo xtask bench`; method in docs/benchmarks.md).
//!
//! Three phases in one process tree, alternated C times: no program attached; a no-op reference
//! program on the same ioctl hooks as gpud (entry and return: the raw `sys_enter` and `sys_exit`
//! tracepoints, which every system call passes, or fentry on `security_file_ioctl` and fexit on
//! the ioctl syscall); gpud's
//! probes attached in the given mode. Differences are taken within each cycle and the median over
//! cycles is reported. In each phase, four workloads run in fresh forked children, R rounds of N
//! calls each, fastest round:
//! - `unrelated_ioctl`: ioctls (`TCGETS`) on /dev/null by a process holding no NVIDIA file;
//! - `unrelated_nv_ioctl`: the same with an NVIDIA escape's encoding (`_IOC_TYPE` 'F'), which
//!   tracepoint mode follows to the file even from untracked processes (a received NVIDIA file
//!   is found at its first call);
//! - `getppid`: a cheap non-ioctl syscall (the host-wide tax of syscall tracepoints);
//! - `matched_ioctl`: ioctls on a stand-in control device (listed as an extra device file) by a
//!   process that opened it, so gpud walks, identifies, classifies and counts each one;
//! - `compat_matched_ioctl`: the same ioctls as a 32-bit process makes them (the compat entry,
//!   `int 0x80`, with the buffer below 4 GiB), from this 64-bit process: what gpud adds to the
//!   ioctls of 32-bit callers (x86-64; `null` where the kernel has no IA32 emulation);
//! - `control_node_ioctl` (tracepoint mode only): the same ioctls on an `O_PATH` descriptor of a
//!   device node with the control device's numbers (195:255). The kernel refuses an ioctl on such
//!   a descriptor before any driver or LSM hook, but tracepoint mode's entry has identified the
//!   file by then, as it identifies `/dev/nvidiactl` (its device number), without what
//!   identifying the stand-in costs (the configuration, three kernel reads, `EXTRA_FILES`).
//!   `matched_ioctl` less this, each against `detached`, is what the stand-in adds to a call.
//!
//! Prints one line `BENCH JSON: {...}` per hook named (several hooks share one boot of the VM).

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::Context as _;
use aya::programs::FExit;
use clap::Parser;
use gpud::{
    config::DenyHookPreference,
    probes::{self, AttachMode},
    report::Chain,
};
use gpud_common::{nv, programs};
use gpud_tests::{TestConfig, inproc};
use serde_json::{Value, json};

const RM_ALLOC: u32 = 0xc030_462b;

/// The added cost per syscall of gpud's probes; prints one `BENCH JSON: {…}` line.
#[derive(Parser)]
#[command(name = "gpud-bench")]
struct Opts {
    /// How gpud's probes attach: tracepoint or fentry.
    #[arg(long, default_value = "tracepoint", value_parser = inproc::attach_mode)]
    mode: AttachMode,
    /// Calls per round.
    #[arg(long, default_value_t = 200_000)]
    calls: u64,
    /// Rounds per workload and phase (the fastest counts).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Alternations of the three phases (the median counts).
    #[arg(long, default_value_t = 5)]
    cycles: usize,
    /// The pre-driver hook in gpud's phase: `none` (the react tier: fentry or tracepoint
    /// programs only), `lsm` or `fmod_ret` (the deny tier through that hook; fentry mode).
    /// Several, comma-separated, are measured one after another, a result line each.
    #[arg(long, default_value = "none", value_parser = hook, value_delimiter = ',')]
    hook: Vec<DenyHookPreference>,
}

fn hook(s: &str) -> Result<DenyHookPreference, String> {
    match s {
        "none" => Ok(DenyHookPreference::None),
        "lsm" => Ok(DenyHookPreference::Lsm),
        "fmod_ret" => Ok(DenyHookPreference::FmodRet),
        _ => Err("none, lsm or fmod_ret".to_owned()),
    }
}

/// Fastest ns per call of `f(n)` over `rounds`, measured in a fresh child process. `f` fails
/// when its workload cannot run (its file cannot be opened): the benchmark then fails instead of
/// timing a loop that does nothing.
fn measure(
    name: &str,
    rounds: usize,
    calls: u64,
    f: impl Fn(u64) -> std::io::Result<()>,
) -> anyhow::Result<f64> {
    let report = inproc::in_child(move || {
        pin_to_cpu(0);
        if let Err(e) = f(calls / 10) {
            return format!("error: {e}");
        }
        let mut samples = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t = Instant::now();
            if let Err(e) = f(calls) {
                return format!("error: {e}");
            }
            samples.push(t.elapsed().as_nanos() as f64 / calls as f64);
        }
        samples.sort_by(f64::total_cmp);
        // The fastest round: the least disturbed by the rest of the machine (interrupts,
        // emulator housekeeping under qemu); each phase gets the same treatment.
        samples
            .first()
            .map_or_else(|| "error: no rounds".to_owned(), f64::to_string)
    })?;
    if let Some(error) = report.strip_prefix("error: ") {
        anyhow::bail!("workload {name}: {error}");
    }
    report
        .parse()
        .with_context(|| format!("workload {name}: the child reported {report:?}"))
}

/// Pins the calling process to one CPU, so every phase is measured on the same core.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// `path` opened for reading; an error names it.
fn open_named(path: &Path) -> std::io::Result<std::fs::File> {
    open_with(path, 0)
}

/// `path` opened for reading with the extra open `flags`; an error names it.
fn open_with(path: &Path, flags: i32) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// `n` ioctls `cmd` on a freshly opened `path`.
fn ioctls_on(path: &Path, cmd: u32, n: u64) -> std::io::Result<()> {
    let f = open_named(path)?;
    inproc::issue(inproc::fd(&f), cmd, n);
    Ok(())
}

/// `n` 32-bit ioctls `cmd` on a freshly opened `path`, through the i386 entry (`int 0x80`, as a
/// 32-bit process enters the kernel), with a buffer below 4 GiB as such a process has.
#[cfg(target_arch = "x86_64")]
fn compat_ioctls_on(path: &Path, cmd: u32, n: u64) -> std::io::Result<()> {
    use gpud_tests::ia32;
    let f = open_named(path)?;
    let buf = ia32::LowPage::new()?;
    let fd = inproc::fd(&f) as u32;
    for _ in 0..n {
        // SAFETY: the i386 ioctl(fd, cmd, arg) on our own descriptor and page.
        let ret = unsafe { ia32::syscall3(ia32::NR_IOCTL, fd, cmd, buf.addr()) };
        // -ENOSYS: no IA32 emulation in this kernel.
        if ret == -libc::ENOSYS {
            return Err(std::io::Error::from_raw_os_error(libc::ENOSYS));
        }
    }
    Ok(())
}

/// `n` ioctls `cmd` on an `O_PATH` descriptor of the device node `node`.
fn path_ioctls_on(node: &Path, cmd: u32, n: u64) -> std::io::Result<()> {
    let f = open_with(node, libc::O_PATH)?;
    inproc::issue(inproc::fd(&f), cmd, n);
    Ok(())
}

/// A character device node at `path` with the NVIDIA control device's numbers, for
/// `control_node_ioctl` (only ever opened `O_PATH`: no driver is reached through it).
fn make_control_node(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let dev = libc::makedev(nv::NV_MAJOR, nv::NV_CTL_MINOR);
    // SAFETY: a NUL-terminated path and plain values.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, dev) } != 0 {
        let e = std::io::Error::last_os_error();
        anyhow::bail!("cannot make the device node {}: {e}", path.display());
    }
    Ok(())
}

/// The workloads' files: the stand-in control device, and (tracepoint mode) the device node.
struct Files {
    standin: PathBuf,
    node: Option<PathBuf>,
}

fn workloads(o: &Opts, files: &Files) -> anyhow::Result<Value> {
    let standin = files.standin.as_path();
    let null = Path::new("/dev/null");
    let unrelated = measure("unrelated_ioctl", o.rounds, o.calls, |n| {
        ioctls_on(null, libc::TCGETS as u32, n)
    })?;
    let unrelated_nv = measure("unrelated_nv_ioctl", o.rounds, o.calls, |n| {
        ioctls_on(null, RM_ALLOC, n)
    })?;
    let getppid = measure("getppid", o.rounds, o.calls, |n| {
        for _ in 0..n {
            // SAFETY: a syscall without arguments.
            unsafe { libc::syscall(libc::SYS_getppid) };
        }
        Ok(())
    })?;
    let matched = measure("matched_ioctl", o.rounds, o.calls, |n| {
        ioctls_on(standin, RM_ALLOC, n)
    })?;
    #[cfg(target_arch = "x86_64")]
    let compat = measure("compat_matched_ioctl", o.rounds, o.calls, |n| {
        compat_ioctls_on(standin, RM_ALLOC, n)
    })?;
    #[cfg(not(target_arch = "x86_64"))]
    let compat = f64::NAN;
    let mut out = json!({
        "unrelated_ioctl": unrelated,
        "unrelated_nv_ioctl": unrelated_nv,
        "getppid": getppid,
        "matched_ioctl": matched,
        "compat_matched_ioctl": compat,
    });
    if let Some(node) = &files.node {
        out[CONTROL_NODE] = json!(measure(CONTROL_NODE, o.rounds, o.calls, |n| {
            path_ioctls_on(node, RM_ALLOC, n)
        })?);
    }
    Ok(out)
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Where the reference phase pins its programs' maps.
fn noop_pins(bpffs: &Path) -> PathBuf {
    bpffs.join(format!("gpud-bench-noop-{}", std::process::id()))
}

/// Where gpud's phase pins its probes.
fn daemon_pins(bpffs: &Path) -> PathBuf {
    bpffs.join(format!("gpud-bench-{}", std::process::id()))
}

/// gpud's phase's state directory.
fn daemon_dir() -> PathBuf {
    std::env::temp_dir().join(format!("gpud-bench-{}-daemon", std::process::id()))
}

fn noop_phase(o: &Opts, files: &Files, bpffs: &Path) -> anyhow::Result<Value> {
    let pins = noop_pins(bpffs);
    std::fs::create_dir_all(&pins)?;
    let (mut ebpf, btf) = inproc::reference_object(&pins)?;
    // Both raw sides, as gpud attaches them where it follows 32-bit callers (the default): the
    // reference pays the same two hooks, on every system call.
    inproc::attach_noop_entry(&mut ebpf, &btf, o.mode, &["sys_enter", "sys_exit"])?;
    if o.mode == AttachMode::Fentry {
        // And the return side where fentry mode has its own.
        let p: &mut FExit = ebpf
            .program_mut(programs::NOOP_FEXIT)
            .context(programs::NOOP_FEXIT)?
            .try_into()?;
        p.load(probes::SYS_IOCTL.0, &btf)?;
        p.attach()?;
    }
    let r = workloads(o, files);
    drop(ebpf);
    let _ = std::fs::remove_dir_all(&pins);
    r
}

fn gpud_phase(
    o: &Opts,
    hook: DenyHookPreference,
    files: &Files,
    bpffs: &Path,
) -> anyhow::Result<Value> {
    // The daemon's own kernel stack (gpud::daemon::core::open), its pins and state apart: a
    // directory of its own, removed after the phase (not the one holding the stand-in, which
    // the next cycles still use).
    let dir = daemon_dir();
    let pins = daemon_pins(bpffs);
    let tier = if hook == DenyHookPreference::None {
        "react"
    } else {
        "deny"
    };
    let config = TestConfig::new(&dir)
        .extra_paths([&files.standin])
        .nvml_off()
        .react_action("notify")
        .set_path("probes.bpffs", &pins)
        .set("probes.attach", o.mode.as_str())
        .set("enforcement.tier", tier)
        .set("enforcement.deny_hook", hook.as_str())
        .parsed();
    let opened = gpud::daemon::core::open(&config).map_err(|e| anyhow::anyhow!("{}", Chain(&e)))?;
    let ladder = opened.core.probes.ladder();
    // The probes are closed (unpinned) whatever happened, or they would stay attached.
    let r = if ladder.in_force.as_str() == hook.as_str() {
        workloads(o, files)
    } else {
        Err(anyhow::anyhow!("hook in force: {ladder:?}"))
    };
    opened.core.close(false);
    let _ = std::fs::remove_dir_all(&pins);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

const KEYS: [&str; 6] = [
    "unrelated_ioctl",
    "unrelated_nv_ioctl",
    "getppid",
    "matched_ioctl",
    "compat_matched_ioctl",
    CONTROL_NODE,
];

const CONTROL_NODE: &str = "control_node_ioctl";

/// The workloads measured: `control_node_ioctl` only with its node (tracepoint mode; fentry
/// mode never sees its calls).
fn keys(files: &Files) -> impl Iterator<Item = &'static str> {
    let node = files.node.is_some();
    KEYS.into_iter().filter(move |k| node || *k != CONTROL_NODE)
}

/// Per-workload median over the cycles.
fn median_of(files: &Files, samples: &[Value]) -> Value {
    let mut out = serde_json::Map::new();
    for k in keys(files) {
        let mut v: Vec<f64> = samples.iter().filter_map(|s| s[k].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        out.insert(
            k.into(),
            json!(v.get(v.len() / 2).copied().unwrap_or(f64::NAN)),
        );
    }
    Value::Object(out)
}

fn main() -> anyhow::Result<()> {
    let o = Opts::parse();
    let work = std::env::temp_dir().join(format!("gpud-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let standin = work.join("nvidiactl");
    std::fs::write(&standin, b"")?;
    let node = (o.mode == AttachMode::Tracepoint).then(|| work.join("control-node"));
    if let Some(node) = &node {
        make_control_node(node)?;
    }
    let files = Files { standin, node };
    let bpffs = PathBuf::from("/sys/fs/bpf");
    probes::ensure_mounted(&bpffs, "bpf", probes::BPF_FS_MAGIC)?;
    {
        // The phases' pins (gpud's probes, the reference programs) are what an interrupted run
        // would leave attached to every process on the host.
        let made = [
            daemon_pins(&bpffs),
            noop_pins(&bpffs),
            daemon_dir(),
            work.clone(),
        ];
        inproc::on_interrupt(move || {
            for dir in &made {
                let _ = std::fs::remove_dir_all(dir);
            }
        })?;
    }
    // The reference programs attach before gpud's probes would mount tracefs (a fresh machine
    // may not have it mounted).
    probes::ensure_mounted(Path::new(probes::TRACEFS), "tracefs", probes::TRACEFS_MAGIC)?;
    inproc::refuse_foreign_probes()?;
    let results: anyhow::Result<Vec<Value>> = o
        .hook
        .iter()
        .map(|&hook| one_hook(&o, hook, &files, &bpffs))
        .collect();
    let _ = std::fs::remove_dir_all(&work);
    for result in results? {
        println!("BENCH JSON: {result}");
    }
    Ok(())
}

/// The three phases, alternated `o.cycles` times, with `hook` in gpud's phase.
fn one_hook(
    o: &Opts,
    hook: DenyHookPreference,
    files: &Files,
    bpffs: &Path,
) -> anyhow::Result<Value> {
    // Phases alternate, and differences are taken within each cycle (phases minutes apart
    // would otherwise compare different states of a shared machine); medians over cycles.
    let (mut detached, mut noop, mut attached) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..o.cycles {
        detached.push(workloads(o, files)?);
        noop.push(noop_phase(o, files, bpffs)?);
        attached.push(gpud_phase(o, hook, files, bpffs)?);
    }
    let v = |phase: &Value, k: &str| phase[k].as_f64().unwrap_or(f64::NAN);
    let per_cycle = |f: &dyn Fn(usize, &str) -> f64| {
        let mut out = serde_json::Map::new();
        for k in keys(files) {
            let mut xs: Vec<f64> = (0..o.cycles).map(|c| f(c, k)).collect();
            xs.sort_by(f64::total_cmp);
            out.insert(
                k.into(),
                json!(xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)),
            );
        }
        Value::Object(out)
    };
    let added = per_cycle(&|c, k| v(&attached[c], k) - v(&detached[c], k));
    let over_noop = per_cycle(&|c, k| v(&attached[c], k) - v(&noop[c], k));
    let noop_added = per_cycle(&|c, k| v(&noop[c], k) - v(&detached[c], k));
    let ratio = per_cycle(&|c, k| v(&attached[c], k) / v(&detached[c], k));
    let (detached, noop, attached) = (
        median_of(files, &detached),
        median_of(files, &noop),
        median_of(files, &attached),
    );
    Ok(json!({
        "mode": o.mode.as_str(),
        "hook": hook.as_str(),
        "kernel": kernel_release(),
        "calls_per_round": o.calls,
        "rounds": o.rounds,
        "cycles": o.cycles,
        "ns_per_call": {
            "detached": detached,
            "noop_program": noop,
            "gpud": attached,
        },
        "added_ns_vs_detached": added,
        "added_ns_vs_noop_program": over_noop,
        "noop_program_added_ns": noop_added,
        "ratio_vs_detached": ratio,
    }))
}
