//! The Kubernetes manifests in `deploy/kubernetes/`: each parses, and names only fields of its
//! kind's schema (deserialized into the Kubernetes API's own types from `k8s-openapi`, generated
//! from the Kubernetes OpenAPI spec of the release gpud-k8s targets, 1.34; every key those types
//! would ignore is reported, as `kubectl --validate=strict` would); the three kustomizations
//! name every manifest; the DRA ClusterRole grants exactly what the DRA driver calls
//! (`gpud_k8s::dra::RBAC`); the DeviceClass, the claim template and the example pods agree with
//! the driver and each other; every workload runs the image `cargo xtask package image` builds
//! (its tag: this version; the name is checked against the built image by that stage of
//! `cargo xtask test`).
//!
//! No cluster and no root needed.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Namespace, Pod, PodSpec, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
    resource::v1::{DeviceClass, ResourceClaimTemplate},
};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The image repository the manifests run (`cargo xtask package image` tags it with the
/// workspace version).
const IMAGE_REPOSITORY: &str = "localhost/gpud";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// One YAML document of a manifest file.
struct Doc {
    file: PathBuf,
    value: Value,
}

impl Doc {
    fn kind(&self) -> (&str, &str) {
        (
            self.value["apiVersion"].as_str().unwrap_or(""),
            self.value["kind"].as_str().unwrap_or(""),
        )
    }

    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or("")
    }

    /// The document as `T`; panics on a type error or on any key `T` does not have (the path of
    /// each is listed).
    fn typed<T: DeserializeOwned>(&self) -> T {
        let mut unknown = Vec::new();
        let typed =
            serde_ignored::deserialize(self.value.clone(), |path| unknown.push(path.to_string()))
                .unwrap_or_else(|e| {
                    panic!(
                        "{}: {} {:?}: {e}",
                        self.file.display(),
                        self.kind().1,
                        self.name()
                    )
                });
        assert!(
            unknown.is_empty(),
            "{}: {} {:?} names fields its schema lacks: {unknown:?}",
            self.file.display(),
            self.kind().1,
            self.name()
        );
        typed
    }
}

/// Every `*.yaml` under `dir`, recursively, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn is_kustomization(p: &Path) -> bool {
    p.file_name().is_some_and(|n| n == "kustomization.yaml")
}

/// The documents of one file, as kubectl reads them (YAML into JSON values).
fn docs_of(file: &Path) -> Vec<Doc> {
    let text = std::fs::read_to_string(file).expect("read manifest");
    let values: Vec<Value> = serde_saphyr::from_multiple(&text)
        .unwrap_or_else(|e| panic!("{}: not YAML: {e}", file.display()));
    values
        .into_iter()
        .map(|value| Doc {
            file: file.to_owned(),
            value,
        })
        .collect()
}

/// Every document of every manifest (kustomizations apart).
fn all_docs() -> Vec<Doc> {
    yaml_files(&deploy_dir())
        .iter()
        .filter(|p| !is_kustomization(p))
        .flat_map(|p| docs_of(p))
        .collect()
}

/// Checks `doc` against its kind's schema; returns the kind's name. Panics on a kind this
/// project does not ship (add it here with its type).
fn check_schema(doc: &Doc) -> &'static str {
    match doc.kind() {
        ("v1", "Namespace") => {
            doc.typed::<Namespace>();
            "Namespace"
        }
        ("v1", "ServiceAccount") => {
            doc.typed::<ServiceAccount>();
            "ServiceAccount"
        }
        ("v1", "Pod") => {
            doc.typed::<Pod>();
            "Pod"
        }
        ("apps/v1", "DaemonSet") => {
            doc.typed::<DaemonSet>();
            "DaemonSet"
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            doc.typed::<ClusterRole>();
            "ClusterRole"
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            doc.typed::<ClusterRoleBinding>();
            "ClusterRoleBinding"
        }
        ("rbac.authorization.k8s.io/v1", "Role") => {
            doc.typed::<Role>();
            "Role"
        }
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
            doc.typed::<RoleBinding>();
            "RoleBinding"
        }
        ("resource.k8s.io/v1", "DeviceClass") => {
            doc.typed::<DeviceClass>();
            "DeviceClass"
        }
        ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
            doc.typed::<ResourceClaimTemplate>();
            "ResourceClaimTemplate"
        }
        (api, kind) => panic!(
            "{}: {api} {kind} is not a kind this test knows",
            doc.file.display()
        ),
    }
}

#[test]
fn every_manifest_names_only_fields_of_its_kinds_schema() {
    let docs = all_docs();
    let kinds: BTreeSet<&str> = docs.iter().map(check_schema).collect();
    let want: BTreeSet<&str> = [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "DaemonSet",
        "DeviceClass",
        "ResourceClaimTemplate",
        "Pod",
    ]
    .into();
    assert_eq!(kinds, want);
    assert_eq!(docs.len(), 16, "documents in deploy/kubernetes");
}

/// The check above is not blind: a misspelt field, a field of another kind and a wrong type are
/// each caught.
#[test]
#[should_panic(expected = "names fields its schema lacks")]
fn a_misspelt_field_is_caught() {
    let file = deploy_dir().join("device-plugin/daemonset.yaml");
    let mut doc = docs_of(&file).remove(0);
    let container = &mut doc.value["spec"]["template"]["spec"]["containers"][0];
    container["imagePullPolcy"] = Value::from("Always");
    check_schema(&doc);
}

#[test]
#[should_panic(expected = "names fields its schema lacks")]
fn a_field_of_another_kind_is_caught() {
    let file = deploy_dir().join("dra/deviceclass.yaml");
    let mut doc = docs_of(&file).remove(0);
    // A ResourceClaimTemplate's field, not a DeviceClass's.
    doc.value["spec"]["spec"] = serde_json::json!({});
    check_schema(&doc);
}

#[test]
#[should_panic(expected = "invalid type")]
fn a_wrong_type_is_caught() {
    let file = deploy_dir().join("common/serviceaccount.yaml");
    let mut doc = docs_of(&file).remove(0);
    doc.value["automountServiceAccountToken"] = Value::from("no");
    check_schema(&doc);
}

/// The `resources` of a kustomization (files, or directories holding a kustomization), resolved
/// recursively into the manifest files they bring.
fn kustomize_files(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    struct Kustomization {
        api_version: String,
        kind: String,
        resources: Vec<String>,
        #[serde(default)]
        config_map_generator: Vec<Generator>,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Generator {
        name: String,
        namespace: String,
        files: Vec<String>,
    }
    let file = dir.join("kustomization.yaml");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let k: Kustomization = serde_saphyr::from_str(&text)
        .unwrap_or_else(|e| panic!("{}: not a kustomization: {e}", file.display()));
    assert_eq!(k.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k.kind, "Kustomization");
    for g in &k.config_map_generator {
        assert!(!g.name.is_empty() && g.namespace == "gpud-system");
        for f in &g.files {
            assert!(
                dir.join(f).is_file(),
                "{}: {f} does not exist",
                file.display()
            );
        }
    }
    for r in &k.resources {
        let p = dir.join(r);
        if p.is_dir() {
            kustomize_files(&p, out);
        } else {
            assert!(p.is_file(), "{}: {r} does not exist", file.display());
            out.insert(p.canonicalize().expect("canonical"));
        }
    }
}

/// (kind, name) of what a flavour applies.
fn flavour(name: &str) -> (BTreeSet<PathBuf>, Vec<Doc>) {
    let mut files = BTreeSet::new();
    kustomize_files(&deploy_dir().join(name), &mut files);
    let docs = files.iter().flat_map(|f| docs_of(f)).collect();
    (files, docs)
}

#[test]
fn the_kustomizations_apply_every_manifest_but_the_examples() {
    let (dp_files, dp) = flavour("device-plugin");
    let (dra_files, dra) = flavour("dra");
    let (gpud_files, gpud) = flavour("gpud");
    let examples = deploy_dir()
        .join("examples")
        .canonicalize()
        .expect("examples");
    let all: BTreeSet<PathBuf> = yaml_files(&deploy_dir())
        .into_iter()
        .filter(|p| !is_kustomization(p))
        .map(|p| p.canonicalize().expect("canonical"))
        .filter(|p| !p.starts_with(&examples))
        .collect();
    let applied: BTreeSet<PathBuf> = dp_files
        .iter()
        .chain(&dra_files)
        .chain(&gpud_files)
        .cloned()
        .collect();
    assert_eq!(applied, all, "manifests no kustomization applies");

    let kinds = |docs: &[Doc]| -> BTreeSet<(String, String)> {
        docs.iter()
            .map(|d| (d.kind().1.to_owned(), d.name().to_owned()))
            .collect()
    };
    let has = |k: &BTreeSet<(String, String)>, kind: &str| k.iter().any(|(x, _)| x == kind);
    let (dp, dra, gpud) = (kinds(&dp), kinds(&dra), kinds(&gpud));
    for k in [&dp, &dra, &gpud] {
        assert!(has(k, "Namespace") && has(k, "ServiceAccount") && has(k, "DaemonSet"));
    }
    // The device plugin calls no API server: it is granted nothing.
    assert!(
        !has(&dp, "ClusterRole") && !has(&dp, "ClusterRoleBinding"),
        "{dp:?}"
    );
    assert!(
        has(&dra, "ClusterRole") && has(&dra, "DeviceClass"),
        "{dra:?}"
    );
    // gpud reads its own DaemonSet (a Role) and its own namespace (a ClusterRole).
    assert!(
        has(&gpud, "Role") && has(&gpud, "RoleBinding") && has(&gpud, "ClusterRole"),
        "{gpud:?}"
    );
}

/// The gpud DaemonSet's pods may read that DaemonSet and its namespace and nothing else; its init container checks
/// that they can, and its preStop hook asks about that same DaemonSet (an update keeps gpud on
/// the node, an uninstall removes it: docs/kubernetes.md).
#[test]
fn the_gpud_daemonset_asks_about_itself_and_may_read_only_itself() {
    let (_, docs) = flavour("gpud");
    let one = |kind: &str| -> &Doc {
        let found: Vec<&Doc> = docs.iter().filter(|d| d.kind().1 == kind).collect();
        assert_eq!(found.len(), 1, "one {kind}");
        found[0]
    };
    let ds: DaemonSet = one("DaemonSet").typed();
    let me = format!(
        "{}/{}",
        ds.metadata.namespace.as_deref().expect("namespace"),
        ds.metadata.name.as_deref().expect("name")
    );
    let role: Role = one("Role").typed();
    let rules = role.rules.unwrap_or_default();
    assert_eq!(rules.len(), 1, "{rules:?}");
    assert_eq!(
        rules[0].api_groups.as_deref(),
        Some(&["apps".to_owned()][..])
    );
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["daemonsets".to_owned()][..])
    );
    assert_eq!(rules[0].verbs, ["get"]);
    assert_eq!(
        rules[0].resource_names.as_deref(),
        Some(&[ds.metadata.name.clone().expect("name")][..])
    );
    let cluster_role: ClusterRole = one("ClusterRole").typed();
    let rules = cluster_role.rules.unwrap_or_default();
    assert_eq!(rules.len(), 1, "{rules:?}");
    assert_eq!(rules[0].api_groups.as_deref(), Some(&[String::new()][..]));
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["namespaces".to_owned()][..])
    );
    assert_eq!(rules[0].verbs, ["get"]);
    assert_eq!(
        rules[0].resource_names.as_deref(),
        Some(&[ds.metadata.namespace.clone().expect("namespace")][..])
    );
    let cluster_binding: ClusterRoleBinding = one("ClusterRoleBinding").typed();
    assert_eq!(
        cluster_binding.role_ref.name,
        cluster_role.metadata.name.expect("name")
    );
    let binding: RoleBinding = one("RoleBinding").typed();
    assert_eq!(binding.role_ref.name, role.metadata.name.expect("name"));
    let spec = pod_spec(&ds);
    let account = spec.service_account_name.clone().expect("service account");
    let subjects = binding.subjects.unwrap_or_default();
    assert!(
        subjects
            .iter()
            .any(|s| s.kind == "ServiceAccount" && s.name == account),
        "{subjects:?}"
    );
    assert!(
        spec.host_pid == Some(true),
        "gpud attributes host processes"
    );
    let install = spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "install")
        .expect("the install init container");
    let cmd = install.command.clone().unwrap_or_default();
    assert_eq!(cmd[..3], ["gpud-k8s", "node", "install"]);
    assert_eq!(
        cmd[cmd
            .iter()
            .position(|a| a == "--daemonset")
            .expect("--daemonset")
            + 1],
        me
    );
    let gpud = spec
        .containers
        .iter()
        .find(|c| c.name == "gpud")
        .expect("gpud");
    let pre_stop = gpud
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|h| h.exec.as_ref())
        .and_then(|e| e.command.clone())
        .expect("a preStop exec hook");
    assert_eq!(pre_stop[..3], ["gpud-k8s", "node", "uninstall"]);
    assert_eq!(
        pre_stop[pre_stop
            .iter()
            .position(|a| a == "--keep-while-daemonset")
            .expect("--keep-while-daemonset")
            + 1],
        me
    );
    // The configuration it mounts is the generated ConfigMap, and names the ready file the
    // preStop hook removes.
    let config = spec
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.config_map.as_ref())
        .expect("a ConfigMap volume");
    assert_eq!(config.name, "gpud-config");
    let toml = std::fs::read_to_string(deploy_dir().join("gpud/gpud.toml")).expect("gpud.toml");
    assert!(toml.contains("ready_file = \"/run/gpud/ready\""), "{toml}");
}

/// (API group, resource, verb) triples.
type Grants = BTreeSet<(String, String, String)>;

#[test]
fn the_dra_cluster_role_grants_exactly_the_calls_of_the_dra_driver() {
    let (_, docs) = flavour("dra");
    let roles: Vec<ClusterRole> = docs
        .iter()
        .filter(|d| d.kind().1 == "ClusterRole")
        .map(Doc::typed)
        .collect();
    assert_eq!(roles.len(), 1, "one ClusterRole");
    let role = &roles[0];
    assert!(role.aggregation_rule.is_none());
    let mut granted = Grants::new();
    for rule in role.rules.iter().flatten() {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{rule:?}"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let called: Grants = gpud_k8s::dra::rbac_grants()
        .map(|(g, r, v)| (g.to_owned(), r.to_owned(), v.to_owned()))
        .collect();
    assert!(!called.is_empty());
    assert_eq!(granted, called, "ClusterRole vs gpud_k8s::dra::RBAC");

    // Bound to the service account the DRA DaemonSet runs as, in its namespace.
    let role_name = role.metadata.name.clone().expect("role name");
    let bindings: Vec<ClusterRoleBinding> = docs
        .iter()
        .filter(|d| d.kind().1 == "ClusterRoleBinding")
        .map(Doc::typed)
        .collect();
    assert_eq!(bindings.len(), 1);
    let b = &bindings[0];
    assert_eq!(b.role_ref.kind, "ClusterRole");
    assert_eq!(b.role_ref.name, role_name);
    let subjects: BTreeSet<(String, String, String)> = b
        .subjects
        .iter()
        .flatten()
        .map(|s| {
            (
                s.kind.clone(),
                s.namespace.clone().unwrap_or_default(),
                s.name.clone(),
            )
        })
        .collect();
    let sets: Vec<DaemonSet> = docs
        .iter()
        .filter(|d| d.kind().1 == "DaemonSet")
        .map(Doc::typed)
        .collect();
    assert_eq!(sets.len(), 1);
    let ds = &sets[0];
    let spec = pod_spec(ds);
    assert_ne!(spec.automount_service_account_token, Some(false));
    let runs_as = (
        "ServiceAccount".to_owned(),
        ds.metadata.namespace.clone().expect("namespace"),
        spec.service_account_name.clone().expect("service account"),
    );
    assert_eq!(subjects, BTreeSet::from([runs_as]));
    let command = spec.containers[0].command.clone().unwrap_or_default();
    assert_eq!(command[..2], ["gpud-k8s", "dra"]);
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
}

#[test]
fn device_class_claim_template_and_pods_agree_with_the_driver() {
    let docs = all_docs();
    let one = |kind: &str| -> &Doc {
        let found: Vec<&Doc> = docs.iter().filter(|d| d.kind().1 == kind).collect();
        assert_eq!(found.len(), 1, "one {kind}");
        found[0]
    };
    let class: DeviceClass = one("DeviceClass").typed();
    let cel: Vec<String> = class
        .spec
        .selectors
        .iter()
        .flatten()
        .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
        .collect();
    assert_eq!(
        cel,
        [format!("device.driver == \"{}\"", gpud_k8s::dra::DRIVER)]
    );
    let class_name = class.metadata.name.expect("class name");

    let template: ResourceClaimTemplate = one("ResourceClaimTemplate").typed();
    let requests = template
        .spec
        .spec
        .devices
        .and_then(|d| d.requests)
        .expect("device requests");
    assert_eq!(requests.len(), 1);
    let exactly = requests[0].exactly.as_ref().expect("exactly");
    assert_eq!(exactly.device_class_name, class_name);
    // The consumable capacities the driver publishes per device (gpud-k8s/src/dra: `memory` in
    // bytes, `compute` in percent).
    let asked: BTreeMap<String, String> = exactly
        .capacity
        .as_ref()
        .and_then(|c| c.requests.clone())
        .expect("capacity requests")
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect();
    assert_eq!(
        asked,
        BTreeMap::from([
            ("compute".to_owned(), "30".to_owned()),
            ("memory".to_owned(), "8Gi".to_owned())
        ])
    );

    let template_name = template.metadata.name.expect("template name");
    let pods: Vec<Pod> = docs
        .iter()
        .filter(|d| d.kind().1 == "Pod")
        .map(Doc::typed)
        .collect();
    assert_eq!(pods.len(), 2, "the device-plugin and the DRA example");
    let mut dra_pods = 0;
    let mut dp_pods = 0;
    for pod in &pods {
        let spec = pod.spec.as_ref().expect("pod spec");
        if let Some(claims) = &spec.resource_claims {
            dra_pods += 1;
            assert_eq!(
                claims[0].resource_claim_template_name.as_deref(),
                Some(template_name.as_str())
            );
            let used = spec.containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.claims.as_ref())
                .expect("container claims");
            assert_eq!(used[0].name, claims[0].name);
        } else {
            dp_pods += 1;
            let limits = spec.containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .expect("limits");
            let names: BTreeSet<&str> = limits.keys().map(String::as_str).collect();
            assert_eq!(
                names,
                BTreeSet::from(["gpud.dev/gpu-memory", "gpud.dev/gpu-compute"])
            );
        }
    }
    assert_eq!((dra_pods, dp_pods), (1, 1));
}

#[test]
fn every_workload_runs_the_packaged_image_of_this_version() {
    let want = format!("{IMAGE_REPOSITORY}:{}", env!("CARGO_PKG_VERSION"));
    let mut seen = 0;
    for doc in all_docs().iter().filter(|d| d.kind().1 == "DaemonSet") {
        let ds: DaemonSet = doc.typed();
        let spec = pod_spec(&ds);
        for c in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            assert_eq!(
                c.image.as_deref(),
                Some(want.as_str()),
                "{}: container {}",
                doc.file.display(),
                c.name
            );
            assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"));
            let program = c.command.as_ref().and_then(|c| c.first()).expect("command");
            assert!(
                ["gpud-k8s", "gpud-nri", "gpud", "sh"].contains(&program.as_str()),
                "{program}"
            );
            seen += 1;
        }
    }
    // device-plugin and dra with their wait-for-gpud; gpud's bpffs, install, gpud and nri.
    assert_eq!(seen, 8);
}
