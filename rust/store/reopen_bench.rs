//! Reopen time at scale (ignored by default; run with
//! `cargo test --release --lib reopen_bench -- --ignored --nocapture`, `FLEXKV_REOPEN_BLOCKS`
//! to change the count). Builds the journal of N tiny blocks directly (the data file is sparse:
//! replay never reads block data), then times `BlockStore::open` and reports the index size.

use std::time::Instant;

use super::journal_file::JOURNAL_FILE;
use super::*;
use crate::format::journal::Location;
use crate::format::PAGE;

fn key(i: u64) -> Vec<u8> {
    // Shaped like the connector's stored keys: a 4-byte rank tag, the 24-byte namespace head
    // (prefix + variant) and the engine's 32-byte block hash (sha256).
    let mut k = vec![0u8, 0, 0, 0];
    k.extend_from_slice(b"model-prefix-16Bvariant0");
    k.extend_from_slice(&crate::hashing::HashAlgo::Xxh3_128.digest(&i.to_le_bytes()));
    k.extend_from_slice(&crate::hashing::HashAlgo::Xxh3_128.digest(&(!i).to_le_bytes()));
    k
}

#[test]
#[ignore]
fn reopen_bench() {
    let n: u64 = std::env::var("FLEXKV_REOPEN_BLOCKS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let dir = tempfile::tempdir().unwrap();
    let capacity = (2 * n + 16) * PAGE as u64;
    let mut cfg = StoreConfig::new(vec![dir.path().to_path_buf()], capacity);
    cfg.preallocate = false;
    BlockStore::open(cfg.clone()).unwrap().close().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    let mut journal = std::fs::read(&path).unwrap();
    let header_len = crate::format::journal::FILE_HEADER_LEN;
    journal.truncate(header_len); // drop the clean-shutdown mark, keep the header
    for i in 0..n {
        let loc = Location {
            dir: 0,
            offset: (1 + 2 * i) * PAGE as u64,
            stored_len: 100,
            raw_len: 100,
            compressed: false,
            seq: i + 1,
        };
        let hash = crate::hashing::HashAlgo::Xxh3_128.digest(&(i + (1 << 40)).to_le_bytes());
        let tag = crate::format::journal::content_tag(&hash);
        Record::Put { key: key(i), tag, loc, parent: None }.encode_into(&mut journal);
    }
    std::fs::write(&path, &journal).unwrap();
    let timer = Timer::start();
    let store = BlockStore::open(cfg.clone()).unwrap();
    let first = timer.stop();
    assert_eq!(store.len() as u64, n);
    let index_bytes = store.index_nbytes();
    store.close().unwrap();
    let timer = Timer::start();
    let store = BlockStore::open(cfg).unwrap();
    let clean = timer.stop();
    assert_eq!(store.len() as u64, n);
    assert!(store.contains(&key(n / 2)));
    drop(store);
    // Where an open's time goes: reading the journal, then replaying it into the index.
    let timer = Timer::start();
    let replayed = super::journal_file::read(dir.path()).unwrap().unwrap();
    let read = timer.stop();
    let timer = Timer::start();
    let mut index = crate::index::Index::new();
    let mut allocators = vec![crate::device::allocator::ExtentAllocator::new(1, capacity / PAGE as u64)];
    super::replay::replay(&replayed, &mut index, &mut allocators, &[false]);
    let replay = timer.stop();
    assert_eq!(index.len() as u64, n);
    println!(
        "reopen_bench: {n} blocks, journal {} MB: open after a crash {first}, after a clean close {clean} \
         (journal read {read}, replay {replay}); index {index_bytes} B = {:.1} B/block",
        journal.len() / 1_000_000,
        index_bytes as f64 / n as f64
    );
}

/// Wall and process CPU time: on a shared machine the CPU figure is the steadier one.
struct Timer {
    wall: Instant,
    cpu: f64,
}

fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid pointer it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

impl Timer {
    fn start() -> Self {
        Timer { wall: Instant::now(), cpu: process_cpu_seconds() }
    }

    fn stop(self) -> String {
        format!("{:.3} s (cpu {:.3} s)", self.wall.elapsed().as_secs_f64(), process_cpu_seconds() - self.cpu)
    }
}
