//! Driver-native memory limits: where the NVIDIA driver charges video memory to the kernel's
//! `dmem` cgroup controller (the open module from the 610/615 series, on kernels with the
//! controller, 6.14+), each GPU's region is listed in the root's `dmem.capacity`, and a cgroup's
//! `dmem.max` makes the driver itself refuse an allocation past it
//! (`NV_ERR_RESOURCE_ACCOUNTING_HARD_LIMIT_EXCEEDED` in the allocation's status). gpud writes each
//! `memory_max` in force for a GPU (or for all) to that GPU's region, beside its own pre-driver
//! refusal, and clears it with the limit. This module owns those writes: what it wrote, so a sync
//! changes only what changed.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use gpud_common::GPU_ALL;

use crate::probes::caps::{DmemRegion, PciAddr};

/// A `dmem.max` write that failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {line:?} to {path}")]
pub struct DmemError {
    pub path: PathBuf,
    pub line: String,
    #[source]
    pub source: std::io::Error,
}

/// The `dmem.max` values gpud wrote, and the regions they go to.
pub struct DmemLimits {
    root: PathBuf,
    regions: Vec<DmemRegion>,
    /// (cgroup path, region name) → bytes written.
    written: BTreeMap<(String, String), u64>,
}

impl DmemLimits {
    /// `root`: the cgroup v2 mount point; `regions`: NVIDIA's, from `dmem.capacity`.
    pub fn new(root: &Path, regions: Vec<DmemRegion>) -> Self {
        Self {
            root: root.to_owned(),
            regions,
            written: BTreeMap::new(),
        }
    }

    pub fn regions(&self) -> &[DmemRegion] {
        &self.regions
    }

    /// Makes the written `dmem.max` values exactly those of `limits` (cgroup path, GPU index or
    /// `GPU_ALL`, bytes): a region gets the least limit naming its GPU or all GPUs; one gpud
    /// wrote that no limit names any more is set back to `max`. `pci_of` gives a GPU index's PCI
    /// address (NVML's); a GPU it does not know gets only the all-GPU limits. Returns the
    /// writes that failed (the rest are done).
    pub fn sync(
        &mut self,
        limits: impl IntoIterator<Item = (String, u32, u64)>,
        pci_of: impl Fn(u32) -> Option<PciAddr>,
    ) -> Vec<DmemError> {
        let mut want: BTreeMap<(String, String), u64> = BTreeMap::new();
        for (cgroup, gpu, bytes) in limits {
            let pci = (gpu != GPU_ALL).then(|| pci_of(gpu));
            for r in &self.regions {
                let names_it = match pci {
                    None => true,
                    Some(Some(addr)) => addr == r.pci,
                    Some(None) => false,
                };
                if names_it {
                    let slot = want
                        .entry((cgroup.clone(), r.name.clone()))
                        .or_insert(bytes);
                    *slot = (*slot).min(bytes);
                }
            }
        }
        let mut failed = Vec::new();
        let gone: Vec<(String, String)> = self
            .written
            .keys()
            .filter(|k| !want.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            match self.write(&key.0, &format!("{} max", key.1)) {
                // A cgroup removed since takes its dmem.max with it.
                Err(e) if e.source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    failed.push(e);
                    continue;
                }
                Ok(()) => {}
            }
            self.written.remove(&key);
        }
        for (key, bytes) in want {
            if self.written.get(&key) == Some(&bytes) {
                continue;
            }
            match self.write(&key.0, &format!("{} {bytes}", key.1)) {
                Ok(()) => {
                    self.written.insert(key, bytes);
                }
                Err(e) => failed.push(e),
            }
        }
        failed
    }

    fn write(&self, cgroup: &str, line: &str) -> Result<(), DmemError> {
        let path = self
            .root
            .join(cgroup.trim_start_matches('/'))
            .join("dmem.max");
        std::fs::write(&path, format!("{line}\n")).map_err(|source| DmemError {
            path,
            line: line.to_owned(),
            source,
        })
    }
}

/// A cgroup's `dmem.current` for GPU regions (`nvidia/…`, NVIDIA's open module; `drm/…`, a DRM
/// driver's): region name → bytes, what the driver itself charges the cgroup. Empty where the
/// file is absent (no controller, or not enabled for the cgroup).
pub fn current(root: &Path, cgroup: &str) -> BTreeMap<String, u64> {
    let path = root
        .join(cgroup.trim_start_matches('/'))
        .join("dmem.current");
    let Ok(text) = std::fs::read_to_string(path) else {
        return BTreeMap::new();
    };
    text.lines()
        .filter_map(|l| {
            let (name, v) = l.split_once(char::is_whitespace)?;
            let gpu = name.starts_with("nvidia/") || name.starts_with("drm/");
            gpu.then(|| Some((name.to_owned(), v.trim().parse().ok()?)))?
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &str, bus: u8) -> DmemRegion {
        DmemRegion {
            name: name.to_owned(),
            pci: PciAddr {
                domain: 0,
                bus,
                device: 0,
            },
            capacity: 80 << 30,
        }
    }

    /// The writes and the clears, on a directory standing in for the cgroup tree (no kernel
    /// here has the dmem controller: the files take the lines as written).
    #[test]
    fn limits_are_written_to_their_regions_and_cleared() -> std::io::Result<()> {
        let root = std::env::temp_dir().join(format!("gpud-dmem-max-{}", std::process::id()));
        for cg in ["a", "b/c"] {
            std::fs::create_dir_all(root.join(cg))?;
        }
        let (g0, g1) = (
            "nvidia/00000000:03:00.0/vidmem",
            "nvidia/00000000:04:00.0/vidmem",
        );
        let mut d = DmemLimits::new(&root, vec![region(g0, 3), region(g1, 4)]);
        let pci_of = |gpu: u32| {
            PciAddr::parse(match gpu {
                0 => "00000000:03:00.0",
                1 => "00000000:04:00.0",
                _ => return None,
            })
        };
        let read = |cg: &str| std::fs::read_to_string(root.join(cg).join("dmem.max"));
        // Per GPU: only that GPU's region; all GPUs: each region; the least wins.
        let failed = d.sync(
            [
                ("/a".to_owned(), 1, 8 << 30),
                ("/b/c".to_owned(), GPU_ALL, 16 << 30),
                ("/b/c".to_owned(), 0, 4 << 30),
                // A GPU NVML does not list: nothing written for it.
                ("/a".to_owned(), 7, 1 << 30),
            ],
            pci_of,
        );
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(read("a")?, format!("{g1} 8589934592\n"));
        // Two lines to one file: the test directory keeps the last; the kernel takes each.
        assert_eq!(read("b/c")?, format!("{g1} 17179869184\n"));
        assert_eq!(d.written.len(), 3);
        assert_eq!(d.written[&("/b/c".to_owned(), g0.to_owned())], 4 << 30);
        // Unchanged: nothing rewritten.
        std::fs::write(root.join("a/dmem.max"), "untouched")?;
        assert!(d.sync([("/a".to_owned(), 1, 8 << 30)], pci_of).is_empty());
        assert_eq!(read("a")?, "untouched");
        // Cleared: the region set back to max; a removed cgroup is forgotten quietly.
        std::fs::remove_dir_all(root.join("b"))?;
        assert!(d.sync([], pci_of).is_empty());
        assert_eq!(read("a")?, format!("{g1} max\n"));
        assert!(d.written.is_empty());
        // A failed write is reported and retried at the next sync.
        assert_eq!(d.sync([("/gone".to_owned(), 0, 1)], pci_of).len(), 1);
        assert!(d.written.is_empty());
        std::fs::write(
            root.join("a/dmem.current"),
            format!("{g0} 0\n{g1} 6291456\nttm/system 4096\n"),
        )?;
        assert_eq!(
            current(&root, "/a"),
            BTreeMap::from([(g0.to_owned(), 0), (g1.to_owned(), 6_291_456)])
        );
        assert!(current(&root, "/none").is_empty());
        std::fs::remove_dir_all(&root)
    }
}
