//! `cargo xtask test`'s stage "package: upgrade": the previous release's package, upgraded to
//! this tree's with `dpkg -i` while tenants hold memory (tests/tests/upgrade.rs says what is
//! checked).
//!
//! The previous release is [`PREVIOUS_RELEASE`], a tag of this repository (CHANGELOG.md says
//! what each release changed; its eBPF ABI is the one `gpud_common::previous` converts). Its
//! package is built from the tag in a git worktree under `target/previous-release/` by the
//! tag's own `cargo xtask package deb`, and kept in [`CACHE_DIR`]`/releases/<tag>/` between runs
//! (the worktree and its build are removed once the package is kept).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use super::{CACHE_DIR, check_deb::Aside, check_deb::dpkg, check_deb::dpkg_status, deb};
use crate::util::{cargo, describe, output, root, stdout_and_stderr};

/// The release this tree upgrades from in the stage.
pub const PREVIOUS_RELEASE: &str = "v0.1.0";
/// The commit [`PREVIOUS_RELEASE`] tags: what is built where a clone has no tags (a clone of a
/// branch alone); where the tag is there, it must name this commit.
const PREVIOUS_RELEASE_COMMIT: &str = "a265e197e0189cf5c12af9026c25104a5a96561b";

/// The .deb in `dir`, if one is there.
fn deb_in(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
}

/// The test of tests/tests/upgrade.rs the stage runs.
const UPGRADE_TEST: &str = "an_upgrade_across_an_abi_change_keeps_every_count_and_limit";

/// The previous release's package: from the cache, or built from its tag (its commit).
pub fn previous_deb() -> anyhow::Result<PathBuf> {
    let cache = Path::new(CACHE_DIR).join("releases").join(PREVIOUS_RELEASE);
    if let Some(deb) = deb_in(&cache) {
        println!(
            "upgrade: {PREVIOUS_RELEASE}'s package: {} (kept from an earlier run)",
            deb.display()
        );
        return Ok(deb);
    }
    let commit = release_commit()?;
    let tree = root()
        .join("target/previous-release")
        .join(PREVIOUS_RELEASE);
    remove_worktree(&tree);
    let added = Command::new("git")
        .current_dir(root())
        .args(["worktree", "add", "--detach"])
        .arg(&tree)
        .arg(&commit)
        .status()
        .context("cannot run git worktree add")?;
    if !added.success() {
        bail!(
            "git worktree add {} {PREVIOUS_RELEASE} failed ({})",
            tree.display(),
            describe(added)
        );
    }
    println!(
        "upgrade: building {PREVIOUS_RELEASE} ({}) in {}",
        commit.trim(),
        tree.display()
    );
    let built = cargo()
        .current_dir(&tree)
        .args(["xtask", "package", "deb"])
        // The tag's own workspace and target directory, whatever this run was given.
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .context("cannot run cargo xtask package deb")?;
    let result = (|| {
        if !built.success() {
            bail!(
                "building {PREVIOUS_RELEASE}'s package failed ({})",
                describe(built)
            );
        }
        let Some(deb) = deb_in(&tree.join("target/package")) else {
            bail!(
                "{PREVIOUS_RELEASE}'s build made no .deb in {}",
                tree.join("target/package").display()
            );
        };
        std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
        let kept = cache.join(deb.file_name().unwrap_or_default());
        std::fs::copy(&deb, &kept).with_context(|| format!("keeping {}", kept.display()))?;
        Ok(kept)
    })();
    remove_worktree(&tree);
    result
}

/// The commit to build: the tag's, which must be [`PREVIOUS_RELEASE_COMMIT`], or that commit
/// where the clone has no tags.
fn release_commit() -> anyhow::Result<String> {
    let rev = |spec: &str| {
        output(
            "git rev-parse",
            Command::new("git").args(["rev-parse", "--verify", "--quiet", spec]),
        )
        .map(|s| s.trim().to_owned())
    };
    match rev(&format!("refs/tags/{PREVIOUS_RELEASE}^{{commit}}")) {
        Ok(tagged) if tagged == PREVIOUS_RELEASE_COMMIT => Ok(tagged),
        Ok(tagged) => bail!(
            "the tag {PREVIOUS_RELEASE} names {tagged}, not {PREVIOUS_RELEASE_COMMIT}: \
             xtask/src/package/upgrade.rs and the tag disagree"
        ),
        Err(_) => rev(&format!("{PREVIOUS_RELEASE_COMMIT}^{{commit}}")).with_context(|| {
            format!(
                "neither the tag {PREVIOUS_RELEASE} nor its commit {PREVIOUS_RELEASE_COMMIT} is \
                 in this clone (a shallow clone: `git fetch --unshallow --tags`)"
            )
        }),
    }
}

/// Removes the worktree at `tree` and its build, if there.
fn remove_worktree(tree: &Path) {
    let _ = Command::new("git")
        .current_dir(root())
        .args(["worktree", "remove", "--force"])
        .arg(tree)
        .output();
    let _ = std::fs::remove_dir_all(tree);
    let _ = Command::new("git")
        .current_dir(root())
        .args(["worktree", "prune"])
        .output();
}

/// The stage: installs the previous release's package, then runs tests/tests/upgrade.rs with
/// the installed gpud and `dpkg -i` of this tree's package as the upgrade; purges gpud after.
pub fn test_upgrade() -> anyhow::Result<()> {
    if dpkg_status("gpud").is_some() {
        println!("upgrade test: gpud is installed already: purging it first");
        dpkg(&["--purge", "gpud"])?;
    }
    let old = previous_deb()?;
    let new = deb()?;
    let _aside = Aside::new(&["/etc/gpud", "/var/lib/gpud", "/var/log/gpud-oci-hook.log"])?;
    let result = (|| {
        let installed = dpkg(&["--install", &old.display().to_string()])?;
        println!(
            "upgrade test: dpkg -i {}:\n{}",
            old.display(),
            installed.trim_end()
        );
        let version = output(
            "gpud --version",
            Command::new("/usr/bin/gpud").arg("--version"),
        )?;
        println!("upgrade test: installed: {}", version.trim());
        let upgrade = format!(
            "DEBIAN_FRONTEND=noninteractive dpkg --install {} && /usr/bin/gpud --version",
            new.display()
        );
        let out = cargo()
            .current_dir(root())
            .args([
                "test",
                "-p",
                "gpud-tests",
                "--test",
                "upgrade",
                "--",
                UPGRADE_TEST,
                "--exact",
                "--nocapture",
            ])
            .env("GPUD_BIN", "/usr/bin/gpud")
            .env("GPUDCTL_BIN", "/usr/bin/gpudctl")
            .env("GPUD_UPGRADE", &upgrade)
            .output()
            .context("cannot run cargo test --test upgrade")?;
        let text = stdout_and_stderr(&out);
        println!("{}", text.trim_end());
        if !out.status.success() {
            bail!("the upgrade test failed ({})", describe(out.status));
        }
        if text.contains("SKIPPED") || !text.contains("test result: ok. 1 passed") {
            bail!("the upgrade test did not run");
        }
        Ok(())
    })();
    match dpkg(&["--purge", "gpud"]) {
        Ok(purged) => println!("upgrade test: dpkg -P:\n{}", purged.trim_end()),
        Err(e) if result.is_ok() => return Err(e),
        Err(e) => eprintln!("upgrade test: {e:#}"),
    }
    result
}
