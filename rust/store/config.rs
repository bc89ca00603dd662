//! What a store is opened with. Parsing from strings lives here so Python and Rust callers
//! get the same validation and the same error texts.

use std::path::PathBuf;

use crate::compression::Compression;
use crate::error::{Result, StoreError};
use crate::hashing::HashAlgo;
use crate::io::EngineChoice;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Acknowledged blocks survive the process being killed (data written with O_DIRECT,
    /// journal record in the page cache). No fsync on the hot path.
    Process,
    /// Acknowledged blocks also survive power loss: data files and journal are fdatasync'ed
    /// before a batch completes.
    Power,
}

impl Durability {
    /// The names `parse` accepts, exported to Python as `DURABILITIES`.
    pub const NAMES: &'static [&'static str] = &["process", "power"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "process" => Ok(Durability::Process),
            "power" => Ok(Durability::Power),
            other => Err(StoreError::Config(format!(
                "durability: unknown mode {other:?} (expected \"process\" or \"power\")"
            ))),
        }
    }
}

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub dirs: Vec<PathBuf>,
    pub capacity_bytes: u64,
    pub io_engine: EngineChoice,
    pub queue_depth: u32,
    pub compression: Compression,
    pub hash: HashAlgo,
    pub durability: Durability,
    pub preallocate: bool,
    pub read_only: bool,
    /// Threads that hash, compress and verify batches (and wait on the device queues), for
    /// puts and again for gets (a get never waits for a thread behind slow writes).
    pub batch_threads: usize,
    /// Testing only: make the device fail some I/Os (see `io::fault`).
    pub fault_injection: Option<crate::io::fault::FaultPlan>,
}

impl StoreConfig {
    pub fn new(dirs: Vec<PathBuf>, capacity_bytes: u64) -> Self {
        StoreConfig {
            dirs,
            capacity_bytes,
            io_engine: EngineChoice::Auto,
            queue_depth: 64,
            compression: Compression::None,
            hash: HashAlgo::Xxh3_128,
            durability: Durability::Process,
            preallocate: true,
            read_only: false,
            batch_threads: 4,
            fault_injection: None,
        }
    }

    /// FlexKV's `FLEXKV_SSD_CACHE_DIR` form: directories separated by ';'.
    pub fn split_dirs(spec: &str) -> Vec<PathBuf> {
        spec.split(';').map(str::trim).filter(|s| !s.is_empty()).map(PathBuf::from).collect()
    }

    pub fn validate(&self) -> Result<()> {
        if self.dirs.is_empty() {
            return Err(StoreError::Config("ssd_cache_dir: no cache directory given".into()));
        }
        if self.dirs.len() > u16::MAX as usize {
            return Err(StoreError::Config("ssd_cache_dir: too many directories".into()));
        }
        for (i, d) in self.dirs.iter().enumerate() {
            if self.dirs[..i].contains(d) {
                return Err(StoreError::Config(format!("ssd_cache_dir: {} is listed twice", d.display())));
            }
            if !d.is_dir() {
                return Err(StoreError::Config(format!(
                    "ssd_cache_dir: {} does not exist or is not a directory",
                    d.display()
                )));
            }
        }
        if !self.read_only {
            let per_dir = self.capacity_bytes / self.dirs.len() as u64;
            if per_dir < 2 * crate::format::PAGE as u64 {
                return Err(StoreError::Config(format!(
                    "capacity: {} bytes over {} directories is too small (need at least 8 KiB per directory)",
                    self.capacity_bytes,
                    self.dirs.len()
                )));
            }
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(StoreError::Config(format!("queue_depth: {} is outside 1..=4096", self.queue_depth)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::fault::FaultPlan;

    #[test]
    fn every_exported_name_parses() {
        for n in EngineChoice::NAMES {
            EngineChoice::parse(n).unwrap();
        }
        for n in Compression::NAMES {
            Compression::parse(n, 1).unwrap();
        }
        for n in HashAlgo::NAMES {
            assert_eq!(HashAlgo::parse(n).unwrap().name(), *n);
        }
        for n in Durability::NAMES {
            Durability::parse(n).unwrap();
        }
        for t in FaultPlan::TARGETS {
            for e in FaultPlan::ERRNOS {
                FaultPlan::parse(&format!("{t}:{e}:3")).unwrap();
            }
        }
    }
}
