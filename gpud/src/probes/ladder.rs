//! The ladder of pre-driver hooks (`lsm` → `fmod_ret` → `kprobe`, not built → `none`): each
//! probed at start by loading and attaching a pass-through program, the first the kernel accepts
//! in force, and why each above it is not.

use super::*;

/// The ladder of pre-driver hooks as probed at start: the hook in force and, for each hook above
/// it, why it is not (the kernel's refusal: errno and verifier line, or what the kernel lacks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookLadder {
    pub in_force: DenyHook,
    /// Hooks above the one in force, in ladder order, with the reason each is not used.
    pub refused: Vec<(DenyHook, String)>,
}

impl HookLadder {
    /// Each refused hook and why, on one line.
    pub fn summary(&self) -> String {
        self.refused
            .iter()
            .map(|(h, why)| format!("{}: {why}", h.as_str()))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The refusals keyed by hook name, as reported on D-Bus (`a{ss}`).
    pub fn refusals(&self) -> std::collections::BTreeMap<String, String> {
        self.refused
            .iter()
            .map(|(h, why)| (h.as_str().to_owned(), why.clone()))
            .collect()
    }
}

/// What the ladder of pre-driver hooks is climbed with.
pub(super) struct LadderInputs<'a> {
    pub(super) preference: DenyHookPreference,
    pub(super) tier: TierPreference,
    pub(super) mode: AttachMode,
    /// Why the fentry probe did not load, where it did not.
    pub(super) fentry_refusal: Option<&'a str>,
    pub(super) attach: AttachPreference,
}

/// Why the kprobe hook is not offered.
const KPROBE_NOT_BUILT: &str = "not built: kprobe + bpf_override_return needs \
    CONFIG_BPF_KPROBE_OVERRIDE, which neither kernel gpud is tested on has (Debian 12, the CI \
    host), so it could not be tested";

/// Probes every hook of the ladder by loading and attaching a program that lets every call
/// through, then picks the hook in force from the preference and the tier. Also returns the
/// object relocated for fmod_ret loads, when that hook is in force.
pub(super) fn climb_ladder(
    ebpf: &mut Ebpf,
    btf: &aya::Btf,
    input: &LadderInputs<'_>,
) -> Result<(HookLadder, [bool; 2], Option<modify_return::Relocated>), ProbeError> {
    // Both hooks run on BPF trampolines, which the probes' own fentry mode needs too.
    let trampolines = match (input.mode, input.attach, input.fentry_refusal) {
        (AttachMode::Fentry, ..) => Ok(()),
        (_, AttachPreference::Tracepoint, _) => Err(
            "it runs on BPF trampolines and the probes attach by tracepoint \
             (probes.attach = \"tracepoint\")"
                .to_owned(),
        ),
        (_, _, why) => Err(format!(
            "the kernel refuses BPF trampolines: {}",
            caps::load_refusal(why.unwrap_or("fentry did not load"))
        )),
    };
    let lsm = trampolines.clone().and_then(|()| probe_lsm(ebpf, btf));
    let (fmod_ret, relocated) = match trampolines.and_then(|()| probe_modify_return(ebpf, btf)) {
        Ok(r) => (Ok(()), Some(r)),
        Err(why) => (Err(why), None),
    };
    let results = [
        (DenyHook::Lsm, lsm),
        (DenyHook::FmodRet, fmod_ret),
        (DenyHook::Kprobe, Err(KPROBE_NOT_BUILT.to_owned())),
    ];
    let works = [results[0].1.is_ok(), results[1].1.is_ok()];
    let not_used = match (input.tier, input.preference) {
        (TierPreference::React | TierPreference::Dmem, _) => Some(format!(
            "not used: enforcement.tier = \"{}\"",
            if input.tier == TierPreference::React {
                "react"
            } else {
                "dmem"
            }
        )),
        (_, DenyHookPreference::Auto) => None,
        (_, p) => Some(format!(
            "not used: enforcement.deny_hook = \"{}\"",
            p.as_str()
        )),
    };
    let wanted = match (input.tier, input.preference) {
        (TierPreference::React | TierPreference::Dmem, _) | (_, DenyHookPreference::None) => None,
        (_, DenyHookPreference::Auto) => results.iter().find(|(_, r)| r.is_ok()).map(|(h, _)| *h),
        (_, DenyHookPreference::Lsm) => Some(DenyHook::Lsm),
        (_, DenyHookPreference::FmodRet) => Some(DenyHook::FmodRet),
        (_, DenyHookPreference::Kprobe) => Some(DenyHook::Kprobe),
    };
    if let Some(hook) = wanted
        && let Some((_, Err(why))) = results.iter().find(|(h, _)| *h == hook)
    {
        return Err(ProbeError::DenyHookRefused {
            hook: hook.as_str(),
            reason: why.clone(),
        });
    }
    let in_force = wanted.unwrap_or(DenyHook::None);
    let refused = results
        .into_iter()
        .take_while(|(h, _)| *h != in_force)
        .map(|(h, r)| {
            let why = match (r, &not_used) {
                (Err(why), _) => why,
                (Ok(()), Some(why)) => why.clone(),
                (Ok(()), None) => "not used".to_owned(),
            };
            (h, why)
        })
        .collect();
    let relocated = relocated.filter(|_| in_force == DenyHook::FmodRet);
    Ok((HookLadder { in_force, refused }, works, relocated))
}

/// The BPF-LSM hook: `bpf` in the LSM list (otherwise its programs load and attach but never
/// run), and a pass-through program loads and attaches.
pub(super) fn probe_lsm(ebpf: &mut Ebpf, btf: &aya::Btf) -> Result<(), String> {
    if !caps::bpf_in_lsm_list() {
        let list = std::fs::read_to_string("/sys/kernel/security/lsm")
            .map(|l| l.trim().to_owned())
            .unwrap_or_else(|e| format!("unreadable: {e}"));
        return Err(format!(
            "`bpf` is not in the kernel's LSM list ({list}), so BPF-LSM programs never run \
             (boot with lsm=…,bpf)"
        ));
    }
    load_probe(ebpf, programs::LSM_PROBE, |p: &mut Lsm| {
        p.load("file_ioctl", btf)
    })
    .map_err(|e| caps::load_refusal(&e))?;
    let p: &mut Lsm = ebpf
        .program_mut(programs::LSM_PROBE)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| ProbeError::NoProgram(programs::LSM_PROBE).to_string())?;
    let id = p
        .attach()
        .map_err(|e| caps::load_refusal(&Chain(&e).to_string()))?;
    // The probe lets every call through; detached at once.
    p.detach(id)
        .map_err(|e| caps::load_refusal(&Chain(&e).to_string()))
}

/// The fmod_ret hook: a pass-through program loads as `BPF_MODIFY_RETURN` on
/// `security_file_ioctl` and attaches (dropping the link detaches it).
pub(super) fn probe_modify_return(
    ebpf: &Ebpf,
    btf: &aya::Btf,
) -> Result<modify_return::Relocated, String> {
    let relocated =
        modify_return::Relocated::new(OBJECT, ebpf, btf).map_err(|e| Chain(&e).to_string())?;
    let func = "security_file_ioctl";
    let prog = relocated
        .load(programs::FMODRET_PROBE, func, btf)
        .map_err(|e| Chain(&e).to_string())?;
    modify_return::attach(&prog, programs::FMODRET_PROBE, func)
        .map_err(|e| Chain(&e).to_string())?;
    Ok(relocated)
}

/// Loads a program to learn whether the kernel accepts its type; a refusal is an answer, not an
/// error.
pub(super) fn try_load<P>(
    ebpf: &mut Ebpf,
    name: &'static str,
    load: impl FnOnce(&mut P) -> Result<(), aya::programs::ProgramError>,
) -> bool
where
    for<'a> &'a mut P: TryFrom<&'a mut aya::programs::Program>,
{
    load_probe(ebpf, name, load).is_ok()
}

/// [`try_load`] that keeps the refusal (the whole chain, verifier log included).
pub(super) fn load_probe<P>(
    ebpf: &mut Ebpf,
    name: &'static str,
    load: impl FnOnce(&mut P) -> Result<(), aya::programs::ProgramError>,
) -> Result<(), String>
where
    for<'a> &'a mut P: TryFrom<&'a mut aya::programs::Program>,
{
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| ProbeError::NoProgram(name).to_string())?;
    let p = <&mut P>::try_from(prog)
        .map_err(|_| format!("`{name}` is not of the expected program type"))?;
    load(p).map_err(|e| {
        let e = Chain(&e).to_string();
        debug!(program = name, "probe load refused: {e}");
        e
    })
}
