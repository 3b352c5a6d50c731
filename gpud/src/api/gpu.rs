//! `dev.gpud.Gpu1` objects: one per GPU (`/dev/gpud/Daemon1/gpu/<index>`) and per MIG device
//! (`/dev/gpud/Daemon1/gpu/<index>/mig/<n>`), published as NVML reports them. Their properties
//! read the latest inventory, so they never go stale; objects appear and disappear with it. A
//! GPU's object signals its critical Xid errors (`Xid`).

use std::collections::BTreeSet;

use tokio::sync::{broadcast, watch};
use zbus::interface;

use gpud_api::{GpuRecord, gpu_path};

use crate::{daemon::Handle, notice::Notice, nvml::GpuStatus};

pub struct Gpu {
    index: u32,
    mig: u32,
    inventory: watch::Receiver<Vec<GpuStatus>>,
}

impl Gpu {
    fn get<T: Default>(&self, f: impl FnOnce(&GpuRecord) -> T) -> T {
        self.inventory
            .borrow()
            .iter()
            .map(GpuRecord::from)
            .find(|g| g.index == self.index && g.mig == self.mig)
            .as_ref()
            .map(f)
            .unwrap_or_default()
    }
}

#[interface(name = "dev.gpud.Gpu1")]
impl Gpu {
    /// NVML index (of the parent GPU for a MIG device).
    #[zbus(property(emits_changed_signal = "false"))]
    async fn index(&self) -> u32 {
        self.index
    }
    /// MIG device number under its GPU; 4294967295 for a whole GPU.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn mig_device(&self) -> u32 {
        self.mig
    }
    #[zbus(property(emits_changed_signal = "false"))]
    async fn uuid(&self) -> String {
        self.get(|g| g.uuid.clone())
    }
    #[zbus(property(emits_changed_signal = "false"))]
    async fn name(&self) -> String {
        self.get(|g| g.name.clone())
    }
    #[zbus(property(emits_changed_signal = "false"))]
    async fn pci_bus_id(&self) -> String {
        self.get(|g| g.pci_bus_id.clone())
    }
    /// Bytes.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn memory_total(&self) -> u64 {
        self.get(|g| g.memory_total)
    }
    /// Bytes, at the last sample.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn memory_used(&self) -> u64 {
        self.get(|g| g.memory_used)
    }
    #[zbus(property(emits_changed_signal = "false"))]
    async fn driver_version(&self) -> String {
        self.get(|g| g.driver_version.clone())
    }
    #[zbus(property(emits_changed_signal = "false"))]
    async fn cuda_version(&self) -> String {
        self.get(|g| g.cuda_version.clone())
    }
    #[zbus(property(emits_changed_signal = "false"))]
    async fn compute_mode(&self) -> String {
        self.get(|g| g.compute_mode.clone())
    }
    /// `enabled`, `disabled` or `n/a`.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn mig_mode(&self) -> String {
        self.get(|g| g.mig_mode.clone())
    }

    /// NVML reported a critical Xid error on this GPU (or one of its MIG devices), attributed to
    /// `pid` (0: none) in `cgroup_id`/`cgroup` when that was the GPU's only process.
    #[zbus(signal)]
    pub async fn xid(
        emitter: &zbus::object_server::SignalEmitter<'_>,
        xid: u64,
        pid: u32,
        cgroup_id: u64,
        cgroup: &str,
    ) -> zbus::Result<()>;
}

/// Keeps the `Gpu1` objects in step with the inventory notices until the bus closes. A
/// subscriber that fell behind asks the daemon for the inventory instead of waiting for the next
/// change.
pub async fn publish_gpus(
    conn: zbus::Connection,
    mut notices: broadcast::Receiver<Notice>,
    daemon: Handle,
) {
    use tokio::sync::broadcast::error::RecvError;
    let (inventory, rx) = watch::channel(Vec::new());
    match daemon.list_gpus().await {
        Ok(gpus) => inventory.send_replace(gpus),
        Err(e) => {
            tracing::warn!("cannot read the GPU inventory: {e}");
            Vec::new()
        }
    };
    let mut published: BTreeSet<(u32, u32)> = BTreeSet::new();
    loop {
        let want: BTreeSet<(u32, u32)> = rx
            .borrow()
            .iter()
            .map(|g| (g.info.index, g.info.mig.unwrap_or(u32::MAX)))
            .collect();
        let server = conn.object_server();
        for &(index, mig) in want.difference(&published) {
            let obj = Gpu {
                index,
                mig,
                inventory: rx.clone(),
            };
            if let Err(e) = server.at(gpu_path(index, mig), obj).await {
                tracing::warn!(index, mig, "cannot publish GPU object: {e}");
            }
        }
        for &(index, mig) in published.difference(&want) {
            let _ = server.remove::<Gpu, _>(gpu_path(index, mig)).await;
        }
        published = want;
        loop {
            match notices.recv().await {
                Ok(Notice::Inventory(gpus)) => {
                    inventory.send_replace(gpus.as_ref().clone());
                    break;
                }
                Ok(_) => {}
                Err(RecvError::Lagged(_)) => match daemon.list_gpus().await {
                    Ok(gpus) => {
                        inventory.send_replace(gpus);
                        break;
                    }
                    Err(e) => tracing::warn!("cannot read the GPU inventory: {e}"),
                },
                Err(RecvError::Closed) => return,
            }
        }
    }
}
