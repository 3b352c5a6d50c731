//! Boots Debian's kernel (6.1: BPF-LSM and fentry available) under qemu TCG with a busybox
//! initramfs that runs one binary, and returns the serial console output.
//!
//! The development and CI machines run a kernel that refuses BPF trampolines, so this VM is where
//! fentry and BPF-LSM are exercised. KVM is unusable there: this is software emulation, so keep
//! what runs inside short.

use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::util::{describe, root, sh_quote, which};

/// The line the init script prints after the binary exits, followed by its exit status.
const EXIT_MARK: &str = "VM EXIT CODE: ";
/// The line the init script prints once everything is mounted, followed by the kernel release.
const BOOT_MARK: &str = "VM BOOTED: ";

/// Kernel command line: serial console, a panic powers the VM off at once (`-no-reboot`)
/// instead of hanging until the timeout; the LSM list and lockdown are the row's ([`Boot`]).
const CMDLINE: &str = "console=ttyS0 panic=-1 quiet loglevel=3";

/// How the kernel is booted: the rows of the kernel matrix that differ by command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Boot {
    /// BPF last in the LSM list (Debian's default list lacks it).
    Debian,
    /// Ubuntu 22.04/24.04's default LSM list: no `bpf`.
    Ubuntu,
    /// Ubuntu's list under Secure Boot: `lockdown=integrity`.
    UbuntuLockdown,
}

impl Boot {
    /// From its name on the command line.
    pub fn parse(name: &str) -> anyhow::Result<Self> {
        match name {
            "debian" => Ok(Self::Debian),
            "ubuntu" => Ok(Self::Ubuntu),
            "ubuntu-secure-boot" => Ok(Self::UbuntuLockdown),
            other => bail!("--boot {other}: expected debian, ubuntu or ubuntu-secure-boot"),
        }
    }

    fn cmdline(self) -> String {
        let extra = match self {
            // x32, which Debian's kernel builds and leaves off, on: its callers are checked too.
            Self::Debian => "lsm=lockdown,capability,landlock,yama,apparmor,bpf syscall.x32=y",
            Self::Ubuntu => "lsm=lockdown,capability,landlock,yama,apparmor",
            Self::UbuntuLockdown => {
                "lsm=lockdown,capability,landlock,yama,apparmor lockdown=integrity"
            }
        };
        format!("{CMDLINE} {extra}")
    }
}

/// Kernel features the payloads use that Debian builds as modules: config option, module name.
/// Each is put into the image (with its dependencies) and loaded when the option is `=m`.
const MODULES: &[(&str, &str)] = &[("CONFIG_FUSE_FS", "fuse")];

/// Which kernel a VM boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSource {
    /// The newest Debian kernel installed on this machine (`/boot`, linux-image-amd64).
    Installed,
    /// The newest kernel Debian ships (sid), unpacked by setup under
    /// [`crate::setup::SID_KERNEL_PREFIX`].
    Sid,
}

impl KernelSource {
    /// From its name on the command line.
    pub fn parse(name: &str) -> anyhow::Result<Self> {
        match name {
            "installed" => Ok(Self::Installed),
            "sid" => Ok(Self::Sid),
            other => bail!("--kernel {other}: expected installed or sid"),
        }
    }
}

/// A kernel to boot: its release string, image, modules directory and build configuration.
struct Kernel {
    release: String,
    image: PathBuf,
    modules: PathBuf,
    config: PathBuf,
    /// qemu's `-accel`: multi-threaded TCG (a host thread per vCPU), except for sid's kernel
    /// (see [`SID_ACCEL`]).
    accel: &'static str,
}

/// Sid's 7.2 takes stray `int3` oopses under multi-threaded TCG where it patches its own text
/// while the other vCPU runs it (early in boot, in the scheduler's clock; when syscall
/// tracepoints detach; docs/design.md, the kernel matrix): a breakpoint the patching left for
/// an instant is executed after it is gone. One host thread running both vCPUs in turn
/// leaves no instant in which one vCPU runs code the other is rewriting; the guest still has
/// two CPUs.
const SID_ACCEL: &str = "tcg,thread=single";

impl Kernel {
    fn of(source: KernelSource) -> anyhow::Result<Self> {
        match source {
            KernelSource::Installed => kernel(),
            KernelSource::Sid => {
                let release = crate::setup::sid_kernel_release().with_context(|| {
                    format!(
                        "vm: no sid kernel under {}: run `cargo xtask setup`",
                        crate::setup::SID_KERNEL_PREFIX
                    )
                })?;
                let modules = Path::new(crate::setup::SID_KERNEL_PREFIX)
                    .join("usr/lib/modules")
                    .join(&release);
                Ok(Self {
                    image: modules.join("vmlinuz"),
                    config: modules.join("config"),
                    release,
                    modules,
                    accel: SID_ACCEL,
                })
            }
        }
    }
}

/// Splits a release such as `6.1.0-56-amd64` into numbers and words, so that `-56` sorts after
/// `-9`.
fn version_key(release: &str) -> Vec<(u64, String)> {
    let mut key = Vec::new();
    let mut rest = release;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits > 0 {
            key.push((rest[..digits].parse().unwrap_or(u64::MAX), String::new()));
            rest = &rest[digits..];
        } else {
            let word = rest
                .find(|c: char| c.is_ascii_digit())
                .unwrap_or(rest.len());
            key.push((0, rest[..word].to_owned()));
            rest = &rest[word..];
        }
    }
    key
}

/// The newest `/boot/vmlinuz-*` that has its `/lib/modules/<release>` (Debian's
/// linux-image-amd64) and is not the running kernel (the host's Firecracker kernel).
fn kernel() -> anyhow::Result<Kernel> {
    let running = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut kernels: Vec<Kernel> = std::fs::read_dir("/boot")
        .context("vm: reading /boot")?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let release = name.strip_prefix("vmlinuz-")?.to_owned();
            let usable =
                release != running.trim() && Path::new("/lib/modules").join(&release).is_dir();
            usable.then(|| Kernel {
                modules: Path::new("/lib/modules").join(&release),
                config: PathBuf::from(format!("/boot/config-{release}")),
                release,
                image: entry.path(),
                accel: "tcg",
            })
        })
        .collect();
    kernels.sort_by_cached_key(|k| version_key(&k.release));
    kernels.pop().context(
        "vm: no /boot/vmlinuz-* with its /lib/modules: install linux-image-amd64 \
         (`cargo xtask setup`)",
    )
}

/// Shared libraries `ldd` lists for `binary`, the dynamic loader included; none if static.
fn libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("vm: cannot run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if text.contains("not a dynamic executable")
            || String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!(
            "vm: ldd {} failed ({})",
            binary.display(),
            describe(out.status)
        );
    }
    // Lines: `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)`, `/lib64/ld-linux-x86-64.so.2
    // (0x…)` and `linux-vdso.so.1 (0x…)` (no file).
    Ok(text
        .lines()
        .filter_map(|l| {
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// Copies `src` into `tree` at the same absolute path (following symlinks).
fn copy_into(tree: &Path, src: &Path) -> anyhow::Result<()> {
    let dst = tree.join(src.strip_prefix("/").unwrap_or(src));
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::copy(src, &dst).with_context(|| format!("vm: copying {}", src.display()))?;
    Ok(())
}

/// Modules to load for `kernel`, dependencies first, as paths relative to its modules directory.
fn modules(kernel: &Kernel) -> anyhow::Result<Vec<String>> {
    let config = std::fs::read_to_string(&kernel.config).unwrap_or_default();
    let wanted: Vec<&str> = MODULES
        .iter()
        .filter(|(option, _)| config.lines().any(|l| l == format!("{option}=m")))
        .map(|(_, module)| *module)
        .collect();
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let dir = &kernel.modules;
    let dep = std::fs::read_to_string(dir.join("modules.dep"))
        .with_context(|| format!("vm: reading {}/modules.dep", dir.display()))?;
    // `kernel/fs/fuse/fuse.ko: dep.ko …`, keyed by the module's name (`fuse`).
    let deps: Vec<(&str, Vec<&str>)> = dep
        .lines()
        .filter_map(|l| {
            let (module, rest) = l.split_once(':')?;
            Some((module, rest.split_whitespace().collect()))
        })
        .collect();
    let name_of = |path: &str| {
        let file = path.rsplit('/').next().unwrap_or(path);
        file.split(".ko").next().unwrap_or(file).replace('-', "_")
    };
    // Depth-first, dependencies before dependants.
    fn visit<'a>(
        path: &'a str,
        deps: &[(&'a str, Vec<&'a str>)],
        seen: &mut BTreeSet<&'a str>,
        order: &mut Vec<String>,
    ) {
        if !seen.insert(path) {
            return;
        }
        if let Some((_, ds)) = deps.iter().find(|(m, _)| *m == path) {
            for d in ds {
                visit(d, deps, seen, order);
            }
        }
        order.push(path.to_owned());
    }
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for module in wanted {
        let (path, _) = deps
            .iter()
            .find(|(m, _)| name_of(m) == module.replace('-', "_"))
            .with_context(|| format!("vm: module {module} is not in {}", dir.display()))?;
        visit(path, &deps, &mut seen, &mut order);
    }
    Ok(order)
}

/// Puts module `rel` (relative to the kernel's modules directory) into `tree` as
/// `/lib/modules/<name>.ko`, decompressed (busybox insmod takes plain objects); returns that path.
fn add_module(tree: &Path, kernel: &Kernel, rel: &str) -> anyhow::Result<String> {
    let src = kernel.modules.join(rel);
    let file = rel.rsplit('/').next().unwrap_or(rel);
    let (stem, decompressor) = if let Some(s) = file.strip_suffix(".ko.xz") {
        (s, Some("xz"))
    } else if let Some(s) = file.strip_suffix(".ko.zst") {
        (s, Some("zstd"))
    } else if let Some(s) = file.strip_suffix(".ko.gz") {
        (s, Some("gzip"))
    } else {
        (file.strip_suffix(".ko").unwrap_or(file), None)
    };
    let inside = format!("/lib/modules/{stem}.ko");
    let dst = tree.join(inside.trim_start_matches('/'));
    std::fs::create_dir_all(tree.join("lib/modules"))?;
    match decompressor {
        None => {
            std::fs::copy(&src, &dst).with_context(|| format!("vm: copying {}", src.display()))?;
        }
        Some(tool) => {
            let file = std::fs::File::create(&dst)?;
            let status = Command::new(tool)
                .arg("-dc")
                .arg(&src)
                .stdout(file)
                .status()
                .with_context(|| format!("vm: cannot run {tool}"))?;
            if !status.success() {
                bail!(
                    "vm: {tool} -dc {} failed ({})",
                    src.display(),
                    describe(status)
                );
            }
        }
    }
    Ok(inside)
}

/// The init script: mount what BPF and cgroup code expects, load modules, run the payload, report
/// its exit status, power off.
fn init_script(kernel: &Kernel, modules: &[String], payload: &str, args: &[String]) -> String {
    let insmods: String = modules
        .iter()
        .map(|m| format!("insmod {m} || echo \"VM: insmod {m} failed\"\n"))
        .collect();
    let args: Vec<String> = args.iter().map(|a| sh_quote(a)).collect();
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /tmp /run
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t securityfs securityfs /sys/kernel/security
mount -t bpf bpf /sys/fs/bpf
mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
{insmods}echo "{BOOT_MARK}$(uname -r) (expected {release}), lsm=$(cat /sys/kernel/security/lsm)"
export RUST_BACKTRACE=1 RUST_LOG=info
cd /tmp
{payload} {args}
echo "{EXIT_MARK}$?"
poweroff -f
"#,
        release = kernel.release,
        args = args.join(" "),
    )
}

/// Builds `target/vm/<name>.cpio.gz`: busybox, the binary at `/bin/<name>` with its shared
/// libraries at their own paths, the modules, and `/init`.
fn initramfs(kernel: &Kernel, binary: &Path, args: &[String]) -> anyhow::Result<PathBuf> {
    let name = binary
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("vm: {} has no usable file name", binary.display()))?;
    let work = root().join("target/vm");
    let tree = work.join(name);
    if tree.exists() {
        std::fs::remove_dir_all(&tree)
            .with_context(|| format!("vm: clearing {}", tree.display()))?;
    }
    std::fs::create_dir_all(tree.join("bin"))?;

    let busybox = Path::new("/bin/busybox");
    if !busybox.exists() {
        bail!("vm: /bin/busybox missing: install busybox-static (`cargo xtask setup`)");
    }
    std::fs::copy(busybox, tree.join("bin/busybox")).context("vm: copying busybox")?;
    std::fs::copy(binary, tree.join("bin").join(name))
        .with_context(|| format!("vm: copying {}", binary.display()))?;
    for lib in libraries(binary)? {
        copy_into(&tree, &lib)?;
    }
    let modules = modules(kernel)?
        .iter()
        .map(|m| add_module(&tree, kernel, m))
        .collect::<anyhow::Result<Vec<_>>>()?;

    let init = tree.join("init");
    std::fs::write(
        &init,
        init_script(kernel, &modules, &format!("/bin/{name}"), args),
    )?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755))?;

    if which("cpio").is_none() {
        bail!("vm: cpio missing: install it (`cargo xtask setup`)");
    }
    let image = work.join(format!("{name}.cpio.gz"));
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "set -e; cd {}; find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet \
             | gzip -1 > {}",
            sh_quote(&tree.display().to_string()),
            sh_quote(&image.display().to_string())
        ))
        .status()
        .context("vm: cannot run sh to pack the initramfs")?;
    if !status.success() {
        bail!("vm: packing the initramfs failed ({})", describe(status));
    }
    Ok(image)
}

/// `line` without terminal escape sequences (the firmware clears the screen) and other control
/// characters but tabs and line ends.
fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            // CSI: ESC [ parameters… final byte (a letter).
            '\x1b' => {
                if chars.next() == Some('[') {
                    for c in chars.by_ref() {
                        if c.is_ascii_alphabetic() {
                            break;
                        }
                    }
                }
            }
            '\t' | '\r' | '\n' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// Boots the VM running `binary args…` and returns the console output when the binary exited 0;
/// fails on any other status or when `timeout` passes (qemu is killed).
/// The console is echoed as it comes, each line prefixed with `vm| `.
pub fn run(binary: &Path, args: &[String], timeout: Duration) -> anyhow::Result<String> {
    run_booted(binary, args, timeout, Boot::Debian, KernelSource::Installed)
}

/// [`run`] with `source`'s kernel booted as `boot` says.
pub fn run_booted(
    binary: &Path,
    args: &[String],
    timeout: Duration,
    boot_as: Boot,
    source: KernelSource,
) -> anyhow::Result<String> {
    let kernel = Kernel::of(source)?;
    let image = initramfs(&kernel, binary, args)?;
    println!(
        "vm: booting {} ({boot_as:?}) with {} ({} MiB initramfs)",
        kernel.image.display(),
        binary.display(),
        std::fs::metadata(&image).map_or(0, |m| m.len() >> 20)
    );
    let mut attempt = 1;
    loop {
        match boot(&kernel, &image, binary, timeout, &boot_as.cmdline())? {
            Ok(console) => return Ok(console),
            Err(why) if attempt < BOOT_ATTEMPTS => {
                println!("vm: {why} (attempt {attempt} of {BOOT_ATTEMPTS}); booting again");
                attempt += 1;
            }
            Err(why) => bail!(
                "vm: the kernel did not reach init in {BOOT_ATTEMPTS} boots, the last: {why} \
                 (console above)"
            ),
        }
    }
}

/// Whether a boot's console shows the init script running (its [`BOOT_MARK`] line): a boot
/// that ended without it never ran the binary, and is booted again.
fn reached_init(console: &str) -> bool {
    console.lines().any(|l| l.contains(BOOT_MARK))
}

/// The kernel reaches the init script in about 5–10 s under TCG; an emulated boot that has not
/// after this long has hung (seen rarely, early in boot) and is retried.
const BOOT_DEADLINE: Duration = Duration::from_secs(120);
const BOOT_ATTEMPTS: u32 = 3;

/// One boot. `Err(why)` when the kernel never reached init (hung, or died early in boot: sid's
/// 7.2 kernel took a stray int3 about one boot in ten under multi-threaded TCG, in the scheduler's
/// clock while it patches its own text, before any of gpud's code has run); those are booted
/// again. Otherwise the console when the binary exited 0, or an error: a crash once init has
/// run is the test's and is never retried.
fn boot(
    kernel: &Kernel,
    image: &Path,
    binary: &Path,
    timeout: Duration,
    cmdline: &str,
) -> anyhow::Result<Result<String, String>> {
    let started = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            kernel.accel,
            "-cpu",
            "max",
            "-m",
            "1024",
            "-smp",
            "2",
        ])
        .args(["-nographic", "-no-reboot", "-kernel"])
        .arg(&kernel.image)
        .arg("-initrd")
        .arg(image)
        .arg("-append")
        .arg(cmdline)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("vm: cannot start qemu-system-x86_64 (install qemu-system-x86)")?;

    // Echo and collect the console on a thread; report when the boot mark passes.
    let stdout = child.stdout.take().context("vm: qemu stdout")?;
    let (booted_tx, booted_rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut console = String::new();
        let mut reader = BufReader::new(stdout);
        let mut buf = Vec::new();
        while reader.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
            let line = strip_escapes(&String::from_utf8_lossy(&buf));
            let line = line.trim_end_matches(['\r', '\n']);
            println!("vm| {line}");
            if line.contains(BOOT_MARK) {
                let _ = booted_tx.send(());
            }
            console.push_str(line);
            console.push('\n');
            buf.clear();
        }
        console
    });

    let mut boot_time = None;
    let status = loop {
        if boot_time.is_none() && booted_rx.try_recv().is_ok() {
            boot_time = Some(started.elapsed());
        }
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if boot_time.is_none() && started.elapsed() > BOOT_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            let _ = reader.join();
            return Ok(Err(format!(
                "the kernel did not reach init within {}s",
                BOOT_DEADLINE.as_secs()
            )));
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            let _ = reader.join();
            bail!("vm: no power-off within {timeout:?} (console above)");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let console = reader.join().unwrap_or_default();
    if !reached_init(&console) {
        return Ok(Err(format!(
            "the kernel stopped before init ({}, after {:.1}s){}",
            describe(status),
            started.elapsed().as_secs_f64(),
            crash_digest(&console)
        )));
    }
    let code = console
        .lines()
        .find_map(|l| l.trim().strip_prefix(EXIT_MARK))
        .and_then(|c| c.trim().parse::<i32>().ok());
    let boot = boot_time.map_or_else(|| "?".to_owned(), |t| format!("{:.1}s", t.as_secs_f64()));
    println!(
        "vm: {} exited with {} (boot {boot}, total {:.1}s, qemu {})",
        binary.display(),
        code.map_or_else(|| "?".to_owned(), |c| c.to_string()),
        started.elapsed().as_secs_f64(),
        describe(status)
    );
    match code {
        Some(0) => Ok(Ok(console)),
        Some(c) => bail!(
            "vm: {} exited with {c}{} (console above)",
            binary.display(),
            crash_digest(&console)
        ),
        None => bail!(
            "vm: {} did not finish{} (console above)",
            binary.display(),
            match crash_digest(&console) {
                d if d.is_empty() => ": kernel panic or crash?".to_owned(),
                d => d,
            }
        ),
    }
}

/// The kernel's own words for a crash, from a console: its first oops, BUG or panic line and the
/// function it was in (the first `RIP:` line after it), as `: Oops: int3 …; RIP: 0010:
/// trace_syscall_enter+0x…`; empty when the console shows none. A failed run's error carries it, so that a summary far below the console
/// still says whether the kernel or the test failed.
fn crash_digest(console: &str) -> String {
    const MARKS: [&str; 5] = [
        "Oops:",
        "BUG:",
        "kernel BUG",
        "Kernel panic",
        "general protection",
    ];
    let text = |l: &str| {
        // Drop the `[   12.345678] ` time stamp.
        let l = l.trim();
        l.strip_prefix('[')
            .and_then(|r| r.split_once("] "))
            .map_or(l, |(_, rest)| rest)
            .trim()
            .to_owned()
    };
    let mut lines = console.lines();
    let Some(first) = lines
        .by_ref()
        .find(|l| MARKS.iter().any(|m| l.contains(m)))
        .map(text)
    else {
        return String::new();
    };
    match lines.find(|l| l.contains("RIP: ")).map(text) {
        Some(rip) => format!(": {first}; {rip}"),
        None => format!(": {first}"),
    }
}

#[cfg(test)]
mod tests {
    use super::version_key;

    #[test]
    fn escapes_are_stripped() {
        assert_eq!(
            super::strip_escapes("\x1bc\x1b[?7l\x1b[2JVM BOOTED: 6.1\r\n"),
            "VM BOOTED: 6.1\r\n"
        );
    }

    /// A boot that crashed before init (sid's 7.2 under TCG, 2026-11-30: the lines around the
    /// panic) is retried; one whose binary ran and then crashed is not.
    #[test]
    fn only_a_boot_that_stopped_before_init_is_retried() {
        let before_init = "\
[    1.329351] Oops: int3: 0000 [#1] SMP NOPTI
[    1.330562] RSP: 0018:ff77190c000f0e70 EFLAGS: 00000082
[    1.331828]  update_rq_clock+0x38/0x170
[    1.332471]  sched_init_debug+0x2e/0x4b0
[    1.333426] Kernel panic - not syncing: Fatal exception in interrupt
";
        assert!(!super::reached_init(before_init));
        let after_init = "\
VM BOOTED: 7.2.13+deb14-amd64 (expected 7.2.13+deb14-amd64), lsm=lockdown,capability,bpf
[   30.100000] Oops: int3: 0000 [#1] SMP NOPTI
[   30.200000] Kernel panic - not syncing: Fatal exception in interrupt
";
        assert!(super::reached_init(after_init));
    }

    #[test]
    fn a_crash_is_named_by_its_oops_and_function() {
        let console = "\
VM BOOTED: 7.2.13+deb14-amd64 (expected 7.2.13+deb14-amd64), lsm=lockdown,capability,bpf
[tracepoint] attribution checks passed
[   30.100000] Oops: int3: 0000 [#1] SMP NOPTI
[   30.150000] RIP: 0010:trace_syscall_enter+0x1/0x90
[   30.200000] Kernel panic - not syncing: Fatal exception in interrupt
";
        assert_eq!(
            super::crash_digest(console),
            ": Oops: int3: 0000 [#1] SMP NOPTI; RIP: 0010:trace_syscall_enter+0x1/0x90"
        );
        assert_eq!(
            super::crash_digest("[tracepoint] attribution checks passed\n"),
            ""
        );
    }

    #[test]
    fn releases_sort_numerically() {
        assert!(version_key("6.1.0-56-amd64") > version_key("6.1.0-9-amd64"));
        assert!(version_key("6.10.0-1-amd64") > version_key("6.1.0-56-amd64"));
    }
}
