//! Rebuild the eBPF object when the linker changes (it is found on PATH by rustc).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
