//! Budget and garbage collection of one bucket prefix, safe while other workers read and
//! write it; plus the inventory `flexkv-py inspect` prints and the lease that lets one worker
//! of a fleet run the collection in the background.
//!
//! Protocol (every writer and GC agree on it):
//! - a writer stores a segment's blocks, then its manifest; a manifest's last use is the
//!   newer of its own time and its touch object's (lookups touch the deepest manifest they
//!   used, at most once per `touch_interval`);
//! - a manifest is live while used within `ttl`, and so is every ancestor of a live one
//!   (parent links): a live manifest's blocks and ancestors are never deleted;
//! - over the byte budget, whole chain tails go first: manifests by the latest use of
//!   themselves or any descendant, oldest first, deepest first on ties;
//! - blocks no live manifest lists are deleted once older than `grace` (a writer uploads a
//!   segment's blocks and writes its manifest within that time);
//! - before deleting, GC lists the manifests and touches again and keeps whatever was written
//!   or used meanwhile (and its ancestors). Deletions go deepest manifest first, blocks last.
//!   A use that lands between that second listing and a delete is a miss later (the load of
//!   a deleted block fails and is recomputed), never wrong KV;
//! - so is a manifest a writer writes in that window over blocks it found stored (it
//!   reuses them, they are not fresh): the pass still deletes them. The next pass finds such a
//!   manifest (older than `grace`, naming a block or parent that is gone) and deletes it and its
//!   descendants (`gc_plan::dangling`): a broken chain costs misses until then, never a hit
//!   that every load fails forever.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::stream::{self, StreamExt};
use object_store::path::Path;
use object_store::ObjectMeta;

use super::error::{ObjectError, Result};
use super::gc_plan::{closure, dangling, fit_budget, hex};
use super::manifest::Manifest;
use super::ops::Ctx;
use super::ObjectTier;

#[derive(Clone, Debug)]
pub struct GcOptions {
    pub ttl: Duration,
    pub grace: Duration,
    pub budget_bytes: Option<u64>,
    pub dry_run: bool,
}

#[derive(Clone, Debug, Default)]
pub struct GcReport {
    pub manifests: u64,
    pub manifests_live: u64,
    pub manifests_deleted: u64,
    pub manifests_rescued: u64,
    pub manifests_dangling: u64,
    pub blocks: u64,
    pub blocks_deleted: u64,
    pub block_bytes: u64,
    pub block_bytes_deleted: u64,
    pub touches_deleted: u64,
    pub claims_deleted: u64,
    pub delete_errors: u64,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// The last path segment (a hex key) of each object under `dir`, with its metadata.
fn by_name(list: Vec<ObjectMeta>) -> HashMap<String, ObjectMeta> {
    list.into_iter().filter_map(|m| m.location.filename().map(str::to_string).map(|n| (n, m))).collect()
}

/// A manifest that could not be read may be live: the blocks it lists and its ancestors would
/// look unreferenced, and deleting them would leave a live manifest naming deleted blocks. So
/// the pass deletes nothing (the next one tries again).
fn refuse_unread(unreadable: u64) -> std::result::Result<(), String> {
    if unreadable == 0 {
        return Ok(());
    }
    Err(format!(
        "GC pass deleted nothing: {unreadable} manifest(s) could not be read (server slow or failing)"
    ))
}

struct Listing {
    manifests: HashMap<String, ObjectMeta>,
    touches: HashMap<String, ObjectMeta>,
}

impl ObjectTier {
    fn dir(&self, name: &str) -> Path {
        self.prefix.clone().join(name)
    }

    async fn listing(&self, ctx: &Ctx) -> std::result::Result<Listing, String> {
        Ok(Listing {
            manifests: by_name(ctx.list(&self.dir("m")).await?),
            touches: by_name(ctx.list(&self.dir("t")).await?),
        })
    }

    /// The manifests' bodies (a damaged one is left out: garbage; one gone since the listing
    /// too), and how many could not be read at all (an error or a timeout: a slow server).
    async fn read_manifests(&self, ctx: &Ctx, names: Vec<String>) -> (HashMap<String, Manifest>, u64) {
        let dir = self.dir("m");
        let got: Vec<(String, std::result::Result<Option<bytes::Bytes>, String>)> = stream::iter(names)
            .map(|n| {
                let path = dir.clone().join(n.as_str());
                async move { (n, ctx.get_small(&path).await) }
            })
            .buffer_unordered(self.cfg.concurrency)
            .collect()
            .await;
        let mut unreadable = 0;
        let mut bodies = HashMap::with_capacity(got.len());
        for (n, body) in got {
            match body {
                Ok(Some(body)) => {
                    if let Some(m) = Manifest::decode(&body) {
                        bodies.insert(n, m);
                    }
                }
                Ok(None) => {}
                Err(_) => unreadable += 1,
            }
        }
        (bodies, unreadable)
    }

    /// One collection pass (see the module's protocol).
    pub fn gc(&self, opts: &GcOptions) -> Result<GcReport> {
        let (rt, ctx) = self.client()?;
        rt.block_on(self.gc_async(&ctx, opts)).map_err(ObjectError::Request)
    }

    pub(super) async fn gc_async(
        &self,
        ctx: &Ctx,
        opts: &GcOptions,
    ) -> std::result::Result<GcReport, String> {
        let mut report = GcReport::default();
        let first = self.listing(ctx).await?;
        let blocks = by_name(ctx.list(&self.dir("b")).await?);
        let now = now_ms();
        let (mut bodies, unreadable) =
            self.read_manifests(ctx, first.manifests.keys().cloned().collect()).await;
        refuse_unread(unreadable)?;
        let last_use = |name: &str, l: &Listing| -> i64 {
            let own = l.manifests.get(name).map_or(0, |m| m.last_modified.timestamp_millis());
            let touched = l.touches.get(name).map_or(0, |m| m.last_modified.timestamp_millis());
            own.max(touched)
        };
        report.manifests = first.manifests.len() as u64;
        report.blocks = blocks.len() as u64;
        report.block_bytes = blocks.values().map(|m| m.size).sum();
        let (ttl, grace) = (opts.ttl.as_millis() as i64, opts.grace.as_millis() as i64);
        let broken = dangling(&bodies, &first.manifests, &blocks, now, grace);
        let roots: Vec<String> = bodies
            .keys()
            .filter(|n| !broken.contains(*n) && now - last_use(n, &first) < ttl)
            .cloned()
            .collect();
        let mut live = closure(&bodies, roots);
        if let Some(budget) = opts.budget_bytes {
            let uses: HashMap<String, i64> = live.iter().map(|n| (n.clone(), last_use(n, &first))).collect();
            fit_budget(&bodies, &mut live, &uses, &blocks, budget);
        }
        // Second look: whatever was written or used since the first listing stays.
        let second = self.listing(ctx).await?;
        let fresh: Vec<String> = second
            .manifests
            .keys()
            .filter(|n| !first.manifests.contains_key(*n) || last_use(n, &second) > last_use(n, &first))
            .cloned()
            .collect();
        let unread: Vec<String> = fresh.iter().filter(|n| !bodies.contains_key(*n)).cloned().collect();
        let (late, unreadable) = self.read_manifests(ctx, unread).await;
        refuse_unread(unreadable)?;
        bodies.extend(late);
        let mut rescued = closure(&bodies, fresh);
        // A broken manifest only touched since stays broken; one written again is judged anew
        // by the next pass.
        let own = |n: &str, l: &Listing| l.manifests.get(n).map(|m| m.last_modified);
        let still_broken: HashSet<&String> =
            broken.iter().filter(|n| own(n, &second).map_or(true, |t| Some(t) == own(n, &first))).collect();
        rescued.retain(|n| !still_broken.contains(n));
        report.manifests_dangling = still_broken.len() as u64;
        report.manifests_rescued = rescued.difference(&live).count() as u64;
        live.extend(rescued);
        report.manifests_live = live.len() as u64;
        let referenced: HashSet<String> =
            live.iter().filter_map(|n| bodies.get(n)).flat_map(|m| m.keys.iter().map(|k| hex(k))).collect();
        // Deepest first, so a concurrent lookup never finds a manifest above a deleted one.
        let mut doomed: Vec<(u64, String)> = second
            .manifests
            .keys()
            .filter(|n| !live.contains(*n))
            .filter(|n| bodies.contains_key(*n) || now - last_use(n, &second) > grace)
            .map(|n| (bodies.get(n).map_or(u64::MAX, |m| m.start), n.clone()))
            .collect();
        doomed.sort_by(|a, b| b.cmp(a));
        let dead_blocks: Vec<(&String, &ObjectMeta)> = blocks
            .iter()
            .filter(|(n, m)| !referenced.contains(*n) && now - m.last_modified.timestamp_millis() > grace)
            .collect();
        report.manifests_deleted = doomed.len() as u64;
        report.blocks_deleted = dead_blocks.len() as u64;
        report.block_bytes_deleted = dead_blocks.iter().map(|(_, m)| m.size).sum();
        let stale_touches: Vec<Path> = second
            .touches
            .iter()
            .filter(|(n, m)| {
                let gone = doomed.iter().any(|(_, d)| d == *n);
                gone || (!second.manifests.contains_key(*n)
                    && now - m.last_modified.timestamp_millis() > grace)
            })
            .map(|(_, m)| m.location.clone())
            .collect();
        report.touches_deleted = stale_touches.len() as u64;
        // Upload claims outlive their use by far after `grace` (a claim's lease is the time of
        // one segment's uploads); a loser never trusts one without the manifest, so a claim
        // deleted early costs at most a duplicate upload.
        let stale_claims: Vec<Path> = ctx
            .list(&self.dir("c"))
            .await?
            .into_iter()
            .filter(|m| now - m.last_modified.timestamp_millis() > grace)
            .map(|m| m.location)
            .collect();
        report.claims_deleted = stale_claims.len() as u64;
        if opts.dry_run {
            return Ok(report);
        }
        // Manifests level by level (deepest first), then touches, then blocks.
        let mut start = 0;
        while start < doomed.len() {
            let level = doomed[start].0;
            let end =
                doomed[start..].iter().position(|(s, _)| *s != level).map_or(doomed.len(), |p| start + p);
            let paths = doomed[start..end].iter().map(|(_, n)| self.dir("m").join(n.as_str())).collect();
            report.delete_errors += self.delete_paths(ctx, paths).await;
            start = end;
        }
        report.delete_errors += self.delete_paths(ctx, stale_touches).await;
        report.delete_errors += self.delete_paths(ctx, stale_claims).await;
        let block_paths = dead_blocks.iter().map(|(_, m)| m.location.clone()).collect();
        report.delete_errors += self.delete_paths(ctx, block_paths).await;
        Ok(report)
    }

    /// Deletes at most `concurrency` at once; returns how many failed.
    async fn delete_paths(&self, ctx: &Ctx, paths: Vec<Path>) -> u64 {
        stream::iter(paths)
            .map(|p| ctx.delete(p))
            .buffer_unordered(self.cfg.concurrency)
            .filter(|r| futures::future::ready(r.is_err()))
            .count()
            .await as u64
    }

    /// Counts and bytes of what the prefix holds, by kind (b: blocks, m: manifests, t: touch
    /// objects, c: upload claims, other), and the GC lease's holder.
    pub fn inventory(&self) -> Result<Vec<(String, u64)>> {
        let (rt, ctx) = self.client()?;
        rt.block_on(async {
            let all = ctx.list(&self.prefix).await.map_err(ObjectError::Request)?;
            let mut out: HashMap<String, u64> = HashMap::new();
            for m in &all {
                let rel: Vec<_> = m.location.prefix_match(&self.prefix).into_iter().flatten().collect();
                let kind = match rel.first().map(|p| p.as_ref()) {
                    Some("b") if rel.len() == 2 => "blocks",
                    Some("m") if rel.len() == 2 => "manifests",
                    Some("t") if rel.len() == 2 => "touches",
                    Some("c") if rel.len() == 2 => "claims",
                    Some(LEASE) if rel.len() == 1 => "lease",
                    _ => "other",
                };
                *out.entry(kind.to_string()).or_default() += 1;
                *out.entry(format!("{kind}_bytes")).or_default() += m.size;
            }
            let mut v: Vec<(String, u64)> = out.into_iter().collect();
            v.sort();
            Ok(v)
        })
    }

    /// Take or renew the GC lease for `lease` (one small object; a holder past its expiry is
    /// replaced). `true`: this holder may run GC now. Two holders at once (a takeover race)
    /// only means two collections, which the protocol allows.
    pub fn try_gc_lease(&self, holder: &str, lease: Duration) -> Result<bool> {
        let (rt, ctx) = self.client()?;
        rt.block_on(self.gc_lease_async(&ctx, holder, lease))
    }

    pub(super) async fn gc_lease_async(&self, ctx: &Ctx, holder: &str, lease: Duration) -> Result<bool> {
        let path = self.prefix.clone().join(LEASE);
        let body = format!("{holder}\n{}", now_ms() + lease.as_millis() as i64).into_bytes();
        let current = ctx.get_small(&path).await.map_err(ObjectError::Request)?;
        let take = match current.as_deref().map(String::from_utf8_lossy) {
            None => ctx.put_small(&path, body, true).await,
            Some(text) => {
                let (who, until) = text.split_once('\n').unwrap_or(("", "0"));
                if who == holder {
                    ctx.put_small(&path, body, false).await
                } else if until.trim().parse::<i64>().unwrap_or(0) < now_ms() {
                    ctx.delete(path.clone()).await.map_err(ObjectError::Request)?;
                    ctx.put_small(&path, body, true).await
                } else {
                    Ok(false)
                }
            }
        };
        take.map_err(ObjectError::Request)
    }
}

const LEASE: &str = "gc-lease";
