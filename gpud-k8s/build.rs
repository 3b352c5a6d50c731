//! Compiles the kubelet APIs in `proto/` (device plugin v1beta1, plugin registration v1, DRA v1)
//! into prost messages and tonic clients and servers in OUT_DIR. protox parses the files in pure
//! Rust, so no `protoc` is needed on the build machine.

fn main() -> anyhow::Result<()> {
    let files = [
        "proto/deviceplugin.proto",
        "proto/pluginregistration.proto",
        "proto/dra.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
