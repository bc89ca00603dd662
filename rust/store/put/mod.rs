//! The put path, one file per phase:
//! 1. encode (no lock, here): content hash and optional compression per block;
//! 2. `admit` (lock): dedup, allocation (evicting when full); journal the deletes;
//! 3. `write` (no lock): one vectored write per block — header page + payload, straight from
//!    caller memory when it is page-aligned — then fdatasync when durability asks for it; and
//!    one header-page read per dedup candidate (the index finds it by its 6-byte content tag:
//!    only the full hash in its header confirms it is this block's content);
//! 4. `commit` (lock): index the written blocks and journal them; only then is a put
//!    acknowledged. Then the reply (superseded duplicates copy their winner's result).

mod admit;
mod commit;
mod write;

use super::Shared;
use crate::format::journal::Location;
use crate::format::PAGE;
use crate::hashing::ContentHash;
use crate::index::{extent_pages, ContentId, FreedExtent};
use crate::tier::batch::{BlockResult, RawBuf};

/// What a put may carry beside the bytes: the previous block of the key's prefix chain
/// (journaled, a few bytes in RAM) and opaque metadata (in the header page only, never in RAM).
#[derive(Clone, Debug, Default)]
pub struct PutExtra {
    pub parent: Option<Vec<u8>>,
    pub meta: Option<Vec<u8>>,
}

/// The extra of item `i` (`extras` is empty when a batch carries none).
fn extra_of(extras: &[PutExtra], i: usize) -> Option<&PutExtra> {
    extras.get(i)
}

/// What phase 2 decided for one item of the batch.
enum Plan {
    Done(BlockResult),
    Write {
        hash: ContentHash,
        loc: Location,
    },
    /// A stored content has this block's tag: pinned until its header page's full hash
    /// confirms (or refutes) that it is this block's content.
    Confirm {
        hash: ContentHash,
        content: ContentId,
        loc: Location,
    },
    /// Same content as an earlier item of this batch that is being written.
    Follow {
        leader: usize,
        hash: ContentHash,
    },
    /// The same key appears again later in the batch; the last occurrence wins.
    Superseded {
        by: usize,
    },
}

/// Phase 1's output per item: the content hash and, when compression paid off, the packed bytes.
struct Encoded {
    hash: ContentHash,
    packed: Option<Vec<u8>>,
}

fn extent_of(loc: &Location) -> FreedExtent {
    FreedExtent { dir: loc.dir, first_page: loc.offset / PAGE as u64, pages: extent_pages(loc.stored_len) }
}

pub(super) fn run(shared: &Shared, items: &[(Vec<u8>, RawBuf)], extras: &[PutExtra]) -> Vec<BlockResult> {
    let encoded = encode(shared, items);
    let plans = admit::plan(shared, items, &encoded);
    let written = write::write(shared, items, extras, &encoded, &plans);
    let results = commit::commit(shared, items, extras, &plans, written);
    shared.maybe_compact();
    reply(&plans, results)
}

/// Phase 1: content hashes and optional compression, outside any lock.
fn encode(shared: &Shared, items: &[(Vec<u8>, RawBuf)]) -> Vec<Encoded> {
    let cfg = &shared.cfg;
    items
        .iter()
        .map(|(_, buf)| {
            // SAFETY: the submitter keeps `buf` readable until the batch completes.
            let data = unsafe { buf.as_slice() };
            Encoded { hash: cfg.hash.digest(data), packed: cfg.compression.compress(data) }
        })
        .collect()
}

/// The reply: a superseded occurrence of a key reports what its winning occurrence got.
fn reply(plans: &[Plan], mut results: Vec<Option<BlockResult>>) -> Vec<BlockResult> {
    for (i, plan) in plans.iter().enumerate() {
        if let Plan::Superseded { by } = plan {
            results[i] = results[*by].clone();
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| BlockResult::failed(super::Status::IoError, "lost")))
        .collect()
}
