//! Small helpers for running commands from the workspace root.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs `cmd` in the workspace root, inheriting stdio; fails with `what` if it fails.
pub fn run(what: &str, cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .current_dir(root())
        .status()
        .with_context(|| format!("{what}: cannot start {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` and returns its stdout; fails (with its stderr) if it fails.
pub fn output(what: &str, cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .current_dir(root())
        .output()
        .with_context(|| format!("{what}: cannot start {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}
