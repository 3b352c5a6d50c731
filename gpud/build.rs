//! Builds the eBPF object (crate `gpud-ebpf`, nightly, bpfel-unknown-none) into OUT_DIR so the
//! daemon can embed it with `include_bytes_aligned!`.
use std::path::Path;

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    let root = Path::new(&manifest_dir).join("../gpud-ebpf");
    let root = root
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("non-UTF-8 path to gpud-ebpf"))?;
    // gpud-common is compiled into the object too.
    println!("cargo:rerun-if-changed={manifest_dir}/../gpud-common/src");
    println!("cargo:rustc-env=GPUD_REVISION={}", revision(&manifest_dir));
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "gpud-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::Nightly,
    )?;
    strip_dwarf(&Path::new(&std::env::var("OUT_DIR")?).join("gpud-probes"))
}

/// The source revision `gpud --version`, gpudctl and D-Bus show: `$GPUD_REVISION` where set (a
/// build from a source archive), else the checkout's commit, else `unknown`. The build script
/// runs again when the branch moves (only files that exist are watched: a missing one would
/// make cargo run it on every build).
fn revision(manifest_dir: &str) -> String {
    println!("cargo:rerun-if-env-changed=GPUD_REVISION");
    if let Ok(r) = std::env::var("GPUD_REVISION")
        && !r.trim().is_empty()
    {
        return r.trim().to_owned();
    }
    let git = Path::new(manifest_dir).join("../.git");
    let mut watched = vec![git.join("HEAD"), git.join("packed-refs")];
    if let Ok(head) = std::fs::read_to_string(git.join("HEAD"))
        && let Some(branch) = head.trim().strip_prefix("ref: ")
    {
        watched.push(git.join(branch));
    }
    for f in watched.iter().filter(|f| f.is_file()) {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    std::process::Command::new("git")
        .args(["-C", manifest_dir, "rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// Removes the object's DWARF (`.debug_*` and their relocations: three quarters of it) with
/// LLVM's objcopy, which the bpf-linker set-up installs: bpf-linker already made the BTF the
/// kernel needs from it, and aya, which ignores those sections, still reads every section's
/// relocations when the daemon parses the object at start (1 MiB more resident in the daemon for
/// nothing). Without objcopy the object is embedded as it is, with a warning.
fn strip_dwarf(object: &Path) -> anyhow::Result<()> {
    let candidates = [
        "/usr/lib/llvm-22/bin/llvm-objcopy",
        "llvm-objcopy-22",
        "llvm-objcopy",
    ];
    for tool in candidates {
        match std::process::Command::new(tool)
            .arg("--strip-debug")
            .arg(object)
            .status()
        {
            Ok(s) if s.success() => return Ok(()),
            Ok(s) => anyhow::bail!("{tool} --strip-debug {}: {s}", object.display()),
            Err(_) => continue,
        }
    }
    println!(
        "cargo:warning=no llvm-objcopy found ({}): the eBPF object keeps its DWARF",
        candidates.join(", ")
    );
    Ok(())
}
