//! One block decoded as its object body streams in: the header is parsed from the first bytes,
//! then a plain payload is copied straight from the response's chunks into the caller's buffer
//! while its content hash is computed, so a get copies the payload once (no collected body,
//! no second copy). The checks are `codec::decode_into`'s: header CRC, key, lengths, and the
//! content hash of every byte. Bytes reach the buffer before the hash is known: on any failure
//! the caller zeroes the buffer (`Ctx::get`), and the batch reports the block only after
//! `finish`, so no unverified byte is ever handed back as a block. A zstd payload is gathered
//! and decoded at the end (it cannot be written in place).

use super::codec::{decode_into, parse_header, DecodeError};
use crate::format::header::BlockHeader;
use crate::format::PAGE;
use crate::hashing::{ContentHash, HashAlgo};

fn corrupt(msg: impl Into<String>) -> DecodeError {
    DecodeError::Corrupt(msg.into())
}

/// An incremental `HashAlgo::digest` (same digests: xxh3-128 and blake3 cut to 128 bits).
enum Hasher {
    Xxh3(Box<xxhash_rust::xxh3::Xxh3>),
    Blake3(Box<blake3::Hasher>),
}

impl Hasher {
    fn new(algo: HashAlgo) -> Self {
        match algo {
            HashAlgo::Xxh3_128 => Hasher::Xxh3(Box::default()),
            HashAlgo::Blake3 => Hasher::Blake3(Box::default()),
        }
    }

    fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Xxh3(h) => h.update(data),
            Hasher::Blake3(h) => {
                h.update(data);
            }
        }
    }

    fn digest(&self) -> ContentHash {
        match self {
            Hasher::Xxh3(h) => h.digest128().to_le_bytes(),
            Hasher::Blake3(h) => {
                let mut out = [0u8; 16];
                out.copy_from_slice(&h.finalize().as_bytes()[..16]);
                out
            }
        }
    }
}

/// The header's length, once its two bytes are in.
fn head_len(head: &[u8]) -> Option<usize> {
    (head.len() >= 2).then(|| u16::from_le_bytes([head[0], head[1]]) as usize)
}

enum State {
    /// `[u16 header_len][header]` gathered so far (at most 2 + PAGE bytes).
    Head(Vec<u8>),
    /// A plain payload: `at` bytes of `raw_len` written to the buffer.
    Plain { raw_len: usize, at: usize, want: ContentHash, hasher: Hasher },
    /// A zstd payload (or anything not plain): the whole body, decoded by `finish`.
    Gathered(Vec<u8>),
}

pub struct StreamDecode<'a> {
    key: &'a [u8],
    dst: &'a mut [u8],
    state: State,
}

impl<'a> StreamDecode<'a> {
    pub fn new(key: &'a [u8], dst: &'a mut [u8]) -> Self {
        StreamDecode { key, dst, state: State::Head(Vec::with_capacity(256)) }
    }

    /// The next chunk of the body.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), DecodeError> {
        while !chunk.is_empty() {
            match &mut self.state {
                State::Head(head) => {
                    let need = match head_len(head) {
                        None => 2,
                        Some(used) if used > PAGE => {
                            return Err(corrupt(format!("header length {used} is over {PAGE}")))
                        }
                        Some(used) => 2 + used,
                    };
                    if head_len(head).is_some() && head.len() == need {
                        self.start_payload()?;
                        continue;
                    }
                    let take = (need - head.len()).min(chunk.len());
                    head.extend_from_slice(&chunk[..take]);
                    chunk = &chunk[take..];
                }
                State::Plain { raw_len, at, hasher, .. } => {
                    let end = *at + chunk.len();
                    if end > *raw_len {
                        return Err(corrupt(format!("payload is over the {raw_len}-byte block")));
                    }
                    self.dst[*at..end].copy_from_slice(chunk);
                    hasher.update(chunk);
                    *at = end;
                    chunk = &[];
                }
                State::Gathered(body) => {
                    if body.len() + chunk.len() > 2 + PAGE + self.dst.len() {
                        return Err(corrupt("object is longer than any block this buffer takes"));
                    }
                    body.extend_from_slice(chunk);
                    chunk = &[];
                }
            }
        }
        // A header that ends exactly with this chunk: check it now (a bad buffer or key fails
        // before the rest of the body is read).
        self.header_if_complete()
    }

    fn header_if_complete(&mut self) -> Result<(), DecodeError> {
        match &self.state {
            State::Head(head) if head_len(head).is_some_and(|used| head.len() == 2 + used) => {
                self.start_payload()
            }
            _ => Ok(()),
        }
    }

    /// The header is complete: check it (its CRC and key; the payload's length is checked by
    /// `finish`) and choose how the payload is taken.
    fn start_payload(&mut self) -> Result<(), DecodeError> {
        let State::Head(head) = &mut self.state else { return Ok(()) };
        let head = std::mem::take(head);
        let (header, _) = parse_header(self.key, &head)?;
        self.start_from(head, header)
    }

    fn start_from(&mut self, head: Vec<u8>, header: BlockHeader) -> Result<(), DecodeError> {
        let raw_len = header.raw_len as usize;
        if self.dst.len() < raw_len {
            return Err(DecodeError::BadBuffer(format!(
                "buffer of {} bytes is smaller than the {raw_len}-byte block",
                self.dst.len()
            )));
        }
        let algo = HashAlgo::from_code(header.hash_algo)
            .ok_or_else(|| corrupt(format!("unknown content hash code {}", header.hash_algo)))?;
        self.state = if header.compressed() {
            let mut body = Vec::with_capacity(head.len() + (header.stored_len as usize).min(raw_len + PAGE));
            body.extend_from_slice(&head);
            State::Gathered(body)
        } else {
            if header.stored_len != header.raw_len {
                return Err(corrupt(format!("payload is {} bytes, block is {raw_len}", header.stored_len)));
            }
            State::Plain { raw_len, at: 0, want: header.content_hash, hasher: Hasher::new(algo) }
        };
        Ok(())
    }

    /// The body ended: the block's length once every check passed.
    pub fn finish(mut self) -> Result<usize, DecodeError> {
        self.header_if_complete()?;
        match self.state {
            State::Head(head) if head.len() < 2 => Err(corrupt("empty object")),
            State::Head(_) => Err(corrupt("object truncated inside its header")),
            State::Plain { raw_len, at, want, hasher } => {
                if at != raw_len {
                    return Err(corrupt(format!("payload is {at} bytes, header says {raw_len}")));
                }
                if hasher.digest() != want {
                    return Err(corrupt("content hash mismatch"));
                }
                Ok(raw_len)
            }
            State::Gathered(body) => decode_into(self.key, &body, self.dst),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compression::Compression;
    use crate::object::codec::encode;

    fn block(n: usize, seed: u32) -> Vec<u8> {
        (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 11) as u8).collect()
    }

    /// The body fed in chunks of `step` bytes (0: one chunk).
    fn streamed(key: &[u8], body: &[u8], out: &mut [u8], step: usize) -> Result<usize, DecodeError> {
        let mut d = StreamDecode::new(key, out);
        let step = if step == 0 { body.len().max(1) } else { step };
        for chunk in body.chunks(step) {
            d.feed(chunk)?;
        }
        d.finish()
    }

    #[test]
    fn streamed_equals_whole_for_every_split() {
        for algo in [HashAlgo::Xxh3_128, HashAlgo::Blake3] {
            for codec in [Compression::None, Compression::parse("zstd", 3).unwrap()] {
                for raw in [block(70_000, 1), vec![0u8; 65536], Vec::new(), vec![3u8; 1]] {
                    let body = encode(b"ns/k1", &raw, algo, codec);
                    for step in [0, 1, 2, 3, 7, 100, 4096, 16384] {
                        let mut out = vec![7u8; raw.len() + 10];
                        assert_eq!(streamed(b"ns/k1", &body, &mut out, step), Ok(raw.len()), "{step}");
                        assert_eq!(&out[..raw.len()], &raw[..]);
                    }
                }
            }
        }
    }

    #[test]
    fn streamed_refuses_what_decode_into_refuses() {
        let raw = block(20_000, 2);
        let body = encode(b"ns/k1", &raw, HashAlgo::Xxh3_128, Compression::None);
        let mut out = vec![0u8; raw.len()];
        for step in [0, 1, 5, 1000] {
            let wrong_key = streamed(b"ns/k2", &body, &mut out, step);
            assert!(matches!(wrong_key, Err(DecodeError::Corrupt(_))), "{step}");
            for cut in [0, 1, 2, 20, body.len() - 1] {
                let r = streamed(b"ns/k1", &body[..cut], &mut out, step);
                assert!(matches!(r, Err(DecodeError::Corrupt(_))), "cut {cut} step {step}");
            }
            let mut longer = body.clone();
            longer.push(0);
            assert!(matches!(streamed(b"ns/k1", &longer, &mut out, step), Err(DecodeError::Corrupt(_))));
            for pos in [0, 3, 30, body.len() / 2, body.len() - 1] {
                let mut bad = body.clone();
                bad[pos] ^= 0x40;
                let r = streamed(b"ns/k1", &bad, &mut out, step);
                assert!(matches!(r, Err(DecodeError::Corrupt(_))), "flip {pos} step {step}");
                assert_eq!(r.map_err(kind), decode_into(b"ns/k1", &bad, &mut out).map_err(kind));
            }
            let mut small = vec![0u8; 100];
            assert!(matches!(streamed(b"ns/k1", &body, &mut small, step), Err(DecodeError::BadBuffer(_))));
        }
    }

    /// Errors compared by kind (their messages may name different stages).
    fn kind(e: DecodeError) -> DecodeError {
        match e {
            DecodeError::Corrupt(_) => DecodeError::Corrupt(String::new()),
            DecodeError::BadBuffer(_) => DecodeError::BadBuffer(String::new()),
        }
    }
}
