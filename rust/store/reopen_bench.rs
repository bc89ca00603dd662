//! Reopen time at scale (ignored by default; run with
//! `cargo test --release --lib reopen_bench -- --ignored --nocapture`, `FLEXKV_REOPEN_BLOCKS`
//! to change the count). Builds the journal of N tiny blocks directly (the data file is sparse:
//! replay never reads block data), then times `BlockStore::open` and reports the index size.

use std::time::Instant;

use super::journal_file::JOURNAL_FILE;
use super::*;
use crate::format::journal::Location;

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
        Record::Put { key: key(i), hash, loc }.encode_into(&mut journal);
    }
    std::fs::write(&path, &journal).unwrap();
    let started = Instant::now();
    let store = BlockStore::open(cfg.clone()).unwrap();
    let first = started.elapsed().as_secs_f64();
    assert_eq!(store.len() as u64, n);
    let index_bytes = store.index_nbytes();
    store.close().unwrap();
    let started = Instant::now();
    let store = BlockStore::open(cfg).unwrap();
    let clean = started.elapsed().as_secs_f64();
    assert_eq!(store.len() as u64, n);
    assert!(store.contains(&key(n / 2)));
    println!(
        "reopen_bench: {n} blocks, journal {} MB: open after a crash {first:.3} s, after a clean close {clean:.3} s; \
         index {index_bytes} B = {:.1} B/block",
        journal.len() / 1_000_000,
        index_bytes as f64 / n as f64
    );
}
