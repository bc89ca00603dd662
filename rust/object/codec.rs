//! One object = one block: `[u16 header_len][header][payload]`. The header is the SSD tier's
//! block header (`format::header`) with its page's zero tail cut off (restored before decoding);
//! the payload is the raw block or one standard zstd frame. Every read is verified: header CRC,
//! key, length and the content hash of the decoded bytes.

use crate::compression::{decompress_into, Compression};
use crate::format::header::{BlockHeader, FLAG_COMPRESSED};
use crate::format::{MAX_KEY_LEN, PAGE};
use crate::hashing::HashAlgo;

/// Why a stored object could not be handed back.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Wrong, truncated or undecodable bytes (status "corrupt").
    Corrupt(String),
    /// The caller's buffer cannot hold the block (status "bad_buffer").
    BadBuffer(String),
}

fn corrupt(msg: impl Into<String>) -> DecodeError {
    DecodeError::Corrupt(msg.into())
}

/// The object body for `raw` under `key` (one copy of the payload, or its zstd frame).
pub fn encode(key: &[u8], raw: &[u8], hash: HashAlgo, compression: Compression) -> Vec<u8> {
    debug_assert!(key.len() <= MAX_KEY_LEN);
    let packed = compression.compress(raw);
    let payload: &[u8] = packed.as_deref().unwrap_or(raw);
    let header = BlockHeader {
        flags: if packed.is_some() { FLAG_COMPRESSED } else { 0 },
        hash_algo: hash.code(),
        raw_len: raw.len() as u64,
        stored_len: payload.len() as u64,
        seq: 0,
        content_hash: hash.digest(raw),
        key: key.to_vec(),
    };
    let mut page = vec![0u8; PAGE];
    header.encode_into(&mut page);
    let used = page.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    let mut out = Vec::with_capacity(2 + used + payload.len());
    out.extend_from_slice(&(used as u16).to_le_bytes());
    out.extend_from_slice(&page[..used]);
    out.extend_from_slice(payload);
    out
}

/// The header and where the payload starts, checked against `key` and the body's length.
pub fn decode_header(key: &[u8], body: &[u8]) -> Result<(BlockHeader, usize), DecodeError> {
    let (header, start) = parse_header(key, body)?;
    let payload_len = (body.len() - start) as u64;
    if payload_len != header.stored_len {
        return Err(corrupt(format!("payload is {payload_len} bytes, header says {}", header.stored_len)));
    }
    Ok((header, start))
}

/// The header at the start of `body` (CRC and key checked) and where the payload starts; the
/// payload's length is the caller's to check.
pub fn parse_header(key: &[u8], body: &[u8]) -> Result<(BlockHeader, usize), DecodeError> {
    let len_bytes: [u8; 2] =
        body.get(..2).and_then(|b| b.try_into().ok()).ok_or_else(|| corrupt("empty object"))?;
    let used = u16::from_le_bytes(len_bytes) as usize;
    if used > PAGE {
        return Err(corrupt(format!("header length {used} is over {PAGE}")));
    }
    let stored = body.get(2..2 + used).ok_or_else(|| corrupt("object truncated inside its header"))?;
    let mut page = vec![0u8; PAGE];
    page[..used].copy_from_slice(stored);
    let header = BlockHeader::decode(&page).map_err(|e| corrupt(format!("block header: {e:?}")))?;
    if header.key != key {
        return Err(corrupt(format!(
            "object holds key {:?}, not {:?}",
            String::from_utf8_lossy(&header.key),
            String::from_utf8_lossy(key)
        )));
    }
    Ok((header, 2 + used))
}

/// Verify `body` and write the block into `out`; returns the block's length. On any error the
/// bytes written so far are zeroed: a failed read never leaves plausible data behind.
pub fn decode_into(key: &[u8], body: &[u8], out: &mut [u8]) -> Result<usize, DecodeError> {
    let (header, start) = decode_header(key, body)?;
    let payload = &body[start..];
    let raw_len = header.raw_len as usize;
    if out.len() < raw_len {
        return Err(DecodeError::BadBuffer(format!(
            "buffer of {} bytes is smaller than the {raw_len}-byte block",
            out.len()
        )));
    }
    let algo = HashAlgo::from_code(header.hash_algo)
        .ok_or_else(|| corrupt(format!("unknown content hash code {}", header.hash_algo)))?;
    let dst = &mut out[..raw_len];
    if header.compressed() {
        if let Err(e) = decompress_into(payload, dst) {
            dst.fill(0);
            return Err(corrupt(e.to_string()));
        }
        if algo.digest(dst) != header.content_hash {
            dst.fill(0);
            return Err(corrupt("content hash mismatch"));
        }
    } else {
        if payload.len() != raw_len {
            return Err(corrupt(format!("payload is {} bytes, block is {raw_len}", payload.len())));
        }
        // Verify before copying: the caller's buffer only ever receives checked bytes.
        if algo.digest(payload) != header.content_hash {
            return Err(corrupt("content hash mismatch"));
        }
        dst.copy_from_slice(payload);
    }
    Ok(raw_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(n: usize, seed: u32) -> Vec<u8> {
        (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 11) as u8).collect()
    }

    #[test]
    fn round_trip_plain_and_zstd() {
        for codec in [Compression::None, Compression::parse("zstd", 3).unwrap()] {
            for raw in [block(65536, 1), vec![0u8; 65536], Vec::new()] {
                let body = encode(b"ns/k1", &raw, HashAlgo::Xxh3_128, codec);
                let mut out = vec![7u8; raw.len() + 10];
                assert_eq!(decode_into(b"ns/k1", &body, &mut out), Ok(raw.len()));
                assert_eq!(&out[..raw.len()], &raw[..]);
            }
        }
        let zeros = encode(b"k", &[0u8; 65536], HashAlgo::Xxh3_128, Compression::parse("zstd", 3).unwrap());
        assert!(zeros.len() < 4096, "zeros are stored as a zstd frame");
    }

    #[test]
    fn wrong_key_truncation_and_flips_are_corrupt() {
        let raw = block(8192, 2);
        let body = encode(b"ns/k1", &raw, HashAlgo::Xxh3_128, Compression::None);
        let mut out = vec![0u8; raw.len()];
        assert!(matches!(decode_into(b"ns/k2", &body, &mut out), Err(DecodeError::Corrupt(_))));
        for cut in [0, 1, 2, 20, body.len() - 1] {
            assert!(
                matches!(decode_into(b"ns/k1", &body[..cut], &mut out), Err(DecodeError::Corrupt(_))),
                "{cut}"
            );
        }
        for pos in [0, 3, 30, body.len() - 1] {
            let mut bad = body.clone();
            bad[pos] ^= 0x40;
            assert!(matches!(decode_into(b"ns/k1", &bad, &mut out), Err(DecodeError::Corrupt(_))), "{pos}");
            assert!(out.iter().all(|&b| b == 0), "no bytes handed back on a failed read");
        }
        let mut small = vec![0u8; 100];
        assert!(matches!(decode_into(b"ns/k1", &body, &mut small), Err(DecodeError::BadBuffer(_))));
    }

    #[test]
    fn corrupt_zstd_payload_leaves_zeros() {
        let raw = vec![5u8; 65536];
        let mut body = encode(b"k", &raw, HashAlgo::Xxh3_128, Compression::parse("zstd", 1).unwrap());
        let last = body.len() - 3;
        body[last] ^= 0xff;
        let mut out = vec![9u8; raw.len()];
        assert!(matches!(decode_into(b"k", &body, &mut out), Err(DecodeError::Corrupt(_))));
        assert!(out.iter().all(|&b| b == 0));
    }
}
