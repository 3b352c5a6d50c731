//! gpud-k8s: the Kubernetes side of gpud, as a client of gpud's D-Bus API and its limit schema
//! (gpud-api) and of its runtime path (gpud-runtime: the `gpud.dev/…` annotations the NRI plugin
//! and the OCI hook apply). It links nothing of the daemon, and nothing in the daemon depends on
//! this crate.
//!
//! - [`device_plugin`]: the kubelet device plugin (API v1beta1) for `gpud.dev/gpu-memory` and
//!   `gpud.dev/gpu-compute`: inventory and health from gpud ([`inventory`]), placement on one GPU
//!   or on closely linked GPUs ([`placement`], [`topology`]), and Allocate answers that carry the
//!   container's limits as annotations ([`units`] names the units).
//! - [`dra`]: the DRA kubelet plugin (API v1, Kubernetes 1.34+): plugin registration, the
//!   node's ResourceSlice with memory and compute as consumable capacity, and
//!   NodePrepareResources turning a claim's allocation into the same limits through CDI.
//! - [`node`]: gpud as a node agent (the gpud DaemonSet): its host files installed from the
//!   image and removed again, and the readiness the plugins wait on.
//! - [`api`]: the kubelet's gRPC APIs, generated from `proto/`; [`grpc`]: gRPC on unix sockets.
//!
//! docs/kubernetes.md is the operator's guide.

pub mod api;
pub mod device_plugin;
pub mod dra;
pub mod grpc;
pub mod inventory;
pub mod node;
pub mod placement;
pub mod topology;
pub mod units;
