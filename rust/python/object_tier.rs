//! `ObjectTier` for Python; its batches are the same `BatchHandle` / `BlockResult` as the SSD
//! store's. Every call runs with the GIL released.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::batch::PyBatchHandle;
use super::buffers::extract_items;
use super::errors::to_py;
use super::lookup_handle::PyLookupHandle;
use super::stats::stats_dict;
use crate::compression::Compression;
use crate::object::gc::GcOptions;
use crate::object::gc_schedule::GcSchedule;
use crate::object::ObjectError;
use crate::object::{ObjectConfig, ObjectTier};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyObjectTier>()?;
    Ok(())
}

/// GC options from Python's seconds, each checked.
fn gc_options(ttl_s: f64, grace_s: f64, budget_bytes: Option<u64>, dry_run: bool) -> PyResult<GcOptions> {
    for (name, v) in [("ttl_s", ttl_s), ("grace_s", grace_s)] {
        if !(v >= 0.0 && v.is_finite()) {
            return Err(to_py(ObjectError::Config(format!("{name}: must be a finite number >= 0, got {v}"))));
        }
    }
    Ok(GcOptions {
        ttl: Duration::from_secs_f64(ttl_s),
        grace: Duration::from_secs_f64(grace_s),
        budget_bytes,
        dry_run,
    })
}

#[pyclass(name = "ObjectTier", module = "flexkv_py._native", frozen)]
pub struct PyObjectTier {
    tier: Arc<ObjectTier>,
}

#[pymethods]
impl PyObjectTier {
    #[new]
    #[pyo3(signature = (url, *, endpoint=None, region=None, access_key_id=None, secret_access_key=None,
        allow_http=false, allow_instance_metadata=false, concurrency=32, timeout_s=10.0, retries=3,
        compression="none", zstd_level=3, touch_interval_s=300.0, claim_lease_s=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: String,
        endpoint: Option<String>,
        region: Option<String>,
        access_key_id: Option<String>,
        secret_access_key: Option<String>,
        allow_http: bool,
        allow_instance_metadata: bool,
        concurrency: usize,
        timeout_s: f64,
        retries: usize,
        compression: &str,
        zstd_level: i32,
        touch_interval_s: f64,
        claim_lease_s: Option<f64>,
    ) -> PyResult<Self> {
        let lease = [("claim_lease_s", claim_lease_s.unwrap_or(1.0))];
        for (name, v) in
            [("timeout_s", timeout_s), ("touch_interval_s", touch_interval_s)].into_iter().chain(lease)
        {
            if !(v > 0.0 && v.is_finite()) {
                return Err(to_py(ObjectError::Config(format!(
                    "{name}: must be a finite number > 0, got {v}"
                ))));
            }
        }
        let mut cfg = ObjectConfig::new(url);
        cfg.endpoint = endpoint;
        cfg.region = region;
        cfg.access_key_id = access_key_id;
        cfg.secret_access_key = secret_access_key;
        cfg.allow_http = allow_http;
        cfg.allow_instance_metadata = allow_instance_metadata;
        cfg.concurrency = concurrency;
        cfg.timeout = Duration::from_secs_f64(timeout_s);
        cfg.retries = retries;
        cfg.compression = Compression::parse(compression, zstd_level).map_err(to_py)?;
        cfg.touch_interval = Duration::from_secs_f64(touch_interval_s);
        cfg.claim_lease = claim_lease_s.map(Duration::from_secs_f64);
        let tier = py.detach(move || ObjectTier::open(cfg)).map_err(to_py)?;
        Ok(PyObjectTier { tier: Arc::new(tier) })
    }

    #[getter]
    fn url(&self) -> String {
        self.tier.config().url.clone()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.tier.backend().name()
    }

    #[getter]
    fn prefix(&self) -> String {
        self.tier.prefix().to_string()
    }

    /// With `chain` (every key from the chain's root to its last block), the chain's manifests
    /// are consulted first and written after the blocks.
    #[pyo3(signature = (items, chain=None))]
    fn submit_put(
        &self,
        py: Python<'_>,
        items: &Bound<'_, PyAny>,
        chain: Option<Vec<Vec<u8>>>,
    ) -> PyResult<PyBatchHandle> {
        let ex = extract_items(py, items, false)?;
        let owners: Box<dyn std::any::Any + Send> = Box::new(ex.owners);
        let (tier, items) = (self.tier.clone(), ex.items);
        let batch = py
            .detach(move || match chain {
                Some(chain) => tier.submit_put_chain(chain, items, Some(owners)),
                None => tier.submit_put(items, Some(owners)),
            })
            .map_err(to_py)?;
        Ok(PyBatchHandle::from_batch(batch))
    }

    /// One listing request: the endpoint, bucket and credentials still work (the same probe
    /// `open` makes); a `ConfigError` naming the problem otherwise.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let tier = self.tier.clone();
        py.detach(move || tier.check()).map_err(to_py)
    }

    /// Leading blocks of the chain `keys` (root first) that are stored, from its manifests.
    fn lookup_chain(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<usize> {
        let tier = self.tier.clone();
        py.detach(move || tier.lookup_chain(&keys)).map_err(to_py)
    }

    /// `lookup_chain(keys)` on the tier's runtime: returns at once; the handle's `result` is
    /// the count.
    fn submit_lookup_chain(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<PyLookupHandle> {
        let tier = self.tier.clone();
        let handle = py.detach(move || tier.submit_lookup_chain(keys)).map_err(to_py)?;
        Ok(PyLookupHandle::new(handle))
    }

    /// Whether each key is stored as a one-block chain, on the tier's runtime: returns at
    /// once; the handle's `result` has bit i set when `lookup_chain([keys[i]]) == 1`.
    fn submit_present(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<PyLookupHandle> {
        let tier = self.tier.clone();
        let handle = py.detach(move || tier.submit_present(keys)).map_err(to_py)?;
        Ok(PyLookupHandle::new(handle))
    }

    /// One collection pass; returns its counts.
    #[pyo3(signature = (*, ttl_s, grace_s=600.0, budget_bytes=None, dry_run=false))]
    fn gc<'py>(
        &self,
        py: Python<'py>,
        ttl_s: f64,
        grace_s: f64,
        budget_bytes: Option<u64>,
        dry_run: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let opts = gc_options(ttl_s, grace_s, budget_bytes, dry_run)?;
        let tier = self.tier.clone();
        let r = py.detach(move || tier.gc(&opts)).map_err(to_py)?;
        let d = PyDict::new(py);
        for (name, v) in [
            ("manifests", r.manifests),
            ("manifests_live", r.manifests_live),
            ("manifests_deleted", r.manifests_deleted),
            ("manifests_rescued", r.manifests_rescued),
            ("manifests_dangling", r.manifests_dangling),
            ("blocks", r.blocks),
            ("blocks_deleted", r.blocks_deleted),
            ("block_bytes", r.block_bytes),
            ("block_bytes_deleted", r.block_bytes_deleted),
            ("touches_deleted", r.touches_deleted),
            ("claims_deleted", r.claims_deleted),
            ("delete_errors", r.delete_errors),
        ] {
            d.set_item(name, v)?;
        }
        Ok(d)
    }

    /// Run collection passes in the background, on the tier's runtime: every `interval_s`, a
    /// pass by whichever process holds the lease (`holder` names this one). `close` stops it.
    #[pyo3(signature = (holder, *, ttl_s, grace_s=600.0, budget_bytes=None, interval_s=300.0, lease_s=900.0))]
    #[allow(clippy::too_many_arguments)]
    fn start_gc(
        &self,
        py: Python<'_>,
        holder: String,
        ttl_s: f64,
        grace_s: f64,
        budget_bytes: Option<u64>,
        interval_s: f64,
        lease_s: f64,
    ) -> PyResult<()> {
        let opts = gc_options(ttl_s, grace_s, budget_bytes, false)?;
        for (name, v) in [("interval_s", interval_s), ("lease_s", lease_s)] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(to_py(ObjectError::Config(format!(
                    "{name}: must be a finite number > 0, got {v}"
                ))));
            }
        }
        let schedule = GcSchedule {
            holder,
            opts,
            interval: Duration::from_secs_f64(interval_s),
            lease: Duration::from_secs_f64(lease_s),
        };
        let tier = self.tier.clone();
        py.detach(move || tier.start_gc(schedule)).map_err(to_py)
    }

    /// Counts and bytes of the prefix's objects by kind.
    fn inspect<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let tier = self.tier.clone();
        let inv = py.detach(move || tier.inventory()).map_err(to_py)?;
        let d = PyDict::new(py);
        for (name, v) in inv {
            d.set_item(name, v)?;
        }
        Ok(d)
    }

    /// Take or renew the background-GC lease; `True`: run GC now.
    fn try_gc_lease(&self, py: Python<'_>, holder: String, lease_s: f64) -> PyResult<bool> {
        if !(lease_s > 0.0 && lease_s.is_finite()) {
            return Err(to_py(ObjectError::Config(format!(
                "lease_s: must be a finite number > 0, got {lease_s}"
            ))));
        }
        let tier = self.tier.clone();
        py.detach(move || tier.try_gc_lease(&holder, Duration::from_secs_f64(lease_s))).map_err(to_py)
    }

    fn submit_get(&self, py: Python<'_>, items: &Bound<'_, PyAny>) -> PyResult<PyBatchHandle> {
        let ex = extract_items(py, items, true)?;
        let owners: Box<dyn std::any::Any + Send> = Box::new(ex.owners);
        let (tier, items) = (self.tier.clone(), ex.items);
        let batch = py.detach(move || tier.submit_get(items, Some(owners))).map_err(to_py)?;
        Ok(PyBatchHandle::from_batch(batch))
    }

    fn contains_many(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<Vec<bool>> {
        let tier = self.tier.clone();
        py.detach(move || tier.contains_many(&keys)).map_err(to_py)
    }

    fn delete(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<usize> {
        let tier = self.tier.clone();
        py.detach(move || tier.delete(&keys)).map_err(to_py)
    }

    fn drain_evicted<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.tier.drain_evicted().iter().map(|k| PyBytes::new(py, k)))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, py.detach(|| self.tier.stats()))
    }

    fn close(&self, py: Python<'_>) {
        let tier = self.tier.clone();
        py.detach(move || tier.close());
    }

    #[getter]
    fn closed(&self) -> bool {
        self.tier.is_closed()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) {
        self.close(py);
    }

    /// URL, endpoint and backend only: never a credential.
    fn __repr__(&self) -> String {
        let cfg = self.tier.config();
        match &cfg.endpoint {
            Some(ep) => {
                format!("ObjectTier({:?}, endpoint={ep:?}, backend={})", cfg.url, self.tier.backend().name())
            }
            None => format!("ObjectTier({:?}, backend={})", cfg.url, self.tier.backend().name()),
        }
    }
}
