//! The plugin's settings: from its flags ([`PluginConfig`]), and what the runtime may hand over
//! in `Configure` ([`RuntimeSettings`]).

use std::{path::PathBuf, time::Duration};

use super::NriError;
use crate::{FailMode, FailPolicy, trust::Trust};

/// Settings the runtime may hand over in `Configure`: the plugin's file in the runtime's NRI
/// configuration directory (containerd's `plugin_config_path`, `/etc/nri/conf.d` by default,
/// file `<idx>-<name>.conf` or `<name>.conf`), in TOML. For a plugin the runtime launches itself
/// from its `plugin_path`, which gets no arguments, this is the way to set them; each key given
/// overrides the flag or environment variable of the same meaning.
#[derive(Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeSettings {
    /// gpud's bus (`--bus-address`).
    pub bus_address: Option<String>,
    /// Bound of each call to gpud (`--timeout-ms`), 1 to 60000.
    pub timeout_ms: Option<u64>,
    /// `closed` or `open` (`--on-invalid`).
    pub on_invalid: Option<FailMode>,
    /// `closed` or `open` (`--on-unreachable`).
    pub on_unreachable: Option<FailMode>,
    pub annotation_trust: Option<Trust>,
    pub pod_limits: Option<bool>,
}

impl RuntimeSettings {
    /// Parses the text of a `Configure` request (empty: nothing set).
    pub fn parse(text: &str) -> Result<Self, NriError> {
        let s: Self = toml::from_str(text)?;
        if let Some(ms) = s.timeout_ms
            && !(1..=60_000).contains(&ms)
        {
            return Err(NriError::RuntimeTimeout(ms));
        }
        Ok(s)
    }

    /// `cfg` with these settings applied.
    pub fn apply(&self, mut cfg: PluginConfig) -> PluginConfig {
        if let Some(bus) = &self.bus_address {
            cfg.bus = bus.clone();
        }
        if let Some(ms) = self.timeout_ms {
            cfg.timeout = Duration::from_millis(ms);
        }
        if let Some(m) = self.on_invalid {
            cfg.policy.on_invalid = m;
        }
        if let Some(m) = self.on_unreachable {
            cfg.policy.on_unreachable = Some(m);
        }
        if let Some(t) = self.annotation_trust {
            cfg.trust = t;
        }
        if let Some(p) = self.pod_limits {
            cfg.pod_limits = p;
        }
        cfg
    }
}

/// How the plugin registers and where it applies shares.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// Registered name (`[A-Za-z0-9_.+-]+`).
    pub name: String,
    /// Registered index: two digits; plugins are called in ascending order.
    pub idx: String,
    /// `"system"` or the D-Bus address of gpud's bus.
    pub bus: String,
    /// Bound of each D-Bus call and of the registration.
    pub timeout: Duration,
    pub policy: FailPolicy,
    pub trust: Trust,
    /// Whether a Kubernetes pod's cgroup carries the sum of its containers' grants
    /// ([`crate::pod`]), so that a container of the pod without a grant (a sidecar handed the
    /// GPU file) is inside them.
    pub pod_limits: bool,
    /// Where the pods' ledgers are kept.
    pub ledger_dir: PathBuf,
}

impl PluginConfig {
    /// Checks name and index as NRI does.
    pub fn validate(&self) -> Result<(), NriError> {
        let name_ok = !self.name.is_empty()
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.+-".contains(&b));
        if !name_ok {
            return Err(NriError::InvalidName(self.name.clone()));
        }
        if self.idx.len() != 2 || !self.idx.bytes().all(|b| b.is_ascii_digit()) {
            return Err(NriError::InvalidIndex(self.idx.clone()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags() -> PluginConfig {
        PluginConfig {
            name: "gpud".into(),
            idx: "50".into(),
            bus: "system".into(),
            timeout: Duration::from_millis(1000),
            policy: FailPolicy::default(),
            trust: Trust::Auto,
            pod_limits: true,
            ledger_dir: "/run/gpud-nri/pods".into(),
        }
    }

    /// The example shipped in the package parses, and sets what its comments say.
    #[test]
    fn the_shipped_example_parses() {
        let text = include_str!("../../../config/nri/50-gpud.conf");
        let s = RuntimeSettings::parse(text).expect("config/nri/50-gpud.conf");
        assert_eq!(s.annotation_trust, Some(Trust::Auto));
        assert_eq!(s.pod_limits, Some(true));
        assert_eq!(s.on_unreachable, None, "unset: by grant");
        assert_eq!(s.on_invalid, Some(FailMode::Closed));
    }

    #[test]
    fn each_key_given_overrides_its_flag_and_nothing_else() {
        let empty = RuntimeSettings::parse("# nothing\n").expect("comments only");
        assert_eq!(empty, RuntimeSettings::default());
        let cfg = empty.apply(flags());
        assert_eq!(
            (cfg.bus.as_str(), cfg.timeout),
            ("system", Duration::from_secs(1))
        );
        let s = RuntimeSettings::parse(
            "bus_address = \"unix:path=/run/b\"\non_unreachable = \"closed\"",
        )
        .expect("valid");
        let cfg = s.apply(flags());
        assert_eq!(cfg.bus, "unix:path=/run/b");
        assert_eq!(cfg.policy.on_unreachable, Some(FailMode::Closed));
        assert_eq!(
            cfg.policy.on_invalid,
            FailMode::Closed,
            "the flag's default"
        );
        assert_eq!(cfg.timeout, Duration::from_secs(1));
    }

    #[test]
    fn bad_settings_are_typed_errors() {
        for text in [
            "timeout_ms = 0",
            "timeout_ms = 60001",
            "timeout_ms = -1",
            "on_invalid = \"Closed\"",
            "bus_address = \"a\"\nbus_address = \"b\"",
            "bus = \"x\"",
            "not toml",
        ] {
            assert!(RuntimeSettings::parse(text).is_err(), "{text:?} accepted");
        }
    }
}
