//! The probes' event ring buffer: each record decoded once ([`Record::decode`]) and forwarded,
//! in batches, to the state task; undo requests straight to the restorer.

use aya::maps::{MapData, RingBuf};
use tokio::{io::unix::AsyncFd, sync::mpsc};
use tracing::warn;

use super::messages::Message;
use crate::probes::events::Record;

/// Most events in one message to the state task: a message is handled whole, and the API's
/// changes wait for at most the one in hand.
const BATCH: usize = 256;

/// Forwards ring-buffer records to the state task, in batches of what one read found (the state
/// task handles a batch's file releases together), until the channel closes.
/// Undo requests (`GuardRestore` records) go to `restore` at once, not through the state task.
pub(super) async fn read_events(
    ring: RingBuf<MapData>,
    tx: mpsc::Sender<Message>,
    restore: Option<crate::enforcement::restore::RestoreSender>,
) -> std::io::Result<()> {
    // SAFETY: the ring buffer owns its map fd for as long as the AsyncFd owns the ring buffer.
    let mut fd = unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1)?;
    loop {
        let mut guard = fd.readable_mut().await?;
        let ring = guard.get_inner_mut();
        let mut batch = Vec::new();
        while let Some(item) = ring.next() {
            match Record::decode(&item) {
                Ok(Record::Event(ev)) => batch.push(ev),
                Ok(Record::Restore(r)) => match &restore {
                    // Never blocks: coalesced and bounded.
                    Some(tx) => tx.send(*r),
                    None => warn!(pid = r.tgid, "a tenant's control to undo, and no restorer"),
                },
                Ok(Record::ReadBack(r)) => match &restore {
                    Some(tx) => tx.read_back(r),
                    None => warn!(
                        pid = r.pid,
                        "a tenant's control to read back, and no restorer"
                    ),
                },
                Err(e) => warn!(len = item.len(), "ring-buffer record dropped: {e}"),
            }
        }
        guard.clear_ready();
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(BATCH));
            if tx.send(Message::Kernel(batch)).await.is_err() {
                return Ok(());
            }
            batch = rest;
        }
    }
}
