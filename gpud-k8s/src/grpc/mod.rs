//! gRPC over unix sockets, as the kubelet speaks it: a tonic server on a listening socket that
//! stops when told and takes the kubelet's `:authority` ([`authority`]), and a client channel to
//! a socket path.

pub mod authority;

use std::{future::Future, path::Path};

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{StreamExt as _, wrappers::UnixListenerStream};
use tonic::transport::{Channel, Endpoint, Uri};

/// A channel to the gRPC server on the unix socket `path` (connected on first use; each
/// reconnection dials the path again, so a recreated socket is found).
pub fn unix_channel(path: &Path) -> Channel {
    let path = path.to_owned();
    // The URI is required by the HTTP/2 layer and otherwise unused: the connector dials `path`.
    Endpoint::from_static("http://localhost").connect_with_connector_lazy(tower::service_fn(
        move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        },
    ))
}

/// Names appearing in or leaving the kubelet's socket directory `dir` (`mask`), as a stream.
pub fn watch_dir(
    dir: &Path,
    mask: inotify::WatchMask,
) -> std::io::Result<inotify::EventStream<[u8; 4096]>> {
    let inotify = inotify::Inotify::init()?;
    inotify.watches().add(dir, mask)?;
    inotify.into_event_stream([0u8; 4096])
}

/// Binds `path` (removing a stale socket file first) for a gRPC server.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    UnixListener::bind(path)
}

/// Serves `router` on `listener` until `stop` completes. Each connection is read through
/// [`authority::Rewriting::server`], so a grpc-go client that dials the socket by path (the
/// kubelet's plugin watcher and DRA manager) is served instead of reset.
pub async fn serve(
    router: tonic::transport::server::Router,
    listener: UnixListener,
    stop: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    router
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener).map(|c| c.map(authority::Rewriting::server)),
            stop,
        )
        .await
}
