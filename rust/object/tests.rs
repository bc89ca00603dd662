//! The object tier over `memory://` and `file://` (the S3 paths are tested against a real
//! server from Python: tests/test_object_tier.py).

use super::*;

fn blocks(n: usize, len: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let data = (0..len).map(|j| ((i * 131 + j * 7) % 251) as u8).collect();
            (format!("ns/{i:04}").into_bytes(), data)
        })
        .collect()
}

fn raw(buf: &mut [u8]) -> RawBuf {
    RawBuf { ptr: buf.as_mut_ptr(), len: buf.len() }
}

fn put_all(tier: &ObjectTier, data: &mut [(Vec<u8>, Vec<u8>)]) -> Vec<BlockResult> {
    let items = data.iter_mut().map(|(k, v)| (k.clone(), raw(v))).collect();
    tier.submit_put(items, None).unwrap().wait(None).unwrap()
}

fn get_all(tier: &ObjectTier, keys: &[Vec<u8>], len: usize) -> (Vec<BlockResult>, Vec<Vec<u8>>) {
    let mut outs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let items = keys.iter().cloned().zip(outs.iter_mut().map(|o| raw(o))).collect();
    let results = tier.submit_get(items, None).unwrap().wait(None).unwrap();
    (results, outs)
}

fn round_trip(url: &str, compression: &str) {
    let mut cfg = ObjectConfig::new(url);
    cfg.concurrency = 4;
    cfg.compression = crate::compression::Compression::parse(compression, 3).unwrap();
    let tier = ObjectTier::open(cfg).unwrap();
    let mut data = blocks(20, 20_000);
    let first = put_all(&tier, &mut data);
    assert!(first.iter().all(|r| r.status == Status::Ok), "{first:?}");
    let again = put_all(&tier, &mut data);
    assert!(again.iter().all(|r| r.status == Status::Deduped), "{again:?}");
    let keys: Vec<Vec<u8>> = data.iter().map(|(k, _)| k.clone()).collect();
    let (results, outs) = get_all(&tier, &keys, 20_000);
    assert!(results.iter().all(|r| r.status == Status::Ok && r.nbytes == 20_000), "{results:?}");
    for ((_, want), got) in data.iter().zip(&outs) {
        assert_eq!(want, got);
    }
    let (missing, _) = get_all(&tier, &[b"ns/missing".to_vec()], 10);
    assert_eq!(missing[0].status, Status::NotFound);
    let mut probe = keys[..3].to_vec();
    probe.push(b"ns/missing".to_vec());
    assert_eq!(tier.contains_many(&probe).unwrap(), vec![true, true, true, false]);
    assert_eq!(tier.delete(&keys[..2]).unwrap(), 2);
    assert_eq!(tier.contains_many(&keys[..3]).unwrap(), vec![false, false, true]);
    let stats = tier.stats();
    let count = |name: &str| match stats.iter().find(|(n, _)| *n == name) {
        Some((_, StatValue::Int(v))) => *v,
        _ => panic!("no stat {name}"),
    };
    assert_eq!(count("put_requests"), 20, "known keys are not uploaded again");
    assert_eq!(count("puts_known"), 20);
    tier.close();
    assert!(matches!(tier.submit_put(Vec::new(), None), Err(ObjectError::Closed)));
}

#[test]
fn memory_round_trip() {
    round_trip("memory://", "none");
    round_trip("memory://", "zstd");
}

#[test]
fn file_round_trip_and_first_writer_wins() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().join("objects").display());
    round_trip(&url, "zstd");
    // Two tiers (two writers that know nothing of each other) on the same directory.
    let a = ObjectTier::open(ObjectConfig::new(url.as_str())).unwrap();
    let b = ObjectTier::open(ObjectConfig::new(url.as_str())).unwrap();
    let mut first = vec![(b"ns/shared".to_vec(), vec![1u8; 5000])];
    let mut second = vec![(b"ns/shared".to_vec(), vec![2u8; 5000])];
    assert_eq!(put_all(&a, &mut first)[0].status, Status::Ok);
    assert_eq!(put_all(&b, &mut second)[0].status, Status::Deduped);
    let (r, outs) = get_all(&b, &[b"ns/shared".to_vec()], 5000);
    assert_eq!(r[0].status, Status::Ok);
    assert_eq!(outs[0], vec![1u8; 5000], "the first writer's bytes stay");
}

#[test]
fn corrupt_object_is_reported_not_returned() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let tier = ObjectTier::open(ObjectConfig::new(url.as_str())).unwrap();
    let mut data = blocks(1, 9000);
    put_all(&tier, &mut data);
    let name: String = data[0].0.iter().map(|b| format!("{b:02x}")).collect();
    let file = dir.path().join("b").join(name);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let (r, outs) = get_all(&tier, &[data[0].0.clone()], 9000);
    assert_eq!(r[0].status, Status::Corrupt, "{r:?}");
    assert!(outs[0].iter().all(|&b| b == 0));
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let (r, _) = get_all(&tier, &[data[0].0.clone()], 9000);
    assert_eq!(r[0].status, Status::Corrupt, "{r:?}");
}

#[test]
fn bad_urls_and_missing_credentials_are_config_errors() {
    for url in ["ftp://x/y", "not a url", "s3:///nobucket"] {
        assert!(matches!(ObjectTier::open(ObjectConfig::new(url)), Err(ObjectError::Config(_))), "{url}");
    }
    let mut cfg = ObjectConfig::new("s3://bucket/prefix");
    cfg.endpoint = Some("http://127.0.0.1:9".into());
    cfg.access_key_id = Some("id".into());
    let err = ObjectTier::open(cfg).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("both or neither"), "{err}");
    // No credentials anywhere: refused rather than asking the cloud's metadata address.
    let env_has = |names: &[&str]| names.iter().any(|n| std::env::var_os(n).is_some());
    if !env_has(&["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]) {
        let err = ObjectTier::open(ObjectConfig::new("s3://bucket/p")).err().map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("allow_instance_metadata"));
    }
    let gcloud =
        std::env::var_os("HOME").is_some_and(|h| std::path::Path::new(&h).join(".config/gcloud").exists());
    if !gcloud
        && !env_has(&[
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
        ])
    {
        let err = ObjectTier::open(ObjectConfig::new("gs://bucket/p")).err().map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("allow_instance_metadata"));
    }
}

#[test]
fn driven_through_the_block_tier_seam() {
    use crate::tier::BlockTier;
    let tier: Arc<dyn BlockTier<Error = ObjectError>> =
        Arc::new(ObjectTier::open(ObjectConfig::new("memory://")).unwrap());
    assert_eq!(tier.tier_name(), "object");
    let mut data = blocks(10, 3000);
    let items = data.iter_mut().map(|(k, v)| (k.clone(), raw(v))).collect();
    let put = tier.submit_put(items, None).unwrap().wait(None).unwrap();
    assert!(put.iter().all(|r| r.status == Status::Ok));
    let mut keys: Vec<Vec<u8>> = data.iter().map(|(k, _)| k.clone()).collect();
    assert!(tier.contains(&keys[3]) && !tier.contains(b"ns/none"));
    keys.insert(7, b"ns/gap".to_vec());
    assert_eq!(tier.match_prefix(&mut keys.iter().map(Vec::as_slice)), 7);
    assert_eq!(tier.delete_many(&keys[..1]).unwrap(), 1);
    assert!(!tier.contains(&keys[0]));
    assert!(tier.drain_evicted().is_empty());
    tier.close().unwrap();
    assert!(matches!(tier.submit_get(Vec::new(), None), Err(ObjectError::Closed)));
}
