//! `gpud`: the daemon. Loads the probes, attributes NVIDIA device use to cgroups, and serves
//! `dev.gpud.Daemon1` on D-Bus.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Parser;
use gpud::{
    api::dbus::{BUS_NAME, DaemonInfo, Manager, OBJECT_PATH},
    attribution::{Attribution, CgroupFs},
    config::{Config, ConfigError},
    daemon::{self, Intervals, Message, State},
    enforcement::MemoryEnforcement,
    logging::LogHandle,
    policy::LimitStore,
    probes::{self, DynamicMajors, Matcher, ProbeSetup, Probes},
};
use sd_notify::NotifyState;
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

const DEFAULT_CONFIG_PATH: &str = "/etc/gpud/gpud.toml";

/// sysexits' EX_CONFIG: the configuration is wrong; systemd does not restart on it in a loop
/// (RestartPreventExitStatus in the unit).
const EX_CONFIG: u8 = 78;

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
    /// Only validate the configuration: print its source and `ok` (exit 0) or the error with
    /// file and line (exit 78). Loads no probes, touches no bus.
    #[arg(long)]
    check_config: bool,
}

/// Where the configuration comes from; a reload reads the same source again.
#[derive(Clone, Debug)]
enum ConfigSource {
    File(PathBuf),
    BuiltIn,
}

impl std::fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File(p) => write!(f, "{}", p.display()),
            Self::BuiltIn => f.write_str("built-in defaults"),
        }
    }
}

impl ConfigSource {
    fn of(args: &Args) -> Self {
        match &args.config {
            Some(p) => Self::File(p.clone()),
            None if Path::new(DEFAULT_CONFIG_PATH).exists() => {
                Self::File(PathBuf::from(DEFAULT_CONFIG_PATH))
            }
            None => Self::BuiltIn,
        }
    }

    /// The configuration and its effective values (to tell what a reload changes).
    fn load(&self) -> Result<(Config, toml::Table), ConfigError> {
        match self {
            Self::File(p) => Config::load_effective(p),
            Self::BuiltIn => Config::defaults_effective(),
        }
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let source = ConfigSource::of(&args);
    let (config, effective) = match source.load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpud: {e}");
            return std::process::ExitCode::from(EX_CONFIG);
        }
    };
    if args.check_config {
        println!("config: {source}");
        println!("ok");
        return std::process::ExitCode::SUCCESS;
    }
    let log = match gpud::logging::init(&config.daemon.log) {
        Ok(l) => l,
        Err(e) => {
            // An invalid RUST_LOG: a configuration error too.
            eprintln!("gpud: {e}");
            return std::process::ExitCode::from(EX_CONFIG);
        }
    };
    info!(version = gpud::VERSION, config = %source, output = ?log.output, "starting");
    let live = Live {
        source,
        effective,
        log,
    };
    match run(config, args, live).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            notify(&[NotifyState::Status(&format!("failed: {e:#}"))]);
            // A state directory or stored limits that need a person, like a bad config: not
            // worth restarting (RestartPreventExitStatus=78 in the unit).
            let needs_a_person = matches!(
                e.downcast_ref::<gpud::policy::PolicyError>(),
                Some(
                    gpud::policy::PolicyError::CorruptState { .. }
                        | gpud::policy::PolicyError::StateDir { .. }
                )
            );
            if needs_a_person {
                std::process::ExitCode::from(EX_CONFIG)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}

/// What a reload (SIGHUP) works on: the source to read again, the values in force, the log
/// filter's handle.
struct Live {
    source: ConfigSource,
    effective: toml::Table,
    log: LogHandle,
}

/// Keys a reload applies without a restart; every other changed key is logged by name.
const LIVE_KEYS: &[&str] = &["daemon.log"];

impl Live {
    /// Reads the configuration again; applies it if valid, keeps the running one otherwise.
    fn reload(&mut self) {
        let mut reloading = vec![NotifyState::Reloading];
        if let Ok(now) = NotifyState::monotonic_usec_now() {
            reloading.push(now);
        }
        notify(&reloading);
        info!(config = %self.source, "reloading the configuration");
        match self.source.load() {
            Err(e) => {
                // The error names file, line and reason.
                error!("configuration not reloaded, the running one stays in force: {e}");
            }
            Ok((config, effective)) => {
                for key in gpud::config::changed_keys(&self.effective, &effective) {
                    if !LIVE_KEYS.contains(&key.as_str()) {
                        warn!(key = %key, "changed in the configuration; takes effect on restart");
                        continue;
                    }
                    match self.log.set_filter(&config.daemon.log) {
                        Ok(true) => {
                            info!(key = %key, filter = %config.daemon.log, "log filter applied");
                        }
                        Ok(false) => info!(key = %key, "RUST_LOG is set and stays in force"),
                        Err(e) => error!(key = %key, "{e}"),
                    }
                    // Only live keys enter the values in force: a restart-only change stays
                    // pending (and is reported again on the next reload).
                    if let (Some(toml::Value::Table(old)), Some(toml::Value::Table(new))) =
                        (self.effective.get_mut("daemon"), effective.get("daemon"))
                        && let Some(v) = new.get("log")
                    {
                        old.insert("log".to_owned(), v.clone());
                    }
                }
            }
        }
        notify(&[
            NotifyState::Ready,
            NotifyState::Status("serving; configuration reloaded"),
        ]);
    }
}

/// Tells the service manager (systemd's `NOTIFY_SOCKET`) a state change; a no-op without one.
fn notify(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        warn!("cannot notify the service manager: {e}");
    }
}

async fn run(config: Config, args: Args, mut live: Live) -> anyhow::Result<()> {
    for w in gpud::privileges::check(gpud::privileges::effective()?)? {
        warn!("{w}");
    }
    // Before anything is attached: the limits must be loadable and storable.
    LimitStore::check_dir(&config.daemon.state_dir)?;
    let store = LimitStore::load(&config.daemon.state_dir, config.daemon.on_corrupt_state)?;
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
    let mut memory = MemoryEnforcement::new(store, tier, config.enforcement.react_action);
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
    let (idle_tx, idle_rx) = tokio::sync::broadcast::channel(64);
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
        idle: gpud::policy::idle::IdleTracker::new((&config.idle).into()),
        idle_changes: config.idle.signal.then_some(idle_tx),
    };

    let (tx, rx) = mpsc::channel::<Message>(1024);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    // Bound before readiness, so a taken or forbidden address fails the start.
    let metrics_listener = match config.metrics.address() {
        Some(addr) => Some(gpud::api::metrics::bind(addr).await?),
        None => None,
    };

    let bus = args
        .bus_address
        .clone()
        .unwrap_or_else(|| config.dbus.bus.clone());
    let conn = gpud::api::dbus::connect_builder(&bus)
        .serve_at(
            OBJECT_PATH,
            Manager::new(tx.clone(), info.clone())
                .with_compute_stats(compute_stats_rx.clone())
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
    let idle_signals = tokio::spawn(gpud::api::dbus::publish_idle(conn.clone(), idle_rx));
    let metrics = metrics_listener.map(|listener| {
        if let Ok(addr) = listener.local_addr() {
            info!(%addr, "metrics at http://{addr}/metrics");
        }
        let exporter = gpud::api::metrics::Exporter::new(
            tx.clone(),
            compute_on.then(|| compute_stats_rx.clone()),
            info.clone(),
        );
        tokio::spawn(gpud::api::metrics::serve(
            listener,
            std::sync::Arc::new(exporter),
            shutdown_rx.clone(),
        ))
    });
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
            // Keep-alives at half the service manager's timeout, from the state task itself:
            // a hung state task stops them and systemd restarts the daemon.
            watchdog: sd_notify::watchdog_enabled()
                .map(|t| t / 2)
                .filter(|t| !t.is_zero()),
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
    // Probes attached, state restored, name owned (`build` returned after the name request
    // succeeded), state task running: ready.
    notify(&[
        NotifyState::Ready,
        NotifyState::Status(&format!(
            "serving {BUS_NAME}; attach mode {}, enforcement {}",
            info.attach_mode, info.enforcement_tier
        )),
    ]);

    wait_for_signal(&mut live).await?;
    notify(&[NotifyState::Stopping]);
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
    idle_signals.abort();
    if let Some(m) = metrics {
        m.abort();
    }
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

/// Waits for SIGTERM or SIGINT; reloads the configuration on every SIGHUP meanwhile.
async fn wait_for_signal(live: &mut Live) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
            _ = hup.recv() => live.reload(),
        }
    }
}
