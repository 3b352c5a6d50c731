//! `gpud`: the daemon. Loads the probes, attributes NVIDIA device use to cgroups, and serves
//! `dev.gpud.Daemon1` on D-Bus.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use gpud::{
    api::dbus::{BUS_NAME, DaemonInfo, Manager, OBJECT_PATH},
    attribution::{Attribution, CgroupFs},
    config::Config,
    daemon::{self, Intervals, Message, State},
    enforcement::MemoryEnforcement,
    policy::LimitStore,
    probes::{self, DynamicMajors, Matcher, ProbeSetup, Probes},
};
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

const DEFAULT_CONFIG_PATH: &str = "/etc/gpud/gpud.toml";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "GPU sharing daemon: per-cgroup attribution of NVIDIA device use"
)]
struct Args {
    /// Configuration file (TOML). Without it, /etc/gpud/gpud.toml if present, else the built-in
    /// defaults.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// D-Bus address to serve on instead of the system bus (overrides `dbus.bus`).
    #[arg(long, value_name = "ADDRESS")]
    bus_address: Option<String>,
}

fn load_config(args: &Args) -> anyhow::Result<(Config, String)> {
    match &args.config {
        Some(p) => Ok((Config::load(p)?, p.display().to_string())),
        None if std::path::Path::new(DEFAULT_CONFIG_PATH).exists() => Ok((
            Config::load(std::path::Path::new(DEFAULT_CONFIG_PATH))?,
            DEFAULT_CONFIG_PATH.to_owned(),
        )),
        None => Ok((Config::defaults()?, "built-in defaults".to_owned())),
    }
}

fn init_tracing(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(filter))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let (config, source) = match load_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpud: {e:#}");
            return std::process::ExitCode::from(78); // EX_CONFIG
        }
    };
    init_tracing(&config.daemon.log);
    info!(version = gpud::VERSION, config = %source, "starting");
    match run(config, args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(config: Config, args: Args) -> anyhow::Result<()> {
    let cgroups = CgroupFs::discover().context("locating the cgroup v2 hierarchy")?;
    let majors = DynamicMajors::read()?;
    let extra = probes::devices::resolve_extra_paths(&config.devices.extra_paths)?;
    for e in &extra {
        info!(path = %e.path.display(), dev = e.key.dev, ino = e.key.ino, "extra device file");
    }
    let matcher = Matcher {
        majors,
        extra: extra.clone(),
    };

    let mut probes = Probes::start(ProbeSetup {
        config: &config.probes,
        majors,
        extra: &extra,
        cgroup2_root: cgroups.root(),
        tier: config.enforcement.tier,
        react_action: config.enforcement.react_action,
    })
    .context("starting the eBPF probes")?;
    let events = probes.take_events()?;
    let tier = probes.tier();

    let info = DaemonInfo {
        version: gpud::VERSION.to_owned(),
        attach_mode: probes.mode().as_str().to_owned(),
        enforcement_tier: tier.as_str().to_owned(),
        react_action: format!("{:?}", config.enforcement.react_action).to_lowercase(),
        kernel_capabilities: probes.caps().as_map(),
        cgroup_root: cgroups.root().display().to_string(),
        probes_resumed: probes.resumed(),
    };

    let cgroup_root = cgroups.root().to_owned();
    let mut attribution = Attribution::new(probes, cgroups, matcher)?;
    let found = attribution.scan();
    attribution.sweep();
    info!(found, "start-up scan of /proc done");
    let mut memory = MemoryEnforcement::new(
        LimitStore::load(&config.daemon.state_dir),
        tier,
        config.enforcement.react_action,
    );
    memory.restore(&mut attribution);
    let (notices, notices_rx) = tokio::sync::broadcast::channel(256);
    let (inventory, inventory_rx) = watch::channel(Vec::new());
    let (control, control_rx) = watch::channel(Default::default());
    let (compute_stats, compute_stats_rx) = watch::channel(Default::default());
    let (throttled, throttled_rx) = tokio::sync::broadcast::channel(256);
    let compute_on = config.compute.enabled && config.nvml.enabled;
    if compute_on {
        // A crash may have left cgroups frozen mid-period: thaw every cgroup with a compute
        // policy before the controller starts.
        for (path, _, _) in memory.compute_policies() {
            let f = state_root_join(&cgroup_root, &path).join("cgroup.freeze");
            if f.exists() && std::fs::write(&f, "0").is_ok() {
                info!(cgroup = %path, "thawed at start-up");
            }
        }
    }
    let (nvml_events, nvml_events_rx) = tokio::sync::broadcast::channel(64);
    let state = State {
        attribution,
        memory,
        notices,
        nvml: if config.nvml.enabled {
            gpud::nvml::NvmlView::default()
        } else {
            gpud::nvml::NvmlView::disabled()
        },
        inventory,
        control: compute_on.then_some(control),
        nvml_events,
    };

    let (tx, rx) = mpsc::channel::<Message>(1024);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);

    let bus = args
        .bus_address
        .clone()
        .unwrap_or_else(|| config.dbus.bus.clone());
    let conn = gpud::api::dbus::connect_builder(&bus)
        .serve_at(
            OBJECT_PATH,
            Manager::new(tx.clone(), info.clone())
                .with_compute_stats(compute_stats_rx)
                .with_admin_group(&config.dbus.admin_group),
        )
        .name(BUS_NAME)
        .build()
        .await
        .with_context(|| format!("serving {BUS_NAME} on the bus `{bus}`"))?;

    let publisher = tokio::spawn(gpud::api::dbus::publish_notices(conn.clone(), notices_rx));
    let gpu_objects = tokio::spawn(gpud::api::gpu::publish_gpus(conn.clone(), inventory_rx));
    let throttle_signals = tokio::spawn(gpud::api::dbus::publish_throttled(
        conn.clone(),
        throttled_rx,
    ));
    let controller = compute_on.then(|| {
        tokio::spawn(gpud::enforcement::compute::run(
            gpud::enforcement::compute::Controller::new(
                cgroup_root.clone(),
                std::time::Duration::from_millis(config.compute.period_ms),
            ),
            control_rx,
            compute_stats,
            throttled,
            shutdown_rx.clone(),
        ))
    });
    let xid_signals = tokio::spawn(gpud::api::gpu::publish_xids(conn.clone(), nvml_events_rx));
    if config.nvml.enabled {
        spawn_nvml_sampler(&config.nvml, tx.clone(), shutdown_rx.clone());
    }
    let reader = tokio::spawn(daemon::read_events(events, tx.clone()));
    let state = tokio::spawn(daemon::run_state(
        state,
        Intervals {
            rescan: (config.attribution.rescan_interval_secs > 0)
                .then(|| std::time::Duration::from_secs(config.attribution.rescan_interval_secs)),
            sweep: std::time::Duration::from_secs(config.attribution.sweep_interval_secs),
        },
        tx,
        rx,
        shutdown_rx,
    ));
    info!(
        mode = %info.attach_mode,
        tier = %info.enforcement_tier,
        resumed = info.probes_resumed,
        bus = %bus,
        "ready: {BUS_NAME} at {OBJECT_PATH}"
    );

    wait_for_signal().await?;
    info!("shutting down");
    let _ = shutdown_tx.send(true);
    reader.abort();
    match state.await {
        Ok(mut state) => {
            state.memory.thaw_all(&mut state.attribution);
            state.attribution.shutdown(config.probes.keep_pinned);
        }
        Err(e) => warn!("state task: {e}"),
    }
    if let Some(c) = controller {
        // It thaws what it froze before it returns.
        let _ = c.await;
    }
    publisher.abort();
    gpu_objects.abort();
    throttle_signals.abort();
    xid_signals.abort();
    drop(conn);
    Ok(())
}

fn state_root_join(root: &std::path::Path, path: &str) -> std::path::PathBuf {
    root.join(path.trim_start_matches('/'))
}

/// Samples NVML and waits for its Xid events on a thread of its own (its calls block) until
/// shutdown.
fn spawn_nvml_sampler(
    cfg: &gpud::config::NvmlConfig,
    tx: mpsc::Sender<Message>,
    shutdown: watch::Receiver<bool>,
) {
    let settings = gpud::nvml::SamplerSettings {
        library_path: cfg.library(),
        sample_interval: std::time::Duration::from_millis(cfg.sample_interval_ms),
        retry_interval: std::time::Duration::from_secs(cfg.retry_interval_secs),
    };
    // One thread, one NVML handle: it samples, and waits for Xid events in between.
    let spawned = std::thread::Builder::new()
        .name("nvml".into())
        .spawn(move || {
            gpud::nvml::Sampler::new(settings).run(
                |s| tx.blocking_send(Message::Nvml(s)).is_ok(),
                || *shutdown.borrow(),
            );
        });
    if let Err(e) = spawned {
        warn!("cannot start the NVML sampler: {e}");
    }
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
