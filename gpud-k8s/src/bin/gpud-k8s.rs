//! `gpud-k8s`: gpud's Kubernetes plugins, run on each GPU node beside gpud and its NRI plugin
//! (docs/kubernetes.md).
//!
//! - `gpud-k8s device-plugin`: the kubelet device plugin for `gpud.dev/gpu-memory` and
//!   `gpud.dev/gpu-compute`.
//! - `gpud-k8s dra`: the DRA kubelet plugin (driver `gpu.gpud.dev`, Kubernetes 1.34+).
//! - `gpud-k8s node install|uninstall|wait`: gpud's host files for the gpud DaemonSet (its init
//!   container and preStop hook), and the wait the plugin DaemonSets start with.
//!
//! The plugins stop cleanly on SIGTERM or SIGINT (exit 0), leaving gpud's limits in place.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use gpud_k8s::device_plugin::{self, DeviceListStrategy};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "gpud's Kubernetes plugins: GPU memory and compute shares for pods"
)]
struct Args {
    /// Log filter (tracing's EnvFilter syntax).
    #[arg(long, env = "GPUD_K8S_LOG", default_value = "info", global = true)]
    log: String,
    /// D-Bus address of gpud's bus, or `system`.
    #[arg(
        long,
        env = "GPUD_BUS_ADDRESS",
        default_value = "system",
        global = true
    )]
    bus_address: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the kubelet device plugin (API v1beta1).
    DevicePlugin(DevicePluginArgs),
    /// Serve the DRA kubelet plugin (API v1.DRAPlugin, Kubernetes 1.34+).
    Dra(DraArgs),
    /// gpud's files on the node, for the gpud DaemonSet (deploy/kubernetes/gpud).
    #[command(subcommand)]
    Node(NodeCommand),
}

#[derive(Subcommand, Debug)]
enum NodeCommand {
    /// Put gpud's bus policy, OCI hook, hooks.d files and gpudctl on the host (init container).
    Install(InstallArgs),
    /// Take them away again; with --keep-while-daemonset, only when that DaemonSet is gone
    /// (then gpud's pins, state and ready file too): a pod replaced in an update keeps all.
    Uninstall(UninstallArgs),
    /// Wait until gpud is ready on this node: it answers on the bus (init container of the
    /// plugin DaemonSets).
    Wait(WaitArgs),
}

#[derive(clap::Args, Debug)]
struct NodeArgs {
    /// The host's `/` as mounted into this container.
    #[arg(long, default_value = "/host")]
    host_root: PathBuf,
    /// The image's host files.
    #[arg(long, default_value = gpud_k8s::node::IMAGE_SHARE)]
    share: PathBuf,
    /// The image's binaries.
    #[arg(long, default_value = "/usr/bin")]
    bin: PathBuf,
}

impl NodeArgs {
    fn layout(&self) -> gpud_k8s::node::Layout {
        gpud_k8s::node::Layout {
            host_root: self.host_root.clone(),
            share: self.share.clone(),
            bin: self.bin.clone(),
        }
    }
}

#[derive(clap::Args, Debug)]
struct InstallArgs {
    #[command(flatten)]
    node: NodeArgs,
    /// NAMESPACE/NAME of the DaemonSet this pod belongs to: install checks that this pod may
    /// read it, as `uninstall --keep-while-daemonset` will need to tell an update from an
    /// uninstall (a Role that is wrong fails the pod now, not the node's limits later).
    #[arg(long)]
    daemonset: Option<String>,
    /// kubeconfig of the API server (default: the pod's service account).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct UninstallArgs {
    #[command(flatten)]
    node: NodeArgs,
    /// NAMESPACE/NAME of the DaemonSet this pod belongs to: while it exists (and is not being
    /// deleted) nothing is removed. An API server that cannot be asked also removes nothing.
    #[arg(long)]
    keep_while_daemonset: Option<String>,
    /// kubeconfig of the API server (default: the pod's service account).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// gpud's pins on the host (`[probes] bpffs`/gpud), removed with the node's gpud.
    #[arg(long, default_value = "/sys/fs/bpf/gpud")]
    pins: PathBuf,
    /// gpud's state directory on the host, removed with the node's gpud.
    #[arg(long, default_value = "/var/lib/gpud")]
    state_dir: PathBuf,
    /// gpud's ready file on the host.
    #[arg(long, default_value = "/run/gpud/ready")]
    ready_file: PathBuf,
}

#[derive(clap::Args, Debug)]
struct WaitArgs {
    /// Also wait for gpud's ready file (`[daemon] ready_file`), as this container sees it.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout_secs: u64,
}

#[derive(clap::Args, Debug)]
struct DraArgs {
    /// This node's name (the ResourceSlice's node and pool).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// The DRA driver name.
    #[arg(long, default_value = gpud_k8s::dra::DRIVER)]
    driver: String,
    /// The kubelet's plugin-registration directory.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    registry_dir: PathBuf,
    /// This plugin's socket directory (default: /var/lib/kubelet/plugins/<driver>).
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// Where CDI specs of prepared claims go.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// gpud's OCI hook as the runtime finds it on the host (the Debian package's path; a
    /// `cargo xtask install` puts it in PREFIX/bin, /usr/local/bin by default).
    #[arg(long, default_value = "/usr/bin/gpud-oci-hook")]
    oci_hook: PathBuf,
    /// Granularity of the memory capacity: bytes or a quantity.
    #[arg(long, default_value = "1Gi")]
    memory_unit: String,
    /// kubeconfig of the API server (its current context). Default: $KUBECONFIG,
    /// ~/.kube/config, then the pod's service account.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// How unhealthy GPUs appear in the ResourceSlice: left out (`off`), or listed with a
    /// `gpu.gpud.dev/unhealthy` taint of that effect (needs the DRADeviceTaints gate, on by
    /// default from Kubernetes 1.36).
    #[arg(long, value_enum, default_value = "off")]
    device_taints: gpud_k8s::dra::DeviceTaints,
    /// How often gpud's inventory and GPU health are read, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    health_interval_ms: u64,
    /// Xid errors that leave a GPU healthy (comma-separated; application errors by default).
    #[arg(long, value_delimiter = ',', default_values_t = gpud_k8s::inventory::APPLICATION_XIDS.to_vec())]
    ignore_xid: Vec<u64>,
    /// Bound of each call to gpud, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

#[derive(clap::Args, Debug)]
struct DevicePluginArgs {
    /// The kubelet's device-plugin directory (kubelet.sock and the plugin's sockets).
    #[arg(long, env = "GPUD_K8S_PLUGIN_DIR", default_value = device_plugin::DEFAULT_PLUGIN_DIR)]
    plugin_dir: PathBuf,
    /// Size of one `gpud.dev/gpu-memory` unit: bytes or a quantity (`512Mi`, `1Gi`).
    #[arg(long, env = "GPUD_K8S_MEMORY_UNIT", default_value = "1Gi")]
    memory_unit: String,
    /// How containers get their GPUs: NVIDIA_VISIBLE_DEVICES, or CDI device names.
    #[arg(long, value_enum, default_value = "envvar")]
    device_list_strategy: DeviceListStrategy,
    /// CDI kind of the GPU devices (with `--device-list-strategy cdi`).
    #[arg(long, default_value = "nvidia.com/gpu")]
    cdi_kind: String,
    /// libnvidia-ml to read the GPU topology with (default: the system's).
    #[arg(long, env = "GPUD_K8S_NVML_LIBRARY")]
    nvml_library: Option<PathBuf>,
    /// How often gpud's inventory and GPU health are read, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    health_interval_ms: u64,
    /// Xid errors that leave a GPU healthy (comma-separated; application errors by default).
    #[arg(long, value_delimiter = ',', default_values_t = gpud_k8s::inventory::APPLICATION_XIDS.to_vec())]
    ignore_xid: Vec<u64>,
    /// Longest gap between a container's two allocations (memory, compute) that pairs them, in
    /// milliseconds.
    #[arg(long, default_value_t = 2000)]
    pair_window_ms: u64,
    /// Bound of each call to gpud and to the kubelet, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

async fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

async fn run(args: Args) -> anyhow::Result<()> {
    let shutdown = shutdown_signal().await?;
    match args.command {
        Command::DevicePlugin(a) => {
            let memory_unit = gpud_api::limits::parse_quantity(&a.memory_unit)
                .map_err(|e| anyhow::anyhow!("--memory-unit {:?}: {e}", a.memory_unit))?;
            let config = device_plugin::Config {
                plugin_dir: a.plugin_dir,
                bus: args.bus_address,
                memory_unit,
                strategy: a.device_list_strategy,
                cdi_kind: a.cdi_kind,
                nvml_library: a.nvml_library,
                health_interval: Duration::from_millis(a.health_interval_ms.max(1)),
                ignored_xids: a.ignore_xid,
                pair_window: Duration::from_millis(a.pair_window_ms),
                timeout: Duration::from_millis(a.timeout_ms.max(1)),
            };
            device_plugin::run(config, shutdown).await?;
        }
        Command::Dra(a) => {
            use gpud_k8s::dra;
            let memory_unit = gpud_api::limits::parse_quantity(&a.memory_unit)
                .map_err(|e| anyhow::anyhow!("--memory-unit {:?}: {e}", a.memory_unit))?;
            let api = dra::ApiServer::connect(a.kubeconfig.as_deref()).await?;
            let config = dra::Config {
                plugin_dir: a
                    .plugin_dir
                    .unwrap_or_else(|| PathBuf::from("/var/lib/kubelet/plugins").join(&a.driver)),
                driver: a.driver,
                node_name: a.node_name,
                registry_dir: a.registry_dir,
                cdi_dir: a.cdi_dir,
                bus: args.bus_address,
                oci_hook: a.oci_hook,
                timeout: Duration::from_millis(a.timeout_ms.max(1)),
                health_interval: Duration::from_millis(a.health_interval_ms.max(1)),
                ignored_xids: a.ignore_xid,
                device_taints: a.device_taints,
            };
            dra::run(config, api, memory_unit, shutdown).await?;
        }
        Command::Node(c) => node(c, &args.bus_address).await?,
    }
    Ok(())
}

async fn node(command: NodeCommand, bus: &str) -> anyhow::Result<()> {
    use gpud_k8s::node;
    match command {
        NodeCommand::Install(a) => {
            if let Some(ds) = &a.daemonset {
                let (ns, name) = split_daemonset(ds)?;
                let api = gpud_k8s::dra::ApiServer::connect(a.kubeconfig.as_deref()).await?;
                let going = api.namespace_going(ns).await.with_context(|| {
                    format!("this pod cannot read its namespace {ns} (the ClusterRole in deploy/kubernetes/gpud)")
                })?;
                if going || !api.daemonset_remains(ns, name).await.with_context(|| {
                    format!("this pod cannot read its DaemonSet {ds} (the Role in deploy/kubernetes/gpud)")
                })? {
                    anyhow::bail!("DaemonSet {ds} does not exist or is being deleted");
                }
            }
            let m = node::install(&a.node.layout())?;
            for f in &m.files {
                tracing::info!(file = %f.display(), "installed");
            }
            // The policy must be in force before gpud asks for its name.
            node::reload_bus(bus)
                .await
                .context("asking the host's bus to read gpud's policy")?;
            tracing::info!(version = %m.version, "gpud's host files installed; bus policy reloaded");
        }
        NodeCommand::Uninstall(a) => {
            if let Some(ds) = &a.keep_while_daemonset {
                let (ns, name) = split_daemonset(ds)?;
                if daemonset_remains(a.kubeconfig.as_deref(), ns, name).await {
                    return Ok(());
                }
            }
            let layout = a.node.layout();
            for p in node::uninstall(&layout)? {
                tracing::info!(path = %p.display(), "removed");
            }
            for tree in [&a.pins, &a.state_dir] {
                if node::remove_tree(&layout, tree)? {
                    tracing::info!(dir = %tree.display(), "removed");
                }
            }
            let ready = layout
                .host_root
                .join(a.ready_file.strip_prefix("/").unwrap_or(&a.ready_file));
            let _ = std::fs::remove_file(&ready);
            // Its directory too, when gpud's DaemonSet made it and nothing else is in it.
            if let Some(dir) = ready.parent() {
                let _ = std::fs::remove_dir(dir);
            }
            if let Err(e) = node::reload_bus(bus).await {
                tracing::warn!("the host's bus did not reload its policy: {e}");
            }
            tracing::info!("gpud's host files, pins and state removed");
        }
        NodeCommand::Wait(a) => {
            node::wait_ready(
                a.ready_file.as_deref(),
                bus,
                Duration::from_secs(a.timeout_secs),
            )
            .await?;
            tracing::info!("gpud is ready on this node");
        }
    }
    Ok(())
}

fn split_daemonset(ds: &str) -> anyhow::Result<(&str, &str)> {
    ds.split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
        .with_context(|| format!("DaemonSet {ds:?}: not NAMESPACE/NAME"))
}

/// Whether the DaemonSet remains (an update or a restart of this pod: keep everything). Gone,
/// being deleted, or this pod no longer allowed to ask (its Role or account deleted with it): an
/// uninstall. No answer: keep everything, the safe side for a node that enforces limits.
async fn daemonset_remains(kubeconfig: Option<&std::path::Path>, ns: &str, name: &str) -> bool {
    let api = match gpud_k8s::dra::ApiServer::connect(kubeconfig).await {
        Ok(api) => api,
        Err(e) => {
            tracing::warn!("cannot reach the API server ({e}): keeping gpud on this node");
            return true;
        }
    };
    let remains = match api.namespace_going(ns).await {
        Ok(true) => Ok(false),
        Ok(false) => api.daemonset_remains(ns, name).await,
        Err(e) => Err(e),
    };
    match remains {
        Ok(true) => {
            tracing::info!("DaemonSet {ns}/{name} remains: keeping gpud's files, pins and state");
            true
        }
        Ok(false) => {
            tracing::info!(
                "DaemonSet {ns}/{name} (or its namespace) is gone or being deleted: removing gpud from this node"
            );
            false
        }
        // `node install` checked that this pod could read it: now it cannot, its account or
        // Role went with the DaemonSet (`kubectl delete -k` takes them all).
        Err(e) if matches!(e.code(), Some(401 | 403)) => {
            tracing::info!(
                "{e}: this pod's account is gone with its DaemonSet; removing gpud from this node"
            );
            false
        }
        Err(e) => {
            tracing::warn!("{e}: keeping gpud on this node");
            true
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    gpud_runtime::logging::init_companion(&args.log, true);
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::from(1)
        }
    }
}
