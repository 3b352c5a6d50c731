//! tests/gpu/hw-controls.sh's measurement kept from rotting without a GPU: gpud-hwcontrols runs
//! its whole control sequence (through gpud's `Controls`, `pidfd_getfd` copies of the tenants'
//! files) against the fake control device, whose `runlist stop` stops a tenant while its groups
//! are off the runlist or its channels disabled, with `gpud-rm progress` tenants standing in for
//! tests/gpu/hw_tenant.cu; and its summary is read back as docs/real-gpu.md's table is made.
//! The fake runs no GPU work, so timeslices change nothing here: only that they were issued.

use std::process::Command;

use gpud_tests::{Rig, RmProcess, bin_dir};
use serde_json::{Value, json};

/// A process with a client, a subdevice, two channel groups of two channels each, counting.
fn tenant(rig: &Rig, gated: bool) -> (RmProcess, Value) {
    let mut p = RmProcess::spawn(None, &rig.ctl());
    let (client, device) = p.client_device(0);
    let subdevice = p.handle(&format!("subdevice {client} {device}"));
    let mut groups = Vec::new();
    let mut channels = Vec::new();
    for _ in 0..2 {
        let g = p.handle(&format!("channel-group {client} {device}"));
        for _ in 0..2 {
            channels.push(p.handle(&format!("channel {client} {g}")));
        }
        groups.push(g);
    }
    let r = p.ok(if gated { "progress gated" } else { "progress" });
    let spec = json!({
        "pid": r["pid"], "progress": r["progress"], "gate": r["gate"], "client": client,
        "subdevice": subdevice, "groups": groups, "channels": channels,
    });
    (p, spec)
}

#[test]
fn the_hardware_controls_sequence_stops_and_restores_a_tenant_on_the_fake_device() {
    let Some(rig) = Rig::new("hwcontrols").fake_device(1) else {
        return;
    };
    rig.fake().inject("runlist stop").expect("runlist mode");
    let (_t, tspec) = tenant(&rig, false);
    let (_n, nspec) = tenant(&rig, true);
    let out = Command::new(bin_dir().join("gpud-hwcontrols"))
        .arg("--extra-path")
        .arg(rig.ctl())
        .args(["sequence", "--tenant", &tspec.to_string()])
        .args(["--neighbour", &nspec.to_string()])
        .output()
        .expect("run gpud-hwcontrols");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let step = |name: &str| {
        lines
            .iter()
            .find(|l| l["control"] == name)
            .unwrap_or_else(|| panic!("no {name} in {stdout}"))
            .clone()
    };
    for name in ["schedule", "disable-own", "disable-via-neighbour"] {
        let s = step(name);
        assert_eq!(s["errors"], json!([]), "{s}");
        let r = &s["result"];
        assert!(r["before"].as_f64().unwrap_or(0.0) > 0.0, "{s}");
        // The fake stops the tenant as soon as the control is in: the first bins after it.
        assert!(r["stop_ms"].as_f64().is_some_and(|ms| ms <= 200.0), "{s}");
        assert!(r["held_pct"].as_f64().is_some_and(|p| p < 5.0), "{s}");
        assert!(r["back_ms"].as_f64().is_some_and(|ms| ms <= 500.0), "{s}");
        assert!(r["after_pct"].as_f64().is_some_and(|p| p > 30.0), "{s}");
    }
    let split = step("timeslice 128 / 16384");
    assert_eq!(split["errors"], json!([]), "{split}");
    let r = &split["result"];
    assert!(r["tenant_share_before"].as_f64().is_some(), "{split}");
    assert!(r["tenant_share_during"].as_f64().is_some(), "{split}");
    // What it read before it changed them: the fake's default, then put back.
    assert_eq!(split["timeslices_before"]["tenant"], json!([1024, 1024]));
}
