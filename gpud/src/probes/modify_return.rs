//! fmod_ret (`BPF_MODIFY_RETURN`) programs: loading, attaching and pinning them, which aya 0.14
//! does not do.
//!
//! The verifier allows fmod_ret on every `security_*` function (5.7+, whatever `lsm=` lists), so
//! on kernels that leave `bpf` out of the LSM list (Ubuntu) the deny tier still stops an ioctl
//! before the driver, through `security_file_ioctl`'s return value. The programs sit in `fentry/`
//! sections of the object (aya parses no `fmod_ret/` section), so aya creates their maps with the
//! rest; this module relocates a second parse of the same object against aya's map descriptors
//! (aya-obj's own relocation, as aya does it) and issues `BPF_PROG_LOAD` with the attach type
//! aya lacks. The link is a BPF link, pinned like every other attachment.

use std::{
    collections::HashSet,
    ffi::CString,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use aya::{Ebpf, maps::Map};
use aya_obj::{
    Object,
    btf::BtfKind,
    generated::{bpf_attach_type, bpf_attr, bpf_cmd, bpf_insn, bpf_prog_type},
};

/// Why an fmod_ret program could not be loaded, attached or pinned.
#[derive(Debug, thiserror::Error)]
pub enum ModifyReturnError {
    #[error("cannot parse the eBPF object")]
    Parse(#[source] aya_obj::ParseError),
    #[error("cannot relocate the eBPF object")]
    Relocate(#[source] aya_obj::relocation::EbpfRelocationError),
    #[error("cannot apply the kernel's BTF to the eBPF object")]
    BtfRelocate(#[source] aya_obj::btf::BtfRelocationError),
    #[error("map `{0}` has a type this loader does not relocate")]
    MapType(String),
    #[error("the eBPF object has no program `{0}`")]
    NoProgram(String),
    #[error("the kernel's BTF has no function `{function}`")]
    NoTarget {
        function: String,
        #[source]
        source: aya::BtfError,
    },
    /// The kernel refused the program: `errno` and the verifier's verdict.
    #[error("the kernel refused to load `{program}` on {function} ({errno}){}", verdict(.verifier))]
    Load {
        program: String,
        function: String,
        errno: std::io::Error,
        verifier: String,
    },
    #[error("the kernel refused to attach `{program}` to {function}")]
    Attach {
        program: String,
        function: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot pin the link of `{program}` at {path}")]
    Pin {
        program: String,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn verdict(line: &str) -> String {
    if line.is_empty() {
        String::new()
    } else {
        format!(": verifier: {line}")
    }
}

/// The object relocated against the loaded maps, ready to load fmod_ret programs from.
pub(super) struct Relocated {
    obj: Object,
}

/// The descriptor of a map aya created, whatever its type.
fn map_fd(name: &str, map: &Map) -> Result<i32, ModifyReturnError> {
    let data = match map {
        Map::Array(m)
        | Map::HashMap(m)
        | Map::LruHashMap(m)
        | Map::PerCpuArray(m)
        | Map::PerCpuHashMap(m)
        | Map::PerCpuLruHashMap(m)
        | Map::RingBuf(m)
        | Map::BloomFilter(m)
        | Map::Queue(m)
        | Map::Stack(m)
        | Map::LpmTrie(m)
        | Map::ProgramArray(m)
        | Map::PerfEventArray(m)
        // Task storage (`CALLS`), which aya loads without a type of its own.
        | Map::Unsupported(m) => m,
        _ => return Err(ModifyReturnError::MapType(name.to_owned())),
    };
    Ok(data.fd().as_fd().as_raw_fd())
}

impl Relocated {
    /// Parses `object` again and relocates it against the maps `ebpf` (loaded from the same
    /// object) created, and the kernel's BTF.
    pub(super) fn new(
        object: &[u8],
        ebpf: &Ebpf,
        kernel_btf: &aya::Btf,
    ) -> Result<Self, ModifyReturnError> {
        let mut obj = Object::parse(object).map_err(ModifyReturnError::Parse)?;
        obj.relocate_btf(kernel_btf)
            .map_err(ModifyReturnError::BtfRelocate)?;
        let mut fds = Vec::new();
        for (name, map) in ebpf.maps() {
            fds.push((name.to_owned(), map_fd(name, map)?));
        }
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(s, _)| *s).collect();
        let defs = obj.maps.clone();
        let maps = fds
            .iter()
            .filter_map(|(name, fd)| defs.get(name).map(|def| (name.as_str(), *fd, def)));
        obj.relocate_maps(maps, &text_sections)
            .map_err(ModifyReturnError::Relocate)?;
        obj.relocate_calls(&text_sections)
            .map_err(ModifyReturnError::Relocate)?;
        Ok(Self { obj })
    }

    /// Loads `program` as fmod_ret on the kernel function `function`.
    pub(super) fn load(
        &self,
        program: &str,
        function: &str,
        kernel_btf: &aya::Btf,
    ) -> Result<OwnedFd, ModifyReturnError> {
        let prog = self
            .obj
            .programs
            .get(program)
            .ok_or_else(|| ModifyReturnError::NoProgram(program.to_owned()))?;
        let insns = &self
            .obj
            .functions
            .get(&prog.function_key())
            .ok_or_else(|| ModifyReturnError::NoProgram(program.to_owned()))?
            .instructions;
        let btf_id = kernel_btf
            .id_by_type_name_kind(function, BtfKind::Func)
            .map_err(|source| ModifyReturnError::NoTarget {
                function: function.to_owned(),
                source,
            })?;
        let license =
            CString::new(self.obj.license.as_bytes()).unwrap_or_else(|_| CString::from(c"GPL"));
        // First without a log (the common case costs no buffer); on refusal again with one, for
        // the verifier's verdict.
        match prog_load(program, insns, &license, btf_id, None) {
            Ok(fd) => Ok(fd),
            Err(errno) => {
                let mut log = vec![0u8; 1 << 20];
                let verifier = match prog_load(program, insns, &license, btf_id, Some(&mut log)) {
                    Ok(fd) => return Ok(fd),
                    Err(_) => {
                        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                        super::caps::verifier_verdict(&String::from_utf8_lossy(&log[..end]))
                            .to_owned()
                    }
                };
                Err(ModifyReturnError::Load {
                    program: program.to_owned(),
                    function: function.to_owned(),
                    errno,
                    verifier,
                })
            }
        }
    }
}

/// `BPF_PROG_LOAD` of a tracing program with the attach type `BPF_MODIFY_RETURN`.
fn prog_load(
    name: &str,
    insns: &[bpf_insn],
    license: &CString,
    btf_id: u32,
    log: Option<&mut Vec<u8>>,
) -> Result<OwnedFd, std::io::Error> {
    // SAFETY: bpf_attr is plain data; all-zero is its "no value" for every field.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing the BPF_PROG_LOAD member of a zeroed union.
    let u = unsafe { &mut attr.__bindgen_anon_3 };
    u.prog_type = bpf_prog_type::BPF_PROG_TYPE_TRACING as u32;
    u.expected_attach_type = bpf_attach_type::BPF_MODIFY_RETURN as u32;
    u.insns = insns.as_ptr() as u64;
    u.insn_cnt = insns.len() as u32;
    u.license = license.as_ptr() as u64;
    u.attach_btf_id = btf_id;
    // The kernel keeps 15 bytes of the name; a longer one is cut, not refused.
    for (dst, src) in u.prog_name.iter_mut().zip(name.bytes().take(15)) {
        *dst = src as core::ffi::c_char;
    }
    if let Some(log) = log {
        u.log_level = 1;
        u.log_buf = log.as_mut_ptr() as u64;
        u.log_size = log.len() as u32;
    }
    sys_bpf_fd(bpf_cmd::BPF_PROG_LOAD, &mut attr)
}

/// Attaches a loaded fmod_ret program to the function it was loaded for; returns the link.
pub(super) fn attach(
    prog: &OwnedFd,
    program: &str,
    function: &str,
) -> Result<OwnedFd, ModifyReturnError> {
    // SAFETY: as in prog_load.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // BPF_RAW_TRACEPOINT_OPEN with no name attaches a tracing program where it was loaded for
    // (5.5+), returning a BPF link (5.7+, the first kernels with fmod_ret on security_*).
    attr.raw_tracepoint.prog_fd = prog.as_raw_fd() as u32;
    sys_bpf_fd(bpf_cmd::BPF_RAW_TRACEPOINT_OPEN, &mut attr).map_err(|source| {
        ModifyReturnError::Attach {
            program: program.to_owned(),
            function: function.to_owned(),
            source,
        }
    })
}

/// Pins `link` at `path` (`BPF_OBJ_PIN`).
pub(super) fn pin(link: &OwnedFd, path: &Path, program: &str) -> Result<(), ModifyReturnError> {
    let perr = |source| ModifyReturnError::Pin {
        program: program.to_owned(),
        path: path.to_owned(),
        source,
    };
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| perr(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    // SAFETY: as in prog_load.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing the BPF_OBJ_PIN member of a zeroed union.
    let u = unsafe { &mut attr.__bindgen_anon_4 };
    u.pathname = c.as_ptr() as u64;
    u.bpf_fd = link.as_raw_fd() as u32;
    sys_bpf(bpf_cmd::BPF_OBJ_PIN, &mut attr)
        .map(drop)
        .map_err(perr)
}

/// The bpf(2) system call: its non-negative result.
fn sys_bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> Result<i64, std::io::Error> {
    // SAFETY: attr points to a bpf_attr of the size passed; the kernel reads (and for the log,
    // writes through) only the pointers set in it, which outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_int,
            attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>() as libc::c_uint,
        )
    };
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// bpf(2) for a command that returns a new descriptor.
fn sys_bpf_fd(cmd: bpf_cmd, attr: &mut bpf_attr) -> Result<OwnedFd, std::io::Error> {
    let fd = sys_bpf(cmd, attr)?;
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
