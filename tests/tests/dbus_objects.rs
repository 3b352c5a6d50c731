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
    drop(b);
    let gone = eventually(Duration::from_secs(15), || async {
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
