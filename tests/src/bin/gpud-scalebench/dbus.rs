//! The D-Bus runs: concurrent clients calling gpud back to back or paced ([`dbus_clients`]), the
//! bus's own ceiling against a service replaying gpud's replies ([`bus_ceiling`], [`Replay`]),
//! and one `ListCgroups` split into its round trip and the client's decoding
//! ([`listing_parts`]).

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use gpud_tests::{Manager1Proxy, connect_builder};
use serde_json::{Value, json};

use crate::{
    Opts,
    figures::{CpuSplit, dist},
};

/// A service on the same bus that answers the bench's four calls with replies it holds ready
/// (the very records gpud returned), doing nothing else.
struct Replay {
    cgroups: Arc<Vec<gpud_api::CgroupRecord>>,
    one: gpud_api::CgroupRecord,
    limits: Arc<Vec<gpud_api::LimitRecord>>,
}

#[zbus::interface(name = "dev.gpud.Manager1")]
impl Replay {
    #[zbus(property)]
    async fn version(&self) -> String {
        "replay".into()
    }

    async fn list_cgroups(&self) -> Arc<Vec<gpud_api::CgroupRecord>> {
        self.cgroups.clone()
    }

    async fn get_cgroup(&self, _path: &str) -> gpud_api::CgroupRecord {
        self.one.clone()
    }

    async fn list_limits(&self) -> Arc<Vec<gpud_api::LimitRecord>> {
        self.limits.clone()
    }
}

/// The name [`bus_ceiling`]'s replaying service owns.
const REPLAY_NAME: &str = "dev.gpud.ScalebenchReplay";

/// The replaying service: takes gpud's replies once, serves them until killed ("READY" on
/// stdout once it owns its name).
pub(crate) async fn replay(bus: &str, path: &str) -> anyhow::Result<()> {
    let gpud = connect_builder(bus).build().await?;
    let proxy = Manager1Proxy::new(&gpud).await?;
    let service = Replay {
        cgroups: Arc::new(proxy.list_cgroups().await?),
        one: proxy.get_cgroup(path).await?,
        limits: Arc::new(proxy.list_limits().await?),
    };
    let _service = connect_builder(bus)
        .name(REPLAY_NAME)
        .serve_at(gpud_api::OBJECT_PATH, service)
        .build()
        .await?;
    println!("READY");
    std::future::pending::<()>().await;
    Ok(())
}

/// The same clients and mix back to back against [`Replay`] in a process of its own: what the
/// bus daemon and the clients allow on this machine with gpud's work taken away (the ceiling
/// for `dbus_us`). `cpu_percent.daemon` is the replaying process's.
pub(crate) async fn bus_ceiling(
    bus: &str,
    bus_pid: u32,
    paths: &[String],
    o: &Opts,
) -> anyhow::Result<Value> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["replay", bus, &paths[0]])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("replay stdout")?).read_line(&mut line)?;
    if line.trim() != "READY" {
        let _ = child.kill();
        bail!("the replaying service did not start: {line:?}");
    }
    let cpu = CpuSplit::start(child.id(), bus_pid)?;
    let run = dbus_clients(bus, REPLAY_NAME, paths, o.clients, o.seconds, None).await;
    let cpu = cpu.end();
    let _ = child.kill();
    let _ = child.wait();
    let mut out = run?;
    out["cpu_percent"] = cpu?;
    Ok(out)
}

/// One client calling `ListCgroups` 200 times in a row, nothing else running: the round trip
/// up to the reply's arrival (the daemon's work, the bus daemon's copy and checks, both sockets)
/// apart from the client's decoding of the reply into records, which is the client's own cost.
pub(crate) async fn listing_parts(conn: &zbus::Connection) -> anyhow::Result<Value> {
    let (mut trip, mut decode) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    for _ in 0..200 {
        let t = Instant::now();
        let reply = conn
            .call_method(
                Some(gpud_api::BUS_NAME),
                gpud_api::OBJECT_PATH,
                Some(gpud_api::MANAGER_INTERFACE),
                "ListCgroups",
                &(),
            )
            .await?;
        trip.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let records: Vec<gpud_api::CgroupRecord> = reply.body().deserialize()?;
        decode.push(t.elapsed().as_secs_f64() * 1e6);
        bytes = reply.data().len();
        std::hint::black_box(records);
    }
    Ok(json!({"round_trip": dist(trip), "client_decode": dist(decode), "reply_bytes": bytes}))
}

/// `clients` connections calling `ListCgroups`, `GetCgroup`, `ListLimits` and a property `Get`
/// in turn for `seconds`: back to back (`pace` None: the daemon's and bus's throughput, latency
/// is then queueing behind the other clients), or each once per `pace`, starts spread over one
/// period (latency at a stated load). Per-method p50/p99/max in µs and the calls per second.
pub(crate) async fn dbus_clients(
    bus: &str,
    service: &'static str,
    paths: &[String],
    clients: usize,
    seconds: u64,
    pace: Option<Duration>,
) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let bus = bus.to_owned();
        let paths = paths.to_vec();
        tasks.push(tokio::spawn(async move {
            let conn = connect_builder(&bus).build().await?;
            let p = Manager1Proxy::builder(&conn)
                .destination(service)
                .cache_properties(zbus::proxy::CacheProperties::No)
                .build()
                .await?;
            let mut tick = pace.map(|period| {
                let offset = period.mul_f64(c as f64 / clients as f64);
                let mut t = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                t
            });
            let mut lat: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
            let mut k = c;
            while Instant::now() < deadline {
                if let Some(t) = tick.as_mut() {
                    t.tick().await;
                }
                let t = Instant::now();
                let name = match k % 4 {
                    0 => {
                        p.list_cgroups().await?;
                        "ListCgroups"
                    }
                    1 => {
                        p.get_cgroup(&paths[k % paths.len()]).await?;
                        "GetCgroup"
                    }
                    2 => {
                        p.list_limits().await?;
                        "ListLimits"
                    }
                    _ => {
                        p.version().await?;
                        "Get(Version)"
                    }
                };
                lat.entry(name)
                    .or_default()
                    .push(t.elapsed().as_secs_f64() * 1e6);
                k += 1;
            }
            anyhow::Ok(lat)
        }));
    }
    let mut all: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for t in tasks {
        for (k, v) in t.await?? {
            all.entry(k).or_default().extend(v);
        }
    }
    let calls: usize = all.values().map(Vec::len).sum();
    let mut out = serde_json::Map::new();
    out.insert(
        "all".into(),
        dist(all.values().flatten().copied().collect()),
    );
    for (k, v) in all {
        out.insert(k.into(), dist(v));
    }
    out.insert("calls_per_s".into(), json!(calls as f64 / seconds as f64));
    Ok(Value::Object(out))
}
