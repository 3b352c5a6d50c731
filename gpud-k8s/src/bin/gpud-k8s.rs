//! `gpud-k8s`: gpud's Kubernetes plugins, run on each GPU node beside gpud and its NRI plugin
//! (docs/kubernetes.md).
//!
//! - `gpud-k8s device-plugin`: the kubelet device plugin for `gpud.dev/gpu-memory` and
//!   `gpud.dev/gpu-compute`.
//! - `gpud-k8s dra`: the DRA kubelet plugin (driver `gpu.gpud.dev`, Kubernetes 1.34+).
//!
//! Both stop cleanly on SIGTERM or SIGINT (exit 0), leaving gpud's limits in place.

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
    }
    Ok(())
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
