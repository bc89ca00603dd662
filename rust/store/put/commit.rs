//! Put phase 4, under the state lock: index what was written, map confirmed duplicates and
//! followers onto the content they share, free what failed, and journal the new mappings.
//! A block written while another batch stored the same content keeps its own copy: the index
//! holds tags, not hashes, so only a header read could prove the two equal. Only a journaled
//! mapping is acknowledged: if the append fails the batch's blocks are withdrawn again.

use super::write::Written;
use super::{extent_of, extra_of, Plan, PutExtra};
use crate::format::journal::{content_tag, ContentTag, Location, Record};
use crate::format::PAGE;
use crate::index::{extent_pages, ContentId};
use crate::store::get::drop_content;
use crate::store::metas::DedupMetas;
use crate::store::stats::Counters;
use crate::store::{Shared, State};
use crate::tier::batch::{BlockResult, RawBuf, Status};

const POISONED: &str = "identical content failed verification and is being dropped; store it again later";

/// Changes to journal, and which items they acknowledge.
#[derive(Default)]
struct Pending {
    journal: Vec<u8>,
    count: u64,
    acknowledged: Vec<usize>,
    /// Keys mapped onto content whose header page names another key: their metadata.
    dedup: DedupMetas,
}

impl Pending {
    /// Queue the journal record of `key`'s new mapping (made in the index) and link its parent.
    fn record(&mut self, state: &mut State, (i, key, parent, _): Item<'_>, tag: ContentTag, loc: &Location) {
        state.index.set_parent(key, parent);
        let parent = parent.map(<[u8]>::to_vec);
        Record::Put { key: key.to_vec(), tag, loc: loc.clone(), parent }.encode_into(&mut self.journal);
        self.count += 1;
        self.acknowledged.push(i);
    }

    /// Map `key` to the content it just wrote at `loc`.
    fn map(&mut self, state: &mut State, item: Item<'_>, tag: ContentTag, loc: &Location) {
        let released = state.index.insert(item.1, tag, loc);
        Shared::free_extent(state, released);
        self.record(state, item, tag, loc);
    }

    /// Map `key` onto stored content another key wrote (its header page names that key); false
    /// when that content is gone.
    fn map_deduped(&mut self, state: &mut State, item: Item<'_>, tag: ContentTag, loc: &Location) -> bool {
        let Some(released) = state.index.share(item.1, tag, loc) else { return false };
        Shared::free_extent(state, released);
        self.dedup.add(item.1, item.3);
        self.record(state, item, tag, loc);
        true
    }
}

/// One item of the batch: its position, key, chain parent and metadata.
type Item<'a> = (usize, &'a [u8], Option<&'a [u8]>, Option<&'a [u8]>);

/// The result for a block whose write finished (`outcome`).
fn written(
    shared: &Shared,
    state: &mut State,
    pending: &mut Pending,
    item: Item<'_>,
    (tag, loc): (ContentTag, &Location),
    outcome: Result<(), String>,
) -> BlockResult {
    if let Err(msg) = outcome {
        Shared::free_extent(state, Some(extent_of(loc)));
        Counters::add(&shared.counters.io_errors, 1);
        return BlockResult::failed(Status::IoError, msg);
    }
    pending.map(state, item, tag, loc);
    Counters::add(&shared.counters.puts, 1);
    Counters::add(&shared.counters.bytes_written, extent_pages(loc.stored_len) * PAGE as u64);
    if loc.compressed {
        Counters::add(&shared.counters.compressed_blocks, 1);
    }
    BlockResult::new(Status::Ok, loc.raw_len)
}

/// The result for a dedup candidate whose header page was read (`outcome`: Ok if it confirmed
/// the candidate). The candidate is still pinned, so it is live; it may have been poisoned since.
fn confirmed(
    shared: &Shared,
    state: &mut State,
    pending: &mut Pending,
    item: Item<'_>,
    (content, tag, loc): (ContentId, ContentTag, &Location),
    outcome: Result<(), String>,
) -> BlockResult {
    if let Err(msg) = outcome {
        Counters::add(&shared.counters.io_errors, 1);
        return BlockResult::failed(Status::IoError, format!("not deduplicated: {msg}"));
    }
    let poisoned = state.index.content(content).is_some_and(|c| c.poisoned);
    if poisoned || !pending.map_deduped(state, item, tag, loc) {
        return BlockResult::failed(Status::IoError, POISONED);
    }
    Counters::add(&shared.counters.deduped, 1);
    BlockResult::new(Status::Deduped, loc.raw_len)
}

pub(super) fn commit(
    shared: &Shared,
    items: &[(Vec<u8>, RawBuf)],
    extras: &[PutExtra],
    plans: &[Plan],
    Written { mut outcomes, damaged }: Written,
) -> Vec<Option<BlockResult>> {
    let mut state = shared.state.lock();
    let mut pending = Pending::default();
    let mut results: Vec<Option<BlockResult>> = Vec::with_capacity(items.len());
    for (i, plan) in plans.iter().enumerate() {
        let key = &items[i].0;
        let extra = extra_of(extras, i);
        let item = (
            i,
            key.as_slice(),
            extra.and_then(|x| x.parent.as_deref()),
            extra.and_then(|x| x.meta.as_deref()),
        );
        let result = match plan {
            Plan::Done(r) => r.clone(),
            // Filled in by the reply, once the winning occurrence has its result.
            Plan::Superseded { .. } => BlockResult::new(Status::Ok, 0),
            Plan::Write { hash, loc } => {
                let outcome = outcomes.remove(&i).unwrap_or(Err("not submitted".into()));
                written(shared, &mut state, &mut pending, item, (content_tag(hash), loc), outcome)
            }
            Plan::Confirm { hash, content, loc } => {
                let outcome = outcomes.remove(&i).unwrap_or(Err("not submitted".into()));
                let result = confirmed(
                    shared,
                    &mut state,
                    &mut pending,
                    item,
                    (*content, content_tag(hash), loc),
                    outcome,
                );
                let released = state.index.unpin(*content);
                Shared::free_extent(&mut state, released);
                result
            }
            Plan::Follow { leader, hash } => {
                let leader_ok =
                    results.get(*leader).and_then(|r| r.as_ref()).is_some_and(|r| r.status == Status::Ok);
                let leader_loc = match &plans[*leader] {
                    Plan::Write { loc, .. } => Some(loc),
                    _ => None,
                };
                match leader_loc {
                    Some(loc)
                        if leader_ok && pending.map_deduped(&mut state, item, content_tag(hash), loc) =>
                    {
                        Counters::add(&shared.counters.deduped, 1);
                        BlockResult::new(Status::Deduped, loc.raw_len)
                    }
                    _ => BlockResult::failed(
                        Status::IoError,
                        "the identical block earlier in this batch failed",
                    ),
                }
            }
        };
        results.push(Some(result));
    }
    drop_content(shared, &mut state, &damaged);
    let journaled = shared.journal_append(&mut state, &pending.journal, pending.count);
    if journaled.is_ok() {
        std::mem::take(&mut pending.dedup).write(shared, &state);
    }
    if let Err(e) = journaled {
        // Not journaled means not durable: withdraw the blocks instead of acknowledging them.
        tracing::error!(error = %e, "journal append failed; withdrawing the batch");
        Counters::add(&shared.counters.io_errors, 1);
        for i in pending.acknowledged {
            let released = state.index.remove(&items[i].0);
            Shared::free_extent(&mut state, released);
            results[i] = Some(BlockResult::failed(Status::IoError, format!("journal: {e}")));
        }
    }
    results
}
