//! Daemon configuration: the TOML schema, its defaults and validation.
//!
//! The defaults live in one place, `config/gpud.toml`, embedded here; a user's file is parsed
//! over them, so it need only hold the keys it changes. Unknown keys are errors.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::{
    Spanned,
    de::{DeTable, DeValue},
};

mod live;

pub use live::{LIVE_KEYS, changed_keys, copy_key, is_live};

/// The documented default configuration, shipped as `config/gpud.toml`.
pub const DEFAULT_CONFIG: &str = include_str!("../../config/gpud.toml");

/// Where in a config file an error is: the file, and the line (1-based) when the error is tied
/// to a place in it (a key or value the file itself holds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub path: PathBuf,
    pub line: Option<usize>,
    pub column: Option<usize>,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        Ok(())
    }
}

impl Location {
    /// The location of byte range `span` of `text`, read from `path`.
    fn at(path: &Path, text: &str, span: Option<std::ops::Range<usize>>) -> Self {
        let (line, column) = match span {
            Some(s) if s.start <= text.len() => {
                let before = &text[..s.start];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                (Some(line), Some(column))
            }
            _ => (None, None),
        };
        Self {
            path: path.to_owned(),
            line,
            column,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Not TOML, an unknown key or section, or a value of the wrong type or enum variant.
    #[error("{at}: {reason}")]
    Parse { at: Location, reason: String },
    /// A value of the right type that validation refuses (range, relative path, ...).
    #[error("{at}: `{key}` {reason}")]
    Invalid {
        at: Location,
        key: &'static str,
        reason: String,
    },
}

impl ConfigError {
    /// The file and line the error is about (none for an unreadable file).
    pub fn location(&self) -> Option<&Location> {
        match self {
            Self::Read { .. } => None,
            Self::Parse { at, .. } | Self::Invalid { at, .. } => Some(at),
        }
    }
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
    pub idle: IdleConfig,
    pub metrics: MetricsConfig,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    pub state_dir: PathBuf,
    pub log: String,
    /// What to do with a stored limits file that cannot be read back.
    pub on_corrupt_state: CorruptState,
    /// Written once gpud is ready, removed when it stops; empty: none.
    pub ready_file: PathBuf,
}

impl DaemonConfig {
    /// The configured ready file, or `None`.
    pub fn ready_file(&self) -> Option<&std::path::Path> {
        (!self.ready_file.as_os_str().is_empty()).then_some(self.ready_file.as_path())
    }
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

/// What to do with a stored limits file that cannot be read back (`[daemon] on_corrupt_state`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CorruptState {
    /// Keep it aside and start with no limits rather than wrong ones.
    #[default]
    StartEmpty,
    /// Refuse to start until a person looks at it.
    Refuse,
}

/// How the programs attach to the ioctl path.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AttachPreference {
    Auto,
    Fentry,
    Tracepoint,
}

impl AttachPreference {
    /// The configuration's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fentry => "fentry",
            Self::Tracepoint => "tracepoint",
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProbesConfig {
    pub attach: AttachPreference,
    pub bpffs: PathBuf,
    pub keep_pinned: bool,
    pub events_ring_kib: u32,
    /// Entries of the object map (RM clients, devices, memory, channels of every tenant).
    pub max_objects: u32,
    /// Most entries of the object map one cgroup may hold (0: no cap).
    pub max_objects_per_cgroup: u32,
    /// Entries of the process map (every process holding an NVIDIA file).
    pub max_procs: u32,
    /// Tracepoint mode follows 32-bit callers where every system call passes (x86-64), and takes
    /// 64-bit ioctls and closes there too (the raw `sys_enter` and `sys_exit` tracepoints).
    pub follow_32bit: bool,
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

impl TierPreference {
    /// The configuration's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Deny => "deny",
            Self::React => "react",
            Self::Dmem => "dmem",
        }
    }
}

/// Which pre-driver hook refuses an ioctl (`[enforcement] deny_hook`): the memory deny tier and
/// the scheduler guard's refusals both use it.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DenyHookPreference {
    /// The first the kernel accepts, in the order below; `none` where it accepts none.
    Auto,
    /// BPF-LSM `file_ioctl` (needs `bpf` in `lsm=`).
    Lsm,
    /// fmod_ret on `security_file_ioctl` (BPF trampolines and BTF; any `lsm=` list).
    FmodRet,
    /// kprobe with `bpf_override_return` on the ioctl syscall: not built (see docs/design.md);
    /// naming it is a start-up error.
    Kprobe,
    /// No pre-driver hook: memory limits are enforced after the crossing allocation (`react`)
    /// and the guard reacts and restores.
    None,
}

impl DenyHookPreference {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Lsm => "lsm",
            Self::FmodRet => "fmod_ret",
            Self::Kprobe => "kprobe",
            Self::None => "none",
        }
    }
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

/// What the scheduler guard does with tenants' scheduling controls (`[enforcement]
/// scheduler_guard`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GuardMode {
    /// Refuse or rewrite what a tenant's policy does not allow, and report it.
    Enforce,
    /// Only report what `enforce` would act on.
    Audit,
    /// Look at no control.
    Off,
}

impl GuardMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::Audit => "audit",
            Self::Off => "off",
        }
    }
}

/// What the scheduler guard does, where no pre-driver hook can refuse it, to the caller of a
/// control it forbids or of a disable naming another process's channels (`[enforcement]
/// guard_react_action`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GuardReactAction {
    /// `SIGKILL` from the probe at the call's entry: it dies before it returns to user space.
    Kill,
    /// Only report (the call's effect on others is still undone).
    Report,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EnforcementConfig {
    pub tier: TierPreference,
    pub deny_hook: DenyHookPreference,
    pub react_action: ReactAction,
    /// Limited cgroups read their limit as the GPU's memory size (`cudaMemGetInfo`, NVML).
    pub virtualize_memory_info: bool,
    /// Tenants' RM controls that change GPU scheduling: refused, clamped or reported.
    pub scheduler_guard: GuardMode,
    pub guard_react_action: GuardReactAction,
    /// Seconds NVML's per-process memory of a limited cgroup may stay over its limit (plus the
    /// margin) before the react action applies; 0: the NVML backstop is off.
    pub nvml_backstop_secs: u64,
    /// Bytes NVML's figure may show over a limit (the contexts' own buffers).
    pub nvml_backstop_margin_bytes: u64,
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
    /// Set shares with the channel-group controls where the firmware honors them; `false`: by
    /// `cgroup.freeze` only.
    pub hardware: bool,
}

/// The idle/hoarding report (`[idle]`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct IdleConfig {
    /// SM utilization (percent) under which a cgroup holding GPU memory counts as idle.
    pub threshold_percent: u32,
    /// How long it must stay under the threshold before it is reported.
    pub min_duration_secs: u64,
    /// Only cgroups holding at least this much GPU memory on the GPU are considered.
    pub min_memory_bytes: u64,
    /// Emit `IdleChanged` on D-Bus when a cgroup becomes idle or active again.
    pub signal: bool,
}

/// The Prometheus endpoint (`[metrics]`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// `host:port` to serve `/metrics` on; empty: no endpoint.
    pub listen: String,
}

impl MetricsConfig {
    /// The address to listen on, `None` when the endpoint is off.
    pub fn address(&self) -> Option<std::net::SocketAddr> {
        self.listen.parse().ok()
    }
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
        Self::from_toml("", Path::new("<built-in config/gpud.toml>"))
    }

    /// Reads `path` and applies it over the defaults.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_effective(path).map(|(c, _)| c)
    }

    /// Like [`Config::load`], also returning the effective values (the defaults with the file
    /// over them) as a table, to tell which keys a reload changes ([`changed_keys`]).
    pub fn load_effective(path: &Path) -> Result<(Self, toml::Table), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::effective_from_toml(&text, path)
    }

    /// Parses `text` (named `path` in errors) over the defaults.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        Self::effective_from_toml(text, path).map(|(c, _)| c)
    }

    /// The built-in defaults with their effective values (see [`Config::load_effective`]).
    pub fn defaults_effective() -> Result<(Self, toml::Table), ConfigError> {
        Self::effective_from_toml("", Path::new("<built-in config/gpud.toml>"))
    }

    /// Parses `text` over the defaults, keeping toml's spans so that every error names the line
    /// of the offending key or value in `text`.
    fn effective_from_toml(text: &str, path: &Path) -> Result<(Self, toml::Table), ConfigError> {
        let parse_err = |src: &str, src_path: &Path, e: toml::de::Error| ConfigError::Parse {
            at: Location::at(src_path, src, e.span()),
            reason: e.message().trim_end().to_owned(),
        };
        let user = DeTable::parse(text).map_err(|e| parse_err(text, path, e))?;
        // A type or variant error points at a value: name its key too.
        let named = |e: toml::de::Error| {
            let key = e.span().and_then(|s| key_of_value(user.get_ref(), "", &s));
            match (parse_err(text, path, e), key) {
                (ConfigError::Parse { at, reason }, Some(key)) => ConfigError::Parse {
                    at,
                    reason: format!("`{key}`: {reason}"),
                },
                (other, _) => other,
            }
        };
        let mut merged = DeTable::parse(DEFAULT_CONFIG)
            .map_err(|e| parse_err(DEFAULT_CONFIG, Path::new("config/gpud.toml"), e))?
            .into_inner();
        merge(&mut merged, user.get_ref().clone());
        // Every span in `merged` that deserialization can fail on is the user's: the defaults
        // are valid (a unit test keeps them so), so a bad key or value came from `text`.
        let de = || toml::de::Deserializer::from(Spanned::new(0..text.len(), merged.clone()));
        let config = Config::deserialize(de()).map_err(named)?;
        let table = toml::Table::deserialize(de()).map_err(named)?;
        config.validate().map_err(|(key, reason)| {
            let span = lookup(user.get_ref(), key).map(Spanned::span);
            ConfigError::Invalid {
                at: Location::at(path, text, span),
                key,
                reason,
            }
        })?;
        Ok((config, table))
    }

    /// Semantic checks on values of the right type: the offending key and why.
    fn validate(&self) -> Result<(), (&'static str, String)> {
        let invalid = |key, reason: &str| (key, reason.to_owned());
        if !self.daemon.state_dir.is_absolute() {
            return Err(invalid("daemon.state_dir", "must be an absolute path"));
        }
        if self.daemon.ready_file().is_some_and(|p| !p.is_absolute()) {
            return Err(invalid(
                "daemon.ready_file",
                "must be an absolute path (or \"\" for none)",
            ));
        }
        if let Err(e) = crate::logging::parse_filter(&self.daemon.log) {
            let reason = match e {
                crate::logging::LogError::Filter { reason, .. } => reason,
                other => other.to_string(),
            };
            return Err(invalid(
                "daemon.log",
                &format!("is not a valid filter: {reason}"),
            ));
        }
        if !self.probes.bpffs.is_absolute() {
            return Err(invalid("probes.bpffs", "must be an absolute path"));
        }
        if !(64..=262_144).contains(&self.probes.events_ring_kib)
            || !self.probes.events_ring_kib.is_power_of_two()
        {
            return Err(invalid(
                "probes.events_ring_kib",
                "must be a power of two between 64 and 262144",
            ));
        }
        if !(1024..=16 << 20).contains(&self.probes.max_objects) {
            return Err(invalid(
                "probes.max_objects",
                "must be between 1024 and 16777216",
            ));
        }
        let per_cgroup = self.probes.max_objects_per_cgroup;
        if per_cgroup != 0 && !(64..=16 << 20).contains(&per_cgroup) {
            return Err(invalid(
                "probes.max_objects_per_cgroup",
                "must be 0 (no cap) or between 64 and 16777216",
            ));
        }
        if !(1024..=4 << 20).contains(&self.probes.max_procs) {
            return Err(invalid(
                "probes.max_procs",
                "must be between 1024 and 4194304",
            ));
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
        if !(1..=100).contains(&self.idle.threshold_percent) {
            return Err(invalid(
                "idle.threshold_percent",
                "must be between 1 and 100",
            ));
        }
        if self.idle.min_duration_secs == 0 {
            return Err(invalid("idle.min_duration_secs", "must be at least 1"));
        }
        if !self.metrics.listen.is_empty() && self.metrics.address().is_none() {
            return Err(invalid(
                "metrics.listen",
                "must be empty (no endpoint) or an IP address and port such as \"127.0.0.1:9400\" \
                 or \"[::1]:9400\"",
            ));
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
fn merge<'i>(base: &mut DeTable<'i>, over: DeTable<'i>) {
    for (key, value) in over {
        let (span, value) = (value.span(), value.into_inner());
        match (base.get_mut(key.get_ref().as_ref()), value) {
            (Some(b), DeValue::Table(o)) if matches!(b.get_ref(), DeValue::Table(_)) => {
                if let DeValue::Table(b) = b.get_mut() {
                    merge(b, o);
                }
            }
            (_, v) => {
                // Remove first: `insert` would keep the default's key (and its span).
                base.remove(key.get_ref().as_ref());
                base.insert(key, Spanned::new(span, v));
            }
        }
    }
}

/// The entry of dotted `key` in `table`, with its span.
fn lookup<'a, 'i>(table: &'a DeTable<'i>, key: &str) -> Option<&'a Spanned<DeValue<'i>>> {
    let mut parts = key.split('.');
    let mut value = table.get(parts.next()?)?;
    for part in parts {
        value = value.get_ref().as_table()?.get(part)?;
    }
    Some(value)
}

/// The dotted key whose value (not a table; an array counts with its elements) holds `span`.
fn key_of_value(
    table: &DeTable<'_>,
    prefix: &str,
    span: &std::ops::Range<usize>,
) -> Option<String> {
    table.iter().find_map(|(k, v)| {
        let name = if prefix.is_empty() {
            k.get_ref().to_string()
        } else {
            format!("{prefix}.{}", k.get_ref())
        };
        match v.get_ref() {
            DeValue::Table(t) => key_of_value(t, &name, span),
            _ => {
                let own = v.span();
                (own.start <= span.start && span.end <= own.end).then_some(name)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"))
    }

    /// Every live key exists, the shipped file marks exactly those `(live)`, and a reload's copy
    /// of one key into the values in force changes that key alone.
    #[test]
    fn live_keys_exist_and_are_marked_in_the_shipped_file() -> Result<(), ConfigError> {
        let (_, defaults) = Config::defaults_effective()?;
        let mut marked = Vec::new();
        let mut section = String::new();
        let mut pending = false;
        for line in DEFAULT_CONFIG.lines() {
            if let Some(s) = line.strip_prefix('[') {
                section = s.trim_end_matches(']').to_owned();
            } else if line.trim() == "# (live)" {
                pending = true;
            } else if let Some((key, _)) = line.split_once(" = ")
                && !line.starts_with('#')
                && std::mem::take(&mut pending)
            {
                marked.push(format!("{section}.{key}"));
            }
        }
        assert_eq!(marked, LIVE_KEYS, "`# (live)` marks in config/gpud.toml");
        for key in LIVE_KEYS {
            let (section, name) = key.split_once('.').expect("dotted");
            assert!(
                defaults
                    .get(section)
                    .and_then(toml::Value::as_table)
                    .is_some_and(|t| t.contains_key(name)),
                "{key} is not a configuration key"
            );
        }
        let (_, changed) = Config::effective_from_toml(
            "[daemon]\nlog = \"debug\"\n[probes]\nkeep_pinned = false\n",
            Path::new("t.toml"),
        )?;
        let mut in_force = defaults.clone();
        copy_key(&changed, &mut in_force, "daemon.log");
        assert_eq!(changed_keys(&defaults, &in_force), ["daemon.log"]);
        assert_eq!(changed_keys(&in_force, &changed), ["probes.keep_pinned"]);
        Ok(())
    }

    #[test]
    fn shipped_file_is_the_defaults() -> Result<(), ConfigError> {
        let c = Config::defaults()?;
        assert_eq!(c.probes.attach, AttachPreference::Auto);
        assert_eq!(c.probes.bpffs, PathBuf::from("/sys/fs/bpf"));
        assert!(c.probes.keep_pinned);
        assert_eq!(c.probes.events_ring_kib, 1024);
        assert_eq!(c.dbus.bus, "system");
        assert_eq!(c.dbus.admin_group, "gpud-admin");
        assert_eq!(parse("[dbus]\nadmin_group = \"\"")?.dbus.admin_group, "");
        assert!(c.devices.extra_paths.is_empty());
        assert!(c.nvml.enabled);
        assert!(c.enforcement.virtualize_memory_info);
        assert_eq!(c.enforcement.scheduler_guard, GuardMode::Enforce);
        assert_eq!(c.enforcement.deny_hook, DenyHookPreference::Auto);
        assert_eq!(c.enforcement.guard_react_action, GuardReactAction::Kill);
        assert_eq!(
            parse("[enforcement]\nscheduler_guard = \"audit\"")?
                .enforcement
                .scheduler_guard,
            GuardMode::Audit
        );
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
            ("[daemon]\nready_file = \"run/ready\"", "daemon.ready_file"),
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
            ("[probes]\nevents_ring_kib = 96", "probes.events_ring_kib"),
            ("[probes]\nmax_objects = 1000", "probes.max_objects"),
            (
                "[probes]\nmax_objects_per_cgroup = 10",
                "probes.max_objects_per_cgroup",
            ),
            ("[probes]\nmax_procs = 0", "probes.max_procs"),
            ("[probes]\nevents_ring_kib = 32", "probes.events_ring_kib"),
            (
                "[probes]\nevents_ring_kib = 524288",
                "probes.events_ring_kib",
            ),
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

    /// Every error tied to the file names its line, and the reason.
    #[test]
    fn errors_name_the_line() {
        for (text, line, needle) in [
            ("[probes]\n\natach = \"auto\"", 3, "unknown field `atach`"),
            ("# c\n[nope]\n", 2, "unknown field `nope`"),
            (
                "[nvml]\nenabled = \"yes\"",
                2,
                "`nvml.enabled`: invalid type",
            ),
            ("[enforcement]\ntier = \"lsm\"", 2, "unknown variant `lsm`"),
            (
                "[enforcement]\nscheduler_guard = \"strict\"",
                2,
                "unknown variant `strict`, expected one of `enforce`, `audit`, `off`",
            ),
            (
                "[enforcement]\nvirtualize_memory_info = \"on\"",
                2,
                "`enforcement.virtualize_memory_info`: invalid type",
            ),
            (
                "[daemon]\nlog = \"info\"\n[nvml]\nsample_interval_ms = 5",
                4,
                "between 10 and 60000",
            ),
            ("[compute]\nperiod_ms = 5000", 2, "`compute.period_ms`"),
            (
                "[daemon]\n\nlog = \"gpud=loudest\"",
                3,
                "`daemon.log` is not a valid filter",
            ),
            ("a = \n", 1, "string values must be quoted"),
            (
                "[devices]\nextra_paths = [\"/a\",\n  7]",
                3,
                "`devices.extra_paths`: invalid type",
            ),
            (
                "[devices]\nextra_paths = [\"rel\"]",
                2,
                "`devices.extra_paths` must hold absolute",
            ),
        ] {
            let err = parse(text).unwrap_err();
            let msg = err.to_string();
            assert_eq!(
                err.location().and_then(|l| l.line),
                Some(line),
                "{text:?} gave {msg}"
            );
            assert!(msg.starts_with(&format!("test.toml:{line}:")), "{msg}");
            assert!(msg.contains(needle), "{text:?} gave {msg}");
        }
    }

    /// Every key of the shipped file has a comment right above it (or above the run of keys it
    /// opens), so the defaults document themselves.
    #[test]
    fn every_shipped_key_is_documented() {
        let mut previous = "";
        for line in DEFAULT_CONFIG.lines().map(str::trim) {
            let is_key = !line.is_empty() && !line.starts_with('#') && !line.starts_with('[');
            if is_key {
                assert!(
                    previous.starts_with('#'),
                    "config/gpud.toml: `{line}` has no comment above it"
                );
            }
            previous = line;
        }
    }

    #[test]
    fn changed_keys_are_named() -> Result<(), ConfigError> {
        let (_, a) = Config::defaults_effective()?;
        let (_, b) = Config::effective_from_toml(
            "[daemon]\nlog = \"debug\"\n[probes]\nattach = \"tracepoint\"",
            Path::new("t"),
        )?;
        assert_eq!(changed_keys(&a, &b), ["daemon.log", "probes.attach"]);
        assert!(changed_keys(&a, &a).is_empty());
        Ok(())
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

/// Fuzz targets (`cargo xtask fuzz`): TOML documents of any shape over the known sections and
/// keys, and the shipped file with arbitrary bytes changed. Every outcome is a configuration or a
/// typed [`ConfigError`] that points into the text.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    const NAME: &str = "fuzz.toml";

    /// (section, key) of every key in the shipped file.
    fn known_keys() -> Vec<(String, String)> {
        let t: toml::Table = DEFAULT_CONFIG.parse().expect("the shipped file is TOML");
        t.iter()
            .flat_map(|(s, v)| {
                v.as_table()
                    .into_iter()
                    .flat_map(|t| t.keys())
                    .map(move |k| (s.clone(), k.clone()))
            })
            .collect()
    }

    fn value() -> impl Strategy<Value = toml::Value> {
        let leaf = prop_oneof![
            any::<i64>().prop_map(toml::Value::Integer),
            (-5i64..5000).prop_map(toml::Value::Integer),
            any::<bool>().prop_map(toml::Value::Boolean),
            any::<f64>().prop_map(toml::Value::Float),
            "\\PC{0,16}".prop_map(toml::Value::String),
            "(/[a-z]{0,6}){0,3}|auto|fentry|tracepoint|kill|freeze|notify|deny|system|session|info|debug"
                .prop_map(toml::Value::String),
        ];
        leaf.prop_recursive(2, 8, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(toml::Value::Array),
                proptest::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                    .prop_map(|m| toml::Value::Table(m.into_iter().collect())),
            ]
        })
    }

    /// Where an error points must be inside `text`.
    fn check_error(e: &ConfigError, text: &str) -> Result<(), TestCaseError> {
        let at = e
            .location()
            .ok_or_else(|| TestCaseError::fail(format!("{e:?} has no location")))?;
        prop_assert_eq!(&at.path, Path::new(NAME));
        if let Some(line) = at.line {
            prop_assert!(
                line <= text.lines().count() + 1,
                "{e} is past the end of\n{text}"
            );
        }
        Ok(())
    }

    proptest! {
        /// Documents built from known and unknown sections and keys with values of any type.
        #[test]
        fn any_document_is_a_config_or_a_located_error(
            entries in proptest::collection::vec(
                (any::<prop::sample::Index>(), "[a-z_]{1,10}", any::<bool>(), value()),
                0..8,
            ),
        ) {
            let known = known_keys();
            let mut doc = toml::Table::new();
            for (i, other, use_known, v) in entries {
                let (section, key) = if use_known {
                    i.get(&known).clone()
                } else {
                    (i.get(&known).0.clone(), other)
                };
                if let toml::Value::Table(s) = doc
                    .entry(section)
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                {
                    s.insert(key, v);
                }
            }
            let text = toml::to_string(&doc).expect("serializable");
            if let Err(e) = Config::from_toml(&text, Path::new(NAME)) {
                prop_assert!(matches!(e, ConfigError::Parse { .. } | ConfigError::Invalid { .. }), "{e:?}");
                check_error(&e, &text)?;
            }
        }

        /// The shipped file with bytes overwritten, inserted or removed anywhere.
        #[test]
        fn arbitrary_bytes_over_the_defaults(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..12),
        ) {
            let mut bytes = DEFAULT_CONFIG.as_bytes().to_vec();
            for (at, b, op) in edits {
                let i = at.index(bytes.len().max(1));
                match op {
                    0 if i < bytes.len() => bytes[i] = b,
                    1 => bytes.insert(i.min(bytes.len()), b),
                    _ if i < bytes.len() => {
                        bytes.remove(i);
                    }
                    _ => {}
                }
            }
            match std::str::from_utf8(&bytes) {
                Ok(text) => {
                    if let Err(e) = Config::from_toml(text, Path::new(NAME)) {
                        check_error(&e, text)?;
                    }
                }
                // Not text: reading it is what fails, naming the file.
                Err(_) => {
                    let dir = std::env::temp_dir().join(format!("gpud-config-fuzz-{}", std::process::id()));
                    std::fs::create_dir_all(&dir).expect("temp dir");
                    let path = dir.join(NAME);
                    std::fs::write(&path, &bytes).expect("write");
                    let got = Config::load(&path);
                    let _ = std::fs::remove_dir_all(&dir);
                    prop_assert!(matches!(got, Err(ConfigError::Read { .. })), "{got:?}");
                }
            }
        }
    }
}
