//! The DRA kubelet plugin (Dynamic Resource Allocation, resource.k8s.io/v1, kubelet API
//! `v1.DRAPlugin`, Kubernetes 1.34+), driver `gpu.gpud.dev`.
//!
//! - It publishes the node's ResourceSlice: one device per GPU or MIG device (from gpud's
//!   `ListGpus`), with `memory` and `compute` as consumable capacity (`allowMultipleAllocations`,
//!   Kubernetes' DRAConsumableCapacity), so the scheduler itself fits fractional claims per GPU.
//! - It registers with the kubelet's plugin watcher (`pluginregistration.v1`: a socket in
//!   `plugins_registry/`) and serves NodePrepareResources/NodeUnprepareResources.
//! - NodePrepareResources reads the claim's allocation from the API server and turns each device's
//!   consumed capacity into the same `gpud.dev/…` annotations the device plugin produces; they
//!   reach gpud through the existing runtime path: a CDI spec per claim whose container edits add
//!   the GPU (`NVIDIA_VISIBLE_DEVICES`) and gpud's OCI hook with the annotations as arguments.
//!   NodeUnprepareResources removes the spec (the hook's poststop cleared the limits).

mod apiserver;
mod registration;

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Duration};

use gpud_api::limits::{GpuSelector, LimitKind, LimitValue, parse_quantity};
use gpud_runtime::annotations::{self, Shares};
use serde_json::{Value, json};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

pub use apiserver::{ApiServer, RBAC, Rule};

use crate::{
    api::{
        dra::{self as pb, dra_plugin_server::DraPlugin, dra_plugin_server::DraPluginServer},
        pluginregistration as reg,
    },
    device_plugin::{Gpud, VISIBLE_DEVICES_ENV},
    grpc,
    inventory::{Inventory, Slot},
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
    #[error("API server, {call}: {reason}")]
    Api { call: String, reason: String },
    #[error("claim {claim}: {reason}")]
    Claim { claim: String, reason: String },
    #[error("gpud: {0}")]
    Gpud(String),
    /// A blocking API-server call could not run to its end.
    #[error("API server call aborted: {0}")]
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
    pub timeout: Duration,
}

/// The ResourceSlice of the node: a device per slot with its memory and compute capacity.
pub fn resource_slice(inv: &Inventory, driver: &str, node: &str, generation: u64) -> Value {
    let unit = inv.memory_unit;
    let devices: Vec<Value> = inv
        .slots
        .iter()
        .filter(|s| s.healthy())
        .map(|s| {
            json!({
                "name": device_name(s),
                "allowMultipleAllocations": true,
                "attributes": {
                    "uuid": { "string": s.uuid },
                    "index": { "int": s.index },
                    "mig": { "bool": s.mig.is_some() },
                },
                "capacity": {
                    "memory": {
                        "value": (s.memory_total / unit * unit).to_string(),
                        "requestPolicy": {
                            "default": unit.to_string(),
                            "validRange": { "min": unit.to_string(), "step": unit.to_string() },
                        },
                    },
                    "compute": {
                        "value": "100",
                        "requestPolicy": {
                            "default": "100",
                            "validRange": { "min": "1", "max": "100", "step": "1" },
                        },
                    },
                },
            })
        })
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": { "name": format!("{node}-{driver}") },
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": { "name": node, "generation": generation, "resourceSliceCount": 1 },
            "devices": devices,
        },
    })
}

/// A slot's DRA device name (a DNS label): `gpu-<index>`, `gpu-<index>-mig-<n>`.
pub fn device_name(s: &Slot) -> String {
    match s.mig {
        None => format!("gpu-{}", s.index),
        Some(m) => format!("gpu-{}-mig-{m}", s.index),
    }
}

/// One allocated device of a claim, with the shares its consumed capacity asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    pub request: String,
    pub device: String,
    pub uuid: String,
    pub shares: Shares,
}

/// The devices of `claim` (a resource.k8s.io/v1 ResourceClaim) allocated by this driver on
/// this node, with their shares. A device allocated without consumed capacity is the whole GPU:
/// no limit.
pub fn prepare_claim(
    claim: &Value,
    uid: &str,
    cfg_driver: &str,
    node: &str,
    inv: &Inventory,
) -> Result<Vec<Prepared>, DraError> {
    let name = format!(
        "{}/{}",
        claim["metadata"]["namespace"].as_str().unwrap_or(""),
        claim["metadata"]["name"].as_str().unwrap_or("")
    );
    let bad = |reason: String| DraError::Claim {
        claim: name.clone(),
        reason,
    };
    if claim["metadata"]["uid"].as_str() != Some(uid) {
        return Err(bad(format!("UID is not {uid}: the claim was replaced")));
    }
    let results = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .ok_or_else(|| bad("not allocated".into()))?;
    let mut out = Vec::new();
    for r in results {
        if r["driver"].as_str() != Some(cfg_driver) || r["pool"].as_str() != Some(node) {
            continue;
        }
        let device = r["device"].as_str().unwrap_or_default();
        let slot = inv
            .slots
            .iter()
            .find(|s| device_name(s) == device)
            .ok_or_else(|| bad(format!("device {device:?} is not on this node")))?;
        let mut limits = std::collections::BTreeMap::new();
        let consumed = &r["consumedCapacity"];
        if let Some(q) = consumed["memory"].as_str() {
            let bytes = parse_quantity(q).map_err(|e| bad(format!("memory {q:?}: {e}")))?;
            limits.insert(LimitKind::MemoryMax, LimitValue::Number(bytes));
        }
        if let Some(q) = consumed["compute"].as_str() {
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
            request: r["request"].as_str().unwrap_or_default().to_owned(),
            device: device.to_owned(),
            uuid: slot.uuid.clone(),
            shares,
        });
    }
    Ok(out)
}

/// The CDI spec of one prepared claim: per device, its GPU and gpud's OCI hook (createRuntime
/// sets the shares, poststop clears them) with the shares as `--annotation` arguments.
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
    api: Arc<ApiServer>,
    gpud: Gpud,
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
        let api = self.api.clone();
        let (ns, name) = (claim.namespace.clone(), claim.name.clone());
        let obj = tokio::task::spawn_blocking(move || api.claim(&ns, &name))
            .await
            .map_err(|e| DraError::Task(e.to_string()))??;
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

/// Runs the DRA plugin until `shutdown`: publishes the ResourceSlice, serves registration and
/// the DRA service. Sockets are removed on the way out; CDI specs of prepared claims stay (the
/// kubelet unprepares them).
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
    let state = Arc::new(State {
        gpud: Gpud::new(&config.bus, config.timeout),
        api: Arc::new(api),
        memory_unit,
        config: config.clone(),
    });
    let inv = state.inventory().await?;
    let slice = resource_slice(&inv, &config.driver, &config.node_name, 1);
    let api = state.api.clone();
    tokio::task::spawn_blocking(move || api.apply_slice(&slice))
        .await
        .map_err(|e| DraError::Task(e.to_string()))??;
    tracing::info!("ResourceSlice published: {} devices", inv.slots.len());

    std::fs::create_dir_all(&config.plugin_dir).map_err(io(&config.plugin_dir))?;
    std::fs::create_dir_all(&config.registry_dir).map_err(io(&config.registry_dir))?;
    let dra_sock = config.plugin_dir.join("dra.sock");
    let reg_sock = config
        .registry_dir
        .join(format!("{}-reg.sock", config.driver));
    let (stop, stopped) = watch::channel(false);
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

    fn claim(results: Value) -> Value {
        json!({ "metadata": { "namespace": "ns", "name": "c", "uid": "u1" },
                "status": { "allocation": { "devices": { "results": results } } } })
    }

    #[test]
    fn slices_offer_memory_and_compute_as_consumable_capacity() {
        let s = resource_slice(&inv(), DRIVER, "node1", 3);
        let d = &s["spec"]["devices"][0];
        assert_eq!(d["name"], "gpu-0");
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(d["capacity"]["memory"]["value"], (16u64 << 30).to_string());
        assert_eq!(d["capacity"]["compute"]["value"], "100");
        assert_eq!(s["spec"]["pool"]["generation"], 3);
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
