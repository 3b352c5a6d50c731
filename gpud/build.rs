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
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "gpud-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::Nightly,
    )
}
