//! Reading back what the store keeps on disk only: each block's metadata lives in its header
//! page (see `format::header`), or, for a key deduplicated onto another key's content, in a
//! side file (below). Lock: look up and pin each key's content. No lock: one page-sized read
//! per key, batched on the directory queues. Lock: unpin.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::config::Durability;
use super::{Shared, State};
use crate::device::private::FILE_MODE;
use crate::format::header::BlockHeader;
use crate::format::journal::{content_tag, ContentTag};
use crate::format::PAGE;
use crate::index::ContentId;
use crate::io::aligned::AlignedBuf;
use crate::io::{iovec, IoOp};

struct Pending {
    item: usize,
    content: ContentId,
    tag: ContentTag,
    seq: u64,
    dir: u16,
    offset: u64,
    page: AlignedBuf,
}

/// The metadata stored with each of `keys` (None: not stored, stored without metadata, or
/// unreadable).
pub(super) fn read_metas(shared: &Shared, keys: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
    let mut out: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
    let mut pending: Vec<Pending> = Vec::new();
    {
        let mut state = shared.state.lock();
        for (item, key) in keys.iter().enumerate() {
            let Some((id, content)) = state.index.lookup(key) else { continue };
            state.index.pin(id);
            let loc = content.loc;
            let page = AlignedBuf::zeroed(PAGE);
            pending.push(Pending {
                item,
                content: id,
                tag: content.tag,
                seq: loc.seq,
                dir: loc.dir,
                offset: loc.offset,
                page,
            });
        }
    }
    let ops: Vec<(usize, u16, IoOp)> = pending
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.dir, IoOp::new(p.offset, vec![iovec(p.page.as_ptr(), PAGE)], false)))
        .collect();
    let mut results = shared.devices.run(ops);
    let mut deduped: Vec<usize> = Vec::new(); // items whose header page names another key
    for (i, p) in pending.iter().enumerate() {
        if !matches!(results.remove(&i), Some(Ok(()))) {
            continue;
        }
        let Ok((header, meta)) = BlockHeader::decode_with_meta(p.page.as_slice()) else { continue };
        if content_tag(&header.content_hash) != p.tag || header.seq != p.seq {
            continue;
        }
        if header.key != keys[p.item] {
            deduped.push(p.item);
        } else if !meta.is_empty() {
            out[p.item] = Some(meta.to_vec());
        }
    }
    if !deduped.is_empty() {
        let wanted: Vec<&[u8]> = deduped.iter().map(|&i| keys[i].as_slice()).collect();
        let mut side = side_metas(&shared.cfg.dirs[0], &wanted);
        for i in deduped {
            out[i] = side.remove(&keys[i]).filter(|m| !m.is_empty());
        }
    }
    let mut state = shared.state.lock();
    for p in &pending {
        let released = state.index.unpin(p.content);
        Shared::free_extent(&mut state, released);
    }
    out
}

// ---------------------------------------------------------------- deduplicated keys' metadata
//
// A put whose content is already stored under another key maps the new key onto that content:
// the header page names the key that wrote it, so the new key's metadata (token ids, extra
// keys) has nowhere to go there. It goes to a side file in directory 0 instead: append-only
// records (key, meta, crc32), the last one of a key wins, a torn tail is ignored. Nothing of it
// is in RAM. `read_metas` consults it only for keys whose header page names another key. An
// older build ignores the file (it answers None for such keys, as before): no format bump.
// The file is rewritten with the live keys' records only once it doubled since the last time.

/// The side file of deduplicated keys' metadata, in directory 0.
pub(super) const DEDUP_METAS_FILE: &str = "flexkv-dedup-metas.log";
const MAGIC: &[u8; 8] = b"FKVDMTA1";
/// Magic + the file's length right after its last rewrite (u64 LE).
const FILE_HEADER: usize = 16;
/// No rewrite below this size.
const REWRITE_FLOOR: u64 = 1 << 20;

/// Records of keys a batch mapped onto another key's content, written once journaled.
#[derive(Default)]
pub(super) struct DedupMetas {
    records: Vec<u8>,
}

fn encode_record(out: &mut Vec<u8>, key: &[u8], meta: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(meta);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Every whole record of a side file's bytes, in order (stops at a torn or damaged tail).
fn decode_records(bytes: &[u8]) -> Vec<(&[u8], &[u8])> {
    let mut out = Vec::new();
    if bytes.len() < FILE_HEADER || &bytes[..8] != MAGIC {
        return out;
    }
    let mut at = FILE_HEADER;
    while bytes.len() >= at + 6 {
        let klen = u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
        let mlen = u32::from_le_bytes([bytes[at + 2], bytes[at + 3], bytes[at + 4], bytes[at + 5]]) as usize;
        let end = at + 6 + klen + mlen;
        if bytes.len() < end + 4 {
            break;
        }
        let crc = u32::from_le_bytes([bytes[end], bytes[end + 1], bytes[end + 2], bytes[end + 3]]);
        if crc32fast::hash(&bytes[at..end]) != crc {
            break;
        }
        out.push((&bytes[at + 6..at + 6 + klen], &bytes[at + 6 + klen..end]));
        at = end + 4;
    }
    out
}

fn file_header(rewritten_len: u64) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&rewritten_len.to_le_bytes());
    h
}

impl DedupMetas {
    /// `key` now maps onto another key's content; `meta` its own metadata (None: none).
    pub fn add(&mut self, key: &[u8], meta: Option<&[u8]>) {
        // An empty record too: it replaces what an earlier mapping of the key recorded.
        encode_record(&mut self.records, key, meta.unwrap_or(&[]));
    }

    /// Append the records (call after the mappings were journaled, under the state lock).
    /// A failure loses only metadata (those keys are announced without token ids): logged.
    pub fn write(self, shared: &Shared, state: &State) {
        if self.records.is_empty() || shared.cfg.read_only {
            return;
        }
        let path = shared.cfg.dirs[0].join(DEDUP_METAS_FILE);
        if let Err(e) = append(&path, &self.records, shared.cfg.durability == Durability::Power) {
            tracing::warn!(path = %path.display(), error = %e, "deduplicated keys' metadata not written");
            return;
        }
        if let Err(e) = rewrite_if_grown(&path, state) {
            tracing::warn!(path = %path.display(), error = %e, "deduplicated keys' metadata not rewritten");
        }
    }
}

fn append(path: &Path, records: &[u8], sync: bool) -> std::io::Result<()> {
    let mut f = OpenOptions::new().append(true).create(true).mode(FILE_MODE).open(path)?;
    if f.metadata()?.len() < FILE_HEADER as u64 {
        f.set_len(0)?; // new, or torn before its header was whole
        f.write_all(&file_header(0))?;
    }
    f.write_all(records)?;
    if sync {
        f.sync_data()?;
    }
    Ok(())
}

/// Rewrite the file with the last record of each key still stored, once it doubled since the
/// last rewrite (temp file + rename: a reader sees the old file or the new one, whole).
fn rewrite_if_grown(path: &Path, state: &State) -> std::io::Result<()> {
    let bytes = std::fs::read(path)?;
    let len = bytes.len() as u64;
    let last = bytes.get(8..FILE_HEADER).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    if len < REWRITE_FLOOR || len < 2 * last {
        return Ok(());
    }
    let mut latest: HashMap<&[u8], &[u8]> = HashMap::new();
    let mut order: Vec<&[u8]> = Vec::new();
    for (key, meta) in decode_records(&bytes) {
        if latest.insert(key, meta).is_none() {
            order.push(key);
        }
    }
    let mut records = Vec::new();
    for key in order {
        if state.index.lookup(key).is_some() {
            encode_record(&mut records, key, latest[key]);
        }
    }
    let mut out = file_header((FILE_HEADER + records.len()) as u64);
    out.extend_from_slice(&records);
    let tmp = path.with_extension("log.tmp");
    {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(FILE_MODE).open(&tmp)?;
        f.write_all(&out)?;
        f.sync_data()?;
    }
    std::fs::rename(&tmp, path)
}

/// The side file's metadata of each wanted key (the last record of each), read in one pass.
fn side_metas(dir0: &Path, wanted: &[&[u8]]) -> HashMap<Vec<u8>, Vec<u8>> {
    let mut out = HashMap::new();
    let Ok(bytes) = std::fs::read(dir0.join(DEDUP_METAS_FILE)) else { return out };
    let wanted: std::collections::HashSet<&[u8]> = wanted.iter().copied().collect();
    for (key, meta) in decode_records(&bytes) {
        if wanted.contains(key) {
            out.insert(key.to_vec(), meta.to_vec());
        }
    }
    out
}
