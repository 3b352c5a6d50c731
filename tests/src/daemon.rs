//! The real `gpud` binary as a test runs it ([`Daemon`]): started on a bus and waited for,
//! signalled, stopped, and asked over D-Bus through the typed proxy.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{CgroupRecord, Manager1Proxy, connect_builder, eventually, gpud_bin};

/// A running `gpud` on a private bus and its own bpffs instance.
pub struct Daemon {
    child: Option<Child>,
    pub config: PathBuf,
    pub bus: String,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts gpud and waits until it answers on the bus.
    pub async fn start(config: &Path, bus: &str) -> Self {
        Self::start_with_env(config, bus, &[]).await
    }

    /// Like [`Daemon::start`], with environment changes: `(name, Some(value))` sets a variable,
    /// `(name, None)` removes it (e.g. `NOTIFY_SOCKET`, `WATCHDOG_USEC`, `RUST_LOG`).
    pub async fn start_with_env(config: &Path, bus: &str, env: &[(&str, Option<&str>)]) -> Self {
        Self::start_wrapped(config, bus, env, &[]).await
    }

    /// Like [`Daemon::start_with_env`], run through `wrapper` (a command that ends by exec'ing
    /// its arguments, e.g. `setpriv ... --`): the daemon's pid is the wrapper's.
    pub async fn start_wrapped(
        config: &Path,
        bus: &str,
        env: &[(&str, Option<&str>)],
        wrapper: &[String],
    ) -> Self {
        static STARTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = config.with_file_name(format!("gpud-{n}.log"));
        let log_file = std::fs::File::create(&log).expect("log file");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(gpud_bin());
                c
            }
            None => Command::new(gpud_bin()),
        };
        for (name, value) in env {
            match value {
                Some(v) => cmd.env(name, v),
                None => cmd.env_remove(name),
            };
        }
        let child = cmd
            .arg("--config")
            .arg(config)
            .arg("--bus-address")
            .arg(bus)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", gpud_bin().display()));
        let mut d = Self {
            child: Some(child),
            config: config.to_owned(),
            bus: bus.to_owned(),
            log,
        };
        d.wait_ready().await;
        d
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!("gpud exited early ({status}):\n{}", self.log_text());
            }
            if let Ok(conn) = connect_builder(&self.bus).build().await
                && let Ok(p) = Manager1Proxy::new(&conn).await
                && p.version().await.is_ok()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "gpud not ready:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls `f` until it returns `Some` (for at most `timeout`); panics naming `what`, with the
    /// daemon's log, if it never does.
    pub async fn expect_eventually<T, F, Fut>(&self, what: &str, timeout: Duration, f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        match eventually(timeout, f).await {
            Some(v) => v,
            None => panic!("{what}: not within {timeout:?}:\n{}", self.log_text()),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (e.g. `libc::SIGHUP`) to the daemon.
    pub fn signal(&self, signal: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: plain kill(2) on our own (unreaped) child.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }

    /// Whether the daemon is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM and wait; returns the exit status code.
    pub fn stop(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().ok().and_then(|s| s.code())
    }

    pub async fn proxy(&self) -> (zbus::Connection, Manager1Proxy<'static>) {
        let conn = connect_builder(&self.bus).build().await.expect("connect");
        let proxy = Manager1Proxy::new(&conn).await.expect("proxy");
        (conn, proxy)
    }

    /// `GetCgroup(path)`, which must succeed.
    pub async fn get_cgroup(&self, path: &str) -> CgroupRecord {
        let (_c, p) = self.proxy().await;
        p.get_cgroup(path).await.expect("GetCgroup")
    }

    /// Waits until gpud's `memory_current` of `path` holds `want` (bytes by GPU name, `"all"`
    /// for the sum) and returns the record; panics with what it holds instead.
    pub async fn expect_memory(&self, path: &str, want: &[(&str, u64)]) -> CgroupRecord {
        let bytes = |r: &CgroupRecord, gpu: &str| r.memory_current.get(gpu).copied().unwrap_or(0);
        let got = eventually(Duration::from_secs(10), || async {
            let (_c, p) = self.proxy().await;
            let r = p.get_cgroup(path).await.ok()?;
            want.iter().all(|(g, b)| bytes(&r, g) == *b).then_some(r)
        })
        .await;
        if let Some(r) = got {
            return r;
        }
        let (_c, p) = self.proxy().await;
        let have = p.get_cgroup(path).await.map(|r| r.memory_current);
        panic!(
            "{path}: gpud says {have:?}, wanted {want:?}\n{}",
            self.log_text()
        )
    }

    /// `SetLimits(cgroup, gpu, {name: value})`, which must succeed.
    pub async fn set_limit<'a>(
        &self,
        cgroup: &str,
        gpu: &str,
        name: &str,
        value: impl Into<zbus::Variant<'a>>,
    ) {
        let (_c, p) = self.proxy().await;
        p.set_limits(cgroup, gpu, BTreeMap::from([(name, value.into())]))
            .await
            .unwrap_or_else(|e| panic!("SetLimits {cgroup} {gpu} {name}: {e}"));
    }

    /// The memory limits in force in the kernel for `cgroup` (`GetCgroup`'s `memory_max`), by
    /// GPU key; empty when there is no such cgroup.
    pub async fn in_force(&self, cgroup: &str) -> BTreeMap<String, u64> {
        let (_c, p) = self.proxy().await;
        p.get_cgroup(cgroup)
            .await
            .map(|r| r.memory_max)
            .unwrap_or_default()
    }

    /// Waits up to 10 s until [`Self::in_force`] of `cgroup` is `want` (bytes by GPU key);
    /// panics with what is there and the log otherwise.
    pub async fn expect_in_force(&self, cgroup: &str, want: &[(&str, u64)]) {
        let want: BTreeMap<String, u64> = want.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
        let got = crate::eventually(std::time::Duration::from_secs(10), || async {
            (self.in_force(cgroup).await == want).then_some(())
        })
        .await;
        if got.is_none() {
            panic!(
                "{cgroup}: in force {:?}, wanted {want:?}\n{}",
                self.in_force(cgroup).await,
                self.log_text()
            );
        }
    }

    /// The limits gpud lists for `cgroup`: by GPU selector, by limit name.
    pub async fn limits(&self, cgroup: &str) -> BTreeMap<String, BTreeMap<String, u64>> {
        let (_c, p) = self.proxy().await;
        p.list_limits()
            .await
            .expect("ListLimits")
            .into_iter()
            .filter(|l| l.cgroup == cgroup)
            .map(|l| (l.gpu, l.limits))
            .collect()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}
