//! Replay: rebuild the index and the allocators from a journal. Records borrow their keys
//! from the journal buffer (no allocation per record); a record whose extent does not fit
//! the data files as they are now (shrunk capacity, recreated file, overlap) is dropped.

use std::collections::VecDeque;

use super::journal_file::Replayed;
use crate::device::allocator::ExtentAllocator;
use crate::format::journal::RecordRef;
use crate::format::PAGE;
use crate::index::{extent_pages, Index};

#[derive(Default)]
pub struct Replay {
    pub last_clean: Option<u64>,
    pub next_seq: u64,
    pub torn: u64,
    pub dropped: u64,
    /// Records the file holds (what the journal's compaction trigger counts).
    pub records: u64,
    /// Where the trailing clean-shutdown marks begin (file offset): a journal reopened as it
    /// is is cut there, so that a crash of this session never reads as a clean shutdown.
    pub clean_from: Option<u64>,
}

/// Apply every record of `replayed` to `index` and `allocators`. `recreated[d]`: directory
/// `d`'s data file was just created, so records pointing there are void.
pub fn replay(
    replayed: &Replayed,
    index: &mut Index,
    allocators: &mut [ExtentAllocator],
    recreated: &[bool],
) -> Replay {
    // A first pass (frame lengths and tags only) sizes the index once.
    index.reserve(replayed.puts_upper_bound());
    let mut out = Replay { next_seq: 1, ..Replay::default() };
    // Records are applied in order, PREFETCH_AHEAD behind the one just read: the table slots
    // a record will probe are asked for when it is read, so the cache misses overlap instead
    // of stalling one after another (they are most of a replay's time at millions of keys).
    let mut ahead: VecDeque<(u64, RecordRef)> = VecDeque::with_capacity(PREFETCH_AHEAD + 1);
    let mut links: Vec<(&[u8], &[u8])> = Vec::new();
    out.torn = replayed.visit(|pos, record| {
        if let RecordRef::Put { key, tag, parent, .. } = &record {
            index.prefetch(key, *tag);
            if let Some(p) = parent {
                links.push((key, p));
            }
        }
        ahead.push_back((pos, record));
        if ahead.len() > PREFETCH_AHEAD {
            if let Some((pos, record)) = ahead.pop_front() {
                apply(&mut out, index, allocators, recreated, pos, record);
            }
        }
    });
    for (pos, record) in ahead {
        apply(&mut out, index, allocators, recreated, pos, record);
    }
    // Chain links last: a parent may come after its child in the journal (a compacted journal
    // is in arena order), so links are resolved once every key is in. Later records win.
    for (key, parent) in links {
        index.set_parent(key, Some(parent));
    }
    out
}

/// Records between reading one and applying it (enough to cover a memory access).
const PREFETCH_AHEAD: usize = 16;

fn apply(
    out: &mut Replay,
    index: &mut Index,
    allocators: &mut [ExtentAllocator],
    recreated: &[bool],
    pos: u64,
    record: RecordRef,
) {
    out.records += 1;
    if !matches!(record, RecordRef::CleanShutdown { .. }) {
        out.clean_from = None;
    }
    match record {
        RecordRef::Put { key, tag, loc, .. } => {
            out.last_clean = None;
            out.next_seq = out.next_seq.max(loc.seq + 1);
            let dir = loc.dir as usize;
            let admit = || {
                dir < allocators.len()
                    && !recreated[dir]
                    && loc.offset % PAGE as u64 == 0
                    && allocators[dir].reserve(loc.offset / PAGE as u64, extent_pages(loc.stored_len))
            };
            match index.replay_put(key, tag, &loc, admit) {
                None => out.dropped += 1,
                Some(Some(f)) => allocators[f.dir as usize].free(f.first_page, f.pages),
                Some(None) => {}
            }
        }
        RecordRef::Delete { key } => {
            out.last_clean = None;
            if let Some(f) = index.remove(key) {
                allocators[f.dir as usize].free(f.first_page, f.pages);
            }
        }
        RecordRef::CleanShutdown { unix_secs } => {
            out.last_clean = Some(unix_secs);
            out.clean_from.get_or_insert(pos);
        }
    }
}
