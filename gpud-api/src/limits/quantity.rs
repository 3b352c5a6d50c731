//! Byte quantities as people write them (`8Gi`, `512Mi`, `2G`): in D-Bus strings, annotations and
//! gpudctl's flags, and as annotations are written back.

/// Largest accepted byte value: far above any GPU, and far from overflowing when usage is added.
pub const MAX_BYTES: u64 = 1 << 60;

/// The suffixes a quantity may carry, with their multipliers.
const SUFFIXES: [(&str, u64); 8] = [
    ("Ki", 1 << 10),
    ("Mi", 1 << 20),
    ("Gi", 1 << 30),
    ("Ti", 1 << 40),
    ("k", 1_000),
    ("M", 1_000_000),
    ("G", 1_000_000_000),
    ("T", 1_000_000_000_000),
];

/// A text that is not a byte quantity; the message quotes it (at most 80 characters).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// No leading digits.
    #[error("{0:?} is not a byte quantity")]
    NotAQuantity(String),
    /// The number, or number times suffix, does not fit in 64 bits.
    #[error("{0:?} is too large")]
    TooLarge(String),
    /// Something after the digits that is not one of the suffixes.
    #[error("unknown suffix {suffix:?} in {text:?} (use Ki, Mi, Gi, Ti, k, M, G, T)")]
    UnknownSuffix {
        /// What followed the digits.
        suffix: String,
        /// The whole text.
        text: String,
    },
}

/// Parses a byte quantity: plain bytes or a Kubernetes-style suffix (Ki, Mi, Gi, Ti; k, M, G, T),
/// surrounding whitespace ignored. Zero and values above [`MAX_BYTES`] are quantities too: whether
/// they make a limit is [`super::LimitKind::MemoryMax`]'s check.
pub fn parse_quantity(text: &str) -> Result<u64, QuantityError> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(QuantityError::NotAQuantity(truncate(text)));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| QuantityError::TooLarge(truncate(text)))?;
    let mult = if suffix.is_empty() {
        1
    } else {
        SUFFIXES
            .iter()
            .find(|(s, _)| *s == suffix)
            .map(|(_, m)| *m)
            .ok_or_else(|| QuantityError::UnknownSuffix {
                suffix: truncate(suffix),
                text: truncate(text),
            })?
    };
    n.checked_mul(mult)
        .ok_or_else(|| QuantityError::TooLarge(truncate(text)))
}

/// Bytes with the largest binary suffix that divides them exactly (`8Gi`), else plain bytes: what
/// [`parse_quantity`] reads back as the same number.
pub fn render_quantity(n: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")];
    UNITS
        .iter()
        .find(|(shift, _)| n != 0 && n.trailing_zeros() >= *shift)
        .map_or_else(|| n.to_string(), |(shift, u)| format!("{}{u}", n >> shift))
}

/// At most 80 characters of a value quoted in an error.
pub(super) fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("8Gi"), Ok(8 << 30));
        assert_eq!(parse_quantity("512Mi"), Ok(512 << 20));
        assert_eq!(parse_quantity("1000"), Ok(1000));
        assert_eq!(parse_quantity("2G"), Ok(2_000_000_000));
        assert_eq!(parse_quantity(" 100k\t"), Ok(100_000));
        for bad in [
            "",
            "Gi",
            "8 GiB",
            "-1",
            "1.5Gi",
            "99999999999999999999",
            "16384Ti0",
        ] {
            assert!(parse_quantity(bad).is_err(), "{bad:?}");
        }
        assert!(parse_quantity("17179869184Ti").is_err(), "overflow");
        assert_eq!(
            parse_quantity("8GB").map_err(|e| e.to_string()),
            Err("unknown suffix \"GB\" in \"8GB\" (use Ki, Mi, Gi, Ti, k, M, G, T)".to_owned())
        );
    }

    #[test]
    fn rendered_in_the_largest_binary_unit() {
        assert_eq!(render_quantity(8 << 30), "8Gi");
        assert_eq!(render_quantity(3 << 40), "3Ti");
        assert_eq!(render_quantity(1536 << 20), "1536Mi");
        assert_eq!(render_quantity(1_500_000_000), "1500000000");
        assert_eq!(render_quantity(0), "0");
    }
}

/// Fuzz targets (`cargo xtask fuzz`): quantities of any text.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    /// Every suffix and none.
    fn all_suffixes() -> Vec<(&'static str, u64)> {
        std::iter::once(("", 1)).chain(SUFFIXES).collect()
    }

    /// `bytes` in the largest unit that divides it, as a person would write it.
    fn format_quantity(bytes: u64) -> String {
        all_suffixes()
            .into_iter()
            .filter(|(_, m)| bytes != 0 && bytes.is_multiple_of(*m))
            .max_by_key(|(_, m)| *m)
            .map_or_else(|| bytes.to_string(), |(s, m)| format!("{}{s}", bytes / m))
    }

    proptest! {
        /// Any text is a byte count or a message; nothing panics.
        #[test]
        fn any_quantity_text_never_panics(text in "(?s).{0,64}") {
            if let Ok(n) = parse_quantity(&text) {
                let t = text.trim();
                prop_assert!(t.starts_with(|c: char| c.is_ascii_digit()), "{text:?} -> {n}");
            }
        }

        /// Number and suffix give their exact product, or an error where it overflows (never a
        /// wrapped value).
        #[test]
        fn quantities_multiply_exactly_or_overflow(n in any::<u64>(), s in 0usize..=SUFFIXES.len(), pad in "[ \t]{0,2}") {
            let (suffix, mult) = all_suffixes()[s];
            let got = parse_quantity(&format!("{pad}{n}{suffix}{pad}"));
            match n.checked_mul(mult) {
                Some(want) => prop_assert_eq!(got, Ok(want)),
                None => prop_assert!(matches!(got, Err(QuantityError::TooLarge(_)))),
            }
        }

        /// A formatted quantity parses back to the same bytes, and so does a rendered one.
        #[test]
        fn formatted_quantities_round_trip(bytes in prop_oneof![
            any::<u64>(),
            (any::<u32>(), 0u32..5).prop_map(|(n, p)| u64::from(n) << (10 * p)),
            (any::<u32>(), 0u32..5).prop_map(|(n, p)| u64::from(n).saturating_mul(1000u64.pow(p))),
        ]) {
            let text = format_quantity(bytes);
            prop_assert_eq!(parse_quantity(&text), Ok(bytes), "{}", text);
            let rendered = render_quantity(bytes);
            prop_assert_eq!(parse_quantity(&rendered), Ok(bytes), "{}", rendered);
        }
    }
}
