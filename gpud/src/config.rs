//! Daemon configuration: the TOML schema, its defaults and validation.
//!
//! The defaults live in one place, `config/gpud.toml`, embedded here; a user's file is parsed
//! over them, so it need only hold the keys it changes. Unknown keys are errors.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The documented default configuration, shipped as `config/gpud.toml`.
pub const DEFAULT_CONFIG: &str = include_str!("../../config/gpud.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("invalid config file {path}: `{key}` {reason}")]
    Invalid {
        path: PathBuf,
        key: &'static str,
        reason: String,
    },
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub daemon: DaemonConfig,
    pub dbus: DbusConfig,
    pub probes: ProbesConfig,
    pub devices: DevicesConfig,
    pub attribution: AttributionConfig,
    pub enforcement: EnforcementConfig,
    pub nvml: NvmlConfig,
    pub compute: ComputeConfig,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    pub state_dir: PathBuf,
    pub log: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DbusConfig {
    /// `"system"` or a D-Bus address.
    pub bus: String,
    /// Group whose members (besides root) may call the methods that change state; empty: root
    /// only. Must match the group in the bus policy (systemd/dev.gpud.Daemon1.conf).
    pub admin_group: String,
}

/// How the programs attach to the ioctl path.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AttachPreference {
    Auto,
    Fentry,
    Tracepoint,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProbesConfig {
    pub attach: AttachPreference,
    pub bpffs: PathBuf,
    pub keep_pinned: bool,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DevicesConfig {
    pub extra_paths: Vec<PathBuf>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AttributionConfig {
    pub rescan_interval_secs: u64,
    pub sweep_interval_secs: u64,
}

/// How GPU-memory limits are enforced (`[enforcement] tier`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TierPreference {
    /// `deny` where BPF-LSM programs load, `react` otherwise.
    Auto,
    /// Refuse the crossing allocation in `file_ioctl` (BPF-LSM); start-up fails without it.
    Deny,
    /// Act on the crossing allocation when its ioctl returns.
    React,
    /// The kernel's `dmem` cgroup controller; start-up fails unless it lists NVIDIA regions.
    Dmem,
}

/// What the `react` tier does to the allocation that crossed a limit.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReactAction {
    /// `SIGKILL` the allocating process, from the probe, before the ioctl returns to it.
    Kill,
    /// Freeze the cgroup whose limit was crossed (`cgroup.freeze`), from the daemon.
    Freeze,
    /// Only report (D-Bus signal, event counter, log).
    Notify,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EnforcementConfig {
    pub tier: TierPreference,
    pub react_action: ReactAction,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NvmlConfig {
    pub enabled: bool,
    /// Path of libnvidia-ml; empty: the system's (`libnvidia-ml.so.1` through the loader).
    pub library_path: PathBuf,
    pub sample_interval_ms: u64,
    pub retry_interval_secs: u64,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ComputeConfig {
    pub enabled: bool,
    pub period_ms: u64,
}

impl NvmlConfig {
    /// The configured library, or `None` for the system's.
    pub fn library(&self) -> Option<PathBuf> {
        (!self.library_path.as_os_str().is_empty()).then(|| self.library_path.clone())
    }
}

impl Config {
    /// The built-in defaults (`config/gpud.toml`; a unit test keeps it valid).
    pub fn defaults() -> Result<Self, ConfigError> {
        Self::parse_over(toml::Table::new(), Path::new("<built-in config/gpud.toml>"))
    }

    /// Reads `path` and applies it over the defaults.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses `text` (named `path` in errors) over the defaults.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let user: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            source: Box::new(e),
        })?;
        Self::parse_over(user, path)
    }

    fn parse_over(user: toml::Table, path: &Path) -> Result<Self, ConfigError> {
        let parse_err = |e| ConfigError::Parse {
            path: path.to_owned(),
            source: Box::new(e),
        };
        let mut merged: toml::Table = toml::from_str(DEFAULT_CONFIG).map_err(parse_err)?;
        merge(&mut merged, user);
        let config: Config = toml::Value::Table(merged).try_into().map_err(parse_err)?;
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |key, reason: &str| ConfigError::Invalid {
            path: path.to_owned(),
            key,
            reason: reason.to_owned(),
        };
        if !self.daemon.state_dir.is_absolute() {
            return Err(invalid("daemon.state_dir", "must be an absolute path"));
        }
        if !self.probes.bpffs.is_absolute() {
            return Err(invalid("probes.bpffs", "must be an absolute path"));
        }
        if self.dbus.bus.trim().is_empty() {
            return Err(invalid("dbus.bus", "must be \"system\" or a D-Bus address"));
        }
        if !valid_group_name(&self.dbus.admin_group) {
            return Err(invalid(
                "dbus.admin_group",
                "must be empty or a group name (letters, digits, `_`, `-`, `.`; not starting \
                 with `-`; at most 64 characters)",
            ));
        }
        if let Some(p) = self.devices.extra_paths.iter().find(|p| !p.is_absolute()) {
            return Err(invalid(
                "devices.extra_paths",
                &format!("must hold absolute paths, not {}", p.display()),
            ));
        }
        if self.devices.extra_paths.len() > gpud_common::MAX_EXTRA_FILES as usize {
            return Err(invalid(
                "devices.extra_paths",
                &format!("holds more than {} files", gpud_common::MAX_EXTRA_FILES),
            ));
        }
        if !(10..=60_000).contains(&self.nvml.sample_interval_ms) {
            return Err(invalid(
                "nvml.sample_interval_ms",
                "must be between 10 and 60000",
            ));
        }
        if !(20..=1000).contains(&self.compute.period_ms) {
            return Err(invalid("compute.period_ms", "must be between 20 and 1000"));
        }
        if self.nvml.retry_interval_secs == 0 {
            return Err(invalid("nvml.retry_interval_secs", "must be at least 1"));
        }
        if self.attribution.sweep_interval_secs == 0 {
            return Err(invalid(
                "attribution.sweep_interval_secs",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Empty (root only) or a plausible group name; whether the group exists is checked per call.
fn valid_group_name(name: &str) -> bool {
    name.is_empty()
        || (name.len() <= 64
            && !name.starts_with('-')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')))
}

/// Recursively overlays `over` on `base`: tables merge, everything else replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(key, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"))
    }

    #[test]
    fn shipped_file_is_the_defaults() -> Result<(), ConfigError> {
        let c = Config::defaults()?;
        assert_eq!(c.probes.attach, AttachPreference::Auto);
        assert_eq!(c.probes.bpffs, PathBuf::from("/sys/fs/bpf"));
        assert!(c.probes.keep_pinned);
        assert_eq!(c.dbus.bus, "system");
        assert_eq!(c.dbus.admin_group, "gpud-admin");
        assert_eq!(parse("[dbus]\nadmin_group = \"\"")?.dbus.admin_group, "");
        assert!(c.devices.extra_paths.is_empty());
        assert!(c.nvml.enabled);
        assert_eq!(
            c.nvml.library(),
            None,
            "the system's libnvidia-ml by default"
        );
        assert_eq!(
            (c.nvml.sample_interval_ms, c.nvml.retry_interval_secs),
            (1000, 10)
        );
        assert_eq!(parse(DEFAULT_CONFIG)?, c);
        assert_eq!(parse("")?, c);
        Ok(())
    }

    #[test]
    fn nvml_library_path_is_taken_as_given() -> Result<(), ConfigError> {
        let c = parse("[nvml]\nlibrary_path = \"/opt/nvidia/libnvidia-ml.so.1\"\n")?;
        assert_eq!(
            c.nvml.library(),
            Some(PathBuf::from("/opt/nvidia/libnvidia-ml.so.1"))
        );
        assert_eq!(c.nvml.sample_interval_ms, 1000);
        Ok(())
    }

    #[test]
    fn partial_file_changes_only_its_keys() -> Result<(), ConfigError> {
        let c = parse("[probes]\nattach = \"tracepoint\"\n")?;
        assert_eq!(c.probes.attach, AttachPreference::Tracepoint);
        assert_eq!(c.probes.bpffs, PathBuf::from("/sys/fs/bpf"));
        assert_eq!(c.daemon, Config::defaults()?.daemon);
        Ok(())
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        for (text, needle) in [
            ("[probes]\natach = \"auto\"", "atach"),
            ("[probes]\nattach = \"kprobe\"", "kprobe"),
            ("[nope]\n", "nope"),
            ("[daemon]\nstate_dir = \"relative\"", "daemon.state_dir"),
            ("[devices]\nextra_paths = [\"x\"]", "devices.extra_paths"),
            (
                "[attribution]\nsweep_interval_secs = 0",
                "sweep_interval_secs",
            ),
            (
                "[attribution]\nrescan_interval_secs = -1",
                "rescan_interval_secs",
            ),
            ("[nvml]\nsample_interval_ms = 5", "nvml.sample_interval_ms"),
            (
                "[nvml]\nsample_interval_ms = 60001",
                "nvml.sample_interval_ms",
            ),
            (
                "[nvml]\nretry_interval_secs = 0",
                "nvml.retry_interval_secs",
            ),
            ("[dbus]\nadmin_group = \"a b\"", "dbus.admin_group"),
            ("[dbus]\nadmin_group = \"-x\"", "dbus.admin_group"),
            ("[dbus]\nadmin_group = \"x:y\"", "dbus.admin_group"),
            ("[nvml]\nlibary_path = \"/x\"", "libary_path"),
            ("[nvml]\nenabled = \"yes\"", "enabled"),
            ("not toml at all =", "test.toml"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text:?} gave {err}");
        }
    }

    proptest::proptest! {
        /// Any text is either a configuration or a typed error; nothing panics.
        #[test]
        fn arbitrary_text_never_panics(text in "(?s).{0,300}") {
            let _ = parse(&text);
        }

        /// Known keys with values of any shape: accepted only when the type and range fit.
        #[test]
        fn arbitrary_values_for_known_keys(
            secs in proptest::prelude::any::<i64>(),
            attach in "[a-z]{0,12}",
            path in "[a-z/]{0,20}",
        ) {
            let text = format!(
                "[attribution]\nsweep_interval_secs = {secs}\n[probes]\nattach = \"{attach}\"\nbpffs = \"{path}\"\n"
            );
            let ok = secs >= 1
                && ["auto", "fentry", "tracepoint"].contains(&attach.as_str())
                && path.starts_with('/');
            proptest::prop_assert_eq!(parse(&text).is_ok(), ok, "{}", text);
        }
    }
}
