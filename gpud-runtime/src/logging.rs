//! Logging for the small companion binaries (the NRI plugin, the OCI hook, gpud-k8s): text on
//! stderr, which a runtime or a service manager captures. The daemon's own logging (journald
//! fields, live reload) is the daemon's.

use std::io::IsTerminal as _;

use tracing_subscriber::{EnvFilter, fmt, layer::SubscriberExt as _, util::SubscriberInitExt as _};

/// Installs the global subscriber: text on stderr with `filter` (EnvFilter syntax; `info` if it
/// does not parse), colours only on a terminal, times unless `time` is false. A second call, or
/// a subscriber already installed, leaves the first in place.
pub fn init_companion(filter: &str, time: bool) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let layer = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // Err only when a subscriber is already installed: that one stays.
    let _ = if time {
        tracing_subscriber::registry()
            .with(filter)
            .with(layer)
            .try_init()
    } else {
        tracing_subscriber::registry()
            .with(filter)
            .with(layer.without_time())
            .try_init()
    };
}
