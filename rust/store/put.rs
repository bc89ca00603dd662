//! The put path. Phase 1 (no lock): hash and maybe compress. Phase 2 (lock): admission, dedup,
//! allocation with eviction, journal the deletes. Phase 3 (no lock): one vectored write per
//! block — header page + payload, straight from caller memory when it is page-aligned.
//! Phase 4 (lock): index the written blocks and journal them; only then is a put acknowledged.

use std::collections::HashMap;

use super::batch::{BlockResult, RawBuf, Status};
use super::stats::Counters;
use super::{Durability, Shared, State};
use crate::format::header::{BlockHeader, FLAG_COMPRESSED};
use crate::format::journal::{Location, Record};
use crate::format::{round_up_to_page, PAGE};
use crate::hashing::ContentHash;
use crate::index::{extent_pages, FreedExtent};
use crate::io::aligned::{is_aligned, AlignedBuf};
use crate::io::{iovec, IoOp};

enum Plan {
    Done(BlockResult),
    Write {
        hash: ContentHash,
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

fn extent_of(loc: &Location) -> FreedExtent {
    FreedExtent { dir: loc.dir, first_page: loc.offset / PAGE as u64, pages: extent_pages(loc.stored_len) }
}

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

pub(super) fn run(shared: &Shared, items: &[(Vec<u8>, RawBuf)]) -> Vec<BlockResult> {
    let cfg = &shared.cfg;
    // Phase 1: content hashes and optional compression, outside any lock.
    let prepared: Vec<(ContentHash, Option<Vec<u8>>)> = items
        .iter()
        .map(|(_, buf)| {
            // SAFETY: the submitter keeps `buf` readable until the batch completes.
            let data = unsafe { buf.as_slice() };
            (cfg.hash.digest(data), cfg.compression.compress(data))
        })
        .collect();

    // Phase 2: decide per block.
    let mut plans = Vec::with_capacity(items.len());
    {
        let mut state = shared.state.lock();
        let mut journal = Vec::new();
        let mut count = 0u64;
        let mut leaders: HashMap<ContentHash, usize> = HashMap::new();
        let mut deduped_now: Vec<usize> = Vec::new();
        let last_of: HashMap<&[u8], usize> =
            items.iter().enumerate().map(|(i, (k, _))| (k.as_slice(), i)).collect();
        for (i, ((key, buf), (hash, packed))) in items.iter().zip(&prepared).enumerate() {
            let hash = *hash;
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
                plans.push(Plan::Done(BlockResult::failed(
                    Status::IoError,
                    "identical content failed verification and is being dropped; store it again later",
                )));
                continue;
            }
            if let Some(existing) = state.index.content(&hash).map(|c| c.loc.clone()) {
                deduped_now.push(i);
                let released = state.index.insert(key, hash, &existing);
                Shared::free_extent(&mut state, released);
                Record::Put { key: key.clone(), hash, loc: existing }.encode_into(&mut journal);
                count += 1;
                Counters::add(&shared.counters.deduped, 1);
                plans.push(Plan::Done(BlockResult::new(Status::Deduped, buf.len as u64)));
                continue;
            }
            if let Some(&leader) = leaders.get(&hash) {
                plans.push(Plan::Follow { leader, hash });
                continue;
            }
            let stored_len = packed.as_ref().map_or(buf.len, Vec::len) as u64;
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
                        compressed: packed.is_some(),
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
    }

    // Phase 3: build one vectored write per block and run them on the directory queues.
    let mut owned: Vec<AlignedBuf> = Vec::new();
    let mut ops: Vec<(usize, u16, IoOp)> = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        let Plan::Write { hash, loc } = plan else { continue };
        let (key, buf) = &items[i];
        let mut header_page = AlignedBuf::zeroed(PAGE);
        BlockHeader {
            flags: if loc.compressed { FLAG_COMPRESSED } else { 0 },
            hash_algo: cfg.hash.code(),
            raw_len: loc.raw_len,
            stored_len: loc.stored_len,
            seq: loc.seq,
            content_hash: *hash,
            key: key.clone(),
        }
        .encode_into(header_page.as_mut_slice());
        let mut iov = vec![iovec(header_page.as_ptr(), PAGE)];
        if loc.stored_len > 0 {
            if !loc.compressed && is_aligned(buf.ptr as usize, buf.len) {
                iov.push(iovec(buf.ptr, buf.len));
            } else {
                let mut bounce = AlignedBuf::zeroed(round_up_to_page(loc.stored_len as usize));
                let src: &[u8] = match &prepared[i].1 {
                    Some(packed) => packed,
                    // SAFETY: readable until completion (see RawBuf).
                    None => unsafe { buf.as_slice() },
                };
                bounce.as_mut_slice()[..src.len()].copy_from_slice(src);
                iov.push(iovec(bounce.as_ptr(), bounce.len()));
                owned.push(bounce);
            }
        }
        owned.push(header_page);
        ops.push((i, loc.dir, IoOp::new(loc.offset, iov, true)));
    }
    let mut touched_dirs: Vec<u16> = ops.iter().map(|(_, d, _)| *d).collect();
    touched_dirs.sort_unstable();
    touched_dirs.dedup();
    let mut outcomes: HashMap<usize, Result<(), String>> = shared
        .devices
        .run(ops)
        .into_iter()
        .map(|(i, r)| {
            let dir = plans.get(i).and_then(|p| match p {
                Plan::Write { loc, .. } => Some(loc.dir),
                _ => None,
            });
            let path = dir.map(|d| shared.devices.path(d).display().to_string()).unwrap_or_default();
            (i, r.map_err(|f| format!("write to {path}: {f}")))
        })
        .collect();
    drop(owned);
    if cfg.durability == Durability::Power {
        for d in touched_dirs {
            if let Err(e) = shared.devices.sync_data(d) {
                tracing::error!(error = %e, "fdatasync of data file failed");
                for (i, plan) in plans.iter().enumerate() {
                    if matches!(plan, Plan::Write { loc, .. } if loc.dir == d) {
                        outcomes.insert(i, Err(e.to_string()));
                    }
                }
            }
        }
    }

    // Phase 4: index and journal what was written; free what failed.
    let mut state = shared.state.lock();
    let mut journal = Vec::new();
    let mut count = 0u64;
    let mut results: Vec<Option<BlockResult>> = Vec::with_capacity(items.len());
    let mut acknowledged: Vec<usize> = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        let key = &items[i].0;
        let result = match plan {
            Plan::Done(r) => r.clone(),
            // Filled in below, once the winning occurrence has its result.
            Plan::Superseded { .. } => BlockResult::new(Status::Ok, 0),
            Plan::Write { hash, loc } => match outcomes.remove(&i).unwrap_or(Err("not submitted".into())) {
                Ok(()) => {
                    let ours = Some(extent_of(loc));
                    // Another batch may have stored the same content meanwhile: keep theirs.
                    let existing = state.index.content(hash).map(|c| (c.loc.clone(), c.poisoned));
                    let loc = match existing {
                        Some((_, true)) => {
                            Shared::free_extent(&mut state, ours);
                            results.push(Some(BlockResult::failed(
                                Status::IoError,
                                "identical content failed verification and is being dropped; store it again later",
                            )));
                            continue;
                        }
                        Some((existing, false)) => {
                            Shared::free_extent(&mut state, ours);
                            existing
                        }
                        None => loc.clone(),
                    };
                    let released = state.index.insert(key, *hash, &loc);
                    Shared::free_extent(&mut state, released);
                    Record::Put { key: key.clone(), hash: *hash, loc: loc.clone() }.encode_into(&mut journal);
                    count += 1;
                    acknowledged.push(i);
                    Counters::add(&shared.counters.puts, 1);
                    Counters::add(&shared.counters.bytes_written, extent_pages(loc.stored_len) * PAGE as u64);
                    if loc.compressed {
                        Counters::add(&shared.counters.compressed_blocks, 1);
                    }
                    BlockResult::new(Status::Ok, loc.raw_len)
                }
                Err(msg) => {
                    Shared::free_extent(&mut state, Some(extent_of(loc)));
                    Counters::add(&shared.counters.io_errors, 1);
                    BlockResult::failed(Status::IoError, msg)
                }
            },
            Plan::Follow { leader, hash } => {
                let leader_ok =
                    results.get(*leader).and_then(|r| r.as_ref()).is_some_and(|r| r.status == Status::Ok);
                match state.index.content(hash).map(|c| c.loc.clone()) {
                    Some(loc) if leader_ok => {
                        let released = state.index.insert(key, *hash, &loc);
                        Shared::free_extent(&mut state, released);
                        Record::Put { key: key.clone(), hash: *hash, loc: loc.clone() }
                            .encode_into(&mut journal);
                        count += 1;
                        acknowledged.push(i);
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
    if let Err(e) = shared.journal_append(&mut state, &journal, count) {
        // Not journaled means not durable: withdraw the blocks instead of acknowledging them.
        tracing::error!(error = %e, "journal append failed; withdrawing the batch");
        Counters::add(&shared.counters.io_errors, 1);
        for i in acknowledged {
            let released = state.index.remove(&items[i].0);
            Shared::free_extent(&mut state, released);
            results[i] = Some(BlockResult::failed(Status::IoError, format!("journal: {e}")));
        }
    }
    shared.maybe_compact(&mut state);
    for (i, plan) in plans.iter().enumerate() {
        if let Plan::Superseded { by } = plan {
            results[i] = results[*by].clone();
        }
    }
    results.into_iter().map(|r| r.unwrap_or_else(|| BlockResult::failed(Status::IoError, "lost"))).collect()
}
