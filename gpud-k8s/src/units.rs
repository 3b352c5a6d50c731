//! The two extended resources and their units: what a device ID names.
//!
//! The kubelet counts devices; gpud-k8s advertises each GPU (or MIG device) as many devices as it
//! has units of a resource: `gpud.dev/gpu-memory` in units of the configured granularity
//! (default 1 GiB), `gpud.dev/gpu-compute` in 1 % units. A device ID is `<uuid>::<n>`, the
//! GPU's (or MIG device's) UUID and the unit's number, so an ID says on which GPU it is and
//! survives restarts of the plugin and the kubelet (the kubelet checkpoints IDs).

use std::fmt;

/// The resources gpud-k8s advertises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// GPU memory, in units of the configured granularity.
    Memory,
    /// GPU time, in percent of one GPU.
    Compute,
}

impl Resource {
    pub const ALL: [Resource; 2] = [Resource::Memory, Resource::Compute];

    /// The extended resource name pods request.
    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "gpud.dev/gpu-memory",
            Self::Compute => "gpud.dev/gpu-compute",
        }
    }

    /// The plugin's socket file in the device-plugins directory.
    pub fn socket(self) -> &'static str {
        match self {
            Self::Memory => "gpud-gpu-memory.sock",
            Self::Compute => "gpud-gpu-compute.sock",
        }
    }

    /// The other resource of the pair.
    pub fn other(self) -> Self {
        match self {
            Self::Memory => Self::Compute,
            Self::Compute => Self::Memory,
        }
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Separates the UUID from the unit number in a device ID.
const SEPARATOR: &str = "::";

/// One unit of a resource on one GPU or MIG device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Unit {
    /// `GPU-…` or `MIG-…`.
    pub uuid: String,
    pub n: u32,
}

impl Unit {
    /// Parses a device ID; `None` for anything that is not `<GPU-…|MIG-…>::<n>`.
    pub fn parse(id: &str) -> Option<Self> {
        let (uuid, n) = id.rsplit_once(SEPARATOR)?;
        let uuid_ok = (uuid.starts_with("GPU-") || uuid.starts_with("MIG-")) && uuid.len() > 4;
        if !uuid_ok || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Self {
            uuid: uuid.to_owned(),
            n: n.parse().ok()?,
        })
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{SEPARATOR}{}", self.uuid, self.n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_round_trip_and_garbage_is_refused() {
        let u = Unit {
            uuid: "GPU-0f0b13fe-cea9-4935-ec40-fd1087fa9f42".into(),
            n: 17,
        };
        assert_eq!(Unit::parse(&u.to_string()), Some(u));
        let mig = Unit::parse("MIG-1234::0");
        assert_eq!(mig.map(|m| (m.uuid, m.n)), Some(("MIG-1234".into(), 0)));
        for bad in [
            "",
            "GPU-::1",
            "GPU-1",
            "GPU-1::",
            "GPU-1::x",
            "gpu0::1",
            "GPU-1::-1",
        ] {
            assert_eq!(Unit::parse(bad), None, "{bad:?}");
        }
    }
}
