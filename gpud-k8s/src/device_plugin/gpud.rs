//! The plugin's view of gpud: one D-Bus connection (re-made after a failure), every call bounded
//! in time, and the periodic refresh of the inventory that ListAndWatch streams.

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

use gpud_api::{LimitRecord, Manager1Proxy, connect_builder, limits::LimitKind};
use tokio::sync::{Mutex, RwLock, watch};

use crate::{
    inventory::{HealthTracker, Inventory},
    topology::Topology,
    units::Resource,
};

/// A connection to gpud, made on first use and again after a failed call.
pub struct Gpud {
    bus: String,
    timeout: Duration,
    proxy: Mutex<Option<Manager1Proxy<'static>>>,
}

impl Gpud {
    pub fn new(bus: &str, timeout: Duration) -> Self {
        Self {
            bus: bus.to_owned(),
            timeout,
            proxy: Mutex::new(None),
        }
    }

    async fn proxy(&self) -> Result<Manager1Proxy<'static>, String> {
        let mut cached = self.proxy.lock().await;
        if let Some(p) = cached.as_ref() {
            return Ok(p.clone());
        }
        let connect = async {
            let conn = connect_builder(&self.bus).build().await?;
            Manager1Proxy::new(&conn).await
        };
        let p = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| {
                format!(
                    "no connection to bus {} within {:?}",
                    self.bus, self.timeout
                )
            })?
            .map_err(|e| format!("bus {}: {e}", self.bus))?;
        *cached = Some(p.clone());
        Ok(p)
    }

    /// Runs one call; a failure drops the connection so the next call connects anew.
    pub async fn call<T, F, Fut>(&self, what: &str, f: F) -> Result<T, String>
    where
        F: FnOnce(Manager1Proxy<'static>) -> Fut,
        Fut: std::future::Future<Output = zbus::Result<T>>,
    {
        let p = self.proxy().await?;
        let r = tokio::time::timeout(self.timeout, f(p)).await;
        let err = match r {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => format!("{what}: {e}"),
            Err(_) => format!("{what}: no answer within {:?}", self.timeout),
        };
        *self.proxy.lock().await = None;
        Err(err)
    }

    /// gpud's limits (`ListLimits`).
    pub async fn limits(&self) -> Result<Vec<LimitRecord>, String> {
        self.call("ListLimits", |p| async move { p.list_limits().await })
            .await
    }
}

/// Units of `r` taken per slot by the limits gpud enforces: `memory_max` in memory units
/// (rounded up), `compute_max` in percent, summed over cgroups. Limits named by a whole GPU's
/// index count for that GPU's slot.
pub fn taken_units(
    limits: &[LimitRecord],
    inventory: &Inventory,
    r: Resource,
) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for l in limits {
        let slot = inventory
            .slots
            .iter()
            .find(|s| s.uuid == l.gpu || (s.mig.is_none() && l.gpu.parse::<u32>() == Ok(s.index)));
        let Some(slot) = slot else { continue };
        let units = match r {
            Resource::Memory => l
                .limits
                .get(LimitKind::MemoryMax.dbus_name())
                .map(|b| b.div_ceil(inventory.memory_unit.max(1))),
            Resource::Compute => l.limits.get(LimitKind::ComputeMax.dbus_name()).copied(),
        };
        if let Some(u) = units {
            let e = out.entry(slot.uuid.clone()).or_insert(0u32);
            *e = e.saturating_add(u32::try_from(u).unwrap_or(u32::MAX));
        }
    }
    out
}

/// What the refresh task keeps current for the services.
pub struct View {
    pub inventory: watch::Receiver<Arc<Inventory>>,
    pub topology: Arc<RwLock<Topology>>,
}

/// Where the refresh task reads the GPU topology from.
#[derive(Clone, Debug)]
pub enum TopologySource {
    /// Not read (the DRA plugin: the scheduler places claims).
    None,
    /// NVML: this libnvidia-ml, or the system's.
    Nvml(Option<PathBuf>),
}

/// Refreshes the inventory from gpud every `interval` (and the topology whenever the set of GPUs
/// changes) until `stop` is set. Returns the receiving side at once.
pub fn spawn_refresh(
    gpud: Arc<Gpud>,
    mut tracker: HealthTracker,
    memory_unit: u64,
    topology_source: TopologySource,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) -> View {
    let (tx, rx) = watch::channel(Arc::new(Inventory::empty(memory_unit)));
    let topology = Arc::new(RwLock::new(Topology::default()));
    let topo = topology.clone();
    tokio::spawn(async move {
        let mut topology_of: Vec<String> = Vec::new();
        let mut announced = false;
        loop {
            let snapshot = async {
                let gpus = gpud
                    .call("ListGpus", |p| async move { p.list_gpus().await })
                    .await?;
                let nvml = gpud
                    .call("NvmlAvailable", |p| async move { p.nvml_available().await })
                    .await?;
                let events = gpud
                    .call(
                        "ListNvmlEvents",
                        |p| async move { p.list_nvml_events().await },
                    )
                    .await?;
                Ok::<_, String>((gpus, nvml, events))
            };
            let inv = match snapshot.await {
                Ok((gpus, nvml, events)) => {
                    let mut parents: Vec<String> = gpus
                        .iter()
                        .filter(|g| g.mig == u32::MAX)
                        .map(|g| g.uuid.clone())
                        .collect();
                    parents.sort();
                    if let TopologySource::Nvml(lib) = &topology_source
                        && parents != topology_of
                        && !parents.is_empty()
                    {
                        let lib = lib.clone();
                        match tokio::task::spawn_blocking(move || Topology::read(lib.as_deref()))
                            .await
                        {
                            Ok(Ok(t)) => {
                                tracing::info!("GPU topology: {} links known", t.links_known());
                                *topo.write().await = t;
                            }
                            Ok(Err(e)) => tracing::warn!(
                                "GPU topology unknown, multi-GPU placement follows GPU order: {e}"
                            ),
                            Err(e) => tracing::warn!("GPU topology: {e}"),
                        }
                        topology_of = parents;
                    }
                    let numa = topo.read().await.numa.clone();
                    tracker.update(&gpus, nvml, &events, &numa)
                }
                Err(e) => {
                    tracing::warn!("gpud: {e}; every GPU is reported unhealthy until it answers");
                    tracker.unreachable(&e)
                }
            };
            // The first round is always announced: receivers wait for it rather than take the
            // empty placeholder for gpud's answer.
            let was_announced = std::mem::replace(&mut announced, true);
            tx.send_if_modified(|cur| {
                if **cur == inv && was_announced {
                    return false;
                }
                for s in &inv.slots {
                    let was = cur.slot(&s.uuid).map(|c| c.unhealthy.clone());
                    if was.as_ref() != Some(&s.unhealthy) {
                        match &s.unhealthy {
                            None => tracing::info!("{} (GPU {}) healthy", s.uuid, s.index),
                            Some(why) => {
                                tracing::warn!("{} (GPU {}) unhealthy: {why}", s.uuid, s.index)
                            }
                        }
                    }
                }
                *cur = Arc::new(inv);
                true
            });
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    });
    View {
        inventory: rx,
        topology,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpud_api::GpuRecord;

    #[test]
    fn limits_count_against_their_gpus_in_units() {
        let gib = 1u64 << 30;
        let rec = |i: u32, uuid: &str| GpuRecord {
            index: i,
            mig: u32::MAX,
            uuid: uuid.into(),
            memory_total: 16 * gib,
            mig_mode: "disabled".into(),
            ..Default::default()
        };
        let inv = Inventory::from_records(&[rec(0, "GPU-a"), rec(1, "GPU-b")], gib);
        let limit = |gpu: &str, pairs: &[(&str, u64)]| LimitRecord {
            cgroup: "/x".into(),
            gpu: gpu.into(),
            limits: pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
            state: gpud_api::LimitState::IN_FORCE.into(),
            note: String::new(),
        };
        let limits = vec![
            limit("GPU-a", &[("memory_max", 8 * gib), ("compute_max", 30)]),
            limit("GPU-a", &[("memory_max", gib + 1)]),
            limit("1", &[("compute_max", 50)]),
            limit("all", &[("memory_max", 4 * gib)]),
        ];
        assert_eq!(
            taken_units(&limits, &inv, Resource::Memory),
            [("GPU-a".to_owned(), 10)].into()
        );
        assert_eq!(
            taken_units(&limits, &inv, Resource::Compute),
            [("GPU-a".to_owned(), 30), ("GPU-b".to_owned(), 50)].into()
        );
    }
}
