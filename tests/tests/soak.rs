//! Churn soak: the real gpud on a private bus, the fake NVIDIA device, and a random but seeded
//! stream of cgroups and processes coming and going: processes open the device, allocate and free
//! video memory of random sizes through every call form, fork children that allocate (in their
//! own or another cgroup) and exit, exit or are killed with memory still allocated, close and
//! reopen the device; pass it to a process in another cgroup over a unix socket (SCM_RIGHTS)
//! and exit, leaving the receiver to allocate and free under their client; daemonize (a double
//! fork whose grandchild carries on with the file); limits are set (react action `kill`, so crossings kill) and cleared;
//! cgroups are removed, some while memory charged to them is still held by a process elsewhere.
//!
//! At every checkpoint the per-cgroup and per-GPU figures must equal the fake driver's ground
//! truth; at the end, after every process and cgroup is gone and the daemon's sweep ran, every
//! accounting map in the daemon's bpffs (OBJECTS, USAGE, ANCESTRY, PENDING, LIMITS, PROCS,
//! CGROUPS) must be empty and ListProcesses / ListCgroups must track nothing.
//!
//! `cargo test` runs it twice for 30 s each: on an otherwise idle machine, and with every CPU
//! kept busy by spinning threads the test starts and stops itself (the release races showed only
//! there). `cargo xtask soak --minutes N` runs longer (`GPUD_SOAK_SECS`); `GPUD_SOAK_SEED`
//! replays a run; `GPUD_SOAK_RUNS=N` repeats it N times (loop mode), each on a fresh rig, and
//! reports how many passed. Each run prints `SOAK SUMMARY: {…}`.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::maps::{Map, MapData};
use gpud_common::{
    Ancestry, IoctlCounts, KernelLimit, ObjEntry, ObjKey, Pending, ProcEntry, UsageKey, maps,
};
use gpud_tests::{
    Cgroup, Daemon, Manager1Proxy, Rig, RmProcess,
    fakenv::{FakeNv, Snapshot},
};
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;
const GPUS: u32 = 2;
const MAX_CGROUPS: usize = 6;
const MAX_PROCS: usize = 10;
const CHECKPOINT_EVERY: Duration = Duration::from_secs(8);
/// How long the daemon may take to settle after a quiesce (sweep interval 1 s).
const SETTLE: Duration = Duration::from_secs(20);

/// xorshift64*: seeded, reproducible choices without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// A memory object a process holds.
struct Obj {
    client: u32,
    parent: u32,
    handle: u32,
    vidheap: bool,
}

struct Proc {
    rm: RmProcess,
    client: u32,
    devices: [u32; GPUS as usize],
    objects: Vec<Obj>,
}

struct Cg {
    dir: PathBuf,
    rel: String,
    procs: Vec<Proc>,
    limited: bool,
}

#[derive(Default, Debug)]
struct Counts {
    iterations: u64,
    cgroups_created: u64,
    cgroups_removed: u64,
    processes: u64,
    forks: u64,
    exits: u64,
    kills: u64,
    killed_by_limit: u64,
    allocations: u64,
    refused: u64,
    frees: u64,
    reopens: u64,
    limits_set: u64,
    limits_cleared: u64,
    checkpoints: u64,
    passes: u64,
    double_forks: u64,
}

/// The entries of a pinned map.
fn pinned<K: aya::Pod, V: aya::Pod>(base: &Path, name: &str) -> Vec<(K, V)> {
    let data = MapData::from_pin(base.join(name)).unwrap_or_else(|e| panic!("open {name}: {e}"));
    let map = if name == maps::PENDING {
        Map::LruHashMap(data)
    } else {
        Map::HashMap(data)
    };
    let m = aya::maps::HashMap::<_, K, V>::try_from(map).unwrap_or_else(|e| panic!("{name}: {e}"));
    m.iter().filter_map(Result::ok).collect()
}

/// The number of entries of a pinned map.
fn entries<K: aya::Pod, V: aya::Pod>(base: &Path, name: &str) -> usize {
    pinned::<K, V>(base, name).len()
}

/// For a failed comparison: the kernel's objects the driver no longer holds (client, handle,
/// entry) and, for each of their clients, whether the driver and the kernel still have it.
fn stray_objects(base: &Path, s: &Snapshot) -> String {
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

fn map_entries(base: &Path) -> BTreeMap<&'static str, usize> {
    BTreeMap::from([
        (
            maps::OBJECTS,
            entries::<ObjKey, ObjEntry>(base, maps::OBJECTS),
        ),
        (maps::USAGE, entries::<UsageKey, u64>(base, maps::USAGE)),
        (
            maps::ANCESTRY,
            entries::<u64, Ancestry>(base, maps::ANCESTRY),
        ),
        (maps::PENDING, entries::<u64, Pending>(base, maps::PENDING)),
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
fn truth(s: &Snapshot, owner: &HashMap<u32, String>) -> BTreeMap<String, BTreeMap<String, u64>> {
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

struct Soak<'a> {
    rng: Rng,
    fake: &'a FakeNv,
    ctl: PathBuf,
    /// The soak's cgroup, above all others; taken (removed) at the end.
    parent: Option<Cgroup>,
    parent_dir: PathBuf,
    parent_rel: String,
    /// Where the unix sockets of fd passing are made.
    sockets: PathBuf,
    cgroups: Vec<Cg>,
    next_cg: u32,
    /// ids of the cgroups above the soak's (they outlive it).
    ancestors: HashSet<u64>,
    /// Every pid that allocated, to the cgroup it allocated in.
    owner: HashMap<u32, String>,
    n: Counts,
    proxy: Manager1Proxy<'static>,
    _conn: zbus::Connection,
}

impl Soak<'_> {
    fn new_cgroup(&mut self) {
        let name = format!("c{}", self.next_cg);
        self.next_cg += 1;
        let dir = self.parent_dir.join(&name);
        std::fs::create_dir(&dir).expect("create cgroup");
        self.cgroups.push(Cg {
            dir,
            rel: format!("{}/{name}", self.parent_rel),
            procs: Vec::new(),
            limited: false,
        });
        self.n.cgroups_created += 1;
    }

    fn spawn(&mut self, c: usize) {
        let mut rm = RmProcess::spawn(Some(&self.cgroups[c].dir), &self.ctl);
        let (client, d0) = rm.client_device(0);
        let d1 = rm.handle(&format!("device {client} 1"));
        self.owner.insert(rm.pid, self.cgroups[c].rel.clone());
        self.cgroups[c].procs.push(Proc {
            rm,
            client,
            devices: [d0, d1],
            objects: Vec::new(),
        });
        self.n.processes += 1;
    }

    /// One allocation by `p` (or its forked child, which is talking now); `None` if the caller
    /// died in it (killed on crossing a limit).
    fn alloc(rng: &mut Rng, n: &mut Counts, p: &mut Proc) -> Option<Value> {
        let size = (rng.next() % (48 * MIB)) + 1;
        let gpu = rng.below(GPUS as usize);
        let form = [
            "nvos21",
            "nvos64",
            "vidheap",
            "xfer21",
            "xfer64",
            "xfervidheap",
        ][rng.below(6)];
        let r = p.rm.try_cmd(&format!(
            "alloc {} {} {size} {form}",
            p.client, p.devices[gpu]
        ))?;
        if r.get("reaped").is_some() {
            // A forked child died in the call; this is its parent's answer.
            return Some(r);
        }
        n.allocations += 1;
        if r["ok"] == true {
            p.objects.push(Obj {
                client: p.client,
                parent: p.devices[gpu],
                handle: r["handle"].as_u64().expect("handle") as u32,
                vidheap: form.contains("vidheap"),
            });
        } else {
            n.refused += 1;
        }
        Some(r)
    }

    fn free(rng: &mut Rng, n: &mut Counts, p: &mut Proc) -> Option<()> {
        if p.objects.is_empty() {
            return Some(());
        }
        let o = p.objects.swap_remove(rng.below(p.objects.len()));
        let line = if o.vidheap {
            format!("vidheap-free {} {} {}", o.client, o.parent, o.handle)
        } else {
            format!("free {} {}", o.client, o.handle)
        };
        let r = p.rm.try_cmd(&line)?;
        assert_eq!(r["ok"], true, "{line}: {r}");
        n.frees += 1;
        Some(())
    }

    /// A process that died (killed by a limit): reap it and forget it.
    fn bury(&mut self, c: usize, i: usize) {
        let mut p = self.cgroups[c].procs.swap_remove(i);
        let st = p.rm.wait();
        assert!(!st.success() || st.code().is_some(), "{st}");
        self.n.killed_by_limit += 1;
    }

    /// Random process: (cgroup, index).
    fn pick_proc(&mut self) -> Option<(usize, usize)> {
        let all: Vec<(usize, usize)> = self
            .cgroups
            .iter()
            .enumerate()
            .flat_map(|(c, cg)| (0..cg.procs.len()).map(move |i| (c, i)))
            .collect();
        (!all.is_empty()).then(|| all[self.rng.below(all.len())])
    }

    async fn step(&mut self) {
        self.n.iterations += 1;
        let procs: usize = self.cgroups.iter().map(|c| c.procs.len()).sum();
        let action = self.rng.below(100);
        match action {
            0..=4 if self.cgroups.len() < MAX_CGROUPS => self.new_cgroup(),
            0..=11 if procs < MAX_PROCS && !self.cgroups.is_empty() => {
                let c = self.rng.below(self.cgroups.len());
                self.spawn(c);
            }
            0..=44 => {
                let Some((c, i)) = self.pick_proc() else {
                    return;
                };
                let (rng, n) = (&mut self.rng, &mut self.n);
                let p = &mut self.cgroups[c].procs[i];
                let alive = if rng.chance(60) || p.objects.is_empty() {
                    Self::alloc(rng, n, p).is_some()
                } else {
                    Self::free(rng, n, p).is_some()
                };
                if !alive {
                    self.bury(c, i);
                }
            }
            45..=54 => self.fork(),
            55..=59 => {
                // Close the device with memory allocated (the driver frees the clients), reopen.
                let Some((c, i)) = self.pick_proc() else {
                    return;
                };
                let p = &mut self.cgroups[c].procs[i];
                p.rm.ok("close");
                // By path: a process that received its file has none of its own.
                p.rm.ok(&format!("open {}", self.ctl.display()));
                p.client = p.rm.handle("client");
                for g in 0..GPUS {
                    p.devices[g as usize] = p.rm.handle(&format!("device {} {g}", p.client));
                }
                p.objects.clear();
                self.n.reopens += 1;
            }
            60..=63 => {
                // Free the whole client, then start over with a new one.
                let Some((c, i)) = self.pick_proc() else {
                    return;
                };
                let p = &mut self.cgroups[c].procs[i];
                p.rm.ok(&format!("free {} {}", p.client, p.client));
                p.client = p.rm.handle("client");
                for g in 0..GPUS {
                    p.devices[g as usize] = p.rm.handle(&format!("device {} {g}", p.client));
                }
                p.objects.clear();
                self.n.frees += 1;
            }
            64..=69 => {
                // Exit with whatever is allocated.
                let Some((c, i)) = self.pick_proc() else {
                    return;
                };
                let mut p = self.cgroups[c].procs.swap_remove(i);
                let _ = p.rm.try_cmd("exit");
                p.rm.wait();
                self.n.exits += 1;
            }
            70..=74 => {
                let Some((c, i)) = self.pick_proc() else {
                    return;
                };
                let mut p = self.cgroups[c].procs.swap_remove(i);
                // SAFETY: kill(2) of our own unreaped child (or adopted descendant).
                unsafe { libc::kill(p.rm.pid as i32, libc::SIGKILL) };
                p.rm.wait();
                self.n.kills += 1;
            }
            75..=84 if !self.cgroups.is_empty() => {
                let c = self.rng.below(self.cgroups.len());
                let rel = self.cgroups[c].rel.clone();
                let gpu = ["all", "0", "1"][self.rng.below(3)];
                if self.cgroups[c].limited && self.rng.chance(50) {
                    self.proxy
                        .clear_limits(&rel, gpu, &[])
                        .await
                        .or_else(|e| {
                            if e.to_string().contains("NotFound") {
                                Ok(())
                            } else {
                                Err(e)
                            }
                        })
                        .expect("ClearLimits");
                    self.n.limits_cleared += 1;
                } else {
                    let max = (self.rng.next() % (256 * MIB)) + 64 * MIB;
                    let limits = BTreeMap::from([("memory_max", zbus::Variant::from(max))]);
                    self.proxy
                        .set_limits(&rel, gpu, limits)
                        .await
                        .expect("SetLimits");
                    self.cgroups[c].limited = true;
                    self.n.limits_set += 1;
                }
            }
            85..=86 if !self.cgroups.is_empty() => {
                let c = self.rng.below(self.cgroups.len());
                self.remove_cgroup(c).await;
            }
            87..=90 => self.pass(),
            91..=93 => self.daemonize(),
            _ => {}
        }
    }

    /// A process forks; the child (here or moved to another cgroup) allocates, maybe frees, and
    /// exits; what it allocated stays with the parent's client.
    fn fork(&mut self) {
        let Some((c, i)) = self.pick_proc() else {
            return;
        };
        let target = if self.rng.chance(40) {
            self.rng.below(self.cgroups.len())
        } else {
            c
        };
        let target_dir = self.cgroups[target].dir.clone();
        let target_rel = self.cgroups[target].rel.clone();
        let (rng, n) = (&mut self.rng, &mut self.n);
        let p = &mut self.cgroups[c].procs[i];
        let Some(child) = p.rm.try_cmd("fork") else {
            self.bury(c, i);
            return;
        };
        assert_eq!(child["ok"], true, "{child}");
        let child_pid = child["pid"].as_u64().expect("child pid") as u32;
        n.forks += 1;
        if target != c {
            p.rm.ok(&format!("cgroup {}", target_dir.display()));
        }
        self.owner.insert(child_pid, target_rel);
        let mut child_died = false;
        for _ in 0..=rng.below(3) {
            match Self::alloc(rng, n, p) {
                Some(r) if r.get("reaped").is_some() => {
                    child_died = true;
                    n.killed_by_limit += 1;
                    break;
                }
                Some(_) => {}
                None => {
                    // Only a child is killed by its own crossing; the parent lives on.
                    panic!("the parent of a forked child ended");
                }
            }
        }
        if !child_died {
            let bye = p.rm.ok("exit");
            assert_eq!(bye["exit"], child_pid, "{bye}");
            let reaped = p.rm.recv();
            assert_eq!(reaped["reaped"], child_pid, "{reaped}");
        }
    }

    /// A process sends its file to a new process in a random cgroup (SCM_RIGHTS) and exits; the
    /// receiver carries on with the sender's client and objects (it may free them: the sender's
    /// cgroup is uncharged) and allocates in its own cgroup.
    fn pass(&mut self) {
        let Some((c, i)) = self.pick_proc() else {
            return;
        };
        let target = self.rng.below(self.cgroups.len());
        let socket = self.sockets.join("pass.sock");
        let mut receiver = RmProcess::spawn_without_file(Some(&self.cgroups[target].dir));
        receiver.ok(&format!("listen {}", socket.display()));
        receiver.send("recv-fd");
        let mut p = self.cgroups[c].procs.swap_remove(i);
        p.rm.ok(&format!("send-fd {}", socket.display()));
        let got = receiver.recv();
        assert_eq!(got["ok"], true, "recv-fd: {got}");
        let _ = p.rm.try_cmd("exit");
        p.rm.wait();
        self.owner
            .insert(receiver.pid, self.cgroups[target].rel.clone());
        p.rm = receiver;
        self.cgroups[target].procs.push(p);
        self.n.passes += 1;
    }

    /// A process daemonizes: it forks, the child forks and exits, the parent exited first; the
    /// grandchild carries on with the file.
    fn daemonize(&mut self) {
        let Some((c, i)) = self.pick_proc() else {
            return;
        };
        let rel = self.cgroups[c].rel.clone();
        let p = &mut self.cgroups[c].procs[i];
        p.rm.handoff();
        let pid = p.rm.handoff();
        self.owner.insert(pid, rel);
        self.n.double_forks += 1;
    }

    async fn remove_cgroup(&mut self, c: usize) {
        let mut cg = self.cgroups.swap_remove(c);
        if cg.limited {
            let _ = self.proxy.clear_limits(&cg.rel, "all", &[]).await;
            let _ = self.proxy.clear_limits(&cg.rel, "0", &[]).await;
            let _ = self.proxy.clear_limits(&cg.rel, "1", &[]).await;
        }
        for mut p in cg.procs.drain(..) {
            if self.rng.chance(50) {
                // SAFETY: kill(2) of our own unreaped child (or adopted descendant).
                unsafe { libc::kill(p.rm.pid as i32, libc::SIGKILL) };
                self.n.kills += 1;
            } else {
                let _ = p.rm.try_cmd("exit");
                self.n.exits += 1;
            }
            p.rm.wait();
        }
        let mut removed = false;
        for _ in 0..200 {
            if std::fs::remove_dir(&cg.dir).is_ok() {
                removed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(removed, "rmdir {}", cg.dir.display());
        self.n.cgroups_removed += 1;
    }

    /// Per live cgroup and for their parent: the daemon's figures equal the fake driver's.
    async fn compare(&self) -> Result<(), String> {
        let want = truth(&self.fake.snapshot(), &self.owner);
        let mut all = BTreeMap::<String, u64>::new();
        for per in want.values() {
            for (g, b) in per {
                *all.entry(g.clone()).or_default() += b;
            }
        }
        let live = self
            .cgroups
            .iter()
            .map(|c| (&c.rel, want.get(&c.rel).cloned().unwrap_or_default()));
        for (path, want) in live.chain([(&self.parent_rel, all)]) {
            let got = self
                .proxy
                .get_cgroup(path)
                .await
                .map_err(|e| format!("GetCgroup {path}: {e}"))?;
            let got: BTreeMap<String, u64> = got
                .memory_current
                .into_iter()
                .filter(|(_, b)| *b > 0)
                .collect();
            if got != want {
                return Err(format!("{path}: daemon {got:?}, driver {want:?}"));
            }
        }
        Ok(())
    }

    async fn checkpoint(&mut self, daemon: &Daemon, base: &Path) {
        self.n.checkpoints += 1;
        let r = settle(|| self.compare()).await;
        if let Err(e) = r {
            let parent = std::fs::metadata(&self.parent_dir).map_or(0, |m| m.ino());
            let kernel: Vec<String> = pinned::<UsageKey, u64>(base, maps::USAGE)
                .into_iter()
                .filter(|(k, _)| k.cgroup_id == parent)
                .map(|(k, b)| format!("{:#x}={b}", k.gpu))
                .collect();
            panic!(
                "usage differs from the driver's: {e}\nthe parent's USAGE entries now: {kernel:?}\n{}\n{}",
                stray_objects(base, &self.fake.snapshot()),
                daemon.log_text()
            );
        }
    }

    /// What is left once every test process and cgroup is gone: map entries, driver memory,
    /// tracked processes and cgroups, limits.
    async fn leftovers(&self, base: &Path, parent_rel: &str) -> Result<(), String> {
        let used = self.fake.snapshot().used_total();
        let m = map_entries(base);
        let e = |what: &str, err: zbus::Error| format!("{what}: {err}");
        let procs = self
            .proxy
            .list_processes()
            .await
            .map_err(|x| e("ListProcesses", x))?;
        let cgroups = self
            .proxy
            .list_cgroups()
            .await
            .map_err(|x| e("ListCgroups", x))?;
        let limits = self
            .proxy
            .list_limits()
            .await
            .map_err(|x| e("ListLimits", x))?;
        let left: Vec<String> = m
            .iter()
            // Live cgroups keep zero entries (the daemon forgets those of removed ones); the
            // soak's cgroups are all gone, only their ancestors live.
            .filter(|(k, n)| **n > 0 && **k != maps::USAGE)
            .map(|(k, n)| format!("{k}={n}"))
            .chain(
                pinned::<UsageKey, u64>(base, maps::USAGE)
                    .into_iter()
                    .filter(|(k, b)| *b != 0 || !self.ancestors.contains(&k.cgroup_id))
                    .map(|(k, b)| format!("USAGE ({}, {:#x})={b}", k.cgroup_id, k.gpu)),
            )
            .chain((used > 0).then(|| format!("driver still holds {used} bytes")))
            .chain(
                procs
                    .iter()
                    .map(|p| format!("process {} ({})", p.pid, p.cgroup)),
            )
            .chain(
                cgroups
                    .iter()
                    .map(|c| format!("cgroup {} {:?} {:?}", c.id, c.path, c.memory_current)),
            )
            .chain(
                limits
                    .iter()
                    .filter(|l| l.cgroup.starts_with(parent_rel))
                    .map(|l| format!("limit on {}", l.cgroup)),
            )
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(left.join(", "))
        }
    }
}

/// What one reply of the read path must show whatever churn goes on, since it comes from one
/// view of the daemon: paths ordered and unique, no process in two cgroups, `all` present and
/// no GPU's bytes above it, and a cgroup's limits and bytes on the GPUs it is limited on.
fn whole(records: &[gpud_api::CgroupRecord]) -> Result<(), String> {
    let mut pids = HashSet::new();
    for w in records.windows(2) {
        if w[0].path >= w[1].path {
            return Err(format!(
                "paths out of order: {:?} {:?}",
                w[0].path, w[1].path
            ));
        }
    }
    for r in records {
        let all = *r
            .memory_current
            .get("all")
            .ok_or_else(|| format!("{}: no `all` in {:?}", r.path, r.memory_current))?;
        if let Some((g, b)) = r.memory_current.iter().find(|(_, b)| **b > all) {
            return Err(format!("{}: GPU {g} holds {b} > all {all}", r.path));
        }
        for pid in &r.pids {
            if !pids.insert(*pid) {
                return Err(format!("process {pid} listed twice (again in {})", r.path));
            }
        }
    }
    Ok(())
}

/// Reads through D-Bus (`ListCgroups`, `GetCgroup` of what it lists) and `gpudctl list` until
/// `stop`, checking each reply with [`whole`]; returns how many replies it checked.
async fn read_during_churn(
    proxy: Manager1Proxy<'static>,
    bus: String,
    parent: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<u64, String> {
    let mut checked = 0;
    let mut round = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        round += 1;
        let list = proxy
            .list_cgroups()
            .await
            .map_err(|e| format!("ListCgroups: {e}"))?;
        whole(&list).map_err(|e| format!("ListCgroups: {e}"))?;
        checked += 1;
        for r in list.iter().filter(|r| r.path.starts_with(&parent)).take(8) {
            match proxy.get_cgroup(&r.path).await {
                Ok(one) => whole(std::slice::from_ref(&one))
                    .map_err(|e| format!("GetCgroup {}: {e}", r.path))?,
                // Removed by the churn since it was listed.
                Err(e) if e.to_string().contains("no cgroup") => continue,
                Err(e) => return Err(format!("GetCgroup {}: {e}", r.path)),
            }
            checked += 1;
        }
        if round.is_multiple_of(5) {
            let out = tokio::process::Command::new(gpud_tests::gpudctl_bin())
                .args(["--bus-address", &bus, "list", "--json"])
                .output()
                .await
                .map_err(|e| format!("gpudctl: {e}"))?;
            if !out.status.success() {
                return Err(format!("gpudctl list failed: {out:?}"));
            }
            let listed: Vec<gpud_api::CgroupRecord> =
                serde_json::from_slice::<Vec<Value>>(&out.stdout)
                    .map_err(|e| format!("gpudctl JSON: {e}"))?
                    .into_iter()
                    .filter_map(|v| serde_json::from_value(v).ok())
                    .collect();
            whole(&listed).map_err(|e| format!("gpudctl list: {e}"))?;
            checked += 1;
        }
        // Close enough that most reads fall between the churn's steps, each of which changes the
        // state (so nearly every read makes the daemon build a new view): about 100 replies a
        // second. This pace found the release race of `release_closed_files`.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(checked)
}

/// Polls `f` until it is `Ok`, for at most [`SETTLE`]; its last error otherwise.
async fn settle<F, Fut>(mut f: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + SETTLE;
    loop {
        let r = f().await;
        if r.is_ok() || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One soak at a time: two would share the machine's CPUs and the fake devices' names.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Threads that keep every CPU busy until dropped (or, whatever happens, until `limit`): the
/// load of a busy GPU node (a build, data loading), under which the daemon is preempted
/// between any two steps of its own.
struct Spinners {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<u64>>,
}

impl Spinners {
    fn start(limit: Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cpus = std::thread::available_parallelism().map_or(2, usize::from);
        let deadline = Instant::now() + limit;
        let threads = (0..cpus)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut spins = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        spins = std::hint::black_box(spins.wrapping_add(1));
                        if spins.is_multiple_of(1 << 20) && Instant::now() > deadline {
                            break;
                        }
                    }
                    spins
                })
            })
            .collect();
        eprintln!("soak: {cpus} spinning threads keep every CPU busy");
        Self { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// `GPUD_SOAK_SECS` (default 30), `GPUD_SOAK_SEED` (default: new for each run) and
/// `GPUD_SOAK_RUNS` (default 1: loop mode for local use, e.g. replaying a seed 20 times). Each run
/// has a fresh rig; every run is made, and the test fails if any did, naming their seeds.
async fn soak_runs(busy: bool) {
    let _serial = SERIAL.lock().await;
    let var = |name: &str| std::env::var(name).ok();
    let secs: u64 = var("GPUD_SOAK_SECS").map_or(30, |v| v.parse().expect("GPUD_SOAK_SECS"));
    let seed: Option<u64> = var("GPUD_SOAK_SEED").map(|v| v.parse().expect("GPUD_SOAK_SEED"));
    let runs: u32 = var("GPUD_SOAK_RUNS").map_or(1, |v| v.parse().expect("GPUD_SOAK_RUNS"));
    let label = if busy { "every CPU busy" } else { "idle" };
    let mut failed = Vec::new();
    for run in 1..=runs {
        let seed = seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        eprintln!("soak run {run} of {runs} ({label}): {secs} s, GPUD_SOAK_SEED={seed}");
        let spinners = busy.then(|| Spinners::start(Duration::from_secs(secs + 600)));
        let outcome = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
            soak_once(secs, seed),
        ))
        .await;
        drop(spinners);
        let verdict = if outcome.is_ok() { "passed" } else { "FAILED" };
        eprintln!("soak run {run} of {runs} ({label}, GPUD_SOAK_SEED={seed}): {verdict}");
        if outcome.is_err() {
            failed.push(seed);
        }
    }
    println!(
        "SOAK LOOP ({label}): {} of {runs} runs passed; failed seeds: {failed:?}",
        runs as usize - failed.len()
    );
    assert!(
        failed.is_empty(),
        "soak ({label}) failed with seeds {failed:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn churn_soak_leaks_nothing_and_matches_the_driver() {
    soak_runs(false).await;
}

/// The same churn while spinning threads keep every CPU busy: the daemon, the probes' programs
/// and the churning processes are preempted anywhere, which is how a GPU node runs. Races of
/// the release rules showed only here (docs/design.md, "Release rule").
#[tokio::test(flavor = "multi_thread")]
async fn churn_soak_holds_with_every_cpu_busy() {
    soak_runs(true).await;
}

async fn soak_once(secs: u64, seed: u64) {
    // Limits name GPUs 0 and 1: gpud checks them against NVML's inventory.
    let Some(mut rig) = Rig::new("soak").fake_gpus(GPUS).fake_device(GPUS) else {
        return;
    };
    let config = rig
        .config()
        .log("gpud=info,gpud::attribution=debug")
        .react_action("kill");
    rig.start(config).await;
    rig.wait_for_gpus(GPUS).await;
    let base = rig.pins();
    let (conn, proxy) = rig.proxy().await;
    let parent = Cgroup::new("soak");
    let root = gpud_tests::cgroup2_root();
    let ancestors: HashSet<u64> = parent
        .dir
        .ancestors()
        .skip(1)
        .take_while(|d| d.starts_with(&root))
        .map(|d| std::fs::metadata(d).expect("stat cgroup").ino())
        .collect();
    let mut soak = Soak {
        ancestors,
        rng: Rng(seed | 1),
        fake: rig.fake(),
        ctl: rig.ctl(),
        parent_dir: parent.dir.clone(),
        parent_rel: parent.rel.clone(),
        sockets: rig.path().to_owned(),
        parent: Some(parent),
        cgroups: Vec::new(),
        next_cg: 0,
        owner: HashMap::new(),
        n: Counts::default(),
        proxy,
        _conn: conn,
    };
    let mut max_entries: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut note = |m: BTreeMap<&'static str, usize>| {
        for (k, v) in m {
            let e = max_entries.entry(k).or_default();
            *e = (*e).max(v);
        }
    };
    // Readers during the churn, on a connection of their own.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (reader_conn, reader_proxy) = rig.proxy().await;
    let reader = tokio::spawn(read_during_churn(
        reader_proxy,
        rig.bus.address.clone(),
        soak.parent_rel.clone(),
        stop.clone(),
    ));
    let started = Instant::now();
    let mut next_checkpoint = started + CHECKPOINT_EVERY;
    while started.elapsed() < Duration::from_secs(secs) {
        soak.step().await;
        note(map_entries(&base));
        if Instant::now() >= next_checkpoint {
            soak.checkpoint(&rig, &base).await;
            next_checkpoint = Instant::now() + CHECKPOINT_EVERY;
        }
    }
    soak.checkpoint(&rig, &base).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let replies_checked = match reader.await.expect("reader task") {
        Ok(n) => n,
        Err(e) => panic!("read path under churn: {e}\n{}", rig.log_text()),
    };
    drop(reader_conn);

    // Wind down: every process and cgroup goes; then nothing may remain anywhere.
    while !soak.cgroups.is_empty() {
        soak.remove_cgroup(0).await;
    }
    let parent_rel = soak.parent_rel.clone();
    drop(soak.parent.take());
    let settled = settle(|| soak.leftovers(&base, &parent_rel)).await;
    let summary = json!({
        "seed": seed,
        "seconds": started.elapsed().as_secs(),
        "iterations": soak.n.iterations,
        "cgroups_created": soak.n.cgroups_created,
        "cgroups_removed": soak.n.cgroups_removed,
        "processes": soak.n.processes,
        "forks": soak.n.forks,
        "exits": soak.n.exits,
        "kills": soak.n.kills,
        "killed_by_limit": soak.n.killed_by_limit,
        "allocations": soak.n.allocations,
        "refused_allocations": soak.n.refused,
        "frees": soak.n.frees,
        "reopens": soak.n.reopens,
        "fd_passes": soak.n.passes,
        "double_forks": soak.n.double_forks,
        "limits_set": soak.n.limits_set,
        "limits_cleared": soak.n.limits_cleared,
        "checkpoints": soak.n.checkpoints,
        "read_replies_checked": replies_checked,
        "max_map_entries": max_entries,
        "leaks": settled.as_ref().map_or_else(|l| l.split(", ").count(), |()| 0),
    });
    println!("SOAK SUMMARY: {summary}");
    if let Err(leaks) = settled {
        panic!("leaked after the churn: {leaks}\n{}", rig.log_text());
    }
    assert!(rig.running(), "gpud died:\n{}", rig.log_text());
}
