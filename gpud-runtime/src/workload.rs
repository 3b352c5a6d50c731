//! The names of the Kubernetes workload a container runs (namespace, pod, container), which the
//! OCI hook and the NRI plugin report to gpud (`SetWorkload`, [`Client::set_workload`]) to label
//! the cgroup's metrics and listings. Names only: no limit depends on them, so a failure to
//! report them is a warning and never fails a container.
//!
//! [`Client::set_workload`]: crate::client::Client::set_workload

use std::collections::{BTreeMap, HashMap};

use gpud_api::workload::{CONTAINER, NAMESPACE, POD};

/// Workload names by key ([`gpud_api::workload::KEYS`]).
pub type Names = BTreeMap<String, String>;

/// Where the runtimes put each name in a container's OCI annotations: containerd's CRI, then
/// CRI-O.
const ANNOTATION_KEYS: [(&str, [&str; 2]); 3] = [
    (
        NAMESPACE,
        [
            "io.kubernetes.cri.sandbox-namespace",
            "io.kubernetes.pod.namespace",
        ],
    ),
    (
        POD,
        ["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"],
    ),
    (
        CONTAINER,
        [
            "io.kubernetes.cri.container-name",
            "io.kubernetes.container.name",
        ],
    ),
];

/// The workload a container's OCI annotations name, as containerd's CRI or CRI-O set them;
/// empty when they name no pod (a container outside Kubernetes, e.g. podman's).
pub fn from_annotations(annotations: &HashMap<String, String>) -> Names {
    let names: Names = ANNOTATION_KEYS
        .iter()
        .filter_map(|(name, keys)| {
            keys.iter()
                .filter_map(|k| annotations.get(*k))
                .find(|v| !v.is_empty())
                .map(|v| ((*name).to_owned(), v.clone()))
        })
        .collect();
    if names.contains_key(POD) {
        names
    } else {
        Names::new()
    }
}

/// The names from a container's and its pod's: `namespace`, `pod` and, where given,
/// `container`; empty without a pod name.
pub fn of_container(namespace: &str, pod: &str, container: &str) -> Names {
    if pod.is_empty() {
        return Names::new();
    }
    [(NAMESPACE, namespace), (POD, pod), (CONTAINER, container)]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The names of the pod's own cgroup: a container's without the container's name.
pub fn of_pod(container: &Names) -> Names {
    container
        .iter()
        .filter(|(k, _)| k.as_str() != CONTAINER)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map<'a, T: FromIterator<(String, String)>>(pairs: &[(&'a str, &'a str)]) -> T {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn names_from_containerds_cri_annotations() {
        let ann: HashMap<String, String> = map(&[
            ("io.kubernetes.cri.container-type", "container"),
            ("io.kubernetes.cri.sandbox-namespace", "ml"),
            ("io.kubernetes.cri.sandbox-name", "train-0"),
            ("io.kubernetes.cri.container-name", "main"),
            ("io.kubernetes.cri.sandbox-id", "0123abcd"),
        ]);
        let want: Names = map(&[
            ("namespace", "ml"),
            ("pod", "train-0"),
            ("container", "main"),
        ]);
        assert_eq!(from_annotations(&ann), want);
    }

    #[test]
    fn names_from_cri_os_annotations() {
        let ann: HashMap<String, String> = map(&[
            ("io.kubernetes.pod.namespace", "ml"),
            ("io.kubernetes.pod.name", "train-0"),
            ("io.kubernetes.container.name", "main"),
            ("io.kubernetes.cri-o.ContainerType", "container"),
        ]);
        let want: Names = map(&[
            ("namespace", "ml"),
            ("pod", "train-0"),
            ("container", "main"),
        ]);
        assert_eq!(from_annotations(&ann), want);
    }

    #[test]
    fn no_names_without_a_pod_and_empty_values_left_out() {
        let podman: HashMap<String, String> = map(&[("gpud.dev/memory-max", "1Gi")]);
        assert_eq!(from_annotations(&podman), Names::new());
        let no_pod: HashMap<String, String> = map(&[
            ("io.kubernetes.cri.sandbox-namespace", "ml"),
            ("io.kubernetes.cri.container-name", "main"),
        ]);
        assert_eq!(from_annotations(&no_pod), Names::new());
        // An empty CRI value does not hide CRI-O's.
        let mixed: HashMap<String, String> = map(&[
            ("io.kubernetes.cri.sandbox-name", ""),
            ("io.kubernetes.pod.name", "train-0"),
            ("io.kubernetes.container.name", ""),
        ]);
        assert_eq!(from_annotations(&mixed), map(&[("pod", "train-0")]));
    }

    #[test]
    fn a_pods_names_are_its_containers_without_the_container() {
        let c = of_container("ml", "train-0", "main");
        assert_eq!(
            c,
            map(&[
                ("namespace", "ml"),
                ("pod", "train-0"),
                ("container", "main")
            ])
        );
        assert_eq!(of_pod(&c), map(&[("namespace", "ml"), ("pod", "train-0")]));
        assert_eq!(of_container("ml", "", "main"), Names::new());
        assert_eq!(of_container("", "p", ""), map(&[("pod", "p")]));
    }
}
