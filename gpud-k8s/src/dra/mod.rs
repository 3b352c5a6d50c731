//! The DRA kubelet plugin (Dynamic Resource Allocation, resource.k8s.io/v1, kubelet API
//! `v1.DRAPlugin`, Kubernetes 1.34+), driver `gpu.gpud.dev`.
//!
//! - It publishes the node's ResourceSlice ([`slice`]): one device per GPU or MIG device (from
//!   gpud's `ListGpus`), with `memory` and `compute` as consumable capacity
//!   (`allowMultipleAllocations`, Kubernetes' DRAConsumableCapacity), so the scheduler itself fits
//!   fractional claims per GPU; republished whenever gpud's inventory or a GPU's health changes.
//! - It talks to the API server through kube-rs ([`apiserver`]: the calls, declared as [`RBAC`]).
//! - It registers with the kubelet's plugin watcher (`pluginregistration.v1`: a socket in
//!   `plugins_registry/`) and serves NodePrepareResources/NodeUnprepareResources.
//! - NodePrepareResources reads the claim's allocation from the API server and turns each device's
//!   consumed capacity into the same `gpud.dev/…` annotations the device plugin produces; they
//!   reach gpud through the existing runtime path: a CDI spec per claim whose container edits add
//!   the GPU (`NVIDIA_VISIBLE_DEVICES`) and gpud's OCI hook with the annotations as arguments.
//!   NodeUnprepareResources removes the spec (the hook's poststop cleared the limits).

pub mod apiserver;
mod registration;
pub mod slice;

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Duration};

use gpud_api::limits::{GpuSelector, LimitKind, LimitValue, parse_quantity};
use gpud_runtime::annotations::{self, Shares};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{Value, json};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

pub use apiserver::{ApiError, ApiServer, RBAC, Rule, rbac_grants};
pub use slice::{DeviceTaints, device_name, resource_slice};

use crate::{
    api::{
        dra::{self as pb, dra_plugin_server::DraPlugin, dra_plugin_server::DraPluginServer},
        pluginregistration as reg,
    },
    device_plugin::{Gpud, TopologySource, VISIBLE_DEVICES_ENV, spawn_refresh},
    grpc,
    inventory::{HealthTracker, Inventory},
};

/// The driver name (DeviceClass selectors, ResourceSlices, CDI kind `gpud.dev/claim`).
pub const DRIVER: &str = "gpu.gpud.dev";
/// The kubelet service version served.
pub const SERVICE_VERSION: &str = "v1.DRAPlugin";
/// The CDI kind of prepared claims.
pub const CDI_KIND: &str = "gpud.dev/claim";

/// Errors of the DRA plugin.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("claim {claim}: {reason}")]
    Claim { claim: String, reason: String },
    #[error("gpud: {0}")]
    Gpud(String),
    /// A task of the plugin could not run to its end.
    #[error("task aborted: {0}")]
    Task(String),
}

/// The plugin's settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub driver: String,
    pub node_name: String,
    /// The kubelet's plugin-registration directory.
    pub registry_dir: PathBuf,
    /// This plugin's directory (its `dra.sock`).
    pub plugin_dir: PathBuf,
    /// Where CDI specs go (the runtime reads them).
    pub cdi_dir: PathBuf,
    pub bus: String,
    /// The OCI hook the CDI specs run.
    pub oci_hook: PathBuf,
    /// Bound of each call to gpud.
    pub timeout: Duration,
    /// How often gpud's inventory and GPU health are read (the slice follows them).
    pub health_interval: Duration,
    /// Xid errors that leave a GPU healthy.
    pub ignored_xids: Vec<u64>,
    /// How unhealthy devices appear in the slice.
    pub device_taints: DeviceTaints,
}

/// One allocated device of a claim, with the shares its consumed capacity asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    pub request: String,
    pub device: String,
    pub uuid: String,
    pub shares: Shares,
}

/// The devices of `claim` allocated by this driver on this node, with their shares. A device
/// allocated without consumed capacity is the whole GPU: no limit.
pub fn prepare_claim(
    claim: &ResourceClaim,
    uid: &str,
    cfg_driver: &str,
    node: &str,
    inv: &Inventory,
) -> Result<Vec<Prepared>, DraError> {
    let meta = &claim.metadata;
    let name = format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    );
    let bad = |reason: String| DraError::Claim {
        claim: name.clone(),
        reason,
    };
    if meta.uid.as_deref() != Some(uid) {
        return Err(bad(format!("UID is not {uid}: the claim was replaced")));
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .map(|d| d.results.as_deref().unwrap_or_default())
        .ok_or_else(|| bad("not allocated".into()))?;
    let mut out = Vec::new();
    for r in results {
        if r.driver != cfg_driver || r.pool != node {
            continue;
        }
        let device = r.device.as_str();
        let slot = inv
            .slots
            .iter()
            .find(|s| device_name(s) == device)
            .ok_or_else(|| bad(format!("device {device:?} is not on this node")))?;
        let mut limits = std::collections::BTreeMap::new();
        let consumed = r.consumed_capacity.as_ref();
        if let Some(q) = consumed.and_then(|c| c.get("memory")) {
            let q = &q.0;
            let bytes = parse_quantity(q).map_err(|e| bad(format!("memory {q:?}: {e}")))?;
            limits.insert(LimitKind::MemoryMax, LimitValue::Number(bytes));
        }
        if let Some(q) = consumed.and_then(|c| c.get("compute")) {
            let q = &q.0;
            let pct = LimitKind::ComputeMax
                .parse(q)
                .map_err(|e| bad(format!("compute {q:?}: {e}")))?;
            limits.insert(LimitKind::ComputeMax, pct);
        }
        let mut shares = Shares::default();
        if !limits.is_empty() {
            shares
                .gpus
                .insert(GpuSelector::Uuid(slot.uuid.clone()), limits);
        }
        out.push(Prepared {
            request: r.request.clone(),
            device: device.to_owned(),
            uuid: slot.uuid.clone(),
            shares,
        });
    }
    Ok(out)
}

/// The CDI spec of one prepared claim: per device, its GPU and gpud's OCI hook (createRuntime
/// sets the shares, poststop clears them) with the shares as `--annotation` arguments and the
/// claim's device as `--claim`: the hook sets them once on the pod's cgroup, for every container
/// of the pod that uses the claim (gpud_runtime::pod).
pub fn cdi_spec(uid: &str, prepared: &[Prepared], cfg: &Config) -> Value {
    let devices: Vec<Value> = prepared
        .iter()
        .map(|p| {
            let mut args = vec!["gpud-oci-hook".to_owned()];
            if cfg.bus != "system" {
                args.extend(["--bus-address".to_owned(), cfg.bus.clone()]);
            }
            for (k, v) in annotations::render(&p.shares) {
                args.extend(["--annotation".to_owned(), format!("{k}={v}")]);
            }
            args.extend(["--claim".to_owned(), cdi_name(uid, &p.device)]);
            let hook = |stage: &str| {
                let mut a = args.clone();
                a.push(stage.to_owned());
                json!({ "hookName": stage, "path": cfg.oci_hook, "args": a })
            };
            let mut edits = json!({ "env": [format!("{VISIBLE_DEVICES_ENV}={}", p.uuid)] });
            if !p.shares.is_empty() {
                edits["hooks"] = json!([hook("createRuntime"), hook("poststop")]);
            }
            json!({ "name": cdi_name(uid, &p.device), "containerEdits": edits })
        })
        .collect();
    json!({ "cdiVersion": "0.6.0", "kind": CDI_KIND, "devices": devices })
}

fn cdi_name(uid: &str, device: &str) -> String {
    format!("{uid}-{device}")
}

fn cdi_path(cfg: &Config, uid: &str) -> PathBuf {
    cfg.cdi_dir.join(format!("gpud.dev-claim_{uid}.json"))
}

/// What the services share.
struct State {
    config: Config,
    api: ApiServer,
    gpud: Arc<Gpud>,
    memory_unit: u64,
}

impl State {
    async fn inventory(&self) -> Result<Inventory, DraError> {
        let gpus = self
            .gpud
            .call("ListGpus", |p| async move { p.list_gpus().await })
            .await
            .map_err(DraError::Gpud)?;
        Ok(Inventory::from_records(&gpus, self.memory_unit))
    }

    async fn prepare(&self, claim: &pb::Claim) -> Result<Vec<pb::Device>, DraError> {
        let obj = self.api.claim(&claim.namespace, &claim.name).await?;
        let inv = self.inventory().await?;
        let prepared = prepare_claim(
            &obj,
            &claim.uid,
            &self.config.driver,
            &self.config.node_name,
            &inv,
        )?;
        let spec = cdi_spec(&claim.uid, &prepared, &self.config);
        let path = cdi_path(&self.config, &claim.uid);
        let tmp = path.with_extension("json.tmp");
        let io = |p: &PathBuf| {
            let p = p.clone();
            move |source| DraError::Io { path: p, source }
        };
        std::fs::create_dir_all(&self.config.cdi_dir).map_err(io(&self.config.cdi_dir))?;
        // Written whole, then renamed: a runtime never reads half a spec.
        std::fs::write(&tmp, spec.to_string()).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        Ok(prepared
            .iter()
            .map(|p| pb::Device {
                request_names: vec![p.request.clone()],
                pool_name: self.config.node_name.clone(),
                device_name: p.device.clone(),
                cdi_device_ids: vec![format!("{CDI_KIND}={}", cdi_name(&claim.uid, &p.device))],
            })
            .collect())
    }
}

struct DraService(Arc<State>);

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<pb::NodePrepareResourcesRequest>,
    ) -> Result<Response<pb::NodePrepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for c in &request.get_ref().claims {
            let resp = match self.0.prepare(c).await {
                Ok(devices) => pb::NodePrepareResourceResponse {
                    devices,
                    error: String::new(),
                },
                Err(e) => {
                    tracing::warn!("prepare {}/{}: {e}", c.namespace, c.name);
                    pb::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: e.to_string(),
                    }
                }
            };
            claims.insert(c.uid.clone(), resp);
        }
        Ok(Response::new(pb::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<pb::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<pb::NodeUnprepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for c in &request.get_ref().claims {
            let path = cdi_path(&self.0.config, &c.uid);
            let error = match std::fs::remove_file(&path) {
                Ok(()) => String::new(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => format!("{}: {e}", path.display()),
            };
            claims.insert(c.uid.clone(), pb::NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(pb::NodeUnprepareResourcesResponse { claims }))
    }
}

/// Runs the DRA plugin until `shutdown`: keeps the ResourceSlice in step with gpud, serves
/// registration and the DRA service. Sockets are removed on the way out; CDI specs of prepared
/// claims stay (the kubelet unprepares them), and so does the slice (the kubelet removes the
/// slices of a driver that stays unregistered).
pub async fn run(
    config: Config,
    api: ApiServer,
    memory_unit: u64,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DraError> {
    let io = |p: &std::path::Path| {
        let p = p.to_owned();
        move |source| DraError::Io { path: p, source }
    };
    let gpud = Arc::new(Gpud::new(&config.bus, config.timeout));
    let state = Arc::new(State {
        gpud: gpud.clone(),
        api: api.clone(),
        memory_unit,
        config: config.clone(),
    });
    let (stop, stopped) = watch::channel(false);
    let view = spawn_refresh(
        gpud,
        HealthTracker::new(memory_unit, config.ignored_xids.iter().copied()),
        memory_unit,
        TopologySource::None,
        config.health_interval,
        stopped.clone(),
    );
    let publisher = slice::Publisher::new(api, &config.driver, &config.node_name);
    let slice_task = tokio::spawn(slice::follow(
        publisher,
        view.inventory,
        config.device_taints,
        stopped.clone(),
    ));

    std::fs::create_dir_all(&config.plugin_dir).map_err(io(&config.plugin_dir))?;
    std::fs::create_dir_all(&config.registry_dir).map_err(io(&config.registry_dir))?;
    let dra_sock = config.plugin_dir.join("dra.sock");
    let reg_sock = config
        .registry_dir
        .join(format!("{}-reg.sock", config.driver));
    let wait = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let dra = grpc::bind(&dra_sock).map_err(io(&dra_sock))?;
    let router =
        tonic::transport::Server::builder().add_service(DraPluginServer::new(DraService(state)));
    let dra_task = tokio::spawn(grpc::serve(router, dra, wait(stopped.clone())));
    let info = reg::PluginInfo {
        r#type: "DRAPlugin".into(),
        name: config.driver.clone(),
        endpoint: dra_sock.display().to_string(),
        supported_versions: vec![SERVICE_VERSION.into()],
    };
    let mut reg_task = tokio::spawn(registration::serve(info, reg_sock, stopped));
    // A registration socket that cannot be served ends the plugin: the kubelet would never
    // find it.
    let ended = tokio::select! {
        () = shutdown => None,
        r = &mut reg_task => Some(r),
    };
    let _ = stop.send(true);
    if let Ok(Err(e)) = dra_task.await {
        tracing::warn!("gRPC server: {e}");
    }
    let _ = slice_task.await;
    let _ = std::fs::remove_file(&dra_sock);
    let registration = match ended {
        Some(r) => r,
        None => reg_task.await,
    };
    registration.map_err(|e| DraError::Task(e.to_string()))??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpud_api::GpuRecord;

    fn inv() -> Inventory {
        let g = GpuRecord {
            index: 0,
            mig: u32::MAX,
            uuid: "GPU-a".into(),
            memory_total: (16 << 30) + 5,
            mig_mode: "disabled".into(),
            ..Default::default()
        };
        Inventory::from_records(&[g], 1 << 30)
    }

    fn claim(results: Value) -> ResourceClaim {
        let v = json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": { "namespace": "ns", "name": "c", "uid": "u1" },
                "spec": {},
                "status": { "allocation": { "devices": { "results": results } } } });
        serde_json::from_value(v).expect("a ResourceClaim")
    }

    #[test]
    fn claims_become_shares_and_bad_ones_clear_errors() {
        let c = claim(json!([
            { "request": "gpu", "driver": DRIVER, "pool": "node1", "device": "gpu-0",
              "consumedCapacity": { "memory": "8Gi", "compute": "30" } },
            { "request": "x", "driver": "other.dev", "pool": "node1", "device": "gpu-0" },
        ]));
        let p = prepare_claim(&c, "u1", DRIVER, "node1", &inv()).unwrap_or_default();
        assert_eq!(p.len(), 1);
        assert_eq!(
            annotations::render(&p[0].shares),
            [
                ("gpud.dev/compute-max.GPU-a".to_owned(), "30".to_owned()),
                ("gpud.dev/memory-max.GPU-a".to_owned(), "8Gi".to_owned())
            ]
            .into()
        );
        let e = prepare_claim(&c, "u2", DRIVER, "node1", &inv())
            .err()
            .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("replaced")));
        let bad = claim(
            json!([{ "request": "gpu", "driver": DRIVER, "pool": "node1",
            "device": "gpu-0", "consumedCapacity": { "compute": "130" } }]),
        );
        let e = prepare_claim(&bad, "u1", DRIVER, "node1", &inv())
            .err()
            .map(|e| e.to_string());
        assert!(
            e.is_some_and(|e| e.contains("compute \"130\"")),
            "out of range"
        );
        let gone = claim(
            json!([{ "request": "gpu", "driver": DRIVER, "pool": "node1", "device": "gpu-7" }]),
        );
        assert!(prepare_claim(&gone, "u1", DRIVER, "node1", &inv()).is_err());
    }
}
