//! The block store: a crash-safe, content-deduplicated cache of variable-size blocks over one
//! or more directories. Data path per batch: hash (+ compress) → index decision → vectored
//! O_DIRECT I/O on the directory queues → journal append → completion.

pub mod config;
pub mod journal_file;
pub mod stats;

mod by_fingerprint;
mod executor;
mod follow;
mod get;
mod journal;
mod metas;
mod open;
mod put;
mod replay;
mod set_aside;
mod shared;
mod snapshot;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::error::{Result, StoreError};
use crate::format::journal::Record;
use crate::format::MAX_KEY_LEN;

use crate::tier::{Batch, BlockResult, Keepalive, RawBuf, StatsSnapshot, Status};
pub use config::{Durability, StoreConfig};
pub use put::PutExtra;
pub(crate) use shared::{Shared, State};

pub struct BlockStore {
    shared: Arc<Shared>,
    executor: Mutex<Option<Pools>>,
}

/// Batch threads, apart for puts and gets: a put waits on its device writes on its thread, so
/// a slow or stuck device would take every thread of a shared pool and a get (a load waiting
/// to serve a request) would queue behind writes it has nothing to do with.
struct Pools {
    puts: executor::Executor,
    gets: executor::Executor,
}

#[derive(Clone, Copy)]
enum Lane {
    Put,
    Get,
}

/// Keys listed joined (`BlockStore::inventory_joined`): each `width` bytes, oldest write
/// first; `children[i]` extends `parents[i]` (empty unless links were asked for).
#[derive(Default)]
pub struct JoinedKeys {
    pub keys: Vec<u8>,
    pub children: Vec<u8>,
    pub parents: Vec<u8>,
    pub width: usize,
}

impl BlockStore {
    pub fn open(cfg: StoreConfig) -> Result<Self> {
        let batch_threads = cfg.batch_threads;
        let shared = open::open(cfg)?;
        let start = || {
            executor::Executor::new(batch_threads).map_err(|e| StoreError::io("starting batch threads", e))
        };
        let pools = Pools { puts: start()?, gets: start()? };
        Ok(BlockStore { shared: Arc::new(shared), executor: Mutex::new(Some(pools)) })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.shared.cfg
    }

    pub fn io_engine(&self) -> &'static str {
        self.shared.devices.engine_name()
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.shared.devices.capacity_bytes()
    }

    fn check_keys<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) -> Result<()> {
        for k in keys {
            if k.len() > MAX_KEY_LEN {
                return Err(StoreError::Config(format!(
                    "key of {} bytes is longer than the {MAX_KEY_LEN}-byte limit",
                    k.len()
                )));
            }
        }
        Ok(())
    }

    fn spawn(
        &self,
        lane: Lane,
        batch: Arc<Batch>,
        job: impl FnOnce(&Shared) -> Vec<BlockResult> + Send + 'static,
    ) -> Result<()> {
        let shared = self.shared.clone();
        {
            // Checked and counted under the state lock, so `close` (which marks the store
            // closed under it before waiting for in-flight batches) cannot miss this batch.
            let state = shared.state.lock();
            if state.closed {
                return Err(StoreError::Closed);
            }
            shared.begin();
        }
        let task = Box::new(move || {
            let results = job(&shared);
            batch.complete(results);
            shared.end();
        });
        let guard = self.executor.lock();
        let Some(pools) = guard.as_ref() else {
            self.shared.end();
            return Err(StoreError::Closed);
        };
        let executor = match lane {
            Lane::Put => &pools.puts,
            Lane::Get => &pools.gets,
        };
        if executor.spawn(task).is_err() {
            self.shared.end();
            return Err(StoreError::Closed);
        }
        Ok(())
    }

    /// Store blocks. `keepalive` owns the caller memory behind the RawBufs until completion.
    pub fn submit_put(
        &self,
        items: Vec<(Vec<u8>, RawBuf)>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>> {
        self.submit_put_with(items, Vec::new(), keepalive)
    }

    /// `submit_put` with each block's chain parent and metadata (`extras`: one per item, or
    /// empty for none). The metadata is written in the block's header page, in the same write.
    pub fn submit_put_with(
        &self,
        items: Vec<(Vec<u8>, RawBuf)>,
        extras: Vec<PutExtra>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>> {
        if self.shared.cfg.read_only {
            return Err(StoreError::Config("store was opened read-only".into()));
        }
        self.check_keys(items.iter().map(|(k, _)| k.as_slice()))?;
        check_extras(&items, &extras)?;
        self.check_keys(extras.iter().filter_map(|x| x.parent.as_deref()))?;
        let batch = Arc::new(Batch::new(items.len(), keepalive));
        self.spawn(Lane::Put, batch.clone(), move |shared| put::run(shared, &items, &extras))?;
        Ok(batch)
    }

    /// Every stored key with its chain parent (when that is stored too), oldest write first.
    pub fn inventory(&self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let state = self.shared.state.lock();
        let mut out = Vec::with_capacity(state.index.len());
        state
            .index
            .for_each_in_order(|key, _, _, parent| out.push((key.to_vec(), parent.map(<[u8]>::to_vec))));
        out
    }

    /// The metadata stored with each key (one header-page read per key, batched).
    pub fn read_metas(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        self.check_keys(keys.iter().map(Vec::as_slice))?;
        {
            let state = self.shared.state.lock();
            if state.closed {
                return Err(StoreError::Closed);
            }
            self.shared.begin();
        }
        let out = metas::read_metas(&self.shared, keys);
        self.shared.end();
        Ok(out)
    }

    /// Read blocks into caller buffers (each at least the block's length).
    pub fn submit_get(
        &self,
        items: Vec<(Vec<u8>, RawBuf)>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>> {
        self.check_keys(items.iter().map(|(k, _)| k.as_slice()))?;
        let batch = Arc::new(Batch::new(items.len(), keepalive));
        self.spawn(Lane::Get, batch.clone(), move |shared| get::run(shared, &items))?;
        Ok(batch)
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.shared.state.lock().index.contains(key)
    }

    pub fn match_prefix<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) -> usize {
        let state = self.shared.state.lock();
        keys.take_while(|k| state.index.contains(k)).count()
    }

    pub fn block_len(&self, key: &[u8]) -> Option<u64> {
        self.shared.state.lock().index.lookup(key).map(|(_, c)| c.loc.raw_len)
    }

    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.shared.state.lock().index.keys_in_order().map(|(k, _)| k).collect()
    }

    /// The stored keys that start with one of `heads` and are at least `min_len` bytes long,
    /// their first `cut` bytes cut, oldest write first, joined into one buffer, with their
    /// common width (0 when none). None when they are not all of one width (then `keys`).
    /// A restart's listing of millions of keys without an object per key.
    pub fn keys_joined(&self, heads: &[Vec<u8>], cut: usize, min_len: usize) -> Option<(Vec<u8>, usize)> {
        self.list_joined(heads, cut, min_len, false).map(|j| (j.keys, j.width))
    }

    /// `keys_joined` with the chain links among the keys listed: `children` and `parents`
    /// joined the same way, `children[i]` extending `parents[i]` (a parent not stored, or not
    /// listed, makes no link). A restart's report without an object per key.
    pub fn inventory_joined(&self, heads: &[Vec<u8>], cut: usize, min_len: usize) -> Option<JoinedKeys> {
        self.list_joined(heads, cut, min_len, true)
    }

    fn list_joined(&self, heads: &[Vec<u8>], cut: usize, min_len: usize, links: bool) -> Option<JoinedKeys> {
        let listed = |key: &[u8]| {
            (key.len() >= min_len.max(cut) && heads.iter().any(|h| key.starts_with(h)))
                .then(|| key.len() - cut)
        };
        let state = self.shared.state.lock();
        let n = state.index.len();
        let mut out = JoinedKeys::default();
        let mut width: Option<usize> = None;
        let mut mixed = false;
        state.index.for_each_in_order(|key, _, _, parent| {
            let Some(w) = listed(key).filter(|_| !mixed) else { return };
            match width {
                None => {
                    width = Some(w);
                    out.keys.reserve_exact(w * n);
                }
                Some(v) if v != w => {
                    mixed = true;
                    return;
                }
                Some(_) => {}
            }
            out.keys.extend_from_slice(&key[cut..]);
            if let Some(p) = parent.filter(|p| links && listed(p) == Some(w)) {
                out.children.extend_from_slice(&key[cut..]);
                out.parents.extend_from_slice(&p[cut..]);
            }
        });
        if mixed {
            return None;
        }
        out.width = width.unwrap_or(0);
        Some(out)
    }

    /// Bytes the in-memory index holds (keys, contents), for benches.
    pub fn index_nbytes(&self) -> usize {
        self.shared.state.lock().index.nbytes()
    }

    pub fn len(&self) -> usize {
        self.shared.state.lock().index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn delete(&self, key: &[u8]) -> Result<bool> {
        self.delete_many(&[key.to_vec()]).map(|n| n == 1)
    }

    pub fn delete_many(&self, keys: &[Vec<u8>]) -> Result<usize> {
        if self.shared.cfg.read_only {
            return Err(StoreError::Config("store was opened read-only".into()));
        }
        let mut state = self.shared.state.lock();
        if state.closed {
            return Err(StoreError::Closed);
        }
        let mut buf = Vec::new();
        let mut removed = 0u64;
        for key in keys {
            if state.index.contains(key) {
                let released = state.index.remove(key);
                Shared::free_extent(&mut state, released);
                Record::Delete { key: key.clone() }.encode_into(&mut buf);
                removed += 1;
            }
        }
        self.shared.journal_append(&mut state, &buf, removed)?;
        drop(state);
        self.shared.maybe_compact();
        Ok(removed as usize)
    }

    pub fn clear(&self) -> Result<usize> {
        let keys = self.keys();
        self.delete_many(&keys)
    }

    /// Keys evicted since the last call that are still gone (a key evicted and then stored
    /// again is not reported).
    pub fn drain_evicted(&self) -> Vec<Vec<u8>> {
        let mut state = self.shared.state.lock();
        let evicted: Vec<Vec<u8>> = state.evicted.drain(..).collect();
        let mut seen = std::collections::HashSet::new();
        evicted.into_iter().filter(|k| !state.index.contains(k) && seen.insert(k.clone())).collect()
    }

    /// Read every block; returns keys whose data failed verification or could not be read.
    pub fn verify(&self) -> Result<Vec<Vec<u8>>> {
        if self.shared.state.lock().closed {
            return Err(StoreError::Closed);
        }
        let keys = self.keys();
        let mut bad = Vec::new();
        for chunk in keys.chunks(64) {
            let mut bufs = Vec::with_capacity(chunk.len());
            let mut items = Vec::with_capacity(chunk.len());
            for key in chunk {
                let len = self.block_len(key).unwrap_or(0) as usize;
                let mut buf = crate::io::aligned::AlignedBuf::zeroed(len);
                items.push((key.clone(), RawBuf { ptr: buf.as_mut_slice().as_mut_ptr(), len: buf.len() }));
                bufs.push(buf);
            }
            let results = get::run(&self.shared, &items);
            for (key, r) in chunk.iter().zip(results) {
                if matches!(r.status, Status::Corrupt | Status::IoError) {
                    bad.push(key.clone());
                }
            }
        }
        Ok(bad)
    }

    /// Compact the journal now; batches keep running while the new journal is written.
    pub fn checkpoint(&self) -> Result<()> {
        self.shared.compact_unlocked()
    }

    /// Wait for in-flight batches, compact, mark a clean shutdown, release the locks.
    pub fn close(&self) -> Result<()> {
        {
            let mut state = self.shared.state.lock();
            if state.closed {
                return Ok(());
            }
            state.closed = true; // no new batches from here on
        }
        {
            let mut n = self.shared.inflight.lock();
            while *n > 0 {
                self.shared.idle.wait_for(&mut n, Duration::from_millis(100));
            }
        }
        let mut state = self.shared.state.lock();
        let result = match state.compact_now() {
            Ok(()) => {
                let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
                state.journal.close(now)
            }
            Err(e) => {
                state.journal.abandon();
                Err(e)
            }
        };
        drop(state);
        self.executor.lock().take();
        self.shared.devices.release_locks();
        result
    }
}

/// One extra per item (or none at all), each metadata small enough for the header page.
fn check_extras(items: &[(Vec<u8>, RawBuf)], extras: &[PutExtra]) -> Result<()> {
    if !extras.is_empty() && extras.len() != items.len() {
        return Err(StoreError::Config(format!(
            "{} parents/metas for {} items: pass one per item",
            extras.len(),
            items.len()
        )));
    }
    for ((key, _), x) in items.iter().zip(extras) {
        let len = x.meta.as_ref().map_or(0, Vec::len);
        let room = crate::format::header::max_meta_len(key.len());
        if len > room {
            return Err(StoreError::Config(format!(
                "block metadata of {len} bytes does not fit the header page ({room} bytes with this key)"
            )));
        }
    }
    Ok(())
}

impl crate::tier::BlockTier for BlockStore {
    type Error = StoreError;

    fn tier_name(&self) -> &'static str {
        "ssd"
    }
    fn submit_put(&self, items: Vec<(Vec<u8>, RawBuf)>, keepalive: Option<Keepalive>) -> Result<Arc<Batch>> {
        BlockStore::submit_put(self, items, keepalive)
    }
    fn submit_get(&self, items: Vec<(Vec<u8>, RawBuf)>, keepalive: Option<Keepalive>) -> Result<Arc<Batch>> {
        BlockStore::submit_get(self, items, keepalive)
    }
    fn delete_many(&self, keys: &[Vec<u8>]) -> Result<usize> {
        BlockStore::delete_many(self, keys)
    }
    fn contains(&self, key: &[u8]) -> bool {
        BlockStore::contains(self, key)
    }
    fn match_prefix(&self, keys: &mut dyn Iterator<Item = &[u8]>) -> usize {
        // One lock for the whole prefix, not one per key.
        BlockStore::match_prefix(self, keys)
    }
    fn drain_evicted(&self) -> Vec<Vec<u8>> {
        BlockStore::drain_evicted(self)
    }
    fn stats(&self) -> StatsSnapshot {
        BlockStore::stats(self)
    }
    fn close(&self) -> Result<()> {
        BlockStore::close(self)
    }
}

impl Drop for BlockStore {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "closing block store");
        }
    }
}

#[cfg(test)]
mod reopen_bench;
#[cfg(test)]
mod tests;
