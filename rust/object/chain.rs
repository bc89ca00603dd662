//! Prefix chains: lookups through segment manifests (`manifest`) instead of one HEAD per
//! block, and chain puts that write those manifests after their blocks.
//!
//! A lookup of `n` keys asks, in order: the manifest of the chain's end (the prompt seen
//! before: 1 request), then a binary search over the full segments' manifests, then a binary
//! search by HEAD over the blocks of the first segment without a manifest (a chain that
//! ended inside it stored them under an end manifest this lookup cannot name), then, unless
//! a manifest vouches for the answer (the end manifest of a chain that ended there, or the one
//! named by the segment's upload claim: the chain this one branched from), one round of HEADs
//! confirming the blocks below that answer it did not ask about (a racing writer's uploads
//! land in any order). A new prompt pays at most `1 + log2(n / SEGMENT + 1) + log2(SEGMENT)`
//! requests in sequence, plus, for a hit that ends inside a segment, 2 rounds of GETs and at
//! worst up to `SEGMENT - 1` HEADs at once. The HEAD search's first round also asks the
//! segment's first block, so a miss costs `1 + log2(n / SEGMENT + 1) + 2` requests even while
//! a writer's uploads race it. The manifest search assumes a chain's stored segments form a prefix
//! (writers store a chain's blocks before its manifests, GC deletes deepest first); where a
//! fault broke that, the load of a missing block fails and is recomputed — every read is
//! verified, so never wrong KV.

use std::sync::Arc;
use std::time::Instant;

use futures::stream::{self, StreamExt};
use object_store::path::Path;

use super::claim::{claim_path, Claim};
use super::error::Result;
use super::fan_out::fan_out;
use super::manifest::{self, Manifest, SEGMENT};
use super::ops::Ctx;
use super::stats::bump;
use super::{hex_name, object_path, ObjectTier, Shared};
use crate::hashing::HashAlgo;
use crate::tier::batch::Keepalive;
use crate::tier::{Batch, BlockResult, RawBuf, Status};

/// Manifests whose last use this process remembers recording.
const TOUCHED_CAP: usize = 1 << 16;

pub fn manifest_path(prefix: &Path, end_key: &[u8]) -> Path {
    prefix.clone().join("m").join(hex_name(end_key))
}

pub fn touch_path(prefix: &Path, end_key: &[u8]) -> Path {
    prefix.clone().join("t").join(hex_name(end_key))
}

/// What one lookup found: blocks matched, and of those how many are vouched for by manifests
/// (a later put skips those), the deepest manifest of this chain used, and another chain's
/// manifest that vouched for the blocks past it (the uses of both are recorded).
struct Found {
    matched: usize,
    by_manifest: usize,
    deepest: Option<usize>,
    vouched_by: Option<Vec<u8>>,
}

/// Whether the manifest of the segment ending at `end` is stored and describes `keys`. A
/// request that failed is an error: the lookup stops there (a miss beyond, never a wait per
/// block on a dead server).
async fn has_manifest(
    ctx: &Ctx,
    prefix: &Path,
    keys: &[Vec<u8>],
    end: usize,
) -> std::result::Result<bool, ()> {
    match ctx.get_small(&manifest_path(prefix, &keys[end])).await {
        Ok(Some(body)) => Ok(Manifest::decode(&body)
            .is_some_and(|m| m.matches(keys) && m.start as usize + m.keys.len() == end + 1)),
        Ok(None) => Ok(false),
        Err(msg) => {
            bump(&ctx.stats.io_errors, 1);
            tracing::warn!("object tier chain lookup failed: {msg}");
            Err(())
        }
    }
}

async fn lookup(ctx: &Ctx, prefix: &Path, keys: &[Vec<u8>]) -> Found {
    let n = keys.len();
    let mut found = Found { matched: 0, by_manifest: 0, deepest: None, vouched_by: None };
    if n == 0 {
        return found;
    }
    bump(&ctx.stats.chain_lookups, 1);
    match has_manifest(ctx, prefix, keys, n - 1).await {
        Ok(true) => return Found { matched: n, by_manifest: n, deepest: Some(n - 1), vouched_by: None },
        Ok(false) => {}
        Err(()) => return found,
    }
    // Full segments below the chain's end: index i ends at position (i + 1) * SEGMENT - 1.
    let full = (n - 1) / SEGMENT;
    let (mut lo, mut hi) = (0usize, full); // segments 0..lo are stored; hi.. are not
    while lo < hi {
        let mid = (lo + hi).div_ceil(2); // test segment index mid - 1
        match has_manifest(ctx, prefix, keys, mid * SEGMENT - 1).await {
            Ok(true) => lo = mid,
            Ok(false) => hi = mid - 1,
            Err(()) => {
                found.matched = lo * SEGMENT;
                found.by_manifest = lo * SEGMENT;
                found.deepest = lo.checked_sub(1).map(|s| (s + 1) * SEGMENT - 1);
                return found;
            }
        }
    }
    found.matched = lo * SEGMENT;
    found.by_manifest = lo * SEGMENT;
    found.deepest = lo.checked_sub(1).map(|s| (s + 1) * SEGMENT - 1);
    // Blocks of the next segment: the largest stored position, by HEAD.
    let start = found.matched;
    let (mut have, mut limit) = (start, n.min(start + SEGMENT));
    let mut seen = Vec::new();
    // The segment's first block is asked in the search's first round too: a miss (it is
    // missing) ends there, where a racing writer's out-of-order uploads further in would
    // otherwise lead the search on and cost a round of confirming HEADs.
    let mut first_round = true;
    while have < limit {
        let mid = (have + limit).div_ceil(2) - 1; // test position mid
        let asked = if std::mem::take(&mut first_round) && mid > start {
            let (head, at_mid) = futures::future::join(
                ctx.exists(object_path(prefix, &keys[start])),
                ctx.exists(object_path(prefix, &keys[mid])),
            )
            .await;
            match head {
                Ok(true) => {
                    seen.push(start);
                    have = start + 1;
                    at_mid
                }
                Ok(false) => break, // a miss: nothing of this segment is stored
                Err(msg) => Err(msg),
            }
        } else {
            ctx.exists(object_path(prefix, &keys[mid])).await
        };
        match asked {
            Ok(true) => {
                seen.push(mid);
                have = mid + 1;
            }
            Ok(false) => limit = mid,
            Err(msg) => {
                bump(&ctx.stats.io_errors, 1);
                tracing::warn!("object tier chain lookup failed: {msg}");
                break;
            }
        }
    }
    // A search that reached its limit ended on the chain's end or a segment's end: the
    // manifest there, the one that could vouch, was asked above and was not stored.
    let vouch = have < n.min(start + SEGMENT);
    (found.matched, found.vouched_by) = confirmed_prefix(ctx, prefix, keys, start, have, &seen, vouch).await;
    found
}

/// The search above assumes the segment's stored blocks form a prefix, which a writer's
/// uploads in flight break (a segment's blocks go up at once, in any order, before its
/// manifest). Before asking the positions `start..have` it did not ask about, a manifest that
/// lists them vouches: where `vouch`, the end manifest of a chain that ended at the answer
/// (the turn before this one); else the manifest named by the segment's upload claim (`claim`:
/// the writer whose chain this one branched from, e.g. a shared document's, wrote it after
/// its blocks). Both GETs go at once, then the claim's manifest: 2 rounds, not a HEAD per
/// block. Failing those, the unasked positions are asked at once by HEAD (up to `SEGMENT -
/// 1`) and the answer ends at the first one missing (or failing). Nothing for a miss or a hit
/// that ends on a manifest. Returns the answer and the manifest that vouched for it, if one
/// but the chain's own did (its use is recorded too).
async fn confirmed_prefix(
    ctx: &Ctx,
    prefix: &Path,
    keys: &[Vec<u8>],
    start: usize,
    have: usize,
    seen: &[usize],
    vouch: bool,
) -> (usize, Option<Vec<u8>>) {
    let unasked: Vec<usize> = (start..have).filter(|p| !seen.contains(p)).collect();
    if unasked.is_empty() {
        return (have, None);
    }
    let at_answer = async { vouch && has_manifest(ctx, prefix, keys, have - 1).await == Ok(true) };
    // An answer on the segment's end: the manifest there, the one a claim would name, was
    // asked by the segment search and was not stored.
    let by_claim = async {
        match have < start + SEGMENT {
            true => claim_manifest(ctx, prefix, keys, start, have, vouch).await,
            false => None,
        }
    };
    let (ends_here, claimed) = futures::future::join(at_answer, by_claim).await;
    if ends_here {
        return (have, None);
    }
    if let Some(end_key) = claimed {
        bump(&ctx.stats.chain_claim_vouches, 1);
        return (have, Some(end_key));
    }
    bump(&ctx.stats.chain_confirm_heads, unasked.len() as u64);
    let missing: Vec<usize> = stream::iter(unasked)
        .map(|p| async move { (p, ctx.exists(object_path(prefix, &keys[p])).await) })
        .buffer_unordered(SEGMENT)
        .filter_map(|(p, r)| futures::future::ready(matches!(r, Ok(false) | Err(_)).then_some(p)))
        .collect()
        .await;
    match missing.into_iter().min() {
        Some(first) => {
            bump(&ctx.stats.chain_confirm_cuts, 1);
            (first, None)
        }
        None => (have, None),
    }
}

/// The name of a stored manifest listing `keys[start..have]`, found through the upload claim
/// named by the segment's first key (its holder's blocks through the end of its chain in the
/// segment, the manifest's name being the last). `None` when there is no such claim (GC
/// deletes claims after its grace), it covers less, or its manifest is not (yet) stored, or
/// is the one at the answer (`asked`: the caller asks that one itself, at once).
async fn claim_manifest(
    ctx: &Ctx,
    prefix: &Path,
    keys: &[Vec<u8>],
    start: usize,
    have: usize,
    asked: bool,
) -> Option<Vec<u8>> {
    let body = ctx.get_small(&claim_path(prefix, &keys[start])).await.ok()??;
    let claim = Claim::decode(&body)?;
    if claim.covers(keys, start) < have - start {
        return None;
    }
    let end_key = claim.keys.last().filter(|k| !(asked && **k == keys[have - 1]))?;
    let body = ctx.get_small(&manifest_path(prefix, end_key)).await.ok()??;
    Manifest::decode(&body).filter(|m| m.lists(keys, have)).map(|_| end_key.clone())
}

impl ObjectTier {
    /// How many leading blocks of the chain `keys` (root first) are stored, from manifests; a
    /// failed request ends the lookup (what was matched so far is the answer).
    /// Blocks the caller's thread; `submit_lookup_chain` (`lookup_task`) is the same lookup on
    /// the runtime.
    pub fn lookup_chain(&self, keys: &[Vec<u8>]) -> Result<usize> {
        let (rt, ctx) = self.client()?;
        Ok(rt.block_on(self.shared.lookup_matched(&ctx, keys)))
    }

    /// Upload `items` (blocks of `chain`, root first) like `submit_put`, after learning from the
    /// chain's manifests which blocks are stored (those send nothing), segment by segment under
    /// upload claims (`claim`: a racing writer's blocks are not sent twice), writing the
    /// manifest of every segment whose blocks, and all before them, are stored. The batch
    /// completes after the manifests.
    pub fn submit_put_chain(
        &self,
        chain: Vec<Vec<u8>>,
        items: Vec<(Vec<u8>, RawBuf)>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>> {
        let chain_ok = chain.iter().all(|k| ObjectTier::check_key(k).is_none());
        self.spawn_batch(items.len(), keepalive, move |ctx, tier| async move {
            let prefix = tier.prefix.clone();
            tier.age_out();
            let all_known = {
                let known = tier.known.lock();
                chain.iter().all(|k| known.contains(k))
            };
            if chain_ok && !all_known {
                let found = lookup(&ctx, &prefix, &chain).await;
                tier.touch_found(&ctx, &prefix, &chain, &found).await;
                tier.learn(&chain, &found);
            }
            if chain_ok {
                tier.put_chain(&ctx, &prefix, &chain, items).await
            } else {
                tier.put_blocks(&ctx, items).await
            }
        })
    }
}

impl Shared {
    /// One chain lookup: the manifests asked, the uses recorded, what was found learnt; its
    /// count of leading stored blocks (0 for a chain with an invalid key).
    pub(super) async fn lookup_matched(&self, ctx: &Ctx, keys: &[Vec<u8>]) -> usize {
        if keys.iter().any(|k| ObjectTier::check_key(k).is_some()) {
            return 0;
        }
        let found = lookup(ctx, &self.prefix, keys).await;
        self.touch_found(ctx, &self.prefix, keys, &found).await;
        self.learn(keys, &found);
        found.matched
    }

    /// Drop local knowledge older than `touch_interval` (another process's GC may have
    /// deleted what it says is stored).
    pub(super) fn age_out(&self) {
        self.known.lock().expire(self.cfg.touch_interval);
        self.manifests.lock().expire(self.cfg.touch_interval);
    }

    /// Blocks found are known (a later put skips them); so are the manifests of the segments
    /// found through manifests (the deepest one and, by the write order, every full one
    /// before it).
    fn learn(&self, keys: &[Vec<u8>], found: &Found) {
        let mut known = self.known.lock();
        for k in &keys[..found.matched] {
            known.insert(k.clone());
        }
        let mut have = self.manifests.lock();
        for end in (SEGMENT - 1..found.by_manifest).step_by(SEGMENT) {
            have.insert(keys[end].clone());
        }
        if let Some(end) = found.deepest {
            have.insert(keys[end].clone());
        }
        if let Some(name) = &found.vouched_by {
            have.insert(name.clone());
        }
    }

    /// Record the uses of the manifests a lookup went by, at once.
    async fn touch_found(&self, ctx: &Ctx, prefix: &Path, keys: &[Vec<u8>], found: &Found) {
        let own = async {
            if let Some(end) = found.deepest {
                self.touch(ctx, prefix, &keys[end]).await;
            }
        };
        let other = async {
            if let Some(name) = &found.vouched_by {
                self.touch(ctx, prefix, name).await;
            }
        };
        futures::future::join(own, other).await;
    }

    /// Record a use of the manifest ending at `end_key` (an empty touch object beside it),
    /// at most once per `touch_interval` per process: GC reads its time as the last use.
    async fn touch(&self, ctx: &Ctx, prefix: &Path, end_key: &[u8]) {
        {
            let mut touched = self.touched.lock();
            if touched.get(end_key).is_some_and(|t| t.elapsed() < self.cfg.touch_interval) {
                return;
            }
            // Bounded: the oldest use recorded is forgotten first (it only costs a touch).
            while touched.len() >= TOUCHED_CAP {
                touched.pop_front();
            }
            touched.insert(end_key.to_vec(), Instant::now());
        }
        if let Err(msg) = ctx.put_small(&touch_path(prefix, end_key), Vec::new(), false).await {
            tracing::warn!("object tier could not record a manifest's use: {msg}");
        }
    }

    /// The blocks not known to be stored, uploaded at most `concurrency` at once.
    pub(super) async fn put_blocks(
        &self,
        ctx: &Ctx,
        items: Vec<(Vec<u8>, RawBuf)>,
    ) -> Vec<Option<BlockResult>> {
        let mut results: Vec<Option<BlockResult>> = vec![None; items.len()];
        let mut todo = Vec::new();
        self.age_out();
        {
            let known = self.known.lock();
            for (i, (key, buf)) in items.into_iter().enumerate() {
                if let Some(r) = ObjectTier::check_key(&key) {
                    results[i] = Some(r);
                } else if known.contains(&key) {
                    bump(&self.stats.puts_known, 1);
                    results[i] = Some(BlockResult::new(Status::Deduped, buf.len as u64));
                } else {
                    todo.push((i, key, buf));
                }
            }
        }
        let (hash, compression) = (HashAlgo::Xxh3_128, self.cfg.compression);
        let prefix = &self.prefix;
        let mut puts = fan_out(todo, self.cfg.concurrency, |(i, key, buf)| {
            let (ctx, path) = (ctx.clone(), object_path(prefix, &key));
            async move {
                let r = match super::encode_block(key.clone(), buf, hash, compression).await {
                    Ok(body) => ctx.put(path, body, buf.len as u64).await,
                    Err(r) => r,
                };
                (i, key, r)
            }
        });
        while let Some((i, key, r)) = puts.next().await {
            if r.status.is_ok() {
                self.known.lock().insert(key);
            }
            results[i] = Some(r);
        }
        results
    }

    /// Manifests of the segments of `chain` within its first `stored` positions (all stored)
    /// that this process does not know to exist yet (conditional creates: identical content
    /// from any writer, so the first one wins).
    pub(super) async fn write_manifests(&self, ctx: &Ctx, prefix: &Path, chain: &[Vec<u8>], stored: usize) {
        // Marked known before the PUT, so the segments of one put writing at once never send
        // the same manifest twice; a failed write is forgotten again below.
        let ends: Vec<usize> = {
            let mut have = self.manifests.lock();
            // The chain's own segment ends that are stored (a prefix still growing has no end
            // segment of its own).
            let ends: Vec<usize> = manifest::segment_ends(chain.len())
                .into_iter()
                .filter(|&e| e < stored && !have.contains(&chain[e]))
                .collect();
            for &e in &ends {
                have.insert(chain[e].clone());
            }
            ends
        };
        let written: Vec<(usize, bool)> = stream::iter(ends)
            .map(|end| async move {
                let body = manifest::for_segment(chain, end).encode();
                bump(&ctx.stats.manifest_puts, 1);
                match ctx.put_small(&manifest_path(prefix, &chain[end]), body, true).await {
                    Ok(_) => (end, true),
                    Err(msg) => {
                        bump(&ctx.stats.io_errors, 1);
                        tracing::warn!("object tier could not write a manifest: {msg}");
                        (end, false)
                    }
                }
            })
            .buffer_unordered(self.cfg.concurrency)
            .collect()
            .await;
        let mut have = self.manifests.lock();
        for (end, ok) in written {
            if !ok {
                have.remove(&chain[end]);
            }
        }
    }
}
