//! The DRA driver and the API server: the ResourceSlice it publishes and keeps in step with
//! gpud's inventory and health, the claims it reads, the RBAC those calls need, and the test API
//! server's own faithfulness.

use serde_json::json;

use gpud_tests::{
    apiserver::TestApiServer,
    eventually,
    kubelet::plugins::PluginWatcher,
    scenario::{Event, uuid},
};

use super::dra::{Container, DRIVER, DraProcess, claim, pb_claim};
use super::{Node, WAIT, scenario};

#[tokio::test(flavor = "multi_thread")]
async fn dra_plugin_publishes_capacity_registers_prepares_and_calls_only_what_its_rbac_grants() {
    let node = Node::start("k8s-dra", &scenario(1, 16, |_, _| ())).await;
    let gpu = uuid(0);
    let claim = claim("uid-1", "train-gpu", "gpu-0");
    let api = TestApiServer::start("dra-token").await;
    api.put(claim);
    let d = node.rig.path();
    let kubeconfig = d.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let plugin = DraProcess::start(&node.rig, &kubeconfig, &[], 0);
    let logs = || plugin.log_text();

    // The ResourceSlice: one device with memory and compute as consumable capacity.
    let slice = eventually(WAIT, || async { api.object("resourceslices", "", SLICE) }).await;
    let slice = slice.unwrap_or_else(|| panic!("no ResourceSlice:\n{}", logs()));
    assert_eq!(slice["spec"]["pool"]["generation"], 1);
    let dev = &slice["spec"]["devices"][0];
    assert_eq!(
        (
            slice["spec"]["driver"].as_str(),
            slice["spec"]["nodeName"].as_str()
        ),
        (Some("gpu.gpud.dev"), Some("node1"))
    );
    assert_eq!(
        dev["capacity"]["memory"]["value"],
        (16u64 << 30).to_string()
    );
    assert_eq!(dev["capacity"]["compute"]["value"], "100");
    assert_eq!(dev["attributes"]["uuid"]["string"], gpu.as_str());

    // The kubelet's plugin watcher registers it (GetInfo, then the status) and its DRA manager
    // prepares a claim: a CDI device whose spec adds the GPU and gpud's hook.
    let kubelet = PluginWatcher::start(&d.join("registry"));
    let r = kubelet
        .wait_registered(DRIVER, WAIT)
        .await
        .unwrap_or_else(|log| panic!("not registered:\n{log}\n{}", plugin.log_text()));
    assert_eq!(
        (r.service, r.endpoint.clone()),
        ("v1.DRAPlugin", d.join("plugins/dra.sock"))
    );
    let resp = kubelet
        .prepare(DRIVER, vec![pb_claim("uid-1", "train-gpu")])
        .await
        .expect("NodePrepareResources");
    let r = &resp.claims["uid-1"];
    assert_eq!(r.error, "", "{}", plugin.log_text());
    assert_eq!(r.devices[0].cdi_device_ids, ["gpud.dev/claim=uid-1-gpu-0"]);
    let spec_path = d.join("cdi/gpud.dev-claim_uid-1.json");
    let ctr = Container::from_spec(&spec_path, "k8s-dra", d);
    assert_eq!(ctr.env[0], format!("NVIDIA_VISIBLE_DEVICES={gpu}"));
    assert_eq!(ctr.hooks.len(), 2, "{:?}", ctr.hooks);

    // An unknown claim is answered with an error for that claim; unprepare removes the spec.
    let resp = kubelet
        .prepare(DRIVER, vec![pb_claim("uid-2", "nope")])
        .await
        .expect("NodePrepareResources");
    assert!(
        resp.claims["uid-2"]
            .error
            .starts_with("claim default/nope not found"),
        "{resp:?}"
    );
    let resp = kubelet
        .unprepare(DRIVER, vec![pb_claim("uid-1", "train-gpu")])
        .await
        .expect("NodeUnprepareResources");
    assert_eq!(resp.claims["uid-1"].error, "");
    assert!(!spec_path.exists());

    // The GPU fails (Xid 79): the slice is republished, a generation on, without it.
    let mut sc = scenario(1, 16, |_, _| ());
    sc.events = vec![Event::xid(0, 79)];
    node.rig.nvml_scenario(&sc);
    let slice = eventually(WAIT, || async {
        api.object("resourceslices", "", SLICE)
            .filter(|s| s["spec"]["pool"]["generation"] == 2)
    })
    .await
    .unwrap_or_else(|| panic!("not republished:\n{}", logs()));
    assert_eq!(device_names(&slice), Vec::<String>::new(), "{slice}");

    // The calls the plugin made are exactly what its RBAC rules grant.
    assert_rbac_is_exact(&api);
}

/// The node's ResourceSlice in these tests.
const SLICE: &str = "node1-gpu.gpud.dev";

/// The (group, resource, verb) of every request `api` saw are granted by `gpud_k8s::dra::RBAC`,
/// and every verb RBAC grants was used.
fn assert_rbac_is_exact(api: &TestApiServer) {
    let granted: std::collections::BTreeSet<(String, String, String)> =
        gpud_k8s::dra::rbac_grants()
            .map(|(g, r, v)| (g.to_owned(), r.to_owned(), v.to_owned()))
            .collect();
    let seen = api.verbs_seen();
    assert!(
        api.requests().iter().all(|r| !r.resource.is_empty()),
        "requests outside the resources: {:?}",
        api.requests()
    );
    assert_eq!(seen, granted, "seen (left) and granted (right) differ");
}

/// The device names of a ResourceSlice.
fn device_names(slice: &serde_json::Value) -> Vec<String> {
    slice["spec"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["name"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn dra_slice_follows_gpu_health_and_inventory_with_a_new_generation_each_time() {
    let node = Node::start("k8s-dra-health", &scenario(2, 16, |_, _| ())).await;
    let api = TestApiServer::start("health-token").await;
    let kubeconfig = node.rig.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let mut plugin = DraProcess::start(&node.rig, &kubeconfig, &[], 0);
    let at = |generation: i64| {
        let api = &api;
        async move {
            eventually(WAIT, || async {
                api.object("resourceslices", "", SLICE)
                    .filter(|s| s["spec"]["pool"]["generation"] == generation)
            })
            .await
        }
    };
    let s = at(1).await;
    let s = s.unwrap_or_else(|| panic!("no slice:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0", "gpu-1"]);

    // Another client writes the slice: the plugin's next replace carries a stale resourceVersion
    // (409 Conflict), so it reads the slice again and replaces that.
    let mut other = s.clone();
    other["metadata"]["labels"] = json!({ "touched-by": "test" });
    api.put(other);

    // GPU 1 leaves gpud's inventory: the next generation lists GPU 0 only.
    node.rig.nvml_scenario(&scenario(1, 16, |_, _| ()));
    let s = at(2).await;
    let s = s.unwrap_or_else(|| panic!("GPU 1 still listed:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0"]);
    let updates: Vec<u16> = api
        .requests()
        .iter()
        .filter(|r| r.verb == "update")
        .map(|r| r.code)
        .collect();
    assert_eq!(updates, [409, 200], "{:?}", api.requests());

    // It comes back.
    node.rig.nvml_scenario(&scenario(2, 16, |_, _| ()));
    let s = at(3).await;
    let s = s.unwrap_or_else(|| panic!("GPU 1 not back:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0", "gpu-1"]);

    // An application's Xid (43) changes nothing; Xid 79 on GPU 0 takes it out of the slice.
    let mut sc = scenario(2, 16, |_, _| ());
    sc.events = vec![Event::xid(1, 43), Event::xid(0, 79)];
    node.rig.nvml_scenario(&sc);
    let s = at(4).await;
    let s = s.unwrap_or_else(|| panic!("GPU 0 still listed:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-1"]);

    // Restarted with device taints (clusters with DRADeviceTaints): the slice goes on from the
    // stored generation and lists GPU 0 again, tainted with why.
    assert_eq!(plugin.stop(), Some(0), "{}", plugin.log_text());
    let plugin = DraProcess::start(
        &node.rig,
        &kubeconfig,
        &["--device-taints", "no-execute"],
        1,
    );
    let s = at(5).await;
    let s = s.unwrap_or_else(|| panic!("not republished:\n{}", plugin.log_text()));
    assert_eq!(device_names(&s), ["gpu-0", "gpu-1"]);
    let taints = &s["spec"]["devices"][0]["taints"];
    assert_eq!(
        (
            taints[0]["key"].as_str(),
            taints[0]["value"].as_str(),
            taints[0]["effect"].as_str()
        ),
        (
            Some("gpu.gpud.dev/unhealthy"),
            Some("Xid79"),
            Some("NoExecute")
        ),
        "{s}"
    );
    assert_eq!(taints.as_array().map(Vec::len), Some(1));
    assert!(s["spec"]["devices"][1]["taints"].is_null(), "{s}");
}

/// The test API server answers as kube-apiserver does for what it serves: checked with plain
/// HTTP, so a lenient server cannot make the DRA tests pass.
#[tokio::test(flavor = "multi_thread")]
async fn the_test_api_server_refuses_what_kube_apiserver_refuses() {
    let api = TestApiServer::start("secret").await;
    let url = api.url.clone();
    let run = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let call = |method: &str, path: &str, body: Option<&serde_json::Value>, token: &str| {
            let u = format!("{url}{path}");
            let auth = format!("Bearer {token}");
            let resp = match (method, body) {
                ("GET", _) => agent.get(&u).header("Authorization", &auth).call(),
                ("PUT", Some(b)) => agent
                    .put(&u)
                    .header("Authorization", &auth)
                    .header("Content-Type", "application/json")
                    .send(b.to_string()),
                (_, b) => agent
                    .post(&u)
                    .header("Authorization", &auth)
                    .header("Content-Type", "application/json")
                    .send(b.map(ToString::to_string).unwrap_or_default()),
            };
            let mut resp = resp.expect("an answer");
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            (resp.status().as_u16(), v)
        };
        let ok = |method: &str, path: &str, body: Option<&serde_json::Value>| {
            call(method, path, body, "secret")
        };
        let status = |(code, v): (u16, serde_json::Value)| {
            assert_eq!(v["kind"], "Status", "{v}");
            (code, v["reason"].as_str().unwrap_or_default().to_owned())
        };
        let coll = "/apis/resource.k8s.io/v1/resourceslices";
        let item = format!("{coll}/s1");
        let slice = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": { "name": "s1" },
            "spec": { "driver": "gpu.gpud.dev", "nodeName": "n1",
                      "pool": { "name": "n1", "generation": 1, "resourceSliceCount": 1 },
                      "devices": [{ "name": "gpu-0", "capacity": { "memory": { "value": "16Gi" } } }] },
        });
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut s = slice.clone();
            f(&mut s);
            s
        };

        assert_eq!(
            status(call("GET", &item, None, "wrong")),
            (401, "Unauthorized".into())
        );
        assert_eq!(status(ok("GET", &item, None)), (404, "NotFound".into()));
        let bad_version = with(&|s| s["apiVersion"] = "resource.k8s.io/v1beta1".into());
        let bad_kind = with(&|s| s["kind"] = "ResourceClaim".into());
        for bad in [&bad_version, &bad_kind] {
            assert_eq!(
                status(ok("POST", coll, Some(bad))),
                (400, "BadRequest".into())
            );
        }
        let unnamed = with(&|s| s["metadata"] = json!({}));
        assert_eq!(
            status(ok("POST", coll, Some(&unnamed))),
            (422, "Invalid".into())
        );
        let bad_device = with(&|s| s["spec"]["devices"][0]["name"] = "GPU_0".into());
        let (code, v) = ok("POST", coll, Some(&bad_device));
        assert_eq!(
            (code, v["details"]["causes"][0]["field"].as_str()),
            (422, Some("spec.devices[0].name"))
        );
        let bad_taint = with(&|s| {
            s["spec"]["devices"][0]["taints"] =
                json!([{ "key": "k", "effect": "PreferNoSchedule" }])
        });
        assert_eq!(
            status(ok("POST", coll, Some(&bad_taint))),
            (422, "Invalid".into())
        );
        let (code, created) = ok("POST", coll, Some(&slice));
        assert_eq!(code, 201, "{created}");
        let rv = created["metadata"]["resourceVersion"].clone();
        assert!(rv.is_string() && created["metadata"]["uid"].is_string());
        assert_eq!(
            status(ok("POST", coll, Some(&slice))),
            (409, "AlreadyExists".into())
        );
        let with_rv = with(&|s| s["metadata"]["resourceVersion"] = rv.clone());
        assert_eq!(status(ok("POST", coll, Some(&with_rv))).0, 500);

        // Updates: conditional on the resourceVersion, the name and immutable fields kept.
        let next = with(&|s| {
            s["metadata"]["resourceVersion"] = rv.clone();
            s["spec"]["pool"]["generation"] = 2.into();
        });
        let (code, updated) = ok("PUT", &item, Some(&next));
        assert_eq!(code, 200, "{updated}");
        assert_ne!(updated["metadata"]["resourceVersion"], rv);
        assert_eq!(updated["metadata"]["generation"], 2);
        assert_eq!(
            status(ok("PUT", &item, Some(&next))),
            (409, "Conflict".into()),
            "a stale resourceVersion"
        );
        let fresh = updated["metadata"]["resourceVersion"].clone();
        let moved = with(&|s| {
            s["metadata"]["resourceVersion"] = fresh.clone();
            s["spec"]["driver"] = "other.dev".into();
        });
        assert_eq!(
            status(ok("PUT", &item, Some(&moved))),
            (422, "Invalid".into())
        );
        assert_eq!(
            status(ok("PUT", &format!("{coll}/s2"), Some(&slice))),
            (400, "BadRequest".into()),
            "the name differs from the URL's"
        );
        let gone = with(&|s| s["metadata"]["name"] = "s3".into());
        assert_eq!(
            status(ok("PUT", &format!("{coll}/s3"), Some(&gone))),
            (404, "NotFound".into())
        );
        assert_eq!(
            status(ok("GET", &format!("{coll}?watch=true"), None)).0,
            405
        );
        assert_eq!(
            status(ok(
                "GET",
                "/apis/resource.k8s.io/v1/namespaces/default/resourceslices",
                None
            )),
            (404, "NotFound".into()),
            "ResourceSlices are cluster-scoped"
        );
    });
    run.await.expect("the checks");
    let verbs: std::collections::BTreeSet<String> =
        api.verbs_seen().into_iter().map(|(_, _, v)| v).collect();
    assert_eq!(
        verbs,
        ["create", "get", "update", "watch"]
            .map(str::to_owned)
            .into()
    );
}
