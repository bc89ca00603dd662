//! Put phase 2, under the state lock: per block, admission, dedup (same key and content, or
//! content already stored, or an earlier item of this batch), then room on some device,
//! evicting cold keys while nothing fits. The deletes this causes are journaled before any
//! data is written; if that fails, nothing of the batch is written or acknowledged.

use std::collections::HashMap;

use super::{extent_of, extra_of, Encoded, Plan, PutExtra};
use crate::format::journal::{Location, Record};
use crate::format::PAGE;
use crate::hashing::ContentHash;
use crate::index::extent_pages;
use crate::store::batch::{BlockResult, RawBuf, Status};
use crate::store::metas::DedupMetas;
use crate::store::stats::Counters;
use crate::store::{Shared, State};

const POISONED: &str = "identical content failed verification and is being dropped; store it again later";

/// Find room for `pages`, evicting cold keys while nothing fits.
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

pub(super) fn plan(
    shared: &Shared,
    items: &[(Vec<u8>, RawBuf)],
    extras: &[PutExtra],
    encoded: &[Encoded],
) -> Vec<Plan> {
    let mut plans = Vec::with_capacity(items.len());
    let mut state = shared.state.lock();
    let mut journal = Vec::new();
    let mut count = 0u64;
    let mut leaders: HashMap<ContentHash, usize> = HashMap::new();
    let mut deduped_now: Vec<usize> = Vec::new();
    let mut dedup_metas = DedupMetas::default();
    let last_of: HashMap<&[u8], usize> =
        items.iter().enumerate().map(|(i, (k, _))| (k.as_slice(), i)).collect();
    for (i, ((key, buf), enc)) in items.iter().zip(encoded).enumerate() {
        let hash = enc.hash;
        let last = last_of.get(key.as_slice()).copied().unwrap_or(i);
        if last != i {
            plans.push(Plan::Superseded { by: last });
            continue;
        }
        if !state.sketch.offer(key) {
            Counters::add(&shared.counters.rejected, 1);
            plans.push(Plan::Done(BlockResult::new(Status::Rejected, buf.len as u64)));
            continue;
        }
        if state.index.lookup(key).is_some_and(|(h, _)| h == hash) {
            state.index.touch(key);
            Counters::add(&shared.counters.deduped, 1);
            plans.push(Plan::Done(BlockResult::new(Status::Deduped, buf.len as u64)));
            continue;
        }
        if state.index.content(&hash).is_some_and(|c| c.poisoned) {
            plans.push(Plan::Done(BlockResult::failed(Status::IoError, POISONED)));
            continue;
        }
        if let Some(existing) = state.index.content(&hash).map(|c| c.loc.clone()) {
            deduped_now.push(i);
            let released = state.index.insert(key, hash, &existing);
            Shared::free_extent(&mut state, released);
            // The existing content's header page names the key that wrote it: this key's
            // metadata goes to the side file (store/metas.rs) once journaled.
            dedup_metas.add(key, extra_of(extras, i).and_then(|x| x.meta.as_deref()));
            let parent = extra_of(extras, i).and_then(|x| x.parent.clone());
            state.index.set_parent(key, parent.as_deref());
            Record::Put { key: key.clone(), hash, loc: existing, parent }.encode_into(&mut journal);
            count += 1;
            Counters::add(&shared.counters.deduped, 1);
            plans.push(Plan::Done(BlockResult::new(Status::Deduped, buf.len as u64)));
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
    let journaled = shared.journal_append(&mut state, &journal, count);
    if journaled.is_ok() {
        dedup_metas.write(shared, &state);
    }
    if let Err(e) = journaled {
        // Not journaled means not acknowledged: undo this phase's dedup mappings and write
        // nothing (freed extents are reused only once a journal rewrite has succeeded).
        Counters::add(&shared.counters.io_errors, 1);
        let failed = || BlockResult::failed(Status::IoError, format!("journal: {e}"));
        for &i in &deduped_now {
            let released = state.index.remove(&items[i].0);
            Shared::free_extent(&mut state, released);
            plans[i] = Plan::Done(failed());
        }
        for plan in plans.iter_mut() {
            match plan {
                Plan::Write { loc, .. } => {
                    Shared::free_extent(&mut state, Some(extent_of(loc)));
                    *plan = Plan::Done(failed());
                }
                Plan::Follow { .. } => *plan = Plan::Done(failed()),
                _ => {}
            }
        }
    }
    plans
}
