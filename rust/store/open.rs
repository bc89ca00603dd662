//! Opening a store: validate, lock, open or create the data files, replay the journal into
//! the index and allocators, then compact the journal. A crash leaves at worst a torn journal
//! tail (cut off here) and unreferenced extents (free space again): never a half block.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use super::journal::Journal;
use super::journal_file::{self, JournalFile};
use super::set_aside::set_aside;
use super::stats::Counters;
use super::{Shared, State, StoreConfig};
use crate::device::allocator::ExtentAllocator;
use crate::device::data_file::DataFile;
use crate::device::dir_lock::DirLock;
use crate::device::set::{Device, DeviceSet};
use crate::error::{Result, StoreError};
use crate::format::journal::{FileHeader, Record};
use crate::format::superblock::Superblock;
use crate::format::PAGE;
use crate::index::admission::FrequencySketch;
use crate::index::{extent_pages, Index};
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
    let per_dir = (cfg.capacity_bytes / ndirs as u64) / PAGE as u64 * PAGE as u64;
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

    let mut index = Index::new(cfg.eviction);
    // A read-only view allocates nothing; it accepts every recorded extent so that a damaged
    // (e.g. truncated) file shows up as corrupt blocks on verify instead of silently missing.
    let pages_of =
        |f: &DataFile| if cfg.read_only { u64::MAX / (4 * PAGE as u64) } else { f.len / PAGE as u64 };
    let mut allocators: Vec<ExtentAllocator> =
        files.iter().map(|f| ExtentAllocator::new(1, pages_of(f))).collect();
    let mut last_clean = None;
    let mut next_seq = 1u64;
    let mut torn = 0u64;
    let mut dropped = 0u64;
    if let Some(r) = replayed {
        torn = r.torn_bytes;
        if torn > 0 {
            tracing::warn!(bytes = torn, "journal had a torn tail (unclean shutdown); cut off");
        }
        for record in r.records {
            match record {
                Record::Put { key, hash, loc } => {
                    last_clean = None;
                    next_seq = next_seq.max(loc.seq + 1);
                    let dir = loc.dir as usize;
                    let known = index.content(&hash).is_some_and(|c| c.loc == loc);
                    if !known {
                        let pages = extent_pages(loc.stored_len);
                        let first = loc.offset / PAGE as u64;
                        let fits = dir < ndirs
                            && !recreated[dir]
                            && loc.offset % PAGE as u64 == 0
                            && index.content(&hash).is_none()
                            && allocators[dir].reserve(first, pages);
                        if !fits {
                            dropped += 1;
                            continue;
                        }
                    }
                    let released = index.insert(&key, hash, &loc);
                    if let Some(f) = released {
                        allocators[f.dir as usize].free(f.first_page, f.pages);
                    }
                }
                Record::Delete { key } => {
                    last_clean = None;
                    if let Some(f) = index.remove(&key) {
                        allocators[f.dir as usize].free(f.first_page, f.pages);
                    }
                }
                Record::CleanShutdown { unix_secs } => last_clean = Some(unix_secs),
            }
        }
    }
    if dropped > 0 {
        tracing::warn!(records = dropped, "journal records outside the data files were dropped");
    }

    if !cfg.read_only {
        make_private(&cfg.dirs, &files, &locks);
    }
    let journal = if cfg.read_only {
        None
    } else {
        let records: Vec<Record> = index
            .keys_in_order()
            .filter_map(|(key, hash)| {
                let c = index.content(hash)?;
                Some(Record::Put { key: key.to_vec(), hash: *hash, loc: c.loc.clone() })
            })
            .collect();
        Some(JournalFile::rewrite(journal_dir, header, &records)?)
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
    Ok(Shared {
        state: Mutex::new(State {
            index,
            allocators,
            journal: Journal::new(
                journal_dir,
                journal,
                header,
                cfg.durability,
                fault_plan.filter(|p| p.journal),
            ),
            sketch: FrequencySketch::new(cfg.admit_min_hits),
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
/// The journal needs nothing: its rewrite below replaces it with a new 0600 file.
fn make_private(dirs: &[PathBuf], files: &[DataFile], locks: &[Option<DirLock>]) {
    let mut changed: Vec<String> = Vec::new();
    for ((dir, data), lock) in dirs.iter().zip(files).zip(locks) {
        changed.extend(crate::device::private::tighten(&data.file, &data.path));
        changed.extend(lock.as_ref().and_then(|l| l.make_private(dir)));
    }
    let journal = dirs[0].join(journal_file::JOURNAL_FILE);
    if let Ok(meta) = std::fs::metadata(&journal) {
        let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777;
        if mode & 0o077 != 0 {
            changed.push(format!("{} {mode:04o} -> 0600 (rewritten)", journal.display()));
        }
    }
    if !changed.is_empty() {
        tracing::info!("cache files made private (group/other access removed): {}", changed.join(", "));
    }
}

fn remove_stale(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(crate::device::data_file::DATA_FILE));
}
