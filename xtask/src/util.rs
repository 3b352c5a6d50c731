//! Small helpers for running commands from the workspace root.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
};

use anyhow::{Context as _, bail};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The cargo that runs xtask (so child builds use the same toolchain), else `cargo` from PATH.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// `status` as a short phrase: "exit 101" or "signal 9".
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        (None, None) => status.to_string(),
    }
}

/// Runs `cmd` in the workspace root, inheriting stdio; fails with `what` if it fails.
pub fn run(what: &str, cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .current_dir(root())
        .status()
        .with_context(|| format!("{what}: cannot start {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({})", describe(status));
    }
    Ok(())
}

/// A finished command's stdout followed by its stderr, for showing whole.
pub fn stdout_and_stderr(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `cmd` in the workspace root and returns its stdout; fails (with its stderr) if it fails.
pub fn output(what: &str, cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .current_dir(root())
        .output()
        .with_context(|| format!("{what}: cannot start {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            describe(out.status),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `cmd` with stdout and stderr written to `log`. On failure the error is one line: `what`,
/// the exit status, the last line of the log that looks like an error, `hint`, and the log's path.
pub fn run_logged(what: &str, cmd: &mut Command, log: &Path, hint: &str) -> anyhow::Result<()> {
    let file = File::create(log).with_context(|| format!("{what}: creating {}", log.display()))?;
    let status = cmd
        .current_dir(root())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("{what}: cannot start {:?}", cmd.get_program()))?;
    if status.success() {
        return Ok(());
    }
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let last_error = text
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with("error") || l.starts_with("E:"))
        .map(|l| format!(" ({l})"))
        .unwrap_or_default();
    bail!(
        "{what} failed ({}){last_error}: {hint}; see {}",
        describe(status),
        log.display()
    )
}

/// The first `name` on PATH that is a file, like `which`.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Quotes `s` for a POSIX shell.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Builds what the integration tests start from target/debug (gpud, gpudctl, gpud-nri,
/// gpud-oci-hook, gpud-k8s, the fixtures) and the fake NVML library they load into the daemon;
/// also used by `fuzz` and `soak`.
pub fn build_test_binaries(what: &str) -> anyhow::Result<()> {
    run(
        what,
        cargo().args([
            "build",
            "--package",
            "gpud",
            "--package",
            "gpud-runtime",
            "--package",
            "gpud-k8s",
            "--package",
            "gpud-tests",
            "--package",
            "fake-nvml",
            "--bins",
            "--lib",
        ]),
    )
}

/// Bytes free to an unprivileged writer on the file system holding `path` (statvfs's `f_bavail`).
pub fn free_bytes(path: &Path) -> anyhow::Result<u64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{}: path holds a NUL", path.display()))?;
    // SAFETY: statvfs is plain data, all zero is a valid value for it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid statvfs to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statvfs {}", path.display()));
    }
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// `bytes` in GiB with one decimal, for messages.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}
