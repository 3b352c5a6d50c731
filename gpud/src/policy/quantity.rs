//! Byte quantities as people write them (`8Gi`, `512Mi`, `2G`), in D-Bus values and annotations.

/// Largest accepted byte value: far above any GPU, and far from overflowing when usage is added.
pub const MAX_BYTES: u64 = 1 << 60;

/// Parses a byte quantity: plain bytes or a Kubernetes-style suffix (Ki, Mi, Gi, Ti; k, M, G, T).
pub fn parse_quantity(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!("{:?} is not a byte quantity", truncate(text)));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{:?} is too large", truncate(text)))?;
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown suffix {:?} in {:?} (use Ki, Mi, Gi, Ti, k, M, G, T)",
                truncate(other),
                truncate(text)
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{:?} is too large", truncate(text)))
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
    }
}

/// Fuzz targets (`cargo xtask fuzz`): quantities of any text.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    const SUFFIXES: [(&str, u64); 9] = [
        ("", 1),
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];

    /// `bytes` in the largest unit that divides it, as a person would write it.
    fn format_quantity(bytes: u64) -> String {
        SUFFIXES
            .iter()
            .rev()
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
        fn quantities_multiply_exactly_or_overflow(n in any::<u64>(), s in 0usize..SUFFIXES.len(), pad in "[ \t]{0,2}") {
            let (suffix, mult) = SUFFIXES[s];
            let got = parse_quantity(&format!("{pad}{n}{suffix}{pad}"));
            match n.checked_mul(mult) {
                Some(want) => prop_assert_eq!(got, Ok(want)),
                None => prop_assert!(got.is_err_and(|e| e.contains("too large"))),
            }
        }

        /// A formatted quantity parses back to the same bytes.
        #[test]
        fn formatted_quantities_round_trip(bytes in prop_oneof![
            any::<u64>(),
            (any::<u32>(), 0u32..5).prop_map(|(n, p)| u64::from(n) << (10 * p)),
            (any::<u32>(), 0u32..5).prop_map(|(n, p)| u64::from(n).saturating_mul(1000u64.pow(p))),
        ]) {
            let text = format_quantity(bytes);
            prop_assert_eq!(parse_quantity(&text), Ok(bytes), "{}", text);
        }
    }
}
