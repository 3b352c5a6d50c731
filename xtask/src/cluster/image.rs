//! The one image of the cluster, built on the spot and imported with `ctr`: there is no registry.
//! It is the busybox root filesystem the containerd tests use (tests/src/containerd.rs), as an
//! OCI archive with `sleep` as its command, so it serves as the pod sandbox ("pause") image and as
//! the image of test pods alike.

use std::{path::Path, process::Command};

use anyhow::{Context as _, bail};
use sha2::{Digest as _, Sha256};

use crate::util::describe;

/// The busybox applets linked into the image.
const APPLETS: &[&str] = &[
    "sh", "sleep", "cat", "ls", "echo", "wget", "nc", "ip", "env",
];

/// Builds the OCI archive in `work` and returns its path.
pub fn build(work: &Path, name: &str) -> anyhow::Result<std::path::PathBuf> {
    let _ = std::fs::remove_dir_all(work);
    let rootfs = work.join("rootfs");
    let blobs = work.join("layout/blobs/sha256");
    for d in ["bin", "proc", "sys", "dev", "tmp", "etc"] {
        std::fs::create_dir_all(rootfs.join(d))
            .with_context(|| format!("cluster: image: creating {d}"))?;
    }
    std::fs::create_dir_all(&blobs).context("cluster: image: creating the layout")?;
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
        .context("cluster: image: copying /bin/busybox (Debian busybox-static)")?;
    for applet in APPLETS {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))
            .with_context(|| format!("cluster: image: linking {applet}"))?;
    }
    let layer = work.join("layer.tar");
    tar(&rootfs, &layer)?;
    let (layer_digest, layer_size) = add_blob(
        &blobs,
        &std::fs::read(&layer).context("cluster: image: reading the layer")?,
    )?;
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": ["sleep", "1000000000"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    });
    let (config_digest, config_size) = add_blob(&blobs, config.to_string().as_bytes())?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer_size,
        }],
    });
    let (manifest_digest, manifest_size) = add_blob(&blobs, manifest.to_string().as_bytes())?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": {"io.containerd.image.name": name},
        }],
    });
    let layout = work.join("layout");
    std::fs::write(layout.join("index.json"), index.to_string())
        .context("cluster: image: writing index.json")?;
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .context("cluster: image: writing oci-layout")?;
    let archive = work.join("image.tar");
    tar(&layout, &archive)?;
    Ok(archive)
}

/// `tar -cf ARCHIVE -C DIR .`, owned by root.
fn tar(dir: &Path, archive: &Path) -> anyhow::Result<()> {
    let status = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .args(["--owner=0", "--group=0", "--numeric-owner", "-cf"])
        .arg(archive)
        .arg(".")
        .status()
        .context("cluster: image: cannot start tar")?;
    if !status.success() {
        bail!(
            "cluster: image: tar of {} failed ({})",
            dir.display(),
            describe(status)
        );
    }
    Ok(())
}

/// Stores `data` as a blob of an OCI layout: its digest (`sha256:…`) and size.
fn add_blob(blobs: &Path, data: &[u8]) -> anyhow::Result<(String, usize)> {
    let hex: String = Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    std::fs::write(blobs.join(&hex), data).context("cluster: image: writing a blob")?;
    Ok((format!("sha256:{hex}"), data.len()))
}
