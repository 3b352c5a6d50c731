//! The `v1beta1.DevicePlugin` service of one resource: ListAndWatch from the inventory,
//! GetPreferredAllocation through [`crate::placement`], Allocate into env (or CDI devices) and
//! gpud's annotations, PreStartContainer as a last check that gpud can enforce.

use std::{
    collections::{BTreeMap, HashMap},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use futures_util::{Stream, StreamExt as _};
use gpud_api::limits::{GpuSelector, LimitKind, LimitValue};
use gpud_runtime::annotations::{self, Shares};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};

use super::{DeviceListStrategy, Shared};
use crate::{
    api::deviceplugin::{self as dp, device_plugin_server::DevicePlugin},
    inventory::Inventory,
    placement::{self, PlacementError},
    units::{Resource, Unit},
};

/// The environment variable the NVIDIA container toolkit reads.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// The options gpud-k8s registers with: GetPreferredAllocation keeps a container on one GPU;
/// PreStartContainer refuses to start a container whose limits gpud could not enforce.
pub fn options() -> dp::DevicePluginOptions {
    dp::DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: true,
    }
}

/// The last allocation of one resource, waiting for the same container's other resource.
#[derive(Debug)]
struct Open {
    resource: Resource,
    slots: Vec<String>,
    at: Instant,
}

/// Pairs a container's two allocations: the kubelet allocates one container's resources back to
/// back (GetPreferredAllocation, Allocate, then the next resource), so an Allocate not yet paired
/// opens a pair that the other resource's next GetPreferredAllocation, within the window, closes.
#[derive(Debug, Default)]
pub struct Pairing {
    open: Option<Open>,
    /// The resource whose Allocate closes the pair, and the partner's slots.
    closing: Option<(Resource, Vec<String>)>,
}

impl Pairing {
    /// The slots the other resource of this container got, if this request closes a pair.
    fn partner_for(&mut self, r: Resource, window: Duration) -> Option<Vec<String>> {
        match self.open.take() {
            Some(o) if o.resource != r && o.at.elapsed() <= window => {
                self.closing = Some((r, o.slots.clone()));
                Some(o.slots)
            }
            // The same resource again: the previous container asked for only one of the two.
            other => {
                self.open = other;
                None
            }
        }
    }

    /// Records an Allocate; returns the partner's slots if it closed a pair.
    fn allocated(&mut self, r: Resource, slots: &[String]) -> Option<Vec<String>> {
        match self.closing.take() {
            Some((c, partner)) if c == r => Some(partner),
            _ => {
                self.open = Some(Open {
                    resource: r,
                    slots: slots.to_vec(),
                    at: Instant::now(),
                });
                None
            }
        }
    }
}

/// The service for one resource.
pub struct ResourcePlugin {
    pub resource: Resource,
    pub shared: Arc<Shared>,
    pub stop: watch::Receiver<bool>,
}

fn placement_status(e: PlacementError) -> Status {
    match e {
        PlacementError::UnknownDevice { .. } => Status::invalid_argument(e.to_string()),
        _ => Status::resource_exhausted(e.to_string()),
    }
}

/// Units per slot of one container's device IDs, in inventory order; unknown IDs refused.
fn units_per_slot(
    ids: &[String],
    inventory: &Inventory,
    r: Resource,
) -> Result<Vec<(String, u32)>, Status> {
    let mut per: BTreeMap<String, u32> = BTreeMap::new();
    for id in ids {
        let unit = Unit::parse(id)
            .filter(|u| {
                inventory
                    .slot(&u.uuid)
                    .is_some_and(|s| u.n < inventory.units_of(s, r))
            })
            .ok_or_else(|| Status::invalid_argument(format!("{r}: unknown device ID {id:?}")))?;
        *per.entry(unit.uuid).or_insert(0) += 1;
    }
    Ok(inventory
        .slots
        .iter()
        .filter_map(|s| per.get(&s.uuid).map(|n| (s.uuid.clone(), *n)))
        .collect())
}

/// The container's shares on each of its slots: memory units times the unit size, compute
/// units as percent.
pub fn shares_of(per_slot: &[(String, u32)], r: Resource, memory_unit: u64) -> Shares {
    let mut shares = Shares::default();
    for (uuid, n) in per_slot {
        let (kind, value) = match r {
            Resource::Memory => (LimitKind::MemoryMax, u64::from(*n) * memory_unit),
            Resource::Compute => (LimitKind::ComputeMax, u64::from(*n).min(100)),
        };
        shares
            .gpus
            .entry(GpuSelector::Uuid(uuid.clone()))
            .or_default()
            .insert(kind, LimitValue::Number(value));
    }
    shares
}

type ListStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for ResourcePlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let r = self.resource;
        let mut last: Option<Vec<dp::Device>> = None;
        let mut stop = self.stop.clone();
        // The current list at once, then again whenever this resource's devices change; the
        // stream ends when the server stops, so a graceful shutdown does not wait on it.
        let stream = WatchStream::new(self.shared.inventory.clone())
            .filter_map(move |inv| {
                let devices = inv.devices(r);
                let changed = last.as_ref() != Some(&devices);
                last = Some(devices.clone());
                std::future::ready(changed.then(|| Ok(dp::ListAndWatchResponse { devices })))
            })
            .take_until(async move {
                let _ = stop.wait_for(|s| *s).await;
            });
        tracing::info!("{r}: kubelet watching the device list");
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let r = self.resource;
        let inventory = self.shared.inventory.borrow().clone();
        let topology = self.shared.topology.read().await.clone();
        // What the other resource has taken, from the limits gpud enforces; without gpud the
        // choice is made without it.
        let other_taken = match self.shared.gpud.limits().await {
            Ok(limits) => super::gpud::taken_units(&limits, &inventory, r.other()),
            Err(e) => {
                tracing::warn!("{r}: preferring without gpud's limits: {e}");
                BTreeMap::new()
            }
        };
        let mut responses = Vec::new();
        for c in &request.get_ref().container_requests {
            let partner = self
                .shared
                .pairing
                .lock()
                .map_err(|_| Status::internal("pairing state poisoned"))?
                .partner_for(r, self.shared.config.pair_window);
            let req = placement::Request {
                resource: r,
                size: u32::try_from(c.allocation_size)
                    .map_err(|_| Status::invalid_argument("negative allocation_size"))?,
                available: &c.available_device_i_ds,
                must_include: &c.must_include_device_i_ds,
            };
            let ctx = placement::Context {
                inventory: &inventory,
                topology: &topology,
                partner: partner.as_deref(),
                other_taken: &other_taken,
            };
            let ids = placement::prefer(&req, &ctx).map_err(|e| {
                tracing::warn!("GetPreferredAllocation: {e}");
                placement_status(e)
            })?;
            tracing::info!(
                "{r}: preferred {} units on {:?}{}",
                ids.len(),
                slots_of(&ids),
                partner.map_or(String::new(), |p| format!(
                    " (with the container's {} on {p:?})",
                    r.other()
                ))
            );
            responses.push(dp::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(dp::PreferredAllocationResponse {
            container_responses: responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let r = self.resource;
        let inventory = self.shared.inventory.borrow().clone();
        let config = &self.shared.config;
        let mut responses = Vec::new();
        for c in &request.get_ref().container_requests {
            let per_slot = units_per_slot(&c.devices_ids, &inventory, r)?;
            let slots: Vec<String> = per_slot.iter().map(|(u, _)| u.clone()).collect();
            let shares = shares_of(&per_slot, r, inventory.memory_unit);
            let annotations: HashMap<String, String> =
                annotations::render(&shares).into_iter().collect();
            let mut resp = dp::ContainerAllocateResponse {
                annotations,
                ..Default::default()
            };
            match config.strategy {
                DeviceListStrategy::Envvar => {
                    resp.envs
                        .insert(VISIBLE_DEVICES_ENV.to_owned(), slots.join(","));
                }
                DeviceListStrategy::Cdi => {
                    resp.cdi_devices = slots
                        .iter()
                        .map(|u| dp::CdiDevice {
                            name: format!("{}={u}", config.cdi_kind),
                        })
                        .collect();
                }
            }
            let partner = self
                .shared
                .pairing
                .lock()
                .map_err(|_| Status::internal("pairing state poisoned"))?
                .allocated(r, &slots);
            if let Some(p) = partner
                && p != slots
            {
                // The kubelet ignored the preference (or the pairing guessed wrong): each
                // resource's limits still go where the kubelet counted them.
                tracing::warn!(
                    "{r} allocated on {slots:?}, the container's {} on {p:?}: split across GPUs",
                    r.other()
                );
            }
            tracing::info!("{r}: allocated {:?}", resp.annotations);
            responses.push(resp);
        }
        Ok(Response::new(dp::AllocateResponse {
            container_responses: responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        let r = self.resource;
        // The limits reach gpud through the runtime path as the container starts: a gpud that
        // does not answer would let it run without them, so the start waits (the kubelet
        // retries) until gpud is back.
        let gpus = self
            .shared
            .gpud
            .call("ListGpus", |p| async move { p.list_gpus().await })
            .await
            .map_err(|e| {
                Status::unavailable(format!("{r}: gpud cannot enforce limits now: {e}"))
            })?;
        for uuid in slots_of(&request.get_ref().devices_ids) {
            if !gpus.iter().any(|g| g.uuid == uuid) {
                return Err(Status::failed_precondition(format!(
                    "{r}: {uuid} is not in gpud's inventory"
                )));
            }
        }
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

/// The distinct slots of some device IDs, in order of first appearance.
fn slots_of(ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for id in ids {
        if let Some(u) = Unit::parse(id)
            && !out.contains(&u.uuid)
        {
            out.push(u.uuid);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_close_once_and_only_across_resources() {
        let w = Duration::from_secs(5);
        let mut p = Pairing::default();
        let a = vec!["GPU-a".to_owned()];
        let b = vec!["GPU-b".to_owned()];
        // Container 1: memory then compute.
        assert_eq!(p.partner_for(Resource::Memory, w), None);
        assert_eq!(p.allocated(Resource::Memory, &a), None);
        assert_eq!(p.partner_for(Resource::Compute, w), Some(a.clone()));
        assert_eq!(p.allocated(Resource::Compute, &a), Some(a.clone()));
        // Container 2: compute only, then container 3: compute: no pairing with container 1.
        assert_eq!(p.partner_for(Resource::Compute, w), None);
        assert_eq!(p.allocated(Resource::Compute, &b), None);
        assert_eq!(p.partner_for(Resource::Compute, w), None);
        assert_eq!(p.allocated(Resource::Compute, &a), None);
        // A stale open pair does not pin the next container.
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(p.partner_for(Resource::Memory, Duration::ZERO), None);
    }

    #[test]
    fn shares_are_the_units_on_each_gpu() {
        let per = vec![("GPU-a".to_owned(), 8), ("GPU-b".to_owned(), 2)];
        let s = shares_of(&per, Resource::Memory, 1 << 30);
        let text = annotations::render(&s);
        assert_eq!(
            text.get("gpud.dev/memory-max.GPU-a").map(String::as_str),
            Some("8Gi")
        );
        assert_eq!(
            text.get("gpud.dev/memory-max.GPU-b").map(String::as_str),
            Some("2Gi")
        );
        let s = shares_of(&per[..1], Resource::Compute, 1 << 30);
        assert_eq!(
            annotations::render(&s),
            [("gpud.dev/compute-max.GPU-a".to_owned(), "8".to_owned())].into()
        );
    }
}
