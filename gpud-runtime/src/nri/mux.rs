//! NRI's connection multiplexing: one socket (the trunk) carries several logical byte streams,
//! each a ttrpc connection. Written from NRI's published behaviour (`pkg/net/multiplex`):
//!
//! - a frame is an 8-byte header, the connection id then the payload length, both big-endian
//!   `u32`, followed by that many payload bytes;
//! - connection 0 is reserved; a plugin serves its `Plugin` service on connection 1 (the runtime
//!   is the ttrpc client there) and calls the runtime's `Runtime` service on connection 2;
//! - opening a connection sends nothing: both ends just start using the id; frames for an id
//!   nobody opened are dropped;
//! - a payload is at most a ttrpc message's header (10 bytes) plus its largest body (4 MiB).
//!
//! Frame boundaries carry no meaning: the payloads of one id, concatenated, are the ttrpc byte
//! stream. But the Go side hands each frame to a single `Read` and fails that read with `ENOMEM`
//! when the frame is larger than the reader's buffer; Go's ttrpc reads through a 4096-byte
//! `bufio.Reader` (it reads directly into the destination only for reads of at least 4096
//! bytes). Frames of at most 4096 bytes fit every read it makes, so that is what this side
//! writes ([`MAX_WRITE_FRAME`]). Inbound frames of any size up to the NRI bound are accepted.
//!
//! The Go side queues at most 256 frames per connection before its reader takes them and closes
//! the whole trunk when that queue overflows. Everything the plugin sends is small (responses
//! without payload, a registration): one or two frames. A multi-megabyte message would take up
//! to 1024 frames here, where Go's writer sends it in two; if the plugin ever sends such
//! messages, frame them as Go does (the first 4096 bytes, then the rest of the message whole).

use std::collections::HashMap;

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream},
    sync::{Mutex, watch},
    task::JoinSet,
};

/// The connection on which the plugin serves and the runtime calls (`Plugin` service).
pub const PLUGIN_SERVICE_CONN: u32 = 1;
/// The connection on which the runtime serves and the plugin calls (`Runtime` service).
pub const RUNTIME_SERVICE_CONN: u32 = 2;
/// Frame header: connection id and payload length, big-endian `u32` each.
pub const HEADER_LEN: usize = 8;
/// Largest payload NRI frames: a ttrpc header (10 bytes) and the largest ttrpc message (4 MiB).
pub const MAX_PAYLOAD: usize = 10 + (4 << 20);
/// Largest frame payload this side writes (see the module documentation).
pub const MAX_WRITE_FRAME: usize = 4096;

/// Buffer of each in-process pipe between the mux and a ttrpc endpoint.
const PIPE_BUFFER: usize = 64 * 1024;

/// Why the trunk stopped.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MuxError {
    #[error("connection id 0 is reserved")]
    ReservedId,
    #[error("connection id {0} opened twice")]
    DuplicateId(u32),
    #[error("the peer closed the connection")]
    Closed,
    #[error("frame for connection {id} announces {len} bytes (at most {MAX_PAYLOAD})")]
    Oversized { id: u32, len: usize },
    #[error("trunk {0}")]
    Io(String),
}

/// Encodes one frame header.
pub fn header(id: u32, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&id.to_be_bytes());
    // Payloads are bounded by MAX_PAYLOAD, far below u32::MAX.
    h[4..].copy_from_slice(&(len.min(u32::MAX as usize) as u32).to_be_bytes());
    h
}

/// A running multiplexer: its tasks stop when the trunk closes or the handle is dropped.
pub struct Mux {
    tasks: JoinSet<()>,
    done: watch::Receiver<Option<MuxError>>,
}

impl Mux {
    /// Splits `trunk` into the logical connections `ids`; returns the multiplexer and one
    /// in-process stream per id, to hand to a ttrpc server or client.
    pub fn start<T>(trunk: T, ids: &[u32]) -> Result<(Self, HashMap<u32, DuplexStream>), MuxError>
    where
        T: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (trunk_rd, trunk_wr) = tokio::io::split(trunk);
        let trunk_wr = std::sync::Arc::new(Mutex::new(trunk_wr));
        let (done_tx, done) = watch::channel(None);
        let done_tx = std::sync::Arc::new(done_tx);
        let mut endpoints = HashMap::new();
        let mut inbound = HashMap::new();
        let mut tasks = JoinSet::new();
        for &id in ids {
            if id == 0 {
                return Err(MuxError::ReservedId);
            }
            if endpoints.contains_key(&id) {
                return Err(MuxError::DuplicateId(id));
            }
            let (ours, theirs) = tokio::io::duplex(PIPE_BUFFER);
            endpoints.insert(id, theirs);
            let (mut from_endpoint, to_endpoint) = tokio::io::split(ours);
            inbound.insert(id, to_endpoint);
            let trunk_wr = trunk_wr.clone();
            let done_tx = done_tx.clone();
            // Endpoint → trunk, in frames of at most MAX_WRITE_FRAME bytes.
            tasks.spawn(async move {
                let mut buf = vec![0u8; HEADER_LEN + MAX_WRITE_FRAME];
                loop {
                    let n = match from_endpoint.read(&mut buf[HEADER_LEN..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    buf[..HEADER_LEN].copy_from_slice(&header(id, n));
                    let mut w = trunk_wr.lock().await;
                    if let Err(e) = w.write_all(&buf[..HEADER_LEN + n]).await {
                        done_tx.send_replace(Some(MuxError::Io(format!("write: {e}"))));
                        return;
                    }
                }
            });
        }
        // Trunk → endpoints.
        tasks.spawn(async move {
            let why = demux(trunk_rd, &mut inbound).await;
            // End the endpoints' streams: their ttrpc sides see the connection closed.
            for (_, mut w) in inbound.drain() {
                let _ = w.shutdown().await;
            }
            done_tx.send_replace(Some(why));
        });
        Ok((Self { tasks, done }, endpoints))
    }

    /// Waits until the trunk stopped; why.
    pub async fn closed(&mut self) -> MuxError {
        loop {
            if let Some(why) = self.done.borrow_and_update().clone() {
                return why;
            }
            if self.done.changed().await.is_err() {
                return MuxError::Closed;
            }
        }
    }

    /// Stops every task (the endpoints see their streams end).
    pub fn shutdown(&mut self) {
        self.tasks.abort_all();
    }
}

impl Drop for Mux {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

async fn demux<R: AsyncRead + Unpin>(
    mut trunk: R,
    inbound: &mut HashMap<u32, tokio::io::WriteHalf<DuplexStream>>,
) -> MuxError {
    let mut hdr = [0u8; HEADER_LEN];
    let mut payload = Vec::new();
    loop {
        match trunk.read_exact(&mut hdr).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return MuxError::Closed,
            Err(e) => return MuxError::Io(format!("read: {e}")),
        }
        let id = u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let len = u32::from_be_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]) as usize;
        if len > MAX_PAYLOAD {
            return MuxError::Oversized { id, len };
        }
        payload.resize(len, 0);
        match trunk.read_exact(&mut payload).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return MuxError::Closed,
            Err(e) => return MuxError::Io(format!("read: {e}")),
        }
        // Unopened ids are dropped, as NRI does; so is an endpoint that went away.
        if let Some(w) = inbound.get_mut(&id)
            && w.write_all(&payload).await.is_err()
        {
            inbound.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read_frame(r: &mut (impl AsyncRead + Unpin)) -> Option<(u32, Vec<u8>)> {
        let mut h = [0u8; HEADER_LEN];
        r.read_exact(&mut h).await.ok()?;
        let id = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let mut p = vec![0u8; len];
        r.read_exact(&mut p).await.ok()?;
        Some((id, p))
    }

    #[tokio::test]
    async fn frames_both_ways() -> Result<(), Box<dyn std::error::Error>> {
        let (trunk, mut peer) = tokio::io::duplex(1 << 20);
        let (mut mux, mut conns) = Mux::start(trunk, &[1, 2])?;
        let mut c1 = conns.remove(&1).ok_or("conn 1")?;
        let mut c2 = conns.remove(&2).ok_or("conn 2")?;

        // Outbound: a write of 10000 bytes leaves in frames of at most 4096 bytes, in order.
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        c2.write_all(&data).await?;
        let mut got = Vec::new();
        while got.len() < data.len() {
            let (id, p) = read_frame(&mut peer).await.ok_or("frame")?;
            assert_eq!(id, 2);
            assert!(!p.is_empty() && p.len() <= MAX_WRITE_FRAME, "{}", p.len());
            got.extend(p);
        }
        assert_eq!(got, data);

        // Inbound: one large frame (as Go writes a big message), several small ones, frames
        // for an unopened id (dropped), interleaved between ids.
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        let mut wire = Vec::new();
        wire.extend(header(1, big.len()));
        wire.extend(&big);
        wire.extend(header(7, 3));
        wire.extend(b"xyz");
        wire.extend(header(2, 2));
        wire.extend(b"ab");
        wire.extend(header(1, 0));
        wire.extend(header(2, 1));
        wire.extend(b"c");
        peer.write_all(&wire).await?;
        let mut back = vec![0u8; big.len()];
        c1.read_exact(&mut back).await?;
        assert_eq!(back, big);
        let mut abc = [0u8; 3];
        c2.read_exact(&mut abc).await?;
        assert_eq!(&abc, b"abc");

        // The peer closing ends the endpoints and the mux.
        drop(peer);
        assert_eq!(mux.closed().await, MuxError::Closed);
        let mut rest = Vec::new();
        c1.read_to_end(&mut rest).await?;
        assert!(rest.is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn oversized_frames_stop_the_trunk() -> Result<(), Box<dyn std::error::Error>> {
        let (trunk, mut peer) = tokio::io::duplex(1 << 16);
        let (mut mux, _conns) = Mux::start(trunk, &[1])?;
        peer.write_all(&header(1, MAX_PAYLOAD + 1)).await?;
        assert_eq!(
            mux.closed().await,
            MuxError::Oversized {
                id: 1,
                len: MAX_PAYLOAD + 1
            }
        );
        Ok(())
    }

    #[test]
    fn ids_are_checked() {
        let rt = tokio::runtime::Builder::new_current_thread().build();
        let Ok(rt) = rt else { return };
        rt.block_on(async {
            let (t, _p) = tokio::io::duplex(16);
            assert!(matches!(Mux::start(t, &[0]), Err(MuxError::ReservedId)));
            let (t, _p) = tokio::io::duplex(16);
            assert!(matches!(
                Mux::start(t, &[1, 1]),
                Err(MuxError::DuplicateId(1))
            ));
        });
    }
}
