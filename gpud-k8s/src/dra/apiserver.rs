//! The DRA plugin's API-server calls, through kube-rs with the resource.k8s.io/v1 types: read a
//! ResourceClaim (typed get), and create or replace the node's ResourceSlice. [`RBAC`] declares
//! every call; [`ApiError`] says which call failed and what the API server answered.

use std::{path::Path, time::Duration};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::Namespace,
    resource::v1::{ResourceClaim, ResourceSlice},
};
use kube::{
    Api, Client,
    api::PostParams,
    config::{KubeConfigOptions, Kubeconfig},
};

/// One RBAC rule: the API group, the resource and the verbs the DRA plugin uses on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    pub group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
}

/// Every API-server call the DRA plugin makes, as RBAC rules: the ClusterRole in
/// deploy/kubernetes and the list in docs/kubernetes.md grant exactly these (tests check both
/// and the calls a test API server sees).
pub const RBAC: &[Rule] = &[
    Rule {
        group: "resource.k8s.io",
        resource: "resourceclaims",
        verbs: &["get"],
    },
    Rule {
        group: "resource.k8s.io",
        resource: "resourceslices",
        verbs: &["create", "get", "update"],
    },
];

/// Every (group, resource, verb) [`RBAC`] grants.
pub fn rbac_grants() -> impl Iterator<Item = (&'static str, &'static str, &'static str)> {
    RBAC.iter()
        .flat_map(|r| r.verbs.iter().map(move |v| (r.group, r.resource, *v)))
}

/// Bound of one API-server request (the plugin makes no long-running ones such as watches).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// An API-server call that failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No usable kubeconfig or in-cluster service account.
    #[error("API server configuration: {0}")]
    Config(String),
    /// The object does not exist (HTTP 404, reason NotFound).
    #[error("{object} not found ({verb}: {message})")]
    NotFound {
        verb: &'static str,
        object: String,
        message: String,
    },
    /// The API server refused the call (its `metav1.Status`).
    #[error("{verb} {object}: {reason} ({code}): {message}")]
    Status {
        verb: &'static str,
        object: String,
        code: u16,
        reason: String,
        message: String,
    },
    /// The call did not get an answer (connection, TLS, timeout, a body that is not the type).
    #[error("{verb} {object}: {source}")]
    Request {
        verb: &'static str,
        object: String,
        #[source]
        source: kube::Error,
    },
}

impl ApiError {
    fn of(verb: &'static str, object: String, e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 404 => Self::NotFound {
                verb,
                object,
                message: s.message,
            },
            kube::Error::Api(s) => Self::Status {
                verb,
                object,
                code: s.code,
                reason: s.reason,
                message: s.message,
            },
            source => Self::Request {
                verb,
                object,
                source,
            },
        }
    }

    /// The HTTP status the API server answered, if it answered.
    pub fn code(&self) -> Option<u16> {
        match self {
            Self::NotFound { .. } => Some(404),
            Self::Status { code, .. } => Some(*code),
            Self::Config(_) | Self::Request { .. } => None,
        }
    }
}

/// A client of the cluster's API server.
#[derive(Clone)]
pub struct ApiServer {
    client: Client,
}

impl ApiServer {
    /// The API server of `kubeconfig` (its current context), or else as kube-rs infers it:
    /// `$KUBECONFIG`, `~/.kube/config`, then the pod's service account (in-cluster).
    pub async fn connect(kubeconfig: Option<&Path>) -> Result<Self, ApiError> {
        let mut config = match kubeconfig {
            Some(path) => {
                let kc = Kubeconfig::read_from(path)
                    .map_err(|e| ApiError::Config(format!("{}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| ApiError::Config(format!("{}: {e}", path.display())))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| ApiError::Config(e.to_string()))?,
        };
        config.read_timeout = Some(REQUEST_TIMEOUT);
        config.write_timeout = Some(REQUEST_TIMEOUT);
        // The timeout counts from each request, not from when its pooled connection went idle.
        config.reset_reader_on_write = true;
        // Retried by kube-rs: 429, 503, 504 (an API server restarting or throttling).
        config.default_retry = true;
        let client = Client::try_from(config).map_err(|e| ApiError::Config(e.to_string()))?;
        Ok(Self { client })
    }

    /// Whether the DaemonSet `namespace/name` exists and is not being deleted (`get
    /// daemonsets`: not the DRA plugin's call but the gpud DaemonSet's, under its own Role in
    /// deploy/kubernetes/gpud, when a pod of it stops and must tell an update from an uninstall).
    pub async fn daemonset_remains(&self, namespace: &str, name: &str) -> Result<bool, ApiError> {
        match Api::<DaemonSet>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
        {
            Ok(ds) => Ok(ds.metadata.deletion_timestamp.is_none()),
            Err(e) => match ApiError::of("get", format!("daemonset {namespace}/{name}"), e) {
                ApiError::NotFound { .. } => Ok(false),
                e => Err(e),
            },
        }
    }

    /// Whether the namespace `name` is gone or being deleted (`get namespaces`, the gpud
    /// DaemonSet's ClusterRole): deleting a namespace deletes its pods before, or while, the
    /// namespace controller deletes their DaemonSet, so the DaemonSet alone cannot tell.
    pub async fn namespace_going(&self, name: &str) -> Result<bool, ApiError> {
        match Api::<Namespace>::all(self.client.clone()).get(name).await {
            Ok(ns) => Ok(ns.metadata.deletion_timestamp.is_some()),
            Err(e) => match ApiError::of("get", format!("namespace {name}"), e) {
                ApiError::NotFound { .. } => Ok(true),
                e => Err(e),
            },
        }
    }

    /// The ResourceClaim `namespace/name` (`get resourceclaims`).
    pub async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| ApiError::of("get", format!("claim {namespace}/{name}"), e))
    }

    /// The ResourceSlice `name` (`get resourceslices`); `None` if there is none.
    pub async fn slice(&self, name: &str) -> Result<Option<ResourceSlice>, ApiError> {
        let api = Api::<ResourceSlice>::all(self.client.clone());
        match api.get(name).await {
            Ok(s) => Ok(Some(s)),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
            Err(e) => Err(ApiError::of("get", format!("ResourceSlice {name}"), e)),
        }
    }

    /// Creates `slice` (`create resourceslices`); the stored object comes back.
    pub async fn create_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        Api::<ResourceSlice>::all(self.client.clone())
            .create(&PostParams::default(), slice)
            .await
            .map_err(|e| ApiError::of("create", slice_name(slice), e))
    }

    /// Replaces the slice of `slice`'s name (`update resourceslices`), conditional on its
    /// `metadata.resourceVersion` (409 Conflict when another write came first).
    pub async fn replace_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        Api::<ResourceSlice>::all(self.client.clone())
            .replace(&name, &PostParams::default(), slice)
            .await
            .map_err(|e| ApiError::of("update", slice_name(slice), e))
    }
}

fn slice_name(s: &ResourceSlice) -> String {
    format!(
        "ResourceSlice {}",
        s.metadata.name.as_deref().unwrap_or_default()
    )
}
