//! `HostPool` for Python: the aligned, pre-faulted host region.
//!
//! Views never outlive the memory. Each `memoryview()` holds a lease (an `Arc` of the region)
//! on the ctypes array under it, so numpy arrays and torch tensors made from the view keep the
//! mapping too. `close()` drops the pool's own reference: the region is unmapped at once when
//! no view is alive, or when the last one is garbage-collected. Deferring (not refusing) keeps
//! every shutdown path free of a new exception; `live_views` says what holds the memory.

use std::sync::{Arc, Weak};

use pyo3::prelude::*;

use super::errors::to_py;
use crate::host_pool::HostPool;

#[pyclass(name = "HostPool", module = "flexkv_py._native")]
pub struct PyHostPool {
    region: Option<Arc<HostPool>>,
    // Still answers `live_views` after close, while views keep the mapping.
    weak: Weak<HostPool>,
}

/// One exported view's share of the region (never seen by Python code).
#[pyclass(name = "_HostPoolLease", module = "flexkv_py._native", frozen)]
struct Lease {
    _region: Arc<HostPool>,
}

#[pymethods]
impl PyHostPool {
    #[new]
    #[pyo3(signature = (nbytes, *, huge_pages=false, touch_threads=0))]
    fn new(py: Python<'_>, nbytes: usize, huge_pages: bool, touch_threads: usize) -> PyResult<Self> {
        let pool = py.detach(move || HostPool::new(nbytes, huge_pages, touch_threads)).map_err(to_py)?;
        let region = Arc::new(pool);
        Ok(PyHostPool { weak: Arc::downgrade(&region), region: Some(region) })
    }

    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.live(py)?.as_ptr() as usize)
    }

    #[getter]
    fn nbytes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.live(py)?.len())
    }

    #[getter]
    fn huge_pages(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.live(py)?.huge_pages())
    }

    /// Views made by `memoryview()` that are still alive (each keeps the mapping).
    #[getter]
    fn live_views(&self) -> usize {
        let own = usize::from(self.region.is_some());
        self.weak.strong_count().saturating_sub(own)
    }

    #[getter]
    fn closed(&self) -> bool {
        self.region.is_none()
    }

    /// A writable memoryview over the whole pool that keeps the memory mapped while it (or
    /// anything made from it) is alive, even past `close()`.
    fn memoryview<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let region = self.live(py)?;
        let (address, nbytes) = (region.as_ptr() as usize, region.len());
        let lease = Py::new(py, Lease { _region: Arc::clone(region) })?;
        py.import("flexkv_py._buffers")?.getattr("leased_view")?.call1((address, nbytes, lease))
    }

    /// Drop the pool's reference: unmapped now, or when the last view goes (see the module).
    fn close(&mut self) {
        self.region.take();
    }
}

impl PyHostPool {
    fn live(&self, py: Python<'_>) -> PyResult<&Arc<HostPool>> {
        match &self.region {
            Some(region) => Ok(region),
            None => Err(closed_error(py)),
        }
    }
}

/// `flexkv_py.errors.ClosedError` (a Python class: the tree's Python half lives there).
fn closed_error(py: Python<'_>) -> PyErr {
    const MSG: &str = "host pool is closed";
    match py.import("flexkv_py.errors").and_then(|m| m.getattr("ClosedError")) {
        Ok(cls) => PyErr::from_value(match cls.call1((MSG,)) {
            Ok(err) => err,
            Err(e) => return e,
        }),
        Err(e) => e,
    }
}
