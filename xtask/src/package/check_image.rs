//! The image stage of `cargo xtask test`: load the image into a private store, run its
//! binaries, check its labels and that the manifests run it.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};

use super::*;
use crate::util::{output, root};

/// `cargo xtask test`'s image stage: build it, `podman load` it into a private store, run
/// `gpud-k8s --version`, `gpud-nri --help` and `gpud --version` in it, check its labels, and
/// that every container image in deploy/kubernetes is the name it loads as.
pub fn test_image() -> anyhow::Result<()> {
    let archive = image()?;
    let podman = Podman::new(&out_dir().join("podman-test"))?;
    let loaded = output(
        "podman load",
        podman.command().arg("load").arg("--input").arg(&archive),
    )?;
    let name = image_name();
    if !loaded.contains(&name) {
        bail!("podman load did not load {name}: {loaded}");
    }
    println!("package test: podman load: {}", loaded.trim());
    let labels = output(
        "podman image inspect",
        podman
            .command()
            .args(["image", "inspect", "--format", "{{json .Labels}} {{.Size}}"])
            .arg(&name),
    )?;
    let (labels_json, size) = labels.trim().rsplit_once(' ').unwrap_or((&labels, "0"));
    let labels: serde_json::Value = serde_json::from_str(labels_json)?;
    if labels["org.opencontainers.image.version"] != VERSION {
        bail!("image version label: {labels}");
    }
    let revision = labels["org.opencontainers.image.revision"]
        .as_str()
        .unwrap_or("");
    if revision.len() != 40 {
        bail!("image revision label: {labels}");
    }
    let run = |args: &[&str]| -> anyhow::Result<String> {
        output(
            &format!("podman run {}", args.join(" ")),
            podman
                .command()
                .args(["run", "--rm", "--network", "none"])
                .args(["--runtime", "runc", "--cgroup-parent", TEST_CGROUP_PARENT])
                .args([
                    "--ulimit",
                    "nofile=1024:1024",
                    "--ulimit",
                    "nproc=1024:1024",
                ])
                .arg(&name)
                .args(args),
        )
    };
    let ran = (|| {
        let version = run(&["gpud-k8s", "--version"])?;
        if version.trim() != format!("gpud-k8s {VERSION}") {
            bail!("gpud-k8s --version in the image: {version:?}");
        }
        let help = run(&["gpud-nri", "--help"])?;
        if !help.contains("NRI plugin") {
            bail!("gpud-nri --help in the image: {help}");
        }
        // `gpud <version> (ABI <n>, revision <commit>)`.
        let gpud = run(&["gpud", "--version"])?;
        if !gpud.trim().starts_with(&format!("gpud {VERSION} (ABI ")) {
            bail!("gpud --version in the image: {gpud:?}");
        }
        Ok(())
    })();
    remove_cgroups(TEST_CGROUP_PARENT);
    ran?;
    let images = manifest_images()?;
    if images.is_empty() || images.iter().any(|(_, i)| *i != name) {
        bail!("the manifests run other images than {name}: {images:?}");
    }
    println!(
        "package test: image {name}: gpud-k8s --version, gpud-nri --help, gpud --version ok; \
         labels version {VERSION}, revision {revision}; {} containers in deploy/kubernetes run it; \
         archive {}, image {}",
        images.len(),
        human(std::fs::metadata(&archive)?.len()),
        human(size.parse().unwrap_or(0))
    );
    Ok(())
}

/// The cgroup the image test's containers run under (runc and Podman's cgroupfs manager leave
/// its directories behind; [`remove_cgroups`] removes them).
const TEST_CGROUP_PARENT: &str = "/gpud-xtask-image";

/// Removes the cgroup directories under `parent` in every hierarchy mounted under /sys/fs/cgroup
/// (v1 controllers and the v2 tree of a hybrid host, or a pure v2 host's), waiting up to 10 s for
/// the last processes in them (conmon) to exit.
fn remove_cgroups(parent: &str) {
    for _ in 0..100 {
        if !try_remove_cgroups(parent) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("package test: cgroup directories under {parent} are still in use; left them");
}

/// One round of [`remove_cgroups`]; whether any directory is left.
fn try_remove_cgroups(parent: &str) -> bool {
    let mut left = false;
    let rel = parent.trim_start_matches('/');
    let mut tops = vec![Path::new("/sys/fs/cgroup").join(rel)];
    if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
        tops.extend(entries.filter_map(Result::ok).map(|e| e.path().join(rel)));
    }
    for top in tops.into_iter().filter(|t| t.is_dir()) {
        // Deepest first: a cgroup directory can only be removed once it has no children.
        let mut dirs = vec![top.clone()];
        let mut i = 0;
        while i < dirs.len() {
            if let Ok(entries) = std::fs::read_dir(&dirs[i]) {
                dirs.extend(
                    entries
                        .filter_map(Result::ok)
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
            i += 1;
        }
        for d in dirs.iter().rev() {
            left |= std::fs::remove_dir(d).is_err();
        }
    }
    left
}

/// (file, image) of every container of every workload in deploy/kubernetes (examples apart:
/// they run the user's image).
fn manifest_images() -> anyhow::Result<Vec<(PathBuf, String)>> {
    let mut out = Vec::new();
    let mut stack = vec![root().join("deploy/kubernetes")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)?.filter_map(Result::ok) {
            let p = e.path();
            if p.is_dir() {
                if !p.ends_with("examples") {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&p)?;
            let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
                .with_context(|| format!("{}: not YAML", p.display()))?;
            for doc in docs {
                let spec = &doc["spec"]["template"]["spec"];
                for key in ["initContainers", "containers"] {
                    for c in spec[key].as_array().into_iter().flatten() {
                        out.push((p.clone(), c["image"].as_str().unwrap_or("").to_owned()));
                    }
                }
            }
        }
    }
    Ok(out)
}
