//! The object-store tier: KV blocks as objects in S3-compatible storage, GCS, Azure, a local
//! directory or memory, through the `object_store` crate. Batches have the block store's shape
//! (`store::Batch` of per-block `BlockResult`s) and run on the tier's own per-process runtime
//! (`runtime`), at most `concurrency` requests at once. The first writer of a key wins
//! (conditional create); a key the tier already knows exists is not uploaded again.

mod block_tier;
mod chain;
mod chain_put;
mod claim;
pub mod codec;
pub mod config;
pub mod error;
mod fan_out;
pub mod gc;
mod gc_plan;
pub mod gc_schedule;
mod known;
pub mod lookup_task;
pub mod manifest;
mod ops;
mod probe;
pub mod runtime;
pub mod stats;
mod stream_decode;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures::stream::{self, StreamExt};
use hashlink::LinkedHashMap;
use object_store::path::Path;
use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;

pub use config::{Backend, ObjectConfig};
pub use error::{ObjectError, Result};

use self::fan_out::fan_out;
use self::known::KnownKeys;
use self::ops::Ctx;
use self::stats::{bump, ObjectStats};
use crate::compression::Compression;
use crate::format::MAX_KEY_LEN;
use crate::hashing::HashAlgo;
use crate::tier::{Batch, BlockResult, Keepalive, RawBuf, StatValue, StatsSnapshot, Status};

/// The client of one process: rebuilt when a forked child first uses the tier.
struct Client {
    pid: u32,
    rt: Arc<Runtime>,
    ctx: Ctx,
}

/// What the tier's batches, running on the runtime, share with it.
pub struct Shared {
    cfg: ObjectConfig,
    prefix: Path,
    /// Block keys known to be stored (a put of one sends nothing).
    known: Mutex<KnownKeys>,
    /// Manifests (by their segment's last key) known to be stored.
    manifests: Mutex<KnownKeys>,
    /// When this process last recorded a manifest's use.
    touched: Mutex<LinkedHashMap<Vec<u8>, Instant>>,
    stats: Arc<ObjectStats>,
}

pub struct ObjectTier {
    backend: Backend,
    client: Mutex<Option<Client>>,
    shared: Arc<Shared>,
    closed: AtomicBool,
    /// The background GC task, if started (`gc_schedule`).
    gc_task: Mutex<Option<gc_schedule::GcTask>>,
}

impl std::ops::Deref for ObjectTier {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

fn hex_name(key: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut name = String::with_capacity(key.len() * 2);
    for &b in key {
        name.push(HEX[(b >> 4) as usize] as char);
        name.push(HEX[(b & 15) as usize] as char);
    }
    name
}

/// Object names are the key in hex under `<prefix>/b/`: any byte string is a valid name.
fn object_path(prefix: &Path, key: &[u8]) -> Path {
    prefix.clone().join("b").join(hex_name(key))
}

/// One block's object body; zstd is CPU work, so it runs off the runtime's workers (one
/// batch's blocks compress in parallel and requests keep flowing meanwhile).
async fn encode_block(
    key: Vec<u8>,
    buf: RawBuf,
    hash: HashAlgo,
    compression: Compression,
) -> std::result::Result<Vec<u8>, BlockResult> {
    let encode = move || {
        // SAFETY: the submitter keeps the buffer valid until the batch completes, which
        // waits for this encode (an empty buffer may come with a null address: never made a
        // slice).
        let raw: &[u8] = if buf.len == 0 { &[] } else { unsafe { buf.as_slice() } };
        codec::encode(&key, raw, hash, compression)
    };
    match compression {
        Compression::None => Ok(encode()),
        Compression::Zstd { .. } => tokio::task::spawn_blocking(encode)
            .await
            .map_err(|e| BlockResult::failed(Status::IoError, format!("encode: {e}"))),
    }
}

impl ObjectTier {
    /// Build the client and, for a remote store, prove with one request that the endpoint,
    /// bucket and credentials work (a wrong secret fails here, naming the endpoint).
    pub fn open(cfg: ObjectConfig) -> Result<Self> {
        let built = config::build(&cfg)?;
        let tier = ObjectTier {
            backend: built.backend,
            client: Mutex::new(None),
            shared: Arc::new(Shared {
                prefix: built.prefix,
                cfg,
                known: Mutex::default(),
                manifests: Mutex::default(),
                touched: Mutex::default(),
                stats: Arc::new(ObjectStats::default()),
            }),
            closed: AtomicBool::new(false),
            gc_task: Mutex::new(None),
        };
        *tier.client.lock() = Some(tier.make_client(Some(built.store))?);
        if tier.backend.is_remote() {
            tier.probe()?;
        }
        Ok(tier)
    }

    fn make_client(&self, store: Option<Arc<dyn object_store::ObjectStore>>) -> Result<Client> {
        let (rt, fresh) = runtime::runtime()?;
        if fresh {
            bump(&self.stats.runtime_builds, 1);
        }
        let store = match store {
            Some(s) => s,
            // A memory store lives in this process only: a child keeps the parent's copy.
            None => config::build(&self.cfg)?.store,
        };
        let ctx = Ctx {
            store,
            permits: Arc::new(Semaphore::new(self.cfg.concurrency)),
            lookups: Arc::new(Semaphore::new(lookup_task::LOOKUPS_AT_ONCE)),
            stats: self.stats.clone(),
            budget: self.cfg.block_budget(),
            target: self.cfg.target().into(),
            secret: self.cfg.secret_access_key.as_deref().map(Arc::from),
            inflight: Arc::default(),
        };
        Ok(Client { pid: std::process::id(), rt, ctx })
    }

    /// This process's runtime and request context (a forked child builds its own: sockets and
    /// runtime threads are not shared across fork).
    fn client(&self) -> Result<(Arc<Runtime>, Ctx)> {
        if self.closed.load(Ordering::Acquire) {
            return Err(ObjectError::Closed);
        }
        let mut slot = self.client.lock();
        let pid = std::process::id();
        if slot.as_ref().is_some_and(|c| c.pid != pid) {
            let inherited = slot.take();
            let keep =
                inherited.as_ref().filter(|_| self.backend == Backend::Memory).map(|c| c.ctx.store.clone());
            // Leaked: its connection pool belongs to the parent's runtime.
            std::mem::forget(inherited);
            *slot = Some(self.make_client(keep)?);
        }
        let c = slot.as_ref().ok_or(ObjectError::Closed)?;
        Ok((c.rt.clone(), c.ctx.clone()))
    }

    pub fn config(&self) -> &ObjectConfig {
        &self.cfg
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn prefix(&self) -> &str {
        self.prefix.as_ref()
    }

    fn check_key(key: &[u8]) -> Option<BlockResult> {
        (key.is_empty() || key.len() > MAX_KEY_LEN).then(|| {
            BlockResult::failed(
                Status::Rejected,
                format!("key of {} bytes (1..={MAX_KEY_LEN} accepted)", key.len()),
            )
        })
    }

    /// Upload the blocks; a key known to exist is "deduped" without a request, a key another
    /// writer created first is "deduped" too (its conditional create was refused).
    pub fn submit_put(
        &self,
        items: Vec<(Vec<u8>, RawBuf)>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>> {
        self.spawn_batch(items.len(), keepalive, move |ctx, shared| async move {
            shared.put_blocks(&ctx, items).await
        })
    }

    /// Run `work` on the tier's runtime as one batch of `n` blocks: the batch completes with
    /// the results it returns, and `close` waits for it (the in-flight guard).
    fn spawn_batch<W, F>(&self, n: usize, keepalive: Option<Keepalive>, work: W) -> Result<Arc<Batch>>
    where
        W: FnOnce(Ctx, Arc<Shared>) -> F,
        F: std::future::Future<Output = Vec<Option<BlockResult>>> + Send + 'static,
    {
        let (rt, ctx) = self.client()?;
        let batch = Arc::new(Batch::new(n, keepalive));
        let done = batch.clone();
        let running = ctx.inflight.enter();
        let work = work(ctx, self.shared.clone());
        rt.spawn(async move {
            done.complete(finish(work.await));
            drop(running);
        });
        Ok(batch)
    }

    /// Download, verify and copy the blocks into the caller's buffers.
    pub fn submit_get(
        &self,
        items: Vec<(Vec<u8>, RawBuf)>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>> {
        let prefix = self.prefix.clone();
        self.spawn_batch(items.len(), keepalive, move |ctx, shared| async move {
            let n = items.len();
            // Every get is spawned at once and waits for its permit (`Ctx::bounded`): a freed
            // permit goes straight to the next get, not through this task. A get holds no
            // memory of its own before its permit (the body goes into the caller's buffer).
            let mut gets = fan_out(items.into_iter().enumerate(), n, |(i, (key, buf))| {
                let ctx = ctx.clone();
                let path = object_path(&prefix, &key);
                async move {
                    let r = match Self::check_key(&key) {
                        Some(r) => r,
                        None => ctx.get(path, &key, buf).await,
                    };
                    (i, key, r)
                }
            });
            let mut results: Vec<Option<BlockResult>> = vec![None; n];
            while let Some((i, key, r)) = gets.next().await {
                if r.status == Status::Ok {
                    shared.known.lock().insert(key);
                }
                results[i] = Some(r);
            }
            results
        })
    }

    /// Whether each key is stored: known keys answer locally, the rest with one HEAD each (at
    /// most `concurrency` at once). A key that could not be checked counts as absent.
    pub fn contains_many(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>> {
        let (rt, ctx) = self.client()?;
        self.age_out();
        let mut answers: Vec<Option<bool>> = {
            let known = self.known.lock();
            keys.iter().map(|k| known.contains(k).then_some(true)).collect()
        };
        let ask: Vec<usize> = (0..keys.len()).filter(|&i| answers[i].is_none()).collect();
        let width = self.cfg.concurrency;
        let prefix = &self.prefix;
        let found: Vec<(usize, bool)> = rt.block_on(async {
            stream::iter(ask)
                .map(|i| {
                    let ctx = ctx.clone();
                    let path = object_path(prefix, &keys[i]);
                    async move {
                        match ctx.exists(path).await {
                            Ok(b) => (i, b),
                            Err(msg) => {
                                bump(&ctx.stats.io_errors, 1);
                                tracing::warn!("object tier lookup failed: {msg}");
                                (i, false)
                            }
                        }
                    }
                })
                .buffer_unordered(width)
                .collect()
                .await
        });
        let mut known = self.known.lock();
        for (i, present) in found {
            if present {
                known.insert(keys[i].clone());
            }
            answers[i] = Some(present);
        }
        Ok(answers.into_iter().map(|a| a.unwrap_or(false)).collect())
    }

    /// Delete the objects of `keys` (absent ones are fine); returns how many were deleted or
    /// already absent. The first failure is returned after every key was tried.
    pub fn delete(&self, keys: &[Vec<u8>]) -> Result<usize> {
        let (rt, ctx) = self.client()?;
        {
            let mut known = self.known.lock();
            for k in keys {
                known.remove(k);
            }
        }
        let width = self.cfg.concurrency;
        let prefix = &self.prefix;
        let outcomes: Vec<std::result::Result<(), String>> = rt.block_on(async {
            stream::iter(keys.iter().map(|k| ctx.delete(object_path(prefix, k))))
                .buffer_unordered(width)
                .collect()
                .await
        });
        let ok = outcomes.iter().filter(|o| o.is_ok()).count();
        match outcomes.into_iter().find_map(|o| o.err()) {
            Some(msg) => Err(ObjectError::Request(msg)),
            None => Ok(ok),
        }
    }

    /// Nothing is evicted by the tier itself (collection is a separate pass).
    pub fn drain_evicted(&self) -> Vec<Vec<u8>> {
        Vec::new()
    }

    pub fn stats(&self) -> StatsSnapshot {
        let mut out = vec![
            ("backend", StatValue::Text(self.backend.name().into())),
            ("concurrency", StatValue::Int(self.cfg.concurrency as u64)),
            ("known_keys", StatValue::Int(self.known.lock().len() as u64)),
        ];
        out.extend(self.stats.snapshot());
        out
    }

    /// No more batches; returns once this process's batches and started lookups in flight have
    /// finished (each request is bounded by the block budget).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let gc = self.gc_task.lock().take();
        if let Some(task) = gc {
            task.stop();
        }
        let ctx = self.client.lock().as_ref().filter(|c| c.pid == std::process::id()).map(|c| c.ctx.clone());
        if let Some(ctx) = ctx {
            // Lookups still waiting for a permit answer `Closed` instead of starting.
            ctx.lookups.close();
            ctx.inflight.wait_idle();
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

fn finish(results: Vec<Option<BlockResult>>) -> Vec<BlockResult> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| BlockResult::failed(Status::IoError, "block was never run")))
        .collect()
}

#[cfg(test)]
mod chain_tests;
#[cfg(test)]
mod lookup_task_tests;
