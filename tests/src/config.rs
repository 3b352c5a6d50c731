//! [`TestConfig`]: the one place the integration tests write gpud's configuration.
//!
//! Every test starts from the same baseline (its state and bpffs inside its own scratch
//! directory, so tests never share pins or stored limits) and changes only the keys its scenario
//! is about. Keys the baseline leaves out keep gpud's shipped defaults (config/gpud.toml).

use std::path::{Path, PathBuf};

use toml::{Table, Value};

/// A gpud configuration file being built: the test baseline plus the test's own keys.
#[derive(Clone, Debug)]
pub struct TestConfig {
    dir: PathBuf,
    table: Table,
}

impl TestConfig {
    /// The baseline in `dir`: `state_dir` and `bpffs` inside it; debug logs of gpud; pins removed
    /// on a clean exit (`keep_pinned = false`: nothing outlives the test); a sweep every second
    /// (removed cgroups are forgotten quickly); no periodic `/proc` rescan (the start-up scan
    /// still runs), so counts change only by what the test does.
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            table: Table::new(),
        }
        .set_path("daemon.state_dir", dir.join("state"))
        .log("gpud=debug")
        .set_path("probes.bpffs", dir.join("bpffs"))
        .keep_pinned(false)
        .set("attribution.sweep_interval_secs", 1)
        .set("attribution.rescan_interval_secs", 0)
    }

    /// Sets any key, named with its section: `.set("enforcement.react_action", "kill")`.
    pub fn set(mut self, key: &str, value: impl Into<Value>) -> Self {
        let (section, name) = key
            .split_once('.')
            .unwrap_or_else(|| panic!("config key {key:?} names no section"));
        let table = self
            .table
            .entry(section)
            .or_insert_with(|| Value::Table(Table::new()));
        let Value::Table(table) = table else {
            unreachable!("sections are tables");
        };
        table.insert(name.to_owned(), value.into());
        self
    }

    /// Sets a key whose value is a path.
    pub fn set_path(self, key: &str, path: impl AsRef<Path>) -> Self {
        let text = path.as_ref().display().to_string();
        self.set(key, text)
    }

    /// Adds files to `devices.extra_paths`: gpud counts ioctls on them as on `/dev/nvidiactl`
    /// (stand-in files, the fake NVIDIA device).
    pub fn extra_paths<P: AsRef<Path>>(mut self, paths: impl IntoIterator<Item = P>) -> Self {
        let mut all: Vec<Value> = self
            .get("devices.extra_paths")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        all.extend(
            paths
                .into_iter()
                .map(|p| Value::from(p.as_ref().display().to_string())),
        );
        self = self.set("devices.extra_paths", Value::Array(all));
        self
    }

    /// Loads NVML from `lib` (the fake, [`crate::install_fake_nvml`]), sampling every 200 ms and
    /// retrying every second, so tests see changes of its scenario within a second.
    pub fn nvml(self, lib: &Path) -> Self {
        self.set("nvml.enabled", true)
            .set_path("nvml.library_path", lib)
            .set("nvml.sample_interval_ms", 200)
            .set("nvml.retry_interval_secs", 1)
    }

    /// No NVML at all (not even the attempt to load the system's library).
    pub fn nvml_off(self) -> Self {
        self.set("nvml.enabled", false)
    }

    /// `daemon.log`, the log filter.
    pub fn log(self, filter: &str) -> Self {
        self.set("daemon.log", filter)
    }

    /// `probes.keep_pinned`: `true` for tests where a restarted daemon resumes the kernel's state.
    pub fn keep_pinned(self, keep: bool) -> Self {
        self.set("probes.keep_pinned", keep)
    }

    /// Compute shares on a short loop: NVML sampled and the law planning every 100 ms;
    /// `compute.hardware` as given (the channel-group controls, or the freezer only).
    pub fn compute(self, hardware: bool) -> Self {
        self.set("nvml.sample_interval_ms", 100)
            .set("compute.period_ms", 100)
            .set("compute.hardware", hardware)
    }

    /// `enforcement.react_action`: `kill`, `freeze` or `notify`.
    pub fn react_action(self, action: &str) -> Self {
        self.set("enforcement.react_action", action)
    }

    /// A key's value, if set.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let (section, name) = key.split_once('.')?;
        self.table.get(section)?.get(name)
    }

    /// The file's text.
    pub fn text(&self) -> String {
        toml::to_string(&self.table).expect("a TOML table serializes")
    }

    /// The configuration as gpud reads it (for the in-process rig: `gpud::daemon::core::open`).
    pub fn parsed(&self) -> gpud::config::Config {
        gpud::config::Config::from_toml(&self.text(), &self.dir.join("gpud.toml"))
            .unwrap_or_else(|e| panic!("the test configuration is invalid: {e}"))
    }

    /// Writes the file as `gpud.toml` in the directory; its path.
    pub fn write(&self) -> PathBuf {
        self.write_as("gpud.toml")
    }

    /// Writes the file as `name` in the directory (tests that keep several); its path.
    pub fn write_as(&self, name: &str) -> PathBuf {
        let p = self.dir.join(name);
        std::fs::write(&p, self.text()).expect("write config");
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baseline_and_setters_round_trip_through_gpuds_own_parser() {
        let dir = Path::new("/tmp/gpud-test-config");
        let text = TestConfig::new(dir)
            .extra_paths([Path::new("/a")])
            .extra_paths([Path::new("/b")])
            .nvml(Path::new("/lib/libnvidia-ml.so.1"))
            .react_action("freeze")
            .set("probes.events_ring_kib", 2048)
            .text();
        let c = gpud::config::Config::from_toml(&text, Path::new("t.toml")).expect("valid");
        assert_eq!(c.daemon.state_dir, dir.join("state"));
        assert_eq!(c.probes.bpffs, dir.join("bpffs"));
        assert!(!c.probes.keep_pinned);
        assert_eq!(c.probes.events_ring_kib, 2048);
        assert_eq!(
            (
                c.attribution.sweep_interval_secs,
                c.attribution.rescan_interval_secs
            ),
            (1, 0)
        );
        assert_eq!(
            c.devices.extra_paths,
            [PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(c.nvml.library_path, Path::new("/lib/libnvidia-ml.so.1"));
        assert_eq!(
            c.enforcement.react_action,
            gpud::config::ReactAction::Freeze
        );
    }
}
