//! One soak run: the churn (cgroups and processes made, allocating, forking, exiting, killed),
//! its checkpoints against the fake driver, and what it reports.

use super::*;

pub(crate) struct Soak<'a> {
    pub(crate) rng: Rng,
    pub(crate) fake: &'a FakeNv,
    pub(crate) ctl: PathBuf,
    /// The soak's cgroup, above all others; taken (removed) at the end.
    pub(crate) parent: Option<Cgroup>,
    pub(crate) parent_dir: PathBuf,
    pub(crate) parent_rel: String,
    /// Where the unix sockets of fd passing are made.
    pub(crate) sockets: PathBuf,
    pub(crate) cgroups: Vec<Cg>,
    pub(crate) next_cg: u32,
    /// ids of the cgroups above the soak's (they outlive it).
    pub(crate) ancestors: HashSet<u64>,
    /// Every pid that allocated, to the cgroup it allocated in.
    pub(crate) owner: HashMap<u32, String>,
    pub(crate) n: Counts,
    pub(crate) proxy: Manager1Proxy<'static>,
    pub(crate) _conn: zbus::Connection,
}

impl Soak<'_> {
    pub(crate) fn new_cgroup(&mut self) {
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

    pub(crate) fn spawn(&mut self, c: usize) {
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
    pub(crate) fn alloc(rng: &mut Rng, n: &mut Counts, p: &mut Proc) -> Option<Value> {
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

    pub(crate) fn free(rng: &mut Rng, n: &mut Counts, p: &mut Proc) -> Option<()> {
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
    pub(crate) fn bury(&mut self, c: usize, i: usize) {
        let mut p = self.cgroups[c].procs.swap_remove(i);
        let st = p.rm.wait();
        assert!(!st.success() || st.code().is_some(), "{st}");
        self.n.killed_by_limit += 1;
    }

    /// Random process: (cgroup, index).
    pub(crate) fn pick_proc(&mut self) -> Option<(usize, usize)> {
        let all: Vec<(usize, usize)> = self
            .cgroups
            .iter()
            .enumerate()
            .flat_map(|(c, cg)| (0..cg.procs.len()).map(move |i| (c, i)))
            .collect();
        (!all.is_empty()).then(|| all[self.rng.below(all.len())])
    }

    pub(crate) async fn step(&mut self) {
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
    pub(crate) fn fork(&mut self) {
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
    pub(crate) fn pass(&mut self) {
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
    pub(crate) fn daemonize(&mut self) {
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

    pub(crate) async fn remove_cgroup(&mut self, c: usize) {
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
    pub(crate) async fn compare(&self) -> Result<(), String> {
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

    pub(crate) async fn checkpoint(&mut self, daemon: &Daemon, base: &Path) {
        self.n.checkpoints += 1;
        let r = settle(|| self.compare()).await;
        if let Err(e) = r {
            let parent = std::fs::metadata(&self.parent_dir).map_or(0, |m| m.ino());
            let kernel: Vec<String> = pinned::<u64, CgroupUsage>(base, maps::USAGE)
                .into_iter()
                .filter(|(id, _)| *id == parent)
                .flat_map(|(_, r)| r.charged().collect::<Vec<_>>())
                .map(|(gpu, b)| format!("{gpu:#x}={b}"))
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
    pub(crate) async fn leftovers(&self, base: &Path, parent_rel: &str) -> Result<(), String> {
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
                pinned::<u64, CgroupUsage>(base, maps::USAGE)
                    .into_iter()
                    .filter(|(id, r)| !r.is_empty() || !self.ancestors.contains(id))
                    .map(|(id, r)| format!("USAGE {id}: {:?}", r.charged().collect::<Vec<_>>())),
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
