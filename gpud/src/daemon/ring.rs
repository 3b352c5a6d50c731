//! The probes' event ring buffer: records decoded and forwarded, in batches, to the state task.

use aya::maps::{MapData, RingBuf};
use tokio::{io::unix::AsyncFd, sync::mpsc};
use tracing::warn;

use super::Message;

/// Forwards ring-buffer records to the state task until the channel closes.
/// Undo requests (`GuardRestore` records) go to `restore` at once, not through the state task.
pub(super) async fn read_events(
    ring: RingBuf<MapData>,
    tx: mpsc::Sender<Message>,
    restore: Option<std::sync::mpsc::Sender<gpud_common::GuardRestore>>,
) -> std::io::Result<()> {
    // SAFETY: the ring buffer owns its map fd for as long as the AsyncFd owns the ring buffer.
    let mut fd = unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1)?;
    loop {
        let mut guard = fd.readable_mut().await?;
        let ring = guard.get_inner_mut();
        let mut batch = Vec::new();
        while let Some(item) = ring.next() {
            if let Some(r) = parse_guard_restore(&item) {
                match &restore {
                    // Sending on a std channel never blocks.
                    Some(tx) => {
                        let _ = tx.send(r);
                    }
                    None => warn!(pid = r.tgid, "a tenant's control to undo, and no restorer"),
                }
                continue;
            }
            match parse_event(&item) {
                Some(ev) => batch.push(ev),
                None => warn!(len = item.len(), "malformed ring-buffer record"),
            }
        }
        guard.clear_ready();
        for ev in batch {
            if tx.send(Message::Kernel(ev)).await.is_err() {
                return Ok(());
            }
        }
    }
}

/// Decodes one record; `None` if its size is not that of [`gpud_common::Event`].
pub fn parse_event(bytes: &[u8]) -> Option<gpud_common::Event> {
    if bytes.len() != size_of::<gpud_common::Event>() {
        return None;
    }
    // SAFETY: the length matches and Event is plain old data; read_unaligned copes with any
    // alignment of the ring-buffer slice.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<gpud_common::Event>()) })
}

/// Decodes an undo request; `None` unless the record has the size of a
/// [`gpud_common::GuardRestore`] and its kind.
pub fn parse_guard_restore(bytes: &[u8]) -> Option<gpud_common::GuardRestore> {
    if bytes.len() != size_of::<gpud_common::GuardRestore>() {
        return None;
    }
    // SAFETY: the length matches and GuardRestore is plain old data (any bit pattern is valid).
    let r = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<gpud_common::GuardRestore>()) };
    (r.kind == gpud_common::EVENT_GUARD_RESTORE).then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_records_must_have_the_exact_size() {
        let ev = gpud_common::Event {
            kind: gpud_common::EVENT_PROC_NEW,
            tgid: 42,
            cgroup_id: 7,
            ..Default::default()
        };
        let size = size_of::<gpud_common::Event>();
        // SAFETY: Event is repr(C) plain data.
        let bytes = unsafe {
            std::slice::from_raw_parts((&ev as *const gpud_common::Event).cast::<u8>(), size)
        };
        assert_eq!(parse_event(bytes), Some(ev));
        assert_eq!(parse_event(&bytes[..size - 1]), None);
        assert_eq!(parse_event(&vec![0u8; size + 1]), None);
        assert_eq!(parse_event(&[]), None);
    }

    #[test]
    fn undo_records_are_told_from_events_by_size_and_kind() {
        let r = gpud_common::GuardRestore {
            tgid: 9,
            num_channels: 1,
            ..Default::default()
        };
        let size = size_of::<gpud_common::GuardRestore>();
        // SAFETY: GuardRestore is repr(C) plain data.
        let bytes = unsafe {
            std::slice::from_raw_parts((&r as *const gpud_common::GuardRestore).cast::<u8>(), size)
        };
        assert_eq!(parse_guard_restore(bytes), Some(r));
        assert_eq!(parse_event(bytes), None);
        assert_eq!(parse_guard_restore(&bytes[..size - 1]), None);
        let mut other = bytes.to_vec();
        other[0] = 0;
        assert_eq!(parse_guard_restore(&other), None, "another kind");
    }
}

/// Fuzz targets (`cargo xtask fuzz` runs them with many more cases): ring-buffer records of any
/// length and content.
#[cfg(test)]
mod fuzz {
    use gpud_common::Event;
    use proptest::prelude::*;

    use super::parse_event;

    fn bytes_of(ev: &Event) -> Vec<u8> {
        // SAFETY: Event is repr(C) plain data without implicit padding (48 bytes of fields).
        unsafe { std::slice::from_raw_parts((ev as *const Event).cast::<u8>(), size_of::<Event>()) }
            .to_vec()
    }

    proptest! {
        /// Any record decodes exactly when it has the event's size, and then to its own bytes.
        #[test]
        fn any_record_decodes_or_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let ev = parse_event(&bytes);
            prop_assert_eq!(ev.is_some(), bytes.len() == size_of::<Event>());
            if let Some(ev) = ev {
                prop_assert_eq!(bytes_of(&ev), bytes);
            }
        }

        /// An event read from any offset of a buffer (the ring buffer guarantees no alignment
        /// to user space) is the event written there.
        #[test]
        fn events_round_trip_at_any_alignment(
            kind in any::<u32>(), tgid in any::<u32>(), cgroup_id in any::<u64>(),
            client in any::<u32>(), object in any::<u32>(), value in any::<u64>(),
            bytes in any::<u64>(), gpu in any::<u32>(), offset in 0usize..16,
        ) {
            let ev = Event { kind, tgid, cgroup_id, client, object, value, bytes, gpu, _pad: 0 };
            let mut buf = vec![0xa5u8; offset];
            buf.extend(bytes_of(&ev));
            prop_assert_eq!(parse_event(&buf[offset..]), Some(ev));
        }
    }
}
