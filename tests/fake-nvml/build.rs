//! Links the library `-z nodelete`: like a driver's state, the fake's (call counts for injected
//! failures, delivered events, utilization history) must survive the caller's `dlclose` and
//! re-`dlopen`, which nvml-wrapper does on every re-initialization.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
