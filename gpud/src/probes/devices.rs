//! Which files are NVIDIA devices: the static major 195, the dynamic majors from `/proc/devices`,
//! and configured extra files identified by (device, inode).
//!
//! The kernel and userspace encode device numbers differently (`major << 20 | minor` inside the
//! kernel, glibc's split encoding in `st_dev`/`st_rdev`); conversions happen here, once.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use gpud_common::{DeviceKind, FileKey, kernel_mkdev, nv};

/// Why the NVIDIA device numbers or files could not be found. Display says what failed; the
/// cause is the error's source.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("devices.extra_paths: cannot stat {path}")]
    ExtraPath {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Dynamic majors of the NVIDIA modules, 0 where the module is not loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DynamicMajors {
    pub uvm: u32,
    pub caps: u32,
    pub caps_imex: u32,
}

impl DynamicMajors {
    /// Reads the "Character devices:" section of `/proc/devices`.
    pub fn read() -> Result<Self, DeviceError> {
        let path = Path::new("/proc/devices");
        let text = std::fs::read_to_string(path).map_err(|source| DeviceError::Read {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self::parse(&text))
    }

    pub fn parse(proc_devices: &str) -> Self {
        let mut majors = Self::default();
        let mut in_char = false;
        for line in proc_devices.lines() {
            let line = line.trim();
            if line.ends_with(':') {
                in_char = line == "Character devices:";
                continue;
            }
            if !in_char {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(num), Some(name)) = (parts.next(), parts.next()) else {
                continue;
            };
            let Ok(num) = num.parse::<u32>() else {
                continue;
            };
            match name {
                nv::UVM_DEVICE_NAME => majors.uvm = num,
                nv::CAPS_DEVICE_NAME => majors.caps = num,
                nv::CAPS_IMEX_DEVICE_NAME => majors.caps_imex = num,
                _ => {}
            }
        }
        majors
    }

    /// Kind of a character device with userspace `(major, minor)`, as the programs decide it.
    pub fn kind_of(&self, major: u32, minor: u32) -> Option<DeviceKind> {
        if major == nv::NV_MAJOR {
            return match minor {
                nv::NV_CTL_MINOR => Some(DeviceKind::Control),
                m if m <= nv::NV_GPU_MINOR_MAX => Some(DeviceKind::Gpu),
                _ => None,
            };
        }
        if major == 0 {
            return None;
        }
        if major == self.uvm {
            Some(DeviceKind::Uvm)
        } else if major == self.caps || major == self.caps_imex {
            Some(DeviceKind::Caps)
        } else {
            None
        }
    }
}

/// Converts a userspace (glibc) device number to the kernel's internal encoding.
pub fn user_to_kernel_dev(dev: u64) -> u64 {
    kernel_mkdev(libc::major(dev), libc::minor(dev))
}

/// The identity the programs see for a file: its superblock device and inode.
pub fn file_key(meta: &std::fs::Metadata) -> FileKey {
    FileKey {
        dev: user_to_kernel_dev(meta.dev()),
        ino: meta.ino(),
    }
}

/// An NVIDIA file known by identity, with the path it was configured or found under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtraFile {
    pub path: PathBuf,
    pub key: FileKey,
}

/// Resolves `devices.extra_paths` to identities. They stand in for the control device.
pub fn resolve_extra_paths(paths: &[PathBuf]) -> Result<Vec<ExtraFile>, DeviceError> {
    paths
        .iter()
        .map(|p| {
            let meta = std::fs::metadata(p).map_err(|source| DeviceError::ExtraPath {
                path: p.clone(),
                source,
            })?;
            Ok(ExtraFile {
                path: p.clone(),
                key: file_key(&meta),
            })
        })
        .collect()
}

/// Decides whether an open file (by its metadata) is one the probes match.
#[derive(Clone, Debug)]
pub struct Matcher {
    pub majors: DynamicMajors,
    pub extra: Vec<ExtraFile>,
}

impl Matcher {
    pub fn matches(&self, meta: &std::fs::Metadata) -> bool {
        self.kind(meta).is_some()
    }

    /// What kind of NVIDIA file an open file is (files of `devices.extra_paths` stand in for the
    /// control device); `None` for any other file.
    pub fn kind(&self, meta: &std::fs::Metadata) -> Option<DeviceKind> {
        use std::os::unix::fs::FileTypeExt;
        if meta.file_type().is_char_device() {
            let rdev = meta.rdev();
            if let Some(kind) = self.majors.kind_of(libc::major(rdev), libc::minor(rdev)) {
                return Some(kind);
            }
        }
        let key = file_key(meta);
        self.extra
            .iter()
            .any(|e| e.key == key)
            .then_some(DeviceKind::Control)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_dynamic_majors_from_char_section_only() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n\
                    509 nvidia-caps\n510 nvidia-caps-imex-channels\n\nBlock devices:\n\
                    511 nvidia-uvm\n";
        let m = DynamicMajors::parse(text);
        assert_eq!(
            m,
            DynamicMajors {
                uvm: 508,
                caps: 509,
                caps_imex: 510
            }
        );
        assert_eq!(m.kind_of(195, 255), Some(DeviceKind::Control));
        assert_eq!(m.kind_of(195, 0), Some(DeviceKind::Gpu));
        assert_eq!(m.kind_of(195, 254), None);
        assert_eq!(m.kind_of(508, 0), Some(DeviceKind::Uvm));
        assert_eq!(m.kind_of(1, 3), None);
        assert_eq!(DynamicMajors::default().kind_of(0, 0), None);
    }

    #[test]
    fn kernel_dev_encoding() -> std::io::Result<()> {
        // /dev/null is 1:3; the kernel encodes it as 0x100003.
        assert_eq!(user_to_kernel_dev(libc::makedev(1, 3)), 0x10_0003);
        let meta = std::fs::metadata("/dev/null")?;
        use std::os::unix::fs::MetadataExt;
        assert_eq!(user_to_kernel_dev(meta.rdev()), 0x10_0003);
        Ok(())
    }
}

/// Fuzz targets (`cargo xtask fuzz`): `/proc/devices` text of any content.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any text yields majors (0 where absent); nothing panics.
        #[test]
        fn any_proc_devices_never_panics(text in "(?s).{0,400}") {
            let _ = DynamicMajors::parse(&text);
        }

        /// The character section as the kernel writes it, among other drivers and with the same
        /// names in the block section, reads back the character majors only.
        #[test]
        fn character_majors_round_trip(
            uvm in proptest::option::of(1u32..4096),
            caps in proptest::option::of(1u32..4096),
            imex in proptest::option::of(1u32..4096),
            others in proptest::collection::vec((1u32..4096, "[a-z][a-z0-9_-]{0,12}"), 0..8),
        ) {
            let ours = [
                (uvm, nv::UVM_DEVICE_NAME),
                (caps, nv::CAPS_DEVICE_NAME),
                (imex, nv::CAPS_IMEX_DEVICE_NAME),
            ];
            let mut text = String::from("Character devices:\n");
            for (n, name) in &others {
                if !ours.iter().any(|(_, o)| o == name) {
                    text.push_str(&format!("{n:>3} {name}\n"));
                }
            }
            for (n, name) in ours {
                if let Some(n) = n {
                    text.push_str(&format!("{n:>3} {name}\n"));
                }
            }
            text.push_str("\nBlock devices:\n");
            for (_, name) in ours {
                text.push_str(&format!("259 {name}\n"));
            }
            let want = DynamicMajors {
                uvm: uvm.unwrap_or(0),
                caps: caps.unwrap_or(0),
                caps_imex: imex.unwrap_or(0),
            };
            prop_assert_eq!(DynamicMajors::parse(&text), want);
        }
    }
}
