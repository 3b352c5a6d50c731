//! A test kubelet: the kubelet's side of the device-plugin API v1beta1 over real gRPC on unix
//! sockets. It serves `Registration` on its own `kubelet.sock`, then, like the kubelet's device
//! manager, dials each registered plugin's socket, follows `ListAndWatch`, and admits containers:
//! GetPreferredAllocation (when the plugin advertised it) from the healthy units not yet
//! allocated, Allocate, PreStartContainer (when required), merging the answers of several
//! resources as the kubelet does (annotations and CDI devices together; of two values of one
//! environment variable, the first).

pub mod grpc_go;
pub mod plugins;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::{Path, PathBuf},
    time::Duration,
};

use gpud_k8s::{
    api::deviceplugin::{
        self as dp,
        device_plugin_client::DevicePluginClient,
        registration_server::{Registration, RegistrationServer},
    },
    grpc,
};
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, transport::Channel};

struct RegistrationService {
    tx: mpsc::UnboundedSender<dp::RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(
        &self,
        request: Request<dp::RegisterRequest>,
    ) -> Result<Response<dp::Empty>, Status> {
        let r = request.into_inner();
        // The kubelet's own checks.
        if r.version != "v1beta1" {
            return Err(Status::invalid_argument(format!(
                "unsupported version {:?}",
                r.version
            )));
        }
        if r.endpoint.contains('/') || !r.resource_name.contains('/') {
            return Err(Status::invalid_argument(
                "invalid endpoint or resource name",
            ));
        }
        let _ = self.tx.send(r);
        Ok(Response::new(dp::Empty {}))
    }
}

/// The kubelet's registration server on `<dir>/kubelet.sock`.
pub struct TestKubelet {
    pub dir: PathBuf,
    registrations: mpsc::UnboundedReceiver<dp::RegisterRequest>,
    tx: mpsc::UnboundedSender<dp::RegisterRequest>,
    stop: Option<watch::Sender<bool>>,
}

impl TestKubelet {
    pub fn start(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("device-plugins dir");
        let (tx, registrations) = mpsc::unbounded_channel();
        let mut k = Self {
            dir: dir.to_owned(),
            registrations,
            tx,
            stop: None,
        };
        k.serve();
        k
    }

    fn serve(&mut self) {
        let listener = grpc::bind(&self.dir.join("kubelet.sock")).expect("bind kubelet.sock");
        let (stop, mut stopped) = watch::channel(false);
        let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(
            RegistrationService {
                tx: self.tx.clone(),
            },
        ));
        tokio::spawn(grpc::serve(router, listener, async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        self.stop = Some(stop);
    }

    /// The next registration, within `timeout`.
    pub async fn registration(&mut self, timeout: Duration) -> dp::RegisterRequest {
        tokio::time::timeout(timeout, self.registrations.recv())
            .await
            .expect("no registration in time")
            .expect("registration channel")
    }

    /// A restart as the kubelet does one: it stops, removes every socket in the directory (the
    /// plugins' too), and serves a new `kubelet.sock`.
    pub fn restart(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        for e in std::fs::read_dir(&self.dir).expect("read dir").flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        self.serve();
    }
}

impl Drop for TestKubelet {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
    }
}

/// The kubelet's connection to one registered plugin: its devices as ListAndWatch last sent
/// them, and the units it allocated.
pub struct PluginEndpoint {
    pub registration: dp::RegisterRequest,
    pub client: DevicePluginClient<Channel>,
    devices: watch::Receiver<Option<Vec<dp::Device>>>,
    /// How many ListAndWatch answers came.
    updates: watch::Receiver<u32>,
    pub allocated: BTreeSet<String>,
}

impl PluginEndpoint {
    /// Dials the plugin's socket and opens ListAndWatch.
    pub async fn connect(dir: &Path, registration: dp::RegisterRequest) -> Self {
        // The device manager's dial: grpc-go, blocking for 10 s, `WithAuthority("localhost")`.
        let channel = grpc_go::dial(
            &dir.join(&registration.endpoint),
            grpc_go::Authority::Localhost,
            Duration::from_secs(10),
        )
        .await
        .expect("dial the device plugin");
        let mut client = DevicePluginClient::new(channel);
        let mut stream = client
            .list_and_watch(dp::Empty {})
            .await
            .expect("ListAndWatch")
            .into_inner();
        let (tx, devices) = watch::channel(None);
        let (count_tx, updates) = watch::channel(0u32);
        tokio::spawn(async move {
            while let Ok(Some(resp)) = stream.message().await {
                // Counted first: whoever sees the new list sees it counted.
                count_tx.send_modify(|n| *n += 1);
                let _ = tx.send(Some(resp.devices));
            }
        });
        Self {
            registration,
            client,
            devices,
            updates,
            allocated: BTreeSet::new(),
        }
    }

    pub fn resource(&self) -> &str {
        &self.registration.resource_name
    }

    /// Waits until ListAndWatch sent a list that `f` accepts; that list.
    pub async fn devices_where(
        &mut self,
        timeout: Duration,
        f: impl Fn(&[dp::Device]) -> bool,
    ) -> Vec<dp::Device> {
        let mut rx = self.devices.clone();
        let r = tokio::time::timeout(timeout, async {
            rx.wait_for(|d| d.as_deref().is_some_and(&f))
                .await
                .map(|d| d.clone().unwrap_or_default())
        })
        .await;
        match r {
            Ok(Ok(d)) => d,
            _ => panic!(
                "{}: no matching device list in {timeout:?}; last: {:?}",
                self.resource(),
                self.devices
                    .borrow()
                    .as_ref()
                    .map(|d| d.iter().filter(|x| x.health == "Healthy").count())
            ),
        }
    }

    /// ListAndWatch answers so far.
    pub fn updates(&self) -> u32 {
        *self.updates.borrow()
    }

    /// The kubelet's allocation of `n` units for one container: the healthy units not yet
    /// allocated, the plugin's preference if it advertised one (its error fails the
    /// allocation, as it fails the pod's admission), then Allocate.
    pub async fn allocate(
        &mut self,
        n: usize,
    ) -> Result<(Vec<String>, dp::ContainerAllocateResponse), Status> {
        let healthy: Vec<String> = self
            .devices
            .borrow()
            .iter()
            .flatten()
            .filter(|d| d.health == "Healthy")
            .map(|d| d.id.clone())
            .filter(|id| !self.allocated.contains(id))
            .collect();
        if healthy.len() < n {
            return Err(Status::resource_exhausted(format!(
                "requested number of devices unavailable for {}. Requested: {n}, Available: {}",
                self.resource(),
                healthy.len()
            )));
        }
        let opts = self.registration.options.unwrap_or_default();
        let mut ids: Vec<String> = Vec::new();
        if opts.get_preferred_allocation_available {
            let resp = self
                .client
                .get_preferred_allocation(dp::PreferredAllocationRequest {
                    container_requests: vec![dp::ContainerPreferredAllocationRequest {
                        available_device_i_ds: healthy.clone(),
                        must_include_device_i_ds: Vec::new(),
                        allocation_size: i32::try_from(n).unwrap_or(i32::MAX),
                    }],
                })
                .await?
                .into_inner();
            let preferred = resp
                .container_responses
                .into_iter()
                .next()
                .map(|c| c.device_i_ds)
                .unwrap_or_default();
            ids = preferred
                .into_iter()
                .filter(|id| healthy.contains(id))
                .take(n)
                .collect();
        }
        for id in &healthy {
            if ids.len() >= n {
                break;
            }
            if !ids.contains(id) {
                ids.push(id.clone());
            }
        }
        let resp = self
            .client
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest {
                    devices_ids: ids.clone(),
                }],
            })
            .await?
            .into_inner();
        let c = resp
            .container_responses
            .into_iter()
            .next()
            .ok_or_else(|| Status::internal("no container response"))?;
        self.allocated.extend(ids.iter().cloned());
        Ok((ids, c))
    }

    /// PreStartContainer, if the plugin asked for it.
    pub async fn pre_start(&mut self, ids: &[String]) -> Result<(), Status> {
        if self
            .registration
            .options
            .as_ref()
            .is_some_and(|o| o.pre_start_required)
        {
            self.client
                .pre_start_container(dp::PreStartContainerRequest {
                    devices_ids: ids.to_vec(),
                })
                .await?;
        }
        Ok(())
    }

    /// The pod ended: its units are free again.
    pub fn release(&mut self, ids: &[String]) {
        for id in ids {
            self.allocated.remove(id);
        }
    }
}

/// One container admitted: the units per resource and the merged runtime options.
#[derive(Debug, Default)]
pub struct Admitted {
    pub units: BTreeMap<String, Vec<String>>,
    pub envs: BTreeMap<String, String>,
    pub annotations: HashMap<String, String>,
    pub cdi_devices: Vec<String>,
}

/// Admits one container asking `requests` (endpoint index, units), in that order, as the
/// kubelet's device manager does: allocation then PreStartContainer per resource, answers merged.
pub async fn admit(
    endpoints: &mut [PluginEndpoint],
    requests: &[(usize, usize)],
) -> Result<Admitted, Status> {
    let mut a = Admitted::default();
    for (i, n) in requests {
        let e = &mut endpoints[*i];
        let (ids, resp) = e.allocate(*n).await?;
        for (k, v) in resp.envs {
            a.envs.entry(k).or_insert(v);
        }
        a.annotations.extend(resp.annotations);
        a.cdi_devices
            .extend(resp.cdi_devices.into_iter().map(|c| c.name));
        a.units.insert(e.resource().to_owned(), ids);
    }
    for (i, _) in requests {
        let e = &mut endpoints[*i];
        let ids = a.units.get(e.resource()).cloned().unwrap_or_default();
        e.pre_start(&ids).await?;
    }
    Ok(a)
}

/// A running `gpud-k8s device-plugin`, killed on drop.
pub struct DevicePluginProcess {
    child: Option<std::process::Child>,
    pub log: PathBuf,
}

impl DevicePluginProcess {
    /// Starts `gpud-k8s --bus-address BUS device-plugin --plugin-dir DIR ARGS` with short
    /// intervals, its log in `log`.
    pub fn start(bus: &str, plugin_dir: &Path, args: &[&str], log: &Path) -> Self {
        let log_file = std::fs::File::create(log).expect("plugin log");
        let child = std::process::Command::new(crate::bin_dir().join("gpud-k8s"))
            .args([
                "--log",
                "gpud_k8s=debug,info",
                "--bus-address",
                bus,
                "device-plugin",
            ])
            .arg("--plugin-dir")
            .arg(plugin_dir)
            .args(["--health-interval-ms", "200", "--timeout-ms", "2000"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start gpud-k8s");
        Self {
            child: Some(child),
            log: log.to_owned(),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and its exit code.
    pub fn stop(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().ok().and_then(|s| s.code())
    }
}

impl Drop for DevicePluginProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
