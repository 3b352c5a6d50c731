//! `dev.gpud.Gpu1` objects: one per GPU (`/dev/gpud/Daemon1/gpu/<index>`) and per MIG device
//! (`/dev/gpud/Daemon1/gpu/<index>/mig/<n>`), published as NVML reports them. Their properties
//! read the latest inventory, so they never go stale; objects appear and disappear with it.

use std::collections::BTreeSet;

use tokio::sync::watch;
use zbus::interface;

use super::{dbus::OBJECT_PATH, model::GpuRecord};

pub const GPU_INTERFACE: &str = "dev.gpud.Gpu1";

/// Object path of a GPU (`mig == u32::MAX`) or MIG device.
pub fn gpu_path(index: u32, mig: u32) -> String {
    if mig == u32::MAX {
        format!("{OBJECT_PATH}/gpu/{index}")
    } else {
        format!("{OBJECT_PATH}/gpu/{index}/mig/{mig}")
    }
}

pub struct Gpu {
    index: u32,
    mig: u32,
    inventory: watch::Receiver<Vec<GpuRecord>>,
}

impl Gpu {
    fn get<T: Default>(&self, f: impl FnOnce(&GpuRecord) -> T) -> T {
        self.inventory
            .borrow()
            .iter()
            .find(|g| g.index == self.index && g.mig == self.mig)
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
}

/// Keeps the `Gpu1` objects in step with the inventory until the channel closes.
pub async fn publish_gpus(conn: zbus::Connection, mut rx: watch::Receiver<Vec<GpuRecord>>) {
    let mut published: BTreeSet<(u32, u32)> = BTreeSet::new();
    loop {
        let want: BTreeSet<(u32, u32)> = rx.borrow().iter().map(|g| (g.index, g.mig)).collect();
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
        if rx.changed().await.is_err() {
            return;
        }
    }
}
