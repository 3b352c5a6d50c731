//! A test kube-apiserver for the resource.k8s.io/v1 objects the DRA plugin reads and writes
//! (ResourceClaims, ResourceSlices), on plain HTTP/1.1 at 127.0.0.1, answering as the real one
//! does for those calls: its paths, the objects as JSON with `apiVersion`/`kind`, a
//! `resourceVersion` per write (409 Conflict for a stale one on update, 409 AlreadyExists for a
//! second create), `metav1.Status` bodies with code and reason for every error (404 NotFound,
//! 400 BadRequest for a wrong apiVersion, kind, name or namespace in the body, 422 Invalid for
//! what the real validation refuses of a ResourceSlice, 401 without the bearer token), and
//! immutable fields kept so. Every request is recorded with the RBAC verb the real server's
//! authorizer would check (get, list, watch, create, update, patch, delete, deletecollection).
//!
//! Watches and patches are not served (a 405 Status): the plugin makes neither, and a test sees
//! it in the recorded verbs if it starts to.

mod validate;

use std::{
    collections::{BTreeMap, BTreeSet},
    convert::Infallible,
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
};

use http_body_util::{BodyExt as _, Full};
use hyper::{Method, Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// The API group and version served.
pub const GROUP: &str = "resource.k8s.io";
pub const API_VERSION: &str = "resource.k8s.io/v1";

/// A resource served: its plural name, kind, and whether objects live in a namespace.
#[derive(Clone, Copy, Debug)]
struct Kind {
    resource: &'static str,
    kind: &'static str,
    namespaced: bool,
}

const KINDS: &[Kind] = &[
    Kind {
        resource: "resourceclaims",
        kind: "ResourceClaim",
        namespaced: true,
    },
    Kind {
        resource: "resourceslices",
        kind: "ResourceSlice",
        namespaced: false,
    },
];

/// One request as the server saw it, with the RBAC verb it needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: String,
    /// get, list, watch, create, update, patch, delete, deletecollection.
    pub verb: String,
    pub group: String,
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// The HTTP status answered.
    pub code: u16,
}

type Key = (&'static str, String, String);

#[derive(Default)]
struct Store {
    objects: BTreeMap<Key, Value>,
    resource_version: u64,
    uids: u64,
    requests: Vec<Recorded>,
}

impl Store {
    fn next_version(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }
}

/// The running server; stops when dropped.
pub struct TestApiServer {
    pub url: String,
    token: String,
    store: Arc<Mutex<Store>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A `metav1.Status` failure.
struct Failure {
    code: StatusCode,
    reason: &'static str,
    message: String,
    details: Option<Value>,
}

impl Failure {
    fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn body(&self) -> Value {
        let mut v = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code.as_u16(),
        });
        if let Some(d) = &self.details {
            v["details"] = d.clone();
        }
        v
    }
}

fn not_found(kind: &Kind, name: &str) -> Failure {
    Failure {
        details: Some(json!({ "name": name, "group": GROUP, "kind": kind.resource })),
        ..Failure::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{}.{GROUP} \"{name}\" not found", kind.resource),
        )
    }
}

/// The parts of a request path (the real server's RequestInfo, for this group).
struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
}

fn target(path: &str) -> Option<Target> {
    let rest = path.strip_prefix(&format!("/apis/{API_VERSION}/"))?;
    let parts: Vec<&str> = rest.split('/').collect();
    let (namespace, parts) = match parts.as_slice() {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
        p => (None, p),
    };
    let (resource, name) = match parts {
        [r] => (*r, None),
        [r, n] if !n.is_empty() => (*r, Some((*n).to_owned())),
        _ => return None,
    };
    let kind = *KINDS.iter().find(|k| k.resource == resource)?;
    // A namespaced resource is also listed across namespaces; a cluster one has no namespace.
    if kind.namespaced != namespace.is_some() && !(kind.namespaced && name.is_none()) {
        return None;
    }
    Some(Target {
        kind,
        namespace,
        name,
    })
}

fn verb(method: &Method, has_name: bool, query: &str) -> &'static str {
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    match (method.as_str(), has_name) {
        ("GET", _) if watch => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "unknown",
    }
}

impl TestApiServer {
    /// Serves on a free port of 127.0.0.1; requests must carry `Authorization: Bearer <token>`.
    pub async fn start(token: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the test API server");
        let addr: SocketAddr = listener.local_addr().expect("its address");
        let store = Arc::new(Mutex::new(Store::default()));
        let (st, tok) = (store.clone(), token.to_owned());
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (st, tok) = (st.clone(), tok.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let (st, tok) = (st.clone(), tok.clone());
                        async move { Ok::<_, Infallible>(handle(req, &st, &tok).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(conn), svc)
                        .await;
                });
            }
        });
        Self {
            url: format!("http://{addr}"),
            token: token.to_owned(),
            store,
            task,
        }
    }

    /// A kubeconfig with this server as the current context's cluster and the token as its user.
    pub fn write_kubeconfig(&self, path: &Path) {
        let kc = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
             users:\n- name: test\n  user:\n    token: {}\ncontexts:\n- name: test\n  context:\n    \
             cluster: test\n    user: test\n    namespace: default\ncurrent-context: test\n",
            self.url, self.token
        );
        std::fs::write(path, kc).expect("write the kubeconfig");
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `obj` as another client would have (the scheduler writing a claim's allocation):
    /// checked as a write is, then a new resourceVersion, a UID unless it has one.
    pub fn put(&self, mut obj: Value) {
        let kind = KINDS
            .iter()
            .find(|k| obj["kind"] == k.kind && obj["apiVersion"] == API_VERSION)
            .expect("an apiVersion and kind the server serves");
        let name = obj["metadata"]["name"].as_str().unwrap_or_default();
        if let Err(f) = validate::object(kind, name, &obj, None) {
            panic!("the API server would refuse {obj}: {}", f.message);
        }
        let mut s = self.lock();
        obj["metadata"]["resourceVersion"] = s.next_version().into();
        if obj["metadata"]["uid"].is_null() {
            s.uids += 1;
            obj["metadata"]["uid"] = format!("uid-test-{}", s.uids).into();
        }
        let key = (
            kind.resource,
            obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            obj["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        s.objects.insert(key, obj);
    }

    /// The stored object, as a GET would return it.
    pub fn object(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let s = self.lock();
        s.objects
            .iter()
            .find(|((r, ns, n), _)| *r == resource && ns == namespace && n == name)
            .map(|(_, v)| v.clone())
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    /// The (group, resource, verb) of every request that reached a resource.
    pub fn verbs_seen(&self) -> BTreeSet<(String, String, String)> {
        self.requests()
            .into_iter()
            .filter(|r| !r.resource.is_empty())
            .map(|r| (r.group, r.resource, r.verb))
            .collect()
    }
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    store: &Mutex<Store>,
    token: &str,
) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or_default().to_owned();
    let authorized = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {token}"));
    let content_type = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let t = target(&path);
    let verb = verb(
        &method,
        t.as_ref().is_some_and(|t| t.name.is_some()),
        &query,
    );
    let result = if !authorized {
        Err(Failure::new(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
        ))
    } else {
        match &t {
            None => Err(Failure::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )),
            Some(t) => {
                let mut s = store.lock().unwrap_or_else(|e| e.into_inner());
                serve(&mut s, t, verb, &content_type, &body)
            }
        }
    };
    let (code, out) = match result {
        Ok((code, v)) => (code, v),
        Err(f) => (f.code, f.body()),
    };
    let mut s = store.lock().unwrap_or_else(|e| e.into_inner());
    s.requests.push(Recorded {
        method: method.to_string(),
        path,
        query,
        verb: verb.to_owned(),
        group: t.as_ref().map(|_| GROUP.to_owned()).unwrap_or_default(),
        resource: t
            .as_ref()
            .map(|t| t.kind.resource.to_owned())
            .unwrap_or_default(),
        namespace: t.as_ref().and_then(|t| t.namespace.clone()),
        name: t.as_ref().and_then(|t| t.name.clone()),
        code: code.as_u16(),
    });
    Response::builder()
        .status(code)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(out.to_string())))
        .unwrap_or_default()
}

type Answer = Result<(StatusCode, Value), Failure>;

fn serve(s: &mut Store, t: &Target, verb: &str, content_type: &str, body: &[u8]) -> Answer {
    let ns = t.namespace.clone().unwrap_or_default();
    let key = |name: &str| (t.kind.resource, ns.clone(), name.to_owned());
    match (verb, &t.name) {
        ("get", Some(name)) => s
            .objects
            .get(&key(name))
            .map(|v| (StatusCode::OK, v.clone()))
            .ok_or_else(|| not_found(&t.kind, name)),
        ("list", None) => {
            let items: Vec<Value> = s
                .objects
                .iter()
                .filter(|((r, o_ns, _), _)| *r == t.kind.resource && (ns.is_empty() || *o_ns == ns))
                .map(|(_, v)| v.clone())
                .collect();
            Ok((
                StatusCode::OK,
                json!({ "apiVersion": API_VERSION, "kind": format!("{}List", t.kind.kind),
                        "metadata": { "resourceVersion": s.resource_version.to_string() },
                        "items": items }),
            ))
        }
        ("create", None) => {
            let mut obj = decode(t, content_type, body)?;
            let name = obj["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if name.is_empty() {
                return Err(validate::invalid(
                    &t.kind,
                    "",
                    &[(
                        "metadata.name".into(),
                        "Required value: name or generateName is required".into(),
                    )],
                ));
            }
            if obj["metadata"]["resourceVersion"]
                .as_str()
                .is_some_and(|rv| !rv.is_empty())
            {
                return Err(Failure::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "resourceVersion should not be set on objects to be created",
                ));
            }
            if s.objects.contains_key(&key(&name)) {
                return Err(Failure {
                    details: Some(json!({ "name": name, "group": GROUP, "kind": t.kind.resource })),
                    ..Failure::new(
                        StatusCode::CONFLICT,
                        "AlreadyExists",
                        format!("{}.{GROUP} \"{name}\" already exists", t.kind.resource),
                    )
                });
            }
            validate::object(&t.kind, &name, &obj, None)?;
            s.uids += 1;
            let meta = &mut obj["metadata"];
            meta["uid"] = format!("uid-apiserver-{}", s.uids).into();
            meta["generation"] = 1.into();
            meta["creationTimestamp"] = "2026-01-01T00:00:00Z".into();
            meta["resourceVersion"] = s.next_version().into();
            if t.kind.namespaced {
                meta["namespace"] = ns.clone().into();
                // Status is written through the status subresource only.
                obj.as_object_mut().map(|o| o.remove("status"));
            }
            validate::default_taint_times(&mut obj);
            s.objects.insert(key(&name), obj.clone());
            Ok((StatusCode::CREATED, obj))
        }
        ("update", Some(name)) => {
            let mut obj = decode(t, content_type, body)?;
            let body_name = obj["metadata"]["name"].as_str().unwrap_or_default();
            if body_name != name {
                return Err(Failure::new(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    format!(
                        "the name of the object ({body_name}) does not match the name on the URL ({name})"
                    ),
                ));
            }
            let Some(old) = s.objects.get(&key(name)).cloned() else {
                return Err(not_found(&t.kind, name));
            };
            let rv = obj["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            if !rv.is_empty() && rv != old["metadata"]["resourceVersion"] {
                return Err(Failure {
                    details: Some(json!({ "name": name, "group": GROUP, "kind": t.kind.resource })),
                    ..Failure::new(
                        StatusCode::CONFLICT,
                        "Conflict",
                        format!(
                            "Operation cannot be fulfilled on {}.{GROUP} \"{name}\": the object has \
                             been modified; please apply your changes to the latest version and try again",
                            t.kind.resource
                        ),
                    )
                });
            }
            validate::object(&t.kind, name, &obj, Some(&old))?;
            let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
            let changed = obj["spec"] != old["spec"];
            let meta = &mut obj["metadata"];
            for k in ["uid", "creationTimestamp", "namespace"] {
                meta[k] = old["metadata"][k].clone();
            }
            meta["generation"] = (generation + i64::from(changed)).into();
            meta["resourceVersion"] = s.next_version().into();
            if t.kind.namespaced {
                obj["status"] = old["status"].clone();
            }
            validate::default_taint_times(&mut obj);
            s.objects.insert(key(name), obj.clone());
            Ok((StatusCode::OK, obj))
        }
        ("delete", Some(name)) => s
            .objects
            .remove(&key(name))
            .map(|v| (StatusCode::OK, v))
            .ok_or_else(|| not_found(&t.kind, name)),
        (v, _) => Err(Failure::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!(
                "the test API server does not serve {v} on {}",
                t.kind.resource
            ),
        )),
    }
}

/// The request body as an object of the target's kind, refused as the real server refuses it.
fn decode(t: &Target, content_type: &str, body: &[u8]) -> Result<Value, Failure> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    if media != "application/json" {
        return Err(Failure::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json (got {media:?})"
            ),
        ));
    }
    let bad = |m: String| Failure::new(StatusCode::BAD_REQUEST, "BadRequest", m);
    let mut obj: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    if !obj.is_object() {
        return Err(bad("the body is not a JSON object".into()));
    }
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    if api_version != API_VERSION {
        return Err(bad(format!(
            "the API version in the data ({api_version}) does not match the expected API version ({API_VERSION})"
        )));
    }
    let kind = obj["kind"].as_str().unwrap_or_default();
    if kind != t.kind.kind {
        return Err(bad(format!(
            "the kind in the data ({kind}) does not match the expected kind ({})",
            t.kind.kind
        )));
    }
    let body_ns = obj["metadata"]["namespace"].as_str().unwrap_or_default();
    match &t.namespace {
        Some(ns) if !body_ns.is_empty() && body_ns != ns => {
            return Err(bad(
                "the namespace of the provided object does not match the namespace sent on the request"
                    .into(),
            ));
        }
        None if !body_ns.is_empty() => {
            // A cluster-scoped object's namespace is cleared, as the real server does.
            obj["metadata"]
                .as_object_mut()
                .map(|m| m.remove("namespace"));
        }
        _ => {}
    }
    Ok(obj)
}
