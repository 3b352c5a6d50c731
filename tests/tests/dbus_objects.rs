//! The per-cgroup D-Bus objects (`dev.gpud.Cgroup1`) as `busctl` users meet them, against the
//! real daemon on a real `dbus-daemon`: the examples of docs/dbus-api.md ("Cgroup objects"), run
//! as written there (`tree`, `get-property`, `monitor`, `call` on the object), with tenants on
//! the fake NVIDIA control device.

use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use gpud_api::{Cgroup1Proxy, cgroup_object_path};
use gpud_tests::{BUS_NAME, Cgroup, Rig, RmProcess, eventually};

const MIB: u64 = 1 << 20;

/// `busctl --address ADDRESS ARGS…`: success and what it printed.
fn busctl(address: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new("busctl")
        .arg(format!("--address={address}"))
        .args(args)
        .output()
        .expect("run busctl");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Waits (at most 10 s) until `busctl tree` lists `object`; the last listing.
fn tree_with(address: &str, object: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (ok, text) = busctl(address, &["tree", "--list", BUS_NAME]);
        if ok && text.lines().any(|l| l.trim() == object) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{object} not in the tree:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn each_attributed_cgroup_is_an_object_with_named_properties_that_signal_changes() {
    let Some(mut rig) = Rig::new("dbus-objects").fake_device(1) else {
        return;
    };
    rig.start(rig.config().react_action("notify")).await;
    let address = rig.bus.address.clone();
    let (a, b) = (Cgroup::new("dbus-obj-a"), Cgroup::new("dbus-obj-b"));
    let mut ta = RmProcess::spawn(Some(&a.dir), &rig.ctl());
    let (ca, da) = ta.client_device(0);
    ta.ok(&format!("alloc {ca} {da} {}", 4 * MIB));
    let mut tb = RmProcess::spawn(Some(&b.dir), &rig.ctl());
    tb.client_device(0);

    // `busctl tree`: an object per attributed cgroup, under the manager's.
    let (oa, ob) = (cgroup_object_path(&a.rel), cgroup_object_path(&b.rel));
    let text = tree_with(&address, &oa);
    assert!(text.lines().any(|l| l.trim() == ob), "{text}");
    assert!(
        oa.starts_with("/dev/gpud/Daemon1/cgroup/_2f") && oa.ends_with("_2ddbus_2dobj_2da"),
        "{oa}"
    );

    // `busctl get-property`: named and typed.
    let charged = eventually(Duration::from_secs(10), || async {
        let (ok, text) = busctl(
            &address,
            &[
                "get-property",
                BUS_NAME,
                &oa,
                "dev.gpud.Cgroup1",
                "MemoryCurrent",
            ],
        );
        (ok && text.contains(&format!("\"all\" {}", 4 * MIB))).then_some(text)
    })
    .await
    .expect("MemoryCurrent shows the 4 MiB");
    assert!(charged.starts_with("a{st} "), "{charged}");
    let (ok, text) = busctl(
        &address,
        &["get-property", BUS_NAME, &oa, "dev.gpud.Cgroup1", "Path"],
    );
    assert!(ok && text.trim() == format!("s \"{}\"", a.rel), "{text}");

    // `busctl monitor`: PropertiesChanged when the tenant allocates.
    let mut monitor = Command::new("busctl")
        .arg(format!("--address={address}"))
        .args(["monitor", "--json=short", BUS_NAME])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("busctl monitor");
    let (tx, rx) = mpsc::channel();
    let out = monitor.stdout.take().expect("monitor stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // The monitor is attached once it reports its own first message (or after a moment).
    std::thread::sleep(Duration::from_millis(500));
    ta.ok(&format!("alloc {ca} {da} {}", 2 * MIB));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    let signalled = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                let hit = line.contains("PropertiesChanged")
                    && line.contains(&oa)
                    && line.contains("MemoryCurrent");
                seen.push(line);
                if hit {
                    break true;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break false,
        }
        if Instant::now() > deadline {
            break false;
        }
    };
    let _ = monitor.kill();
    let _ = monitor.wait();
    assert!(
        signalled,
        "no PropertiesChanged of MemoryCurrent on {oa}:\n{}",
        seen.join("\n")
    );

    // The object's own SetLimits, and its Limits and MemoryMax.
    let (ok, text) = busctl(
        &address,
        &[
            "call",
            BUS_NAME,
            &oa,
            "dev.gpud.Cgroup1",
            "SetLimits",
            "sa{sv}",
            "all",
            "1",
            "memory_max",
            "t",
            &(64 * MIB).to_string(),
        ],
    );
    assert!(ok && text.contains("in-force"), "{text}");
    let (_c, manager) = rig.proxy().await;
    let proxy = Cgroup1Proxy::builder(manager.inner().connection())
        .path(oa.as_str())
        .build()
        .await
        .expect("Cgroup1 proxy");
    let max = eventually(Duration::from_secs(5), || async {
        let m = proxy.memory_max().await.ok()?;
        (m.get("all") == Some(&(64 * MIB))).then_some(m)
    })
    .await;
    assert!(max.is_some(), "MemoryMax never showed the limit");
    let limits = proxy.limits().await.expect("Limits");
    assert_eq!(
        limits.get("all").and_then(|l| l.get("memory_max")),
        Some(&(64 * MIB)),
        "{limits:?}"
    );
    assert_eq!(proxy.id().await.expect("Id"), a.id());
    assert_eq!(proxy.processes().await.expect("Processes"), vec![ta.pid]);

    // A cgroup that is no longer attributed loses its object.
    drop(tb);
    let _ = manager.clear_limits(&a.rel, "all", &[]).await;
    let b_dir = b.dir.clone();
    drop(b);
    assert!(
        !b_dir.exists(),
        "the test could not remove {}",
        b_dir.display()
    );
    let gone = eventually(Duration::from_secs(30), || async {
        let (ok, text) = busctl(&address, &["tree", "--list", BUS_NAME]);
        (ok && !text.lines().any(|l| l.trim() == ob)).then_some(())
    })
    .await;
    let listed: Vec<String> = manager
        .list_cgroups()
        .await
        .expect("ListCgroups")
        .into_iter()
        .map(|c| c.path)
        .collect();
    assert!(
        gone.is_some(),
        "{ob} is still published; attributed: {listed:?}\n{}",
        rig.log_text()
    );
}

/// What a D-Bus member is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Method,
    Property,
    Signal,
}

/// `(interface, kind, member)` of every `dev.gpud.*` member the running daemon serves.
type Members = std::collections::BTreeSet<(String, Kind, String)>;

fn daemon_members(tree: &[(String, String)]) -> Members {
    let mut out = Members::new();
    gpud_tests::for_each_gpud_interface(tree, |_, iface| {
        let name = iface.attribute("name").unwrap_or_default();
        for m in iface.children().filter(|c| c.is_element()) {
            let kind = match m.tag_name().name() {
                "method" => Kind::Method,
                "property" => Kind::Property,
                "signal" => Kind::Signal,
                _ => continue,
            };
            let member = m.attribute("name").expect("member name").to_owned();
            out.insert((name.to_owned(), kind, member));
        }
    });
    out
}

/// `snake_case` as zbus names it on the bus: `PascalCase`.
fn pascal(snake: &str) -> String {
    snake
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect()
}

/// The members gpud-api's `#[zbus::proxy]` traits declare (gpud-api/src/proxy.rs, read as Rust).
fn proxy_members() -> Members {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../gpud-api/src/proxy.rs");
    let src = std::fs::read_to_string(&path).expect("read proxy.rs");
    let file = syn::parse_file(&src).expect("proxy.rs parses");
    let mut out = Members::new();
    for item in file.items {
        let syn::Item::Trait(t) = item else { continue };
        let mut interface = None;
        for attr in t
            .attrs
            .iter()
            .filter(|a| a.path().segments.last().is_some_and(|s| s.ident == "proxy"))
        {
            attr.parse_nested_meta(|m| {
                let value: syn::Expr = m.value()?.parse()?;
                if m.path.is_ident("interface")
                    && let syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Str(s),
                        ..
                    }) = value
                {
                    interface = Some(s.value());
                }
                Ok(())
            })
            .expect("proxy attribute");
        }
        let Some(interface) = interface else { continue };
        for f in t.items {
            let syn::TraitItem::Fn(f) = f else { continue };
            let (mut kind, mut name) = (Kind::Method, None);
            for attr in f.attrs.iter().filter(|a| a.path().is_ident("zbus")) {
                attr.parse_nested_meta(|m| {
                    if m.path.is_ident("property") {
                        kind = Kind::Property;
                        if m.input.peek(syn::token::Paren) {
                            m.parse_nested_meta(|inner| {
                                let _: syn::Expr = inner.value()?.parse()?;
                                Ok(())
                            })?;
                        }
                    } else if m.path.is_ident("signal") {
                        kind = Kind::Signal;
                    } else if m.path.is_ident("name") {
                        let s: syn::LitStr = m.value()?.parse()?;
                        name = Some(s.value());
                    } else if m.input.peek(syn::Token![=]) {
                        let _: syn::Expr = m.value()?.parse()?;
                    }
                    Ok(())
                })
                .expect("zbus attribute");
            }
            let name = name.unwrap_or_else(|| pascal(&f.sig.ident.to_string()));
            out.insert((interface.clone(), kind, name));
        }
    }
    out
}

/// One definition of the interface: every member the running daemon serves on a `dev.gpud.*`
/// interface (the manager, a GPU, a cgroup) is declared by gpud-api's proxies, and nothing else
/// is; its signals are exactly those gpudctl decodes (`gpud_api::SIGNALS`); and each is
/// documented in docs/dbus-api.md. A member added to the daemon alone fails here.
#[tokio::test(flavor = "multi_thread")]
async fn the_daemons_interfaces_match_the_proxies_gpudctl_and_the_docs() {
    let Some(rig) = Rig::new("dbus-drift").fake_device(1) else {
        return;
    };
    let mut rig = rig.fake_nvml();
    rig.nvml_scenario(&gpud_tests::one_gpu("Fake H100", []));
    rig.start(rig.config().react_action("notify")).await;
    let cg = Cgroup::new("dbus-drift");
    let mut t = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
    t.client_device(0);
    let address = rig.bus.address.clone();
    tree_with(&address, &cgroup_object_path(&cg.rel));
    tree_with(&address, &gpud_api::gpu_path(0, u32::MAX));

    let (_c, manager) = rig.proxy().await;
    let tree = gpud_tests::introspect_tree(manager.inner().connection(), "/").await;
    let served = daemon_members(&tree);
    let declared = proxy_members();
    let interfaces: std::collections::BTreeSet<&str> =
        served.iter().map(|(i, _, _)| i.as_str()).collect();
    assert_eq!(
        interfaces,
        ["dev.gpud.Cgroup1", "dev.gpud.Gpu1", "dev.gpud.Manager1"].into(),
        "the daemon's interfaces"
    );
    let missing: Vec<_> = served.difference(&declared).collect();
    let extra: Vec<_> = declared.difference(&served).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "served but not in gpud-api's proxies: {missing:?}\ndeclared but not served: {extra:?}"
    );
    let signals: std::collections::BTreeSet<&str> = served
        .iter()
        .filter(|(_, k, _)| *k == Kind::Signal)
        .map(|(_, _, n)| n.as_str())
        .collect();
    assert_eq!(
        signals,
        gpud_api::SIGNALS.into_iter().collect(),
        "the daemon's signals and those gpudctl decodes (gpud_api::SIGNALS)"
    );
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/dbus-api.md"),
    )
    .expect("docs/dbus-api.md");
    let undocumented: Vec<_> = served
        .iter()
        .filter(|(_, _, n)| !docs.contains(&format!("`{n}`")) && !docs.contains(&format!("`{n}(")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "not in docs/dbus-api.md: {undocumented:?}"
    );
}
