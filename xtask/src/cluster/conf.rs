//! The components' configuration files, all written into the cluster directory.

use std::path::Path;

use super::{Cluster, IMAGE, POD_SUBNET};

/// The service range; its first address is the API server's (`pki::API_SERVICE_IP`).
pub const SERVICE_RANGE: &str = "10.96.0.0/16";

/// A kubeconfig for the API server on 127.0.0.1 with the client certificate `pki/NAME.crt`.
pub fn kubeconfig(c: &Cluster, name: &str) -> String {
    let pki = c.dir.join("pki");
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: gpud-test
  cluster:
    server: https://127.0.0.1:{port}
    certificate-authority: {ca}
users:
- name: {name}
  user:
    client-certificate: {crt}
    client-key: {key}
contexts:
- name: gpud-test
  context:
    cluster: gpud-test
    user: {name}
current-context: gpud-test
",
        port = super::API_PORT,
        ca = pki.join("ca.crt").display(),
        crt = pki.join(format!("{name}.crt")).display(),
        key = pki.join(format!("{name}.key")).display(),
    )
}

/// containerd 1.7's configuration (version 2): root, state and sockets in the cluster directory;
/// NRI on; CDI on; the runc runtime passing `gpud.dev/*` annotations into the OCI spec.
pub fn containerd(c: &Cluster, snapshotter: &str, runc: &Path) -> String {
    let d = c.dir.join("containerd");
    let d = d.display();
    let cni = c.dir.join("cni");
    // Where /run/nri points (`NODE_LINKS`): plugins find the socket at its usual path.
    let nri = c.dir.join("nri");
    let nri = nri.display();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
# Snapshotters that need their own filesystems, and tracing: not wanted here.
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{d}/containerd.sock"

[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = "{nri}/nri.sock"
  plugin_path = "{d}/nri-plugins"
  plugin_config_path = "{d}/nri-conf.d"
  plugin_registration_timeout = "5s"
  plugin_request_timeout = "2s"

[plugins."io.containerd.grpc.v1.cri"]
  # The sandbox's oom_score_adj of -998 needs CAP_SYS_RESOURCE, which this machine's root lacks:
  # keep containers at or above containerd's own.
  restrict_oom_score_adj = true
  # Imported by `cluster up`: there is no registry to pull from.
  sandbox_image = "{IMAGE}"
  enable_cdi = true
  cdi_spec_dirs = ["{d}/cdi", "/etc/cdi", "/var/run/cdi"]
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "{snapshotter}"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      # Device plugins' and DRA drivers' annotations reach the OCI spec (gpud's OCI hook).
      container_annotations = ["gpud.dev/*"]
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{d}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"#,
        runc = runc.display(),
        cni_bin = super::CNI_BIN,
        cni_conf = cni.join("conf").display(),
    )
}

/// The pods' network: a bridge (`cni0`) with host-local addresses, masqueraded, with host ports.
pub fn cni(c: &Cluster) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": super::CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": super::BRIDGE,
                "isGateway": true,
                "ipMasq": true,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    // Leases stay in the cluster directory, not /var/lib/cni.
                    "dataDir": c.dir.join("cni/ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    })
    .to_string()
}

/// The KubeletConfiguration.
pub fn kubelet(c: &Cluster) -> String {
    let pki = c.dir.join("pki");
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# Hybrid cgroups here (v1 controllers, an empty cgroup2): no systemd, no cgroup v2 only.
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
# No CAP_SYS_RESOURCE: the kubelet cannot lower its own oom_score_adj.
oomScoreAdj: 0
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
clusterDomain: cluster.local
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
staticPodPath: ""
podLogsDir: {logs}
# Test machines' disks are shared and fill up: neither evict nor collect the imported image.
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
"#,
        ca = pki.join("ca.crt").display(),
        logs = c.dir.join("pod-logs").display(),
    )
}

/// The KubeProxyConfiguration: iptables mode, and no conntrack sysctls (this machine may not let
/// them be written; the kernel's defaults do for a test cluster).
pub fn kube_proxy(c: &Cluster) -> String {
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {node}
clusterCIDR: {POD_SUBNET}
bindAddress: 127.0.0.1
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
iptables:
  localhostNodePorts: false
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        kubeconfig = c.dir.join("kube-proxy.kubeconfig").display(),
        node = c.node,
    )
}
