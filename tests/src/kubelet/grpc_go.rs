//! Dialing a plugin's socket as the kubelet's grpc-go does, so that a plugin is tested against
//! what a real kubelet puts on the wire and not what tonic's client would send.
//!
//! - The plugin watcher (pkg/kubelet/pluginmanager/operationexecutor) and the DRA manager
//!   (pkg/kubelet/cm/dra/plugin) dial `grpc.DialContext(ctx, socketPath, insecure, WithBlock,
//!   WithContextDialer(unix))` with no `WithAuthority`. grpc-go then resolves the target with
//!   its passthrough resolver, takes the endpoint (the path) as the authority and percent-encodes
//!   it (`encodeAuthority`): `/var/lib/…/x.sock` is sent as `%2Fvar%2Flib%2F…%2Fx.sock`.
//! - The device manager's client (pkg/kubelet/cm/devicemanager/plugin/v1beta1) adds
//!   `WithAuthority("localhost")`.
//! - HTTP/2 as grpc-go's defaults: 64 KiB stream and connection windows grown by BDP estimation,
//!   16 KiB frames, user agent `grpc-go/…`; the calls' deadlines go as `grpc-timeout`.
//!
//! `http::Uri` cannot hold grpc-go's authority, so the client's header blocks are re-encoded on
//! the way out (`gpud_k8s::grpc::authority::Rewriting::client`).

use std::{path::Path, time::Duration};

use gpud_k8s::grpc::authority::Rewriting;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The grpc-go release of Kubernetes 1.34–1.36 (go.mod of those releases: 1.72–1.75), as its
/// user agent.
const USER_AGENT: &str = "grpc-go/1.72.2";
/// grpc-go's initial stream and connection windows (defaultWindowSize).
const WINDOW: u32 = 65_535;

/// The `:authority` a kubelet client sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authority {
    /// No `WithAuthority`: the socket path, as grpc-go encodes it (plugin watcher, DRA manager).
    SocketPath,
    /// `WithAuthority("localhost")` (device manager).
    Localhost,
}

/// grpc-go's `encodeAuthority`: RFC 3986 §3.2's unreserved, sub-delims and authority
/// delimiters kept, every other byte as `%XX`.
pub fn encode_authority(s: &str) -> String {
    let keep = |c: u8| c.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&c);
    s.bytes()
        .map(|c| {
            if keep(c) {
                char::from(c).to_string()
            } else {
                format!("%{c:02X}")
            }
        })
        .collect()
}

/// The authority grpc-go sends for `path` under `authority`.
pub fn wire_authority(path: &Path, authority: Authority) -> String {
    match authority {
        Authority::SocketPath => encode_authority(&path.display().to_string()),
        Authority::Localhost => "localhost".to_owned(),
    }
}

/// Dials `path` as grpc-go with `WithBlock`: the connection is made (or fails) within `timeout`.
pub async fn dial(
    path: &Path,
    authority: Authority,
    timeout: Duration,
) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_owned();
    let wire = wire_authority(&path, authority).into_bytes();
    Endpoint::from_static("http://localhost")
        .user_agent(USER_AGENT)?
        .initial_stream_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .http2_adaptive_window(true)
        .connect_timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let (path, wire) = (path.clone(), wire.clone());
            async move {
                let s = UnixStream::connect(path).await?;
                let map = Box::new(move |_: Option<&[u8]>| Some(wire.clone()));
                Ok::<_, std::io::Error>(TokioIo::new(Rewriting::client(s, map)))
            }
        }))
        .await
}

/// A gRPC error as grpc-go prints it (`rpc error: code = … desc = …`); a stream the server
/// reset reads as grpc-go words it.
pub fn go_error(s: &tonic::Status) -> String {
    let mut source = std::error::Error::source(s);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>()
            && h2.is_reset()
            && let Some(reason) = h2.reason()
        {
            return format!(
                "rpc error: code = {:?} desc = stream terminated by RST_STREAM with error code: {reason:?}",
                s.code()
            );
        }
        source = e.source();
    }
    format!("rpc error: code = {:?} desc = {}", s.code(), s.message())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_encoded_as_grpc_go_does() {
        assert_eq!(
            encode_authority("/var/lib/kubelet/plugins_registry/gpu.gpud.dev-reg.sock"),
            "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.gpud.dev-reg.sock"
        );
        assert_eq!(encode_authority("localhost:80"), "localhost:80");
        assert_eq!(encode_authority("a b/c%"), "a%20b%2Fc%25");
    }
}
