//! The kubelet's plugin watcher and DRA manager, driven as the kubelet of Kubernetes 1.34–1.36
//! drives them (pkg/kubelet/pluginmanager, pkg/kubelet/cm/dra/plugin):
//!
//! - The watcher finds sockets in `plugins_registry` (those there at its start, then new ones; a
//!   reconciler pass each second). For a new or recreated socket: dial (grpc-go, blocking, 10 s),
//!   `GetInfo` (1 s), the handler's ValidatePlugin (type `DRAPlugin`, a service version it
//!   speaks), RegisterPlugin (the DRA handler records the endpoint), then
//!   `NotifyRegistrationStatus` (5 s). A failure is logged as the kubelet logs it and retried
//!   after an exponential backoff per socket (0.5 s, doubling, at most 2 min 2 s). A socket that
//!   goes away deregisters its plugin.
//! - NodePrepareResources and NodeUnprepareResources go to the registered driver's endpoint over
//!   one grpc-go connection (no authority), each call with the 45 s client timeout; a driver that
//!   is not registered fails as `DRA driver NAME is not registered`.

use std::{
    collections::BTreeMap,
    os::unix::fs::{FileTypeExt, MetadataExt},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use gpud_k8s::api::{
    dra::{self as pb, dra_plugin_client::DraPluginClient},
    pluginregistration::{self as reg, registration_client::RegistrationClient},
};
use tokio::sync::watch;
use tonic::{Request, transport::Channel};

use super::grpc_go::{self, Authority};

const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
const GET_INFO_TIMEOUT: Duration = Duration::from_secs(1);
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
const RECONCILE: Duration = Duration::from_secs(1);
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(122);
/// The DRA manager's per-call timeout (PluginClientTimeout).
const CALL_TIMEOUT: Duration = Duration::from_secs(45);
/// The DRA services the kubelet speaks, newest first.
const DRA_SERVICES: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// A registered DRA driver.
#[derive(Clone, Debug)]
pub struct Registered {
    pub name: String,
    pub endpoint: PathBuf,
    pub service: &'static str,
    /// The registration socket it came through, and that socket's inode.
    socket: PathBuf,
    inode: u64,
    conn: Option<Channel>,
}

#[derive(Default)]
struct State {
    plugins: BTreeMap<String, Registered>,
    /// Per socket (by inode): when the next try may run and the backoff after that.
    retries: BTreeMap<(PathBuf, u64), (Instant, Duration)>,
    log: Vec<String>,
}

/// A running plugin watcher with its DRA manager.
pub struct PluginWatcher {
    pub registry: PathBuf,
    state: Arc<Mutex<State>>,
    stop: watch::Sender<bool>,
}

impl PluginWatcher {
    pub fn start(registry: &Path) -> Self {
        std::fs::create_dir_all(registry).expect("plugins_registry");
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, mut stopped) = watch::channel(false);
        let (dir, st) = (registry.to_owned(), state.clone());
        tokio::spawn(async move {
            loop {
                reconcile(&dir, &st).await;
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => break,
                    () = tokio::time::sleep(RECONCILE) => {}
                }
            }
        });
        Self {
            registry: registry.to_owned(),
            state,
            stop,
        }
    }

    /// The kubelet restarts: its in-memory registrations are gone and a new watcher starts.
    pub fn restart(&mut self) {
        *self = Self::start(&self.registry);
    }

    /// What the kubelet logged about registrations.
    pub fn log(&self) -> Vec<String> {
        self.lock().log.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn registered(&self, driver: &str) -> Option<Registered> {
        self.lock().plugins.get(driver).cloned()
    }

    /// The driver once registered, within `timeout`; else the kubelet's log.
    pub async fn wait_registered(
        &self,
        driver: &str,
        timeout: Duration,
    ) -> Result<Registered, String> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(r) = self.registered(driver) {
                return Ok(r);
            }
            if Instant::now() > until {
                return Err(self.log().join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One grpc-go connection per plugin, made on first use (getOrCreateGRPCConn).
    async fn client(&self, driver: &str) -> Result<DraPluginClient<Channel>, String> {
        let p = self
            .registered(driver)
            .ok_or_else(|| format!("DRA driver {driver} is not registered"))?;
        let conn = match p.conn {
            Some(c) => c,
            None => {
                let c = grpc_go::dial(&p.endpoint, Authority::SocketPath, Duration::from_secs(1))
                    .await
                    .map_err(|e| format!("connecting to {}: {e}", p.endpoint.display()))?;
                if let Some(p) = self.lock().plugins.get_mut(driver) {
                    p.conn = Some(c.clone());
                }
                c
            }
        };
        Ok(DraPluginClient::new(conn))
    }

    pub async fn prepare(
        &self,
        driver: &str,
        claims: Vec<pb::Claim>,
    ) -> Result<pb::NodePrepareResourcesResponse, String> {
        let mut c = self.client(driver).await?;
        let mut req = Request::new(pb::NodePrepareResourcesRequest { claims });
        req.set_timeout(CALL_TIMEOUT);
        c.node_prepare_resources(req)
            .await
            .map(|r| r.into_inner())
            .map_err(|s| grpc_go::go_error(&s))
    }

    pub async fn unprepare(
        &self,
        driver: &str,
        claims: Vec<pb::Claim>,
    ) -> Result<pb::NodeUnprepareResourcesResponse, String> {
        let mut c = self.client(driver).await?;
        let mut req = Request::new(pb::NodeUnprepareResourcesRequest { claims });
        req.set_timeout(CALL_TIMEOUT);
        c.node_unprepare_resources(req)
            .await
            .map(|r| r.into_inner())
            .map_err(|s| grpc_go::go_error(&s))
    }
}

impl Drop for PluginWatcher {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// One reconciler pass: deregister what went away, register what is new or recreated.
async fn reconcile(dir: &Path, state: &Arc<Mutex<State>>) {
    let sockets: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            m.file_type().is_socket().then(|| (e.path(), m.ino()))
        })
        .collect();
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    lock()
        .plugins
        .retain(|_, p| sockets.contains(&(p.socket.clone(), p.inode)));
    for (socket, inode) in sockets {
        let now = Instant::now();
        {
            let s = lock();
            let known = s
                .plugins
                .values()
                .any(|p| p.socket == socket && p.inode == inode);
            let waiting = s
                .retries
                .get(&(socket.clone(), inode))
                .is_some_and(|(next, _)| *next > now);
            if known || waiting {
                continue;
            }
        }
        if let Err(e) = register(&socket, inode, state).await {
            let mut s = lock();
            let backoff = s
                .retries
                .get(&(socket.clone(), inode))
                .map_or(FIRST_BACKOFF, |(_, b)| *b);
            s.log.push(e);
            s.retries.insert(
                (socket, inode),
                (Instant::now() + backoff, (backoff * 2).min(MAX_BACKOFF)),
            );
        }
    }
}

/// The RegisterPlugin operation (operation_generator.go) with the DRA handler.
async fn register(socket: &Path, inode: u64, state: &Arc<Mutex<State>>) -> Result<(), String> {
    let at = socket.display();
    let conn = grpc_go::dial(socket, Authority::SocketPath, DIAL_TIMEOUT)
        .await
        .map_err(|e| format!("RegisterPlugin error -- dial failed at socket {at}, err: {e}"))?;
    let mut client = RegistrationClient::new(conn);
    let mut req = Request::new(reg::InfoRequest {});
    req.set_timeout(GET_INFO_TIMEOUT);
    let info = client.get_info(req).await.map_err(|s| {
        format!(
            "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {at}, err: {}",
            grpc_go::go_error(&s)
        )
    })?;
    let info = info.into_inner();
    let refuse = |msg: String| async {
        let _ = notify(&mut client.clone(), false, &msg).await;
        Err(msg)
    };
    if info.r#type != "DRAPlugin" {
        return refuse(format!(
            "RegisterPlugin error -- no handler registered for plugin type: {} at socket {at}",
            info.r#type
        ))
        .await;
    }
    let Some(service) = DRA_SERVICES
        .into_iter()
        .find(|s| info.supported_versions.iter().any(|v| v == s))
    else {
        return refuse(format!(
            "RegisterPlugin error -- plugin validation failed with err: none of the versions are supported: {:?}",
            info.supported_versions
        ))
        .await;
    };
    let endpoint = if info.endpoint.is_empty() {
        socket.to_owned()
    } else {
        PathBuf::from(&info.endpoint)
    };
    // Added before the status is sent, as the kubelet does: a failed notify keeps it registered.
    let plugin = Registered {
        name: info.name.clone(),
        endpoint,
        service,
        socket: socket.to_owned(),
        inode,
        conn: None,
    };
    state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .plugins
        .insert(info.name, plugin);
    notify(&mut client, true, "").await.map_err(|e| {
        format!(
            "RegisterPlugin error -- failed to send registration status at socket {at}, err: {e}"
        )
    })
}

async fn notify(
    client: &mut RegistrationClient<Channel>,
    registered: bool,
    error: &str,
) -> Result<(), String> {
    let mut req = Request::new(reg::RegistrationStatus {
        plugin_registered: registered,
        error: error.to_owned(),
    });
    req.set_timeout(NOTIFY_TIMEOUT);
    client
        .notify_registration_status(req)
        .await
        .map(|_| ())
        .map_err(|s| grpc_go::go_error(&s))
}
