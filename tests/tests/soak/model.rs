//! The soak's model of what it made (processes, their objects and cgroups), its random choices, and
//! the ground truth read from the fake driver and the pinned maps.

use super::*;

/// xorshift64*: seeded, reproducible choices without a dependency.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// A memory object a process holds.
pub(crate) struct Obj {
    pub(crate) client: u32,
    pub(crate) parent: u32,
    pub(crate) handle: u32,
    pub(crate) vidheap: bool,
}

pub(crate) struct Proc {
    pub(crate) rm: RmProcess,
    pub(crate) client: u32,
    pub(crate) devices: [u32; GPUS as usize],
    pub(crate) objects: Vec<Obj>,
}

pub(crate) struct Cg {
    pub(crate) dir: PathBuf,
    pub(crate) rel: String,
    pub(crate) procs: Vec<Proc>,
    pub(crate) limited: bool,
}

#[derive(Default, Debug)]
pub(crate) struct Counts {
    pub(crate) iterations: u64,
    pub(crate) cgroups_created: u64,
    pub(crate) cgroups_removed: u64,
    pub(crate) processes: u64,
    pub(crate) forks: u64,
    pub(crate) exits: u64,
    pub(crate) kills: u64,
    pub(crate) killed_by_limit: u64,
    pub(crate) allocations: u64,
    pub(crate) refused: u64,
    pub(crate) frees: u64,
    pub(crate) reopens: u64,
    pub(crate) limits_set: u64,
    pub(crate) limits_cleared: u64,
    pub(crate) checkpoints: u64,
    pub(crate) passes: u64,
    pub(crate) double_forks: u64,
}

/// The entries of a pinned map.
pub(crate) fn pinned<K: aya::Pod, V: aya::Pod>(base: &Path, name: &str) -> Vec<(K, V)> {
    let data = MapData::from_pin(base.join(name)).unwrap_or_else(|e| panic!("open {name}: {e}"));
    let map = Map::HashMap(data);
    let m = aya::maps::HashMap::<_, K, V>::try_from(map).unwrap_or_else(|e| panic!("{name}: {e}"));
    m.iter().filter_map(Result::ok).collect()
}

/// The number of entries of a pinned map.
pub(crate) fn entries<K: aya::Pod, V: aya::Pod>(base: &Path, name: &str) -> usize {
    pinned::<K, V>(base, name).len()
}

/// For a failed comparison: the kernel's objects the driver no longer holds (client, handle,
/// entry) and, for each of their clients, whether the driver and the kernel still have it.
pub(crate) fn stray_objects(base: &Path, s: &Snapshot) -> String {
    let kernel: Vec<(ObjKey, ObjEntry)> = pinned(base, maps::OBJECTS);
    let held: HashSet<(u32, u32)> = s.objects.iter().map(|o| (o.client, o.handle)).collect();
    let mut out = String::from("kernel objects the driver does not hold:");
    for (k, e) in kernel
        .iter()
        .filter(|(k, e)| e.bytes > 0 && !held.contains(&(k.client, k.object)))
    {
        let root = kernel
            .iter()
            .find(|(r, _)| r.client == k.client && r.object == k.client)
            .map(|(_, r)| format!("tgid {} serial {} file {:#x}", r.tgid, r.serial, r.file));
        out += &format!(
            "\n  ({:#x}, {:#x}) {e:?}; client in driver: {}, client in kernel: {root:?}",
            k.client,
            k.object,
            s.has_client(k.client)
        );
    }
    out
}

pub(crate) fn map_entries(base: &Path) -> BTreeMap<&'static str, usize> {
    BTreeMap::from([
        (
            maps::OBJECTS,
            entries::<ObjKey, ObjEntry>(base, maps::OBJECTS),
        ),
        (maps::USAGE, entries::<u64, CgroupUsage>(base, maps::USAGE)),
        (
            maps::ANCESTRY,
            entries::<u64, Ancestry>(base, maps::ANCESTRY),
        ),
        (
            maps::LIMITS,
            entries::<UsageKey, KernelLimit>(base, maps::LIMITS),
        ),
        (maps::PROCS, entries::<u32, ProcEntry>(base, maps::PROCS)),
        (
            maps::CGROUPS,
            entries::<u64, IoctlCounts>(base, maps::CGROUPS),
        ),
    ])
}

/// The fake driver's video memory by cgroup path (through the allocating pid) and GPU name.
pub(crate) fn truth(
    s: &Snapshot,
    owner: &HashMap<u32, String>,
) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut t: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for o in s.memory() {
        let cg = owner
            .get(&o.pid)
            .cloned()
            .unwrap_or_else(|| format!("?pid {}", o.pid));
        let per = t.entry(cg).or_default();
        let gpu = o
            .gpu
            .map_or_else(|| "unknown".to_owned(), |g| g.to_string());
        *per.entry(gpu).or_default() += o.bytes;
        *per.entry("all".to_owned()).or_default() += o.bytes;
    }
    t
}
