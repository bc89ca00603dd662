//! The store's journal as one type: append (made durable per `durability`), heal (rewrite
//! from memory after a failed append), and compaction in three steps so that batches never
//! wait for the rewrite:
//!
//! 1. `begin_compaction` (under the state lock): the caller snapshots the live records; from
//!    here on every append also lands in a catch-up buffer.
//! 2. `Compaction::write` (no lock): the snapshot goes to a temp file, synced. Batches keep
//!    appending to the current journal, which stays authoritative until step 3.
//! 3. `finish_compaction` (under the lock): the catch-up bytes are appended to the temp file,
//!    which is renamed over the journal. Replay of snapshot + catch-up gives exactly the state
//!    the old journal described, so a crash at any point loses no acknowledged record.
//!
//! A heal (a full rewrite under the lock) or close during step 2 voids that compaction.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::config::Durability;
use super::journal_file::{JournalFile, Prepared};
use crate::error::{Result, StoreError};
use crate::format::journal::{FileHeader, Record};
use crate::io::fault::FaultPlan;

/// Least time between two attempts to rewrite a broken journal.
const HEAL_INTERVAL: Duration = Duration::from_secs(1);

pub struct Journal {
    dir: PathBuf,
    /// None for a read-only view and after close.
    file: Option<JournalFile>,
    header: FileHeader,
    durability: Durability,
    /// The last append failed and no rewrite has succeeded since: nothing is acknowledged.
    broken: bool,
    last_heal: Option<Instant>,
    /// Testing: journal writes to fail or compactions to slow down (see `io::fault`).
    fault: Option<FaultPlan>,
    writes: u64,
    compactions: u64,
    /// While a compaction runs: its number, and what was appended since it began.
    catch_up: Option<(u64, Vec<u8>, u64)>,
    /// A read-only view: how far it has read the writer's journal (store/follow.rs).
    pub follow: Option<super::follow::Followed>,
}

/// A compaction between `begin_compaction` and `finish_compaction`.
pub struct Compaction {
    id: u64,
    dir: PathBuf,
    header: FileHeader,
    records: Vec<Record>,
    delay: Option<Duration>,
}

impl Compaction {
    /// Step 2, without the state lock: write and sync the new journal beside the current one.
    pub fn write(self) -> (u64, Result<Prepared>) {
        if let Some(d) = self.delay {
            tracing::warn!(ms = d.as_millis() as u64, "fault injection: slow journal compaction");
            std::thread::sleep(d);
        }
        (self.id, Prepared::write(&self.dir, ".compact", self.header, &self.records))
    }
}

impl Journal {
    pub fn new(
        dir: &Path,
        file: Option<JournalFile>,
        header: FileHeader,
        durability: Durability,
        fault: Option<FaultPlan>,
    ) -> Self {
        Journal {
            dir: dir.to_path_buf(),
            file,
            header,
            durability,
            broken: false,
            last_heal: None,
            fault,
            writes: 0,
            compactions: 0,
            catch_up: None,
            follow: None,
        }
    }

    pub fn is_open(&self) -> bool {
        self.file.is_some()
    }

    /// Records and bytes in the current file (0 when closed or read-only).
    pub fn records(&self) -> u64 {
        self.file.as_ref().map_or(0, |f| f.records)
    }

    pub fn bytes(&self) -> u64 {
        self.file.as_ref().map_or(0, |f| f.bytes)
    }

    pub fn compacting(&self) -> bool {
        self.catch_up.is_some()
    }

    /// Testing: the errno to fail this journal write with, per the fault plan.
    fn injected_fault(&mut self) -> Option<i32> {
        let plan = self.fault.filter(|p| p.journal && p.delay_ms == 0)?;
        let n = self.writes;
        self.writes += 1;
        (n % plan.every == 0).then_some(plan.errno)
    }

    /// Make `encoded` (`count` records) durable. When an append fails, the journal is rewritten
    /// from `live()` (the in-memory index, which already holds these changes) instead; until
    /// one such rewrite succeeds the journal is broken and nothing is acknowledged.
    pub fn append(&mut self, encoded: &[u8], count: u64, live: impl FnOnce() -> Vec<Record>) -> Result<()> {
        if count == 0 && !self.broken {
            return Ok(());
        }
        if self.file.is_none() {
            return Err(StoreError::Device("store is read-only".into()));
        }
        if !self.broken {
            let fault = self.injected_fault();
            let durability = self.durability;
            let Some(file) = self.file.as_mut() else {
                return Err(StoreError::Device("journal closed".into()));
            };
            let appended = match fault {
                Some(errno) => file.append_torn(encoded, errno),
                None => file.append(encoded, count),
            };
            let synced = appended.and_then(|_| match durability {
                Durability::Power => file.sync(),
                Durability::Process => Ok(()),
            });
            match synced {
                Ok(()) => {
                    if let Some((_, buf, n)) = self.catch_up.as_mut() {
                        buf.extend_from_slice(encoded);
                        *n += count;
                    }
                    return Ok(());
                }
                Err(e) => {
                    tracing::error!("journal append failed ({e}); nothing is acknowledged until a rewrite of the journal succeeds");
                    self.broken = true;
                    self.last_heal = None;
                }
            }
        }
        // Broken: rewrite from memory, at most once per HEAL_INTERVAL (a full disk would
        // otherwise make every batch rewrite the whole journal under the lock).
        if self.last_heal.is_some_and(|t| t.elapsed() < HEAL_INTERVAL) {
            return Err(StoreError::Device(
                "journal is unwritable (a rewrite is retried every second)".into(),
            ));
        }
        self.last_heal = Some(Instant::now());
        self.rewrite(&live())?;
        self.broken = false;
        tracing::warn!("journal rewritten from memory; writes are acknowledged again");
        Ok(())
    }

    /// Rewrite the journal as `records` now, under the caller's lock (heal, checkpoint, close).
    /// Voids a compaction in progress: its snapshot may predate what this rewrite dropped.
    pub fn rewrite(&mut self, records: &[Record]) -> Result<()> {
        if self.file.is_none() {
            return Ok(());
        }
        if let Some(errno) = self.injected_fault() {
            let err = std::io::Error::from_raw_os_error(errno);
            return Err(StoreError::io("rewriting the journal (injected fault)", err));
        }
        self.catch_up = None;
        self.file = Some(JournalFile::rewrite(&self.dir, self.header, records)?);
        Ok(())
    }

    /// Whether appends have grown the journal well past the `live` records it would hold
    /// compacted (and no compaction is running).
    pub fn wants_compaction(&self, live: u64) -> bool {
        !self.broken && self.catch_up.is_none() && self.records() > 2 * live + 65_536
    }

    /// Step 1, under the lock: start capturing appends for a compaction to `records`.
    pub fn begin_compaction(&mut self, records: Vec<Record>) -> Option<Compaction> {
        if self.file.is_none() || self.broken || self.catch_up.is_some() {
            return None;
        }
        self.compactions += 1;
        let id = self.compactions;
        self.catch_up = Some((id, Vec::new(), 0));
        let delay = self
            .fault
            .filter(|p| p.journal && p.delay_ms > 0 && (id - 1) % p.every == 0)
            .map(|p| Duration::from_millis(p.delay_ms));
        Some(Compaction { id, dir: self.dir.clone(), header: self.header, records, delay })
    }

    /// Step 3, under the lock: install the new journal with what was appended meanwhile. A
    /// failure keeps the current journal (it holds everything).
    pub fn finish_compaction(&mut self, id: u64, prepared: Result<Prepared>) -> Result<()> {
        let catch_up = match self.catch_up.take() {
            Some((cid, buf, n)) if cid == id => (buf, n),
            other => {
                // Voided by a heal, a checkpoint or close: the temp file is just dropped.
                self.catch_up = other;
                return Ok(());
            }
        };
        let prepared = prepared?;
        if self.file.is_none() || self.broken {
            return Ok(());
        }
        self.file = Some(prepared.install(&catch_up.0, catch_up.1)?);
        Ok(())
    }

    /// Close without a clean-shutdown mark (the closing rewrite failed).
    pub fn abandon(&mut self) {
        self.catch_up = None;
        if let Some(mut f) = self.file.take() {
            f.close();
        }
    }

    /// Append a clean-shutdown mark and close the file (nothing may be written after).
    pub fn close(&mut self, unix_secs: u64) -> Result<()> {
        self.catch_up = None;
        let Some(mut file) = self.file.take() else { return Ok(()) };
        let mut buf = Vec::new();
        Record::CleanShutdown { unix_secs }.encode_into(&mut buf);
        let result = file.append(&buf, 1).and_then(|_| file.sync());
        file.close();
        result
    }
}
