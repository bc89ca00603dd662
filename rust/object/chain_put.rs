//! A chain put, segment by segment: each segment's new blocks go up under an upload claim
//! (`claim`), so racing writers of the same prompt send each body once, and each segment's
//! manifest is written as soon as it and every segment before it are stored (a loser waiting
//! on a winner's manifest never waits on its own later segments: no cycle between writers).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use object_store::path::Path;

use super::chain::manifest_path;
use super::claim::{claim_path, Claim};
use super::manifest::{Manifest, SEGMENT};
use super::ops::Ctx;
use super::stats::bump;
use super::{finish, Shared};
use crate::tier::{BlockResult, RawBuf, Status};

/// One block of the put: its index in the batch, chain position, key and buffer.
type Item = (usize, usize, Vec<u8>, RawBuf);

/// Segments in flight at once: one. A segment's blocks go up only once every segment before
/// it is stored and its manifest written, so a block waits for the manifest that references
/// it no longer than its own segment's uploads: GC deletes unreferenced blocks older than its
/// grace, and with two at once a segment's uploads sat unreferenced for as long as the
/// segment before it waited on a racing winner (a lease), and were collected under load.
const SEGMENTS_AT_ONCE: usize = 1;

impl Shared {
    /// Upload `items` (blocks of `chain`, root first), claiming each segment first; write the
    /// chain's manifests as the stored prefix grows. Results by batch index.
    pub(super) async fn put_chain(
        &self,
        ctx: &Ctx,
        prefix: &Path,
        chain: &[Vec<u8>],
        items: Vec<(Vec<u8>, RawBuf)>,
    ) -> Vec<Option<BlockResult>> {
        let mut results: Vec<Option<BlockResult>> = vec![None; items.len()];
        let mut pos: HashMap<&[u8], usize> = HashMap::with_capacity(chain.len());
        for (p, k) in chain.iter().enumerate() {
            pos.entry(k.as_slice()).or_insert(p);
        }
        let (mut segments, mut loose) = (BTreeMap::<usize, Vec<Item>>::new(), Vec::new());
        let mut in_put = vec![false; chain.len()];
        let mut pos_of = vec![usize::MAX; items.len()];
        for (i, (key, buf)) in items.into_iter().enumerate() {
            match pos.get(key.as_slice()).copied() {
                Some(p) => {
                    in_put[p] = true;
                    pos_of[i] = p;
                    segments.entry(p / SEGMENT).or_default().push((i, p, key, buf));
                }
                None => loose.push((i, 0, key, buf)),
            }
        }
        drop(pos);
        self.age_out();
        // Positions below this are stored or in this put: a claim is taken only for a segment
        // this writer will vouch for with a manifest (losers wait for that manifest).
        // What this put knows is stored, by chain position: what was known at its start and
        // what it stores. Its manifests go by this, not by the shared set, which another
        // batch's `age_out` may clear in the middle of the put.
        let stored: parking_lot::Mutex<Vec<bool>> = {
            let known = self.known.lock();
            parking_lot::Mutex::new(
                chain.iter().enumerate().map(|(p, k)| !in_put[p] && known.contains(k)).collect(),
            )
        };
        let vouched = {
            let s = stored.lock();
            (0..chain.len()).take_while(|&p| in_put[p] || s[p]).count()
        };
        let (stored, pos_of) = (&stored, &pos_of);
        let prefix_stored = move |out: &[(usize, BlockResult)]| {
            let mut s = stored.lock();
            for (i, r) in out {
                if r.status.is_ok() && pos_of[*i] != usize::MAX {
                    s[pos_of[*i]] = true;
                }
            }
            s.iter().take_while(|&&b| b).count()
        };
        for (i, r) in self.upload(ctx, loose).await {
            results[i] = Some(r);
        }
        // Each segment's future writes the manifests that became writable as it ends: requests
        // paused in the other segment's future (holding permits) never stand between a
        // manifest and its permit, as they would if this loop wrote them between segments.
        let mut done = stream::iter(segments)
            .map(|(seg, group)| async move {
                let out = self.put_segment(ctx, prefix, chain, seg, group, vouched).await;
                self.write_manifests(ctx, prefix, chain, prefix_stored(&out)).await;
                out
            })
            .buffered(SEGMENTS_AT_ONCE);
        while let Some(seg_results) = done.next().await {
            for (i, r) in seg_results {
                results[i] = Some(r);
            }
        }
        // Nothing else to write when no segment was put (their futures write as they end).
        self.write_manifests(ctx, prefix, chain, prefix_stored(&[])).await;
        results
    }

    /// Plain conditional creates of `todo` (known keys send nothing).
    async fn upload(&self, ctx: &Ctx, todo: Vec<Item>) -> Vec<(usize, BlockResult)> {
        if todo.is_empty() {
            return Vec::new();
        }
        let (idx, items): (Vec<usize>, Vec<_>) = todo.into_iter().map(|(i, _, k, b)| (i, (k, b))).unzip();
        idx.into_iter().zip(finish(self.put_blocks(ctx, items).await)).collect()
    }

    /// The longest a claim for `n` uploads may be held: one request timeout per upload round
    /// (at most `concurrency` requests at once, `SEGMENTS_AT_ONCE` segments at a time), plus one for the
    /// manifest. A holder slowed by retries past it costs a duplicate upload; a dead one keeps
    /// the others waiting this long.
    fn claim_lease(&self, n: usize) -> Duration {
        self.cfg.claim_lease.unwrap_or_else(|| {
            let rounds = (n * SEGMENTS_AT_ONCE).div_ceil(self.cfg.concurrency) as u32;
            self.cfg.timeout * (rounds + 1)
        })
    }

    async fn put_segment(
        &self,
        ctx: &Ctx,
        prefix: &Path,
        chain: &[Vec<u8>],
        seg: usize,
        group: Vec<Item>,
        vouched: usize,
    ) -> Vec<(usize, BlockResult)> {
        let mut out = Vec::new();
        let mut todo: Vec<Item> = Vec::new();
        {
            let known = self.known.lock();
            for item in group {
                if known.contains(&item.2) {
                    bump(&self.stats.puts_known, 1);
                    out.push((item.0, BlockResult::new(Status::Deduped, item.3.len as u64)));
                } else {
                    todo.push(item);
                }
            }
        }
        todo.sort_by_key(|t| t.1);
        let end = ((seg + 1) * SEGMENT).min(chain.len()) - 1;
        if todo.is_empty() || end >= vouched {
            out.extend(self.upload(ctx, todo).await);
            return out;
        }
        // Claims are named from the segment's start, whatever this writer already knows, so a
        // writer whose lookup saw part of a racing winner's uploads still meets its claim. A
        // claim covering only part of ours (an earlier turn that ended inside the segment, or
        // a continuation that parts from ours) hands on to a claim at the first key it lacks.
        let mut at = seg * SEGMENT;
        while !todo.is_empty() {
            let claim = Claim::new(at, chain[at..=end].to_vec(), self.claim_lease(todo.len()));
            let path = claim_path(prefix, &chain[at]);
            let held = match ctx.put_small(&path, claim.encode(), true).await {
                Ok(true) => {
                    bump(&self.stats.claims_won, 1);
                    break;
                }
                Ok(false) => {
                    bump(&self.stats.claims_lost, 1);
                    match ctx.get_small(&path).await {
                        Ok(Some(body)) => Claim::decode(&body),
                        _ => None,
                    }
                }
                Err(msg) => {
                    tracing::warn!("object tier could not claim a segment's upload: {msg}");
                    None
                }
            };
            let Some(held) = held else { break };
            let upto = at + held.covers(chain, at);
            let (covered, rest): (Vec<Item>, Vec<Item>) = todo.into_iter().partition(|t| t.1 < upto);
            out.extend(self.settle(ctx, prefix, chain, &held, upto, covered).await);
            todo = rest;
            if upto == at || upto > end {
                break;
            }
            at = upto;
        }
        out.extend(self.upload(ctx, todo).await);
        out
    }

    /// Blocks another writer's claim covers: "deduped" once its manifest lists them, uploaded
    /// after all when its lease ends without one.
    async fn settle(
        &self,
        ctx: &Ctx,
        prefix: &Path,
        chain: &[Vec<u8>],
        held: &Claim,
        upto: usize,
        covered: Vec<Item>,
    ) -> Vec<(usize, BlockResult)> {
        let Some(end_key) = held.keys.last().filter(|_| !covered.is_empty()) else {
            return self.upload(ctx, covered).await;
        };
        if !self.wait_manifest(ctx, &manifest_path(prefix, end_key), chain, upto, held.wait_left()).await {
            bump(&self.stats.claim_waits_expired, 1);
            return self.upload(ctx, covered).await;
        }
        bump(&self.stats.puts_claimed, covered.len() as u64);
        self.manifests.lock().insert(end_key.clone());
        let mut known = self.known.lock();
        covered
            .into_iter()
            .map(|(i, _, key, buf)| {
                known.insert(key);
                (i, BlockResult::new(Status::Deduped, buf.len as u64))
            })
            .collect()
    }

    /// Poll the claim holder's manifest at `path` (named by its last key) until it lists
    /// `chain`'s positions below `upto`, or `wait` is over (`false`: upload them).
    async fn wait_manifest(
        &self,
        ctx: &Ctx,
        path: &Path,
        chain: &[Vec<u8>],
        upto: usize,
        wait: Duration,
    ) -> bool {
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(20);
        loop {
            bump(&self.stats.claim_polls, 1);
            match ctx.get_small(path).await {
                Ok(Some(body)) => return Manifest::decode(&body).is_some_and(|m| m.lists(chain, upto)),
                Ok(None) => {}
                // A failed poll: keep asking until the deadline (each request is bounded).
                Err(msg) => tracing::warn!("object tier could not read a claimed manifest: {msg}"),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            tokio::time::sleep(pause.min(left)).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }
}
