//! The kubelet device plugin (API v1beta1): `gpud.dev/gpu-memory` and `gpud.dev/gpu-compute`,
//! each served on its own socket in the device-plugins directory and registered with the kubelet
//! there; re-registered whenever the kubelet restarts (its `kubelet.sock` is created anew).
//!
//! The plugin keeps no state that matters across its own restarts: the kubelet checkpoints which
//! units each container holds, gpud keeps the limits the runtime path set (the plugin never sets
//! or clears one), and the plugin's view of what is taken is gpud's `ListLimits`, read when it is
//! needed. A restarted plugin re-registers and carries on; running pods keep their limits.

mod gpud;
mod service;

use std::{path::PathBuf, sync::Arc, time::Duration};

use futures_util::StreamExt as _;
use tokio::sync::{RwLock, watch};

pub use self::gpud::{Gpud, TopologySource, View, spawn_refresh, taken_units};
pub use service::{Pairing, ResourcePlugin, VISIBLE_DEVICES_ENV, options, shares_of};

use crate::{
    api::deviceplugin::{
        RegisterRequest, device_plugin_server::DevicePluginServer,
        registration_client::RegistrationClient,
    },
    grpc,
    inventory::{APPLICATION_XIDS, HealthTracker, Inventory},
    topology::Topology,
    units::Resource,
};

/// The device-plugin API version spoken.
pub const API_VERSION: &str = "v1beta1";
/// The kubelet's directory for device-plugin sockets.
pub const DEFAULT_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// The kubelet's registration socket in that directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// How containers are given their GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<uuid>,…` for the NVIDIA container toolkit.
    Envvar,
    /// CDI device names (`<cdi-kind>=<uuid>`), for runtimes with CDI enabled.
    Cdi,
}

/// The plugin's settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where `kubelet.sock` is and the plugin's sockets go.
    pub plugin_dir: PathBuf,
    /// gpud's bus: `"system"` or a D-Bus address.
    pub bus: String,
    /// Bytes per `gpud.dev/gpu-memory` unit.
    pub memory_unit: u64,
    pub strategy: DeviceListStrategy,
    /// CDI kind of the GPU devices, e.g. `nvidia.com/gpu`.
    pub cdi_kind: String,
    /// libnvidia-ml for the topology (default: the system's).
    pub nvml_library: Option<PathBuf>,
    /// How often gpud's inventory and health are read.
    pub health_interval: Duration,
    /// Xid errors that do not make a GPU unhealthy.
    pub ignored_xids: Vec<u64>,
    /// Longest time between one resource's Allocate and the other's GetPreferredAllocation of
    /// the same container.
    pub pair_window: Duration,
    /// Bound of each call to gpud and of registering with the kubelet.
    pub timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            plugin_dir: DEFAULT_PLUGIN_DIR.into(),
            bus: "system".into(),
            memory_unit: 1 << 30,
            strategy: DeviceListStrategy::Envvar,
            cdi_kind: "nvidia.com/gpu".into(),
            nvml_library: None,
            health_interval: Duration::from_secs(5),
            ignored_xids: APPLICATION_XIDS.to_vec(),
            pair_window: Duration::from_secs(2),
            timeout: Duration::from_secs(5),
        }
    }
}

/// Errors that stop the plugin.
#[derive(Debug, thiserror::Error)]
pub enum DevicePluginError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What the two services share.
pub struct Shared {
    pub config: Config,
    pub inventory: watch::Receiver<Arc<Inventory>>,
    pub topology: Arc<RwLock<Topology>>,
    pub gpud: Arc<Gpud>,
    pub pairing: std::sync::Mutex<Pairing>,
}

/// Runs the plugin until `shutdown` completes: serves both resources, registers them, and does
/// both again whenever the kubelet restarts. On shutdown the sockets are removed; gpud's limits
/// are left as they are.
pub async fn run(
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DevicePluginError> {
    if config.memory_unit == 0 {
        return Err(DevicePluginError::Config(
            "the memory unit is 0 bytes".into(),
        ));
    }
    let io = |path: &std::path::Path| {
        let path = path.to_owned();
        move |source| DevicePluginError::Io { path, source }
    };
    let dir = config.plugin_dir.clone();
    // Watched before anything else, so a kubelet restart during start-up is not missed.
    let mut events = grpc::watch_dir(
        &dir,
        inotify::WatchMask::CREATE | inotify::WatchMask::MOVED_TO,
    )
    .map_err(io(&dir))?;

    let (stop_all, stop_rx) = watch::channel(false);
    let gpud = Arc::new(Gpud::new(&config.bus, config.timeout));
    let view = spawn_refresh(
        gpud.clone(),
        HealthTracker::new(config.memory_unit, config.ignored_xids.iter().copied()),
        config.memory_unit,
        TopologySource::Nvml(config.nvml_library.clone()),
        config.health_interval,
        stop_rx,
    );
    let shared = Arc::new(Shared {
        config: config.clone(),
        inventory: view.inventory,
        topology: view.topology,
        gpud,
        pairing: std::sync::Mutex::new(Pairing::default()),
    });
    let kubelet = dir.join(KUBELET_SOCKET);
    tokio::pin!(shutdown);
    let result = loop {
        let (stop_servers, servers_stop) = watch::channel(false);
        let mut tasks = Vec::new();
        for r in Resource::ALL {
            let path = dir.join(r.socket());
            let listener = grpc::bind(&path).map_err(io(&path))?;
            let plugin = ResourcePlugin {
                resource: r,
                shared: shared.clone(),
                stop: servers_stop.clone(),
            };
            let router =
                tonic::transport::Server::builder().add_service(DevicePluginServer::new(plugin));
            let mut stop = servers_stop.clone();
            tasks.push(tokio::spawn(async move {
                let stopped = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                if let Err(e) = grpc::serve(router, listener, stopped).await {
                    tracing::error!("{r}: serving {}: {e}", path.display());
                }
            }));
        }
        // Register once kubelet.sock is there; a kubelet that is not yet there (or refuses) is
        // retried on its next creation of the socket.
        let mut registered = false;
        if kubelet.exists() {
            registered = register_all(&kubelet, shared.config.timeout).await;
        } else {
            tracing::info!("waiting for the kubelet ({} is absent)", kubelet.display());
        }
        let restart = loop {
            tokio::select! {
                () = &mut shutdown => break false,
                ev = events.next() => match ev {
                    Some(Ok(e)) if e.name.as_deref() == Some(std::ffi::OsStr::new(KUBELET_SOCKET)) => {
                        tracing::info!("{} created: the kubelet (re)started; registering again", kubelet.display());
                        break true;
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::warn!("watching {}: {e}", dir.display()),
                    None => break false,
                },
                // A kubelet that refused the first registration is asked again now and then.
                () = tokio::time::sleep(Duration::from_secs(5)), if !registered && kubelet.exists() => {
                    registered = register_all(&kubelet, shared.config.timeout).await;
                }
            }
        };
        let _ = stop_servers.send(true);
        for t in tasks {
            let _ = t.await;
        }
        if !restart {
            break Ok(());
        }
    };
    let _ = stop_all.send(true);
    for r in Resource::ALL {
        let _ = std::fs::remove_file(dir.join(r.socket()));
    }
    tracing::info!("stopped; gpud keeps the limits of running containers");
    result
}

/// Registers both resources; whether both were accepted.
async fn register_all(kubelet: &std::path::Path, timeout: Duration) -> bool {
    let mut ok = true;
    for r in Resource::ALL {
        match register(kubelet, r, timeout).await {
            Ok(()) => tracing::info!("{r}: registered with the kubelet ({API_VERSION})"),
            Err(e) => {
                tracing::warn!("{r}: registration with the kubelet failed: {e}");
                ok = false;
            }
        }
    }
    ok
}

async fn register(kubelet: &std::path::Path, r: Resource, timeout: Duration) -> Result<(), String> {
    let mut client = RegistrationClient::new(grpc::unix_channel(kubelet));
    let req = RegisterRequest {
        version: API_VERSION.into(),
        endpoint: r.socket().into(),
        resource_name: r.name().into(),
        options: Some(options()),
    };
    match tokio::time::timeout(timeout, client.register(req)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(format!("{}: {}", status.code(), status.message())),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}
