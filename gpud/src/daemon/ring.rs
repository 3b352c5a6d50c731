//! The probes' event ring buffer: each record decoded once ([`Record::decode`]) and forwarded,
//! in batches, to the state task; undo requests and limit crossings straight to the restorer.

use aya::maps::{MapData, RingBuf};
use tokio::{io::unix::AsyncFd, sync::mpsc};
use tracing::warn;

use super::messages::Message;
use crate::probes::events::{KernelEvent, Record};

/// Reads every record waiting in `ring`, each decoded once: events appended to `events`, undo
/// and read-back requests handed to `requests`, undecodable records logged. The one loop over
/// the ring, for the daemon's reader and for callers without a state task
/// ([`super::core::Core::drain`]). Returns the records read.
pub(super) fn read_records(
    ring: &mut RingBuf<MapData>,
    events: &mut Vec<KernelEvent>,
    mut requests: impl FnMut(Record),
) -> usize {
    let mut read = 0;
    while let Some(item) = ring.next() {
        read += 1;
        match Record::decode(&item) {
            Ok(Record::Event(ev)) => events.push(ev),
            Ok(other) => requests(other),
            Err(e) => warn!(len = item.len(), "ring-buffer record dropped: {e}"),
        }
    }
    read
}

/// Most events in one message to the state task: a message is handled whole, and the API's
/// changes wait for at most the one in hand.
const BATCH: usize = 256;

/// Forwards ring-buffer records to the state task, in batches of what one read found (the state
/// task handles a batch's file releases together), until the channel closes.
/// Undo and read-back requests go to `restore` at once, not through the state task. After an
/// upgrade, `previous` (the ring of the probes taken over, whose programs are detached) is read
/// first:
/// what its programs sent while no daemon read it, and while both sets of programs ran, is
/// handled like the ring's own records (a release or a crossing handled twice changes nothing
/// the second time).
pub(super) async fn read_events(
    ring: RingBuf<MapData>,
    previous: Option<RingBuf<MapData>>,
    tx: mpsc::Sender<Message>,
    restore: Option<crate::enforcement::restore::RestoreSender>,
) -> std::io::Result<()> {
    if let Some(mut previous) = previous {
        let n = forward(&mut previous, &tx, restore.as_ref()).await;
        tracing::info!(records = n, "read the event ring of the probes taken over");
    }
    // SAFETY: the ring buffer owns its map fd for as long as the AsyncFd owns the ring buffer.
    let mut fd = unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1)?;
    loop {
        let mut guard = fd.readable_mut().await?;
        let sent = forward(guard.get_inner_mut(), &tx, restore.as_ref()).await;
        guard.clear_ready();
        if sent.is_none() {
            return Ok(());
        }
    }
}

/// Reads what `ring` holds and forwards it (see [`read_events`]); the records read, or `None`
/// once the state task is gone.
async fn forward(
    ring: &mut RingBuf<MapData>,
    tx: &mpsc::Sender<Message>,
    restore: Option<&crate::enforcement::restore::RestoreSender>,
) -> Option<usize> {
    let mut batch = Vec::new();
    let read = read_records(ring, &mut batch, |r| match (r, restore) {
        // Never blocks: coalesced and bounded.
        (Record::Undo(r), Some(tx)) => tx.send(r),
        (Record::ReadBack(r), Some(tx)) => tx.read_back(r),
        (Record::Undo(r), None) => {
            warn!(pid = r.pid(), "a tenant's control to undo, and no restorer");
        }
        (Record::ReadBack(r), None) => {
            warn!(
                pid = r.pid,
                "a tenant's control to read back, and no restorer"
            );
        }
        (Record::SizeCheck(c), Some(tx)) => tx.check_size(c),
        (Record::SizeCheck(c), None) => {
            warn!(
                pid = c.pid,
                "a limited tenant's allocation to read back, and no restorer"
            );
        }
        (Record::DeviceCheck(c), Some(tx)) => tx.check_device(c),
        (Record::DeviceCheck(c), None) => {
            warn!(
                pid = c.pid,
                "a limited tenant's device to read back, and no restorer"
            );
        }
        (Record::FreeCheck(c), Some(tx)) => tx.check_free(c),
        (Record::FreeCheck(c), None) => {
            warn!(
                pid = c.pid,
                "a limited tenant's free to read back, and no restorer"
            );
        }
        (Record::Event(_), _) => {}
    });
    // A crossing's allocation may outlive its killed caller in another holder's file.
    if let Some(tx) = restore {
        for ev in &batch {
            if let KernelEvent::LimitCrossed(l) = ev {
                tx.crossing(*l);
            }
        }
    }
    while !batch.is_empty() {
        let rest = batch.split_off(batch.len().min(BATCH));
        if tx.send(Message::Kernel(batch)).await.is_err() {
            return None;
        }
        batch = rest;
    }
    Some(read)
}
