//! `dev.gpud.Cgroup1` objects: one per attributed cgroup, at
//! [`cgroup_object_path`](gpud_api::cgroup_object_path) (`/dev/gpud/Daemon1/cgroup/_2fa_2fb`
//! for `/a/b`, systemd's escaping), with named, typed properties read from the state task's
//! published view, and `SetLimits`/`ClearLimits` on the cgroup itself. An `ObjectManager` on
//! `/dev/gpud/Daemon1` announces objects as cgroups come and go (`InterfacesAdded`/`Removed`).
//!
//! One publisher task owns the objects ([`publish_cgroups`]): every [`PUBLISH_EVERY`] it reads
//! the view, adds and removes objects, and for each property whose value changed stores the new
//! value and emits `PropertiesChanged`, so an object changes at most that often however fast
//! its cgroup's figures move.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use tokio::sync::watch;
use zbus::{interface, object_server::InterfaceRef};

use gpud_api::{OBJECT_PATH, cgroup_object_path, limits::LimitDict};

use super::{
    authz::Authorizer,
    dbus::{clear_limits_of, set_limits_of},
    error::ApiError,
    records::class_map,
};
use crate::daemon::{DaemonError, Handle, View};

/// How often at most the objects are brought up to date (and a property's change signalled).
pub const PUBLISH_EVERY: Duration = Duration::from_millis(500);

/// What a cgroup's object shows: each field one property.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CgroupProps {
    pub path: String,
    pub id: u64,
    pub memory_current: BTreeMap<String, u64>,
    pub memory_max: BTreeMap<String, u64>,
    pub memory_events: u64,
    pub nvml_memory: BTreeMap<String, u64>,
    pub processes: Vec<u32>,
    pub ioctl_counts: BTreeMap<String, u64>,
    pub compute_share: f64,
    pub compute_target: f64,
    pub compute_measured: f64,
    pub throttled_usec: u64,
    pub nr_throttled: u64,
    pub limits: BTreeMap<String, BTreeMap<String, u64>>,
    pub idle: BTreeMap<String, u64>,
    pub workload: BTreeMap<String, String>,
}

/// Every attributed cgroup's properties, by path, from `view` and the compute controller's
/// figures (`None` when compute shares are off).
pub fn props_of(
    view: &View,
    compute: Option<&crate::daemon::ComputeStats>,
) -> BTreeMap<String, CgroupProps> {
    let mut all: BTreeMap<String, CgroupProps> = view
        .cgroups
        .iter()
        .map(|c| {
            let p = CgroupProps {
                path: c.path.clone(),
                id: c.id,
                memory_current: c.memory.current.clone(),
                memory_max: c.memory.max.clone(),
                memory_events: c.memory.events,
                processes: c.pids.clone(),
                ioctl_counts: class_map(&c.ioctls),
                workload: c.workload.clone(),
                ..CgroupProps::default()
            };
            (c.path.clone(), p)
        })
        .collect();
    for u in &view.nvml_usage {
        if let Some(p) = all.get_mut(&u.cgroup) {
            p.nvml_memory
                .insert(u.gpu.to_string(), u.usage.memory_bytes);
        }
    }
    for (l, _) in &view.limits {
        if let Some(p) = all.get_mut(&l.cgroup) {
            p.limits.insert(l.gpu.to_string(), l.limits.named());
        }
    }
    for i in view.idle() {
        if let Some(p) = all.get_mut(&i.cgroup) {
            p.idle.insert(i.gpu.to_string(), i.idle_for.as_secs());
        }
    }
    for (cgroup, s) in compute.into_iter().flat_map(|c| c.iter()) {
        if let Some(p) = all.get_mut(cgroup) {
            (p.compute_share, p.compute_target, p.compute_measured) =
                (s.duty, s.target, s.measured);
            (p.throttled_usec, p.nr_throttled) = (s.throttled_usec, s.nr_throttled);
        }
    }
    all
}

/// One cgroup's object.
pub struct Cgroup {
    /// Shared with the publisher's record of what it published: one copy per cgroup.
    props: Arc<CgroupProps>,
    daemon: Handle,
    authz: Authorizer,
}

#[interface(name = "dev.gpud.Cgroup1")]
impl Cgroup {
    /// Path relative to the cgroup v2 root.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn path(&self) -> String {
        self.props.path.clone()
    }
    /// cgroup v2 id (the inode number of its directory).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn id(&self) -> u64 {
        self.props.id
    }
    /// GPU memory charged to it and its descendants (bytes) by GPU index, `unknown` and `all`.
    #[zbus(property)]
    async fn memory_current(&self) -> BTreeMap<String, u64> {
        self.props.memory_current.clone()
    }
    /// Memory limits in force on it (bytes) by GPU index or `all`.
    #[zbus(property)]
    async fn memory_max(&self) -> BTreeMap<String, u64> {
        self.props.memory_max.clone()
    }
    /// Allocations that crossed or were refused by its limits.
    #[zbus(property)]
    async fn memory_events(&self) -> u64 {
        self.props.memory_events
    }
    /// GPU memory NVML reports for its processes (bytes) by GPU index; empty without NVML.
    #[zbus(property)]
    async fn nvml_memory(&self) -> BTreeMap<String, u64> {
        self.props.nvml_memory.clone()
    }
    /// Its live attributed processes.
    #[zbus(property)]
    async fn processes(&self) -> Vec<u32> {
        self.props.processes.clone()
    }
    /// ioctls on NVIDIA files by class.
    #[zbus(property)]
    async fn ioctl_counts(&self) -> BTreeMap<String, u64> {
        self.props.ioctl_counts.clone()
    }
    /// Share of each period the compute controller lets it run (percent; 0 without a compute
    /// policy).
    #[zbus(property)]
    async fn compute_share(&self) -> f64 {
        self.props.compute_share
    }
    /// The utilization the controller aims it at (percent of one GPU, summed over its GPUs).
    #[zbus(property)]
    async fn compute_target(&self) -> f64 {
        self.props.compute_target
    }
    /// Its GPU utilization at the controller's last sample (percent).
    #[zbus(property)]
    async fn compute_measured(&self) -> f64 {
        self.props.compute_measured
    }
    /// Time the controller held it (µs), as `cpu.stat`'s `throttled_usec`.
    #[zbus(property, name = "ThrottledUSec")]
    async fn throttled_usec(&self) -> u64 {
        self.props.throttled_usec
    }
    /// Periods in which the controller held it.
    #[zbus(property)]
    async fn nr_throttled(&self) -> u64 {
        self.props.nr_throttled
    }
    /// Its stored limits by GPU selector (`all`, an index or a UUID), each by name (as
    /// `ListLimits`).
    #[zbus(property)]
    async fn limits(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.props.limits.clone()
    }
    /// Seconds it has been idle while holding memory, by GPU index (`[idle]`); empty when
    /// active everywhere.
    #[zbus(property)]
    async fn idle(&self) -> BTreeMap<String, u64> {
        self.props.idle.clone()
    }
    /// The Kubernetes workload it runs (`namespace`, `pod`, `container`), as the runtime
    /// integrations reported it (`dev.gpud.Manager1.SetWorkload`); empty when none did.
    #[zbus(property)]
    async fn workload(&self) -> BTreeMap<String, String> {
        self.props.workload.clone()
    }

    /// `dev.gpud.Manager1.SetLimits` on this cgroup.
    async fn set_limits(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        gpu: &str,
        limits: LimitDict,
    ) -> Result<(String, String), ApiError> {
        self.authz.check(conn, &header).await?;
        set_limits_of(&self.daemon, &self.props.path, gpu, limits).await
    }

    /// `dev.gpud.Manager1.ClearLimits` on this cgroup.
    async fn clear_limits(
        &self,
        #[zbus(connection)] conn: &zbus::Connection,
        #[zbus(header)] header: zbus::message::Header<'_>,
        gpu: &str,
        names: Vec<String>,
    ) -> Result<(), ApiError> {
        self.authz.check(conn, &header).await?;
        clear_limits_of(&self.daemon, &self.props.path, gpu, names).await
    }
}

/// Stores `new` in the object behind `iface` and signals each property that changed.
async fn update(iface: &InterfaceRef<Cgroup>, new: Arc<CgroupProps>) -> zbus::Result<()> {
    let mut obj = iface.get_mut().await;
    let old = std::mem::replace(&mut obj.props, new);
    let (p, e) = (&obj.props, iface.signal_emitter());
    if old.memory_current != p.memory_current {
        obj.memory_current_changed(e).await?;
    }
    if old.memory_max != p.memory_max {
        obj.memory_max_changed(e).await?;
    }
    if old.memory_events != p.memory_events {
        obj.memory_events_changed(e).await?;
    }
    if old.nvml_memory != p.nvml_memory {
        obj.nvml_memory_changed(e).await?;
    }
    if old.processes != p.processes {
        obj.processes_changed(e).await?;
    }
    if old.ioctl_counts != p.ioctl_counts {
        obj.ioctl_counts_changed(e).await?;
    }
    if old.compute_share != p.compute_share {
        obj.compute_share_changed(e).await?;
    }
    if old.compute_target != p.compute_target {
        obj.compute_target_changed(e).await?;
    }
    if old.compute_measured != p.compute_measured {
        obj.compute_measured_changed(e).await?;
    }
    if old.throttled_usec != p.throttled_usec {
        obj.throttled_u_sec_changed(e).await?;
    }
    if old.nr_throttled != p.nr_throttled {
        obj.nr_throttled_changed(e).await?;
    }
    if old.limits != p.limits {
        obj.limits_changed(e).await?;
    }
    if old.idle != p.idle {
        obj.idle_changed(e).await?;
    }
    if old.workload != p.workload {
        obj.workload_changed(e).await?;
    }
    Ok(())
}

/// Keeps a `Cgroup1` object per attributed cgroup, and an `ObjectManager` on the manager's
/// object, until the daemon stops (see the module docs). `admin_group` authorizes the objects'
/// mutating methods as the manager's.
pub async fn publish_cgroups(
    conn: zbus::Connection,
    daemon: Handle,
    admin_group: watch::Receiver<String>,
) {
    let server = conn.object_server();
    if let Err(e) = server.at(OBJECT_PATH, zbus::fdo::ObjectManager).await {
        tracing::warn!("cannot serve the object manager: {e}");
    }
    let authz = Authorizer::new(admin_group);
    let mut published: HashMap<String, Arc<CgroupProps>> = HashMap::new();
    let mut tick = tokio::time::interval(PUBLISH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // What the objects were last brought up to date from: an unchanged view and unchanged
    // compute figures change no property, so nothing is rebuilt or compared.
    let mut last: Option<(std::sync::Weak<View>, Option<crate::daemon::ComputeStats>)> = None;
    loop {
        tick.tick().await;
        let view = match daemon.view().await {
            Ok(v) => v,
            Err(DaemonError::Stopped) => return,
            Err(e) => {
                tracing::warn!("cannot read the view for the cgroup objects: {e}");
                continue;
            }
        };
        let compute = daemon.compute_stats();
        if let Some((seen, stats)) = &last
            && std::sync::Weak::ptr_eq(seen, &Arc::downgrade(&view))
            && *stats == compute
        {
            continue;
        }
        let want = props_of(&view, compute.as_ref());
        // Remembered only where every object was brought up to date; else the next pass retries.
        let mut all_done = true;
        let gone: Vec<String> = published
            .keys()
            .filter(|p| !want.contains_key(*p))
            .cloned()
            .collect();
        for path in gone {
            match server
                .remove::<Cgroup, _>(cgroup_object_path(&path).as_str())
                .await
            {
                Ok(_) | Err(zbus::Error::InterfaceNotFound) => {
                    published.remove(&path);
                }
                // Kept as published: removed again at the next pass.
                Err(e) => {
                    all_done = false;
                    tracing::warn!(cgroup = %path, "cannot remove the cgroup's object: {e}");
                }
            }
        }
        for (path, props) in want {
            let object = cgroup_object_path(&path);
            match published.get(&path) {
                Some(old) if **old == props => {}
                Some(_) => {
                    let props = Arc::new(props);
                    let updated = match server.interface::<_, Cgroup>(object.as_str()).await {
                        Ok(iface) => update(&iface, props.clone()).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = updated {
                        all_done = false;
                        tracing::warn!(cgroup = %path, "cannot update the cgroup's object: {e}");
                    }
                    published.insert(path, props);
                }
                None => {
                    let props = Arc::new(props);
                    let obj = Cgroup {
                        props: props.clone(),
                        daemon: daemon.clone(),
                        authz: authz.clone(),
                    };
                    match server.at(object.as_str(), obj).await {
                        Ok(_) => {
                            published.insert(path, props);
                        }
                        Err(e) => {
                            all_done = false;
                            tracing::warn!(cgroup = %path, "cannot publish the cgroup's object: {e}");
                        }
                    }
                }
            }
        }
        if all_done {
            last = Some((Arc::downgrade(&view), compute));
        }
    }
}
