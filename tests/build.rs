//! Compiles the CRI subset in `proto/cri.proto` into prost messages and a tonic client in
//! OUT_DIR, for the containerd test. protox parses it in pure Rust: no `protoc` needed.

fn main() -> anyhow::Result<()> {
    let file = "proto/cri.proto";
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
