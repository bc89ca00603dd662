//! Store-level tests in Rust: persistence and crash recovery. A "crash" is simulated by copying
//! the directory while the store is open (what a kill -9 leaves on disk: O_DIRECT data on the
//! device, journal bytes in the page cache) and opening the copy.

use std::path::Path;

use super::*;

fn data(key: &[u8], len: usize) -> Vec<u8> {
    let seed = crate::hashing::HashAlgo::Xxh3_128.digest(key);
    (0..len).map(|i| seed[i % 16].wrapping_add((i / 16) as u8)).collect()
}

fn put_all(store: &BlockStore, keys: &[Vec<u8>], len: usize) -> Vec<BlockResult> {
    let bufs: Vec<Vec<u8>> = keys.iter().map(|k| data(k, len)).collect();
    let items = keys
        .iter()
        .zip(&bufs)
        .map(|(k, b)| (k.clone(), RawBuf { ptr: b.as_ptr() as *mut u8, len: b.len() }))
        .collect();
    let batch = store.submit_put(items, None).unwrap();
    let results = batch.wait(None).unwrap();
    drop(bufs);
    results
}

fn read(store: &BlockStore, key: &[u8]) -> Option<Vec<u8>> {
    let len = store.block_len(key)? as usize;
    let mut out = vec![0u8; len];
    let items = vec![(key.to_vec(), RawBuf { ptr: out.as_mut_ptr(), len })];
    let r = store.submit_get(items, None).unwrap().wait(None).unwrap();
    (r[0].status == Status::Ok).then_some(out)
}

fn open(dir: &Path) -> BlockStore {
    BlockStore::open(StoreConfig::new(vec![dir.to_path_buf()], 8 << 20)).unwrap()
}

fn snapshot(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for name in [crate::device::data_file::DATA_FILE, journal_file::JOURNAL_FILE] {
        std::fs::copy(src.join(name), dst.join(name)).unwrap();
    }
}

#[test]
fn clean_reopen_recovers_and_marks_clean() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<Vec<u8>> = (0..20).map(|i| format!("k{i}").into_bytes()).collect();
    {
        let store = open(dir.path());
        assert!(put_all(&store, &keys, 10_000).iter().all(|r| r.status == Status::Ok));
        store.close().unwrap();
    }
    let store = open(dir.path());
    assert!(store.shared.last_clean_shutdown.is_some());
    for k in &keys {
        assert_eq!(read(&store, k).unwrap(), data(k, 10_000));
    }
}

#[test]
fn crash_snapshot_keeps_acknowledged_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let crashed = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let keys: Vec<Vec<u8>> = (0..30).map(|i| format!("k{i}").into_bytes()).collect();
    assert!(put_all(&store, &keys, 20_000).iter().all(|r| r.status == Status::Ok));
    assert!(store.delete(b"k5").unwrap());
    snapshot(dir.path(), crashed.path());
    let recovered = open(crashed.path());
    assert!(recovered.shared.last_clean_shutdown.is_none());
    assert_eq!(recovered.len(), 29);
    assert!(!recovered.contains(b"k5"));
    for k in keys.iter().filter(|k| k.as_slice() != b"k5") {
        assert_eq!(read(&recovered, k).unwrap(), data(k, 20_000));
    }
}

#[test]
fn any_torn_journal_prefix_recovers_whole_records_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let keys: Vec<Vec<u8>> = (0..12).map(|i| format!("k{i}").into_bytes()).collect();
    for k in &keys {
        put_all(&store, std::slice::from_ref(k), 5_000);
    }
    let journal = std::fs::read(dir.path().join(journal_file::JOURNAL_FILE)).unwrap();
    let header = crate::format::journal::FILE_HEADER_LEN;
    for cut in (header..=journal.len()).step_by(7) {
        let copy = tempfile::tempdir().unwrap();
        snapshot(dir.path(), copy.path());
        std::fs::write(copy.path().join(journal_file::JOURNAL_FILE), &journal[..cut]).unwrap();
        let recovered = open(copy.path());
        let present = recovered.keys();
        // Records are appended in order: what survives is a prefix of the keys, each complete.
        assert_eq!(present.as_slice(), &keys[..present.len()]);
        for k in &present {
            assert_eq!(read(&recovered, k).unwrap(), data(k, 5_000));
        }
    }
}

#[test]
fn recovery_drops_records_beyond_a_shrunk_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("k{i}").into_bytes()).collect();
    {
        let store = open(dir.path());
        put_all(&store, &keys, 100_000);
        store.close().unwrap();
    }
    let small = BlockStore::open(StoreConfig::new(vec![dir.path().to_path_buf()], 1 << 20)).unwrap();
    assert!(small.len() < keys.len());
    for k in small.keys() {
        assert_eq!(read(&small, &k).unwrap(), data(&k, 100_000));
    }
}

#[test]
fn store_files_are_private_and_old_ones_are_tightened() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let names =
        [crate::device::data_file::DATA_FILE, journal_file::JOURNAL_FILE, crate::device::dir_lock::LOCK_FILE];
    let mode = |name: &str| std::fs::metadata(dir.path().join(name)).unwrap().permissions().mode() & 0o777;
    {
        let store = open(dir.path());
        put_all(&store, &[b"k".to_vec()], 5_000);
        store.close().unwrap();
    }
    for name in names {
        // 0600 at most: a stricter umask may take more away, never give more.
        assert_eq!(mode(name) & !0o600, 0, "{name} is {:o}", mode(name));
    }
    // A store from before private files: 0644 everywhere; a read-write open fixes it.
    for name in names {
        std::fs::set_permissions(dir.path().join(name), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let store = open(dir.path());
    for name in names {
        assert_eq!(mode(name), 0o600, "{name}");
    }
    assert_eq!(read(&store, b"k").unwrap(), data(b"k", 5_000));
}

/// Wait (bounded) until `cond` holds; panics after 10 s.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn batches_complete_while_compaction_runs_and_a_crash_mid_compaction_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(vec![dir.path().to_path_buf()], 8 << 20);
    // The first background compaction spends 10 s before writing its new journal: far longer
    // than the batch below may take on a loaded machine (it is given 8 s).
    cfg.fault_injection = Some(crate::io::fault::FaultPlan::parse("journal:DELAY10000:1000").unwrap());
    let store = Arc::new(BlockStore::open(cfg).unwrap());
    let old: Vec<Vec<u8>> = (0..20).map(|i| format!("old{i}").into_bytes()).collect();
    assert!(put_all(&store, &old, 9000).iter().all(|r| r.status == Status::Ok));
    let compacting = || store.shared.state.lock().journal.compacting();

    let background = {
        let store = store.clone();
        std::thread::spawn(move || store.checkpoint())
    };
    wait_until("the compaction to start", compacting);
    // A batch and a delete complete while the rewrite is still running: they do not wait for it.
    let new: Vec<Vec<u8>> = (0..5).map(|i| format!("new{i}").into_bytes()).collect();
    let bufs: Vec<Vec<u8>> = new.iter().map(|k| data(k, 9000)).collect();
    let items =
        new.iter().zip(&bufs).map(|(k, b)| (k.clone(), RawBuf { ptr: b.as_ptr() as *mut u8, len: b.len() }));
    let batch = store.submit_put(items.collect(), None).unwrap();
    let results = batch.wait(Some(Duration::from_secs(8))).unwrap();
    assert!(results.iter().all(|r| r.status == Status::Ok));
    assert!(store.delete(b"old3").unwrap());
    assert!(compacting(), "the batch should not have waited for the compaction");

    // A crash now (old journal current, the new one half done) keeps every acknowledged block.
    let crashed = tempfile::tempdir().unwrap();
    snapshot(dir.path(), crashed.path());
    let expect: Vec<&Vec<u8>> = old.iter().chain(&new).filter(|k| k.as_slice() != b"old3").collect();
    {
        let recovered = open(crashed.path());
        assert_eq!(recovered.len(), expect.len());
        assert!(!recovered.contains(b"old3"));
        for k in &expect {
            assert_eq!(read(&recovered, k).unwrap(), data(k, 9000));
        }
    }

    background.join().unwrap().unwrap();
    assert!(!compacting());
    // The new journal holds the snapshot and what was appended meanwhile.
    let after = tempfile::tempdir().unwrap();
    snapshot(dir.path(), after.path());
    let recovered = open(after.path());
    assert_eq!(recovered.len(), expect.len());
    assert!(!recovered.contains(b"old3"));
    for k in &expect {
        assert_eq!(read(&recovered, k).unwrap(), data(k, 9000));
    }
    let stray = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().ends_with(".compact"));
    assert!(!stray, "the compaction's temp file was installed, not left behind");
}

/// The calls the layers above make, through the trait only (what an object tier must pass too).
#[test]
fn the_ssd_store_serves_through_the_block_tier_trait() {
    use crate::tier::BlockTier;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(vec![dir.path().to_path_buf()], 64 << 10);
    cfg.preallocate = false;
    let tier: Arc<dyn BlockTier<Error = StoreError>> = Arc::new(BlockStore::open(cfg).unwrap());
    assert_eq!(tier.tier_name(), "ssd");
    let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("t{i}").into_bytes()).collect();
    let bufs: Vec<Vec<u8>> = keys.iter().map(|k| data(k, 8192)).collect();
    for range in [0..5, 5..6] {
        let items = range.map(|i| (keys[i].clone(), RawBuf { ptr: bufs[i].as_ptr() as *mut u8, len: 8192 }));
        let put = tier.submit_put(items.collect(), None).unwrap().wait(None).unwrap();
        assert!(put.iter().all(|r| r.status == Status::Ok), "{put:?}");
    }
    // 64 KiB hold 5 blocks of 3 pages beside the superblock: the first one was evicted.
    let evicted = tier.drain_evicted();
    assert_eq!(evicted, vec![keys[0].clone()]);
    assert!(!tier.contains(&keys[0]) && tier.contains(&keys[5]));
    assert_eq!(tier.match_prefix(&mut keys[1..].iter().map(Vec::as_slice)), 5);
    let mut out = vec![0u8; 8192];
    let get =
        tier.submit_get(vec![(keys[5].clone(), RawBuf { ptr: out.as_mut_ptr(), len: out.len() })], None);
    assert_eq!(get.unwrap().wait(None).unwrap()[0].status, Status::Ok);
    assert_eq!(out, bufs[5]);
    assert_eq!(tier.delete_many(&[keys[5].clone(), keys[0].clone()]).unwrap(), 1);
    let stats = tier.stats();
    assert!(stats.contains(&("blocks", crate::tier::StatValue::Int(4))));
    tier.close().unwrap();
    assert!(matches!(tier.submit_put(Vec::new(), None), Err(StoreError::Closed)));
}

/// A journal reopened as it is (no rewrite at open) loses its clean-shutdown mark, and what is
/// appended to it survives a crash.
#[test]
fn journal_kept_at_open_reads_unclean_after_a_crash_and_keeps_new_records() {
    let dir = tempfile::tempdir().unwrap();
    let first: Vec<Vec<u8>> = (0..10).map(|i| format!("a{i}").into_bytes()).collect();
    let later: Vec<Vec<u8>> = (0..10).map(|i| format!("b{i}").into_bytes()).collect();
    let store = open(dir.path());
    assert!(put_all(&store, &first, 5000).iter().all(|r| r.status == Status::Ok));
    store.close().unwrap();
    drop(store);
    let journal = dir.path().join(journal_file::JOURNAL_FILE);
    let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let before = inode(&journal);

    let store = open(dir.path());
    assert!(store.shared.last_clean_shutdown.is_some());
    assert_eq!(inode(&journal), before, "a clean, compact journal is reopened, not rewritten");
    let idle = tempfile::tempdir().unwrap();
    snapshot(dir.path(), idle.path()); // a crash before any write of this session
    assert!(put_all(&store, &later, 5000).iter().all(|r| r.status == Status::Ok));
    assert!(store.delete(b"a0").unwrap());
    let crashed = tempfile::tempdir().unwrap();
    snapshot(dir.path(), crashed.path());

    let recovered = open(idle.path());
    assert!(recovered.shared.last_clean_shutdown.is_none(), "the crashed session was not clean");
    assert_eq!(recovered.len(), 10);
    let recovered = open(crashed.path());
    assert!(recovered.shared.last_clean_shutdown.is_none());
    assert_eq!(recovered.len(), 19);
    for k in first.iter().skip(1).chain(&later) {
        assert_eq!(read(&recovered, k).unwrap(), data(k, 5000));
    }
}

/// Key a's 10 000 bytes, stored; where they lie.
fn stored_a(store: &BlockStore) -> (Vec<u8>, crate::format::journal::Location) {
    assert_eq!(put_all(store, &[b"a".to_vec()], 10_000)[0].status, Status::Ok);
    let loc = store.shared.state.lock().index.lookup(b"a").unwrap().1.loc;
    (data(b"a", 10_000), loc)
}

/// Overwrite the data file's page at `offset` behind the store's back (damage, a planted header).
fn overwrite_page(dir: &Path, offset: u64, page: &[u8]) {
    use std::os::unix::fs::FileExt;
    let file =
        std::fs::OpenOptions::new().write(true).open(dir.join(crate::device::data_file::DATA_FILE)).unwrap();
    file.write_all_at(page, offset).unwrap();
    file.sync_all().unwrap();
}

/// Put `bytes` under `key`, one item.
fn put_one(store: &BlockStore, key: &[u8], bytes: &[u8]) -> Vec<BlockResult> {
    let items = vec![(key.to_vec(), RawBuf { ptr: bytes.as_ptr() as *mut u8, len: bytes.len() })];
    store.submit_put(items, None).unwrap().wait(None).unwrap()
}

#[test]
fn a_dedup_candidate_found_by_tag_is_refuted_by_its_header_full_hash() {
    // The index keeps 6 bytes of each content hash. Plant a clash: rewrite key a's header page
    // so that its full hash shares a's tag (the first 6 bytes) but differs after. A put of a's
    // bytes under key b finds a's content by tag, reads the header, and must not map b onto it.
    use crate::format::header::BlockHeader;
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (a, loc) = stored_a(&store);
    let mut hash = store.shared.cfg.hash.digest(&a);
    hash[6..].iter_mut().for_each(|b| *b ^= 0xFF);
    let mut page = vec![0u8; crate::format::PAGE];
    let header = BlockHeader {
        flags: 0,
        hash_algo: store.shared.cfg.hash.code(),
        raw_len: loc.raw_len,
        stored_len: loc.stored_len,
        seq: loc.seq,
        content_hash: hash,
        key: b"a".to_vec(),
    };
    header.encode_into(&mut page);
    overwrite_page(dir.path(), loc.offset, &page);
    let r = put_one(&store, b"b", &a);
    assert_eq!(r[0].status, Status::IoError, "{:?}", r[0]);
    assert!(!store.contains(b"b"));
    assert_eq!(store.shared.state.lock().index.content_count(), 1);
    // a's payload no longer matches its header's full hash: a read refuses it (never served).
    assert_eq!(read(&store, b"a"), None);
    // Unrelated content still dedups through a confirming header read.
    let c = data(b"c", 10_000);
    assert_eq!(put_all(&store, &[b"c".to_vec()], 10_000)[0].status, Status::Ok);
    let r = put_one(&store, b"d", &c);
    assert_eq!(r[0].status, Status::Deduped);
    assert_eq!(read(&store, b"d").unwrap(), c);
}

#[test]
fn a_dedup_candidate_with_a_damaged_header_is_dropped_and_the_next_put_stores() {
    // Key a's header page is overwritten with garbage (bit rot, a torn rewrite). A put of a's
    // bytes under key b finds a's content by tag; the confirming read finds no valid header, so
    // that put fails (recompute) and a's content is dropped: the next put of the same bytes
    // stores its own copy instead of failing against a damaged block for as long as it lives.
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (a, loc) = stored_a(&store);
    overwrite_page(dir.path(), loc.offset, &[0x5A; crate::format::PAGE]);
    let r = put_one(&store, b"b", &a);
    assert_eq!(r[0].status, Status::IoError, "{:?}", r[0]);
    assert!(!store.contains(b"b"));
    assert!(!store.contains(b"a"), "the damaged content is dropped with its keys");
    assert_eq!(store.shared.state.lock().index.content_count(), 0);
    let r = put_one(&store, b"b", &a);
    assert_eq!(r[0].status, Status::Ok, "{:?}", r[0]);
    assert_eq!(read(&store, b"b").unwrap(), a);
    drop(store);
    let reopened = open(dir.path());
    assert!(!reopened.contains(b"a"), "the drop was journaled");
    assert_eq!(read(&reopened, b"b").unwrap(), a);
}

#[test]
fn a_full_store_still_evicts_and_lists_by_write_after_a_reopen() {
    // No order is kept, but a device that fills up still takes puts (a clock sweep picks
    // victims), and after a reopen the keys come oldest write first.
    let dir = tempfile::tempdir().unwrap();
    let cfg = || StoreConfig::new(vec![dir.path().to_path_buf()], 1 << 20);
    let keys: Vec<Vec<u8>> = (0..60).map(|i| format!("k{i:02}").into_bytes()).collect();
    {
        let store = BlockStore::open(cfg()).unwrap();
        for chunk in keys.chunks(6) {
            assert!(put_all(&store, chunk, 20_000).iter().all(|r| r.status == Status::Ok));
        }
        assert!(store.len() < keys.len());
        assert!(!store.drain_evicted().is_empty());
        store.close().unwrap();
    }
    let store = BlockStore::open(cfg()).unwrap();
    let listed = store.keys();
    assert!(!listed.is_empty());
    let mut by_write = listed.clone();
    by_write.sort(); // keys were written in name order
    assert_eq!(listed, by_write);
    for k in &listed {
        assert_eq!(read(&store, k).unwrap(), data(k, 20_000));
    }
}

#[test]
fn a_get_never_waits_for_a_batch_thread_behind_slow_writes() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(vec![dir.path().to_path_buf()], 8 << 20);
    cfg.batch_threads = 2;
    // Every device write is held 3 s: each put keeps its batch thread that long.
    cfg.fault_injection = Some(crate::io::fault::FaultPlan::parse("write:DELAY3000:1").unwrap());
    let store = BlockStore::open(cfg).unwrap();
    let keys: Vec<Vec<u8>> = (0..4).map(|i| format!("slow{i}").into_bytes()).collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|k| data(k, 9000)).collect();
    // More puts than put threads: both threads wait on the device, the rest queue.
    let puts: Vec<_> = keys
        .iter()
        .zip(bufs.iter_mut())
        .map(|(k, b)| {
            store.submit_put(vec![(k.clone(), RawBuf { ptr: b.as_mut_ptr(), len: b.len() })], None).unwrap()
        })
        .collect();
    let mut out = vec![0u8; 9000];
    let get = store
        .submit_get(vec![(b"absent".to_vec(), RawBuf { ptr: out.as_mut_ptr(), len: out.len() })], None)
        .unwrap();
    let got = get.wait(Some(Duration::from_secs(60))).unwrap();
    assert_eq!(got[0].status, Status::NotFound);
    assert!(puts.iter().all(|p| !p.done()), "the get waited for a put's thread");
    for p in &puts {
        assert!(p.wait(Some(Duration::from_secs(60))).unwrap().iter().all(|r| r.status == Status::Ok));
    }
}

#[test]
fn keys_and_links_list_joined_by_head_with_the_tag_cut_and_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let key = |head: &[u8], i: u8| [head, &[i; 6][..]].concat();
    let ours: Vec<Vec<u8>> = (0..4).map(|i| key(b"TGhead", i)).collect();
    let other = key(b"TGelse", 9);
    {
        let store = open(dir.path());
        let bufs: Vec<Vec<u8>> = ours.iter().chain([&other]).map(|k| data(k, 4096)).collect();
        let items = ours
            .iter()
            .chain([&other])
            .zip(&bufs)
            .map(|(k, b)| (k.clone(), RawBuf { ptr: b.as_ptr() as *mut u8, len: b.len() }))
            .collect();
        // ours[i] extends ours[i - 1]; ours[0] extends the other head's key (not listed).
        let parents = [Some(other.clone()), Some(ours[0].clone()), Some(ours[1].clone()), None, None];
        let extras = parents.into_iter().map(|parent| PutExtra { parent, meta: None }).collect();
        let results = store.submit_put_with(items, extras, None).unwrap().wait(None).unwrap();
        assert!(results.iter().all(|r| r.status == Status::Ok));
        drop(bufs);
    }
    let store = open(dir.path());
    let cut = |k: &Vec<u8>| k[2..].to_vec();
    let heads = vec![b"TGhead".to_vec()];
    let (keys, width) = store.keys_joined(&heads, 2, 8).unwrap();
    assert_eq!((keys, width), (ours.iter().flat_map(cut).collect::<Vec<u8>>(), 10));
    let inv = store.inventory_joined(&heads, 2, 8).unwrap();
    assert_eq!(inv.children, [&ours[1], &ours[2]].into_iter().flat_map(cut).collect::<Vec<u8>>());
    assert_eq!(inv.parents, [&ours[0], &ours[1]].into_iter().flat_map(cut).collect::<Vec<u8>>());
    assert_eq!(store.keys_joined(&heads, 2, 13), Some((Vec::new(), 0))); // none that long
                                                                         // Both heads listed: widths are still one; a key of another width makes it None.
    let both = vec![b"TGhead".to_vec(), b"TGelse".to_vec()];
    assert_eq!(store.keys_joined(&both, 2, 8).map(|(k, _)| k.len()), Some(50));
    let long = key(b"TGhead", 7).repeat(2);
    assert!(put_all(&store, &[long], 4096).iter().all(|r| r.status == Status::Ok));
    assert!(store.keys_joined(&heads, 2, 8).is_none());
}
