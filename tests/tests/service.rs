//! gpud as a systemd service, without systemd: the real binary reports readiness, watchdog
//! keep-alives and reloads to a `NOTIFY_SOCKET` listener (a unix datagram socket, as systemd's
//! is), on a real dbus-daemon; SIGHUP reloads its configuration.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use gpud_tests::{BUS_NAME, Cgroup, Issuer, Manager1Proxy, Rig, connect_builder, eventually};
use tokio::net::UnixDatagram;

/// What the listener saw: each datagram, and for the first `READY=1` whether the bus name had
/// an owner and a D-Bus call answered when it arrived.
#[derive(Default)]
struct Seen {
    messages: Vec<(Instant, String)>,
    ready_check: Option<(bool, bool)>,
}

/// Listens on `dir/notify` like systemd's notification socket.
fn listen(dir: &Path, bus: String) -> (PathBuf, Arc<Mutex<Seen>>) {
    let path = dir.join("notify");
    let sock = UnixDatagram::bind(&path).expect("bind the notification socket");
    let seen = Arc::new(Mutex::new(Seen::default()));
    let out = seen.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = sock.recv(&mut buf).await {
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            let first_ready = text.lines().any(|l| l == "READY=1")
                && seen.lock().expect("lock").ready_check.is_none();
            seen.lock()
                .expect("lock")
                .messages
                .push((Instant::now(), text));
            if first_ready {
                let check = check_bus(&bus).await;
                seen.lock().expect("lock").ready_check = Some(check);
            }
        }
    });
    (path, out)
}

/// (the name has an owner, `Version` answers), asked right now.
async fn check_bus(bus: &str) -> (bool, bool) {
    let Ok(conn) = connect_builder(bus).build().await else {
        return (false, false);
    };
    let owned = match zbus::fdo::DBusProxy::new(&conn).await {
        Ok(p) => p
            .name_has_owner(BUS_NAME.try_into().expect("bus name"))
            .await
            .unwrap_or(false),
        Err(_) => false,
    };
    let answers = match Manager1Proxy::new(&conn).await {
        Ok(p) => p.version().await.is_ok(),
        Err(_) => false,
    };
    (owned, answers)
}

fn messages(seen: &Arc<Mutex<Seen>>) -> Vec<String> {
    seen.lock()
        .expect("lock")
        .messages
        .iter()
        .map(|(_, m)| m.clone())
        .collect()
}

/// Waits until a datagram after the first `skip` holds `line`; returns its index.
async fn wait_for(seen: &Arc<Mutex<Seen>>, skip: usize, line: &str) -> Option<usize> {
    eventually(Duration::from_secs(10), || async {
        messages(seen)
            .iter()
            .enumerate()
            .skip(skip)
            .find(|(_, m)| m.lines().any(|l| l == line))
            .map(|(i, _)| i)
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn ready_after_the_name_is_owned_watchdog_and_reload() {
    let mut rig = Rig::new("service");
    let ctl = rig.stand_in("nvidiactl-standin");
    let (sock, seen) = listen(rig.path(), rig.bus.address.clone());
    let config = rig.config().extra_paths([&ctl]).log("info").nvml_off();
    let sock = sock.display().to_string();
    let started = Instant::now();
    rig.start_with_env(
        config.clone(),
        &[
            ("NOTIFY_SOCKET", Some(&sock)),
            // 0.4 s: keep-alives every 0.2 s.
            ("WATCHDOG_USEC", Some("400000")),
            ("WATCHDOG_PID", None),
            ("RUST_LOG", None),
        ],
    )
    .await;

    // Readiness: READY=1 with a STATUS=, once the name is owned and calls are answered.
    let ready = wait_for(&seen, 0, "READY=1")
        .await
        .unwrap_or_else(|| panic!("no READY=1: {:?}\n{}", messages(&seen), rig.log_text()));
    let ready_msg = &messages(&seen)[ready];
    assert!(
        ready_msg.lines().any(|l| l.starts_with("STATUS=serving")),
        "{ready_msg:?}"
    );
    let check = eventually(Duration::from_secs(10), || async {
        seen.lock().expect("lock").ready_check
    })
    .await;
    assert_eq!(
        check,
        Some((true, true)),
        "at READY=1 the name must be owned and answering"
    );

    // Watchdog: WATCHDOG=1 repeatedly, about every 0.2 s.
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let times: Vec<Instant> = seen
        .lock()
        .expect("lock")
        .messages
        .iter()
        .filter(|(t, m)| *t >= t0 && m.lines().any(|l| l == "WATCHDOG=1"))
        .map(|(t, _)| *t)
        .collect();
    assert!(
        times.len() >= 4,
        "{} keep-alives in 1.5 s (want one every 0.2 s)",
        times.len()
    );
    let longest = times.windows(2).map(|w| w[1] - w[0]).max().expect("gaps");
    assert!(
        longest < Duration::from_millis(400),
        "a keep-alive gap of {longest:?} is past the 0.4 s timeout"
    );

    // A process issuing ioctls: at "info" its attribution is not logged (a debug line).
    let cg = Cgroup::new("service");
    let issue = |cg: &Cgroup| Issuer::in_cgroup(cg, &ctl, &["--ioctl", "0xc030462b:1"]);
    let before = issue(&cg);
    let (_c, proxy) = rig.proxy().await;
    eventually(Duration::from_secs(5), || async {
        let r = proxy.get_cgroup(&cg.rel).await.ok()?;
        (r.ioctls.values().sum::<u64>() >= 1).then_some(())
    })
    .await
    .expect("the first process is counted");
    assert!(
        !rig.log_text().contains("process attributed"),
        "debug lines at info:\n{}",
        rig.log_text()
    );
    before.finish();

    // A valid change: RELOADING=1 (with MONOTONIC_USEC=), then READY=1, and the new filter.
    let n = messages(&seen).len();
    let cfg = config
        .log("gpud=debug")
        .set("attribution.sweep_interval_secs", 2)
        .keep_pinned(true)
        .write();
    assert_eq!(cfg, rig.config_path(), "rewritten in place");
    rig.signal(libc::SIGHUP);
    let reloading = wait_for(&seen, n, "RELOADING=1")
        .await
        .expect("RELOADING=1");
    assert!(
        messages(&seen)[reloading]
            .lines()
            .any(|l| l.starts_with("MONOTONIC_USEC=")),
        "{:?}",
        messages(&seen)[reloading]
    );
    let ready_again = wait_for(&seen, reloading + 1, "READY=1")
        .await
        .expect("READY=1 after the reload");
    assert!(ready_again > reloading);
    let after = issue(&cg);
    let log = eventually(Duration::from_secs(5), || async {
        let log = rig.log_text();
        log.contains(&format!("pid={}", after.pid))
            .then_some(log)
            .filter(|l| l.contains("process attributed"))
    })
    .await
    .unwrap_or_else(|| panic!("no debug line after the reload:\n{}", rig.log_text()));
    // The change that needs a restart is named, the live ones applied (the log filter by the
    // binary, the sweep interval by the state task).
    assert!(
        log.contains("probes.keep_pinned") && log.contains("takes effect on restart"),
        "{log}"
    );
    assert!(log.contains("log filter applied"), "{log}");
    assert!(
        log.lines().any(|l| l.contains("live settings applied")
            && l.contains("attribution.sweep_interval_secs")),
        "{log}"
    );
    after.finish();

    // An invalid change: the error names file and line, nothing changes, it keeps serving.
    // (Written by hand: the line the error names is part of what is checked.)
    let n = messages(&seen).len();
    std::fs::write(
        &cfg,
        "[daemon]\nlog = \"info\"\n\n[nvml]\nsample_interval_ms = 1\n",
    )
    .expect("rewrite config");
    rig.signal(libc::SIGHUP);
    let reloading = wait_for(&seen, n, "RELOADING=1")
        .await
        .expect("RELOADING=1");
    wait_for(&seen, reloading + 1, "READY=1")
        .await
        .expect("READY=1 after a refused reload");
    let want = format!("{}:5:", cfg.display());
    let log = eventually(Duration::from_secs(5), || async {
        let log = rig.log_text();
        log.contains(&want).then_some(log)
    })
    .await
    .unwrap_or_else(|| panic!("no error naming {want}:\n{}", rig.log_text()));
    assert!(
        log.contains("`nvml.sample_interval_ms` must be between 10 and 60000")
            && log.contains("not reloaded"),
        "{log}"
    );
    assert!(proxy.version().await.is_ok(), "still serving");
    // The debug filter stayed in force.
    let third = issue(&cg);
    eventually(Duration::from_secs(5), || async {
        rig.log_text()
            .contains(&format!("pid={}", third.pid))
            .then_some(())
    })
    .await
    .expect("the previous (debug) filter is still in force");
    third.finish();
    assert!(started.elapsed() < Duration::from_secs(60));
}
