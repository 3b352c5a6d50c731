//! Boots Debian's kernel (6.1, BPF-LSM and fentry available) under qemu TCG with a busybox
//! initramfs that runs one test binary, and returns the serial console output.
//!
//! The host kernel of the development and CI machines refuses BPF trampolines; this VM is where
//! fentry and BPF-LSM are exercised. KVM is unusable there, so it is software emulation.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::util::{output, root};

/// Marker lines the init script prints.
const EXIT_MARK: &str = "VM EXIT CODE: ";

/// The newest Debian kernel image in /boot that has its modules directory.
fn kernel() -> anyhow::Result<PathBuf> {
    let mut kernels: Vec<(String, PathBuf)> = std::fs::read_dir("/boot")
        .context("vm: reading /boot")?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let ver = name.strip_prefix("vmlinuz-")?.to_owned();
            Path::new("/lib/modules")
                .join(&ver)
                .exists()
                .then(|| (ver, e.path()))
        })
        .collect();
    kernels.sort();
    kernels.pop().map(|(_, p)| p).context(
        "vm: no /boot/vmlinuz-* with modules: install linux-image-amd64 (`cargo xtask setup`)",
    )
}

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /tmp /run
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t securityfs securityfs /sys/kernel/security
mount -t bpf bpf /sys/fs/bpf
mount -t tracefs tracefs /sys/kernel/tracing
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
echo "VM BOOTED: $(uname -r)"
export RUST_BACKTRACE=1 RUST_LOG=info
/bin/vm-payload __ARGS__
echo "VM EXIT CODE: $?"
poweroff -f
"#;

/// Quotes `s` for a POSIX shell.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Copies `src` to `dir` + `src` (absolute paths keep their place in the image).
fn copy_into(dir: &Path, src: &Path) -> anyhow::Result<()> {
    let dst = dir.join(src.strip_prefix("/").unwrap_or(src));
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::copy(src, &dst).with_context(|| format!("vm: copying {}", src.display()))?;
    Ok(())
}

/// Shared libraries `ldd` lists for `binary` (and the loader).
fn libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let text = output("vm: ldd", Command::new("ldd").arg(binary))?;
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

/// Builds target/vm/initramfs.cpio.gz holding busybox, `binary` (as /bin/vm-payload) and its
/// libraries.
fn initramfs(binary: &Path, args: &[String]) -> anyhow::Result<PathBuf> {
    let work = root().join("target/vm");
    let tree = work.join("root");
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(tree.join("bin"))?;
    let busybox = Path::new("/bin/busybox");
    if !busybox.exists() {
        bail!("vm: /bin/busybox missing: install busybox-static (`cargo xtask setup`)");
    }
    std::fs::copy(busybox, tree.join("bin/busybox")).context("vm: copying busybox")?;
    std::fs::copy(binary, tree.join("bin/vm-payload"))
        .with_context(|| format!("vm: copying {}", binary.display()))?;
    for lib in libraries(binary)? {
        copy_into(&tree, &lib)?;
    }
    let quoted: Vec<String> = args.iter().map(|a| sh_quote(a)).collect();
    let init = tree.join("init");
    std::fs::write(&init, INIT.replace("__ARGS__", &quoted.join(" ")))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755))?;
    let image = work.join("initramfs.cpio.gz");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd {} && find . -print0 | cpio --null -o -H newc --quiet | gzip -1 > {}",
            sh_quote(&tree.display().to_string()),
            sh_quote(&image.display().to_string())
        ))
        .status()
        .context("vm: packing the initramfs")?;
    if !status.success() {
        bail!("vm: packing the initramfs failed ({status}): are cpio and gzip installed?");
    }
    Ok(image)
}

/// Boots the VM running `binary args…`; returns the console output when the payload exited 0.
pub fn run(binary: &Path, args: &[String], timeout: Duration) -> anyhow::Result<String> {
    let kernel = kernel()?;
    let image = initramfs(binary, args)?;
    let started = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg", "-cpu", "max", "-m", "1024", "-smp", "2"])
        .args(["-nographic", "-no-reboot", "-kernel"])
        .arg(&kernel)
        .arg("-initrd")
        .arg(&image)
        .arg("-append")
        .arg(
            "console=ttyS0 lsm=lockdown,capability,landlock,yama,apparmor,bpf panic=-1 quiet \
             loglevel=3",
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("vm: cannot start qemu-system-x86_64 (install qemu-system-x86)")?;
    let mut stdout = child.stdout.take().context("vm: qemu stdout")?;
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    });
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            let out = reader.join().unwrap_or_default();
            bail!("vm: no power-off within {timeout:?}; console:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = reader.join().unwrap_or_default();
    let code = out
        .lines()
        .find_map(|l| l.trim().strip_prefix(EXIT_MARK))
        .and_then(|c| c.trim().parse::<i32>().ok());
    match code {
        Some(0) => {
            println!("vm: {} ran in {:.1?}", binary.display(), started.elapsed());
            Ok(out)
        }
        Some(c) => bail!("vm: {} exited with {c}; console:\n{out}", binary.display()),
        None => bail!("vm: the payload did not finish; console:\n{out}"),
    }
}
