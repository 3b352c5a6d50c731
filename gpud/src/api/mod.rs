//! What gpud exposes: the D-Bus service and the records it carries.

pub mod authz;
pub mod dbus;
pub mod gpu;
pub mod metrics;
pub mod model;
