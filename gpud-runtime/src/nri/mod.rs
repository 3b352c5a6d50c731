//! The NRI plugin (`gpud-nri`): a long-running process that registers with the container
//! runtime's NRI socket (containerd 1.7+ with NRI enabled, 2.x; CRI-O 1.26+) and sets each
//! container's GPU shares from its pod's and its own annotations.
//!
//! Protocol: one unix-socket connection, multiplexed ([`mux`]) into two ttrpc connections; the
//! plugin serves NRI's `Plugin` service on one and calls the runtime's `Runtime` service on the
//! other ([`api`], generated from `gpud-runtime/proto/nri.proto`). The plugin calls `RegisterPlugin`;
//! the runtime answers with `Configure` (the plugin subscribes to events) and `Synchronize`
//! (every existing pod and container), then sends the subscribed events.
//!
//! What the plugin does:
//! - `Synchronize`: applies the shares of every created or running container (containers that
//!   existed before the plugin started); failures are logged, never returned (the runtime would
//!   drop the plugin).
//! - `CreateContainer`: validates the annotations; invalid ones fail the container when
//!   `on_invalid` is closed (the default), before anything runs.
//! - `StartContainer`: the container's process exists in its cgroup: resolves the cgroup (from
//!   the pid, else from `linux.cgroups_path`) and sets the shares.
//! - `StopContainer`, `RemoveContainer`: clears what was set.
//! - `StateChange`: the same for runtimes that deliver start and remove there (NRI < 0.12).
//! - Wherever it sets shares (at start, synchronize, a retry), it also names the container's
//!   workload to gpud ([`crate::workload`]), and the pod's on the pod's cgroup it limits.
//! - `Shutdown` or a closed connection: the plugin exits (a service manager restarts it; the
//!   next registration synchronizes again).

pub mod api;
mod config;
pub mod mux;
mod serve;

pub use config::{PluginConfig, RuntimeSettings};
pub use serve::{Ending, serve};

use std::{collections::HashMap, sync::Arc, time::Duration};

use api::{nri, nri_ttrpc};
use tokio::sync::{Mutex, Notify};
use tracing::{debug, info, warn};

use crate::report::Chain;

use super::{
    FailMode, RuntimeError,
    client::Client,
    trust::{self, Decision, Sources},
};

/// Where the pods' ledgers are kept by default ([`crate::pod`]).
pub const DEFAULT_LEDGER_DIR: &str = "/run/gpud-nri/pods";

/// How often shares that could not be set because gpud was unreachable are tried again.
pub const RETRY_EVERY: Duration = Duration::from_secs(2);

/// Environment variable through which a runtime that launched the plugin passes the connected
/// socket's file descriptor.
pub const PLUGIN_SOCKET_ENV: &str = "NRI_PLUGIN_SOCKET";
/// Environment variables with the name and index a runtime-launched plugin must register with.
pub const PLUGIN_NAME_ENV: &str = "NRI_PLUGIN_NAME";
pub const PLUGIN_IDX_ENV: &str = "NRI_PLUGIN_IDX";
/// Where runtimes listen for external plugins by default.
pub const DEFAULT_SOCKET: &str = "/var/run/nri/nri.sock";

/// Errors of the plugin's connection to the runtime.
#[derive(Debug, thiserror::Error)]
pub enum NriError {
    #[error("invalid plugin name {0:?}: use letters, digits and _ . + -")]
    InvalidName(String),
    #[error("invalid plugin index {0:?}: two digits, 00 to 99")]
    InvalidIndex(String),
    #[error(transparent)]
    Mux(#[from] mux::MuxError),
    #[error("a ttrpc call to the runtime failed")]
    Ttrpc(#[from] ttrpc::Error),
    #[error("registration refused or unanswered: {0}")]
    Register(String),
    #[error("the runtime did not configure the plugin within {0:?} of its registration")]
    NotConfigured(Duration),
    #[error("invalid plugin configuration from the runtime")]
    RuntimeConfig(#[from] toml::de::Error),
    #[error(
        "invalid plugin configuration from the runtime: timeout_ms must be 1 to 60000, not {0}"
    )]
    RuntimeTimeout(u64),
}

/// Event numbers (NRI's `Event` enum); bit `event - 1` of the subscription mask.
fn event_bit(e: nri::Event) -> i32 {
    1 << ((e as i32) - 1)
}

/// The events gpud's plugin subscribes to.
pub fn subscribed_events() -> i32 {
    event_bit(nri::Event::CREATE_CONTAINER)
        | event_bit(nri::Event::START_CONTAINER)
        | event_bit(nri::Event::STOP_CONTAINER)
        | event_bit(nri::Event::REMOVE_CONTAINER)
}

/// What was set on a container, to clear it later.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Tracked {
    cgroup: String,
    gpus: Vec<String>,
    /// The pod's cgroup whose ledger counts this container's grant.
    pod: Option<String>,
}

/// The plugin's state, shared by the ttrpc handlers.
struct Inner {
    /// The flags' configuration, with what the runtime's `Configure` set applied.
    cfg: std::sync::RwLock<PluginConfig>,
    /// Cached connection to gpud; dropped after a failure so that the next call reconnects.
    client: Mutex<Option<Client>>,
    /// Containers with shares set, by id.
    tracked: Mutex<HashMap<String, Tracked>>,
    /// Containers left without their shares because gpud could not be reached (the policy let
    /// them run, or a synchronization stopped), by id: applied again every [`RETRY_EVERY`] until
    /// gpud answers (it was restarted, or came up after the runtime) or they go.
    pending: Mutex<HashMap<String, (Option<nri::PodSandbox>, nri::Container)>>,
    /// Synchronize batches received with `more` set.
    pending_sync: Mutex<(Vec<nri::PodSandbox>, Vec<nri::Container>)>,
    configured: Notify,
    shutdown: Notify,
}

/// The `Plugin` service.
#[derive(Clone)]
pub struct Handler {
    inner: Arc<Inner>,
}

/// Whether `r` failed because gpud could not be asked (another call would wait out the timeout
/// again).
fn unreachable(r: &Result<(), RuntimeError>) -> bool {
    matches!(r, Err(e) if e.class() == super::FailureClass::Unreachable)
}

fn status(e: &RuntimeError) -> ttrpc::Error {
    let code = match e.class() {
        super::FailureClass::Invalid => ttrpc::Code::INVALID_ARGUMENT,
        super::FailureClass::Unreachable => ttrpc::Code::UNAVAILABLE,
    };
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, format!("gpud: {}", Chain(e))))
}

/// Whether a container's pod is a Kubernetes pod: CRI pods carry their namespace; containers of
/// other clients have no pod.
fn kubernetes_pod(pod: Option<&nri::PodSandbox>) -> bool {
    pod.is_some_and(|p| !p.namespace.is_empty())
}

/// The workload names of a Kubernetes container ([`crate::workload`]); none for others.
fn workload_of(pod: Option<&nri::PodSandbox>, c: &nri::Container) -> crate::workload::Names {
    match pod {
        Some(p) if kubernetes_pod(pod) => {
            crate::workload::of_container(&p.namespace, &p.name, &c.name)
        }
        _ => crate::workload::Names::new(),
    }
}

/// A short name of a container for logs: `namespace/pod/container (id)`.
fn describe(pod: Option<&nri::PodSandbox>, c: &nri::Container) -> String {
    let short: String = c.id.chars().take(12).collect();
    match pod {
        Some(p) if !p.name.is_empty() => {
            format!("{}/{}/{} ({short})", p.namespace, p.name, c.name)
        }
        _ if !c.name.is_empty() => format!("{} ({short})", c.name),
        _ => short,
    }
}

impl Handler {
    pub fn new(cfg: PluginConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                cfg: std::sync::RwLock::new(cfg),
                client: Mutex::new(None),
                tracked: Mutex::new(HashMap::new()),
                pending: Mutex::new(HashMap::new()),
                pending_sync: Mutex::new((Vec::new(), Vec::new())),
                configured: Notify::new(),
                shutdown: Notify::new(),
            }),
        }
    }

    /// The configuration in force (a poisoned lock still holds a whole value: writers only
    /// ever replace it).
    fn cfg(&self) -> PluginConfig {
        self.inner
            .cfg
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Resolves when the runtime asked the plugin to shut down.
    pub async fn shutdown_requested(&self) {
        self.inner.shutdown.notified().await;
    }

    /// Containers with shares set (id → cgroup), for tests and logs.
    pub async fn tracked(&self) -> HashMap<String, String> {
        self.inner
            .tracked
            .lock()
            .await
            .iter()
            .map(|(id, t)| (id.clone(), t.cgroup.clone()))
            .collect()
    }

    async fn client(&self) -> Result<Client, RuntimeError> {
        let mut slot = self.inner.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let cfg = self.cfg();
        let c = Client::connect(&cfg.bus, cfg.timeout).await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Forgets the cached connection after an error that may mean gpud went away.
    async fn on_error(&self, e: &RuntimeError) {
        if e.class() == super::FailureClass::Unreachable {
            *self.inner.client.lock().await = None;
        }
    }

    /// The container's shares: the pod's annotations asked, the container's own (a device
    /// plugin's) granted, weighed by [`trust`].
    fn decision(
        &self,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
    ) -> Result<Decision, RuntimeError> {
        let empty = HashMap::new();
        let pod_ann = pod.map_or(&empty, |p| &p.annotations);
        let own = trust::without_pod_copies(&c.annotations, pod_ann);
        let src = Sources {
            asked: pod_ann,
            granted: &own,
            name: (!c.name.is_empty()).then_some(c.name.as_str()),
            kubernetes: kubernetes_pod(pod),
        };
        Ok(trust::decide(&src, self.cfg().trust)?)
    }

    fn cgroup_of(c: &nri::Container) -> Result<String, RuntimeError> {
        if c.pid > 0 {
            match super::cgroup::of_pid(c.pid) {
                Ok(cg) => return Ok(cg),
                // The process may have exited already; the path may still name the cgroup.
                Err(e) => debug!(container = %c.id, "cgroup from pid {}: {e}", c.pid),
            }
        }
        let path = c
            .linux
            .as_ref()
            .map(|l| l.cgroups_path.as_str())
            .unwrap_or("");
        if path.is_empty() {
            return Err(RuntimeError::Cgroup(
                "the runtime gave neither a pid nor a cgroups path".into(),
            ));
        }
        super::cgroup::of_cgroups_path(path)
    }

    /// Sets a container's shares; `Ok(false)` when it asks for none.
    async fn apply(
        &self,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
    ) -> Result<bool, RuntimeError> {
        let Decision {
            shares,
            ignored,
            grant,
            ..
        } = self.decision(pod, c)?;
        for i in &ignored {
            warn!(container = %describe(pod, c), "{i}");
        }
        if shares.is_empty() {
            return Ok(false);
        }
        let cgroup = Self::cgroup_of(c)?;
        let client = self.client().await?;
        let (applied, result) = client.apply(&cgroup, &shares).await;
        let pod_result = self.add_to_pod(pod, c, &cgroup, &grant, &client).await;
        if !applied.gpus.is_empty() && !unreachable(&result) && !unreachable(&pod_result) {
            self.name_workload(pod, c, &client, &cgroup, &workload_of(pod, c))
                .await;
        }
        if !applied.gpus.is_empty() {
            info!(
                container = %describe(pod, c),
                cgroup = %cgroup,
                gpus = %applied.gpus.join(","),
                "GPU shares set"
            );
            for (gpu, why) in &applied.pending {
                info!(container = %describe(pod, c), gpu = %gpu, "stored, pending: {why}");
            }
            // Tracked whatever failed, so that removal clears what was set (a retry adds to it).
            self.track(&c.id, &cgroup, |t| {
                for gpu in applied.gpus {
                    if !t.gpus.contains(&gpu) {
                        t.gpus.push(gpu);
                    }
                }
            })
            .await;
        }
        if let Err(e) = result.and(pod_result) {
            self.on_error(&e).await;
            return Err(e);
        }
        Ok(true)
    }

    /// With `pod_limits`, a Kubernetes container's grant joins its pod's ledger and the pod's
    /// cgroup gets the sum of its containers' grants ([`crate::pod`]).
    async fn add_to_pod(
        &self,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
        cgroup: &str,
        grant: &crate::annotations::Shares,
        client: &Client,
    ) -> Result<(), RuntimeError> {
        let cfg = self.cfg();
        if !cfg.pod_limits || !kubernetes_pod(pod) || grant.is_empty() {
            return Ok(());
        }
        let Some(pod_cg) = crate::pod::pod_cgroup_of(cgroup) else {
            debug!(container = %describe(pod, c), %cgroup, "no pod cgroup above the container");
            return Ok(());
        };
        let change = crate::pod::Ledger::new(&cfg.ledger_dir).join(&pod_cg, &c.id, &c.id, grant)?;
        let (applied, result) = client.apply_change(&change).await;
        if !applied.gpus.is_empty() {
            info!(
                container = %describe(pod, c),
                pod = %pod_cg,
                gpus = %applied.gpus.join(","),
                "the pod's cgroup carries its containers' grants"
            );
        }
        if !applied.gpus.is_empty() && !unreachable(&result) {
            let names = crate::workload::of_pod(&workload_of(pod, c));
            self.name_workload(pod, c, client, &pod_cg, &names).await;
        }
        self.track(&c.id, cgroup, |t| t.pod = Some(pod_cg)).await;
        result
    }

    /// Reports `names` as the workload of `cgroup` (the container's or its pod's). Only a
    /// warning when that fails: no limit depends on the names.
    async fn name_workload(
        &self,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
        client: &Client,
        cgroup: &str,
        names: &crate::workload::Names,
    ) {
        if names.is_empty() {
            return;
        }
        if let Err(e) = client.set_workload(cgroup, names).await {
            self.on_error(&e).await;
            warn!(
                container = %describe(pod, c),
                %cgroup,
                "workload names not reported: {}",
                Chain(&e)
            );
        }
    }

    /// Records on container `id` (in `cgroup`) what `update` adds, for its removal to clear.
    async fn track(&self, id: &str, cgroup: &str, update: impl FnOnce(&mut Tracked)) {
        let mut tracked = self.inner.tracked.lock().await;
        let t = tracked.entry(id.to_owned()).or_insert_with(|| Tracked {
            cgroup: cgroup.to_owned(),
            gpus: Vec::new(),
            pod: None,
        });
        t.cgroup = cgroup.to_owned();
        update(t);
    }

    /// Clears what was set on a container, if anything.
    async fn clear(
        &self,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
    ) -> Result<(), RuntimeError> {
        let Some(t) = self.inner.tracked.lock().await.remove(&c.id) else {
            return Ok(());
        };
        // The pod's ledger loses the container whatever gpud answers.
        let change = t
            .pod
            .as_ref()
            .map(|pod_cg| crate::pod::Ledger::new(&self.cfg().ledger_dir).leave(pod_cg, &c.id));
        let result = match self.client().await {
            Ok(client) => match client.clear(&t.cgroup, &t.gpus).await {
                Ok(()) => match change {
                    Some(change) => client.apply_change(&change?).await.1,
                    None => Ok(()),
                },
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match &result {
            Ok(()) => {
                info!(container = %describe(pod, c), cgroup = %t.cgroup, "GPU shares cleared")
            }
            Err(e) => {
                self.on_error(e).await;
                warn!(container = %describe(pod, c), "cannot clear GPU shares: {}", Chain(e));
            }
        }
        result
    }

    /// Applies the failure policy to an event's result: `Err` fails the runtime's request.
    fn decide(
        &self,
        what: &str,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
        r: Result<(), RuntimeError>,
    ) -> ttrpc::Result<()> {
        let Err(e) = r else { return Ok(()) };
        let granted = self.decision(pod, c).is_ok_and(|d| d.granted());
        match self.cfg().policy.mode_for(&e, granted) {
            FailMode::Closed => {
                warn!(container = %describe(pod, c), "{what}: {}; failing the container (closed)", Chain(&e));
                Err(status(&e))
            }
            FailMode::Open => {
                warn!(
                    container = %describe(pod, c),
                    "{what}: {}; the container runs without GPU shares (open)",
                    Chain(&e)
                );
                Ok(())
            }
        }
    }

    async fn on_start(
        &self,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
    ) -> ttrpc::Result<()> {
        let r = self.apply(pod, c).await.map(|_| ());
        let unreachable = matches!(&r, Err(e) if e.class() == super::FailureClass::Unreachable);
        self.decide("StartContainer", pod, c, r)?;
        if unreachable {
            // Running without its shares (open): set them once gpud answers.
            self.wait_for_gpud(pod, c).await;
        }
        Ok(())
    }

    /// Remembers a container whose shares wait for gpud to answer ([`Self::retry_pending`]).
    async fn wait_for_gpud(&self, pod: Option<&nri::PodSandbox>, c: &nri::Container) {
        self.inner
            .pending
            .lock()
            .await
            .insert(c.id.clone(), (pod.cloned(), c.clone()));
    }

    /// Applies the shares of the containers left without them while gpud was unreachable;
    /// stops at the first that still cannot reach it.
    pub async fn retry_pending(&self) {
        let waiting: Vec<(String, (Option<nri::PodSandbox>, nri::Container))> = self
            .inner
            .pending
            .lock()
            .await
            .iter()
            .map(|(id, v)| (id.clone(), v.clone()))
            .collect();
        for (id, (pod, c)) in waiting {
            match self.apply(pod.as_ref(), &c).await {
                Err(e) if e.class() == super::FailureClass::Unreachable => return,
                Err(e) => warn!(
                    container = %describe(pod.as_ref(), &c),
                    "GPU shares still not set, and will not be: {}",
                    Chain(&e)
                ),
                Ok(true) => info!(
                    container = %describe(pod.as_ref(), &c),
                    "gpud answers again: GPU shares set late"
                ),
                Ok(false) => {}
            }
            self.inner.pending.lock().await.remove(&id);
        }
    }

    async fn on_remove(
        &self,
        pod: Option<&nri::PodSandbox>,
        c: &nri::Container,
    ) -> ttrpc::Result<()> {
        self.inner.pending.lock().await.remove(&c.id);
        // Clearing cannot fail a container that is going away: only logged.
        let _ = self.clear(pod, c).await;
        Ok(())
    }

    /// Applies the shares of every existing container.
    async fn synchronize_all(&self, pods: &[nri::PodSandbox], containers: &[nri::Container]) {
        let by_id: HashMap<&str, &nri::PodSandbox> =
            pods.iter().map(|p| (p.id.as_str(), p)).collect();
        let (mut set, mut failed) = (0usize, 0usize);
        let mut unreachable = false;
        for c in containers {
            let live = matches!(
                c.state.enum_value(),
                Ok(nri::ContainerState::CONTAINER_CREATED
                    | nri::ContainerState::CONTAINER_RUNNING
                    | nri::ContainerState::CONTAINER_PAUSED)
            );
            if !live {
                continue;
            }
            let pod = by_id.get(c.pod_sandbox_id.as_str()).copied();
            if unreachable {
                // One timeout is enough: the rest wait for gpud too.
                self.wait_for_gpud(pod, c).await;
                continue;
            }
            match self.apply(pod, c).await {
                Ok(true) => set += 1,
                Ok(false) => {}
                Err(e) if e.class() == super::FailureClass::Unreachable => {
                    warn!(
                        "synchronize: {}; the remaining containers get their shares once gpud \
                         answers",
                        Chain(&e)
                    );
                    failed += 1;
                    unreachable = true;
                    self.wait_for_gpud(pod, c).await;
                }
                Err(e) => {
                    failed += 1;
                    warn!(container = %describe(pod, c), "synchronize: {}", Chain(&e));
                }
            }
        }
        info!(
            pods = pods.len(),
            containers = containers.len(),
            with_shares = set,
            failed,
            "synchronized with the runtime"
        );
    }
}

#[async_trait::async_trait]
impl nri_ttrpc::Plugin for Handler {
    async fn configure(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::ConfigureRequest,
    ) -> ttrpc::Result<nri::ConfigureResponse> {
        info!(
            runtime = %req.runtime_name,
            version = %req.runtime_version,
            nri = %req.NRI_version,
            "configured by the runtime"
        );
        let settings = RuntimeSettings::parse(&req.config).map_err(|e| {
            warn!("refusing the runtime's configuration: {}", Chain(&e));
            ttrpc::Error::RpcStatus(ttrpc::get_status(
                ttrpc::Code::INVALID_ARGUMENT,
                format!("gpud: {}", Chain(&e)),
            ))
        })?;
        if settings != RuntimeSettings::default() {
            let cfg = settings.apply(self.cfg());
            info!(
                bus = %cfg.bus,
                timeout = ?cfg.timeout,
                policy = ?cfg.policy,
                annotation_trust = %cfg.trust,
                "configuration from the runtime applied"
            );
            *self
                .inner
                .cfg
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = cfg;
            // The bus may have changed.
            *self.inner.client.lock().await = None;
        }
        let budget = Duration::from_millis(u64::try_from(req.request_timeout).unwrap_or(0));
        let timeout = self.cfg().timeout;
        if !budget.is_zero() && timeout >= budget {
            warn!(
                "the D-Bus timeout ({timeout:?}) is not below the runtime's request timeout \
                 ({budget:?}): a slow gpud would make the runtime drop this plugin"
            );
        }
        self.inner.configured.notify_one();
        Ok(nri::ConfigureResponse {
            events: subscribed_events(),
            ..Default::default()
        })
    }

    async fn synchronize(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::SynchronizeRequest,
    ) -> ttrpc::Result<nri::SynchronizeResponse> {
        let more = req.more;
        let (pods, containers) = {
            let mut pending = self.inner.pending_sync.lock().await;
            pending.0.extend(req.pods);
            pending.1.extend(req.containers);
            if more {
                // Answer `more` as asked: the runtime sends the rest.
                return Ok(nri::SynchronizeResponse {
                    more,
                    ..Default::default()
                });
            }
            std::mem::take(&mut *pending)
        };
        // Answered at once, applied in the background: the runtime bounds each request (2 s by
        // default) and drops a plugin that overruns it.
        let this = self.clone();
        tokio::spawn(async move { this.synchronize_all(&pods, &containers).await });
        Ok(nri::SynchronizeResponse::default())
    }

    async fn shutdown(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        _req: nri::Empty,
    ) -> ttrpc::Result<nri::Empty> {
        info!("the runtime is shutting down");
        self.inner.shutdown.notify_one();
        Ok(nri::Empty::default())
    }

    async fn create_container(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::CreateContainerRequest,
    ) -> ttrpc::Result<nri::CreateContainerResponse> {
        let pod = req.pod.as_ref();
        let c = req.container.get_or_default();
        // Only validation: the container's cgroup does not exist yet.
        let r = self.decision(pod, c).map(|_| ());
        self.decide("CreateContainer", pod, c, r)?;
        Ok(nri::CreateContainerResponse::default())
    }

    async fn start_container(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::StartContainerRequest,
    ) -> ttrpc::Result<nri::StartContainerResponse> {
        self.on_start(req.pod.as_ref(), req.container.get_or_default())
            .await?;
        Ok(nri::StartContainerResponse::default())
    }

    async fn stop_container(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::StopContainerRequest,
    ) -> ttrpc::Result<nri::StopContainerResponse> {
        self.on_remove(req.pod.as_ref(), req.container.get_or_default())
            .await?;
        Ok(nri::StopContainerResponse::default())
    }

    async fn remove_container(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::RemoveContainerRequest,
    ) -> ttrpc::Result<nri::RemoveContainerResponse> {
        self.on_remove(req.pod.as_ref(), req.container.get_or_default())
            .await?;
        Ok(nri::RemoveContainerResponse::default())
    }

    async fn state_change(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::StateChangeEvent,
    ) -> ttrpc::Result<nri::Empty> {
        let pod = req.pod.as_ref();
        let c = req.container.get_or_default();
        match req.event.enum_value() {
            Ok(nri::Event::START_CONTAINER) => self.on_start(pod, c).await?,
            Ok(nri::Event::STOP_CONTAINER | nri::Event::REMOVE_CONTAINER) => {
                self.on_remove(pod, c).await?
            }
            other => debug!("state change {other:?} ignored"),
        }
        Ok(nri::Empty::default())
    }
}
