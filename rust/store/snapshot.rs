//! `BlockStore::stats`: one snapshot of the store's counters, index totals, free space and
//! journal state. Kept apart from `mod.rs` (the batch submit / delete / close paths) because it
//! only reads: it takes the state lock once, copies the totals out and builds the list unlocked.

use super::stats::Counters;
use super::BlockStore;
use crate::format::PAGE;
use crate::tier::{StatValue, StatsSnapshot};

impl BlockStore {
    pub fn stats(&self) -> StatsSnapshot {
        let c = &self.shared.counters;
        let state = self.shared.state.lock();
        let ix = &state.index;
        let (blocks, unique, logical, physical) =
            (ix.len() as u64, ix.content_count() as u64, ix.logical_bytes(), ix.physical_bytes());
        let (content_raw, content_stored) = ix.content_totals();
        let free_pages: u64 = state.allocators.iter().map(|a| a.free_pages()).sum();
        let (journal_bytes, compacting) = (state.journal.bytes(), state.journal.compacting());
        drop(state);
        let ratio = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
        let g = Counters::get;
        vec![
            ("blocks", StatValue::Int(blocks)),
            ("unique_blocks", StatValue::Int(unique)),
            ("logical_bytes", StatValue::Int(logical)),
            ("physical_bytes", StatValue::Int(physical)),
            ("dedup_ratio", StatValue::Float(ratio(logical, content_raw))),
            ("compression_ratio", StatValue::Float(ratio(content_raw, content_stored))),
            ("capacity_bytes", StatValue::Int(self.capacity_bytes())),
            ("free_bytes", StatValue::Int(free_pages * PAGE as u64)),
            ("hits", StatValue::Int(g(&c.hits))),
            ("misses", StatValue::Int(g(&c.misses))),
            ("puts", StatValue::Int(g(&c.puts))),
            ("deduped", StatValue::Int(g(&c.deduped))),
            ("no_space", StatValue::Int(g(&c.no_space))),
            ("evictions", StatValue::Int(g(&c.evictions))),
            ("corrupt_reads", StatValue::Int(g(&c.corrupt_reads))),
            ("io_errors", StatValue::Int(g(&c.io_errors))),
            ("bytes_read", StatValue::Int(g(&c.bytes_read))),
            ("bytes_written", StatValue::Int(g(&c.bytes_written))),
            ("compressed_blocks", StatValue::Int(g(&c.compressed_blocks))),
            ("inflight_ios", StatValue::Int(self.shared.devices.inflight() as u64)),
            ("queue_depth", StatValue::Int(self.shared.cfg.queue_depth as u64)),
            ("io_engine", StatValue::Text(self.io_engine().to_string())),
            ("direct_io", StatValue::Int(self.shared.devices.all_direct() as u64)),
            ("content_hash", StatValue::Text(self.shared.cfg.hash.name().to_string())),
            ("journal_bytes", StatValue::Int(journal_bytes)),
            ("journal_compacting", StatValue::Int(compacting as u64)),
            ("recovery_seconds", StatValue::Float(self.shared.recovery_seconds)),
            ("torn_journal_bytes", StatValue::Int(self.shared.torn_journal_bytes)),
            ("last_clean_shutdown_unix", StatValue::Int(self.shared.last_clean_shutdown.unwrap_or(0))),
            ("directories", StatValue::Int(self.shared.devices.len() as u64)),
        ]
    }
}
