//! The limits as a D-Bus dictionary (`a{sv}`, `SetLimits`' `limits`): decoded straight into
//! typed values ([`LimitDict`], [`LimitKind::decode`]) and encoded from them ([`to_dict`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use serde::{
    Deserialize, Deserializer,
    de::{MapAccess, Visitor},
};
use zbus::{Signature, Type, Variant};

use super::{LimitError, LimitKind, LimitSet, LimitValue, ValueError, ValueType, truncate};

impl LimitKind {
    /// A value of this limit as sent on D-Bus: an integer of any width (bytes, percent,
    /// weight), a string read as [`LimitKind::parse`] reads text, or a variant holding one.
    pub fn decode(self, value: &Variant<'_>) -> Result<LimitValue, ValueError> {
        use Variant as V;
        let n = match value {
            V::U64(n) => i128::from(*n),
            V::U32(n) => i128::from(*n),
            V::U16(n) => i128::from(*n),
            V::U8(n) => i128::from(*n),
            V::I64(n) => i128::from(*n),
            V::I32(n) => i128::from(*n),
            V::I16(n) => i128::from(*n),
            V::Str(s) => return self.parse(s.as_str()),
            V::Variant(inner) => return self.decode(inner),
            other => {
                return Err(ValueError::WrongType {
                    kind: self,
                    got: other.value_signature().to_string(),
                });
            }
        };
        if self.value_type() == ValueType::Priority {
            return Err(ValueError::WrongType {
                kind: self,
                got: value.value_signature().to_string(),
            });
        }
        self.check_integer(n)
    }

    /// The value as sent on D-Bus: numbers as `t`, priorities by name as `s`.
    pub fn encode(self, value: &LimitValue) -> Variant<'static> {
        match value {
            LimitValue::Number(n) => Variant::from(*n),
            LimitValue::Priority(p) => Variant::from(p.as_str()),
        }
    }
}

/// The `limits` dictionary of a `SetLimits` call, keyed by D-Bus name ([`LimitKind::encode`]).
pub fn to_dict<'a>(
    limits: impl IntoIterator<Item = (LimitKind, &'a LimitValue)>,
) -> BTreeMap<&'static str, Variant<'static>> {
    limits
        .into_iter()
        .map(|(kind, value)| (kind.dbus_name(), kind.encode(value)))
        .collect()
}

impl LimitSet {
    /// The `limits` dictionary of a `SetLimits` call.
    pub fn to_dict(&self) -> BTreeMap<&'static str, Variant<'static>> {
        to_dict(self.iter())
    }
}

/// `SetLimits`' `limits` argument (`a{sv}`), decoded as it arrives: every entry straight into
/// its kind and typed value, in the order sent, repeated names kept (a map type would keep only
/// the last of a repeated key, and so silently drop the first, valid or not).
///
/// Decoding never fails the message (zbus would answer `org.freedesktop.DBus.Error.InvalidArgs`
/// before the daemon sees the call): what is wrong is kept for [`LimitDict::into_result`], which
/// the daemon answers with `dev.gpud.Error.InvalidArgument`. Refused, in this order: a repeated
/// name, whatever its values; the first entry (as sent) with an unknown name or a value that is
/// not its limit's; an empty dictionary; a `compute_min` above the `compute_max` beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitDict(Result<LimitSet, LimitError>);

/// One entry as decoded, by its name as sent.
type Decoded = (String, Result<(LimitKind, LimitValue), LimitError>);

impl LimitDict {
    /// The limits, or why they cannot be set.
    pub fn into_result(self) -> Result<LimitSet, LimitError> {
        self.0
    }

    fn from_entries(entries: Vec<Decoded>) -> Self {
        Self(Self::validate(entries))
    }

    fn validate(entries: Vec<Decoded>) -> Result<LimitSet, LimitError> {
        // Repeats first: a repeated name is ambiguous whatever its values (the first may be the
        // invalid one).
        let mut seen = BTreeSet::new();
        if let Some((name, _)) = entries.iter().find(|(n, _)| !seen.insert(n.as_str())) {
            return Err(LimitError::Repeated(truncate(name)));
        }
        let mut set = LimitSet::new();
        for (_, decoded) in entries {
            let (kind, value) = decoded?;
            set.insert(kind, value)?;
        }
        if set.is_empty() {
            return Err(LimitError::Empty);
        }
        set.check_min_max()?;
        Ok(set)
    }
}

impl From<LimitSet> for LimitDict {
    fn from(set: LimitSet) -> Self {
        Self(Ok(set))
    }
}

impl Type for LimitDict {
    const SIGNATURE: &'static Signature =
        &Signature::static_dict(&Signature::Str, &Signature::Variant);
}

impl<'de> Deserialize<'de> for LimitDict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = LimitDict;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a dictionary of limit names to values (a{sv})")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LimitDict, A::Error> {
                let mut entries = Vec::new();
                while let Some((name, value)) = map.next_entry::<String, Variant<'_>>()? {
                    let decoded = match LimitKind::from_dbus_name(&name) {
                        None => Err(LimitError::Unknown(truncate(&name))),
                        Some(kind) => kind
                            .decode(&value)
                            .map(|v| (kind, v))
                            .map_err(|reason| LimitError::InvalidValue { kind, reason }),
                    };
                    entries.push((name, decoded));
                }
                Ok(LimitDict::from_entries(entries))
            }
        }
        d.deserialize_map(Entries)
    }
}

#[cfg(test)]
mod tests {
    use serde::{Serialize, Serializer, ser::SerializeMap};
    use zbus::wire::{serialized::Context, to_bytes};

    use super::*;
    use crate::limits::Priority;

    /// A dictionary that keeps repeated keys on the wire (what busctl or any other client may
    /// send; zbus's own map types cannot).
    struct Repeated(Vec<(&'static str, Variant<'static>)>);
    impl Serialize for Repeated {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut m = s.serialize_map(Some(self.0.len()))?;
            for (k, v) in &self.0 {
                m.serialize_entry(k, v)?;
            }
            m.end()
        }
    }
    impl Type for Repeated {
        const SIGNATURE: &'static Signature = LimitDict::SIGNATURE;
    }

    fn decode(entries: Vec<(&'static str, Variant<'static>)>) -> Result<LimitSet, LimitError> {
        let ctxt = Context::new(zbus::wire::Endian::Little, 0);
        let bytes = to_bytes(ctxt, &Repeated(entries)).expect("encode");
        let (got, _): (LimitDict, _) = bytes.deserialize().expect("decode");
        got.into_result()
    }

    #[test]
    fn a_dictionary_decodes_into_typed_values() {
        let set = decode(vec![
            ("memory_max", Variant::from("8Gi")),
            ("compute_max", Variant::from(30u32)),
            (
                "compute_min",
                Variant::Variant(Box::new(Variant::from(20i64))),
            ),
            ("compute_weight", Variant::from("300")),
            ("priority", Variant::from("best-effort")),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let got: Vec<(LimitKind, LimitValue)> = set.iter().map(|(k, v)| (k, v.clone())).collect();
        assert_eq!(
            got,
            vec![
                (LimitKind::MemoryMax, LimitValue::Number(8 << 30)),
                (LimitKind::ComputeMax, LimitValue::Number(30)),
                (LimitKind::ComputeMin, LimitValue::Number(20)),
                (LimitKind::ComputeWeight, LimitValue::Number(300)),
                (
                    LimitKind::Priority,
                    LimitValue::Priority(Priority::BestEffort)
                ),
            ]
        );
    }

    #[test]
    fn an_encoded_set_decodes_to_itself() {
        let mut set = LimitSet::new();
        for (kind, value) in [
            (LimitKind::MemoryMax, LimitValue::Number(1 << 30)),
            (LimitKind::ComputeMax, LimitValue::Number(30)),
            (
                LimitKind::Priority,
                LimitValue::Priority(Priority::BestEffort),
            ),
        ] {
            set.insert(kind, value).unwrap_or_else(|e| panic!("{e}"));
        }
        let dict = set.to_dict();
        assert_eq!(
            dict.keys().copied().collect::<Vec<_>>(),
            ["compute_max", "memory_max", "priority"]
        );
        assert_eq!(
            dict.get("memory_max"),
            Some(&Variant::from(1u64 << 30)),
            "bytes as t"
        );
        assert_eq!(dict.get("priority"), Some(&Variant::from("best-effort")));
        let entries = dict.into_iter().collect();
        assert_eq!(decode(entries), Ok(set));
    }

    /// Refusals, with words the message must contain.
    #[test]
    #[rustfmt::skip]
    fn refusals() {
        let cases: Vec<(Vec<(&'static str, Variant<'static>)>, &str)> = vec![
            (vec![], "no limits given"),
            (vec![("memory_maximum", Variant::from("1Gi"))], "unknown limit \"memory_maximum\" (known: memory_max, compute_max, compute_min, compute_weight, priority)"),
            (vec![("memory_max", Variant::from(true))], "limit memory_max: expected bytes as an unsigned integer (t) or a quantity string (s), got type b"),
            (vec![("memory_max", Variant::from(1.5f64))], "got type d"),
            (vec![("memory_max", Variant::from(vec![1u64]))], "got type at"),
            (vec![("memory_max", Variant::from(0u64))], "0 bytes"),
            (vec![("memory_max", Variant::from(-1i64))], "-1 is negative"),
            (vec![("memory_max", Variant::from(u64::MAX))], "larger than"),
            (vec![("memory_max", Variant::from("lots"))], "\"lots\" is not a byte quantity"),
            (vec![("compute_max", Variant::from(0u32))], "limit compute_max: 0 is outside 1..=100"),
            (vec![("compute_max", Variant::from(-5i32))], "-5 is outside 1..=100"),
            (vec![("compute_max", Variant::from("half"))], "\"half\" is not a whole number"),
            (vec![("compute_weight", Variant::from(10_001u32))], "outside 1..=10000"),
            (vec![("priority", Variant::from("urgent"))], "\"urgent\" is not a priority (latency-critical, normal, best-effort)"),
            (vec![("priority", Variant::from(1u32))], "expected a string: latency-critical, normal, best-effort, got type u"),
            (vec![("compute_max", Variant::from(30u32)), ("compute_min", Variant::from(40u32))], "limit compute_min: 40 is above compute_max 30"),
            // A repeated name is refused whatever its values: the first may be the invalid one.
            (vec![("compute_max", Variant::from(101u32)), ("compute_max", Variant::from(100u64))], "limit \"compute_max\" is given more than once"),
            (vec![("bogus", Variant::from(1u32)), ("bogus", Variant::from(1u32))], "\"bogus\" is given more than once"),
            // The first bad entry as sent is the one named.
            (vec![("memory_max", Variant::from("2Gi")), ("bogus", Variant::from(1u32)), ("compute_max", Variant::from(0u32))], "unknown limit \"bogus\""),
        ];
        for (entries, words) in cases {
            let shown = format!("{entries:?}");
            match decode(entries) {
                Ok(set) => panic!("{shown} accepted as {set:?}"),
                Err(e) => assert!(e.to_string().contains(words), "{shown}: {e:?} lacks {words:?}"),
            }
        }
    }
}

/// Fuzz targets (`cargo xtask fuzz`): dictionaries of any names, types and values as D-Bus
/// callers may send them.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    fn value() -> impl Strategy<Value = Variant<'static>> {
        prop_oneof![
            any::<u64>().prop_map(Variant::from),
            any::<i64>().prop_map(Variant::from),
            any::<u32>().prop_map(Variant::from),
            any::<i16>().prop_map(Variant::from),
            any::<bool>().prop_map(Variant::from),
            "\\PC{0,30}".prop_map(Variant::from),
            "[0-9]{1,22}(Ki|Mi|Gi|Ti|k|M|G|T)?".prop_map(Variant::from),
            "(latency-critical|normal|best-effort)".prop_map(Variant::from),
        ]
    }

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            proptest::sample::select(LimitKind::ALL.map(LimitKind::dbus_name).to_vec())
                .prop_map(str::to_owned),
            "\\PC{0,12}",
        ]
    }

    proptest! {
        /// Named values of any name, type and content are limits within range or a typed
        /// error; accepted limits carry exactly the names given.
        #[test]
        fn any_named_values_are_validated(entries in proptest::collection::vec((name(), value()), 0..6)) {
            let names: BTreeSet<String> = entries.iter().map(|(n, _)| n.clone()).collect();
            let repeated = names.len() != entries.len();
            let decoded = entries
                .into_iter()
                .map(|(name, value)| {
                    let d = match LimitKind::from_dbus_name(&name) {
                        None => Err(LimitError::Unknown(truncate(&name))),
                        Some(kind) => kind
                            .decode(&value)
                            .map(|v| (kind, v))
                            .map_err(|reason| LimitError::InvalidValue { kind, reason }),
                    };
                    (name, d)
                })
                .collect();
            match LimitDict::from_entries(decoded).into_result() {
                Ok(set) => {
                    prop_assert!(!repeated);
                    prop_assert_eq!(set.len(), names.len());
                    for (kind, value) in set.iter() {
                        prop_assert!(kind.check(value).is_ok(), "{kind}: {value:?}");
                        prop_assert!(names.contains(kind.dbus_name()));
                    }
                    prop_assert!(set.check_min_max().is_ok());
                }
                Err(LimitError::Repeated(_)) => prop_assert!(repeated),
                Err(_) => prop_assert!(!repeated),
            }
        }
    }
}
