//! The plugin's life on one connection to the runtime: serve `Plugin`, register, wait for
//! `Configure`, retry what gpud could not be asked, until `Shutdown` or the connection closes.

use std::{sync::Arc, time::Duration};

use tracing::info;

use super::{Handler, NriError, RETRY_EVERY, api::nri, api::nri_ttrpc, mux};

/// How long the plugin lets its Shutdown reply go out before it closes the connection itself.
const SHUTDOWN_REPLY: Duration = Duration::from_millis(500);

/// Why [`serve`] returned.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// The runtime called `Shutdown`.
    Shutdown,
    /// The connection closed (the runtime stopped or dropped the plugin).
    Disconnected(String),
}

/// Runs the plugin on a connected NRI socket until the runtime shuts it down or the connection
/// closes: serves `Plugin`, registers, and waits for the runtime's `Configure`.
pub async fn serve<T>(trunk: T, handler: Handler) -> Result<Ending, NriError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    use futures_util::StreamExt as _;
    let cfg = handler.cfg();
    cfg.validate()?;
    let (mut mux, mut conns) = mux::Mux::start(
        trunk,
        &[mux::PLUGIN_SERVICE_CONN, mux::RUNTIME_SERVICE_CONN],
    )?;
    let (Some(plugin_conn), Some(runtime_conn)) = (
        conns.remove(&mux::PLUGIN_SERVICE_CONN),
        conns.remove(&mux::RUNTIME_SERVICE_CONN),
    ) else {
        return Err(NriError::Mux(mux::MuxError::Closed));
    };
    // The Plugin service: the runtime's one connection, then no more.
    let incoming = futures_util::stream::once(async move { Ok(plugin_conn) })
        .chain(futures_util::stream::pending());
    let mut server = ttrpc::r#async::Server::new()
        .add_listener(ttrpc::r#async::transport::Listener::new(incoming))
        .register_service(nri_ttrpc::create_plugin(Arc::new(handler.clone())));
    server.start().await?;

    let client = ttrpc::r#async::Client::new(ttrpc::r#async::transport::Socket::new(runtime_conn));
    let runtime = nri_ttrpc::RuntimeClient::new(client);
    let configured = handler.inner.configured.notified();
    tokio::pin!(configured);
    // Registered before the request goes out: Configure may arrive before its answer.
    configured.as_mut().enable();
    let req = nri::RegisterPluginRequest {
        plugin_name: cfg.name.clone(),
        plugin_idx: cfg.idx.clone(),
        NRI_version: String::new(),
        ..Default::default()
    };
    info!(name = %cfg.name, idx = %cfg.idx, "registering with the runtime");
    let registered = tokio::select! {
        r = runtime.register_plugin(ttrpc::context::with_duration(cfg.timeout), &req) => r,
        why = mux.closed() => {
            let _ = server.shutdown().await;
            return Ok(Ending::Disconnected(why.to_string()));
        }
    };
    if let Err(e) = registered {
        let _ = server.shutdown().await;
        return Err(NriError::Register(e.to_string()));
    }
    let wait = cfg.timeout.max(Duration::from_secs(5));
    tokio::select! {
        () = &mut configured => {}
        why = mux.closed() => {
            let _ = server.shutdown().await;
            return Ok(Ending::Disconnected(why.to_string()));
        }
        () = tokio::time::sleep(wait) => {
            let _ = server.shutdown().await;
            return Err(NriError::NotConfigured(wait));
        }
    }
    let retries = {
        let handler = handler.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(RETRY_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                handler.retry_pending().await;
            }
        })
    };
    let ending = tokio::select! {
        () = handler.shutdown_requested() => Ending::Shutdown,
        why = mux.closed() => Ending::Disconnected(why.to_string()),
    };
    if matches!(ending, Ending::Shutdown) {
        // The Shutdown reply is still on its way out when the handler asks to end: closing the
        // connection now could cut it (the runtime sees an early EOF). The runtime closes the
        // connection once answered; wait for that, a short while at most.
        let _ = tokio::time::timeout(SHUTDOWN_REPLY, mux.closed()).await;
    }
    retries.abort();
    let _ = server.shutdown().await;
    mux.shutdown();
    drop(runtime);
    Ok(ending)
}
