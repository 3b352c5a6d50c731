//! `gpudctl`: command-line client of gpud over D-Bus.
//!
//! Exit codes: 0 success; 1 the daemon answered with an error (e.g. unknown cgroup);
//! 2 bad usage; 3 the daemon cannot be reached (or went away during `top`/`events`); 4 the
//! caller is not allowed (refused by the bus policy or by gpud).

mod events;
mod limits;
mod top;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpud_api::{
    CgroupRecord, ComputeRecord, LimitRecord, LimitState, Manager1Proxy, NvmlUsageRecord,
    connect_builder,
};
use gpud_common::IOCTL_CLASS_NAMES;

#[derive(Parser, Debug)]
#[command(version, about = "Query and control gpud")]
struct Args {
    /// D-Bus address of the bus gpud serves on (default: the system bus).
    #[arg(long, global = true, value_name = "ADDRESS")]
    bus_address: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Daemon version, attach mode and kernel capabilities.
    Status,
    /// Attributed cgroups with their processes and ioctl counts.
    List,
    /// Attributed processes with their cgroup and ioctl counts.
    Ps,
    /// One cgroup by path relative to the cgroup v2 root.
    Get {
        /// e.g. /kubepods/pod1/ctr
        path: String,
    },
    /// Sets limits on a cgroup, e.g. `gpudctl set /kubepods/pod1 --memory-max 8Gi --compute-max 30`.
    Set {
        /// cgroup path relative to the cgroup v2 root.
        cgroup: String,
        /// GPU: `all` (the sum over GPUs), an index, or a UUID.
        #[arg(long, default_value = "all")]
        gpu: String,
        // One flag per limit of gpud-api's schema: --memory-max, --compute-max, ….
        #[command(flatten)]
        limits: limits::LimitFlags,
    },
    /// Clears limits of a cgroup (all of them unless names are given).
    Clear {
        cgroup: String,
        #[arg(long, default_value = "all")]
        gpu: String,
        /// Limit names to clear (e.g. memory_max); none: all.
        names: Vec<String>,
    },
    /// Limits in force.
    Limits,
    /// cgroups holding GPU memory while idle on that GPU ([idle] in gpud.toml), longest first.
    Idle,
    /// Live per-cgroup view (memory, utilization, compute share, throttling, ioctl rate, idle
    /// time), refreshed every interval. Keys: q quits; m, u, s, t, i, c sort by memory,
    /// utilization, share, throttling, ioctl rate, cgroup.
    Top(top::TopArgs),
    /// Follows gpud's D-Bus signals (limit crossings, throttling, idle changes, Xid errors), one
    /// line (or, with --json, one JSON object) per event.
    Events(events::EventsArgs),
}

pub(crate) enum Failure {
    Unreachable(String),
    Daemon(String),
    /// The caller may not make this call (the bus policy or gpud refused it).
    Denied(String),
    /// Already reported.
    Usage,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Args = gpud::parse_args();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Daemon(m)) => {
            eprintln!("gpudctl: {m}");
            ExitCode::from(1)
        }
        Err(Failure::Unreachable(m)) => {
            eprintln!("gpudctl: cannot reach gpud: {m}");
            ExitCode::from(3)
        }
        Err(Failure::Denied(m)) => {
            eprintln!("gpudctl: not allowed: {m}");
            ExitCode::from(4)
        }
        Err(Failure::Usage) => ExitCode::from(2),
    }
}

/// What a refused caller needs, where the refusal does not say it (the bus policy's does not).
const NEEDS_ADMIN: &str = "changing limits needs root or membership in the admin group \
    (`gpud-admin` as shipped; `[dbus] admin_group` in gpud.toml and the bus policy \
    dev.gpud.Daemon1.conf name it)";

pub(crate) fn daemon_err(e: zbus::Error) -> Failure {
    /// The bus answered for a daemon that is not there (not started, exited, restarting).
    const ABSENT: [&str; 3] = [
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
    ];
    /// gpud's own refusal; its message names the method, the uid and the group it needs.
    const DENIED_BY_GPUD: &str = "dev.gpud.Error.AccessDenied";
    // zbus hands the bus's own errors (`org.freedesktop.DBus.Error.*`) over as `Error::FDO`.
    let (name, msg) = match &e {
        zbus::Error::MethodError(name, msg, _) => {
            (name.as_str().to_owned(), msg.clone().unwrap_or_default())
        }
        zbus::Error::FDO(f) => {
            let name = zbus::DBusError::name(&**f).as_str().to_owned();
            (
                name,
                zbus::DBusError::description(&**f)
                    .unwrap_or_default()
                    .to_owned(),
            )
        }
        _ => return Failure::Unreachable(e.to_string()),
    };
    if ABSENT.contains(&name.as_str()) {
        Failure::Unreachable(format!("{name}: {msg}"))
    } else if name == DENIED_BY_GPUD {
        Failure::Denied(format!("{msg} ({name})"))
    } else if name == "org.freedesktop.DBus.Error.AccessDenied" {
        Failure::Denied(format!(
            "the system bus policy refused the call for uid {} ({name}: {msg}); {NEEDS_ADMIN}",
            nix::unistd::Uid::current()
        ))
    } else {
        Failure::Daemon(format!("{name}: {msg}"))
    }
}

async fn run(args: Args) -> Result<(), Failure> {
    let bus = args.bus_address.as_deref().unwrap_or("system");
    let conn = connect_builder(bus)
        .build()
        .await
        .map_err(|e| Failure::Unreachable(format!("bus `{bus}`: {e}")))?;
    let proxy = Manager1Proxy::new(&conn)
        .await
        .map_err(|e| Failure::Unreachable(e.to_string()))?;
    match args.command {
        Command::Status => status(&proxy, args.json).await,
        Command::List => {
            let list = proxy.list_cgroups().await.map_err(daemon_err)?;
            let nvml = proxy.list_nvml_usage().await.map_err(daemon_err)?;
            let compute = proxy.list_compute().await.map_err(daemon_err)?;
            let limits = proxy.list_limits().await.map_err(daemon_err)?;
            let root = proxy.cgroup_root().await.map_err(daemon_err)?;
            let records = Records {
                list: &list,
                nvml: &nvml,
                compute: &compute,
                limits: &limits,
                cgroup_root: Some(std::path::Path::new(&root)),
            };
            print_records(&records, args.json);
            Ok(())
        }
        Command::Ps => {
            let procs = proxy.list_processes().await.map_err(daemon_err)?;
            if args.json {
                println!("{}", to_json(&procs));
            } else {
                print!("{:>8} {:<40}", "PID", "CGROUP");
                for c in IOCTL_CLASS_NAMES {
                    print!(" {c:>9}");
                }
                println!();
                for p in &procs {
                    print!("{:>8} {:<40}", p.pid, p.cgroup);
                    for c in IOCTL_CLASS_NAMES {
                        print!(" {:>9}", p.ioctls.get(c).copied().unwrap_or(0));
                    }
                    println!();
                }
            }
            Ok(())
        }
        Command::Set {
            cgroup,
            gpu,
            limits,
        } => {
            if limits.0.is_empty() {
                eprintln!("gpudctl: set needs at least one limit (see gpudctl set --help)");
                return Err(Failure::Usage);
            }
            let (state, note) = proxy
                .set_limits(&cgroup, &gpu, limits.0.to_dict())
                .await
                .map_err(daemon_err)?;
            if let LimitState::Pending(why) = LimitState::from_wire(&state, &note) {
                eprintln!("gpudctl: stored, pending: {why}");
            }
            Ok(())
        }
        Command::Clear { cgroup, gpu, names } => {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            proxy
                .clear_limits(&cgroup, &gpu, &names)
                .await
                .map_err(daemon_err)?;
            Ok(())
        }
        Command::Limits => {
            let limits = proxy.list_limits().await.map_err(daemon_err)?;
            if args.json {
                println!("{}", to_json(&limits));
            } else {
                limits::print_limits(&limits);
            }
            Ok(())
        }
        Command::Idle => {
            let idle = proxy.list_idle().await.map_err(daemon_err)?;
            if args.json {
                println!("{}", to_json(&idle));
            } else {
                print_idle(&idle);
            }
            Ok(())
        }
        Command::Top(t) => top::run(&proxy, t, args.json).await,
        Command::Events(e) => events::run(&conn, e, args.json).await,
        Command::Get { path } => {
            let rec = proxy.get_cgroup(&path).await.map_err(daemon_err)?;
            if args.json {
                println!("{}", to_json(&rec));
            } else {
                let records = Records {
                    list: std::slice::from_ref(&rec),
                    nvml: &[],
                    compute: &[],
                    limits: &[],
                    cgroup_root: None,
                };
                print_records(&records, false);
            }
            Ok(())
        }
    }
}

fn print_idle(idle: &[gpud_api::IdleRecord]) {
    println!(
        "{:<50} {:>4} {:>12} {:>10} {:>5} {:<20}",
        "CGROUP", "GPU", "MEMORY", "IDLE", "UTIL", "LAST ACTIVE"
    );
    for i in idle {
        let last = if i.last_active == 0 {
            "not since gpud started".to_owned()
        } else {
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + std::time::Duration::from_secs(i.last_active),
            )
            .to_string()
        };
        println!(
            "{:<50} {:>4} {:>12} {:>10} {:>4}% {:<20}",
            i.cgroup,
            i.gpu,
            human(i.memory_bytes),
            duration(i.idle_secs),
            i.util,
            last
        );
    }
}

/// Seconds as `1h02m`, `5m03s` or `42s`.
pub(crate) fn duration(secs: u64) -> String {
    match secs {
        s if s >= 3600 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{s}s"),
    }
}

pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> String {
    // Serializing plain records to a String cannot fail.
    serde_json::to_string_pretty(v).unwrap_or_default()
}

async fn status(proxy: &Manager1Proxy<'_>, json: bool) -> Result<(), Failure> {
    let version = proxy.version().await.map_err(daemon_err)?;
    let abi = proxy.abi_version().await.map_err(daemon_err)?;
    let revision = proxy.revision().await.map_err(daemon_err)?;
    let mode = proxy.attach_mode().await.map_err(daemon_err)?;
    let caps = proxy.kernel_capabilities().await.map_err(daemon_err)?;
    let hook = proxy.deny_hook().await.map_err(daemon_err)?;
    let hook_refusals = proxy.deny_hook_refusals().await.map_err(daemon_err)?;
    let unseen = proxy.unseen_calls().await.map_err(daemon_err)?;
    let driver_limits = proxy.driver_limits().await.map_err(daemon_err)?;
    let root = proxy.cgroup_root().await.map_err(daemon_err)?;
    let resumed = proxy.probes_resumed().await.map_err(daemon_err)?;
    let taken_over = proxy.probes_taken_over().await.map_err(daemon_err)?;
    let stats = proxy.get_kernel_stats().await.map_err(daemon_err)?;
    let cgroups = proxy.list_cgroups().await.map_err(daemon_err)?.len();
    let tier = proxy.enforcement_tier().await.map_err(daemon_err)?;
    let action = proxy.react_action().await.map_err(daemon_err)?;
    let nvml_status = proxy.nvml_status().await.map_err(daemon_err)?;
    let gpus = proxy.list_gpus().await.map_err(daemon_err)?;
    let nvml_available = proxy.nvml_available().await.map_err(daemon_err)?;
    let nvml_events = proxy.list_nvml_events().await.map_err(daemon_err)?;
    let memory_view = proxy.memory_info_view().await.map_err(daemon_err)?;
    let guard = proxy.scheduler_guard().await.map_err(daemon_err)?;
    if json {
        let v = serde_json::json!({
            "version": version,
            "abi_version": abi,
            "revision": revision,
            "nvml_available": nvml_available,
            "nvml_status": nvml_status,
            "gpus": gpus,
            "nvml_events": nvml_events,
            "attach_mode": mode,
            "enforcement_tier": tier,
            "deny_hook": hook,
            "deny_hook_refusals": hook_refusals,
            "unseen_calls": unseen,
            "driver_limits": driver_limits,
            "react_action": action,
            "memory_info_view": memory_view,
            "scheduler_guard": guard,
            "kernel_capabilities": caps,
            "cgroup_root": root,
            "probes_resumed": resumed,
            "probes_taken_over": taken_over,
            "kernel_stats": stats,
            "cgroups": cgroups,
        });
        println!("{}", to_json(&v));
        return Ok(());
    }
    println!("gpud {version} (ABI {abi}, revision {revision})");
    println!(
        "  attach mode:      {mode}{}",
        if resumed { " (resumed)" } else { "" }
    );
    if let Some(from) = taken_over.get("from_abi") {
        let get = |k: &str| taken_over.get(k).map_or("0", String::as_str);
        println!(
            "  taken over:       ABI {from}'s maps: {} objects adopted, {} released while both ran, {} without room",
            get("objects_adopted"),
            get("objects_released"),
            get("objects_no_room"),
        );
    }
    if let Some(why) = taken_over.get("unconverted") {
        println!("  WARNING: not taken over: {why}");
    }
    let offered: Vec<&str> = caps
        .iter()
        .filter(|(_, v)| **v)
        .map(|(k, _)| k.as_str())
        .collect();
    let missing: Vec<&str> = caps
        .iter()
        .filter(|(_, v)| !**v)
        .map(|(k, _)| k.as_str())
        .collect();
    println!("  memory limits:    {tier} tier (react action: {action})");
    println!("  driver limits:    {driver_limits}");
    println!("  pre-driver hook:  {hook}");
    // Ladder order, not the map's alphabetical one.
    for rung in ["lsm", "fmod_ret", "kprobe"] {
        if let Some(why) = hook_refusals.get(rung) {
            println!("    {rung:<9} {why}");
        }
    }
    for (calls, why) in &unseen {
        println!("  WARNING: unseen:  {calls} ({why}): neither charged nor guarded");
    }
    println!("  memory view:      {memory_view}");
    println!("  scheduler guard:  {guard}");
    println!("  NVML:             {nvml_status}");
    for g in &gpus {
        let id = if g.mig == u32::MAX {
            format!("GPU {}", g.index)
        } else {
            format!("  MIG {}/{}", g.index, g.mig)
        };
        println!(
            "    {id:<10} {} {} {} {}/{} used, driver {}, CUDA {}, compute {}, MIG {}, Xid errors {}",
            g.name,
            g.uuid,
            g.pci_bus_id,
            human(g.memory_used),
            human(g.memory_total),
            g.driver_version,
            g.cuda_version,
            g.compute_mode,
            g.mig_mode,
            g.xid_errors
        );
    }
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    // The last few Xid events, oldest first.
    for e in nvml_events.iter().skip(nvml_events.len().saturating_sub(5)) {
        let whom = if e.pid != 0 {
            format!("pid {} in {}", e.pid, e.cgroup)
        } else {
            format!("processes on the GPU: {:?}", e.pids)
        };
        println!(
            "    Xid {:<6} GPU {} {}s ago, {whom}",
            e.xid,
            e.gpu,
            now_us.saturating_sub(e.timestamp_us) / 1_000_000
        );
    }
    println!("  kernel offers:    {}", offered.join(", "));
    println!("  kernel lacks:     {}", missing.join(", "));
    println!("  cgroup v2 root:   {root}");
    println!("  cgroups:          {cgroups}");
    let s = |k: &str| stats.get(k).copied().unwrap_or(0);
    println!(
        "  matched ioctls:   {}   events lost: {}",
        s("matched_ioctls"),
        s("events_lost")
    );
    Ok(())
}

/// Cgroup records with NVML's per-GPU figures joined in by path (`nvml` key in JSON; cgroups that
/// only NVML knows are listed too).
/// What `gpudctl list` prints.
struct Records<'a> {
    list: &'a [CgroupRecord],
    nvml: &'a [NvmlUsageRecord],
    compute: &'a [ComputeRecord],
    limits: &'a [LimitRecord],
    /// Where the cgroups' own files are read (`dmem.current`: the driver's figure, in JSON).
    cgroup_root: Option<&'a std::path::Path>,
}

fn print_records(records: &Records<'_>, json: bool) {
    let Records {
        list,
        nvml,
        compute,
        limits,
        cgroup_root,
    } = *records;
    if json {
        let mut out: Vec<serde_json::Value> = Vec::new();
        let mut by_path: std::collections::BTreeMap<
            &str,
            serde_json::Map<String, serde_json::Value>,
        > = Default::default();
        for u in nvml {
            by_path.entry(u.cgroup.as_str()).or_default().insert(
                u.gpu.to_string(),
                serde_json::json!({
                    "memory_bytes": u.nvml_memory_bytes,
                    "ebpf_memory_bytes": u.ebpf_memory_bytes,
                    "sm_util": u.sm_util,
                    "enc_util": u.enc_util,
                    "dec_util": u.dec_util,
                    "pids": u.pids,
                }),
            );
        }
        let mut extra: std::collections::BTreeMap<
            &str,
            serde_json::Map<String, serde_json::Value>,
        > = Default::default();
        for c in compute {
            extra.entry(c.cgroup.as_str()).or_default().insert(
                "compute".into(),
                serde_json::to_value(c).unwrap_or_default(),
            );
        }
        for l in limits {
            let e = extra.entry(l.cgroup.as_str()).or_default();
            let all = e.entry("limits").or_insert_with(|| serde_json::json!({}));
            all[l.gpu.as_str()] = serde_json::to_value(&l.limits).unwrap_or_default();
        }
        // cgroups only NVML or the controller know come after the attributed ones.
        let mut paths: Vec<String> = list.iter().map(|r| r.path.clone()).collect();
        let rest: std::collections::BTreeSet<String> = by_path
            .keys()
            .chain(extra.keys())
            .map(|p| (*p).to_owned())
            .filter(|p| !paths.contains(p))
            .collect();
        paths.extend(rest);
        for path in paths {
            let mut o = match list.iter().find(|r| r.path == path) {
                Some(r) => match serde_json::to_value(r) {
                    Ok(serde_json::Value::Object(o)) => o,
                    _ => serde_json::Map::new(),
                },
                None => {
                    // Known only to NVML or the controller: NVML's cgroup id where it has one.
                    let id = nvml
                        .iter()
                        .find(|u| u.cgroup == path)
                        .map_or(0, |u| u.cgroup_id);
                    let mut o = serde_json::Map::new();
                    o.insert("id".into(), id.into());
                    o.insert("path".into(), path.clone().into());
                    o
                }
            };
            if let Some(n) = by_path.remove(path.as_str()) {
                o.insert("nvml".into(), serde_json::Value::Object(n));
            }
            if let Some(x) = extra.remove(path.as_str()) {
                o.extend(x);
            }
            // The driver's own figure beside gpud's, where it charges a dmem region.
            let dmem = cgroup_root
                .map(|root| gpud::enforcement::dmem::current(root, &path))
                .unwrap_or_default();
            if !dmem.is_empty() {
                o.insert("dmem_current".into(), serde_json::json!(dmem));
            }
            out.push(serde_json::Value::Object(o));
        }
        println!("{}", to_json(&out));
        return;
    }
    // A POD column only where a runtime integration named some cgroup's workload.
    let pod_of =
        |r: &gpud_api::CgroupRecord| match (r.workload.get("namespace"), r.workload.get("pod")) {
            (Some(ns), Some(pod)) => format!("{ns}/{pod}"),
            (None, Some(pod)) => pod.clone(),
            _ => "-".to_owned(),
        };
    let pods = list.iter().any(|r| r.workload.contains_key("pod"));
    print!(
        "{:<40} {:>6} {:>12} {:>12}",
        "CGROUP", "PIDS", "GPU_MEM", "MEM_MAX"
    );
    if pods {
        print!(" {:<30}", "POD");
    }
    for c in IOCTL_CLASS_NAMES {
        print!(" {c:>9}");
    }
    println!();
    for r in list {
        let cur = r.memory_current.get("all").copied().unwrap_or(0);
        let max = r
            .memory_max
            .get("all")
            .map(|m| human(*m))
            .unwrap_or_else(|| "-".into());
        print!(
            "{:<40} {:>6} {:>12} {:>12}",
            r.path,
            r.pids.len(),
            human(cur),
            max
        );
        if pods {
            print!(" {:<30}", pod_of(r));
        }
        for c in IOCTL_CLASS_NAMES {
            print!(" {:>9}", r.ioctls.get(c).copied().unwrap_or(0));
        }
        println!();
    }
}

/// Bytes in binary units (as `nvidia-smi` and Kubernetes quantities read).
pub(crate) fn human(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
