//! `gpud-oci-hook`: OCI runtime hook that sets a container's GPU shares from its annotations
//! through gpud (docs/runtime-integration.md).
//!
//! The runtime runs it with the container's OCI state on standard input:
//! `gpud-oci-hook createRuntime` (or `prestart`) when the container's process exists,
//! `gpud-oci-hook poststop` when it is gone.
//!
//! Exit status: 0 done, or failed where the policy says open (logged); 1 failed where the policy
//! says closed (the runtime fails the container); 2 bad usage.

use std::{
    io::Write as _,
    path::PathBuf,
    process::ExitCode,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use clap::{Parser, ValueEnum};
use gpud_runtime::{
    FailMode, FailPolicy, RuntimeError,
    oci::{self, HookConfig, Outcome},
    report::Chain,
    trust::Trust,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Stage {
    /// Set the shares (runtime namespace; the container's process exists).
    #[value(name = "createRuntime")]
    CreateRuntime,
    /// The same as createRuntime (runc runs both at one point; prestart is deprecated).
    #[value(name = "prestart")]
    Prestart,
    /// Clear what createRuntime set.
    #[value(name = "poststop")]
    Poststop,
}

#[derive(Parser, Debug)]
#[command(
    version,
    about = "OCI hook: GPU shares from container annotations, through gpud"
)]
struct Args {
    /// Hook stage.
    stage: Stage,
    /// D-Bus address of gpud's bus (default: the system bus).
    #[arg(long, env = "GPUD_BUS_ADDRESS", value_name = "ADDRESS")]
    bus_address: Option<String>,
    /// Bound of the connection to gpud and of each call, in milliseconds.
    #[arg(long, env = "GPUD_HOOK_TIMEOUT_MS", default_value_t = 5000)]
    timeout_ms: u64,
    /// Where createRuntime records what it set, for poststop.
    #[arg(long, env = "GPUD_HOOK_RECORD_DIR", default_value = oci::DEFAULT_RECORD_DIR)]
    record_dir: PathBuf,
    /// Invalid annotations (or a cgroup that cannot be found, a limit gpud refuses): fail the
    /// container (closed) or run it without shares (open).
    #[arg(long, env = "GPUD_ON_INVALID", value_enum, default_value = "closed")]
    on_invalid: FailMode,
    /// gpud unreachable: fail the container (closed) or run it without shares (open). Default:
    /// closed when the hook carries a grant (`--annotation`, a DRA claim's), open otherwise.
    #[arg(long, env = "GPUD_ON_UNREACHABLE", value_enum)]
    on_unreachable: Option<FailMode>,
    /// How far the container's OCI annotations count: `narrow` (they only narrow what the
    /// `--annotation` arguments grant), `full` (as much), `auto` (narrow for Kubernetes pods).
    #[arg(long, env = "GPUD_ANNOTATION_TRUST", value_enum, default_value_t = Trust::Auto)]
    annotation_trust: Trust,
    /// An annotation of the container's own, `KEY=VALUE` (repeatable), over those the runtime
    /// hands over: how a CDI spec's hook passes a DRA claim's shares (gpud-k8s dra).
    #[arg(long = "annotation", value_name = "KEY=VALUE", value_parser = key_value)]
    annotations: Vec<(String, String)>,
    /// The DRA claim (and device) the `--annotation` grant is, as gpud-k8s's CDI spec names it:
    /// the grant is the pod's, set once on the pod's cgroup for all its containers that use it.
    #[arg(long, value_name = "ID")]
    claim: Option<String>,
    /// Also append log lines to this file (runtimes often discard a hook's output).
    #[arg(long, env = "GPUD_HOOK_LOG", value_name = "FILE")]
    log_file: Option<PathBuf>,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE"))
}

/// Log lines to stderr and, if asked, a file.
struct Log {
    prefix: String,
    file: Option<PathBuf>,
}

impl Log {
    fn line(&self, msg: &str) {
        let line = format!("{}: {msg}", self.prefix);
        eprintln!("{line}");
        if let Some(path) = &self.file {
            let stamp = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| format!("{}.{:03}", d.as_secs(), d.subsec_millis()))
                .unwrap_or_default();
            let written = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| writeln!(f, "{stamp} {line}"));
            if let Err(e) = written {
                eprintln!("gpud-oci-hook: cannot write {}: {e}", path.display());
            }
        }
    }
}

fn stage_name(s: Stage) -> &'static str {
    match s {
        Stage::CreateRuntime => "createRuntime",
        Stage::Prestart => "prestart",
        Stage::Poststop => "poststop",
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    gpud_runtime::logging::init_companion("warn", false);
    let policy = FailPolicy {
        on_invalid: args.on_invalid,
        on_unreachable: args.on_unreachable,
    };
    let cfg = HookConfig {
        bus: args.bus_address.clone().unwrap_or_else(|| "system".into()),
        timeout: Duration::from_millis(args.timeout_ms.max(1)),
        record_dir: args.record_dir.clone(),
        annotations: args.annotations.iter().cloned().collect(),
        trust: args.annotation_trust,
        claim: args.claim.clone(),
    };
    let mut log = Log {
        prefix: format!("gpud-oci-hook {}", stage_name(args.stage)),
        file: args.log_file.clone(),
    };
    let result = match oci::read_state(std::io::stdin().lock()) {
        Err(e) => Err(e),
        Ok(state) => {
            log.prefix = format!("{} {}", log.prefix, state.id());
            match args.stage {
                Stage::CreateRuntime | Stage::Prestart => oci::create(&state, &cfg).await,
                Stage::Poststop => oci::poststop(&state, &cfg).await,
            }
        }
    };
    match result {
        Ok(outcome) => {
            report(&log, &outcome);
            ExitCode::SUCCESS
        }
        Err(e) => fail(&log, &policy, &e, cfg.granted()),
    }
}

fn report(log: &Log, outcome: &Outcome) {
    match outcome {
        Outcome::Applied {
            cgroup,
            applied,
            ignored,
            pod,
            claim_group,
            warnings,
        } => {
            for line in ignored
                .iter()
                .map(ToString::to_string)
                .chain(warnings.iter().cloned())
            {
                log.line(&line);
            }
            if let Some((pod, applied)) = pod {
                log.line(&format!(
                    "the claim's shares on the pod's cgroup {pod} (GPU {})",
                    applied.gpus.join(", ")
                ));
            }
            if let Some(group) = claim_group {
                log.line(&format!(
                    "the claim's memory on its own cgroup {group}, which {cgroup}'s GPU memory is \
                     also charged to"
                ));
            }
            if !applied.gpus.is_empty() {
                log.line(&format!(
                    "GPU shares set on {cgroup} (GPU {})",
                    applied.gpus.join(", ")
                ));
            }
            for (gpu, why) in &applied.pending {
                log.line(&format!("GPU {gpu}: stored, pending: {why}"));
            }
        }
        Outcome::Cleared { cgroup, gpus } => {
            log.line(&format!(
                "GPU shares of {cgroup} cleared (GPU {})",
                gpus.join(", ")
            ));
        }
        Outcome::Skipped(why) => log.line(&format!("skipped: {why}")),
        Outcome::NoShares { ignored } => {
            for i in ignored {
                log.line(&i.to_string());
            }
        }
        Outcome::NothingToClear => {}
    }
}

fn fail(log: &Log, policy: &FailPolicy, e: &RuntimeError, granted: bool) -> ExitCode {
    match policy.mode_for(e, granted) {
        FailMode::Closed => {
            log.line(&format!(
                "error: {}; failing the container (closed)",
                Chain(e)
            ));
            ExitCode::from(1)
        }
        FailMode::Open => {
            log.line(&format!(
                "error: {}; the container runs without GPU shares (open)",
                Chain(e)
            ));
            ExitCode::SUCCESS
        }
    }
}
