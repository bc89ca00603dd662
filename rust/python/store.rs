//! `BlockStore` for Python (its batches complete through `batch.rs`: `BatchHandle`, `BlockResult`).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::batch::{PyBatchHandle, PyBlockResult};
use super::buffers::extract_items;
use super::errors::to_py;
use super::stats::stats_dict;
use crate::compression::Compression;
use crate::error::StoreError;
use crate::hashing::HashAlgo;
use crate::index::block_set::Digest;
use crate::io::aligned::AlignedBuf;
use crate::io::EngineChoice;
use crate::store::{BlockStore, Durability, PutExtra, StoreConfig};
use crate::tier::{BlockResult, BlockTier, Keepalive, RawBuf, Status};

/// The SSD block store for Python. The calls every block tier has go through the `BlockTier`
/// trait (`tier`); the SSD-only ones (verify, checkpoint, keys, io engine) use `store`. Both
/// are the same object.
#[pyclass(name = "BlockStore", module = "flexkv_py._native", frozen)]
pub struct PyBlockStore {
    tier: Arc<dyn BlockTier<Error = StoreError>>,
    store: Arc<BlockStore>,
}

fn parse_dirs(dirs: &Bound<'_, PyAny>) -> PyResult<Vec<std::path::PathBuf>> {
    if let Ok(s) = dirs.extract::<String>() {
        return Ok(StoreConfig::split_dirs(&s));
    }
    let list: Vec<std::path::PathBuf> = dirs.extract().map_err(|_| {
        to_py(StoreError::Config(
            "ssd_cache_dir: expected a path, a ';'-separated string or a list of paths".into(),
        ))
    })?;
    Ok(list)
}

/// Parallel `parents` / `metas` lists as one extra per item; empty when neither is given.
fn zip_extras(
    n: usize,
    parents: Option<Vec<Option<Vec<u8>>>>,
    metas: Option<Vec<Option<Vec<u8>>>>,
) -> crate::error::Result<Vec<PutExtra>> {
    if parents.is_none() && metas.is_none() {
        return Ok(Vec::new());
    }
    for (name, list) in [("parents", &parents), ("metas", &metas)] {
        if let Some(l) = list.as_ref().filter(|l| l.len() != n) {
            return Err(StoreError::Config(format!("{name} has {} entries for {n} items", l.len())));
        }
    }
    let mut parents = parents.map(Vec::into_iter);
    let mut metas = metas.map(Vec::into_iter);
    Ok((0..n)
        .map(|_| PutExtra {
            parent: parents.as_mut().and_then(Iterator::next).flatten(),
            meta: metas.as_mut().and_then(Iterator::next).flatten(),
        })
        .collect())
}

impl PyBlockStore {
    fn single(
        &self,
        py: Python<'_>,
        key: Vec<u8>,
        buf: &Bound<'_, PyAny>,
        put: bool,
    ) -> PyResult<PyBlockResult> {
        let items = PyList::new(py, [(PyBytes::new(py, &key), buf.clone())])?;
        let handle =
            if put { self.submit_put(py, &items, None, None)? } else { self.submit_get(py, &items)? };
        let batch = handle.batch.clone();
        let mut results = py.detach(move || batch.wait(None)).map_err(to_py)?;
        let inner = results.pop().ok_or_else(|| to_py(StoreError::Device("empty batch result".into())))?;
        Ok(PyBlockResult::new(inner))
    }
}

#[pymethods]
impl PyBlockStore {
    #[new]
    #[pyo3(signature = (dirs, capacity_bytes, *, io_engine="auto", queue_depth=64, compression="none",
        zstd_level=1, content_hash="xxh3-128", durability="process",
        preallocate=true, read_only=false, batch_threads=4, fault_injection=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        dirs: &Bound<'_, PyAny>,
        capacity_bytes: u64,
        io_engine: &str,
        queue_depth: u32,
        compression: &str,
        zstd_level: i32,
        content_hash: &str,
        durability: &str,
        preallocate: bool,
        read_only: bool,
        batch_threads: usize,
        fault_injection: Option<&str>,
    ) -> PyResult<Self> {
        let mut cfg = StoreConfig::new(parse_dirs(dirs)?, capacity_bytes);
        let parsed = (|| -> crate::error::Result<()> {
            cfg.io_engine = EngineChoice::parse(io_engine)?;
            cfg.compression = Compression::parse(compression, zstd_level)?;
            cfg.hash = HashAlgo::parse(content_hash)?;
            cfg.durability = Durability::parse(durability)?;
            cfg.fault_injection = fault_injection.map(crate::io::fault::FaultPlan::parse).transpose()?;
            Ok(())
        })();
        parsed.map_err(to_py)?;
        cfg.queue_depth = queue_depth;
        cfg.preallocate = preallocate;
        cfg.read_only = read_only;
        cfg.batch_threads = batch_threads.max(1);
        let store = Arc::new(py.detach(move || BlockStore::open(cfg)).map_err(to_py)?);
        Ok(PyBlockStore { tier: store.clone(), store })
    }

    #[getter]
    fn io_engine(&self) -> &'static str {
        self.store.io_engine()
    }

    #[getter]
    fn dirs(&self) -> Vec<String> {
        self.store.config().dirs.iter().map(|d| d.display().to_string()).collect()
    }

    #[getter]
    fn capacity_bytes(&self) -> u64 {
        self.store.capacity_bytes()
    }

    /// `parents` / `metas`: one per item (None: absent), or None for the whole batch.
    #[pyo3(signature = (items, parents=None, metas=None))]
    fn submit_put(
        &self,
        py: Python<'_>,
        items: &Bound<'_, PyAny>,
        parents: Option<Vec<Option<Vec<u8>>>>,
        metas: Option<Vec<Option<Vec<u8>>>>,
    ) -> PyResult<PyBatchHandle> {
        let ex = extract_items(py, items, false)?;
        let owners: Keepalive = Box::new(ex.owners);
        let items = ex.items;
        let extras = zip_extras(items.len(), parents, metas).map_err(to_py)?;
        if extras.is_empty() {
            let tier = self.tier.clone();
            let batch = py.detach(move || tier.submit_put(items, Some(owners))).map_err(to_py)?;
            return Ok(PyBatchHandle::from_batch(batch));
        }
        let store = self.store.clone();
        let batch = py.detach(move || store.submit_put_with(items, extras, Some(owners))).map_err(to_py)?;
        Ok(PyBatchHandle::from_batch(batch))
    }

    /// Every stored key with its chain parent (None when it has none stored), oldest write first.
    fn inventory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let inv = py.detach(|| self.store.inventory());
        PyList::new(
            py,
            inv.iter().map(|(k, p)| (PyBytes::new(py, k), p.as_ref().map(|p| PyBytes::new(py, p)))),
        )
    }

    /// The metadata stored with each key (None: absent), read from the block header pages.
    fn read_metas<'py>(&self, py: Python<'py>, keys: Vec<Vec<u8>>) -> PyResult<Bound<'py, PyList>> {
        let store = self.store.clone();
        let metas = py.detach(move || store.read_metas(&keys)).map_err(to_py)?;
        PyList::new(py, metas.iter().map(|m| m.as_ref().map(|m| PyBytes::new(py, m))))
    }

    fn submit_get(&self, py: Python<'_>, items: &Bound<'_, PyAny>) -> PyResult<PyBatchHandle> {
        let ex = extract_items(py, items, true)?;
        let tier = self.tier.clone();
        let owners: Keepalive = Box::new(ex.owners);
        let items = ex.items;
        let batch = py.detach(move || tier.submit_get(items, Some(owners))).map_err(to_py)?;
        Ok(PyBatchHandle::from_batch(batch))
    }

    fn put(&self, py: Python<'_>, key: Vec<u8>, data: &Bound<'_, PyAny>) -> PyResult<PyBlockResult> {
        self.single(py, key, data, true)
    }

    fn get(&self, py: Python<'_>, key: Vec<u8>, out: &Bound<'_, PyAny>) -> PyResult<PyBlockResult> {
        self.single(py, key, out, false)
    }

    fn read<'py>(&self, py: Python<'py>, key: Vec<u8>) -> PyResult<Bound<'py, PyBytes>> {
        let store = self.store.clone();
        let k = key.clone();
        let (result, buf) = py
            .detach(move || -> crate::error::Result<(BlockResult, Vec<u8>)> {
                let len = store.block_len(&k).ok_or_else(|| {
                    StoreError::NotFound(format!("key {:?} is not stored", String::from_utf8_lossy(&k)))
                })? as usize;
                let mut buf = AlignedBuf::zeroed(len);
                let raw = RawBuf { ptr: buf.as_mut_slice().as_mut_ptr(), len: buf.len() };
                let batch = store.submit_get(vec![(k, raw)], None)?;
                let r =
                    batch.wait(None)?.pop().ok_or_else(|| StoreError::Device("empty batch result".into()))?;
                Ok((r, buf.as_slice()[..len].to_vec()))
            })
            .map_err(to_py)?;
        let name = String::from_utf8_lossy(&key).into_owned();
        match result.status {
            Status::Ok => Ok(PyBytes::new(py, &buf)),
            Status::NotFound => Err(to_py(StoreError::NotFound(format!("key {name:?} is not stored")))),
            Status::Corrupt => {
                Err(to_py(StoreError::corrupt(format!("key {name:?}"), result.error.unwrap_or_default())))
            }
            _ => {
                Err(to_py(StoreError::Device(format!("key {name:?}: {}", result.error.unwrap_or_default()))))
            }
        }
    }

    // Every method that takes the store's lock first releases the GIL: a store thread may hold
    // that lock while it needs the GIL (releasing a caller's buffer).
    fn contains(&self, py: Python<'_>, key: Vec<u8>) -> bool {
        py.detach(|| self.tier.contains(&key))
    }

    fn __contains__(&self, py: Python<'_>, key: Vec<u8>) -> bool {
        self.contains(py, key)
    }

    fn match_prefix(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> usize {
        py.detach(|| self.tier.match_prefix(&mut keys.iter().map(Vec::as_slice)))
    }

    fn block_len(&self, py: Python<'_>, key: Vec<u8>) -> Option<u64> {
        py.detach(|| self.store.block_len(&key))
    }

    fn delete(&self, py: Python<'_>, key: Vec<u8>) -> PyResult<bool> {
        let tier = self.tier.clone();
        py.detach(move || tier.delete_many(&[key])).map(|n| n == 1).map_err(to_py)
    }

    /// Delete the keys that start with `tag` whose fingerprint (`BlockSet.digest` of the key
    /// past its 4-byte rank tag) is in `fingerprints` (8 bytes each, joined); returns them.
    fn delete_fingerprints<'py>(
        &self,
        py: Python<'py>,
        tag: Vec<u8>,
        fingerprints: Vec<u8>,
    ) -> PyResult<Bound<'py, PyList>> {
        if fingerprints.len() % 8 != 0 {
            let n = fingerprints.len();
            return Err(to_py(StoreError::Config(format!("fingerprints: {n} bytes, not 8 per block"))));
        }
        let fps: Vec<Digest> = fingerprints.chunks_exact(8).filter_map(|c| c.try_into().ok()).collect();
        let store = self.store.clone();
        let keys = py.detach(move || store.delete_by_fingerprint(&tag, &fps)).map_err(to_py)?;
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    /// Delete every key that starts with one of `prefixes`; returns them, oldest write first.
    fn delete_prefixed<'py>(&self, py: Python<'py>, prefixes: Vec<Vec<u8>>) -> PyResult<Bound<'py, PyList>> {
        let store = self.store.clone();
        let keys = py.detach(move || store.delete_with_prefix(&prefixes)).map_err(to_py)?;
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    fn clear(&self, py: Python<'_>) -> PyResult<usize> {
        let store = self.store.clone();
        py.detach(move || store.clear()).map_err(to_py)
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let keys = py.detach(|| self.store.keys());
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    /// `keys()` of the keys that start with one of `heads` and are at least `min_len` bytes
    /// long, `cut` bytes cut from each, joined: (bytes, their common width); None when their
    /// widths differ. No object per key (a restart lists millions).
    fn keys_joined<'py>(
        &self,
        py: Python<'py>,
        heads: Vec<Vec<u8>>,
        cut: usize,
        min_len: usize,
    ) -> Option<(Bound<'py, PyBytes>, usize)> {
        let got = py.detach(|| self.store.keys_joined(&heads, cut, min_len));
        got.map(|(joined, width)| (PyBytes::new(py, &joined), width))
    }

    /// `keys_joined` with the chain links among the keys listed: (keys, children, parents,
    /// width), `children[i]` extending `parents[i]`, all joined; None when widths differ.
    #[allow(clippy::type_complexity)]
    fn inventory_joined<'py>(
        &self,
        py: Python<'py>,
        heads: Vec<Vec<u8>>,
        cut: usize,
        min_len: usize,
    ) -> Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, usize)> {
        let got = py.detach(|| self.store.inventory_joined(&heads, cut, min_len));
        got.map(|j| {
            (PyBytes::new(py, &j.keys), PyBytes::new(py, &j.children), PyBytes::new(py, &j.parents), j.width)
        })
    }

    /// A read-only view: (keys that appeared, keys that vanished) in the writer's journal
    /// since the last call or the open; None when it cannot be followed (open a new view).
    #[allow(clippy::type_complexity)]
    fn follow<'py>(&self, py: Python<'py>) -> PyResult<Option<(Bound<'py, PyList>, Bound<'py, PyList>)>> {
        let store = self.store.clone();
        let Some((came, gone)) = py.detach(move || store.follow()).map_err(to_py)? else { return Ok(None) };
        let list = |keys: &[Vec<u8>]| PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)));
        Ok(Some((list(&came)?, list(&gone)?)))
    }

    fn drain_evicted<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let keys = py.detach(|| self.tier.drain_evicted());
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    fn verify<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let store = self.store.clone();
        let bad = py.detach(move || store.verify()).map_err(to_py)?;
        PyList::new(py, bad.iter().map(|k| PyBytes::new(py, k)))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, py.detach(|| self.tier.stats()))
    }

    fn checkpoint(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store.clone();
        py.detach(move || store.checkpoint()).map_err(to_py)
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let tier = self.tier.clone();
        py.detach(move || tier.close()).map_err(to_py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        py.detach(|| self.store.len())
    }

    /// Bytes the in-memory index holds (for benches: divide by `len()` for bytes per block).
    fn index_nbytes(&self, py: Python<'_>) -> usize {
        py.detach(|| self.store.index_nbytes())
    }
}

impl Drop for PyBlockStore {
    fn drop(&mut self) {
        // Garbage collection may run with the GIL held; closing waits for batch threads that
        // may need the GIL (logging, releasing buffers), so finish closing on a thread of its own.
        let tier = self.tier.clone();
        let spawned = std::thread::Builder::new().name("flexkv-close".into()).spawn(move || {
            if let Err(e) = tier.close() {
                tracing::error!("closing a dropped block store: {e}");
            }
        });
        if spawned.is_err() {
            tracing::error!("could not start the closing thread of a dropped block store");
        }
    }
}

#[pyfunction]
#[pyo3(signature = (data, algorithm="xxh3-128"))]
pub fn content_hash<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    algorithm: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let algo = HashAlgo::parse(algorithm).map_err(to_py)?;
    let helper = py.import("flexkv_py._buffers")?.getattr("address_of")?;
    let (raw, owner) = super::buffers::extract_one(&helper, data, false)?;
    let digest = py.detach(move || {
        // SAFETY: `owner` keeps the memory alive and we hold it across this call.
        algo.digest(unsafe { raw.as_slice() })
    });
    drop(owner);
    Ok(PyBytes::new(py, &digest))
}

#[pyfunction]
pub fn io_uring_available() -> bool {
    crate::io::io_uring_available()
}

/// Testing: turn the delays of slow-mode fault injection (`DELAY<ms>`) on or off process-wide.
#[pyfunction]
pub fn set_fault_delays(enabled: bool) {
    crate::io::fault::set_delays_enabled(enabled);
}

/// Blocks of `stored_bytes` a store of `capacity_bytes` over `dirs` directories holds: the
/// store's own layout arithmetic, so the Python index sizes the SSD tier as the store fills it.
#[pyfunction]
pub fn store_capacity_blocks(capacity_bytes: u64, dirs: usize, stored_bytes: u64) -> PyResult<u64> {
    if dirs < 1 || stored_bytes < 1 {
        return Err(to_py(StoreError::Config(format!(
            "need >= 1 directory and block byte, got {dirs}, {stored_bytes}"
        ))));
    }
    Ok(crate::format::layout::capacity_blocks(capacity_bytes, dirs, stored_bytes))
}

/// Pages one block of `stored_bytes` takes on disk (its header page plus its data).
#[pyfunction]
pub fn block_pages(stored_bytes: u64) -> u64 {
    crate::format::layout::extent_pages(stored_bytes)
}
