//! `gpudctl set`'s limit flags and `gpudctl limits`' text, both from gpud-api's limit schema: one
//! flag per limit (`--memory-max`, `--compute-max`, …: its annotation name), each value parsed and
//! checked as the daemon checks it, sent typed ([`LimitSet::to_dict`]).

use clap::{Arg, ArgMatches, Args, Command, FromArgMatches};
use gpud_api::{
    LimitRecord, LimitState,
    limits::{LimitKind, LimitSet, LimitValue, Priority, ValueType},
};

use crate::human;

/// The limits given as `--<limit> VALUE`, one flag per [`LimitKind`].
#[derive(Clone, Debug, Default)]
pub struct LimitFlags(pub LimitSet);

impl FromArgMatches for LimitFlags {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = Self::default();
        flags.update_from_arg_matches(m)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        for kind in LimitKind::iter() {
            if let Some(value) = m.get_one::<LimitValue>(kind.annotation()) {
                self.0.insert(kind, value.clone()).map_err(|e| {
                    clap::Error::raw(clap::error::ErrorKind::ValueValidation, e.to_string())
                })?;
            }
        }
        Ok(())
    }
}

impl Args for LimitFlags {
    fn augment_args(cmd: Command) -> Command {
        LimitKind::iter().fold(cmd, |cmd, kind| {
            cmd.arg(
                Arg::new(kind.annotation())
                    .long(kind.annotation())
                    .value_name(kind.value_name())
                    .help(kind.description())
                    .value_parser(move |text: &str| kind.parse(text)),
            )
        })
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// `gpudctl limits` as text: every limit set and its state (`in-force`, or `pending` with why
/// on a line of its own), the cgroup column as wide as its longest path (Kubernetes paths run
/// past 100 characters).
pub fn print_limits(limits: &[LimitRecord]) {
    let width = limits
        .iter()
        .map(|l| l.cgroup.len())
        .max()
        .unwrap_or(0)
        .max("CGROUP".len());
    println!("{:<width$}  {:<12} {:<8} LIMITS", "CGROUP", "GPU", "STATE");
    for l in limits {
        let shown: Vec<String> = l
            .limits
            .iter()
            .map(|(name, v)| format!("{name}={}", shown(name, *v)))
            .collect();
        println!(
            "{:<width$}  {:<12} {:<8} {}",
            l.cgroup,
            l.gpu,
            l.state,
            shown.join(" ")
        );
        if let LimitState::Pending(why) = l.limit_state() {
            println!("{:<width$}  {:<12} ↳ {why}", "", "");
        }
    }
}

/// One listed value, as its limit's type reads: bytes in binary units, percent with `%`,
/// priorities by name.
fn shown(name: &str, v: u64) -> String {
    match LimitKind::from_dbus_name(name).map(LimitKind::value_type) {
        Some(ValueType::Bytes) => human(v),
        Some(ValueType::Percent) => format!("{v}%"),
        Some(ValueType::Priority) => {
            Priority::from_index(v).map_or_else(|| v.to_string(), |p| p.as_str().to_owned())
        }
        Some(ValueType::Weight) | None => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Set {
        #[command(flatten)]
        limits: LimitFlags,
    }

    #[test]
    fn one_flag_per_limit_parsed_by_the_schema() {
        let set = Set::try_parse_from([
            "set",
            "--memory-max",
            "8Gi",
            "--compute-max",
            "30",
            "--compute-min",
            "10",
            "--compute-weight",
            "300",
            "--priority",
            "best-effort",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(set.limits.0.len(), LimitKind::iter().count());
        assert_eq!(
            set.limits.0.get(LimitKind::MemoryMax),
            Some(&LimitValue::Number(8 << 30))
        );
        for (flag, bad, words) in [
            ("--compute-max", "0", "0 is outside 1..=100"),
            ("--memory-max", "8GB", "unknown suffix"),
            ("--priority", "urgent", "is not a priority"),
        ] {
            let err = Set::try_parse_from(["set", flag, bad]).map(|s| s.limits);
            let text = err.as_ref().map_err(ToString::to_string).err();
            assert!(
                text.as_deref().is_some_and(|t| t.contains(words)),
                "{flag} {bad}: {err:?}"
            );
        }
    }

    #[test]
    fn listed_values_read_as_their_type() {
        assert_eq!(shown("memory_max", 8 << 30), "8.0 GiB");
        assert_eq!(shown("compute_min", 20), "20%");
        assert_eq!(shown("compute_weight", 300), "300");
        assert_eq!(shown("priority", 0), "latency-critical");
        assert_eq!(shown("priority", 7), "7");
        assert_eq!(shown("future_limit", 7), "7");
    }
}
