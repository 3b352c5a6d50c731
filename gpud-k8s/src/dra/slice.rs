//! The node's ResourceSlice (resource.k8s.io/v1): one device per healthy GPU or MIG device of
//! gpud's inventory, with memory and compute as consumable capacity, and the publisher that keeps
//! it in step with gpud's inventory and health (each change a new pool generation).
//!
//! Unhealthy devices (a critical Xid, gone from gpud's inventory, NVML unavailable, gpud not
//! answering) are left out of the slice by default: that works on every cluster. With
//! [`DeviceTaints::NoSchedule`] or [`DeviceTaints::NoExecute`] they stay listed with a taint
//! `gpu.gpud.dev/unhealthy=<reason>` instead, for clusters with the `DRADeviceTaints` gate on
//! (beta and on by default from 1.36; an API server without it drops the field silently, which
//! would offer the device as healthy).

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::{
    api::resource::v1::{
        CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
        DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
};
use tokio::sync::watch;

use super::{ApiError, ApiServer};
use crate::inventory::{Inventory, Slot};

/// How unhealthy devices appear in the slice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceTaints {
    /// Left out of the slice (works on every cluster).
    #[default]
    Off,
    /// Listed with a `NoSchedule` taint: no new allocation, running pods stay.
    NoSchedule,
    /// Listed with a `NoExecute` taint: pods using them are evicted as well.
    NoExecute,
}

impl DeviceTaints {
    fn effect(self) -> Option<&'static str> {
        match self {
            Self::Off => None,
            Self::NoSchedule => Some("NoSchedule"),
            Self::NoExecute => Some("NoExecute"),
        }
    }
}

/// The key of the taint on unhealthy devices (its value is the reason, e.g. `Xid79`).
pub const UNHEALTHY_TAINT: &str = "gpu.gpud.dev/unhealthy";

/// The slice's name for `node` and `driver`.
pub fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

/// A slot's DRA device name (a DNS label): `gpu-<index>`, `gpu-<index>-mig-<n>`.
pub fn device_name(s: &Slot) -> String {
    match s.mig {
        None => format!("gpu-{}", s.index),
        Some(m) => format!("gpu-{}-mig-{m}", s.index),
    }
}

fn quantity(v: impl ToString) -> Quantity {
    Quantity(v.to_string())
}

/// The devices of the slice for `inv`: healthy slots, and unhealthy ones with a taint when
/// `taints` says so.
pub fn devices(inv: &Inventory, taints: DeviceTaints) -> Vec<Device> {
    let unit = inv.memory_unit.max(1);
    inv.slots
        .iter()
        .filter_map(|s| {
            let taint = match (&s.unhealthy, taints.effect()) {
                (None, _) => None,
                (Some(_), None) => return None,
                (Some(why), Some(effect)) => Some(DeviceTaint {
                    key: UNHEALTHY_TAINT.into(),
                    value: Some(why.reason()),
                    effect: effect.into(),
                    time_added: None,
                }),
            };
            let attributes = BTreeMap::from([
                (
                    "uuid".to_owned(),
                    DeviceAttribute {
                        string: Some(s.uuid.clone()),
                        ..Default::default()
                    },
                ),
                (
                    "index".to_owned(),
                    DeviceAttribute {
                        int: Some(i64::from(s.index)),
                        ..Default::default()
                    },
                ),
                (
                    "mig".to_owned(),
                    DeviceAttribute {
                        bool: Some(s.mig.is_some()),
                        ..Default::default()
                    },
                ),
            ]);
            let capacity = BTreeMap::from([
                (
                    "memory".to_owned(),
                    DeviceCapacity {
                        value: quantity(s.memory_total / unit * unit),
                        request_policy: Some(CapacityRequestPolicy {
                            default: Some(quantity(unit)),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: quantity(unit),
                                step: Some(quantity(unit)),
                                max: None,
                            }),
                            valid_values: None,
                        }),
                    },
                ),
                (
                    "compute".to_owned(),
                    DeviceCapacity {
                        value: quantity(100),
                        request_policy: Some(CapacityRequestPolicy {
                            default: Some(quantity(100)),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: quantity(1),
                                max: Some(quantity(100)),
                                step: Some(quantity(1)),
                            }),
                            valid_values: None,
                        }),
                    },
                ),
            ]);
            Some(Device {
                name: device_name(s),
                allow_multiple_allocations: Some(true),
                attributes: Some(attributes),
                capacity: Some(capacity),
                taints: taint.map(|t| vec![t]),
                ..Default::default()
            })
        })
        .collect()
}

/// The node's ResourceSlice: `devices` in the pool named after the node, at `generation`.
pub fn resource_slice(
    devices: Vec<Device>,
    driver: &str,
    node: &str,
    generation: i64,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node, driver)),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

/// Keeps a taint's `timeAdded` across republications: the API server sets it when it is unset,
/// so a taint sent again without it would look new.
fn keep_taint_times(devices: &mut [Device], stored: &ResourceSlice) {
    let old: BTreeMap<(&str, &str, &str), _> = stored
        .spec
        .devices
        .iter()
        .flatten()
        .flat_map(|d| {
            d.taints.iter().flatten().filter_map(move |t| {
                t.time_added
                    .clone()
                    .map(|at| ((d.name.as_str(), t.key.as_str(), t.effect.as_str()), at))
            })
        })
        .collect();
    for d in devices {
        for t in d.taints.iter_mut().flatten() {
            if let Some(at) = old.get(&(d.name.as_str(), t.key.as_str(), t.effect.as_str())) {
                t.time_added = Some(at.clone());
            }
        }
    }
}

/// Writes the node's slice: creates it, or replaces it with the next pool generation.
pub struct Publisher {
    api: ApiServer,
    driver: String,
    node: String,
    /// The slice as the API server last returned it (its resourceVersion and generation).
    stored: Option<ResourceSlice>,
    /// The devices last published; `None` before the first publication.
    sent: Option<Vec<Device>>,
}

impl Publisher {
    pub fn new(api: ApiServer, driver: &str, node: &str) -> Self {
        Self {
            api,
            driver: driver.into(),
            node: node.into(),
            stored: None,
            sent: None,
        }
    }

    /// Publishes `devices` unless they are what was last published; the pool generation it
    /// published, if it did. A replace that loses a race (409 Conflict) or finds the slice
    /// deleted reads the slice again and retries.
    pub async fn publish(&mut self, devices: Vec<Device>) -> Result<Option<i64>, ApiError> {
        if self.sent.as_ref() == Some(&devices) {
            return Ok(None);
        }
        let name = slice_name(&self.node, &self.driver);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let current = match self.stored.take() {
                Some(s) => Some(s),
                None => self.api.slice(&name).await?,
            };
            let generation = current.as_ref().map_or(1, |c| c.spec.pool.generation + 1);
            let mut want = devices.clone();
            if let Some(c) = &current {
                keep_taint_times(&mut want, c);
            }
            let mut slice = resource_slice(want, &self.driver, &self.node, generation);
            let written = match &current {
                None => self.api.create_slice(&slice).await,
                Some(c) => {
                    slice.metadata.resource_version = c.metadata.resource_version.clone();
                    self.api.replace_slice(&slice).await
                }
            };
            match written {
                Ok(stored) => {
                    self.stored = Some(stored);
                    self.sent = Some(devices);
                    return Ok(Some(generation));
                }
                // Someone else wrote or deleted it since it was read: read it again.
                Err(e) if attempts < 3 && matches!(e.code(), Some(404 | 409)) => {
                    tracing::debug!("ResourceSlice {name}: {e}; reading it again");
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Republishes the slice whenever `inventory` changes, until `stop`; failed publications are
/// retried with a growing pause (1 s to 30 s).
pub async fn follow(
    mut publisher: Publisher,
    mut inventory: watch::Receiver<std::sync::Arc<Inventory>>,
    taints: DeviceTaints,
    mut stop: watch::Receiver<bool>,
) {
    let stopped = |stop: &mut watch::Receiver<bool>| *stop.borrow_and_update();
    // gpud's first answer (the receiver starts with an empty placeholder).
    tokio::select! {
        r = inventory.changed() => if r.is_err() { return },
        _ = stop.wait_for(|s| *s) => return,
    }
    let mut pause = Duration::from_secs(1);
    while !stopped(&mut stop) {
        let inv = inventory.borrow_and_update().clone();
        let devs = devices(&inv, taints);
        let (n, healthy) = (devs.len(), inv.slots.iter().filter(|s| s.healthy()).count());
        match publisher.publish(devs).await {
            Ok(Some(generation)) => {
                tracing::info!(
                    "ResourceSlice published: generation {generation}, {n} devices ({healthy} healthy)"
                );
                pause = Duration::from_secs(1);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("publishing the ResourceSlice: {e}; again in {pause:?}");
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                pause = (pause * 2).min(Duration::from_secs(30));
                continue;
            }
        }
        tokio::select! {
            r = inventory.changed() => if r.is_err() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Unhealthy;
    use gpud_api::GpuRecord;

    fn inv() -> Inventory {
        let g = |index: u32, uuid: &str| GpuRecord {
            index,
            mig: u32::MAX,
            uuid: uuid.into(),
            memory_total: (16 << 30) + 5,
            mig_mode: "disabled".into(),
            ..Default::default()
        };
        Inventory::from_records(&[g(0, "GPU-a"), g(1, "GPU-b")], 1 << 30)
    }

    #[test]
    fn slices_offer_memory_and_compute_as_consumable_capacity() {
        let s = resource_slice(devices(&inv(), DeviceTaints::Off), "gpu.gpud.dev", "n1", 3);
        let v = serde_json::to_value(&s).unwrap_or_default();
        assert_eq!(v["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(v["kind"], "ResourceSlice");
        assert_eq!(v["metadata"]["name"], "n1-gpu.gpud.dev");
        let d = &v["spec"]["devices"][0];
        assert_eq!(d["name"], "gpu-0");
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(d["attributes"]["uuid"]["string"], "GPU-a");
        assert_eq!(d["capacity"]["memory"]["value"], (16u64 << 30).to_string());
        assert_eq!(
            d["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
            (1u64 << 30).to_string()
        );
        assert_eq!(d["capacity"]["compute"]["value"], "100");
        assert_eq!(v["spec"]["pool"]["generation"], 3);
        assert!(d.get("taints").is_none());
    }

    #[test]
    fn unhealthy_devices_are_left_out_or_tainted_with_their_reason() {
        let mut i = inv();
        i.slots[1].unhealthy = Some(Unhealthy::Xid(79));
        let off = devices(&i, DeviceTaints::Off);
        assert_eq!(
            off.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
            ["gpu-0"]
        );
        let tainted = devices(&i, DeviceTaints::NoExecute);
        assert_eq!(tainted.len(), 2);
        assert_eq!(tainted[0].taints, None);
        let t = tainted[1].taints.clone().unwrap_or_default();
        assert_eq!(
            t.iter()
                .map(|t| (t.key.as_str(), t.value.as_deref(), t.effect.as_str()))
                .collect::<Vec<_>>(),
            [(UNHEALTHY_TAINT, Some("Xid79"), "NoExecute")]
        );
    }

    #[test]
    fn a_republished_taint_keeps_the_time_the_api_server_gave_it() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let mut i = inv();
        i.slots[0].unhealthy = Some(Unhealthy::Gone);
        let mut stored = resource_slice(devices(&i, DeviceTaints::NoSchedule), "d", "n", 1);
        let at = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        for d in stored.spec.devices.iter_mut().flatten() {
            for t in d.taints.iter_mut().flatten() {
                t.time_added = Some(at.clone());
            }
        }
        let mut again = devices(&i, DeviceTaints::NoSchedule);
        keep_taint_times(&mut again, &stored);
        assert_eq!(
            again[0]
                .taints
                .as_ref()
                .and_then(|t| t[0].time_added.clone()),
            Some(at)
        );
        // Another effect is another taint: a time of its own.
        let mut other = devices(&i, DeviceTaints::NoExecute);
        keep_taint_times(&mut other, &stored);
        assert_eq!(
            other[0]
                .taints
                .as_ref()
                .and_then(|t| t[0].time_added.clone()),
            None
        );
    }
}
