//! The schema's own tests: names, text values, rendering.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

#[test]
fn names_are_unique_and_round_trip() {
    let dbus: BTreeSet<&str> = LimitKind::ALL.iter().map(|k| k.dbus_name()).collect();
    let ann: BTreeSet<&str> = LimitKind::ALL.iter().map(|k| k.annotation()).collect();
    assert_eq!(dbus.len(), LimitKind::ALL.len());
    assert_eq!(ann.len(), LimitKind::ALL.len());
    for k in LimitKind::ALL {
        assert_eq!(LimitKind::from_dbus_name(k.dbus_name()), Some(k));
        assert_eq!(LimitKind::from_annotation(k.annotation()), Some(k));
        // The annotation is the D-Bus name in kebab case.
        assert_eq!(k.annotation().replace('-', "_"), k.dbus_name());
    }
    assert_eq!(LimitKind::from_dbus_name("memory-max"), None);
    assert_eq!(LimitKind::from_annotation("memory_max"), None);
    assert_eq!(
        dbus_names(),
        "memory_max, compute_max, compute_min, compute_weight, priority"
    );
}

#[test]
fn priorities_by_name_and_number() {
    for p in Priority::ALL {
        assert_eq!(p.as_str().parse::<Priority>(), Ok(p));
        assert_eq!(Priority::from_index(p.index()), Some(p));
    }
    assert_eq!(Priority::LatencyCritical.index(), 0);
    assert_eq!(Priority::BestEffort.index(), 2);
    assert_eq!(Priority::from_index(3), None);
    assert_eq!(
        "Normal".parse::<Priority>().map_err(|e| e.to_string()),
        Err("\"Normal\" is not a priority (latency-critical, normal, best-effort)".to_owned())
    );
}

/// Text values: (limit, text, value).
#[test]
#[rustfmt::skip]
fn valid_text() {
    use LimitKind::*;
    use LimitValue::{Number as N, Priority as P};
    let cases: Vec<(LimitKind, &str, LimitValue)> = vec![
        (MemoryMax,     "8Gi",              N(8 << 30)),
        (MemoryMax,     " 2G ",             N(2_000_000_000)),
        (MemoryMax,     "1",                N(1)),
        (MemoryMax,     "1073741824",       N(1 << 30)),
        (ComputeMax,    "30",               N(30)),
        (ComputeMax,    " 100 ",            N(100)),
        (ComputeMax,    "+30",              N(30)),
        (ComputeMin,    "1",                N(1)),
        (ComputeWeight, "10000",            N(10_000)),
        (Priority,      "latency-critical", P(super::Priority::LatencyCritical)),
        (Priority,      " best-effort",     P(super::Priority::BestEffort)),
    ];
    for (kind, text, want) in cases {
        assert_eq!(kind.parse(text), Ok(want), "{kind} {text:?}");
    }
}

/// Invalid text: (limit, text, words the message must contain).
#[test]
#[rustfmt::skip]
fn invalid_text() {
    use LimitKind::*;
    let cases: Vec<(LimitKind, &str, &str)> = vec![
        (MemoryMax,     "",                        "\"\" is not a byte quantity"),
        (MemoryMax,     "0",                       "0 bytes"),
        (MemoryMax,     "0Gi",                     "0 bytes"),
        (MemoryMax,     "8GB",                     "unknown suffix \"GB\""),
        (MemoryMax,     "-1",                      "not a byte quantity"),
        (MemoryMax,     "2000000Ti",               "larger than gpud accepts (1152921504606846976)"),
        (MemoryMax,     "99999999999999999999",    "too large"),
        (ComputeMax,    "0",                       "0 is outside 1..=100"),
        (ComputeMax,    "101",                     "outside 1..=100"),
        (ComputeMax,    "-5",                      "-5 is outside 1..=100"),
        (ComputeMax,    "30%",                     "\"30%\" is not a whole number (compute_max is 1..=100)"),
        (ComputeMax,    "",                        "not a whole number"),
        (ComputeMin,    "1000",                    "outside 1..=100"),
        (ComputeWeight, "0",                       "outside 1..=10000"),
        (ComputeWeight, "1.5",                     "not a whole number (compute_weight is 1..=10000)"),
        (Priority,      "high",                    "\"high\" is not a priority (latency-critical, normal, best-effort)"),
        (Priority,      "",                        "is not a priority"),
    ];
    for (kind, text, words) in cases {
        match kind.parse(text) {
            Ok(v) => panic!("{kind} {text:?} accepted as {v:?}"),
            Err(e) => assert!(e.to_string().contains(words), "{kind} {text:?}: {e} lacks {words:?}"),
        }
    }
}

#[test]
fn values_built_in_code_are_checked() {
    assert!(LimitKind::ComputeMax.check(&LimitValue::Number(30)).is_ok());
    assert!(LimitKind::ComputeMax.check(&LimitValue::Number(0)).is_err());
    assert!(
        LimitKind::MemoryMax
            .check(&LimitValue::Number(MAX_BYTES + 1))
            .is_err()
    );
    assert!(
        LimitKind::ComputeMax
            .check(&LimitValue::Priority(Priority::Normal))
            .is_err()
    );
    assert!(LimitKind::Priority.check(&LimitValue::Number(1)).is_err());
    let mut set = LimitSet::new();
    assert!(
        set.insert(LimitKind::ComputeMin, LimitValue::Number(50))
            .is_ok()
    );
    assert!(
        set.insert(LimitKind::ComputeMax, LimitValue::Number(40))
            .is_ok()
    );
    assert_eq!(
        set.check_min_max().map_err(|e| e.to_string()),
        Err("limit compute_min: 50 is above compute_max 40".to_owned())
    );
    assert!(
        set.insert(LimitKind::ComputeWeight, LimitValue::Number(0))
            .is_err()
    );
    assert_eq!(set.len(), 2, "a refused value is not set");
}

#[test]
fn rendered_values_parse_back() {
    for (kind, value, text) in [
        (LimitKind::MemoryMax, LimitValue::Number(8 << 30), "8Gi"),
        (
            LimitKind::MemoryMax,
            LimitValue::Number(1_500_000_000),
            "1500000000",
        ),
        (LimitKind::ComputeWeight, LimitValue::Number(300), "300"),
        (
            LimitKind::Priority,
            LimitValue::Priority(Priority::BestEffort),
            "best-effort",
        ),
    ] {
        assert_eq!(kind.render(&value), text);
        assert_eq!(kind.parse(text), Ok(value));
    }
}

/// Fuzz targets (`cargo xtask fuzz`): limit values of any text.
mod fuzz {
    use super::*;

    proptest! {
        /// Any text for any limit is a value in the limit's range or a message; nothing panics;
        /// an accepted value renders to text that parses back to it.
        #[test]
        fn any_value_is_in_range_or_refused(k in 0usize..LimitKind::ALL.len(), text in prop_oneof![
            "(?s).{0,300}",
            "[ ]?[+-]?[0-9]{0,22}(Ki|Mi|Gi|Ti|k|M|G|T|%)?[ ]?",
            "[ ]?(latency-critical|normal|best-effort)[ ]?",
        ]) {
            let kind = LimitKind::ALL[k];
            if let Ok(value) = kind.parse(&text) {
                prop_assert!(kind.check(&value).is_ok(), "{kind} {text:?}: {value:?}");
                prop_assert_eq!(kind.parse(&kind.render(&value)), Ok(value));
            }
        }
    }
}
