//! What gpud exposes: the D-Bus service (`dev.gpud.Manager1`, the `dev.gpud.Gpu1` and
//! `dev.gpud.Cgroup1` objects), its
//! authorization, and the Prometheus endpoint. The wire shapes are gpud-api's; this module turns
//! the core's answers into them.

pub mod args;
pub mod authz;
pub mod cgroup;
pub mod dbus;
pub mod error;
pub mod gpu;
pub mod metrics;
pub mod records;
