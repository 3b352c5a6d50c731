//! Logs into the journal: when stderr is the stream `JOURNAL_STREAM` names, the real gpud sends
//! its events over journald's native protocol with their fields as journal fields (`CGROUP=`,
//! `PID=`, ...). No journald runs here: the daemon runs in a mount namespace of its own where
//! `/run/systemd/journal` is a directory holding the test's datagram socket, so it talks to the
//! test exactly as it would to journald.

use std::{
    collections::BTreeMap,
    ffi::CString,
    os::unix::{fs::MetadataExt as _, net::UnixDatagram, process::CommandExt as _},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use gpud_tests::{Cgroup, Issuer, Rig, gpud_bin};

/// Fields of one datagram of journald's native protocol: `NAME=value\n`, or `NAME\n`, a
/// little-endian u64 length, the value's bytes and `\n` (what tracing-journald mostly sends).
fn fields(mut d: &[u8]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    while !d.is_empty() {
        let Some(end) = d.iter().position(|&b| b == b'\n' || b == b'=') else {
            break;
        };
        let name = String::from_utf8_lossy(&d[..end]).into_owned();
        let value;
        if d[end] == b'=' {
            let rest = &d[end + 1..];
            let len = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            value = &rest[..len];
            d = rest.get(len + 1..).unwrap_or(&[]);
        } else {
            let rest = &d[end + 1..];
            let Some(len) = rest
                .get(..8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            else {
                break;
            };
            let Some(v) = rest.get(8..8 + len) else { break };
            value = v;
            d = rest.get(8 + len + 1..).unwrap_or(&[]);
        }
        out.insert(name, String::from_utf8_lossy(value).into_owned());
    }
    out
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("path without NUL")
}

#[test]
fn events_reach_the_journal_with_their_fields() {
    // The rig's directory, bus and config; the daemon is started by hand below, in its own mount
    // namespace.
    let rig = Rig::new("journal");
    let journal_dir = rig.path().join("journal");
    std::fs::create_dir_all(&journal_dir).expect("journal dir");
    let sock = UnixDatagram::bind(journal_dir.join("socket")).expect("bind");
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let ctl = rig.stand_in("nvidiactl-standin");
    let cfg = rig.config().extra_paths([&ctl]).write();
    // The daemon's stderr, named by JOURNAL_STREAM as systemd does for its stream socket.
    let stderr_path = rig.path().join("stderr");
    let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
    let meta = stderr.metadata().expect("stat");
    let stream = format!("{}:{}", meta.dev(), meta.ino());

    let (run, systemd_run, journal_mnt) = (
        cstr(Path::new("/run")),
        cstr(Path::new("/run/systemd")),
        cstr(Path::new("/run/systemd/journal")),
    );
    let (tmpfs, journal_src, none) = (
        CString::new("tmpfs").expect("c"),
        cstr(&journal_dir),
        CString::new("").expect("c"),
    );
    let mut cmd = Command::new(gpud_bin());
    cmd.arg("--config")
        .arg(&cfg)
        .arg("--bus-address")
        .arg(&rig.bus.address)
        .env("JOURNAL_STREAM", &stream)
        .env_remove("RUST_LOG")
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::null())
        .stderr(stderr);
    // SAFETY: between fork and exec only async-signal-safe system calls on memory prepared
    // before the fork: a private mount namespace with a tmpfs /run whose
    // /run/systemd/journal is the test's socket directory (bind mount).
    unsafe {
        cmd.pre_exec(move || {
            let check = |rc: libc::c_int| {
                if rc == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            };
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                none.as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                tmpfs.as_ptr(),
                run.as_ptr(),
                tmpfs.as_ptr(),
                0,
                std::ptr::null(),
            ))?;
            check(libc::mkdir(systemd_run.as_ptr(), 0o755))?;
            check(libc::mkdir(journal_mnt.as_ptr(), 0o755))?;
            check(libc::mount(
                journal_src.as_ptr(),
                journal_mnt.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ))?;
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start gpud");
    let mut seen: Vec<BTreeMap<String, String>> = Vec::new();
    let mut buf = vec![0u8; 65536];
    let mut receive_until =
        |seen: &mut Vec<BTreeMap<String, String>>,
         what: &dyn Fn(&BTreeMap<String, String>) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if seen.iter().any(what) {
                    return true;
                }
                if let Ok(n) = sock.recv(&mut buf) {
                    seen.push(fields(&buf[..n]));
                }
            }
            false
        };
    let ready = receive_until(&mut seen, &|f| {
        f.get("MESSAGE").is_some_and(|m| m.starts_with("ready:"))
    });
    let text = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(
        ready,
        "no ready event in the journal: {seen:?}\nstderr: {text}"
    );
    assert!(
        text.trim().is_empty(),
        "with the journal, nothing on stderr: {text}"
    );
    let ready = seen
        .iter()
        .find(|f| f.get("MESSAGE").is_some_and(|m| m.starts_with("ready:")))
        .expect("ready");
    assert_eq!(
        ready.get("PRIORITY").map(String::as_str),
        Some("6"),
        "{ready:?}"
    );
    assert_eq!(
        ready.get("MODE").map(String::as_str),
        Some("tracepoint"),
        "{ready:?}"
    );
    assert_eq!(
        ready.get("TIER").map(String::as_str),
        Some("react"),
        "{ready:?}"
    );

    // An attributed process: PID= and CGROUP= as fields.
    let cg = Cgroup::new("journal");
    let issuer = Issuer::in_cgroup(&cg, &ctl, &["--ioctl", "0xc030462b:1"]);
    let pid = issuer.pid.to_string();
    let attributed = receive_until(&mut seen, &|f| {
        f.get("MESSAGE").map(String::as_str) == Some("process attributed")
            && f.get("PID") == Some(&pid)
    });
    assert!(attributed, "no attribution event: {seen:?}");
    let event = seen
        .iter()
        .find(|f| f.get("PID") == Some(&pid))
        .expect("event");
    assert_eq!(event.get("CGROUP"), Some(&cg.rel), "{event:?}");
    assert_eq!(
        event.get("PRIORITY").map(String::as_str),
        Some("7"),
        "{event:?}"
    );
    issuer.finish();

    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(0));
}
