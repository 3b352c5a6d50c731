//! `gpud-nri`: NRI plugin that sets each container's GPU shares from its pod's and its own
//! annotations through gpud (docs/runtime-integration.md).
//!
//! Runs beside the runtime (a systemd service) and connects to its NRI socket, or is launched by
//! the runtime from its plugin directory, which hands it a connected socket in
//! `NRI_PLUGIN_SOCKET` and its name and index in `NRI_PLUGIN_NAME` and `NRI_PLUGIN_IDX`.
//!
//! Exit status: 0 when the runtime shut the plugin down or on SIGTERM/SIGINT; 1 when the
//! connection was lost or could not be made (a service manager restarts it); 2 bad usage.

use std::{os::fd::FromRawFd as _, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::Parser;
use gpud_runtime::{
    FailMode, FailPolicy,
    nri::{self, Ending, Handler, PluginConfig},
    trust::Trust,
};
use tracing::{error, info};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "NRI plugin: GPU shares from pod and container annotations, through gpud"
)]
struct Args {
    /// The runtime's NRI socket.
    #[arg(long, env = "GPUD_NRI_SOCKET", default_value = nri::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Name to register with (NRI_PLUGIN_NAME wins when the runtime launched the plugin).
    #[arg(long, default_value = "gpud")]
    name: String,
    /// Index to register with, two digits: plugins are called in ascending order.
    #[arg(long, default_value = "50")]
    idx: String,
    /// D-Bus address of gpud's bus (default: the system bus).
    #[arg(long, env = "GPUD_BUS_ADDRESS", value_name = "ADDRESS")]
    bus_address: Option<String>,
    /// Bound of each call to gpud, in milliseconds; keep it below the runtime's NRI request
    /// timeout (2 s by default).
    #[arg(long, env = "GPUD_NRI_TIMEOUT_MS", default_value_t = 1000)]
    timeout_ms: u64,
    /// Invalid annotations (or a cgroup that cannot be found, a limit gpud refuses): fail the
    /// container (closed) or run it without shares (open).
    #[arg(long, env = "GPUD_ON_INVALID", value_enum, default_value = "closed")]
    on_invalid: FailMode,
    /// gpud unreachable: fail the container (closed) or run it without shares (open). Default:
    /// closed for a container whose shares the cluster granted (device plugin), open for others.
    #[arg(long, env = "GPUD_ON_UNREACHABLE", value_enum)]
    on_unreachable: Option<FailMode>,
    /// How far pod annotations count: `narrow` (they only narrow what the cluster granted),
    /// `full` (as much as a grant), `auto` (narrow for Kubernetes pods).
    #[arg(long, env = "GPUD_ANNOTATION_TRUST", value_enum, default_value_t = Trust::Auto)]
    annotation_trust: Trust,
    /// Whether a Kubernetes pod's cgroup carries the sum of its containers' grants (device
    /// plugin), so that a container of the pod without one is inside them.
    #[arg(long, env = "GPUD_NRI_POD_LIMITS", default_value_t = true, action = clap::ArgAction::Set)]
    pod_limits: bool,
    /// Where the pods' ledgers are kept (what each container of a pod contributes).
    #[arg(long, env = "GPUD_NRI_LEDGER_DIR", default_value = nri::DEFAULT_LEDGER_DIR)]
    ledger_dir: PathBuf,
    /// Log filter (tracing's EnvFilter syntax).
    #[arg(long, env = "GPUD_NRI_LOG", default_value = "info")]
    log: String,
}

/// The connection to the runtime: inherited from a runtime that launched the plugin, or made to
/// its socket.
fn connect(args: &Args) -> anyhow::Result<tokio::net::UnixStream> {
    let std_stream = match std::env::var(nri::PLUGIN_SOCKET_ENV) {
        Ok(fd) => {
            let fd: i32 = fd.trim().parse().with_context(|| {
                format!("{}={fd:?} is not a file descriptor", nri::PLUGIN_SOCKET_ENV)
            })?;
            info!(fd, "using the socket the runtime handed over");
            // SAFETY: the runtime that launched this process passes a connected socket it does
            // not use itself; nothing else in this process owns this descriptor.
            unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) }
        }
        Err(_) => std::os::unix::net::UnixStream::connect(&args.socket)
            .with_context(|| format!("connecting to the NRI socket {}", args.socket.display()))?,
    };
    std_stream.set_nonblocking(true)?;
    Ok(tokio::net::UnixStream::from_std(std_stream)?)
}

async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let name = std::env::var(nri::PLUGIN_NAME_ENV).unwrap_or_else(|_| args.name.clone());
    let idx = std::env::var(nri::PLUGIN_IDX_ENV).unwrap_or_else(|_| args.idx.clone());
    let cfg = PluginConfig {
        name,
        idx,
        bus: args.bus_address.clone().unwrap_or_else(|| "system".into()),
        timeout: Duration::from_millis(args.timeout_ms.max(1)),
        policy: FailPolicy {
            on_invalid: args.on_invalid,
            on_unreachable: args.on_unreachable,
        },
        trust: args.annotation_trust,
        pod_limits: args.pod_limits,
        ledger_dir: args.ledger_dir.clone(),
    };
    cfg.validate()?;
    let trunk = connect(&args)?;
    let handler = Handler::new(cfg);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        ending = nri::serve(trunk, handler) => match ending? {
            Ending::Shutdown => {
                info!("stopped: the runtime shut the plugin down");
                Ok(ExitCode::SUCCESS)
            }
            Ending::Disconnected(why) => {
                error!("stopped: connection to the runtime lost ({why})");
                Ok(ExitCode::from(1))
            }
        },
        _ = tokio::signal::ctrl_c() => Ok(ExitCode::SUCCESS),
        _ = term.recv() => Ok(ExitCode::SUCCESS),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    gpud_runtime::logging::init_companion(&args.log, true);
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            error!("{e:#}");
            ExitCode::from(1)
        }
    }
}
