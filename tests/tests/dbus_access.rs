//! Who may call what on `dev.gpud.Daemon1`, and what bad input gets back.
//!
//! Authorization is tested with a real `dbus-daemon` in two layers: a bus with the system bus's
//! default policy that includes the shipped systemd/dev.gpud.Daemon1.conf (the bus refuses
//! mutations to non-members), and a permissive bus (gpud itself refuses them, from the caller's
//! credentials). Callers are real processes: `gpudctl`/`busctl` run by `setpriv` as uid/gid
//! 65534, with or without a temporary admin group, and root.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::Path,
    process::{Command, Output},
    time::Duration,
};

use gpud_tests::{
    BUS_NAME, Bus, Cgroup, Daemon, MANAGER_INTERFACE, MUTATING_METHODS, OBJECT_PATH, Rig,
    TestGroup, eventually, gpudctl_bin, one_gpu, shipped_bus_policy,
};
use zbus::{Structure, Variant};

const NOBODY: u32 = 65534;

/// A daemon on `bus` whose admin group is `admin_group`; with `nvml`, on the fake NVML with one
/// GPU, once that GPU is listed (so that the per-GPU objects exist too).
async fn started(tag: &str, bus: Bus, admin_group: &str, nvml: bool) -> Rig {
    let mut rig = Rig::on_bus(tag, bus);
    if nvml {
        rig = rig.fake_nvml();
        rig.nvml_scenario(&one_gpu("Fake H100", []));
    }
    rig.start(rig.config().set("dbus.admin_group", admin_group))
        .await;
    if nvml {
        wait_for_gpus(&rig).await;
    }
    rig
}

async fn wait_for_gpus(d: &Daemon) {
    let (_c, p) = d.proxy().await;
    let up = eventually(Duration::from_secs(15), || async {
        (!p.list_gpus().await.ok()?.is_empty()).then_some(())
    })
    .await;
    assert!(up.is_some(), "NVML never came up:\n{}", d.log_text());
}

/// Who runs a client process.
#[derive(Clone, Copy, Debug)]
enum Who {
    Root,
    /// uid/gid 65534 with no supplementary group.
    Nobody,
    /// uid/gid 65534 with the given supplementary group.
    Member(u32),
}

fn run_as(who: Who, program: &Path, args: &[&str]) -> Output {
    let mut cmd = match who {
        Who::Root => Command::new(program),
        Who::Nobody | Who::Member(_) => {
            let mut c = Command::new("setpriv");
            c.args([
                "--reuid",
                &NOBODY.to_string(),
                "--regid",
                &NOBODY.to_string(),
            ]);
            match who {
                Who::Member(gid) => c.args(["--groups", &gid.to_string()]),
                _ => c.arg("--clear-groups"),
            };
            c.arg(program);
            c
        }
    };
    cmd.args(args).output().expect("run client")
}

/// `gpudctl --bus-address BUS ARGS` as `who`: (success, stdout and stderr).
fn gpudctl(who: Who, bus: &str, args: &[&str]) -> (bool, String) {
    let (code, text) = gpudctl_code(who, bus, args);
    (code == Some(0), text)
}

/// `gpudctl --bus-address BUS ARGS` as `who`: its exit code and output.
fn gpudctl_code(who: Who, bus: &str, args: &[&str]) -> (Option<i32>, String) {
    let mut all = vec!["--bus-address", bus];
    all.extend_from_slice(args);
    let out = run_as(who, &gpudctl_bin(), &all);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// `busctl --address=BUS ARGS` as `who`.
fn busctl(who: Who, bus: &str, args: &[&str]) -> (bool, String) {
    let addr = format!("--address={bus}");
    let mut all = vec![addr.as_str()];
    all.extend_from_slice(args);
    let out = run_as(who, Path::new("busctl"), &all);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// What a call could have changed: the limits listed and the file they persist in.
async fn snapshot(d: &Daemon, state: &Path) -> (String, Option<Vec<u8>>) {
    let (_c, p) = d.proxy().await;
    let limits = p.list_limits().await.expect("ListLimits");
    (
        format!("{limits:?}"),
        std::fs::read(state.join("limits.json")).ok(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn system_bus_policy_lets_anyone_read_and_only_root_and_admins_change() {
    let group = TestGroup::create("s");
    let bus = Bus::start_system_like(&group.name);
    let rig = started("authz-sys", bus, &group.name, false).await;
    let bus = rig.bus.address.as_str();
    let state = rig.path().join("state");
    let cg = Cgroup::new("authz-sys");
    let before = snapshot(&rig, &state).await;

    // A non-member: the bus refuses both mutations; nothing changes.
    for args in [
        vec!["set", &cg.rel, "--memory-max", "1Gi"],
        vec!["clear", &cg.rel],
    ] {
        let (code, text) = gpudctl_code(Who::Nobody, bus, &args);
        assert_ne!(code, Some(0), "{args:?} allowed to a non-member: {text}");
        // Said as a refusal, with what the caller needs; not as an unreachable daemon.
        assert_eq!(code, Some(4), "{args:?}: {text}");
        for needle in [
            "not allowed",
            "org.freedesktop.DBus.Error.AccessDenied",
            "uid 65534",
            "gpud-admin",
        ] {
            assert!(text.contains(needle), "{args:?}: {needle} not in {text}");
        }
        assert!(!text.contains("cannot reach"), "{args:?}: {text}");
    }
    assert_eq!(snapshot(&rig, &state).await, before);

    // ... nor may it take the name.
    let (ok, text) = busctl(
        Who::Nobody,
        bus,
        &[
            "call",
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus",
            "RequestName",
            "su",
            BUS_NAME,
            "0",
        ],
    );
    assert!(!ok && text.to_lowercase().contains("denied"), "{text}");

    // It may read: methods, properties, introspection.
    for args in [vec!["list"], vec!["ps"], vec!["limits"], vec!["status"]] {
        let (ok, text) = gpudctl(Who::Nobody, bus, &args);
        assert!(ok, "{args:?} refused to a non-member: {text}");
    }
    let (ok, text) = gpudctl(Who::Nobody, bus, &["get", &cg.rel]);
    assert!(ok || text.contains("dev.gpud.Error.NotFound"), "{text}");
    let (ok, text) = busctl(Who::Nobody, bus, &["introspect", BUS_NAME, OBJECT_PATH]);
    assert!(ok && text.contains(".SetLimits"), "{text}");
    let (ok, text) = busctl(
        Who::Nobody,
        bus,
        &[
            "get-property",
            BUS_NAME,
            OBJECT_PATH,
            MANAGER_INTERFACE,
            "Version",
        ],
    );
    assert!(ok, "{text}");
    // Properties.Set is not read access.
    let (ok, text) = busctl(
        Who::Nobody,
        bus,
        &[
            "set-property",
            BUS_NAME,
            OBJECT_PATH,
            MANAGER_INTERFACE,
            "Version",
            "s",
            "x",
        ],
    );
    assert!(!ok && text.to_lowercase().contains("denied"), "{text}");

    // A member of the admin group may change limits.
    let (ok, text) = gpudctl(
        Who::Member(group.gid),
        bus,
        &["set", &cg.rel, "--memory-max", "1Gi"],
    );
    assert!(ok, "member refused: {text}\n{}", rig.log_text());
    let (_c, p) = rig.proxy().await;
    let limits = p.list_limits().await.expect("ListLimits");
    assert_eq!(limits.len(), 1, "{limits:?}");
    assert_eq!(limits[0].limits.get("memory_max"), Some(&(1u64 << 30)));
    let (ok, text) = gpudctl(Who::Member(group.gid), bus, &["clear", &cg.rel]);
    assert!(ok, "member refused: {text}");

    // And root.
    let (ok, text) = gpudctl(Who::Root, bus, &["set", &cg.rel, "--compute-max", "50"]);
    assert!(ok, "root refused: {text}");
    // Anyone may read them back, every kind, the whole cgroup path.
    let (ok, text) = gpudctl(Who::Nobody, bus, &["limits"]);
    assert!(ok && text.contains("compute_max=50%"), "{text}");
    assert!(text.lines().any(|l| l.starts_with(&cg.rel)), "{text}");
    let (ok, text) = gpudctl(Who::Root, bus, &["clear", &cg.rel]);
    assert!(ok, "root refused: {text}");
    assert!(p.list_limits().await.expect("ListLimits").is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn gpud_refuses_mutations_from_non_members_even_when_the_bus_allows_them() {
    let group = TestGroup::create("p");
    let rig = started("authz-daemon", Bus::start(), &group.name, false).await;
    let bus = rig.bus.address.as_str();
    let state = rig.path().join("state");
    let cg = Cgroup::new("authz-daemon");
    let (_c, p) = rig.proxy().await;
    // Root (this process) may set limits.
    rig.set_limit(&cg.rel, "all", "memory_max", "1Gi").await;
    let before = snapshot(&rig, &state).await;
    assert!(before.1.is_some(), "limits.json not written");

    for (args, method) in [
        (vec!["set", &cg.rel, "--memory-max", "2Gi"], "SetLimits"),
        (vec!["clear", &cg.rel], "ClearLimits"),
        // Refused before its arguments are looked at.
        (vec!["set", "/..", "--memory-max", "2Gi"], "SetLimits"),
    ] {
        let (code, text) = gpudctl_code(Who::Nobody, bus, &args);
        assert_eq!(code, Some(4), "{args:?}: {text}");
        for needle in [
            "not allowed",
            "dev.gpud.Error.AccessDenied",
            method,
            "uid 65534",
            &format!("group `{}`", group.name),
        ] {
            assert!(text.contains(needle), "{args:?}: {needle} not in {text}");
        }
        assert_eq!(
            snapshot(&rig, &state).await,
            before,
            "{args:?} changed state"
        );
    }
    let log = rig.log_text();
    assert!(
        // (Colored: `uid=65534` has escape codes around the `=`.)
        log.contains("WARN") && log.contains("65534") && log.contains("refused"),
        "no warning logged:\n{log}"
    );

    // The member's calls pass the daemon's check.
    let (ok, text) = gpudctl(
        Who::Member(group.gid),
        bus,
        &["set", &cg.rel, "--memory-max", "2Gi"],
    );
    assert!(ok, "member refused: {text}\n{}", rig.log_text());
    let limits = p.list_limits().await.expect("ListLimits");
    assert_eq!(limits[0].limits.get("memory_max"), Some(&(2u64 << 30)));
    let (ok, text) = gpudctl(Who::Member(group.gid), bus, &["clear", &cg.rel]);
    assert!(ok, "member refused: {text}");
    assert!(p.list_limits().await.expect("ListLimits").is_empty());
}

/// The rules of one `<policy>` element that allow sending to gpud: (interface, member), `None`
/// matching any.
fn allowed_in(
    doc: &roxmltree::Document<'_>,
    attr: &str,
    value: &str,
) -> Vec<(Option<String>, Option<String>)> {
    doc.descendants()
        .filter(|n| n.has_tag_name("policy") && n.attribute(attr) == Some(value))
        .flat_map(|p| p.children().filter(|c| c.has_tag_name("allow")))
        .filter(|a| a.attribute("send_destination") == Some(BUS_NAME))
        .map(|a| {
            (
                a.attribute("send_interface").map(str::to_owned),
                a.attribute("send_member").map(str::to_owned),
            )
        })
        .collect()
}

fn allows(rules: &[(Option<String>, Option<String>)], interface: &str, member: &str) -> bool {
    rules.iter().any(|(i, m)| {
        i.as_deref().is_none_or(|i| i == interface) && m.as_deref().is_none_or(|m| m == member)
    })
}

/// A method added later must be classified: listed in `MUTATING_METHODS` (and then allowed only
/// to root and the admin group) or allowed to everyone by the shipped policy.
#[tokio::test(flavor = "multi_thread")]
async fn every_method_is_either_mutating_or_open_to_everyone_in_the_policy() {
    let group = TestGroup::create("c");
    let bus = Bus::start_system_like(&group.name);
    let rig = started("authz-classes", bus, &group.name, true).await;
    let bus = rig.bus.address.as_str();

    let policy_text = std::fs::read_to_string(shipped_bus_policy()).expect("policy");
    let policy = gpud_tests::parse_dbus_xml(&policy_text);
    let open = allowed_in(&policy, "context", "default");
    let admins = allowed_in(&policy, "group", "gpud-admin");
    let root = allowed_in(&policy, "user", "root");

    let (conn, _p) = rig.proxy().await;
    let tree = gpud_tests::introspect_tree(&conn, "/").await;
    let mut seen = BTreeSet::new();
    let mut interfaces = BTreeSet::new();
    gpud_tests::for_each_gpud_interface(&tree, |path, iface| {
        let name = iface.attribute("name").unwrap_or_default();
        interfaces.insert(name.to_owned());
        for prop in iface.children().filter(|c| c.has_tag_name("property")) {
            assert_eq!(
                prop.attribute("access"),
                Some("read"),
                "{name}.{:?} on {path} is writable: Properties.Set would change state",
                prop.attribute("name")
            );
        }
        for m in iface.children().filter(|c| c.has_tag_name("method")) {
            let member = m.attribute("name").expect("method name");
            let takes_args = m
                .children()
                .any(|a| a.has_tag_name("arg") && a.attribute("direction") == Some("in"));
            seen.insert(member.to_owned());
            if MUTATING_METHODS.contains(&member) {
                assert!(
                    !allows(&open, name, member),
                    "{name}.{member} changes state but the policy allows it to everyone"
                );
                assert!(
                    allows(&admins, name, member) && allows(&root, name, member),
                    "{name}.{member} changes state but the policy does not allow it to root \
                     and the admin group"
                );
            } else {
                assert!(
                    allows(&open, name, member),
                    "{name}.{member} is neither in MUTATING_METHODS nor allowed to everyone by \
                     systemd/dev.gpud.Daemon1.conf: classify it"
                );
                if !takes_args {
                    // And the bus really lets an unprivileged user call it.
                    let (ok, text) =
                        busctl(Who::Nobody, bus, &["call", BUS_NAME, path, name, member]);
                    assert!(ok, "{name}.{member} refused to a non-member: {text}");
                }
            }
        }
    });
    assert!(
        interfaces.contains(MANAGER_INTERFACE) && interfaces.contains("dev.gpud.Gpu1"),
        "{interfaces:?}"
    );
    for m in MUTATING_METHODS {
        assert!(
            seen.contains(*m),
            "MUTATING_METHODS names {m}, which the daemon lacks"
        );
    }
}

/// The body of a raw call: the fields as given, whatever the method's signature.
fn body(fields: Vec<Variant<'static>>) -> Structure<'static> {
    fields
        .into_iter()
        .fold(Structure::builder(), |b, f| b.append_field(f))
        .build()
        .expect("body")
}

fn s(text: &str) -> Variant<'static> {
    Variant::from(text.to_owned())
}

/// An `a{sv}` of limits.
fn lims(pairs: Vec<(&str, Variant<'static>)>) -> Variant<'static> {
    let m: HashMap<String, Variant<'static>> =
        pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    Variant::from(m)
}

/// The D-Bus error name and message of a failed call.
fn error_name(e: &zbus::Error) -> Option<(String, String)> {
    use zbus::DBusError;
    match e {
        zbus::Error::MethodError(name, msg, _) => {
            Some((name.to_string(), msg.clone().unwrap_or_default()))
        }
        zbus::Error::FDO(e) => Some((
            e.name().to_string(),
            e.description().unwrap_or_default().to_owned(),
        )),
        _ => None,
    }
}

/// A call of `interface.method(args)` that must fail with `want`, its message containing `says`.
fn call(
    what: &'static str,
    interface: &'static str,
    method: &'static str,
    args: Vec<Variant<'static>>,
    want: &'static str,
    says: &'static str,
) -> Case {
    Case {
        what,
        interface,
        method,
        args,
        want,
        says,
    }
}

struct Case {
    what: &'static str,
    interface: &'static str,
    method: &'static str,
    args: Vec<Variant<'static>>,
    /// Error name.
    want: &'static str,
    /// Part of the error message (the reason).
    says: &'static str,
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_dbus_input_gets_a_typed_error_and_changes_nothing() {
    let rig = started("badinput", Bus::start(), "", true).await;
    let bus = rig.bus.address.as_str();
    let state = rig.path().join("state");
    let cg = Cgroup::new("badinput");
    let (conn, p) = rig.proxy().await;
    // Something in force that a bad call could disturb.
    let start = BTreeMap::from([
        ("memory_max", zbus::Variant::from("1Gi")),
        ("compute_max", zbus::Variant::from(50u32)),
    ]);
    p.set_limits(&cg.rel, "all", start)
        .await
        .expect("SetLimits");

    const M: &str = MANAGER_INTERFACE;
    const INVALID: &str = "dev.gpud.Error.InvalidArgument";
    const NOT_FOUND: &str = "dev.gpud.Error.NotFound";
    const BAD_SIG: &str = "org.freedesktop.DBus.Error.InvalidArgs";
    let mib = "x".repeat(1 << 20);
    let cgv = || s(&cg.rel);
    let mem = || lims(vec![("memory_max", s("2Gi"))]);
    let set = |what: &'static str,
               cgroup: Variant<'static>,
               gpu: &str,
               l: Variant<'static>,
               want: &'static str,
               says: &'static str| {
        call(what, M, "SetLimits", vec![cgroup, s(gpu), l], want, says)
    };
    let one = |what: &'static str, l: (&str, Variant<'static>), says: &'static str| {
        set(what, cgv(), "all", lims(vec![l]), INVALID, says)
    };
    #[rustfmt::skip]
    let cases = vec![
        // Wrong signatures.
        call("SetLimits (su)", M, "SetLimits", vec![cgv(), Variant::from(5u32)], BAD_SIG, "Signature mismatch"),
        call("SetLimits with a{ss}", M, "SetLimits", vec![cgv(), s("all"), Variant::from(HashMap::from([("memory_max".to_owned(), "1Gi".to_owned())]))], BAD_SIG, "Signature mismatch"),
        call("SetLimits with an extra argument", M, "SetLimits", vec![cgv(), s("all"), mem(), s("junk")], BAD_SIG, "Signature mismatch"),
        call("ClearLimits (sss)", M, "ClearLimits", vec![cgv(), s("all"), s("memory_max")], BAD_SIG, "Signature mismatch"),
        call("GetCgroup (u)", M, "GetCgroup", vec![Variant::from(1u32)], BAD_SIG, "Signature mismatch"),
        call("unknown method", M, "DropAllLimits", vec![cgv()], "org.freedesktop.DBus.Error.UnknownMethod", "DropAllLimits"),
        call("unknown interface", "dev.gpud.Manager9", "SetLimits", vec![cgv(), s("all"), mem()], "org.freedesktop.DBus.Error.UnknownInterface", "dev.gpud.Manager9"),
        // zbus answers UnknownProperty for a property without a setter.
        call("Properties.Set of a read-only property", "org.freedesktop.DBus.Properties", "Set", vec![s(M), s("Version"), Variant::new(s("9"))], "org.freedesktop.DBus.Error.UnknownProperty", "Version"),
        call("Properties.Get of an unknown property", "org.freedesktop.DBus.Properties", "Get", vec![s(M), s("Secret")], "org.freedesktop.DBus.Error.UnknownProperty", "Secret"),
        // Cgroup paths.
        set("empty cgroup", s(""), "all", mem(), INVALID, "empty"),
        set("cgroup /../..", s("/../.."), "all", mem(), INVALID, "`..`"),
        set("cgroup a/../../etc", s("a/../../etc"), "all", mem(), INVALID, "`..`"),
        set("cgroup ./x", s("./x"), "all", mem(), INVALID, "`.`"),
        set("unknown cgroup", s("/gpud-no-such-cgroup"), "all", mem(), NOT_FOUND, "gpud-no-such-cgroup"),
        set("cgroup with trailing junk", s(&format!("{}/cgroup.procs", cg.rel)), "all", mem(), NOT_FOUND, "cgroup.procs"),
        set("1 MiB cgroup", s(&mib), "all", mem(), INVALID, "bytes long"),
        // GPU selectors.
        set("empty GPU", cgv(), "", mem(), INVALID, "invalid GPU"),
        set("GPU 7x", cgv(), "7x", mem(), INVALID, "invalid GPU"),
        set("unknown GPU index", cgv(), "5", mem(), INVALID, "no GPU with this index"),
        set("GPU- alone", cgv(), "GPU-", mem(), INVALID, "invalid GPU"),
        set("malformed UUID", cgv(), "GPU-zz!", mem(), INVALID, "invalid GPU"),
        set("unknown UUID", cgv(), "GPU-00000000-0000-0000-0000-000000000000", mem(), INVALID, "no GPU with this UUID"),
        set("1 MiB GPU", cgv(), &mib, mem(), INVALID, "bytes long"),
        // Limit names and values.
        set("no limits", cgv(), "all", lims(vec![]), INVALID, "no limits"),
        one("unknown limit", ("memory_maximum", s("1Gi")), "unknown limit"),
        set("unknown limit beside a good one", cgv(), "all", lims(vec![("memory_max", s("2Gi")), ("bogus", Variant::from(1u32))]), INVALID, "unknown limit"),
        one("1 MiB limit name", (mib.as_str(), s("1Gi")), "unknown limit"),
        one("memory_max as a boolean", ("memory_max", Variant::from(true)), "got type b"),
        one("memory_max as a double", ("memory_max", Variant::from(1.5f64)), "got type d"),
        one("memory_max as an array", ("memory_max", Variant::from(vec![1u64])), "got type at"),
        one("overflowing quantity", ("memory_max", s("99999999999999999999Gi")), "too large"),
        one("u64::MAX + 1", ("memory_max", s("18446744073709551616")), "too large"),
        one("u64::MAX bytes", ("memory_max", Variant::from(u64::MAX)), "larger than"),
        one("quantity overflowing on its suffix", ("memory_max", s("17179869184Gi")), "too large"),
        one("negative bytes", ("memory_max", Variant::from(-1i64)), "negative"),
        one("negative quantity", ("memory_max", s("-1Gi")), "not a byte quantity"),
        one("zero bytes", ("memory_max", Variant::from(0u64)), "ClearLimits"),
        one("empty quantity", ("memory_max", s("")), "not a byte quantity"),
        one("unknown suffix", ("memory_max", s("1Xi")), "unknown suffix"),
        one("1 MiB quantity", ("memory_max", s(&mib)), "not a byte quantity"),
        one("compute_max 0", ("compute_max", Variant::from(0u32)), "outside 1..=100"),
        one("compute_max 101", ("compute_max", Variant::from(101u32)), "outside 1..=100"),
        one("compute_max -5", ("compute_max", Variant::from(-5i32)), "outside 1..=100"),
        one("compute_max text", ("compute_max", s("half")), "not a whole number"),
        one("compute_weight 0", ("compute_weight", Variant::from(0u32)), "outside 1..=10000"),
        one("compute_weight 10001", ("compute_weight", Variant::from(10_001u32)), "outside 1..=10000"),
        set("compute_min above compute_max", cgv(), "all", lims(vec![("compute_min", Variant::from(60u32)), ("compute_max", Variant::from(40u32))]), INVALID, "above compute_max"),
        one("compute_min above the stored compute_max", ("compute_min", Variant::from(70u32)), "above compute_max"),
        one("bad priority name", ("priority", s("urgent")), "not a priority"),
        one("priority as a number", ("priority", Variant::from(1u32)), "expected a string"),
        // ClearLimits.
        call("ClearLimits duplicate names", M, "ClearLimits", vec![cgv(), s("all"), Variant::from(vec!["memory_max", "memory_max"])], INVALID, "more than once"),
        call("ClearLimits unknown name", M, "ClearLimits", vec![cgv(), s("all"), Variant::from(vec!["memory_max", "vram"])], INVALID, "unknown limit"),
        call("ClearLimits escaping path", M, "ClearLimits", vec![s("/a/../../etc"), s("all"), Variant::from(Vec::<String>::new())], INVALID, "`..`"),
        call("ClearLimits bad GPU", M, "ClearLimits", vec![cgv(), s("GPU-"), Variant::from(Vec::<String>::new())], INVALID, "invalid GPU"),
        call("ClearLimits 1 MiB name", M, "ClearLimits", vec![cgv(), s("all"), Variant::from(vec![mib.clone()])], INVALID, "bytes long"),
        // GetCgroup.
        call("GetCgroup empty", M, "GetCgroup", vec![s("")], INVALID, "empty"),
        call("GetCgroup /..", M, "GetCgroup", vec![s("/..")], INVALID, "`..`"),
        call("GetCgroup 1 MiB", M, "GetCgroup", vec![s(&mib)], INVALID, "bytes long"),
        call("GetCgroup unknown", M, "GetCgroup", vec![s("/gpud-no-such-cgroup")], NOT_FOUND, "gpud-no-such-cgroup"),
        call("GetCgroup of a file", M, "GetCgroup", vec![s("cgroup.procs")], NOT_FOUND, "cgroup.procs"),
    ];
    assert!(cases.len() >= 30);

    let before = snapshot(&rig, &state).await;
    assert!(before.1.is_some(), "limits.json not written");
    for c in cases {
        let reply = if c.args.is_empty() {
            conn.call_method(
                Some(BUS_NAME),
                OBJECT_PATH,
                Some(c.interface),
                c.method,
                &(),
            )
            .await
        } else {
            conn.call_method(
                Some(BUS_NAME),
                OBJECT_PATH,
                Some(c.interface),
                c.method,
                &body(c.args),
            )
            .await
        };
        match reply.as_ref().err().and_then(error_name) {
            Some((name, msg)) => {
                assert_eq!(name.as_str(), c.want, "{}: {msg}", c.what);
                assert!(
                    msg.contains(c.says),
                    "{}: {:?} lacks {:?}",
                    c.what,
                    &msg[..msg.len().min(300)],
                    c.says
                );
                assert!(
                    msg.len() < 2000,
                    "{}: message of {} bytes",
                    c.what,
                    msg.len()
                );
            }
            None => panic!("{}: expected {}, got {reply:?}", c.what, c.want),
        }
        assert_eq!(
            snapshot(&rig, &state).await,
            before,
            "{} changed state",
            c.what
        );
    }

    // A string with a NUL byte is not valid D-Bus: it never reaches gpud as a call (the bus
    // drops the sender's connection), and gpud goes on answering.
    let (nul_conn, _) = rig.proxy().await;
    let nul = nul_conn
        .call_method(
            Some(BUS_NAME),
            OBJECT_PATH,
            Some(M),
            "GetCgroup",
            &("/a\0b",),
        )
        .await;
    assert!(nul.is_err(), "{nul:?}");
    let (_c2, p2) = rig.proxy().await;
    assert_eq!(p2.get_cgroup("/").await.expect("GetCgroup /").path, "/");
    assert_eq!(snapshot(&rig, &state).await, before);

    // gpudctl maps a daemon error to exit code 1 and an unreachable bus to 3.
    let st = Command::new(gpudctl_bin())
        .args(["--bus-address", bus, "get", "/../x"])
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(1));
    let st = Command::new(gpudctl_bin())
        .args(["--bus-address", "unix:path=/nonexistent/bus", "status"])
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(3));
}

/// A limits dictionary that keeps repeated keys on the wire, as busctl or any client may send it
/// (zbus's own map types cannot).
struct Repeated(Vec<(&'static str, Variant<'static>)>);

impl serde::Serialize for Repeated {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl zbus::Type for Repeated {
    const SIGNATURE: &'static zbus::Signature =
        &zbus::Signature::static_dict(&zbus::Signature::Str, &zbus::Signature::Variant);
}

/// Ambiguous input is refused with a typed error and changes nothing: a limit named twice (the
/// first value would otherwise be dropped unseen, valid or not), a GPU selector that is not
/// exact, and one card named both by index and by UUID on one cgroup. Without NVML a per-GPU
/// selector cannot be checked: refused, naming why; `all` still works.
#[tokio::test(flavor = "multi_thread")]
async fn ambiguous_limits_and_unchecked_gpus_are_refused_and_change_nothing() {
    const INVALID: &str = "dev.gpud.Error.InvalidArgument";
    let rig = started("ambiguous", Bus::start(), "", true).await;
    let state = rig.path().join("state");
    let cg = Cgroup::new("ambiguous");
    let (conn, p) = rig.proxy().await;
    let uuid = gpud_tests::scenario::uuid(0);
    p.set_limits(
        &cg.rel,
        "0",
        BTreeMap::from([("memory_max", Variant::from("1Gi"))]),
    )
    .await
    .expect("SetLimits on GPU 0");
    let before = snapshot(&rig, &state).await;
    #[rustfmt::skip]
    let cases: Vec<(&str, &str, Repeated, &str)> = vec![
        ("compute_max twice, the first invalid", "all",
         Repeated(vec![("compute_max", Variant::from(101u32)), ("compute_max", Variant::from(100u64))]), "more than once"),
        ("memory_max twice, the first an array", "all",
         Repeated(vec![("memory_max", Variant::from(vec![1u8, 2])), ("memory_max", Variant::from(4096i64))]), "more than once"),
        ("memory_max twice, the first empty", "all",
         Repeated(vec![("memory_max", Variant::from("")), ("memory_max", Variant::from("512Mi"))]), "more than once"),
        ("a valid limit twice with the same value", "all",
         Repeated(vec![("compute_max", Variant::from(30u32)), ("compute_max", Variant::from(30u32))]), "more than once"),
        ("a nested dictionary as a value", "all",
         Repeated(vec![("memory_max", Variant::from(HashMap::from([("memory_max".to_owned(), Variant::from(1u64))])))]), "got type a{sv}"),
        ("selector with a leading space", " 0", Repeated(vec![("memory_max", Variant::from("2Gi"))]), "invalid GPU"),
        ("selector with a trailing space", "0 ", Repeated(vec![("memory_max", Variant::from("2Gi"))]), "invalid GPU"),
        ("selector with a sign", "+0", Repeated(vec![("memory_max", Variant::from("2Gi"))]), "invalid GPU"),
        ("UUID with a trailing space", "GPU-0 ", Repeated(vec![("memory_max", Variant::from("2Gi"))]), "invalid GPU"),
        ("GPU 0 again by its UUID", &uuid, Repeated(vec![("memory_max", Variant::from("2Gi"))]), "already has limits for as `0`"),
    ];
    for (what, gpu, limits, says) in cases {
        let reply = conn
            .call_method(
                Some(BUS_NAME),
                OBJECT_PATH,
                Some(MANAGER_INTERFACE),
                "SetLimits",
                &(cg.rel.as_str(), gpu, limits),
            )
            .await;
        let (name, msg) = reply
            .as_ref()
            .err()
            .and_then(error_name)
            .unwrap_or_else(|| panic!("{what}: accepted: {reply:?}"));
        assert_eq!(name, INVALID, "{what}: {msg}");
        assert!(msg.contains(says), "{what}: {msg:?} lacks {says:?}");
        assert_eq!(snapshot(&rig, &state).await, before, "{what} changed state");
    }

    // NVML off by configuration: a UUID can never be resolved, so it is refused; an index is
    // the driver's numbering, which the kernel side keys memory by: in force without NVML.
    let mut off = Rig::new("ambiguous-nonvml");
    off.start(off.config().nvml_off()).await;
    let (_c, p) = off.proxy().await;
    let e = p
        .set_limits(
            &cg.rel,
            &gpud_tests::scenario::uuid(0),
            BTreeMap::from([("memory_max", Variant::from("1Gi"))]),
        )
        .await
        .expect_err("a UUID without NVML");
    let (name, msg) = error_name(&e).expect("a D-Bus error");
    assert_eq!(name, INVALID, "{msg}");
    assert!(msg.contains("NVML is disabled"), "{msg}");
    assert!(p.list_limits().await.expect("ListLimits").is_empty());
    let (state, note) = p
        .set_limits(
            &cg.rel,
            "0",
            BTreeMap::from([("memory_max", Variant::from("1Gi"))]),
        )
        .await
        .expect("GPU 0 by index needs no inventory");
    assert_eq!((state.as_str(), note.as_str()), ("in-force", ""));
    let r = p.get_cgroup(&cg.rel).await.expect("GetCgroup");
    assert_eq!(r.memory_max.get("0"), Some(&(1 << 30)));
    p.set_limits(
        &cg.rel,
        "all",
        BTreeMap::from([("memory_max", Variant::from("1Gi"))]),
    )
    .await
    .expect("`all` needs no inventory");
}

/// A limit set by UUID is kept across a restart although NVML has not answered when the stored
/// limits are restored (it was dropped then), and is in force once NVML resolves the UUID.
#[tokio::test(flavor = "multi_thread")]
async fn a_limit_set_by_uuid_survives_a_restart_and_is_in_force_once_nvml_answers() {
    let mut rig = started("uuid-restart", Bus::start(), "", true).await;
    let cg = Cgroup::new("uuid-restart");
    let uuid = gpud_tests::scenario::uuid(0);
    let (_c, p) = rig.proxy().await;
    p.set_limits(
        &cg.rel,
        &uuid,
        BTreeMap::from([("memory_max", Variant::from("1Gi"))]),
    )
    .await
    .expect("SetLimits by UUID");
    rig.restart().await;
    let (_c, p) = rig.proxy().await;
    let stored = p.list_limits().await.expect("ListLimits");
    assert!(
        stored.iter().any(|l| l.cgroup == cg.rel && l.gpu == uuid),
        "{stored:?}\n{}",
        rig.log_text()
    );
    let in_force = eventually(Duration::from_secs(15), || async {
        let r = p.get_cgroup(&cg.rel).await.ok()?;
        (r.memory_max.get("0") == Some(&(1 << 30))).then_some(())
    })
    .await;
    assert!(in_force.is_some(), "not in force:\n{}", rig.log_text());
}
