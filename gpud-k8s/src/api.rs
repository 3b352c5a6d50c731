//! The kubelet's gRPC APIs, generated at build time from `proto/` (see build.rs).

/// Device plugin API v1beta1: the kubelet's `Registration`, the plugin's `DevicePlugin`.
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
}

/// Plugin registration API v1 (the kubelet's plugin watcher; used by the DRA plugin).
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// DRA kubelet plugin API v1 (Kubernetes 1.34+).
pub mod dra {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}
