//! Kernel struct field offsets from the running kernel's BTF.
//!
//! aya cannot relocate field accesses (no CO-RE for Rust programs), so the daemon looks the
//! offsets up in `/sys/kernel/btf/vmlinux` and hands them to the programs in the `CONFIG` map.

use std::path::{Path, PathBuf};

use gpud_common::KernelOffsets;
use libbpf_rs::btf::{
    Btf, BtfKind, BtfType,
    types::{Composite, MemberAttr},
};

/// Why the kernel struct offsets could not be found. Display says what failed; a cause is the
/// error's source.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("cannot read kernel BTF from {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: libbpf_rs::Error,
    },
    #[error("kernel BTF has no struct `{0}`")]
    NoStruct(&'static str),
    #[error("kernel BTF: struct `{strukt}` has no field `{field}`")]
    NoField {
        strukt: &'static str,
        field: &'static str,
    },
    #[error("kernel BTF: `{strukt}.{field}` is a bitfield")]
    BitField {
        strukt: &'static str,
        field: &'static str,
    },
}

/// The kernel's BTF, parsed once at start-up.
pub struct KernelBtf {
    btf: Btf<'static>,
}

impl KernelBtf {
    pub const VMLINUX: &'static str = "/sys/kernel/btf/vmlinux";

    pub fn load() -> Result<Self, BtfError> {
        Self::from_path(Path::new(Self::VMLINUX))
    }

    pub fn from_path(path: &Path) -> Result<Self, BtfError> {
        let btf = Btf::from_path(path).map_err(|source| BtfError::Read {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self { btf })
    }

    /// Whether the kernel has a function `name` (a possible fentry target or LSM hook).
    pub fn has_function(&self, name: &str) -> bool {
        self.btf
            .type_by_name::<BtfType<'_>>(name)
            .is_some_and(|t| t.kind() == BtfKind::Func)
    }

    /// Byte offset of `field` in `struct strukt`, looking through anonymous struct/union members.
    pub fn offset_of(&self, strukt: &'static str, field: &'static str) -> Result<u32, BtfError> {
        let ty = self
            .btf
            .type_by_name::<libbpf_rs::btf::types::Struct<'_>>(strukt)
            .ok_or(BtfError::NoStruct(strukt))?;
        let bits = find_member(&self.btf, Composite::from(ty), field, 0, strukt)?
            .ok_or(BtfError::NoField { strukt, field })?;
        Ok(bits / 8)
    }

    /// All offsets the programs need.
    pub fn kernel_offsets(&self) -> Result<KernelOffsets, BtfError> {
        // 6.13 replaced `atomic_long_t f_count` (one reference = 1) by `file_ref_t f_ref`,
        // whose counter reads 0 for one reference; its counter is the first member.
        let (file_refs, file_one_ref) = match self.offset_of("file", "f_ref") {
            Ok(off) => (off, 0),
            Err(BtfError::NoField { .. }) => (self.offset_of("file", "f_count")?, 1),
            Err(e) => return Err(e),
        };
        Ok(KernelOffsets {
            file_refs,
            file_one_ref,
            task_files: self.offset_of("task_struct", "files")?,
            task_tgid: self.offset_of("task_struct", "tgid")?,
            task_signal: self.offset_of("task_struct", "signal")?,
            signal_live: self.offset_of("signal_struct", "live")?,
            files_fdt: self.offset_of("files_struct", "fdt")?,
            fdt_max_fds: self.offset_of("fdtable", "max_fds")?,
            fdt_fd: self.offset_of("fdtable", "fd")?,
            file_inode: self.offset_of("file", "f_inode")?,
            inode_rdev: self.offset_of("inode", "i_rdev")?,
            inode_ino: self.offset_of("inode", "i_ino")?,
            inode_sb: self.offset_of("inode", "i_sb")?,
            sb_dev: self.offset_of("super_block", "s_dev")?,
        })
    }
}

impl KernelBtf {
    /// Offset of `task_struct.thread_info.status`, whose `TS_COMPAT` bit marks an i386 system
    /// call on x86-64; `None` on other architectures (their 32-bit calls are not told apart on
    /// the raw tracepoints yet) or where the BTF lacks either member.
    pub fn task_compat_status(&self) -> Option<u32> {
        if !cfg!(target_arch = "x86_64") {
            return None;
        }
        let info = self.offset_of("task_struct", "thread_info").ok()?;
        let status = self.offset_of("thread_info", "status").ok()?;
        Some(info + status).filter(|&off| off != 0)
    }
}

/// Bit offset of `field` within `comp`, recursing into anonymous members.
fn find_member(
    btf: &Btf<'_>,
    comp: Composite<'_>,
    field: &'static str,
    base_bits: u32,
    strukt: &'static str,
) -> Result<Option<u32>, BtfError> {
    for m in comp.iter() {
        let bits = match m.attr {
            MemberAttr::Normal { offset } => offset,
            MemberAttr::BitField { offset, .. } => {
                if m.name.is_some_and(|n| n == field) {
                    return Err(BtfError::BitField { strukt, field });
                }
                offset
            }
        };
        match m.name {
            Some(n) if n == field => return Ok(Some(base_bits + bits)),
            Some(n) if !n.is_empty() => {}
            _ => {
                // Anonymous struct or union: its members belong to the outer struct.
                let Some(inner) = btf.type_by_id::<BtfType<'_>>(m.ty) else {
                    continue;
                };
                if let Ok(inner) = Composite::try_from(inner.skip_mods_and_typedefs())
                    && let Some(found) = find_member(btf, inner, field, base_bits + bits, strukt)?
                {
                    return Ok(Some(found));
                }
            }
        }
    }
    Ok(None)
}
