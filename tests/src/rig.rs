//! [`Rig`]: one test's world, so that a test body is only its scenario. A scratch directory, a
//! private dbus-daemon, optionally the fake NVIDIA control device ([`crate::fakenv`]) and the fake
//! NVML (tests/fake-nvml), and the real gpud started in them with a [`TestConfig`].
//!
//! ```no_run
//! # async fn example() {
//! use gpud_tests::{Cgroup, Rig, RmProcess};
//! let Some(mut rig) = Rig::new("mem-exact").fake_device(2) else { return };
//! rig.start(rig.config().react_action("notify")).await;
//! let cg = Cgroup::new("mem-exact");
//! let mut p = RmProcess::spawn(Some(&cg.dir), &rig.ctl());
//! let (client, device) = p.client_device(0);
//! p.ok(&format!("alloc {client} {device} 4M"));
//! rig.expect_memory(&cg.rel, &[("all", 4 << 20)]).await;
//! # }
//! ```
//!
//! The rig dereferences to its running [`Daemon`] (`rig.proxy()`, `rig.log_text()`). Its parts
//! go in a fixed order: the daemon stops first, the bus and the fake go next, the directory (with
//! the daemon's bpffs) last.

use std::{
    ops::{Deref, DerefMut},
    path::{Path, PathBuf},
};

use crate::{
    Bus, Daemon, TempDir, TestConfig,
    fakenv::{self, FakeNv, Options},
    install_fake_nvml, write_nvml_scenario,
};

/// A test's scratch directory, bus, fakes and daemon (fields drop in this order).
pub struct Rig {
    daemon: Option<Daemon>,
    pub bus: Bus,
    fake: Option<FakeNv>,
    nvml: Option<PathBuf>,
    config: Option<PathBuf>,
    dir: TempDir,
}

impl Rig {
    /// A scratch directory named after `tag` and a bus that lets anyone own names and call
    /// anything.
    pub fn new(tag: &str) -> Self {
        Self::on_bus(tag, Bus::start())
    }

    /// Like [`Rig::new`] on a bus of the test's choice (e.g. [`Bus::start_system_like`]).
    pub fn on_bus(tag: &str, bus: Bus) -> Self {
        Self {
            daemon: None,
            bus,
            fake: None,
            nvml: None,
            config: None,
            dir: TempDir::new(tag),
        }
    }

    /// Mounts the fake NVIDIA control device at `<dir>/fake`: `gpus` GPUs of 1 GiB, 2 MiB pages;
    /// [`Rig::config`] counts ioctls on it. `None`, after saying why, where `/dev/fuse` is absent:
    /// `let Some(rig) = Rig::new(..).fake_device(1) else { return };`.
    pub fn fake_device(mut self, gpus: u32) -> Option<Self> {
        if !fakenv::available() {
            eprintln!("SKIPPED: /dev/fuse is absent, the fake NVIDIA device cannot be mounted");
            return None;
        }
        let opts = Options {
            gpus,
            capacity: 1 << 30,
            page_size: 2 << 20,
            verbose: false,
        };
        let fake = fakenv::mount(&self.dir.path().join("fake"), opts).expect("mount the fake");
        self.fake = Some(fake);
        Some(self)
    }

    /// Installs the fake NVML under `<dir>/nvml`, which [`Rig::config`] loads. It has no GPU until
    /// [`Rig::nvml_scenario`] writes one.
    pub fn fake_nvml(mut self) -> Self {
        let lib_dir = self.dir.path().join("nvml");
        install_fake_nvml(&lib_dir);
        self.nvml = Some(lib_dir);
        self
    }

    /// The fake NVML reporting `n` idle test GPUs (`scenario::Scenario::gpus`): gpud
    /// checks per-GPU limit selectors against NVML's inventory, so tests that set them need it.
    /// After [`Rig::start`], [`Rig::wait_for_gpus`] waits for gpud to have read it.
    pub fn fake_gpus(self, n: u32) -> Self {
        let rig = self.fake_nvml();
        rig.nvml_scenario(&crate::scenario::Scenario::gpus(n));
        rig
    }

    /// Waits until gpud lists as many GPUs as the fake NVML reports (its first sample).
    pub async fn wait_for_gpus(&self, n: u32) {
        let (_c, p) = self.proxy().await;
        let up = crate::eventually(std::time::Duration::from_secs(15), || async {
            (p.list_gpus().await.ok()?.len() == n as usize).then_some(())
        })
        .await;
        assert!(up.is_some(), "NVML never came up:\n{}", self.log_text());
    }

    /// The scratch directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// An empty regular file in the directory, to list in `devices.extra_paths` as a stand-in
    /// control device: gpud counts the NVIDIA-encoded ioctls on it (which fail with ENOTTY).
    pub fn stand_in(&self, name: &str) -> PathBuf {
        let p = self.path().join(name);
        std::fs::write(&p, b"").expect("stand-in file");
        p
    }

    /// The fake NVIDIA device; panics unless [`Rig::fake_device`] mounted it.
    pub fn fake(&self) -> &FakeNv {
        self.fake.as_ref().expect("the rig has no fake device")
    }

    /// The fake device's control file (its `/dev/nvidiactl`).
    pub fn ctl(&self) -> PathBuf {
        self.fake().ctl()
    }

    /// The fake NVML's directory (the library and its scenario); panics without
    /// [`Rig::fake_nvml`].
    pub fn nvml_dir(&self) -> &Path {
        self.nvml.as_deref().expect("the rig has no fake NVML")
    }

    /// Replaces the fake NVML's scenario (GPUs, processes, failures; see tests/fake-nvml). The
    /// daemon sees it at its next sample.
    pub fn nvml_scenario(&self, scenario: &crate::scenario::Scenario) {
        write_nvml_scenario(self.nvml_dir(), scenario);
    }

    /// The test baseline ([`TestConfig::new`]) in this rig's directory, with the fake device in
    /// `devices.extra_paths` and the fake NVML as `nvml.library_path` where the rig has them.
    pub fn config(&self) -> TestConfig {
        let mut c = TestConfig::new(self.path());
        if let Some(fake) = &self.fake {
            c = c.extra_paths([fake.ctl()]);
        }
        if let Some(lib_dir) = &self.nvml {
            c = c.nvml(&lib_dir.join("libnvidia-ml.so.1"));
        }
        c
    }

    /// `<bpffs>/gpud/v<ABI>`, where the daemon pins its maps.
    pub fn pins(&self) -> PathBuf {
        gpud::probes::Probes::pin_base(&self.path().join("bpffs"))
    }

    /// Writes `config` as `<dir>/gpud.toml` and starts gpud on it; returns once it answers.
    pub async fn start(&mut self, config: TestConfig) {
        self.start_wrapped(config, &[], &[]).await;
    }

    /// [`Rig::start`] with environment changes (see [`Daemon::start_with_env`]).
    pub async fn start_with_env(&mut self, config: TestConfig, env: &[(&str, Option<&str>)]) {
        self.start_wrapped(config, env, &[]).await;
    }

    /// [`Rig::start`] through a wrapper command (see [`Daemon::start_wrapped`]).
    pub async fn start_wrapped(
        &mut self,
        config: TestConfig,
        env: &[(&str, Option<&str>)],
        wrapper: &[String],
    ) {
        let path = config.write();
        self.daemon = Some(Daemon::start_wrapped(&path, &self.bus.address, env, wrapper).await);
        self.config = Some(path);
    }

    /// Stops the daemon if it still runs and starts a new one on the same configuration file (the
    /// same state directory and bpffs).
    pub async fn restart(&mut self) {
        if let Some(mut old) = self.daemon.take() {
            old.stop();
        }
        let path = self.config_path().to_owned();
        self.daemon = Some(Daemon::start(&path, &self.bus.address).await);
    }

    /// The configuration file the daemon was started with.
    pub fn config_path(&self) -> &Path {
        self.config
            .as_deref()
            .expect("the rig's daemon was never started")
    }
}

impl Deref for Rig {
    type Target = Daemon;

    fn deref(&self) -> &Daemon {
        self.daemon
            .as_ref()
            .expect("the rig's daemon is not started")
    }
}

impl DerefMut for Rig {
    fn deref_mut(&mut self) -> &mut Daemon {
        self.daemon
            .as_mut()
            .expect("the rig's daemon is not started")
    }
}
