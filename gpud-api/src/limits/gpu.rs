//! GPU selectors: which GPUs a limit applies to (`SetLimits`' `gpu` argument, the suffix of an
//! annotation key, gpudctl's `--gpu`).

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Highest GPU index the NVIDIA driver gives (its device minors `/dev/nvidia0` to
/// `/dev/nvidia247`; 255 is the control device). The daemon checks it against gpud-common's
/// `NV_GPU_MINOR_MAX`, the number the probes decode with.
pub const MAX_GPU_INDEX: u32 = 247;

/// A text that is not a GPU selector (quoted, at most 80 characters).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid GPU {0:?}: expected \"all\", an index (0, 1, ...) or a UUID (GPU-..., MIG-...)")]
pub struct InvalidGpu(pub String);

/// Which GPUs a limit applies to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GpuSelector {
    /// The sum over all GPUs.
    All,
    /// One GPU by index (the RM device instance, as `nvidia-smi` numbers them).
    Index(u32),
    /// One GPU (or MIG device) by UUID, resolved to an index where NVML is available.
    Uuid(String),
}

impl FromStr for GpuSelector {
    type Err = InvalidGpu;
    /// Exact forms only: `all` (any case), an index in decimal digits (no sign or space), or
    /// `GPU-`/`MIG-` and hex digits. Anything else, `" 0"` included, is refused rather than read
    /// as something the caller may not have meant.
    fn from_str(t: &str) -> Result<Self, Self::Err> {
        if t.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        if !t.is_empty() && t.len() <= 3 && t.bytes().all(|b| b.is_ascii_digit()) {
            let i: u32 = t.parse().map_err(|_| InvalidGpu(t.into()))?;
            if i <= MAX_GPU_INDEX {
                return Ok(Self::Index(i));
            }
        }
        let is_uuid = (t.starts_with("GPU-") || t.starts_with("MIG-"))
            && t.len() <= 64
            && t[4..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b'-' || b == b'/');
        if is_uuid && t.len() > 4 {
            return Ok(Self::Uuid(t.to_owned()));
        }
        Err(InvalidGpu(t.chars().take(80).collect()))
    }
}

impl std::fmt::Display for GpuSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Index(i) => write!(f, "{i}"),
            Self::Uuid(u) => f.write_str(u),
        }
    }
}

/// As its text (`"all"`, `"0"`, `"GPU-…"`), e.g. in the daemon's `limits.json`.
impl Serialize for GpuSelector {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GpuSelector {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_selectors() {
        assert_eq!("all".parse::<GpuSelector>().ok(), Some(GpuSelector::All));
        assert_eq!("ALL".parse::<GpuSelector>().ok(), Some(GpuSelector::All));
        assert_eq!("0".parse::<GpuSelector>().ok(), Some(GpuSelector::Index(0)));
        assert_eq!(
            "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42"
                .parse::<GpuSelector>()
                .ok(),
            Some(GpuSelector::Uuid(
                "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42".into()
            ))
        );
        for bad in [
            "",
            "-1",
            "248",
            "99999999999",
            "GPU-",
            "gpu0",
            "GPU-xyz",
            "1.5",
            " 0",
            "0 ",
            "+1",
            " all",
            "GPU-0f0b13fe ",
        ] {
            assert!(bad.parse::<GpuSelector>().is_err(), "{bad:?}");
        }
    }
}

/// Fuzz targets (`cargo xtask fuzz`): GPU selectors of any text.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any text is a selector or `InvalidGpu`; an accepted one prints as text that parses
        /// back to it.
        #[test]
        fn any_gpu_selector_round_trips_or_is_invalid(text in prop_oneof![
            "(?s).{0,70}",
            "(GPU|MIG|gpu)-[0-9a-fA-F/-]{0,64}",
            "[ ]?[0-9]{1,4}[ ]?",
            "[aA][lL][lL]",
        ]) {
            if let Ok(sel) = text.parse::<GpuSelector>() {
                let printed = sel.to_string();
                prop_assert_eq!(printed.parse::<GpuSelector>().ok(), Some(sel.clone()));
                if let GpuSelector::Index(i) = sel {
                    prop_assert!(i <= MAX_GPU_INDEX);
                }
            }
        }

        /// Every GPU index the driver can have round-trips; the next one is refused.
        #[test]
        fn gpu_indexes_round_trip(i in 0u32..=MAX_GPU_INDEX + 8) {
            let sel = i.to_string().parse::<GpuSelector>();
            if i <= MAX_GPU_INDEX {
                prop_assert_eq!(sel.ok(), Some(GpuSelector::Index(i)));
            } else {
                prop_assert!(sel.is_err());
            }
        }
    }
}
