//! Put phase 2, under the state lock: per block, dedup (same key and content tag,
//! or a stored content with this block's tag — to be confirmed by its header page in phase 3 —
//! or an earlier item of this batch), then room on some device, evicting keys while nothing
//! fits (a last resort: the store's owner deletes what it evicts before that happens). The deletes this causes are journaled before any data is written; if that
//! fails, nothing of the batch is written or acknowledged.

use std::collections::HashMap;

use super::{extent_of, Encoded, Plan};
use crate::format::journal::{content_tag, Location};
use crate::format::PAGE;
use crate::hashing::ContentHash;
use crate::index::extent_pages;
use crate::store::stats::Counters;
use crate::store::{Shared, State};
use crate::tier::batch::{BlockResult, RawBuf, Status};

const POISONED: &str = "identical content failed verification and is being dropped; store it again later";

/// Find room for `pages`, evicting keys while nothing fits.
fn allocate(
    shared: &Shared,
    state: &mut State,
    pages: u64,
    journal: &mut Vec<u8>,
    count: &mut u64,
) -> Option<(usize, u64)> {
    let ndirs = state.allocators.len();
    if !state.allocators.iter().any(|a| a.total_pages() > pages) {
        return None;
    }
    loop {
        for k in 0..ndirs {
            let d = (state.next_dir + k) % ndirs;
            if let Some(first) = state.allocators[d].alloc(pages) {
                state.next_dir = (d + 1) % ndirs;
                return Some((d, first));
            }
        }
        if !shared.evict_one(state, journal, count) {
            return None;
        }
    }
}

pub(super) fn plan(shared: &Shared, items: &[(Vec<u8>, RawBuf)], encoded: &[Encoded]) -> Vec<Plan> {
    let mut plans = Vec::with_capacity(items.len());
    let mut state = shared.state.lock();
    let mut journal = Vec::new();
    let mut count = 0u64;
    let mut leaders: HashMap<ContentHash, usize> = HashMap::new();
    let last_of: HashMap<&[u8], usize> =
        items.iter().enumerate().map(|(i, (k, _))| (k.as_slice(), i)).collect();
    for (i, ((key, buf), enc)) in items.iter().zip(encoded).enumerate() {
        let hash = enc.hash;
        let tag = content_tag(&hash);
        let last = last_of.get(key.as_slice()).copied().unwrap_or(i);
        if last != i {
            plans.push(Plan::Superseded { by: last });
            continue;
        }
        // The key already holds content with this tag. A clash of tags (~2^-48) keeps the
        // key's earlier bytes: a value written for this very key, verified on every read.
        if state.index.lookup(key).is_some_and(|(_, c)| c.tag == tag) {
            Counters::add(&shared.counters.deduped, 1);
            plans.push(Plan::Done(BlockResult::new(Status::Deduped, buf.len as u64)));
            continue;
        }
        if let Some((content, c)) = state.index.candidate(tag) {
            if c.poisoned {
                plans.push(Plan::Done(BlockResult::failed(Status::IoError, POISONED)));
                continue;
            }
            // Pinned: its extent stays this content's until phase 4 maps the key or lets go.
            state.index.pin(content);
            plans.push(Plan::Confirm { hash, content, loc: c.loc });
            continue;
        }
        if let Some(&leader) = leaders.get(&hash) {
            plans.push(Plan::Follow { leader, hash });
            continue;
        }
        let stored_len = enc.packed.as_ref().map_or(buf.len, Vec::len) as u64;
        match allocate(shared, &mut state, extent_pages(stored_len), &mut journal, &mut count) {
            Some((dir, first_page)) => {
                let seq = state.next_seq;
                state.next_seq += 1;
                leaders.insert(hash, i);
                let loc = Location {
                    dir: dir as u16,
                    offset: first_page * PAGE as u64,
                    stored_len,
                    raw_len: buf.len as u64,
                    compressed: enc.packed.is_some(),
                    seq,
                };
                plans.push(Plan::Write { hash, loc });
            }
            None => {
                Counters::add(&shared.counters.no_space, 1);
                plans.push(Plan::Done(BlockResult::failed(
                    Status::NoSpace,
                    format!("a {stored_len}-byte block does not fit in the store's budget"),
                )));
            }
        }
    }
    if let Err(e) = shared.journal_append(&mut state, &journal, count) {
        // The evictions' deletes were not journaled: write nothing and map nothing (freed
        // extents are reused only once a journal rewrite has succeeded).
        Counters::add(&shared.counters.io_errors, 1);
        let failed = || BlockResult::failed(Status::IoError, format!("journal: {e}"));
        for plan in plans.iter_mut() {
            match plan {
                Plan::Write { loc, .. } => {
                    Shared::free_extent(&mut state, Some(extent_of(loc)));
                    *plan = Plan::Done(failed());
                }
                Plan::Confirm { content, .. } => {
                    let released = state.index.unpin(*content);
                    Shared::free_extent(&mut state, released);
                    *plan = Plan::Done(failed());
                }
                Plan::Follow { .. } => *plan = Plan::Done(failed()),
                _ => {}
            }
        }
    }
    plans
}
