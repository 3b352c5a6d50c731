//! The runtime side of NRI for the tests: a [`TestRuntime`] that accepts a plugin's connection
//! and registration over the real protocol (multiplexed ttrpc, gpud-runtime's generated code),
//! the [`Session`] calls a runtime makes, the pods and containers it describes, and the
//! `gpud-nri` plugin process ([`NriPlugin`]).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use gpud_runtime::nri::{
    api::{nri, nri_ttrpc},
    mux::{self, Mux},
};
use tokio::sync::mpsc;

use crate::bin_dir;

/// What the test runtime saw of the plugin's registration.
pub type Registration = nri::RegisterPluginRequest;

/// The runtime side of NRI: serves `Runtime` (registration) and calls the plugin's `Plugin`
/// service, over one accepted connection multiplexed as NRI does.
pub struct TestRuntime {
    listener: tokio::net::UnixListener,
    pub socket: PathBuf,
}

/// One plugin's connection.
pub struct Session {
    pub plugin: nri_ttrpc::PluginClient,
    pub registration: Registration,
    pub mux: Mux,
    _server: ttrpc::r#async::Server,
}

struct RuntimeService {
    registered: mpsc::Sender<Registration>,
}

#[async_trait::async_trait]
impl nri_ttrpc::Runtime for RuntimeService {
    async fn register_plugin(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: nri::RegisterPluginRequest,
    ) -> ttrpc::Result<nri::Empty> {
        // NRI's own checks (CheckPluginName, CheckPluginIndex).
        let name_ok = !req.plugin_name.is_empty()
            && req
                .plugin_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.+-".contains(&b));
        let idx_ok =
            req.plugin_idx.len() == 2 && req.plugin_idx.bytes().all(|b| b.is_ascii_digit());
        if !name_ok || !idx_ok {
            return Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
                ttrpc::Code::INVALID_ARGUMENT,
                "invalid plugin name or index",
            )));
        }
        let _ = self.registered.send(req).await;
        Ok(nri::Empty::default())
    }
}

impl TestRuntime {
    pub fn bind(dir: &Path) -> Self {
        let socket = dir.join("nri.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind NRI socket");
        Self { listener, socket }
    }

    /// Accepts a raw connection (for wire-level checks).
    pub async fn accept_raw(&self, timeout: Duration) -> tokio::net::UnixStream {
        tokio::time::timeout(timeout, self.listener.accept())
            .await
            .expect("the plugin did not connect in time")
            .expect("accept")
            .0
    }

    /// Accepts the plugin's connection and waits for its registration.
    pub async fn accept(&self, timeout: Duration) -> Session {
        let conn = self.accept_raw(timeout).await;
        Self::session(conn, timeout).await
    }

    /// Runs NRI's runtime side on an accepted connection until the plugin registered.
    pub async fn session<T>(conn: T, timeout: Duration) -> Session
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    {
        use futures_util::StreamExt as _;
        let (mux, mut conns) =
            Mux::start(conn, &[mux::PLUGIN_SERVICE_CONN, mux::RUNTIME_SERVICE_CONN]).expect("mux");
        let plugin_conn = conns.remove(&mux::PLUGIN_SERVICE_CONN).expect("conn 1");
        let runtime_conn = conns.remove(&mux::RUNTIME_SERVICE_CONN).expect("conn 2");
        let (tx, mut rx) = mpsc::channel(1);
        let incoming = futures_util::stream::once(async move { Ok(runtime_conn) })
            .chain(futures_util::stream::pending());
        let mut server = ttrpc::r#async::Server::new()
            .add_listener(ttrpc::r#async::transport::Listener::new(incoming))
            .register_service(nri_ttrpc::create_runtime(Arc::new(RuntimeService {
                registered: tx,
            })));
        server.start().await.expect("serve Runtime");
        let client =
            ttrpc::r#async::Client::new(ttrpc::r#async::transport::Socket::new(plugin_conn));
        let registration = tokio::time::timeout(timeout, rx.recv())
            .await
            .expect("the plugin did not register in time")
            .expect("registration");
        Session {
            plugin: nri_ttrpc::PluginClient::new(client),
            registration,
            mux,
            _server: server,
        }
    }
}

/// The container calls of a session, each for one container of one pod, as a runtime sends them.
macro_rules! container_calls {
    ($($(#[$doc:meta])* $name:ident: $method:ident($req:ident) -> $resp:ident;)*) => {
        impl Session {
            $(
                $(#[$doc])*
                pub async fn $name(
                    &self,
                    pod: &nri::PodSandbox,
                    container: &nri::Container,
                ) -> ttrpc::Result<nri::$resp> {
                    let req = nri::$req {
                        pod: Some(pod.clone()).into(),
                        container: Some(container.clone()).into(),
                        ..Default::default()
                    };
                    self.plugin.$method(ctx(), &req).await
                }
            )*
        }
    };
}

container_calls! {
    /// `CreateContainer`.
    create: create_container(CreateContainerRequest) -> CreateContainerResponse;
    /// `StartContainer` (NRI >= 0.12; older runtimes send a `StateChange`).
    start: start_container(StartContainerRequest) -> StartContainerResponse;
    /// `StopContainer`.
    stop: stop_container(StopContainerRequest) -> StopContainerResponse;
    /// `RemoveContainer`.
    remove: remove_container(RemoveContainerRequest) -> RemoveContainerResponse;
}

impl Session {
    /// `Configure` with [`configure_request`].
    pub async fn configure(&self) -> ttrpc::Result<nri::ConfigureResponse> {
        self.configure_with("").await
    }

    /// `Configure` handing over `config`, the text of the plugin's configuration file.
    pub async fn configure_with(&self, config: &str) -> ttrpc::Result<nri::ConfigureResponse> {
        let mut req = configure_request();
        req.config = config.to_owned();
        self.plugin.configure(ctx(), &req).await
    }

    /// `StateChange` with `event` for `container` of `pod`, as older runtimes deliver starts
    /// and removals.
    pub async fn state_change(
        &self,
        event: nri::Event,
        pod: &nri::PodSandbox,
        container: &nri::Container,
    ) -> ttrpc::Result<nri::Empty> {
        let req = nri::StateChangeEvent {
            event: event.into(),
            pod: Some(pod.clone()).into(),
            container: Some(container.clone()).into(),
            ..Default::default()
        };
        self.plugin.state_change(ctx(), &req).await
    }
}

/// The `Configure` request of a runtime (containerd's timeouts, NRI v0.12.0).
pub fn configure_request() -> nri::ConfigureRequest {
    nri::ConfigureRequest {
        runtime_name: "gpud-test-runtime".into(),
        runtime_version: "1.0".into(),
        registration_timeout: 5000,
        request_timeout: 2000,
        NRI_version: "v0.12.0".into(),
        ..Default::default()
    }
}

/// A ttrpc context with NRI's default request timeout (2 s).
pub fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_duration(Duration::from_secs(2))
}

/// A pod as a runtime describes it.
pub fn pod(id: &str, name: &str, annotations: &[(&str, &str)]) -> nri::PodSandbox {
    nri::PodSandbox {
        id: id.to_owned(),
        name: name.to_owned(),
        namespace: "default".to_owned(),
        uid: format!("uid-{id}"),
        annotations: annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    }
}

/// A container as a runtime describes it: its pid (0: none) and cgroups path.
pub fn container(
    id: &str,
    pod: &nri::PodSandbox,
    name: &str,
    state: nri::ContainerState,
    pid: u32,
    cgroups_path: &str,
    annotations: &[(&str, &str)],
) -> nri::Container {
    let mut linux = nri::LinuxContainer::new();
    linux.cgroups_path = cgroups_path.to_owned();
    nri::Container {
        id: id.to_owned(),
        pod_sandbox_id: pod.id.clone(),
        name: name.to_owned(),
        state: state.into(),
        pid,
        linux: Some(linux).into(),
        annotations: annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    }
}

/// A running `gpud-nri`, killed on drop.
pub struct NriPlugin {
    child: std::process::Child,
    pub log: PathBuf,
}

impl NriPlugin {
    /// Starts `gpud-nri ARGS` with its log in `log` and its pods' ledgers beside it.
    pub fn start(args: &[&str], log: &Path) -> Self {
        let log_file = std::fs::File::create(log).expect("plugin log");
        let ledgers = log.with_extension("pods");
        let child = Command::new(bin_dir().join("gpud-nri"))
            .args(args)
            .arg("--log")
            .arg("gpud=debug,gpud_nri=debug")
            .env("GPUD_NRI_LEDGER_DIR", &ledgers)
            .env_remove(gpud_runtime::nri::PLUGIN_SOCKET_ENV)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start gpud-nri");
        Self {
            child,
            log: log.to_owned(),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `timeout` for the plugin to exit; its exit code.
    pub async fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for NriPlugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
