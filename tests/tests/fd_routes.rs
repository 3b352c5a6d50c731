//! Attribution of GPU memory whichever way a control file travels between processes: a double
//! fork, SCM_RIGHTS to a process in another cgroup, a free made by the receiver, `dup2`. The
//! rule under test (docs/design.md, "Release rule"): an object is charged to the cgroup of the
//! process that allocated it for as long as the driver holds it, whoever holds the file
//! afterwards; it is released only by an `RM_FREE` or the file's last reference going, never
//! because its creator died. At every step gpud's figures are compared, to the byte, with the
//! fake driver's own ledger of live allocations, and nothing may be charged to GPU "unknown".
//! Each route also runs with the daemon restarted while the file is held by someone else.

use std::time::Duration;

use gpud_tests::{Cgroup, Rig, RmProcess};
use rstest::rstest;

const MIB: u64 = 1 << 20;

/// A daemon on the fake device, sweeping every second, whose kernel maps survive a restart.
async fn started(tag: &str) -> Option<Rig> {
    let mut rig = Rig::new(tag).fake_device(1)?;
    let config = rig.config().keep_pinned(true);
    rig.start(config).await;
    Some(rig)
}

/// One step's check: each cgroup holds what the fake driver's ledger says its processes
/// (`pids`: every process that allocated from it) hold, nothing is on GPU "unknown", and the
/// cgroups account for everything the driver holds.
async fn agree(rig: &Rig, cgroups: &[(&Cgroup, &[u32])]) {
    let snapshot = rig.fake().snapshot();
    let mut total = 0;
    for (cg, pids) in cgroups {
        let held = snapshot.held_by(pids);
        total += held;
        rig.expect_memory(&cg.rel, &[("all", held), ("0", held), ("unknown", 0)])
            .await;
    }
    assert_eq!(
        total,
        snapshot.used_total(),
        "the driver holds bytes no tested cgroup is charged with: {snapshot:?}"
    );
}

/// Waits long enough for two periodic sweeps (and their checks of control files) to run.
async fn two_sweeps() {
    tokio::time::sleep(Duration::from_millis(2_500)).await;
}

#[derive(Clone, Copy, Debug)]
enum Route {
    /// The creator forks a child, which forks a grandchild and exits; the creator exits too.
    DoubleFork,
    /// The creator sends its descriptor to a process in another cgroup and exits first.
    ScmRights,
    /// As `ScmRights`, and the receiver frees an object the sender allocated.
    FreedByReceiver,
    /// The creator `dup2`s its descriptor and closes the original.
    Dup2,
}

#[rstest]
#[case::double_fork(Route::DoubleFork, false)]
#[case::double_fork_across_a_restart(Route::DoubleFork, true)]
#[case::scm_rights(Route::ScmRights, false)]
#[case::scm_rights_across_a_restart(Route::ScmRights, true)]
#[case::freed_by_the_receiver(Route::FreedByReceiver, false)]
#[case::freed_by_the_receiver_across_a_restart(Route::FreedByReceiver, true)]
#[case::dup2(Route::Dup2, false)]
#[case::dup2_across_a_restart(Route::Dup2, true)]
#[tokio::test(flavor = "multi_thread")]
async fn memory_stays_charged_to_its_allocator_while_the_driver_holds_it(
    #[case] route: Route,
    #[case] restart: bool,
) {
    let tag = format!("fd-{route:?}-{restart}").to_lowercase();
    let Some(mut rig) = started(&tag).await else {
        return;
    };
    let ctl = rig.ctl();
    let a = Cgroup::new(&format!("{tag}-a"));
    let b = Cgroup::new(&format!("{tag}-b"));

    let mut creator = RmProcess::spawn(Some(&a.dir), &ctl);
    let creator_pid = creator.pid;
    let (c, d) = creator.client_device(0);
    let kept = creator.handle(&format!("alloc {c} {d} {}", 8 * MIB));
    let freed = creator.handle(&format!("alloc {c} {d} {}", 6 * MIB));
    agree(&rig, &[(&a, &[creator_pid])]).await;

    // The file moves on; `holder` ends up with the only descriptor, in cgroup `holder_cg`.
    let (mut holder, holder_cg) = match route {
        Route::DoubleFork => {
            let child = creator.handoff();
            let grandchild = creator.handoff();
            assert_ne!(child, grandchild);
            (creator, &a)
        }
        Route::ScmRights | Route::FreedByReceiver => {
            let socket = rig.path().join("pass.sock");
            let mut receiver = RmProcess::spawn_without_file(Some(&b.dir));
            receiver.ok(&format!("listen {}", socket.display()));
            receiver.send("recv-fd");
            creator.ok(&format!("send-fd {}", socket.display()));
            let got = receiver.recv();
            assert_eq!(got["ok"], true, "{got}");
            // The sender leaves first; the driver keeps its client (the receiver holds the file).
            creator.ok("exit");
            creator.wait();
            (receiver, &b)
        }
        Route::Dup2 => {
            let fd = creator.ok("dup2")["fd"].as_u64();
            assert!(fd.is_some_and(|fd| fd >= 100), "dup2 answered {fd:?}");
            (creator, &a)
        }
    };
    let everyone = [creator_pid, holder.pid];
    let cgroups: Vec<(&Cgroup, &[u32])> = if std::ptr::eq(holder_cg, &a) {
        vec![(&a, &everyone)]
    } else {
        vec![(&a, &everyone[..1]), (&b, &everyone[1..])]
    };
    two_sweeps().await;
    agree(&rig, &cgroups).await;
    assert_eq!(
        rig.fake().snapshot().held_by(&[creator_pid]),
        14 * MIB,
        "the driver kept the creator's memory"
    );

    if restart {
        rig.restart().await;
        agree(&rig, &cgroups).await;
    }

    // The holder allocates under the creator's client: charged to the holder's own cgroup, at
    // once (the first NVIDIA call of a process that received a file makes it tracked).
    holder.ok(&format!("alloc {c} {d} {}", 4 * MIB));
    agree(&rig, &cgroups).await;

    // A free through the held file, whoever issues it, uncharges the allocator's cgroup.
    if matches!(route, Route::FreedByReceiver | Route::DoubleFork) {
        holder.ok(&format!("free {c} {freed}"));
        agree(&rig, &cgroups).await;
        assert!(
            rig.fake().snapshot().object(c, freed).is_none(),
            "the driver freed it"
        );
    }
    two_sweeps().await;
    agree(&rig, &cgroups).await;
    assert!(rig.fake().snapshot().object(c, kept).is_some());

    // The last holder goes: the driver frees the clients with the file, and so does gpud.
    holder.ok("exit");
    if !matches!(route, Route::DoubleFork) {
        holder.wait();
    }
    rig.fake()
        .wait(Duration::from_secs(5), |s| s.used_total() == 0)
        .expect("the fake driver freed everything with the file");
    agree(&rig, &cgroups).await;
    rig.expect_memory(&a.rel, &[("all", 0)]).await;
    rig.expect_memory(&b.rel, &[("all", 0)]).await;
}

/// The last reference to a file can go where no probe sees it: here a receiver that never called
/// the driver (so is not tracked) closes it. The periodic check of control files finds it gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_file_released_by_a_process_gpud_does_not_track_is_found_released() {
    let Some(rig) = started("fd-untracked-close").await else {
        return;
    };
    let a = Cgroup::new("fd-untracked-close-a");
    let b = Cgroup::new("fd-untracked-close-b");
    let mut sender = RmProcess::spawn(Some(&a.dir), &rig.ctl());
    let (c, d) = sender.client_device(0);
    sender.ok(&format!("alloc {c} {d} {}", 8 * MIB));
    let socket = rig.path().join("pass.sock");
    let mut receiver = RmProcess::spawn_without_file(Some(&b.dir));
    receiver.ok(&format!("listen {}", socket.display()));
    receiver.send("recv-fd");
    sender.ok(&format!("send-fd {}", socket.display()));
    assert_eq!(receiver.recv()["ok"], true);
    sender.ok("exit");
    sender.wait();
    two_sweeps().await;
    agree(&rig, &[(&a, &[sender.pid])]).await;
    receiver.ok("close");
    rig.fake()
        .wait(Duration::from_secs(5), |s| s.used_total() == 0)
        .expect("the fake driver freed the client with the file");
    agree(&rig, &[(&a, &[sender.pid])]).await;
}
