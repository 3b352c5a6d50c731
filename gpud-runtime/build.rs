//! Generates the NRI messages and ttrpc services from `proto/nri.proto` into OUT_DIR/nri
//! (pure-Rust parser: no `protoc` needed).
use std::path::Path;

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    nri(&manifest_dir)
}

/// rust-protobuf messages (`nri.rs`) and async ttrpc client and server (`nri_ttrpc.rs`).
fn nri(manifest_dir: &str) -> anyhow::Result<()> {
    let proto_dir = Path::new(manifest_dir).join("proto");
    let out = Path::new(&std::env::var("OUT_DIR")?).join("nri");
    std::fs::create_dir_all(&out)?;
    println!(
        "cargo:rerun-if-changed={}",
        proto_dir.join("nri.proto").display()
    );
    ttrpc_codegen::Codegen::new()
        .out_dir(&out)
        .input(proto_dir.join("nri.proto"))
        .include(&proto_dir)
        .rust_protobuf()
        .customize(ttrpc_codegen::Customize {
            async_all: true,
            ..Default::default()
        })
        .run()?;
    // The generated files open with inner attributes (`#![allow(...)]`) and inner doc comments,
    // which `include!` does not accept; gpud-runtime/src/nri/api.rs puts the equivalent outer
    // attributes on the modules that include them.
    for name in ["nri.rs", "nri_ttrpc.rs"] {
        let path = out.join(name);
        let text = std::fs::read_to_string(&path)?;
        let kept: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("#![") && !l.trim_start().starts_with("//!"))
            .collect();
        std::fs::write(&path, kept.join("\n"))?;
    }
    Ok(())
}
