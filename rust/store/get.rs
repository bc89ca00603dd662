//! The get path. Lock: look up and pin each block's content (so eviction cannot reuse the
//! extent mid-read). No lock: one vectored read per block (header page + payload, straight
//! into caller memory when aligned), then verify the header and the content hash. The index
//! holds only an 8-byte content tag: the header must carry the indexed seq and tag (so it is
//! the indexed write), and the payload must match the header's full hash. Lock: drop keys
//! whose content proved corrupt so they are recomputed, never served, and unpin.

use super::stats::Counters;
use super::Shared;
use crate::compression::decompress_into;
use crate::format::header::BlockHeader;
use crate::format::journal::{content_tag, ContentTag, Location, Record};
use crate::format::{round_up_to_page, PAGE};
use crate::index::{extent_pages, ContentId};
use crate::io::aligned::{is_aligned, AlignedBuf};
use crate::io::{iovec, IoFailure, IoOp};
use crate::tier::batch::{BlockResult, RawBuf, Status};

struct Pending {
    item: usize,
    content: ContentId,
    tag: ContentTag,
    loc: Location,
    header: AlignedBuf,
    /// Set when the payload cannot land in caller memory directly.
    bounce: Option<AlignedBuf>,
}

pub(super) fn run(shared: &Shared, items: &[(Vec<u8>, RawBuf)]) -> Vec<BlockResult> {
    let mut results: Vec<Option<BlockResult>> = vec![None; items.len()];
    let mut pending: Vec<Pending> = Vec::new();
    {
        let mut state = shared.state.lock();
        for (i, (key, buf)) in items.iter().enumerate() {
            let Some((id, content)) = state.index.lookup(key) else {
                Counters::add(&shared.counters.misses, 1);
                results[i] = Some(BlockResult::new(Status::NotFound, 0));
                continue;
            };
            let loc = content.loc.clone();
            if (buf.len as u64) < loc.raw_len {
                results[i] = Some(BlockResult::failed(
                    Status::BadBuffer,
                    format!("buffer of {} bytes is smaller than the {}-byte block", buf.len, loc.raw_len),
                ));
                continue;
            }
            state.index.pin(id);
            let header = AlignedBuf::zeroed(PAGE);
            pending.push(Pending { item: i, content: id, tag: content.tag, loc, header, bounce: None });
        }
    }

    let mut ops: Vec<(usize, u16, IoOp)> = Vec::with_capacity(pending.len());
    for (p_idx, p) in pending.iter_mut().enumerate() {
        let buf = items[p.item].1;
        let mut iov = vec![iovec(p.header.as_ptr(), PAGE)];
        if p.loc.stored_len > 0 {
            let direct = !p.loc.compressed && is_aligned(buf.ptr as usize, p.loc.raw_len as usize);
            if direct {
                iov.push(iovec(buf.ptr, p.loc.raw_len as usize));
            } else {
                let bounce = AlignedBuf::zeroed(round_up_to_page(p.loc.stored_len as usize));
                iov.push(iovec(bounce.as_ptr(), bounce.len()));
                p.bounce = Some(bounce);
            }
        }
        ops.push((p_idx, p.loc.dir, IoOp::new(p.loc.offset, iov, false)));
    }
    let mut io_results = shared.devices.run(ops);

    let mut corrupt: Vec<(ContentId, Location)> = Vec::new();
    for (p_idx, p) in pending.iter().enumerate() {
        let buf = items[p.item].1;
        let outcome = match io_results.remove(&p_idx).unwrap_or(Err(IoFailure::Errno(libc::EIO))) {
            Err(IoFailure::Short { done, expected }) => {
                Err((Status::Corrupt, format!("block truncated on disk: read {done} of {expected} bytes")))
            }
            Err(f) => {
                Err((Status::IoError, format!("read from {}: {f}", shared.devices.path(p.loc.dir).display())))
            }
            Ok(()) => verify(shared, p, buf),
        };
        results[p.item] = Some(match outcome {
            Ok(()) => {
                Counters::add(&shared.counters.hits, 1);
                Counters::add(&shared.counters.bytes_read, extent_pages(p.loc.stored_len) * PAGE as u64);
                BlockResult::new(Status::Ok, p.loc.raw_len)
            }
            Err((status, msg)) => {
                if status == Status::Corrupt {
                    Counters::add(&shared.counters.corrupt_reads, 1);
                    corrupt.push((p.content, p.loc.clone()));
                    // The key's last 8 bytes in hex, as the Python side logs it (keys are binary).
                    let key = &items[p.item].0;
                    let tail: String =
                        key[key.len().saturating_sub(8)..].iter().map(|b| format!("{b:02x}")).collect();
                    tracing::warn!(key = %tail, reason = %msg, "corrupt block");
                } else {
                    Counters::add(&shared.counters.io_errors, 1);
                }
                BlockResult::failed(status, msg)
            }
        });
    }

    {
        let mut state = shared.state.lock();
        // Before the unpins: a pinned content id still names the content that was read.
        if !corrupt.is_empty() && state.journal.is_open() {
            drop_content(shared, &mut state, &corrupt);
        }
        for p in &pending {
            let released = state.index.unpin(p.content);
            Shared::free_extent(&mut state, released);
        }
    }
    results.into_iter().map(|r| r.unwrap_or_else(|| BlockResult::failed(Status::IoError, "lost"))).collect()
}

fn verify(shared: &Shared, p: &Pending, buf: RawBuf) -> Result<(), (Status, String)> {
    let corrupt = |m: String| Err((Status::Corrupt, m));
    let header = match BlockHeader::decode(p.header.as_slice()) {
        Ok(h) => h,
        Err(e) => return corrupt(format!("block header unreadable ({e:?})")),
    };
    if content_tag(&header.content_hash) != p.tag
        || header.raw_len != p.loc.raw_len
        || header.stored_len != p.loc.stored_len
        || header.seq != p.loc.seq
        || header.compressed() != p.loc.compressed
    {
        return corrupt("block header names a different block".into());
    }
    let raw_len = p.loc.raw_len as usize;
    // SAFETY: the caller's buffer is writable and at least raw_len bytes (checked at lookup).
    let out = unsafe { std::slice::from_raw_parts_mut(buf.ptr, raw_len) };
    if let Some(bounce) = &p.bounce {
        let stored = &bounce.as_slice()[..p.loc.stored_len as usize];
        if p.loc.compressed {
            decompress_into(stored, out).map_err(|e| (Status::Corrupt, e.to_string()))?;
        } else {
            out.copy_from_slice(stored);
        }
    }
    if shared.cfg.hash.digest(out) != header.content_hash {
        return corrupt("content hash mismatch: block bytes are damaged".into());
    }
    Ok(())
}

/// Forget every key that maps to damaged content, so no later put dedups against it. Only
/// content still at the location that was read is dropped (it may have been stored again
/// elsewhere meanwhile); if a reader still pins it, it stays poisoned until unpinned.
pub(super) fn drop_content(shared: &Shared, state: &mut super::State, damaged: &[(ContentId, Location)]) {
    let current: Vec<ContentId> = damaged
        .iter()
        .filter(|(id, loc)| state.index.content(*id).is_some_and(|c| c.loc == *loc))
        .map(|(id, _)| *id)
        .collect();
    if current.is_empty() {
        return;
    }
    for &id in &current {
        state.index.poison(id);
    }
    let doomed: Vec<Vec<u8>> =
        state.index.keys_any_order().filter(|(_, c)| current.contains(c)).map(|(k, _)| k).collect();
    let mut journal = Vec::new();
    for key in &doomed {
        let released = state.index.remove(key);
        Shared::free_extent(state, released);
        Record::Delete { key: key.clone() }.encode_into(&mut journal);
    }
    if let Err(e) = shared.journal_append(state, &journal, doomed.len() as u64) {
        tracing::error!("journal append failed while dropping corrupt blocks: {e}");
    }
}
