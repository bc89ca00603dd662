//! Reading back what the store keeps on disk only: each block's metadata lives in its header
//! page (see `format::header`). Lock: look up and pin each key's content. No lock: one
//! page-sized read per key, batched on the directory queues. Lock: unpin.

use super::Shared;
use crate::format::header::BlockHeader;
use crate::format::PAGE;
use crate::hashing::ContentHash;
use crate::io::aligned::AlignedBuf;
use crate::io::{iovec, IoOp};

struct Pending {
    item: usize,
    hash: ContentHash,
    seq: u64,
    dir: u16,
    offset: u64,
    page: AlignedBuf,
}

/// The metadata stored with each of `keys` (None: not stored, stored without metadata, stored
/// as a duplicate of another key's content, or unreadable).
pub(super) fn read_metas(shared: &Shared, keys: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
    let mut out: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
    let mut pending: Vec<Pending> = Vec::new();
    {
        let mut state = shared.state.lock();
        for (item, key) in keys.iter().enumerate() {
            let Some((hash, content)) = state.index.lookup(key) else { continue };
            state.index.pin(&hash);
            let loc = content.loc;
            let page = AlignedBuf::zeroed(PAGE);
            pending.push(Pending { item, hash, seq: loc.seq, dir: loc.dir, offset: loc.offset, page });
        }
    }
    let ops: Vec<(usize, u16, IoOp)> = pending
        .iter()
        .enumerate()
        .map(|(i, p)| (i, p.dir, IoOp::new(p.offset, vec![iovec(p.page.as_ptr(), PAGE)], false)))
        .collect();
    let mut results = shared.devices.run(ops);
    for (i, p) in pending.iter().enumerate() {
        if !matches!(results.remove(&i), Some(Ok(()))) {
            continue;
        }
        let Ok((header, meta)) = BlockHeader::decode_with_meta(p.page.as_slice()) else { continue };
        let ours = header.content_hash == p.hash && header.seq == p.seq && header.key == keys[p.item];
        if ours && !meta.is_empty() {
            out[p.item] = Some(meta.to_vec());
        }
    }
    let mut state = shared.state.lock();
    for p in &pending {
        let released = state.index.unpin(&p.hash);
        Shared::free_extent(&mut state, released);
    }
    out
}
