//! The plugin-registration socket the kubelet's plugin watcher finds in `plugins_registry`:
//! `GetInfo` names the driver, its DRA socket and service version; `NotifyRegistrationStatus`
//! tells whether the kubelet took it. The socket is served again whenever it goes away (a
//! kubelet or an operator clearing the directory), so the kubelet always finds the driver.

use std::path::{Path, PathBuf};

use futures_util::StreamExt as _;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::{DraError, SERVICE_VERSION};
use crate::{
    api::pluginregistration::{
        self as reg,
        registration_server::{Registration, RegistrationServer},
    },
    grpc,
};

struct RegistrationService {
    info: reg::PluginInfo,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = request.get_ref();
        if s.plugin_registered {
            tracing::info!("registered with the kubelet ({SERVICE_VERSION})");
        } else {
            tracing::error!("the kubelet refused the registration: {}", s.error);
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// Serves registration for `info` on `socket` until `stop`, binding the socket anew each time
/// it is removed. The socket is removed on the way out.
pub async fn serve(
    info: reg::PluginInfo,
    socket: PathBuf,
    mut stop: watch::Receiver<bool>,
) -> Result<(), DraError> {
    let io = |p: &Path| {
        let p = p.to_owned();
        move |source| DraError::Io { path: p, source }
    };
    let dir = socket
        .parent()
        .ok_or_else(|| DraError::Config(format!("{} has no directory", socket.display())))?
        .to_owned();
    let name = socket.file_name().map(ToOwned::to_owned);
    // Watched before the first bind, so no removal goes unseen.
    let mut events = grpc::watch_dir(
        &dir,
        inotify::WatchMask::DELETE | inotify::WatchMask::MOVED_FROM,
    )
    .map_err(io(&dir))?;
    loop {
        let listener = grpc::bind(&socket).map_err(io(&socket))?;
        let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(
            RegistrationService { info: info.clone() },
        ));
        let (stop_server, server_stopped) = watch::channel(false);
        let server = tokio::spawn(grpc::serve(router, listener, async move {
            let mut s = server_stopped;
            let _ = s.wait_for(|s| *s).await;
        }));
        let again = loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break false,
                ev = events.next() => match ev {
                    Some(Ok(e)) if e.name == name => break true,
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::warn!("watching {}: {e}", dir.display()),
                    None => break false,
                },
            }
        };
        let _ = stop_server.send(true);
        if let Ok(Err(e)) = server.await {
            tracing::warn!("registration server: {e}");
        }
        if !again {
            let _ = std::fs::remove_file(&socket);
            return Ok(());
        }
        tracing::info!(
            "{} was removed; serving it again for the kubelet's plugin watcher",
            socket.display()
        );
    }
}
