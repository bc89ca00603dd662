//! Opening a store: validate, lock, open or create the data files, replay the journal into
//! the index and allocators, then compact the journal. A crash leaves at worst a torn journal
//! tail (cut off here) and unreferenced extents (free space again): never a half block.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use super::journal::Journal;
use super::journal_file::{self, JournalFile};
use super::replay::Replay;
use super::set_aside::set_aside;
use super::stats::Counters;
use super::{Shared, State, StoreConfig};
use crate::device::allocator::ExtentAllocator;
use crate::device::data_file::DataFile;
use crate::device::dir_lock::DirLock;
use crate::device::set::{Device, DeviceSet};
use crate::error::{Result, StoreError};
use crate::format::journal::FileHeader;
use crate::format::layout;
use crate::format::superblock::Superblock;
use crate::format::PAGE;
use crate::index::Index;
use crate::io::fault::FaultPlan;
use crate::io::EngineChoice;

fn new_store_id() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    xxhash_rust::xxh3::xxh3_64(&[nanos.to_le_bytes(), (std::process::id() as u64).to_le_bytes()].concat())
}

pub(super) fn open(cfg: StoreConfig) -> Result<Shared> {
    cfg.validate()?;
    let started = Instant::now();
    let ndirs = cfg.dirs.len();
    let locks = if cfg.read_only {
        (0..ndirs).map(|_| None).collect::<Vec<Option<DirLock>>>()
    } else {
        cfg.dirs.iter().map(|d| DirLock::acquire(d).map(Some)).collect::<Result<Vec<_>>>()?
    };

    let journal_dir = cfg.dirs[0].as_path();
    let replayed = match journal_file::read(journal_dir) {
        Err(StoreError::FormatVersion { found, expected, .. }) if !cfg.read_only => {
            set_aside(&cfg.dirs, found, expected)?;
            None
        }
        other => other?,
    };
    if cfg.read_only && replayed.is_none() {
        return Err(StoreError::Config(format!(
            "{} holds no flexkv store (no {})",
            journal_dir.display(),
            journal_file::JOURNAL_FILE
        )));
    }
    let header = match &replayed {
        Some(r) => {
            let h = r.header;
            if h.hash_algo != cfg.hash.code() && !cfg.read_only {
                let existing =
                    crate::hashing::HashAlgo::from_code(h.hash_algo).map_or("unknown", |a| a.name());
                return Err(StoreError::Config(format!(
                    "content_hash: the store in {} was created with {existing}, not {}; use a fresh directory",
                    journal_dir.display(),
                    cfg.hash.name()
                )));
            }
            if h.dir_count as usize != ndirs {
                return Err(StoreError::Config(format!(
                    "ssd_cache_dir: the store in {} spans {} directories, {} were given",
                    journal_dir.display(),
                    h.dir_count,
                    ndirs
                )));
            }
            h
        }
        None => FileHeader { hash_algo: cfg.hash.code(), dir_count: ndirs as u16, store_id: new_store_id() },
    };
    let fresh = replayed.is_none();

    // Data files: check that each belongs to this store at this position, or create it.
    let per_dir = layout::data_file_len(cfg.capacity_bytes, ndirs);
    let mut files = Vec::with_capacity(ndirs);
    // Directories whose data file had to be created: journal records pointing there are void.
    let mut recreated = vec![false; ndirs];
    for (i, dir) in cfg.dirs.iter().enumerate() {
        let sb = Superblock { store_id: header.store_id, dir_index: i as u16, dir_count: ndirs as u16 };
        let existing = DataFile::open(dir, !cfg.read_only)?;
        let file = match existing {
            Some(mut f) => {
                let found = f.read_superblock()?;
                if found != Some(sb) {
                    if found.is_some() || !fresh {
                        return Err(StoreError::Config(format!(
                            "ssd_cache_dir: {} already holds data of another flexkv store (or of this one \
                             listed in a different order); restore the original directory list or empty it",
                            dir.display()
                        )));
                    }
                    drop(f);
                    remove_stale(dir);
                    files.push(create_data_file(dir, per_dir, sb, cfg.preallocate)?);
                    continue;
                }
                if !cfg.read_only && f.len != per_dir {
                    tracing::info!(dir = %dir.display(), from = f.len, to = per_dir, "resizing data file");
                    f.resize(per_dir)?;
                }
                f
            }
            None if cfg.read_only => {
                return Err(StoreError::Config(format!("{} has no data file", dir.display())));
            }
            None => {
                if !fresh {
                    tracing::warn!(dir = %dir.display(), "data file missing (disk replaced?); its blocks are dropped");
                    recreated[i] = true;
                }
                create_data_file(dir, per_dir, sb, cfg.preallocate)?
            }
        };
        files.push(file);
    }

    let mut index = Index::new();
    // A read-only view allocates nothing; it accepts every recorded extent so that a damaged
    // (e.g. truncated) file shows up as corrupt blocks on verify instead of silently missing.
    let pages_of =
        |f: &DataFile| if cfg.read_only { u64::MAX / (4 * PAGE as u64) } else { f.len / PAGE as u64 };
    let mut allocators: Vec<ExtentAllocator> =
        files.iter().map(|f| ExtentAllocator::new(layout::SUPERBLOCK_PAGES, pages_of(f))).collect();
    let mut replay = Replay { next_seq: 1, ..Replay::default() };
    let mut journal_bytes = 0;
    let journal_ident = replayed.as_ref().and_then(|r| r.ident);
    // An older journal this build reads (format::journal::MIGRATES_FROM) is rewritten as ours.
    let migrate = replayed.as_ref().is_some_and(|r| r.migrate);
    if migrate && !cfg.read_only {
        tracing::info!(dir = %journal_dir.display(), "journal of the previous format: rewritten in this one");
    }
    if let Some(r) = &replayed {
        replay = super::replay::replay(r, &mut index, &mut allocators, &recreated);
        journal_bytes = r.file_bytes();
        if replay.torn > 0 {
            tracing::warn!(bytes = replay.torn, "journal had a torn tail (unclean shutdown); cut off");
        }
    }
    drop(replayed);
    let Replay { last_clean, next_seq, torn, dropped, mut records, clean_from } = replay;
    if dropped > 0 {
        tracing::warn!(records = dropped, "journal records outside the data files were dropped");
    }

    let journal_private = if cfg.read_only { true } else { make_private(&cfg.dirs, &files, &locks) };
    // Rewritten at open only when that buys something: a torn tail or dropped records to cut
    // off, a journal grown well past the live keys, or one that is not private yet. Otherwise
    // it is reopened as it is (a rewrite of 1 M records costs seconds before the first hit).
    let keep = !fresh
        && !migrate
        && torn == 0
        && dropped == 0
        && journal_private
        && records <= 2 * index.len() as u64 + 65_536;
    let journal = if cfg.read_only {
        None
    } else if keep {
        // Cut the clean-shutdown marks off: this session has not shut down cleanly yet.
        let mut bytes = journal_bytes;
        if let Some(at) = clean_from {
            records = records.saturating_sub(1);
            bytes = at;
        }
        Some(JournalFile::reopen(journal_dir, header, records, bytes)?)
    } else {
        Some(JournalFile::rewrite(journal_dir, header, &State::live_records(&index))?)
    };

    let fault_plan = match (cfg.fault_injection, std::env::var("FLEXKV_FAULT_INJECTION")) {
        (Some(plan), _) => Some(plan),
        (None, Ok(spec)) if !spec.is_empty() => Some(FaultPlan::parse(&spec)?),
        _ => None,
    };
    let mut devices = Vec::with_capacity(ndirs);
    for ((path, data), lock) in cfg.dirs.iter().zip(files).zip(locks) {
        let choice = if cfg.read_only { EngineChoice::Psync } else { cfg.io_engine };
        let name = format!("flexkv-io-{}", devices.len());
        devices.push(Device::start(path.clone(), data, lock, choice, cfg.queue_depth, fault_plan, name)?);
    }
    let devices = DeviceSet::new(devices);

    let recovery_seconds = started.elapsed().as_secs_f64();
    tracing::info!(
        blocks = index.len(),
        seconds = recovery_seconds,
        engine = devices.engine_name(),
        "block store opened"
    );
    let mut journal =
        Journal::new(journal_dir, journal, header, cfg.durability, fault_plan.filter(|p| p.journal));
    if cfg.read_only {
        // Where this view's replay ended: `follow` reads the writer's appends from there.
        journal.follow = super::follow::Followed::at(journal_dir, journal_ident, journal_bytes - torn);
    }
    Ok(Shared {
        state: Mutex::new(State {
            index,
            allocators,
            journal,
            next_seq,
            next_dir: 0,
            evicted: VecDeque::new(),
            closed: false,
        }),
        cfg,
        devices,
        counters: Counters::default(),
        inflight: Mutex::new(0),
        idle: Condvar::new(),
        recovery_seconds,
        last_clean_shutdown: last_clean,
        torn_journal_bytes: torn,
    })
}

fn create_data_file(dir: &Path, len: u64, sb: Superblock, preallocate: bool) -> Result<DataFile> {
    if preallocate {
        return DataFile::create(dir, len, sb);
    }
    let mut f = DataFile::create(dir, PAGE as u64, sb)?;
    f.file.set_len(len).map_err(|e| StoreError::io(dir.display(), e))?;
    f.len = len;
    Ok(f)
}

/// Stores created before files were private hold 0644 files: take group/other access away
/// from the files this opener owns (it holds their locks), with one log line for all of them.
/// The journal is not changed here: false when it is not private, so that the caller rewrites
/// it (the rewrite is a new 0600 file).
fn make_private(dirs: &[PathBuf], files: &[DataFile], locks: &[Option<DirLock>]) -> bool {
    let mut changed: Vec<String> = Vec::new();
    for ((dir, data), lock) in dirs.iter().zip(files).zip(locks) {
        changed.extend(crate::device::private::tighten(&data.file, &data.path));
        changed.extend(lock.as_ref().and_then(|l| l.make_private(dir)));
    }
    let journal = dirs[0].join(journal_file::JOURNAL_FILE);
    let mut private = true;
    if let Ok(meta) = std::fs::metadata(&journal) {
        let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777;
        if mode & 0o077 != 0 {
            changed.push(format!("{} {mode:04o} -> 0600 (rewritten)", journal.display()));
            private = false;
        }
    }
    if !changed.is_empty() {
        tracing::info!("cache files made private (group/other access removed): {}", changed.join(", "));
    }
    private
}

fn remove_stale(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(crate::device::data_file::DATA_FILE));
}
