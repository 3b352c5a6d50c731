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
