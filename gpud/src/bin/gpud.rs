//! `gpud`: the daemon. Loads the probes, attributes NVIDIA device use to cgroups, and serves
//! `dev.gpud.Daemon1` on D-Bus.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Parser;
use gpud::{
    api::{dbus::Manager, gpu, metrics},
    config::{Config, ConfigError},
    daemon::{self, Handle, StartError},
    logging::LogHandle,
    report::Chain,
};
use gpud_api::{BUS_NAME, OBJECT_PATH};
use sd_notify::NotifyState;
use tokio::sync::watch;
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
    let args: Args = gpud::parse_args();
    let source = ConfigSource::of(&args);
    let (config, effective) = match source.load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpud: {}", Chain(&e));
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
            eprintln!("gpud: {}", Chain(&e));
            return std::process::ExitCode::from(EX_CONFIG);
        }
    };
    info!(
        version = gpud::VERSION,
        abi = gpud_common::ABI_VERSION,
        revision = gpud::REVISION,
        config = %source,
        output = ?log.output,
        "starting"
    );
    let (admin_group, _) = watch::channel(config.dbus.admin_group.clone());
    let (idle_signal, _) = watch::channel(config.idle.signal);
    let live = Live {
        source,
        effective,
        log,
        admin_group,
        idle_signal,
        daemon: None,
    };
    match run(config, args, live).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            notify(&[NotifyState::Status(&format!("failed: {e:#}"))]);
            // A state directory or stored limits that need a person, like a bad config: not
            // worth restarting (RestartPreventExitStatus=78 in the unit).
            let needs_a_person = e
                .downcast_ref::<StartError>()
                .is_some_and(StartError::needs_a_person);
            if needs_a_person {
                std::process::ExitCode::from(EX_CONFIG)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}

/// What a reload (SIGHUP) works on: the source to read again, the values in force, and the owners
/// of the live keys (the log filter, the admin group, the daemon's handle).
struct Live {
    source: ConfigSource,
    effective: toml::Table,
    log: LogHandle,
    admin_group: watch::Sender<String>,
    /// `[idle] signal`: whether idle changes become D-Bus signals.
    idle_signal: watch::Sender<bool>,
    /// Set once the daemon runs.
    daemon: Option<Handle>,
}

impl Live {
    /// Reads the configuration again; applies its live keys if it is valid, keeps the running
    /// one otherwise.
    async fn reload(&mut self) {
        let mut reloading = vec![NotifyState::Reloading];
        if let Ok(now) = NotifyState::monotonic_usec_now() {
            reloading.push(now);
        }
        notify(&reloading);
        info!(config = %self.source, "reloading the configuration");
        match self.source.load() {
            // The error names file, line and reason.
            Err(e) => error!(
                "configuration not reloaded, the running one stays in force: {}",
                Chain(&e)
            ),
            Ok((config, effective)) => self.apply(config, &effective).await,
        }
        notify(&[
            NotifyState::Ready,
            NotifyState::Status("serving; configuration reloaded"),
        ]);
    }

    async fn apply(&mut self, config: Config, effective: &toml::Table) {
        let changed = gpud::config::changed_keys(&self.effective, effective);
        let (live, later): (Vec<String>, Vec<String>) =
            changed.into_iter().partition(|k| gpud::config::is_live(k));
        for key in &later {
            warn!(key = %key, "changed in the configuration; takes effect on restart");
        }
        // Each live key to its owner: the log filter and the admin group here, the rest to the
        // daemon's state task, which passes the controller's and the sampler's on.
        let mut to_daemon = false;
        for key in &live {
            match key.as_str() {
                "daemon.log" => match self.log.set_filter(&config.daemon.log) {
                    Ok(true) => {
                        info!(key = %key, filter = %config.daemon.log, "log filter applied");
                    }
                    Ok(false) => info!(key = %key, "RUST_LOG is set and stays in force"),
                    Err(e) => error!(key = %key, "{}", Chain(&e)),
                },
                "idle.signal" => {
                    self.idle_signal.send_replace(config.idle.signal);
                    info!(key = %key, signal = config.idle.signal, "idle signal applied");
                }
                "dbus.admin_group" => {
                    self.admin_group
                        .send_replace(config.dbus.admin_group.clone());
                    info!(key = %key, group = %config.dbus.admin_group, "admin group applied");
                }
                _ => to_daemon = true,
            }
        }
        if to_daemon && let Some(daemon) = &self.daemon {
            match daemon.reconfigure(config).await {
                Ok(()) => info!(keys = ?live, "live settings applied"),
                Err(e) => error!("live settings not applied: {}", Chain(&e)),
            }
        }
        // Only live keys enter the values in force: a restart-only change stays pending (and
        // is reported again on the next reload).
        for key in &live {
            gpud::config::copy_key(effective, &mut self.effective, key);
        }
    }
}

/// Tells the service manager (systemd's `NOTIFY_SOCKET`) a state change; a no-op without one.
/// `[daemon] ready_file`: written (gpud's pid) once ready, removed when dropped at shutdown.
struct ReadyFile(PathBuf);

impl ReadyFile {
    fn write(path: &Path) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("daemon.ready_file: creating {}", dir.display()))?;
        }
        // Through a rename: a reader never sees an empty file.
        let tmp = path.with_extension("gpud-new");
        std::fs::write(&tmp, format!("{}\n", std::process::id()))
            .and_then(|()| std::fs::rename(&tmp, path))
            .with_context(|| format!("daemon.ready_file: writing {}", path.display()))?;
        Ok(Self(path.to_owned()))
    }
}

impl Drop for ReadyFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!("daemon.ready_file: removing {}: {e}", self.0.display());
        }
    }
}

fn notify(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        warn!("cannot notify the service manager: {e}");
    }
}

async fn run(config: Config, args: Args, mut live: Live) -> anyhow::Result<()> {
    for w in gpud::privileges::check(gpud::privileges::effective()?)? {
        warn!("{w}");
    }
    let daemon = daemon::spawn(&config)?;
    live.daemon = Some(daemon.handle.clone());
    let info = daemon.info.clone();
    // Bound before readiness, so a taken or forbidden address fails the start.
    let metrics_listener = match config.metrics.address() {
        Some(addr) => Some(metrics::bind(addr).await?),
        None => None,
    };
    let bus = args
        .bus_address
        .clone()
        .unwrap_or_else(|| config.dbus.bus.clone());
    let conn = gpud_api::connect_builder(&bus)
        .serve_at(
            OBJECT_PATH,
            Manager::new(
                daemon.handle.clone(),
                info.clone(),
                live.admin_group.subscribe(),
            ),
        )
        .name(BUS_NAME)
        .build()
        .await
        .with_context(|| format!("serving {BUS_NAME} on the bus `{bus}`"))?;
    let publishers = [
        tokio::spawn(gpud::api::dbus::publish_notices(
            conn.clone(),
            daemon.notices(),
            live.idle_signal.subscribe(),
        )),
        tokio::spawn(gpu::publish_gpus(
            conn.clone(),
            daemon.notices(),
            daemon.handle.clone(),
        )),
        tokio::spawn(gpud::api::cgroup::publish_cgroups(
            conn.clone(),
            daemon.handle.clone(),
            live.admin_group.subscribe(),
        )),
    ];
    let metrics = metrics_listener.map(|listener| {
        if let Ok(addr) = listener.local_addr() {
            info!(%addr, "metrics at http://{addr}/metrics");
        }
        let exporter =
            metrics::Exporter::new(daemon.handle.clone(), info.clone(), daemon.notice_counts());
        tokio::spawn(metrics::serve(
            listener,
            std::sync::Arc::new(exporter),
            daemon.shutdown_signal(),
        ))
    });
    info!(
        mode = %info.attach_mode,
        tier = %info.enforcement_tier,
        deny_hook = %info.deny_hook,
        resumed = info.probes_resumed,
        bus = %bus,
        "ready: {BUS_NAME} at {OBJECT_PATH}"
    );
    // Probes attached, state restored, state task running, name owned (`build` returned after
    // the name request succeeded): ready.
    notify(&[
        NotifyState::Ready,
        NotifyState::Status(&format!(
            "serving {BUS_NAME}; attach mode {}, enforcement {}, deny hook {}",
            info.attach_mode, info.enforcement_tier, info.deny_hook
        )),
    ]);
    let ready_file = config
        .daemon
        .ready_file()
        .map(ReadyFile::write)
        .transpose()?;

    wait_for_signal(&mut live).await?;
    drop(ready_file);
    notify(&[NotifyState::Stopping]);
    info!("shutting down");
    daemon.stop().await;
    for p in publishers {
        p.abort();
    }
    if let Some(m) = metrics {
        m.abort();
    }
    drop(conn);
    Ok(())
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
            _ = hup.recv() => live.reload().await,
        }
    }
}
