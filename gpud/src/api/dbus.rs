//! The D-Bus service `dev.gpud.Daemon1`: object `/dev/gpud/Daemon1`, interface
//! `dev.gpud.Manager1` (documented in docs/dbus-api.md), and the client proxy gpudctl uses.
//!
//! Handlers hold no state: they validate arguments and ask the state task over a channel.

use std::collections::BTreeMap;

use tokio::sync::{mpsc, oneshot};
use zbus::interface;

use super::model::{CgroupRecord, ProcessRecord};
use crate::{
    attribution::{AttributionError, CgroupError},
    daemon::{Message, Request},
};

pub const BUS_NAME: &str = "dev.gpud.Daemon1";
pub const OBJECT_PATH: &str = "/dev/gpud/Daemon1";
pub const MANAGER_INTERFACE: &str = "dev.gpud.Manager1";

/// Errors returned to D-Bus callers, named `dev.gpud.Error.<Variant>`.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "dev.gpud.Error")]
pub enum ApiError {
    #[zbus(error)]
    ZBus(zbus::Error),
    /// The named object (e.g. a cgroup path) does not exist.
    NotFound(String),
    /// An argument is malformed (e.g. a path with `..`).
    InvalidArgument(String),
    /// The daemon could not complete the request.
    Failed(String),
}

impl From<AttributionError> for ApiError {
    fn from(e: AttributionError) -> Self {
        match e {
            AttributionError::Cgroup(CgroupError::NotFound(_)) => Self::NotFound(e.to_string()),
            AttributionError::Cgroup(CgroupError::InvalidPath { .. }) => {
                Self::InvalidArgument(e.to_string())
            }
            other => Self::Failed(other.to_string()),
        }
    }
}

/// Facts fixed at start-up.
#[derive(Clone, Debug)]
pub struct DaemonInfo {
    pub version: String,
    pub attach_mode: String,
    pub kernel_capabilities: BTreeMap<String, bool>,
    pub cgroup_root: String,
    pub probes_resumed: bool,
}

pub struct Manager {
    tx: mpsc::Sender<Message>,
    info: DaemonInfo,
}

impl Manager {
    pub fn new(tx: mpsc::Sender<Message>, info: DaemonInfo) -> Self {
        Self { tx, info }
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Request,
    ) -> Result<T, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Message::Request(make(reply)))
            .await
            .map_err(|_| ApiError::Failed("daemon is shutting down".into()))?;
        rx.await
            .map_err(|_| ApiError::Failed("daemon is shutting down".into()))
    }
}

#[interface(name = "dev.gpud.Manager1")]
impl Manager {
    /// The daemon's version.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn version(&self) -> String {
        self.info.version.clone()
    }

    /// How the probes are attached: `fentry` or `tracepoint`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn attach_mode(&self) -> String {
        self.info.attach_mode.clone()
    }

    /// Mechanisms this kernel offers, as probed at start-up.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn kernel_capabilities(&self) -> BTreeMap<String, bool> {
        self.info.kernel_capabilities.clone()
    }

    /// Mount point of the cgroup v2 hierarchy; cgroup paths are relative to it.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn cgroup_root(&self) -> String {
        self.info.cgroup_root.clone()
    }

    /// Whether the probes were found attached (by a previous daemon) and adopted with their counts.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn probes_resumed(&self) -> bool {
        self.info.probes_resumed
    }

    /// Every attributed cgroup, ordered by path.
    async fn list_cgroups(&self) -> Result<Vec<CgroupRecord>, ApiError> {
        self.ask(Request::ListCgroups).await
    }

    /// Every live attributed process, ordered by pid.
    async fn list_processes(&self) -> Result<Vec<ProcessRecord>, ApiError> {
        self.ask(Request::ListProcesses).await
    }

    /// One cgroup by path relative to the cgroup v2 root ("/a/b").
    async fn get_cgroup(&self, path: &str) -> Result<CgroupRecord, ApiError> {
        // Reject obviously bad input here, before it reaches the state task.
        crate::attribution::CgroupFs::normalize(path)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?;
        let path = path.to_owned();
        self.ask(|reply| Request::GetCgroup { path, reply })
            .await?
            .map_err(ApiError::from)
    }

    /// Health counters of the kernel side: `events_lost`, `procs_map_full`, `cgroups_map_full`,
    /// `matched_ioctls`.
    async fn get_kernel_stats(&self) -> Result<BTreeMap<String, u64>, ApiError> {
        self.ask(Request::KernelStats).await
    }
}

/// Client side of `dev.gpud.Manager1`.
#[zbus::proxy(
    interface = "dev.gpud.Manager1",
    default_service = "dev.gpud.Daemon1",
    default_path = "/dev/gpud/Daemon1"
)]
pub trait Manager1 {
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn attach_mode(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn kernel_capabilities(&self) -> zbus::Result<BTreeMap<String, bool>>;
    #[zbus(property)]
    fn cgroup_root(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn probes_resumed(&self) -> zbus::Result<bool>;
    fn list_cgroups(&self) -> zbus::Result<Vec<CgroupRecord>>;
    fn list_processes(&self) -> zbus::Result<Vec<ProcessRecord>>;
    fn get_cgroup(&self, path: &str) -> zbus::Result<CgroupRecord>;
    fn get_kernel_stats(&self) -> zbus::Result<BTreeMap<String, u64>>;
}

/// A connection builder for the bus named by `bus`: `"system"` or a D-Bus address.
pub fn connect_builder(bus: &str) -> zbus::connection::Builder<'static> {
    match bus {
        "system" => zbus::connection::Builder::system(),
        address => zbus::connection::Builder::address(address),
    }
}
