//! The few API-server calls the DRA plugin makes (read a ResourceClaim, create or replace the
//! node's ResourceSlice), as plain REST with the pod's service-account token. Blocking (ureq);
//! callers run them on tokio's blocking pool.

use std::{path::Path, time::Duration};

use serde_json::Value;

use super::DraError;

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

/// Where the service account's credentials are mounted in a pod.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// An API server: its base URL and the bearer token.
pub struct ApiServer {
    base: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl ApiServer {
    /// `base` (e.g. `https://10.0.0.1:443`), a bearer token, and the CA bundle (PEM) that signed
    /// the server's certificate (default: the public roots).
    pub fn new(base: &str, token: Option<String>, ca_pem: Option<&[u8]>) -> Result<Self, DraError> {
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(pem) = ca_pem {
            let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(pem)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            if certs.is_empty() {
                return Err(DraError::Config(
                    "the CA bundle holds no certificate".into(),
                ));
            }
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
        }
        let agent = ureq::Agent::config_builder()
            .tls_config(tls.build())
            .timeout_global(Some(Duration::from_secs(10)))
            .http_status_as_error(false)
            .build()
            .into();
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            token,
            agent,
        })
    }

    /// The API server of the cluster this pod runs in (`KUBERNETES_SERVICE_HOST`/`_PORT`, the
    /// mounted service-account token and CA).
    pub fn in_cluster() -> Result<Self, DraError> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| {
            DraError::Config(
                "not in a pod: KUBERNETES_SERVICE_HOST is unset; pass --api-server".into(),
            )
        })?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let dir = Path::new(SERVICE_ACCOUNT);
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|source| DraError::Io { path: p, source })
        };
        let token = String::from_utf8_lossy(&read("token")?).trim().to_owned();
        Self::new(
            &format!("https://{host}:{port}"),
            Some(token),
            Some(&read("ca.crt")?),
        )
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), DraError> {
        let url = format!("{}{path}", self.base);
        let err = |e: ureq::Error| DraError::Api {
            call: format!("{method} {path}"),
            reason: e.to_string(),
        };
        let auth = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let mut resp = match (method, body) {
            ("GET", _) => {
                let mut r = self.agent.get(&url).header("Accept", "application/json");
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call().map_err(err)?
            }
            (m, b) => {
                let mut r = match m {
                    "PUT" => self.agent.put(&url),
                    _ => self.agent.post(&url),
                }
                .header("Accept", "application/json");
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.send_json(b.cloned().unwrap_or(Value::Null))
                    .map_err(err)?
            }
        };
        let status = resp.status().as_u16();
        let v = resp.body_mut().read_json::<Value>().unwrap_or(Value::Null);
        Ok((status, v))
    }

    fn check(call: String, (status, v): (u16, Value)) -> Result<Value, DraError> {
        if (200..300).contains(&status) {
            return Ok(v);
        }
        let msg = v["message"].as_str().unwrap_or("").to_owned();
        Err(DraError::Api {
            call,
            reason: format!("HTTP {status} {msg}"),
        })
    }

    /// `GET …/namespaces/NS/resourceclaims/NAME` (resource.k8s.io/v1).
    pub fn claim(&self, namespace: &str, name: &str) -> Result<Value, DraError> {
        let path = format!("/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}");
        Self::check(format!("GET {path}"), self.request("GET", &path, None)?)
    }

    /// Creates the ResourceSlice, or replaces the one of that name.
    pub fn apply_slice(&self, slice: &Value) -> Result<(), DraError> {
        let coll = "/apis/resource.k8s.io/v1/resourceslices";
        let name = slice["metadata"]["name"].as_str().unwrap_or_default();
        let (status, v) = self.request("POST", coll, Some(slice))?;
        if status != 409 {
            return Self::check(format!("POST {coll}"), (status, v)).map(|_| ());
        }
        let path = format!("{coll}/{name}");
        let current = Self::check(format!("GET {path}"), self.request("GET", &path, None)?)?;
        let mut slice = slice.clone();
        slice["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        Self::check(
            format!("PUT {path}"),
            self.request("PUT", &path, Some(&slice))?,
        )
        .map(|_| ())
    }
}
