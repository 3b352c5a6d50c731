//! `gpudctl events`: follows the signals gpud emits under its object tree.

use futures_util::StreamExt as _;
use gpud_api::OBJECT_PATH;
use serde_json::{Value, json};
use zbus::{MatchRule, MessageStream, message::Type};

use crate::{Failure, human};

#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    /// Exit after this many events (default: follow until interrupted).
    #[arg(long, short = 'n', value_name = "N")]
    count: Option<u64>,
    /// Only these signals (repeatable): MemoryLimitExceeded, SchedulerControlGuarded,
    /// ComputeThrottled, IdleChanged, Xid, KernelEventsLost, or any other signal gpud emits.
    #[arg(long = "type", value_name = "SIGNAL")]
    types: Vec<String>,
}

const KNOWN: [&str; 6] = gpud_api::SIGNALS;

/// One decoded signal: its name, a line for people and an object for scripts. A signal this
/// gpudctl has no line for (a newer daemon's) is shown with its arguments as D-Bus text.
fn decode(msg: &zbus::Message) -> Option<(String, String, Value)> {
    let header = msg.header();
    let member = header.member()?.to_string();
    let path = header.path().map(|p| p.to_string()).unwrap_or_default();
    let body = msg.body();
    let (line, value) = match member.as_str() {
        "MemoryLimitExceeded" => {
            let (cgroup, gpu, pid, bytes, usage, max, action, source): (
                String,
                String,
                u32,
                u64,
                u64,
                u64,
                String,
                String,
            ) = body.deserialize().ok()?;
            let line = if source == "nvml" {
                format!(
                    "{cgroup} gpu {gpu}: NVML shows {} held (pid {pid} the most), {} over max {} ({action}, source nvml)",
                    human(usage),
                    human(bytes),
                    human(max)
                )
            } else {
                format!(
                    "{cgroup} gpu {gpu}: pid {pid} allocated {} taking usage to {} over max {} ({action})",
                    human(bytes),
                    human(usage),
                    human(max)
                )
            };
            (
                line,
                json!({"cgroup": cgroup, "gpu": gpu, "pid": pid, "bytes": bytes, "usage": usage,
                       "max": max, "action": action, "source": source}),
            )
        }
        "SchedulerControlGuarded" => {
            let (cgroup, pid, control, action, reason, requested, allowed): (
                String,
                u32,
                String,
                String,
                String,
                u64,
                u64,
            ) = body.deserialize().ok()?;
            let asked = match reason.as_str() {
                "timeslice" => format!(" {requested} µs (allowed {allowed} µs)"),
                "foreign-client" => format!(" naming client {requested:#x}"),
                _ => String::new(),
            };
            (
                format!("{cgroup}: pid {pid} {control}{asked}: {action} ({reason})"),
                json!({"cgroup": cgroup, "pid": pid, "control": control, "action": action,
                       "reason": reason, "requested": requested, "allowed": allowed}),
            )
        }
        "ComputeThrottled" => {
            let cgroup: String = body.deserialize().ok()?;
            (
                format!("{cgroup}: compute throttling started"),
                json!({"cgroup": cgroup}),
            )
        }
        "IdleChanged" => {
            let (cgroup, gpu, idle, memory_bytes, idle_secs): (String, u32, bool, u64, u64) =
                body.deserialize().ok()?;
            let what = if idle {
                format!(
                    "idle for {} holding {}",
                    crate::duration(idle_secs),
                    human(memory_bytes)
                )
            } else {
                format!("active again after {}", crate::duration(idle_secs))
            };
            (
                format!("{cgroup} gpu {gpu}: {what}"),
                json!({"cgroup": cgroup, "gpu": gpu, "idle": idle, "memory_bytes": memory_bytes,
                       "idle_secs": idle_secs}),
            )
        }
        "Xid" => {
            let (xid, pid, cgroup_id, cgroup): (u64, u32, u64, String) = body.deserialize().ok()?;
            let whom = if pid == 0 {
                "no single process".to_owned()
            } else {
                format!("pid {pid} in {cgroup}")
            };
            (
                format!("{path}: Xid {xid}, {whom}"),
                json!({"path": path, "xid": xid, "pid": pid, "cgroup_id": cgroup_id,
                       "cgroup": cgroup}),
            )
        }
        "KernelEventsLost" => {
            let lost: u64 = body.deserialize().ok()?;
            (
                format!(
                    "{lost} kernel events lost (ring buffer full); the sweeps reconcile what they said"
                ),
                json!({"lost": lost}),
            )
        }
        _ => {
            let args: zbus::Structure = body.deserialize().ok()?;
            let line: Vec<String> = args.fields().iter().map(ToString::to_string).collect();
            let args: Vec<Value> = args.fields().iter().map(json_of).collect();
            (line.join(" "), json!({"path": path, "args": args}))
        }
    };
    Some((member, line, value))
}

/// A D-Bus value as JSON: numbers, booleans and strings as themselves, anything else as its
/// D-Bus text.
fn json_of(v: &zbus::Variant<'_>) -> Value {
    use zbus::Variant as V;
    match v {
        V::Bool(b) => json!(b),
        V::U8(n) => json!(n),
        V::I16(n) => json!(n),
        V::U16(n) => json!(n),
        V::I32(n) => json!(n),
        V::U32(n) => json!(n),
        V::I64(n) => json!(n),
        V::U64(n) => json!(n),
        V::F64(n) => json!(n),
        V::Str(s) => json!(s.as_str()),
        V::ObjectPath(p) => json!(p.as_str()),
        other => json!(other.to_string()),
    }
}

pub async fn run(conn: &zbus::Connection, args: EventsArgs, json: bool) -> Result<(), Failure> {
    // A newer daemon may emit signals this gpudctl does not know: followed all the same.
    if let Some(t) = args.types.iter().find(|t| !KNOWN.contains(&t.as_str())) {
        eprintln!(
            "gpudctl: {t:?} is not a signal this gpudctl knows ({}); following it anyway",
            KNOWN.join(", ")
        );
    }
    // Every signal under gpud's object tree (the manager and the per-GPU objects).
    let rule = MatchRule::builder()
        .msg_type(Type::Signal)
        .path_namespace(OBJECT_PATH)
        .build()
        .map_err(|e| Failure::Unreachable(e.to_string()))?;
    let mut stream = MessageStream::for_match_rule(rule, conn, std::num::NonZeroUsize::new(256))
        .await
        .map_err(|e| Failure::Unreachable(e.to_string()))?;
    // Subscribed: events from now on are seen (scripts may wait for this line).
    eprintln!("gpudctl: following gpud's signals");
    let mut seen = 0u64;
    while args.count.is_none_or(|n| seen < n) {
        let msg = match stream.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(Failure::Unreachable(e.to_string())),
            None => return Err(Failure::Unreachable("the bus connection closed".into())),
        };
        let Some((member, line, value)) = decode(&msg) else {
            continue;
        };
        if !args.types.is_empty() && !args.types.contains(&member) {
            continue;
        }
        let now = std::time::SystemTime::now();
        if json {
            let ts = now
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let mut o = json!({"time": ts, "signal": member});
            if let (Value::Object(o), Value::Object(v)) = (&mut o, value) {
                o.extend(v);
            }
            println!("{o}");
        } else {
            println!(
                "{} {member:<20} {line}",
                humantime::format_rfc3339_millis(now)
            );
        }
        seen += 1;
    }
    Ok(())
}
