//! Bad configuration files, through the real `gpud` binary: `gpud --check-config` and the daemon
//! itself refuse each with exit status 78 (EX_CONFIG) and a message naming the file, the line and
//! the reason; a good file passes the check without loading probes or touching a bus.

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use gpud_tests::{TempDir, gpud_bin};
use rstest::rstest;

fn check(config: &Path) -> Output {
    Command::new(gpud_bin())
        .arg("--check-config")
        .arg("--config")
        .arg(config)
        .output()
        .expect("run gpud --check-config")
}

/// Starts the daemon proper on `config`; it must exit by itself (killed after 20 s if not).
fn start(config: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(gpud_bin())
        .arg("--config")
        .arg(config)
        // Never reached: the configuration is refused first.
        .args(["--bus-address", "unix:path=/nonexistent/gpud-test-bus"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gpud");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("gpud output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// (file name, text, line, reason text): each file by hand, since its error is the test.
#[rstest]
#[case::unknown_key(
    "unknown-key.toml",
    "[probes]\nattach = \"auto\"\nbpfs = \"/sys/fs/bpf\"\n",
    Some(3),
    "unknown field `bpfs`"
)]
#[case::unknown_section(
    "unknown-section.toml",
    "# gpud\n\n[daemon]\nlog = \"info\"\n\n[metricz]\n",
    Some(6),
    "unknown field `metricz`"
)]
#[case::wrong_type(
    "wrong-type.toml",
    "[attribution]\nsweep_interval_secs = \"10\"\n",
    Some(2),
    "`attribution.sweep_interval_secs`: invalid type: string \"10\", expected u64"
)]
#[case::negative(
    "negative.toml",
    "[attribution]\n\nrescan_interval_secs = -1\n",
    Some(3),
    "`attribution.rescan_interval_secs`: invalid value"
)]
#[case::sample_range(
    "sample-range.toml",
    "[nvml]\nenabled = true\nsample_interval_ms = 60001\n",
    Some(3),
    "`nvml.sample_interval_ms` must be between 10 and 60000"
)]
#[case::period_range(
    "period-range.toml",
    "[compute]\nperiod_ms = 10\n",
    Some(2),
    "`compute.period_ms` must be between 20 and 1000"
)]
#[case::sweep_zero(
    "sweep-zero.toml",
    "[attribution]\nsweep_interval_secs = 0\n",
    Some(2),
    "`attribution.sweep_interval_secs` must be at least 1"
)]
#[case::relative_path(
    "relative-path.toml",
    "[daemon]\nstate_dir = \"var/lib/gpud\"\n",
    Some(2),
    "`daemon.state_dir` must be an absolute path"
)]
#[case::bad_filter(
    "bad-filter.toml",
    "[daemon]\nlog = \"gpud=chatty\"\n",
    Some(2),
    "`daemon.log` is not a valid filter"
)]
#[case::bad_enum(
    "bad-enum.toml",
    "[enforcement]\ntier = \"react\"\nreact_action = \"stop\"\n",
    Some(3),
    "unknown variant `stop`, expected one of `kill`, `freeze`, `notify`"
)]
#[case::bad_deny_hook(
    "bad-deny-hook.toml",
    "[enforcement]\ndeny_hook = \"kfunc\"\n",
    Some(2),
    "unknown variant `kfunc`, expected one of `auto`, `lsm`, `fmod_ret`, `kprobe`, `none`"
)]
#[case::not_toml(
    "not-toml.toml",
    "[daemon\nlog = \"info\"\n",
    Some(1),
    "unclosed table, expected `]`"
)]
fn bad_configs_are_refused_with_file_line_and_reason(
    #[case] name: &str,
    #[case] text: &str,
    #[case] line: Option<usize>,
    #[case] reason: &str,
) {
    let dir = TempDir::new(&format!("config-errors-{name}"));
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write config");
    let at = match line {
        Some(l) => format!("{}:{l}:", path.display()),
        None => path.display().to_string(),
    };

    let out = check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{name}: {stderr}");
    assert!(
        stderr.contains(&at) && stderr.contains(reason),
        "{name}: wanted {at} and {reason:?} in {stderr:?}"
    );
    assert!(out.stdout.is_empty(), "{name}: nothing on stdout");

    let (code, stderr) = start(&path);
    assert_eq!(code, Some(78), "{name}: the daemon must refuse: {stderr}");
    assert!(
        stderr.contains(&at) && stderr.contains(reason),
        "{name}: wanted {at} and {reason:?} in {stderr:?}"
    );
}

#[rstest]
#[case::missing("missing.toml", "No such file or directory")]
#[case::a_directory("a-directory.toml", "Is a directory")]
fn unreadable_files_are_refused(#[case] name: &str, #[case] reason: &str) {
    let dir = TempDir::new(&format!("config-unreadable-{name}"));
    let path = dir.path().join(name);
    if name == "a-directory.toml" {
        std::fs::create_dir(&path).expect("dir");
    }
    let out = check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot read config file {}", path.display()))
            && stderr.contains(reason),
        "{stderr}"
    );
    let (code, stderr) = start(&path);
    assert_eq!(code, Some(78), "{stderr}");
    assert!(stderr.contains(reason), "{stderr}");
}

#[test]
fn good_config_passes_the_check() {
    let dir = TempDir::new("config-good");
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gpud.toml");
    let partial = dir.path().join("partial.toml");
    std::fs::write(&partial, "[daemon]\nlog = \"gpud=debug\"\n").expect("write");
    for path in [shipped.as_path(), partial.as_path()] {
        let out = check(path);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            stdout,
            format!("config: {}\nok\n", path.display()),
            "the source and ok"
        );
    }
}
