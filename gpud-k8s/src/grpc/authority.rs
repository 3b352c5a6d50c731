//! HTTP/2 header blocks whose `:authority` the server can take.
//!
//! The kubelet dials the plugin-registration socket and the DRA socket with grpc-go and the bare
//! socket path as the target, without `WithAuthority` (its device-plugin client has it). grpc-go
//! then sends the path as each request's `:authority`: percent-encoded by current grpc-go
//! (`%2Fvar%2Flib%2Fkubelet%2F…`), raw by older releases. h2, tonic's HTTP/2, refuses both as a
//! malformed authority and resets the stream with PROTOCOL_ERROR before any service runs
//! (hyperium/h2#487, still open), so a real kubelet never gets past `GetInfo`.
//!
//! A server therefore reads each connection through [`Rewriting::server`]: it decodes the
//! client's header blocks (HPACK), replaces an authority that `http::uri::Authority` refuses with
//! `localhost` (what the kubelet itself sends its device plugins) and encodes the block again.
//! Every block is re-encoded, changed or not, so the server's HPACK table follows this encoder's
//! table and never the client's. Nothing else in the byte stream changes.
//!
//! The same transform on a client's written side ([`Rewriting::client`]) lets a test client put
//! grpc-go's authority on the wire, which `http::Uri` cannot hold.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The frame size every HTTP/2 peer takes (SETTINGS_MAX_FRAME_SIZE's initial value).
const MAX_FRAME: usize = 16_384;
/// The largest header block gathered (a kubelet's are a few hundred bytes).
const MAX_BLOCK: usize = 1 << 20;

/// What the server gets instead of an authority it would refuse.
pub const LOCALHOST: &[u8] = b"localhost";

/// A client's bytes that cannot be carried on as HTTP/2 header blocks.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("HTTP/2 frame on stream {stream}: {reason}")]
    Frame { stream: u32, reason: &'static str },
    #[error("HPACK header block on stream {stream}: {reason}")]
    Hpack { stream: u32, reason: String },
}

/// Given a request's authority (`None`: it has none), the authority to send instead (`None`:
/// keep it).
pub type AuthorityMap = Box<dyn FnMut(Option<&[u8]>) -> Option<Vec<u8>> + Send>;

/// The server's rule: an authority `http` refuses becomes `localhost`.
pub fn acceptable_authority(current: Option<&[u8]>) -> Option<Vec<u8>> {
    let a = current?;
    http::uri::Authority::try_from(a)
        .is_err()
        .then(|| LOCALHOST.to_vec())
}

/// One direction of an HTTP/2 connection, client to server, with its header blocks re-encoded.
pub struct HeaderBlocks {
    map: AuthorityMap,
    /// Preface bytes still to pass on unchanged.
    preface: usize,
    input: Vec<u8>,
    /// Payload bytes of a frame that is not a header block, still to pass on unchanged.
    passing: usize,
    open: Option<Block>,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
}

/// A header block being gathered from HEADERS and CONTINUATION frames.
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

impl HeaderBlocks {
    pub fn new(map: AuthorityMap) -> Self {
        Self {
            map,
            preface: PREFACE.len(),
            input: Vec::new(),
            passing: 0,
            open: None,
            decoder: Decoder::new(),
            // A 4 KiB dynamic table: HTTP/2's initial SETTINGS_HEADER_TABLE_SIZE, which tonic's
            // server keeps, so the server's decoder always has room for what this one indexes.
            encoder: Encoder::new(),
        }
    }

    /// Takes bytes the client sent and appends to `out` what the server is to get. Other frames
    /// pass as they come; a header block waits for its last frame.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Result<(), RewriteError> {
        self.input.extend_from_slice(bytes);
        let input = std::mem::take(&mut self.input);
        let mut at = self.preface.min(input.len());
        out.extend_from_slice(&input[..at]);
        self.preface -= at;
        loop {
            let n = self.passing.min(input.len() - at);
            out.extend_from_slice(&input[at..at + n]);
            (at, self.passing) = (at + n, self.passing - n);
            if self.passing > 0 {
                break;
            }
            let Some(head) = input.get(at..at + FRAME_HEADER) else {
                break;
            };
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            if kind != HEADERS && kind != CONTINUATION && self.open.is_none() {
                out.extend_from_slice(head);
                (at, self.passing) = (at + FRAME_HEADER, len);
                continue;
            }
            if len > MAX_FRAME {
                // Larger than SETTINGS_MAX_FRAME_SIZE allows (tonic's server keeps 16 KiB).
                return Err(RewriteError::Frame {
                    stream,
                    reason: "a header frame over 16 KiB",
                });
            }
            let Some(payload) = input.get(at + FRAME_HEADER..at + FRAME_HEADER + len) else {
                break;
            };
            match (kind, self.open.take()) {
                (HEADERS, None) => {
                    let block = Self::headers(stream, flags, payload)?;
                    self.gathered(block, flags, out)?;
                }
                (CONTINUATION, Some(mut block))
                    if block.stream == stream && block.fragment.len() + len <= MAX_BLOCK =>
                {
                    block.fragment.extend_from_slice(payload);
                    self.gathered(block, flags, out)?;
                }
                (CONTINUATION, Some(_)) if len > 0 => {
                    return Err(RewriteError::Frame {
                        stream,
                        reason: "a header block on another stream or over 1 MiB",
                    });
                }
                _ => {
                    // RFC 9113 §6.10: nothing may come between a block's frames.
                    return Err(RewriteError::Frame {
                        stream,
                        reason: "a header block interrupted or continued without a start",
                    });
                }
            }
            at += FRAME_HEADER + len;
        }
        self.input = input;
        self.input.drain(..at);
        Ok(())
    }

    /// Bytes fed but not passed on (an unfinished frame at the end of the stream).
    pub fn leftover(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.input)
    }

    fn headers(stream: u32, flags: u8, payload: &[u8]) -> Result<Block, RewriteError> {
        let bad = |reason| RewriteError::Frame { stream, reason };
        let mut p = payload;
        let mut pad = 0;
        if flags & PADDED != 0 {
            let (&n, rest) = p.split_first().ok_or(bad("no pad length"))?;
            (pad, p) = (usize::from(n), rest);
        }
        let mut priority = None;
        if flags & PRIORITY != 0 {
            let (fields, rest) = p.split_first_chunk::<5>().ok_or(bad("short priority"))?;
            (priority, p) = (Some(*fields), rest);
        }
        let end = p
            .len()
            .checked_sub(pad)
            .ok_or(bad("padding past the frame"))?;
        Ok(Block {
            stream,
            end_stream: flags & END_STREAM != 0,
            priority,
            fragment: p[..end].to_vec(),
        })
    }

    /// Keeps `block` open, or re-encodes it when `flags` end it.
    fn gathered(&mut self, block: Block, flags: u8, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        if flags & END_HEADERS == 0 {
            self.open = Some(block);
            return Ok(());
        }
        let mut fields = self
            .decoder
            .decode(&block.fragment)
            .map_err(|e| RewriteError::Hpack {
                stream: block.stream,
                reason: format!("{e:?}"),
            })?;
        let at = fields.iter().position(|(n, _)| n == b":authority");
        if let Some(new) = (self.map)(at.map(|i| fields[i].1.as_slice())) {
            match at {
                Some(i) => {
                    tracing::debug!(
                        "stream {}: :authority {:?} sent as {:?}",
                        block.stream,
                        String::from_utf8_lossy(&fields[i].1),
                        String::from_utf8_lossy(&new)
                    );
                    fields[i].1 = new;
                }
                // Pseudo-header fields come first (RFC 9113 §8.3).
                None => fields.insert(0, (b":authority".to_vec(), new)),
            }
        }
        let encoded = self
            .encoder
            .encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        write_block(&block, &encoded, out);
        Ok(())
    }
}

/// A re-encoded block as HEADERS then CONTINUATION frames of at most [`MAX_FRAME`] bytes.
fn write_block(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
    let room = MAX_FRAME - block.priority.map_or(0, |p| p.len());
    let (first, mut rest) = encoded.split_at(room.min(encoded.len()));
    let mut flags = 0;
    if block.end_stream {
        flags |= END_STREAM;
    }
    if block.priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    let priority = block.priority.as_ref().map_or(&[][..], |p| &p[..]);
    write_frame(out, HEADERS, flags, block.stream, &[priority, first]);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(MAX_FRAME.min(rest.len()));
        rest = tail;
        let flags = if rest.is_empty() { END_HEADERS } else { 0 };
        write_frame(out, CONTINUATION, flags, block.stream, &[chunk]);
    }
}

fn write_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    // At most MAX_FRAME, so it fits the 24-bit length.
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    for p in parts {
        out.extend_from_slice(p);
    }
}

/// Which way the rewritten bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// A server's connection: what it reads is rewritten.
    Read,
    /// A client's connection: what it writes is rewritten.
    Write,
}

/// A connection whose client-to-server header blocks pass through [`HeaderBlocks`].
pub struct Rewriting<S> {
    inner: S,
    side: Side,
    blocks: HeaderBlocks,
    /// Rewritten bytes not yet handed on, from `sent`.
    out: Vec<u8>,
    sent: usize,
    eof: bool,
}

impl<S> Rewriting<S> {
    /// A server's accepted connection, with authorities it would refuse made `localhost`.
    pub fn server(inner: S) -> Self {
        Self::new(inner, Side::Read, Box::new(acceptable_authority))
    }

    /// A client's connection whose requests carry the authority `map` gives.
    pub fn client(inner: S, map: AuthorityMap) -> Self {
        Self::new(inner, Side::Write, map)
    }

    fn new(inner: S, side: Side, map: AuthorityMap) -> Self {
        Self {
            inner,
            side,
            blocks: HeaderBlocks::new(map),
            out: Vec::new(),
            sent: 0,
            eof: false,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    fn invalid(e: RewriteError) -> io::Error {
        tracing::warn!("closing an HTTP/2 connection: {e}");
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

impl<S: AsyncWrite + Unpin> Rewriting<S> {
    /// Writes out the rewritten bytes still held.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.out.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewriting<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.side == Side::Write {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        loop {
            if this.sent < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.sent);
                buf.put_slice(&this.out[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == this.out.len() {
                    this.out.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; MAX_FRAME];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                // The server sees the truncated frame and ends the connection its own way.
                this.eof = true;
                this.out = this.blocks.leftover();
                continue;
            }
            this.blocks
                .feed(read.filled(), &mut this.out)
                .map_err(Self::invalid)?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewriting<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.side == Side::Read {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        ready!(this.drain(cx))?;
        this.blocks
            .feed(buf, &mut this.out)
            .map_err(Self::invalid)?;
        // The bytes are taken; what the socket does not take now goes on the next write or flush.
        if let Poll::Ready(Err(e)) = this.drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.side == Side::Write {
            ready!(this.drain(cx))?;
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.side == Side::Write {
            ready!(this.drain(cx))?;
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Rewriting<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GRPC_GO: &[u8] = b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.gpud.dev-reg.sock";

    fn request(authority: &[u8]) -> Fields {
        [
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        .iter()
        .map(|(n, v)| (n.to_vec(), v.to_vec()))
        .collect()
    }

    /// What a client writes: the preface, SETTINGS, then one HEADERS frame per request (with
    /// `flags` and `prefix`: pad length and priority fields as the flags say) and a DATA frame.
    fn client_bytes(requests: &[Fields], flags: u8, prefix: &[u8]) -> Vec<u8> {
        let mut enc = Encoder::new();
        let mut out = PREFACE.to_vec();
        write_frame(&mut out, 0x4, 0, 0, &[]);
        for (i, r) in (0u32..).zip(requests) {
            let stream = 1 + 2 * i;
            let block = enc.encode(r.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
            let pad = if flags & PADDED != 0 {
                vec![0; usize::from(prefix[0])]
            } else {
                vec![]
            };
            write_frame(
                &mut out,
                HEADERS,
                flags | END_HEADERS,
                stream,
                &[prefix, &block, &pad],
            );
            write_frame(&mut out, 0x0, END_STREAM, stream, &[b"\0\0\0\0\0"]);
        }
        out
    }

    type Fields = Vec<(Vec<u8>, Vec<u8>)>;
    /// A frame as the server sees it: kind, flags, stream, decoded fields, payload.
    type Frame = (u8, u8, u32, Fields, Vec<u8>);

    /// The server's view: the frames of `bytes` with each header block decoded.
    fn server_view(bytes: &[u8]) -> Vec<Frame> {
        assert_eq!(&bytes[..PREFACE.len()], PREFACE);
        let mut dec = Decoder::new();
        let mut at = PREFACE.len();
        let mut frames = Vec::new();
        while at < bytes.len() {
            let h = &bytes[at..at + FRAME_HEADER];
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            assert!(len <= MAX_FRAME);
            let payload = bytes[at + FRAME_HEADER..at + FRAME_HEADER + len].to_vec();
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]);
            // Blocks over CONTINUATIONs are decoded by the test itself.
            let fields = if h[3] == HEADERS && h[4] & END_HEADERS != 0 {
                let skip = if h[4] & PRIORITY != 0 { 5 } else { 0 };
                dec.decode(&payload[skip..]).expect("decodes")
            } else {
                vec![]
            };
            frames.push((h[3], h[4], stream, fields, payload));
            at += FRAME_HEADER + len;
        }
        frames
    }

    fn through(bytes: &[u8], chunk: usize) -> Vec<u8> {
        let mut blocks = HeaderBlocks::new(Box::new(acceptable_authority));
        let mut out = Vec::new();
        for c in bytes.chunks(chunk) {
            blocks.feed(c, &mut out).expect("feeds");
        }
        assert!(blocks.leftover().is_empty());
        out
    }

    #[test]
    fn a_socket_path_authority_becomes_localhost_and_the_rest_stays() {
        let reqs = [
            request(GRPC_GO),
            request(b"/var/lib/kubelet/x.sock"),
            request(b""),
        ];
        let bytes = client_bytes(&reqs, 0, &[]);
        // Any split of the input gives the same output.
        let out = through(&bytes, bytes.len());
        for chunk in [1, 7, 9, 100] {
            assert_eq!(through(&bytes, chunk), out, "chunks of {chunk}");
        }
        let frames = server_view(&out);
        let headers: Vec<_> = frames.iter().filter(|f| f.0 == HEADERS).collect();
        assert_eq!(headers.len(), 3);
        for h in headers {
            assert_eq!(h.3, request(LOCALHOST));
        }
        // SETTINGS and DATA frames pass unchanged.
        let others: Vec<_> = frames
            .iter()
            .filter(|f| f.0 != HEADERS)
            .map(|f| (f.0, f.1, f.2, f.4.clone()))
            .collect();
        assert_eq!(others[0], (0x4, 0, 0, vec![]));
        assert_eq!(others[1], (0x0, END_STREAM, 1, b"\0\0\0\0\0".to_vec()));
    }

    #[test]
    fn valid_authorities_are_kept() {
        for a in [
            &b"localhost"[..],
            b"[::1]:8080",
            b"10.0.0.1:443",
            b"node-1.example",
        ] {
            let out = through(&client_bytes(&[request(a)], 0, &[]), 3);
            assert_eq!(server_view(&out)[1].3, request(a));
        }
    }

    #[test]
    fn padding_is_dropped_and_priority_and_end_stream_are_kept() {
        let bytes = client_bytes(
            &[request(GRPC_GO)],
            PADDED | PRIORITY | END_STREAM,
            &[4, 0, 0, 0, 3, 15],
        );
        let frames = server_view(&through(&bytes, 5));
        let h = &frames[1];
        assert_eq!(h.1, PRIORITY | END_STREAM | END_HEADERS);
        assert_eq!(&h.4[..5], &[0, 0, 0, 3, 15]);
        assert_eq!(h.3, request(LOCALHOST));
    }

    #[test]
    fn a_block_over_continuations_is_gathered_and_a_long_one_split() {
        let mut req = request(GRPC_GO);
        req.push((b"x-long".to_vec(), vec![b'a'; 40_000]));
        let block = Encoder::new().encode(req.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let (a, b) = block.split_at(100);
        let mut bytes = PREFACE.to_vec();
        write_frame(&mut bytes, HEADERS, 0, 1, &[a]);
        for c in b.chunks(MAX_FRAME) {
            let last = c.as_ptr_range().end == b.as_ptr_range().end;
            let flags = if last { END_HEADERS } else { 0 };
            write_frame(&mut bytes, CONTINUATION, flags, 1, &[c]);
        }
        let out = through(&bytes, 4096);
        // Re-split: HEADERS of 16 KiB, then CONTINUATIONs, the last one ending the block.
        let frames = server_view(&out);
        let kinds: Vec<_> = frames.iter().map(|f| (f.0, f.1)).collect();
        assert_eq!(
            kinds,
            [(HEADERS, 0), (CONTINUATION, 0), (CONTINUATION, END_HEADERS)]
        );
        let whole: Vec<u8> = frames.iter().flat_map(|f| f.4.clone()).collect();
        let mut want = request(LOCALHOST);
        want.push((b"x-long".to_vec(), vec![b'a'; 40_000]));
        assert_eq!(Decoder::new().decode(&whole).expect("decodes"), want);
    }

    #[test]
    fn broken_framing_and_hpack_are_errors() {
        let mut bytes = PREFACE.to_vec();
        write_frame(&mut bytes, HEADERS, 0, 1, &[b"\x82"]);
        write_frame(&mut bytes, 0x0, 0, 1, &[b"x"]);
        let mut blocks = HeaderBlocks::new(Box::new(acceptable_authority));
        let e = blocks
            .feed(&bytes, &mut Vec::new())
            .expect_err("interrupted block");
        assert!(matches!(e, RewriteError::Frame { stream: 1, .. }), "{e}");

        let mut bytes = PREFACE.to_vec();
        // An index past both tables.
        write_frame(&mut bytes, HEADERS, END_HEADERS, 3, &[b"\xff\x7f"]);
        let mut blocks = HeaderBlocks::new(Box::new(acceptable_authority));
        let e = blocks.feed(&bytes, &mut Vec::new()).expect_err("bad index");
        assert!(matches!(e, RewriteError::Hpack { stream: 3, .. }), "{e}");
    }

    #[test]
    fn other_frames_pass_as_they_come_and_oversized_header_frames_are_errors() {
        let mut blocks = HeaderBlocks::new(Box::new(acceptable_authority));
        let mut out = Vec::new();
        let mut bytes = PREFACE.to_vec();
        write_frame(&mut bytes, 0x0, 0, 1, &[]);
        // A DATA frame of 100 000 bytes, declared before any of it arrives.
        bytes[PREFACE.len()..PREFACE.len() + 3].copy_from_slice(&100_000u32.to_be_bytes()[1..]);
        blocks.feed(&bytes, &mut out).expect("feeds");
        assert_eq!(out, bytes, "the frame's header passes before its payload");
        blocks.feed(&[7; 60_000], &mut out).expect("feeds");
        assert_eq!(out.len(), bytes.len() + 60_000);
        blocks.feed(&[7; 40_000], &mut out).expect("feeds");
        let mut next = Vec::new();
        write_frame(&mut next, HEADERS, END_HEADERS, 3, &[&[0; MAX_FRAME + 1]]);
        let e = blocks.feed(&next, &mut out).expect_err("too large");
        assert!(matches!(e, RewriteError::Frame { stream: 3, .. }), "{e}");
        assert_eq!(out.len(), bytes.len() + 100_000);
    }

    proptest! {
        /// Whatever a client sends, the rewriter answers with bytes or an error, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mut blocks = HeaderBlocks::new(Box::new(acceptable_authority));
            let mut out = Vec::new();
            let _ = blocks.feed(PREFACE, &mut out);
            let _ = blocks.feed(&body, &mut out);
        }

        /// Header frames of arbitrary flags and payloads, too.
        #[test]
        fn arbitrary_header_frames_never_panic(
            flags in any::<u8>(),
            payload in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut bytes = PREFACE.to_vec();
            write_frame(&mut bytes, HEADERS, flags, 1, &[&payload]);
            write_frame(&mut bytes, CONTINUATION, END_HEADERS, 1, &[&payload]);
            let mut blocks = HeaderBlocks::new(Box::new(acceptable_authority));
            let _ = blocks.feed(&bytes, &mut Vec::new());
        }
    }
}
