//! The fake NVML for tests: installing the library where `nvml.library_path` points, and
//! writing its scenario beside it (typed, from [`crate::scenario`]).

use std::path::{Path, PathBuf};

use crate::{
    bin_dir,
    scenario::{Process, Scenario},
};

/// Copies the fake NVML library (tests/fake-nvml) to `lib_dir/libnvidia-ml.so.1`, where a test
/// points `nvml.library_path`; its scenario goes beside it ([`write_nvml_scenario`]).
pub fn install_fake_nvml(lib_dir: &Path) -> PathBuf {
    std::fs::create_dir_all(lib_dir).expect("lib dir");
    let dst = lib_dir.join("libnvidia-ml.so.1");
    std::fs::copy(bin_dir().join("libnvidia_ml_fake.so"), &dst)
        .expect("copy the fake NVML library (is fake-nvml built?)");
    dst
}

/// A fake-NVML scenario of one test GPU (`scenario::Gpu::test(0)`) named `name`, with
/// `processes`.
pub fn one_gpu(name: &str, processes: impl IntoIterator<Item = Process>) -> Scenario {
    let mut s = Scenario::gpus(1).with(processes);
    s.gpus[0].name = name.to_owned();
    s
}

/// [`Scenario::gpus`] with these processes, (pid, GPU index), each holding 1 GiB; with no
/// `sm_util` given, each reports its CPU share as its SM utilization (the fake NVML's simulated
/// GPU users).
pub fn gpus_with(n: u32, processes: &[(u32, u32)]) -> Scenario {
    Scenario::gpus(n).with(
        processes
            .iter()
            .map(|&(pid, gpu)| Process::on(pid, gpu, 1 << 30)),
    )
}

/// Writes the fake NVML's scenario beside it (write then rename: never read half-written).
pub fn write_nvml_scenario(lib_dir: &Path, scenario: &Scenario) {
    std::fs::create_dir_all(lib_dir).expect("lib dir");
    let tmp = lib_dir.join("fake-nvml.json.tmp");
    let text = serde_json::to_string(scenario).expect("a scenario serializes");
    std::fs::write(&tmp, text).expect("scenario");
    std::fs::rename(&tmp, lib_dir.join("fake-nvml.json")).expect("scenario");
}

/// The fake NVML reporting what the fake driver holds, as the real NVML reports RM's own
/// per-process figures: every 100 ms, one process row per process and GPU holding video
/// memory in the fake driver's ledger (its `state` file in `fake_dir`), over `gpus` GPUs.
/// Stops when dropped.
pub struct LedgerNvml {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LedgerNvml {
    pub fn follow(fake_dir: &Path, lib_dir: &Path, gpus: u32) -> Self {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (fake_dir, lib_dir, stopping) = (fake_dir.to_owned(), lib_dir.to_owned(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut last = None;
            while !stopping.load(Ordering::Relaxed) {
                if let Ok(s) = crate::fakenv::read_state(&fake_dir) {
                    let mut held = std::collections::BTreeMap::<(u32, u32), u64>::new();
                    let mut seen = std::collections::BTreeSet::new();
                    // Each allocation once, as `Snapshot::held_by` counts it.
                    for o in s.memory().filter(|o| o.mem == 0 || seen.insert(o.mem)) {
                        *held.entry((o.pid, o.gpu.unwrap_or(0))).or_default() += o.bytes;
                    }
                    if last.as_ref() != Some(&held) {
                        let rows = held
                            .iter()
                            .map(|(&(pid, gpu), &b)| Process::on(pid, gpu, b));
                        write_nvml_scenario(&lib_dir, &Scenario::gpus(gpus).with(rows));
                        last = Some(held);
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for LedgerNvml {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
