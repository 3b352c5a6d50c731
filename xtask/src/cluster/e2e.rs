//! `cargo xtask cluster e2e`, the "kubernetes (real cluster)" stage of `cargo xtask test`: gpud
//! installed on a real single-node cluster the way an operator installs it (deploy/kubernetes),
//! from the image `cargo xtask package image` builds, checked by `gpud-cluster-e2e`
//! (tests/src/bin; what it checks is in its docs).
//!
//! Skipped (exit 77) without the Kubernetes binaries, before anything is built. Otherwise builds
//! the image and the checks, brings the cluster up, imports the image into its containerd under
//! its name and a second tag (the rolling update's), runs the checks, and always takes the
//! cluster down again.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{Cluster, down, kube_tool};
use crate::util::{describe, root};

/// Where the checks put the node's fakes (tests/src/bin/gpud-cluster-e2e.rs).
const FAKES: &str = "/run/gpud-e2e";
/// Bound of the checks (they take about two minutes here).
const E2E_TIMEOUT: Duration = Duration::from_secs(900);

/// The stage: up, import, check, down.
pub fn e2e() -> anyhow::Result<()> {
    super::need_root("e2e")?;
    // Skipped (and said why) before anything is built for it.
    super::kube_binaries(&Cluster::new())?;
    // Built every time (both are quick when nothing changed): a stale image or checker would
    // test something other than this tree.
    let image = crate::package::image()?;
    let checker = root().join("target/debug/gpud-cluster-e2e");
    crate::util::build_test_binaries("cargo build (the cluster checks and their fixtures)")?;
    super::up()?;
    let c = Cluster::new();
    let result = checks(&c, &image, &checker);
    let taken_down = down::teardown(&c, false);
    let cleaned = clean_node();
    result.and(taken_down).and(cleaned)
}

/// What a failed run leaves on this machine once the cluster is down (a passing run leaves
/// nothing, and the checks say so): the fake device's mount, whose server exited, and gpud's
/// host files, pins and state, which a pod stopped by `down` (not by the kubelet: no preStop
/// hook) did not remove. gpud's own uninstall removes those.
fn clean_node() -> anyhow::Result<()> {
    let fakes = std::path::Path::new(FAKES);
    let nv = fakes.join("nv");
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(&*nv.to_string_lossy()));
    if mounted {
        crate::util::run(
            "umount --lazy (the fake control device)",
            Command::new("umount").arg("--lazy").arg(&nv),
        )?;
    }
    if fakes.exists() {
        std::fs::remove_dir_all(fakes).with_context(|| format!("removing {FAKES}"))?;
    }
    // Only after gpud's install ran here (it refuses a host with the package; without its
    // manifest, pins and state may be another gpud's).
    if !std::path::Path::new("/opt/gpud/installed.json").exists() {
        return Ok(());
    }
    crate::util::run(
        "gpud-k8s node uninstall (what a failed run left)",
        Command::new(root().join("target/debug/gpud-k8s"))
            .args(["node", "uninstall", "--host-root", "/"])
            .env("GPUD_K8S_LOG", "warn"),
    )
}

fn checks(c: &Cluster, image: &std::path::Path, checker: &std::path::Path) -> anyhow::Result<()> {
    let name = crate::package::image_name();
    let update = format!("{}-update", crate::package::VERSION);
    crate::util::output(
        "ctr images import (gpud's image)",
        c.ctr().args(["images", "import"]).arg(image),
    )?;
    // The rolling update's image: the same one under another tag, as a new release would be.
    let (repo, _) = name.rsplit_once(':').context("image name without a tag")?;
    crate::util::output(
        "ctr images tag",
        c.ctr()
            .args(["images", "tag", "--force", &name])
            .arg(format!("{repo}:{update}")),
    )?;
    println!("cluster: imported {name} (and {repo}:{update}) into containerd");
    let started = Instant::now();
    let mut child = Command::new(checker)
        .arg("--kubeconfig")
        .arg(c.kubeconfig())
        .arg("--kubectl")
        .arg(kube_tool("kubectl"))
        .args(["--image", &name, "--update-tag", &update])
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", checker.display()))?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > E2E_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the cluster checks did not finish within {E2E_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if !status.success() {
        bail!(
            "the cluster checks failed ({}); the cluster's logs are in {}",
            describe(status),
            c.dir.join("logs").display()
        );
    }
    println!(
        "cluster: the checks passed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
