//! The private `dbus-daemon` a test's daemon serves on ([`Bus`]: permissive, or with the shipped
//! system policy) and the system group that policy names as admin ([`TestGroup`]).

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use crate::TempDir;

/// A private `dbus-daemon` with its own configuration.
pub struct Bus {
    child: Child,
    pub address: String,
    _dir: TempDir,
}

impl Bus {
    /// The bus daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts a bus whose policy lets anyone own names and call anything (the shipped system
    /// policy is tested separately).
    pub fn start() -> Self {
        let dir = TempDir::new("bus");
        let socket = dir.path().join("bus");
        let conf = dir.path().join("bus.conf");
        std::fs::write(
            &conf,
            include_str!("../fixtures/private-bus.conf")
                .replace("@SOCKET@", &socket.display().to_string()),
        )
        .expect("write bus config");
        Self::spawn(dir, &conf)
    }

    /// Starts a bus with the system bus's default policy (deny owning names and calling methods
    /// unless allowed) and the shipped policy systemd/dev.gpud.Daemon1.conf, its admin group
    /// `gpud-admin` renamed to `admin_group`. Its socket is reachable by unprivileged users.
    pub fn start_system_like(admin_group: &str) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new("sysbus");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod bus dir");
        let policy = dir.path().join("dev.gpud.Daemon1.conf");
        let shipped = std::fs::read_to_string(shipped_bus_policy()).expect("read shipped policy");
        assert!(
            shipped.contains(r#"group="gpud-admin""#),
            "policy names no admin group"
        );
        std::fs::write(
            &policy,
            shipped.replace(
                r#"group="gpud-admin""#,
                &format!(r#"group="{admin_group}""#),
            ),
        )
        .expect("write policy");
        let socket = dir.path().join("bus");
        let conf = dir.path().join("bus.conf");
        std::fs::write(
            &conf,
            include_str!("../fixtures/system-bus.conf")
                .replace("@SOCKET@", &socket.display().to_string())
                .replace("@POLICY@", &policy.display().to_string()),
        )
        .expect("write bus config");
        Self::spawn(dir, &conf)
    }

    fn spawn(dir: TempDir, conf: &Path) -> Self {
        let mut child = Command::new("dbus-daemon")
            .arg("--config-file")
            .arg(conf)
            .args(["--nofork", "--print-address"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start dbus-daemon (is the `dbus` package installed?)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read bus address");
        Self {
            child,
            address: line.trim().to_owned(),
            _dir: dir,
        }
    }
}

/// The shipped system bus policy, systemd/dev.gpud.Daemon1.conf.
pub fn shipped_bus_policy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/dev.gpud.Daemon1.conf")
}

/// A system group that exists for the life of the value (`groupadd --system`, `groupdel` on
/// drop, also when a test fails), named uniquely per test process.
pub struct TestGroup {
    pub name: String,
    pub gid: u32,
}

impl TestGroup {
    pub fn create(tag: &str) -> Self {
        let name = format!("gpudt{}{tag}", std::process::id());
        assert!(name.len() <= 32, "group name {name} too long");
        let st = Command::new("groupadd")
            .args(["--system", &name])
            .status()
            .expect("run groupadd");
        assert!(st.success(), "groupadd {name}: {st}");
        let gid = nix::unistd::Group::from_name(&name)
            .ok()
            .flatten()
            .map(|g| g.gid.as_raw());
        // Built before the check, so that a failed check still removes the group.
        let group = Self {
            name,
            gid: gid.unwrap_or(u32::MAX),
        };
        assert!(
            gid.is_some(),
            "group {} not found after groupadd",
            group.name
        );
        group
    }
}

impl Drop for TestGroup {
    fn drop(&mut self) {
        let _ = Command::new("groupdel").arg(&self.name).status();
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// D-Bus XML (introspection data, bus policies: both come with a DOCTYPE), parsed.
pub fn parse_dbus_xml(text: &str) -> roxmltree::Document<'_> {
    let opts = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    roxmltree::Document::parse_with_options(text, opts).expect("D-Bus XML")
}

/// Every object path the daemon serves under `path` (depth first), each with its introspection
/// XML.
pub async fn introspect_tree(conn: &zbus::Connection, path: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut todo = vec![path.to_owned()];
    while let Some(path) = todo.pop() {
        let proxy = zbus::fdo::IntrospectableProxy::builder(conn)
            .destination(crate::BUS_NAME)
            .path(path.clone())
            .build()
            .await
            .expect("Introspectable proxy");
        let xml = proxy.introspect().await.expect("Introspect");
        let children: Vec<String> = parse_dbus_xml(&xml)
            .root_element()
            .children()
            .filter(|n| n.has_tag_name("node"))
            .filter_map(|n| n.attribute("name").map(str::to_owned))
            .collect();
        for c in children.into_iter().rev() {
            todo.push(if path == "/" {
                format!("/{c}")
            } else {
                format!("{path}/{c}")
            });
        }
        out.push((path, xml));
    }
    out
}

/// Calls `f` with each object's path and each of its own `dev.gpud.*` interfaces (children
/// inlined as nested nodes are theirs, not its), from [`introspect_tree`]'s output.
pub fn for_each_gpud_interface(
    tree: &[(String, String)],
    mut f: impl FnMut(&str, roxmltree::Node<'_, '_>),
) {
    for (path, xml) in tree {
        let doc = parse_dbus_xml(xml);
        for iface in doc.root_element().children().filter(|n| {
            n.has_tag_name("interface")
                && n.attribute("name")
                    .is_some_and(|a| a.starts_with("dev.gpud."))
        }) {
            f(path, iface);
        }
    }
}
