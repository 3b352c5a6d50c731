//! The maps from userspace: taking them from the loaded object, reading whole hash maps in
//! batches, and writing the configuration the programs wait for.

use aya::{
    Ebpf,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray},
};
use gpud_common::{
    Ancestry, CFG_EXIT_RELEASE, CFG_HAS_EXTRA_FILES, CFG_LIMITS_SEEN, CFG_READY, CFG_VIRT_MEMINFO,
    CgroupUsage, DeviceKind, FileKey, IoctlCounts, KernelLimit, ObjEntry, ObjKey, ProbeConfig,
    ProcEntry, REACT_FREEZE, REACT_KILL, REACT_NOTIFY, UsageKey, maps,
};
use tracing::debug;

use super::{AttachMode, DynamicMajors, ExtraFile, ProbeError};
use crate::{config::ReactAction, report::Chain};

/// The accounting maps the attribution reads and updates (the settings are
/// [`super::KernelSettings`]'s).
pub struct KernelMaps {
    pub procs: HashMap<MapData, u32, ProcEntry>,
    pub cgroups: HashMap<MapData, u64, IoctlCounts>,
    pub stats: PerCpuArray<MapData, u64>,
    pub objects: HashMap<MapData, ObjKey, ObjEntry>,
    pub usage: HashMap<MapData, u64, CgroupUsage>,
    /// The memory limits, read back for the views: written only by [`super::KernelSettings`].
    pub limits: HashMap<MapData, UsageKey, KernelLimit>,
    pub ancestry: HashMap<MapData, u64, Ancestry>,
    /// Control files whose releases the kernel sends (`FILE_MARKS`).
    pub file_marks: HashMap<MapData, u64, u32>,
    /// Raised after every `ANCESTRY` record written or removed here.
    pub limits_gen: super::LimitsGeneration,
}

/// The map pinned at `dir/name`, as the type `T` (`HashMap`, `Array`, `RingBuf`, …): a second
/// handle on a map of the loaded object, or a map of pins this process did not load.
pub fn pinned<T: TryFrom<Map, Error = MapError>>(
    dir: &std::path::Path,
    name: &str,
) -> Result<T, MapError> {
    MapData::from_pin(dir.join(name))
        .and_then(Map::from_map_data)
        .and_then(T::try_from)
}

/// `bpf_map_update_elem`'s flag: make an entry, never replace one (a kernel-side entry, or a
/// record a program may be reading).
pub const BPF_NOEXIST: u64 = 1;

/// Entries per `BPF_MAP_LOOKUP_BATCH` call: far more than a hash bucket ever holds (a bucket
/// larger than the batch is refused with `ENOSPC`).
const LOOKUP_BATCH: usize = 1024;

/// Every entry of a hash map. Read in batches (one `bpf()` call per 1,024 entries instead of two
/// per entry: the walks behind `ListCgroups`, the sweeps and the releases stay cheap with
/// thousands of processes and objects); by key walk where the kernel refuses batches. Entries
/// changing meanwhile may be seen or not, as with any walk of a live map.
pub fn map_entries<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>) -> Vec<(K, V)> {
    match batch_entries(raw_fd(map)) {
        Ok(v) => v,
        Err(e) => {
            debug!("batched map read refused ({}); walking keys", Chain(&e));
            map.iter().filter_map(Result::ok).collect()
        }
    }
}

/// Every element of an array map with its index, batched as [`map_entries`] (an array sized
/// to `pid_max` has hundreds of thousands); by index where the kernel refuses batches.
pub(super) fn array_entries<V: aya::Pod>(map: &Array<MapData, V>) -> Vec<(u32, V)> {
    match batch_entries(raw_fd(map)) {
        Ok(v) => v,
        Err(e) => {
            debug!("batched map read refused ({}); reading by index", Chain(&e));
            (0..map.len())
                .filter_map(|i| map.get(&i, 0).ok().map(|v| (i, v)))
                .collect()
        }
    }
}

/// The descriptor of `map`, for the batch calls aya does not make.
fn raw_fd<K: aya::Pod, V: aya::Pod>(map: &impl aya::maps::IterableMap<K, V>) -> i32 {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    map.map().fd().as_fd().as_raw_fd()
}

fn batch_entries<K: aya::Pod, V: aya::Pod>(fd: i32) -> std::io::Result<Vec<(K, V)>> {
    let (ks, vs) = (size_of::<K>(), size_of::<V>());
    let mut keys = vec![0u8; LOOKUP_BATCH * ks];
    let mut values = vec![0u8; LOOKUP_BATCH * vs];
    // Hash maps use a bucket index as the batch cursor; key-sized buffers hold it.
    let mut cursor_in = vec![0u8; ks.max(8)];
    let mut cursor_out = vec![0u8; ks.max(8)];
    let opts = libbpf_sys::bpf_map_batch_opts {
        sz: size_of::<libbpf_sys::bpf_map_batch_opts>() as _,
        elem_flags: 0,
        flags: 0,
    };
    let mut out = Vec::new();
    let mut first = true;
    loop {
        let mut count = LOOKUP_BATCH as u32;
        // SAFETY: the buffers hold `count` keys and values of the map's sizes (checked by aya
        // when the map was taken) and cursors of at least the key size; libbpf writes no more.
        let rc = unsafe {
            libbpf_sys::bpf_map_lookup_batch(
                fd,
                if first {
                    std::ptr::null_mut()
                } else {
                    cursor_in.as_mut_ptr().cast()
                },
                cursor_out.as_mut_ptr().cast(),
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                &mut count,
                &opts,
            )
        };
        let done = match rc {
            0 => false,
            e if -e == libc::ENOENT => true,
            e if -e == libc::EINTR => continue,
            e => return Err(std::io::Error::from_raw_os_error(-e)),
        };
        let n = (count as usize).min(LOOKUP_BATCH);
        for i in 0..n {
            // SAFETY: in bounds (i < n ≤ LOOKUP_BATCH) and both types are plain old data;
            // read_unaligned makes no assumption about the byte buffers' alignment.
            let (k, v) = unsafe {
                (
                    std::ptr::read_unaligned(keys.as_ptr().add(i * ks).cast::<K>()),
                    std::ptr::read_unaligned(values.as_ptr().add(i * vs).cast::<V>()),
                )
            };
            out.push((k, v));
        }
        if done {
            return Ok(out);
        }
        std::mem::swap(&mut cursor_in, &mut cursor_out);
        first = false;
    }
}

/// What the configuration record is written from.
pub(super) struct Settings<'a> {
    pub offsets: gpud_common::KernelOffsets,
    pub majors: DynamicMajors,
    pub extra: &'a [ExtraFile],
    pub mode: AttachMode,
    pub react: ReactAction,
    pub memory_info: bool,
    /// `CFG_SCHED_*` bits of the guard's mode.
    pub guard_flags: u32,
    pub guard_timeslice_us: u64,
    /// `probes.max_objects_per_cgroup` (0: no cap).
    pub objects_per_cgroup: u32,
}

pub(super) fn write_config(ebpf: &mut Ebpf, s: Settings<'_>) -> Result<(), ProbeError> {
    let Settings {
        offsets,
        majors,
        extra,
        mode,
        react,
        memory_info,
        guard_flags,
        guard_timeslice_us,
        objects_per_cgroup,
    } = s;
    let map_err = |name| move |source| ProbeError::WriteMap { name, source };
    let mut files: HashMap<_, FileKey, u32> =
        HashMap::try_from(map_mut(ebpf, maps::EXTRA_FILES)?).map_err(map_err(maps::EXTRA_FILES))?;
    // The pinned map may hold a previous daemon's list: make it exactly the configured one.
    let stale: Vec<FileKey> = files
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !extra.iter().any(|e| e.key == *k))
        .collect();
    for k in stale {
        files.remove(&k).map_err(map_err(maps::EXTRA_FILES))?;
    }
    for e in extra {
        files
            .insert(e.key, DeviceKind::Control as u32, 0)
            .map_err(map_err(maps::EXTRA_FILES))?;
    }
    let mut config: Array<_, ProbeConfig> =
        Array::try_from(map_mut(ebpf, maps::CONFIG)?).map_err(map_err(maps::CONFIG))?;
    let value = ProbeConfig {
        offsets,
        uvm_major: majors.uvm,
        caps_major: majors.caps,
        caps_imex_major: majors.caps_imex,
        flags: CFG_READY
            | if extra.is_empty() {
                0
            } else {
                CFG_HAS_EXTRA_FILES
            }
            | match mode {
                AttachMode::Tracepoint => CFG_EXIT_RELEASE,
                AttachMode::Fentry => 0,
            }
            | if memory_info { CFG_VIRT_MEMINFO } else { 0 }
            | if cfg!(target_arch = "x86_64") {
                CFG_LIMITS_SEEN
            } else {
                0
            }
            | guard_flags,
        react_action: match react {
            ReactAction::Kill => REACT_KILL,
            ReactAction::Freeze => REACT_FREEZE,
            ReactAction::Notify => REACT_NOTIFY,
        },
        daemon_tgid: std::process::id(),
        guard_timeslice_us,
        objects_per_cgroup,
        _pad: 0,
    };
    config.set(0, value, 0).map_err(map_err(maps::CONFIG))
}

/// Sets or clears `flag` in the configuration record the programs read.
pub(super) fn set_config_flag(ebpf: &mut Ebpf, flag: u32, on: bool) -> Result<(), ProbeError> {
    let map_err = |source| ProbeError::WriteMap {
        name: maps::CONFIG,
        source,
    };
    let mut config: Array<_, ProbeConfig> =
        Array::try_from(map_mut(ebpf, maps::CONFIG)?).map_err(map_err)?;
    let mut value = config.get(&0, 0).map_err(map_err)?;
    if on {
        value.flags |= flag;
    } else {
        value.flags &= !flag;
    }
    config.set(0, value, 0).map_err(map_err)
}

/// Removes `key` from a hash map; a key that is not there is not an error (the kernel answers
/// `ENOENT`, which aya reports as a failed syscall).
pub fn remove_key<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
) -> Result<(), aya::maps::MapError> {
    match map.remove(key) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Takes map `name` out of the loaded object, as the map type `T`.
pub(super) fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, ProbeError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(ProbeError::NoMap(name))?;
    T::try_from(map).map_err(|source| ProbeError::TakeMap { name, source })
}

fn map_mut<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut aya::maps::Map, ProbeError> {
    ebpf.map_mut(name).ok_or(ProbeError::NoMap(name))
}
