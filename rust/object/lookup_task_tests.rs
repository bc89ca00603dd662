//! Lookups submitted to the runtime answer what the blocking calls do, and `close` with
//! lookups queued or running returns (over `file://`, the way two workers share a bucket).

use std::time::Duration;

use super::lookup_task::{Answer, LOOKUPS_AT_ONCE};
use super::*;

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

fn chain(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("ns/{tag}/{i:05}").into_bytes()).collect()
}

fn open(url: &str) -> ObjectTier {
    ObjectTier::open(ObjectConfig::new(url)).unwrap()
}

/// A tier over a fresh directory holding the chain `keys` and the one-block chain `single`.
fn stored(dir: &tempfile::TempDir, keys: &[Vec<u8>], single: &[u8]) -> String {
    let url = format!("file://{}", dir.path().display());
    let writer = open(&url);
    for chain in [keys.to_vec(), vec![single.to_vec()]] {
        let mut data: Vec<Vec<u8>> = chain.iter().map(|k| k.repeat(2)).collect();
        let items =
            chain.iter().cloned().zip(data.iter_mut().map(|d| RawBuf { ptr: d.as_mut_ptr(), len: d.len() }));
        let results =
            writer.submit_put_chain(chain.clone(), items.collect(), None).unwrap().wait(None).unwrap();
        assert!(results.iter().all(|r| r.status == Status::Ok));
    }
    writer.close();
    url
}

#[test]
fn a_submitted_chain_lookup_answers_what_the_blocking_one_does() {
    let dir = tempfile::tempdir().unwrap();
    let keys = chain("c", 300);
    let url = stored(&dir, &keys, b"ns/one/0");
    let mut longer = keys.clone();
    longer.extend(chain("new", 20));
    let mut bad = keys[..10].to_vec();
    bad[3].clear(); // an invalid key: the blocking lookup answers 0
    let asks = [keys.clone(), keys[..130].to_vec(), longer, chain("miss", 40), bad, Vec::new()];
    // Each on a fresh tier, so neither answer comes from what the other one learnt.
    for ask in asks {
        let want = open(&url).lookup_chain(&ask).unwrap();
        let handle = open(&url).submit_lookup_chain(ask.clone()).unwrap();
        assert_eq!(handle.wait(WAIT).unwrap(), Answer::Matched(want), "{} keys", ask.len());
        assert!(handle.done());
    }
    assert_eq!(open(&url).lookup_chain(&keys).unwrap(), 300, "the fixture holds the chain");
}

#[test]
fn a_presence_probe_answers_one_block_chain_lookups() {
    let dir = tempfile::tempdir().unwrap();
    let keys = chain("c", 40);
    let url = stored(&dir, &keys, b"ns/one/0");
    let probe: Vec<Vec<u8>> =
        vec![b"ns/one/0".to_vec(), b"ns/absent".to_vec(), keys[0].clone(), keys[39].clone(), Vec::new()];
    let want: Vec<bool> =
        probe.iter().map(|k| open(&url).lookup_chain(std::slice::from_ref(k)).unwrap() == 1).collect();
    assert!(want[0] && !want[1] && !want[4], "{want:?}");
    let got = open(&url).submit_present(probe).unwrap().wait(WAIT).unwrap();
    assert_eq!(got, Answer::Present(want));
}

#[test]
fn close_with_lookups_queued_returns_and_fails_the_unstarted() {
    let dir = tempfile::tempdir().unwrap();
    let keys = chain("c", 200);
    let url = stored(&dir, &keys, b"ns/one/0");
    let tier = open(&url);
    let handles: Vec<_> =
        (0..4 * LOOKUPS_AT_ONCE).map(|_| tier.submit_lookup_chain(keys.clone()).unwrap()).collect();
    // Dropped at once: aborted, and `close` does not wait for them.
    for _ in 0..LOOKUPS_AT_ONCE {
        drop(tier.submit_lookup_chain(keys.clone()).unwrap());
    }
    tier.close();
    for h in &handles {
        assert!(h.done(), "close returned before a lookup it waits for answered");
        match h.wait(Some(Duration::ZERO)) {
            Ok(a) => assert_eq!(a, Answer::Matched(200)),
            Err(e) => assert!(matches!(e, ObjectError::Closed), "{e}"),
        }
    }
    assert!(matches!(tier.submit_lookup_chain(keys), Err(ObjectError::Closed)));
}

#[test]
fn a_wait_runs_out_of_time_as_a_timeout() {
    // Every permit taken: the lookup waits on the runtime, and a wait that runs out is a
    // Timeout, not a hang; freed, it answers.
    let tier = open("memory://");
    let (rt, ctx) = tier.client().unwrap();
    let held = rt.block_on(ctx.lookups.clone().acquire_many_owned(LOOKUPS_AT_ONCE as u32)).unwrap();
    let handle = tier.submit_lookup_chain(chain("c", 3)).unwrap();
    let err = handle.wait(Some(Duration::from_millis(50))).unwrap_err();
    assert!(matches!(err, ObjectError::Timeout(_)), "{err}");
    assert!(!handle.done(), "waiting for a permit: not answered");
    drop(held);
    assert_eq!(handle.wait(WAIT).unwrap(), Answer::Matched(0));
}
