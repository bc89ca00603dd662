//! Chain lookups through manifests and GC, over `file://` (two tiers share a directory the way
//! two workers share a bucket); request counts come from the tier's own counters.

use super::gc::GcOptions;
use super::manifest::SEGMENT;
use super::*;
use std::time::Duration;

fn chain(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("ns/{tag}/{i:05}").into_bytes()).collect()
}

/// Put items of `keys`, each block its key twice, in `data` (which must outlive the put).
fn put_items(keys: &[Vec<u8>], data: &mut Vec<Vec<u8>>) -> Vec<(Vec<u8>, RawBuf)> {
    *data = keys.iter().map(|k| k.repeat(2)).collect();
    keys.iter().cloned().zip(data.iter_mut().map(|d| RawBuf { ptr: d.as_mut_ptr(), len: d.len() })).collect()
}

fn store_chain(tier: &ObjectTier, keys: &[Vec<u8>], from: usize) -> Vec<BlockResult> {
    let mut data = Vec::new();
    let items = put_items(&keys[from..], &mut data);
    tier.submit_put_chain(keys.to_vec(), items, None).unwrap().wait(None).unwrap()
}

/// The sum of the tier's counters named `names`.
fn counted(tier: &ObjectTier, names: &[&str]) -> u64 {
    tier.stats()
        .iter()
        .filter(|(n, _)| names.contains(n))
        .map(|(_, v)| match v {
            StatValue::Int(v) => *v,
            _ => 0,
        })
        .sum()
}

fn open(url: &str) -> ObjectTier {
    let mut cfg = ObjectConfig::new(url);
    cfg.concurrency = 16;
    ObjectTier::open(cfg).unwrap()
}

/// Every request a tier sends.
const REQUESTS: [&str; 4] = ["get_requests", "head_requests", "put_requests", "list_requests"];

/// The cost of `lookup_chain(keys)` on a fresh tier (nothing known locally), in the counters
/// named `names`; and the blocks it matched.
fn lookup_counted(url: &str, keys: &[Vec<u8>], names: &[&str]) -> (usize, u64) {
    let tier = open(url);
    let before = counted(&tier, names);
    let n = tier.lookup_chain(keys).unwrap();
    (n, counted(&tier, names) - before)
}

/// The cost of `lookup_chain(keys)` on a fresh tier, in requests.
fn lookup_cost(url: &str, keys: &[Vec<u8>]) -> (usize, u64) {
    lookup_counted(url, keys, &REQUESTS)
}

#[test]
fn a_128k_token_prompt_costs_a_few_requests() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let keys = chain("long", 8192);
    let writer = open(&url);
    assert!(store_chain(&writer, &keys, 0).iter().all(|r| r.status == Status::Ok));
    // Seen before: the end manifest, plus one touch recording its use.
    assert_eq!(lookup_cost(&url, &keys), (8192, 2));
    // A prefix ending inside a segment: binary search over 78 segments, then HEADs, then one
    // round confirming the blocks the search skipped (the end manifest, the one that could
    // vouch, was asked first), a touch.
    let (n, cost) = lookup_cost(&url, &keys[..5000]);
    assert_eq!(n, 5000);
    assert!(cost <= 1 + 7 + (6 + 1) + (SEGMENT - 2) as u64 + 1, "{cost}");
    // The prompt continued with new blocks.
    let mut longer = keys.clone();
    longer.extend(chain("new", 300));
    let (n, cost) = lookup_cost(&url, &longer);
    assert_eq!(n, 8192);
    assert!(cost <= 1 + 8 + 2 + 1, "{cost}");
    assert!((cost as f64) / 8192.0 <= 0.1);
    // A new prompt: a bounded number of requests, nothing touched.
    let (n, cost) = lookup_cost(&url, &chain("miss", 8192));
    assert_eq!(n, 0);
    assert!(cost <= 1 + 7 + 2, "{cost}");
}

#[test]
fn a_miss_racing_a_writers_uploads_stays_cheap() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    // A writer's chain upload in flight: blocks 1..40 of its first segment have landed, block 0
    // and the manifests have not (a segment's blocks go up at once, in any order).
    let keys = chain("racing", 2 * SEGMENT + 10);
    let mut data = Vec::new();
    let items = put_items(&keys[1..40], &mut data);
    let r = open(&url).submit_put(items, None).unwrap().wait(None).unwrap();
    assert!(r.iter().all(|r| r.status == Status::Ok), "{r:?}");
    // The end manifest, 2 rounds over the 2 full segments' manifests, then one round asking
    // block 0 (missing: a miss) beside the search's first block.
    let (n, cost) = lookup_cost(&url, &keys);
    assert_eq!(n, 0);
    assert!(cost <= 1 + 2 + 2, "{cost}");
    // Block 0 lands: the hit is the 40 blocks, confirmed.
    let items = put_items(&keys[..1], &mut data);
    open(&url).submit_put(items, None).unwrap().wait(None).unwrap();
    assert_eq!(lookup_cost(&url, &keys).0, 40);
}

#[test]
fn a_chain_that_ended_inside_a_segment_is_found_and_extended() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let keys = chain("turns", 3 * SEGMENT + 40);
    let first = open(&url);
    store_chain(&first, &keys[..SEGMENT + 10], 0);
    let (n, _) = lookup_cost(&url, &keys);
    assert_eq!(n, SEGMENT + 10, "the first turn's blocks, through its end manifest's blocks");
    // A second worker stores the next turn: only the new blocks are uploaded.
    let second = open(&url);
    let r = store_chain(&second, &keys, SEGMENT + 10);
    assert!(r.iter().all(|r| r.status == Status::Ok), "{r:?}");
    assert_eq!(lookup_cost(&url, &keys), (keys.len(), 2));
    // A third writer of the whole chain uploads nothing.
    let third = open(&url);
    let r = store_chain(&third, &keys, 0);
    assert!(r.iter().all(|r| r.status == Status::Deduped));
    let puts = third.stats().iter().find(|(n, _)| *n == "put_body_bytes").map(|(_, v)| v.clone());
    assert!(matches!(puts, Some(StatValue::Int(0))), "{puts:?}");
}

#[test]
fn a_hit_ending_on_a_manifest_already_asked_does_not_ask_it_again() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    // Blocks stored by plain puts (no manifests): segment 0 of one chain, 40 blocks of another.
    let (whole, part) = (chain("whole", 2 * SEGMENT + 10), chain("part", SEGMENT));
    let stored: Vec<Vec<u8>> = whole[..SEGMENT].iter().chain(&part[..40]).cloned().collect();
    let mut data = Vec::new();
    let items = put_items(&stored, &mut data);
    let r = open(&url).submit_put(items, None).unwrap().wait(None).unwrap();
    assert!(r.iter().all(|r| r.status == Status::Ok), "{r:?}");
    const GETS: &[&str] = &["get_requests"]; // manifests (blocks are asked by HEAD)
                                             // The hit ends on segment 0's end: the chain's end and that manifest, each asked once.
    assert_eq!(lookup_counted(&url, &whole, GETS), (SEGMENT, 2));
    // The hit ends on the chain's end, asked once; then the segment's upload claim (a longer
    // chain stored with this one as its prefix would vouch), not stored here.
    assert_eq!(lookup_counted(&url, &part[..40], GETS), (40, 2));
    // A hit ending inside a segment can be vouched for: two more GETs at once, the manifest at
    // the answer and the segment's upload claim (neither is stored here).
    assert_eq!(lookup_counted(&url, &part, GETS), (40, 3));
}

#[test]
fn a_prompt_branching_inside_a_segment_is_vouched_for_by_its_claim() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    // One document shared by two questions; the first question's chain is stored.
    let doc = chain("doc", SEGMENT + 20);
    let ask = |q: &str| -> Vec<Vec<u8>> { doc.iter().cloned().chain(chain(q, 10)).collect() };
    let (first, second) = (ask("q1"), ask("q2"));
    let r = store_chain(&open(&url), &first, 0);
    assert!(r.iter().all(|r| r.status == Status::Ok), "{r:?}");
    // The second question matches the document: the first writer's claim on the document's
    // second segment names the manifest it wrote after those blocks, which vouches for them.
    let lookup = || {
        let tier = open(&url);
        assert_eq!(tier.lookup_chain(&second).unwrap(), doc.len());
        let count = |name: &str| counted(&tier, &[name]);
        (count("chain_claim_vouches"), count("chain_confirm_heads"), counted(&tier, &REQUESTS))
    };
    let (vouches, confirmed, cost) = lookup();
    assert_eq!((vouches, confirmed), (1, 0));
    // The end manifest, 1 segment manifest, the HEAD search, the manifest at the answer and
    // the claim, the claim's manifest, the touches of the two manifests used.
    assert!(cost <= 1 + 1 + 7 + 2 + 1 + 2, "{cost}");
    // A claim whose manifest is not stored (its writer still uploading) vouches for nothing:
    // the blocks the search did not ask are asked by HEAD, and the answer is the same.
    std::fs::remove_file(dir.path().join("m").join(hex_name(first.last().unwrap()))).unwrap();
    let (vouches, confirmed, _) = lookup();
    assert_eq!(vouches, 0);
    assert!(confirmed > 0);
    // A prompt that is a prefix of the stored one ends inside the segment: vouched for too.
    let tier = open(&url);
    std::fs::remove_file(dir.path().join("m").join(hex_name(first.last().unwrap()))).ok();
    let r = store_chain(&tier, &first, 0);
    assert!(r.iter().all(|r| r.status.is_ok()), "{r:?}");
    let tier = open(&url);
    assert_eq!(tier.lookup_chain(&doc[..SEGMENT + 10]).unwrap(), SEGMENT + 10);
    assert_eq!(counted(&tier, &["chain_claim_vouches", "chain_confirm_heads"]), 1);
}

#[test]
fn background_gc_runs_on_the_runtime_under_the_lease_and_stops_at_close() {
    use super::gc_schedule::GcSchedule;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let tier = Arc::new(open(&url));
    let live = chain("live", SEGMENT + 5);
    store_chain(&tier, &live, 0);
    let mut orphan = vec![7u8; 100];
    let items = vec![(b"ns/orphan".to_vec(), RawBuf { ptr: orphan.as_mut_ptr(), len: orphan.len() })];
    tier.submit_put(items, None).unwrap().wait(None).unwrap();
    let opts = GcOptions {
        ttl: Duration::from_secs(3600),
        grace: Duration::ZERO,
        budget_bytes: None,
        dry_run: false,
    };
    let every = |ms: u64, lease_ms: u64| GcSchedule {
        holder: "this-process".into(),
        opts: opts.clone(),
        interval: Duration::from_millis(ms),
        lease: Duration::from_millis(lease_ms),
    };
    let bad = tier.start_gc(every(50, 10)).unwrap_err().to_string();
    assert!(bad.contains("lease"), "{bad}");
    tier.start_gc(every(20, 5000)).unwrap();
    assert!(tier.start_gc(every(20, 5000)).is_err(), "one task per tier");
    let passes = || counted(&tier, &["gc_passes"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while passes() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10)); // polling the task's counter
    }
    assert!(passes() >= 2, "the task ran passes");
    assert_eq!(counted(&tier, &["gc_pass_failures"]), 0);
    let other = open(&url);
    assert_eq!(other.lookup_chain(&live).unwrap(), live.len(), "a live chain stays");
    assert!(!other.try_gc_lease("someone-else", Duration::from_secs(5)).unwrap(), "the lease is held");
    assert!(!dir.path().join("b").join(hex_name(b"ns/orphan")).exists(), "the orphan was collected");
    // Closed: the task has returned and sends nothing more.
    tier.close();
    let requests = counted(&tier, &REQUESTS);
    std::thread::sleep(Duration::from_millis(100)); // five intervals: no pass may start
    assert_eq!(counted(&tier, &REQUESTS), requests);
}

#[test]
fn gc_keeps_live_chains_drops_garbage_and_fits_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let tier = open(&url);
    let old = chain("old", 2 * SEGMENT + 5);
    let new = chain("new", 2 * SEGMENT + 5);
    store_chain(&tier, &old, 0);
    store_chain(&tier, &new, 0);
    let mut orphan = vec![7u8; 100];
    let items = vec![(b"ns/orphan".to_vec(), RawBuf { ptr: orphan.as_mut_ptr(), len: orphan.len() })];
    tier.submit_put(items, None).unwrap().wait(None).unwrap();
    let keep_all = GcOptions {
        ttl: Duration::from_secs(3600),
        grace: Duration::ZERO,
        budget_bytes: None,
        dry_run: false,
    };
    std::thread::sleep(Duration::from_millis(2)); // the orphan older than the zero grace (ms clock)
    let r = tier.gc(&keep_all).unwrap();
    assert_eq!((r.manifests, r.manifests_deleted, r.blocks_deleted), (6, 0, 1), "{r:?}");
    assert_eq!(lookup_cost(&url, &new).0, new.len(), "a use: `new` is now the more recent chain");
    // Room for one chain: the least recently used one goes, whole.
    let one_chain: u64 = r.block_bytes / 2;
    let fit = GcOptions { budget_bytes: Some(one_chain), ..keep_all.clone() };
    let r = tier.gc(&fit).unwrap();
    assert_eq!((r.manifests_deleted, r.blocks_deleted), (3, old.len() as u64), "{r:?}");
    assert_eq!(lookup_cost(&url, &old).0, 0);
    assert_eq!(lookup_cost(&url, &new).0, new.len());
    // Unused for longer than the TTL: everything goes.
    let expire = GcOptions { ttl: Duration::ZERO, ..keep_all };
    let r = tier.gc(&expire).unwrap();
    assert_eq!((r.manifests_deleted, r.blocks_deleted), (3, new.len() as u64), "{r:?}");
    let inv = tier.inventory().unwrap();
    assert!(inv.iter().all(|(k, _)| k.starts_with("lease") || k.starts_with("other")), "{inv:?}");
}

#[test]
fn one_gc_lease_holder_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let (a, b) = (open(&url), open(&url));
    assert!(a.try_gc_lease("a", Duration::from_secs(60)).unwrap());
    assert!(!b.try_gc_lease("b", Duration::from_secs(60)).unwrap());
    assert!(a.try_gc_lease("a", Duration::from_millis(1)).unwrap(), "the holder renews");
    std::thread::sleep(Duration::from_millis(5)); // the 1 ms lease lapses
    assert!(b.try_gc_lease("b", Duration::from_secs(60)).unwrap(), "a lapsed lease is taken over");
    assert!(!a.try_gc_lease("a", Duration::from_secs(60)).unwrap());
}

#[test]
fn knowledge_ages_out_after_the_touch_interval() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let mut cfg = ObjectConfig::new(url.as_str());
    cfg.touch_interval = Duration::from_millis(50);
    let tier = ObjectTier::open(cfg).unwrap();
    let keys = chain("aged", 3);
    store_chain(&tier, &keys, 0);
    // Another process's GC deletes everything.
    let expire = GcOptions { ttl: Duration::ZERO, grace: Duration::ZERO, budget_bytes: None, dry_run: false };
    // "Older than a zero grace" is by the millisecond clock: a GC in the upload's own
    // millisecond keeps the blocks (seen on a fast machine).
    std::thread::sleep(Duration::from_millis(2));
    assert_eq!(open(&url).gc(&expire).unwrap().blocks_deleted, 3);
    std::thread::sleep(Duration::from_millis(60)); // the touch interval passes
    let again = store_chain(&tier, &keys, 0);
    assert!(again.iter().all(|r| r.status == Status::Ok), "uploaded again, not skipped: {again:?}");
    assert_eq!(lookup_cost(&url, &keys).0, 3);
}
