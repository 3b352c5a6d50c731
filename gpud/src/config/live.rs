//! What a reload changes: the keys applied without a restart, and the comparison of two
//! effective configurations key by key.

/// Keys a reload (SIGHUP, `systemctl reload gpud`) applies without a restart, each by its owner:
/// the log filter and the admin group by the daemon binary, the sweep and rescan timers and the
/// idle rule by the state task, the period by the compute controller, the intervals by the NVML
/// sampler. A changed key that is not listed is logged as taking effect on restart.
pub const LIVE_KEYS: &[&str] = &[
    "daemon.log",
    "dbus.admin_group",
    "attribution.rescan_interval_secs",
    "attribution.sweep_interval_secs",
    "enforcement.virtualize_memory_info",
    "enforcement.scheduler_guard",
    "enforcement.nvml_backstop_secs",
    "enforcement.nvml_backstop_margin_bytes",
    "nvml.sample_interval_ms",
    "nvml.retry_interval_secs",
    "compute.period_ms",
    "idle.threshold_percent",
    "idle.min_duration_secs",
    "idle.min_memory_bytes",
    "idle.signal",
];

/// Whether a reload applies the dotted `key` without a restart.
pub fn is_live(key: &str) -> bool {
    LIVE_KEYS.contains(&key)
}

/// Copies the value of dotted `key` from `from` into `to` (removing it where `from` has none).
pub fn copy_key(from: &toml::Table, to: &mut toml::Table, key: &str) {
    let Some((section, name)) = key.split_once('.') else {
        match from.get(key) {
            Some(v) => to.insert(key.to_owned(), v.clone()),
            None => to.remove(key),
        };
        return;
    };
    let value = from
        .get(section)
        .and_then(toml::Value::as_table)
        .and_then(|t| t.get(name))
        .cloned();
    let toml::Value::Table(target) = to
        .entry(section.to_owned())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
    else {
        return;
    };
    match value {
        Some(v) => target.insert(name.to_owned(), v),
        None => target.remove(name),
    };
}

/// Dotted names of the keys whose effective values differ between `old` and `new`.
pub fn changed_keys(old: &toml::Table, new: &toml::Table) -> Vec<String> {
    fn walk(prefix: &str, old: &toml::Table, new: &toml::Table, out: &mut Vec<String>) {
        let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
        for k in keys {
            let name = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match (old.get(k), new.get(k)) {
                (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) => {
                    walk(&name, a, b, out)
                }
                (a, b) if a != b => out.push(name),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    walk("", old, new, &mut out);
    out
}
