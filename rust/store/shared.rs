//! What every batch thread shares: the config, the devices, and the state behind one lock
//! (index, allocators, journal). Helpers here are the moves that several paths make under
//! that lock: free an extent, evict a key when the device is full, journal a change, and
//! compact the journal (the long part of which runs without the lock: see `journal.rs`).

use std::collections::VecDeque;

use parking_lot::{Condvar, Mutex};

use super::config::StoreConfig;
use super::journal::Journal;
use super::stats::Counters;
use crate::device::allocator::ExtentAllocator;
use crate::device::set::DeviceSet;
use crate::error::{Result, StoreError};
use crate::format::journal::Record;
use crate::index::{FreedExtent, Index};

/// Keys evicted but not yet drained by the owner; older ones are dropped past this.
const MAX_PENDING_EVICTED: usize = 1 << 20;

pub(crate) struct State {
    pub index: Index,
    pub allocators: Vec<ExtentAllocator>,
    pub journal: Journal,
    pub next_seq: u64,
    pub next_dir: usize,
    pub evicted: VecDeque<Vec<u8>>,
    pub closed: bool,
}

impl State {
    /// One Put per live key, a compacted journal, in any order (`Index::for_each`): listings
    /// sort by the records' seq.
    pub fn live_records(index: &Index) -> Vec<Record> {
        let mut records = Vec::with_capacity(index.len());
        index.for_each(|key, tag, loc, parent| {
            records.push(Record::Put { key: key.to_vec(), tag, loc, parent: parent.map(<[u8]>::to_vec) });
        });
        records
    }

    /// Rewrite the journal from the index now, under the lock (checkpoint, close).
    pub fn compact_now(&mut self) -> Result<()> {
        let records = Self::live_records(&self.index);
        self.journal.rewrite(&records)
    }
}

pub(crate) struct Shared {
    pub cfg: StoreConfig,
    pub devices: DeviceSet,
    pub state: Mutex<State>,
    pub counters: Counters,
    pub inflight: Mutex<usize>,
    pub idle: Condvar,
    pub recovery_seconds: f64,
    pub last_clean_shutdown: Option<u64>,
    pub torn_journal_bytes: u64,
}

impl Shared {
    pub fn free_extent(state: &mut State, f: Option<FreedExtent>) {
        if let Some(f) = f {
            state.allocators[f.dir as usize].free(f.first_page, f.pages);
        }
    }

    /// Make `encoded` durable (see `Journal::append`); refused once the store is closed.
    pub fn journal_append(&self, state: &mut State, encoded: &[u8], count: u64) -> Result<()> {
        if state.closed {
            // A closed handle must never rewrite the journal: another process may own it now.
            return Err(StoreError::Closed);
        }
        let State { journal, index, .. } = state;
        journal.append(encoded, count, || State::live_records(index))
    }

    /// Evict the coldest key; false when there is nothing left to evict.
    pub fn evict_one(&self, state: &mut State, journal_buf: &mut Vec<u8>, count: &mut u64) -> bool {
        let Some(victim) = state.index.victim() else { return false };
        let released = state.index.remove(&victim);
        Self::free_extent(state, released);
        Record::Delete { key: victim.clone() }.encode_into(journal_buf);
        *count += 1;
        if state.evicted.len() >= MAX_PENDING_EVICTED {
            state.evicted.pop_front();
        }
        state.evicted.push_back(victim);
        Counters::add(&self.counters.evictions, 1);
        true
    }

    /// Compact the journal if appends have grown it well past the live keys. Call without
    /// the state lock: the rewrite itself runs unlocked, so batches keep flowing meanwhile.
    pub fn maybe_compact(&self) {
        let compaction = {
            let mut state = self.state.lock();
            if state.closed || !state.journal.wants_compaction(state.index.len() as u64) {
                return;
            }
            let records = State::live_records(&state.index);
            state.journal.begin_compaction(records)
        };
        let Some(compaction) = compaction else { return };
        let (id, prepared) = compaction.write();
        let mut state = self.state.lock();
        if let Err(e) = state.journal.finish_compaction(id, prepared) {
            tracing::error!(error = %e, "journal compaction failed; keeping the old journal");
        }
    }

    /// Compact in the background style (unlocked rewrite) even when the journal is small:
    /// `checkpoint` and tests.
    pub fn compact_unlocked(&self) -> Result<()> {
        let compaction = {
            let mut state = self.state.lock();
            if state.closed {
                return Err(StoreError::Closed);
            }
            let records = State::live_records(&state.index);
            state.journal.begin_compaction(records)
        };
        let Some(compaction) = compaction else {
            // Broken or already compacting: fall back to the locked rewrite (heals a broken one).
            return self.state.lock().compact_now();
        };
        let (id, prepared) = compaction.write();
        self.state.lock().journal.finish_compaction(id, prepared)
    }

    pub fn begin(&self) {
        *self.inflight.lock() += 1;
    }

    pub fn end(&self) {
        let mut n = self.inflight.lock();
        *n -= 1;
        if *n == 0 {
            self.idle.notify_all();
        }
    }
}
