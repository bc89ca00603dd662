//! Journal records. The journal is the store's only metadata: replaying it rebuilds the index.
//! A record is appended only after its block's data write completed, so every record names
//! complete bytes; a torn tail fails its CRC and replay stops there.
//!
//! Frame: `len: u32 | crc32(body): u32 | body`.
//!
//! v2: a put names the block's parent (the previous block of its prefix chain), so the chains
//! survive a restart (prefix-aware eviction, the restart announcement).
//!
//! v3: a put names its content by an 8-byte tag (the first 8 bytes of the content hash), not
//! the 16-byte hash: the index keeps only the tag in RAM, and a compaction writes the journal
//! from RAM. The full hash stays in the block's header page, where every read checks it.
//!
//! v4: the tag is the first 6 bytes (the index keeps 6 in RAM), still in an 8-byte field. A v3
//! journal is migrated, not set aside: its tags are read masked to 6 bytes and the journal is
//! rewritten as v4 when the store opens (`MIGRATES_FROM`).

use super::{Reader, MAX_KEY_LEN};
use crate::hashing::ContentHash;

pub const FILE_MAGIC: &[u8; 8] = b"FLXKVJNL";
pub const FILE_VERSION: u32 = 4;
/// The older version this build opens: v3 differs only in 8-byte tags, read masked to 6.
pub const MIGRATES_FROM: u32 = 3;

/// What the index and the journal know of a block's content: the first 6 bytes of its content
/// hash (`TAG_MASK` of a u64). Two different blocks share a tag ~2^-48 of the time per pair, so
/// a tag only *finds* a dedup candidate; the header page's full hash confirms it (see
/// `store/put`: a refuted candidate fails that put, ~n/2^48 of puts with n contents stored).
pub type ContentTag = u64;

/// The bits of a `ContentTag` that count (a v3 journal's tags carry 16 more: dropped).
pub const TAG_MASK: ContentTag = (1 << 48) - 1;

pub fn content_tag(hash: &ContentHash) -> ContentTag {
    let mut b = [0u8; 8];
    b[..6].copy_from_slice(&hash[..6]);
    u64::from_le_bytes(b)
}
/// Bytes of the file header: magic, version, hash algo, dir count, store id.
pub const FILE_HEADER_LEN: usize = 8 + 4 + 1 + 2 + 8;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub dir: u16,
    /// Byte offset of the block's header page in the directory's data file.
    pub offset: u64,
    pub stored_len: u64,
    pub raw_len: u64,
    pub compressed: bool,
    pub seq: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// `key` now maps to the content tagged `tag` stored at `loc`; `parent` precedes it in its
    /// chain.
    Put { key: Vec<u8>, tag: ContentTag, loc: Location, parent: Option<Vec<u8>> },
    /// `key` was deleted or evicted.
    Delete { key: Vec<u8> },
    /// The store was closed cleanly at `unix_secs`; nothing may follow except a new session.
    CleanShutdown { unix_secs: u64 },
}

/// A decoded record borrowing its key from the journal buffer: replay walks a whole journal
/// without one allocation per record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordRef<'a> {
    Put { key: &'a [u8], tag: ContentTag, loc: Location, parent: Option<&'a [u8]> },
    Delete { key: &'a [u8] },
    CleanShutdown { unix_secs: u64 },
}

impl RecordRef<'_> {
    pub fn to_owned(&self) -> Record {
        match self {
            RecordRef::Put { key, tag, loc, parent } => Record::Put {
                key: key.to_vec(),
                tag: *tag,
                loc: loc.clone(),
                parent: parent.map(<[u8]>::to_vec),
            },
            RecordRef::Delete { key } => Record::Delete { key: key.to_vec() },
            RecordRef::CleanShutdown { unix_secs } => Record::CleanShutdown { unix_secs: *unix_secs },
        }
    }
}

const TAG_PUT: u8 = 1;
const TAG_DELETE: u8 = 2;
const TAG_CLEAN: u8 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileHeader {
    pub hash_algo: u8,
    pub dir_count: u16,
    pub store_id: u64,
}

impl FileHeader {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(FILE_HEADER_LEN);
        w.extend_from_slice(FILE_MAGIC);
        w.extend_from_slice(&FILE_VERSION.to_le_bytes());
        w.push(self.hash_algo);
        w.extend_from_slice(&self.dir_count.to_le_bytes());
        w.extend_from_slice(&self.store_id.to_le_bytes());
        w
    }

    /// The format version of a header with flexkv's journal magic (None: not a flexkv journal).
    pub fn version_of(buf: &[u8]) -> Option<u32> {
        let mut r = Reader::new(buf);
        if r.bytes(8)? != FILE_MAGIC {
            return None;
        }
        r.u32()
    }

    pub fn decode(buf: &[u8]) -> Option<Self> {
        let mut r = Reader::new(buf);
        if r.bytes(8)? != FILE_MAGIC || ![FILE_VERSION, MIGRATES_FROM].contains(&r.u32()?) {
            return None;
        }
        Some(FileHeader { hash_algo: r.u8()?, dir_count: r.u16()?, store_id: r.u64()? })
    }
}

impl Record {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let mut body = Vec::with_capacity(96);
        match self {
            Record::Put { key, tag, loc, parent } => {
                body.push(TAG_PUT);
                put_key(&mut body, key);
                body.extend_from_slice(&tag.to_le_bytes());
                body.extend_from_slice(&loc.dir.to_le_bytes());
                body.extend_from_slice(&loc.offset.to_le_bytes());
                body.extend_from_slice(&loc.stored_len.to_le_bytes());
                body.extend_from_slice(&loc.raw_len.to_le_bytes());
                body.push(loc.compressed as u8);
                body.extend_from_slice(&loc.seq.to_le_bytes());
                body.push(parent.is_some() as u8);
                if let Some(p) = parent {
                    put_key(&mut body, p);
                }
            }
            Record::Delete { key } => {
                body.push(TAG_DELETE);
                put_key(&mut body, key);
            }
            Record::CleanShutdown { unix_secs } => {
                body.push(TAG_CLEAN);
                body.extend_from_slice(&unix_secs.to_le_bytes());
            }
        }
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out.extend_from_slice(&body);
    }
}

impl<'a> RecordRef<'a> {
    fn decode_body(body: &'a [u8]) -> Option<Self> {
        let mut r = Reader::new(body);
        let record = match r.u8()? {
            TAG_PUT => {
                let key = get_key(&mut r)?;
                let tag = r.u64()?;
                let loc = Location {
                    dir: r.u16()?,
                    offset: r.u64()?,
                    stored_len: r.u64()?,
                    raw_len: r.u64()?,
                    compressed: r.u8()? != 0,
                    seq: r.u64()?,
                };
                let parent = match r.u8()? {
                    0 => None,
                    1 => Some(get_key(&mut r)?),
                    _ => return None,
                };
                RecordRef::Put { key, tag, loc, parent }
            }
            TAG_DELETE => RecordRef::Delete { key: get_key(&mut r)? },
            TAG_CLEAN => RecordRef::CleanShutdown { unix_secs: r.u64()? },
            _ => return None,
        };
        (r.pos() == body.len()).then_some(record)
    }
}

fn put_key(body: &mut Vec<u8>, key: &[u8]) {
    body.extend_from_slice(&(key.len() as u16).to_le_bytes());
    body.extend_from_slice(key);
}

fn get_key<'a>(r: &mut Reader<'a>) -> Option<&'a [u8]> {
    let n = r.u16()? as usize;
    if n > MAX_KEY_LEN {
        return None;
    }
    r.bytes(n)
}

/// Result of decoding a journal body (everything after the file header).
pub struct Decoded {
    pub records: Vec<Record>,
    /// Bytes of valid frames; anything after is a torn or corrupt tail to truncate.
    pub valid_len: usize,
}

pub fn decode_all(buf: &[u8]) -> Decoded {
    let mut records = Vec::new();
    let valid_len = visit_all(buf, |_, r| records.push(r.to_owned()));
    Decoded { records, valid_len }
}

/// Put records framed in a journal body, counted from frame lengths and tags alone (no CRC,
/// no decode): an upper bound that sizes the index before the real replay.
pub fn count_puts(buf: &[u8]) -> usize {
    let mut pos = 0usize;
    let mut puts = 0;
    while let Some(frame) = buf.get(pos..pos + 9) {
        puts += (frame[8] == TAG_PUT) as usize;
        pos += 8 + u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
    }
    puts
}

/// Call `f` on every whole record of a journal body, in order, with the byte position of its
/// frame; returns the bytes of valid frames (anything after is a torn or corrupt tail).
pub fn visit_all<'a>(buf: &'a [u8], mut f: impl FnMut(usize, RecordRef<'a>)) -> usize {
    let mut pos = 0usize;
    while let Some(frame) = buf.get(pos..pos + 8) {
        let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
        let crc = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
        let Some(body) = buf.get(pos + 8..pos + 8 + len) else { break };
        if crc32fast::hash(body) != crc {
            break;
        }
        let Some(record) = RecordRef::decode_body(body) else { break };
        f(pos, record);
        pos += 8 + len;
    }
    pos
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_record() -> impl Strategy<Value = Record> {
        let key = proptest::collection::vec(any::<u8>(), 0..80);
        prop_oneof![
            (
                (key.clone(), proptest::option::of(proptest::collection::vec(any::<u8>(), 0..80))),
                any::<u64>(),
                any::<u16>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<bool>(),
                any::<u64>()
            )
                .prop_map(
                    |((key, parent), tag, dir, offset, stored_len, raw_len, compressed, seq)| {
                        Record::Put {
                            key,
                            tag,
                            loc: Location { dir, offset, stored_len, raw_len, compressed, seq },
                            parent,
                        }
                    }
                ),
            key.prop_map(|key| Record::Delete { key }),
            any::<u64>().prop_map(|unix_secs| Record::CleanShutdown { unix_secs }),
        ]
    }

    proptest! {
        #[test]
        fn roundtrip(records in proptest::collection::vec(arb_record(), 0..40)) {
            let mut buf = Vec::new();
            for r in &records { r.encode_into(&mut buf); }
            let decoded = decode_all(&buf);
            prop_assert_eq!(decoded.valid_len, buf.len());
            prop_assert_eq!(decoded.records, records);
        }

        #[test]
        fn torn_tail_keeps_only_whole_records(records in proptest::collection::vec(arb_record(), 1..20), cut in any::<prop::sample::Index>()) {
            let mut buf = Vec::new();
            let mut ends = Vec::new();
            for r in &records { r.encode_into(&mut buf); ends.push(buf.len()); }
            let cut = cut.index(buf.len());
            let decoded = decode_all(&buf[..cut]);
            let whole = ends.iter().filter(|&&e| e <= cut).count();
            prop_assert_eq!(decoded.records.len(), whole);
            prop_assert_eq!(&decoded.records[..], &records[..whole]);
        }
    }

    #[test]
    fn file_header_roundtrip() {
        let h = FileHeader { hash_algo: 2, dir_count: 3, store_id: 99 };
        let enc = h.encode();
        assert_eq!(enc.len(), FILE_HEADER_LEN);
        assert_eq!(FileHeader::decode(&enc), Some(h));
        assert_eq!(FileHeader::decode(b"garbage-garbage-garbage"), None);
    }
}
