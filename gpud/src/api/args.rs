//! Arguments of D-Bus calls as they were sent, before the core validates them.

use std::fmt;

use serde::{
    Deserialize, Deserializer,
    de::{MapAccess, Visitor},
};
use zbus::{Signature, Type, Variant};

use crate::policy::LimitValueIn;

/// Longest string argument accepted; longer ones are refused before any work.
pub const MAX_ARG_LEN: usize = 4096;

/// A `limits` dictionary (`a{sv}`) in the order sent, repeated keys kept. A map type would keep
/// only the last of a repeated key, so `{compute_max: u 101, compute_max: t 100}` would silently
/// drop the invalid first value; the policy refuses any repeat instead.
#[derive(Debug, Default, PartialEq)]
pub struct LimitArgs(pub Vec<(String, LimitValueIn)>);

impl Type for LimitArgs {
    const SIGNATURE: &'static Signature =
        &Signature::static_dict(&Signature::Str, &Signature::Variant);
}

impl<'de> Deserialize<'de> for LimitArgs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = LimitArgs;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a dictionary of limit names to values (a{sv})")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LimitArgs, A::Error> {
                let mut out = Vec::new();
                while let Some((name, value)) = map.next_entry::<String, Variant<'_>>()? {
                    out.push((
                        name.chars().take(MAX_ARG_LEN).collect(),
                        limit_value(&value),
                    ));
                }
                Ok(LimitArgs(out))
            }
        }
        d.deserialize_map(Entries)
    }
}

/// The policy's view of a D-Bus value: integers of any width, strings (bounded), and the
/// signature of anything else (so the error can name the type sent).
pub fn limit_value(v: &Variant<'_>) -> LimitValueIn {
    use Variant as V;
    match v {
        V::U64(n) => LimitValueIn::Unsigned(*n),
        V::U32(n) => LimitValueIn::Unsigned(u64::from(*n)),
        V::U16(n) => LimitValueIn::Unsigned(u64::from(*n)),
        V::U8(n) => LimitValueIn::Unsigned(u64::from(*n)),
        V::I64(n) => LimitValueIn::Signed(*n),
        V::I32(n) => LimitValueIn::Signed(i64::from(*n)),
        V::I16(n) => LimitValueIn::Signed(i64::from(*n)),
        V::Str(s) => LimitValueIn::Text(s.as_str().chars().take(MAX_ARG_LEN).collect()),
        V::Variant(inner) => limit_value(inner),
        other => LimitValueIn::Other(other.value_signature().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use serde::{Serialize, Serializer, ser::SerializeMap};
    use zbus::wire::{Endian, serialized::Context, to_bytes};

    use super::*;

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
        const SIGNATURE: &'static Signature = LimitArgs::SIGNATURE;
    }

    #[test]
    fn repeated_keys_survive_decoding_in_order() {
        let ctxt = Context::new(Endian::Little, 0);
        let sent = Repeated(vec![
            ("compute_max", Variant::from(101u32)),
            ("compute_max", Variant::from(100u64)),
            ("memory_max", Variant::from("1Gi")),
        ]);
        let bytes = to_bytes(ctxt, &sent).expect("encode");
        let (got, _): (LimitArgs, _) = bytes.deserialize().expect("decode");
        assert_eq!(
            got.0,
            vec![
                ("compute_max".to_owned(), LimitValueIn::Unsigned(101)),
                ("compute_max".to_owned(), LimitValueIn::Unsigned(100)),
                ("memory_max".to_owned(), LimitValueIn::Text("1Gi".into())),
            ]
        );
    }
}
