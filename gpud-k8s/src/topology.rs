//! How closely the node's GPUs are joined, read from NVML on the node (nvml-wrapper): NVLinks
//! between two GPUs (`nvmlDeviceGetNvLinkState`, `nvmlDeviceGetNvLinkRemotePciInfo_v2`) and
//! their closest common PCIe ancestor (`nvmlDeviceGetTopologyCommonAncestor`). Placement uses it
//! to keep a multi-GPU container on GPUs that talk fast to each other.
//!
//! gpud's D-Bus records carry no topology on purpose (the daemon has no use for it); the plugin
//! runs on the node and asks NVML itself. Without NVML the topology is unknown and placement falls
//! back to GPU order.

use std::{collections::BTreeMap, path::Path};

use nvml_wrapper::{Nvml, enum_wrappers::device::TopologyLevel, error::NvmlError};

/// NVML's `NVML_NVLINK_MAX_LINKS`: links per GPU asked about.
const NVLINK_MAX_LINKS: u32 = 18;

/// Topology cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("NVML ({library}): {source}")]
    Nvml {
        library: String,
        #[source]
        source: NvmlError,
    },
}

/// The link between two GPUs, closest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Link {
    /// Joined by this many active NVLinks (directly or through NVSwitches).
    NvLink(u32),
    /// Through one PCIe switch.
    PcieSwitch,
    /// Through several PCIe switches.
    PcieSwitches,
    /// Through one PCIe host bridge.
    HostBridge,
    /// Within one NUMA node.
    NumaNode,
    /// Across NUMA nodes (SMP interconnect).
    System,
}

impl Link {
    /// Higher is closer; 0 is unknown.
    pub fn score(self) -> u32 {
        match self {
            Self::NvLink(n) => 1000 + n.min(100),
            Self::PcieSwitch => 500,
            Self::PcieSwitches => 400,
            Self::HostBridge => 300,
            Self::NumaNode => 200,
            Self::System => 100,
        }
    }
}

/// Links between pairs of GPUs (by UUID) and each GPU's NUMA node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Topology {
    links: BTreeMap<(String, String), Link>,
    pub numa: BTreeMap<String, u32>,
}

impl Topology {
    /// Records the link between `a` and `b` (either order).
    pub fn insert(&mut self, a: &str, b: &str, link: Link) {
        self.links.insert(Self::key(a, b), link);
    }

    fn key(a: &str, b: &str) -> (String, String) {
        if a <= b {
            (a.to_owned(), b.to_owned())
        } else {
            (b.to_owned(), a.to_owned())
        }
    }

    pub fn link(&self, a: &str, b: &str) -> Option<Link> {
        self.links.get(&Self::key(a, b)).copied()
    }

    /// Closeness of two GPUs: [`Link::score`], the most for the same GPU, 0 if unknown.
    pub fn score(&self, a: &str, b: &str) -> u32 {
        if a == b {
            return u32::MAX / 4;
        }
        self.link(a, b).map_or(0, Link::score)
    }

    /// Pairs of GPUs whose link is known.
    pub fn links_known(&self) -> usize {
        self.links.len()
    }

    /// Reads the topology of every GPU NVML lists, from the library at `library` (default: the
    /// system's libnvidia-ml).
    pub fn read(library: Option<&Path>) -> Result<Self, TopologyError> {
        let lib_name =
            library.map_or_else(|| "libnvidia-ml.so.1".into(), |p| p.display().to_string());
        let err = |source| TopologyError::Nvml {
            library: lib_name.clone(),
            source,
        };
        let nvml = match library {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::init(),
        }
        .map_err(err)?;
        let count = nvml.device_count().map_err(err)?;
        // (uuid, PCI bus id) of every GPU, by index.
        let mut gpus = Vec::new();
        for i in 0..count {
            let d = nvml.device_by_index(i).map_err(err)?;
            let uuid = d.uuid().map_err(err)?;
            let bus = d.pci_info().map_err(err)?.bus_id;
            gpus.push((uuid, normalize_bus_id(&bus)));
        }
        let by_bus: BTreeMap<&str, &str> =
            gpus.iter().map(|(u, b)| (b.as_str(), u.as_str())).collect();
        let mut topo = Topology::default();
        // NVLinks per GPU: to each peer GPU, and to switches (NVSwitch fabrics).
        let mut peers: Vec<BTreeMap<String, u32>> = Vec::new();
        let mut fabric: Vec<u32> = Vec::new();
        for i in 0..count {
            let d = nvml.device_by_index(i).map_err(err)?;
            if let Ok(n) = d.numa_node_id() {
                topo.numa.insert(gpus[i as usize].0.clone(), n);
            }
            let mut to_gpu = BTreeMap::new();
            let mut to_switch = 0;
            for link in 0..NVLINK_MAX_LINKS {
                let l = d.link_wrapper_for(link);
                match l.is_active() {
                    Ok(true) => {}
                    Ok(false) => continue,
                    // No NVLink on this GPU, or no more links.
                    Err(_) => break,
                }
                match l.remote_pci_info() {
                    Ok(pci) => match by_bus.get(normalize_bus_id(&pci.bus_id).as_str()) {
                        Some(peer) => *to_gpu.entry((*peer).to_owned()).or_insert(0) += 1,
                        None => to_switch += 1,
                    },
                    Err(e) => tracing::debug!("NVLink {link} of GPU {i}: remote end: {e}"),
                }
            }
            peers.push(to_gpu);
            fabric.push(to_switch);
        }
        for i in 0..gpus.len() {
            for j in (i + 1)..gpus.len() {
                let (a, b) = (&gpus[i].0, &gpus[j].0);
                let direct = peers[i].get(b).copied().unwrap_or(0);
                let switched = fabric[i].min(fabric[j]);
                let link = if direct + switched > 0 {
                    Link::NvLink(direct + switched)
                } else {
                    let da = nvml.device_by_index(i as u32).map_err(err)?;
                    let db = nvml.device_by_index(j as u32).map_err(err)?;
                    match da.topology_common_ancestor(db) {
                        Ok(level) => pcie_link(level),
                        Err(e) => {
                            tracing::debug!("common ancestor of {a} and {b}: {e}");
                            continue;
                        }
                    }
                };
                topo.insert(a, b, link);
            }
        }
        Ok(topo)
    }
}

fn pcie_link(level: TopologyLevel) -> Link {
    match level {
        TopologyLevel::Internal | TopologyLevel::Single => Link::PcieSwitch,
        TopologyLevel::Multiple => Link::PcieSwitches,
        TopologyLevel::HostBridge => Link::HostBridge,
        TopologyLevel::Node => Link::NumaNode,
        TopologyLevel::System => Link::System,
    }
}

/// PCI bus ids as NVML writes them differ in case and in the width of the domain
/// (`00000000:07:00.0`, `0000:07:00.0`): compared as lower-case bus:device.function with the
/// domain as a number.
fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) => {
            let d = u32::from_str_radix(domain, 16).unwrap_or(0);
            format!("{d:x}:{rest}")
        }
        None => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_symmetric_and_ordered_by_closeness() {
        let mut t = Topology::default();
        t.insert("GPU-b", "GPU-a", Link::NvLink(4));
        t.insert("GPU-a", "GPU-c", Link::System);
        assert_eq!(t.link("GPU-a", "GPU-b"), Some(Link::NvLink(4)));
        assert!(t.score("GPU-a", "GPU-b") > t.score("GPU-a", "GPU-c"));
        assert!(Link::NvLink(1).score() > Link::PcieSwitch.score());
        assert!(Link::NumaNode.score() > Link::System.score());
        assert_eq!(t.score("GPU-b", "GPU-c"), 0, "unknown");
        assert_eq!(
            normalize_bus_id("00000000:07:00.0"),
            normalize_bus_id("0000:07:00.0")
        );
        assert_eq!(normalize_bus_id("0000:0A:00.0"), "0:0a:00.0");
    }
}
