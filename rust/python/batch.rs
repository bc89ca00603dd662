//! `BatchHandle` and `BlockResult` for Python: the completion side of a submitted batch
//! (wait with the GIL released, then one result per item). Shared by every tier's bindings
//! (`BlockStore`, `ObjectTier`), so it lives apart from the SSD store's bindings.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::errors::to_py;
use crate::tier::{Batch, BlockResult};

#[pyclass(name = "BlockResult", module = "flexkv_py._native", frozen)]
pub struct PyBlockResult {
    inner: BlockResult,
}

impl PyBlockResult {
    pub(super) fn new(inner: BlockResult) -> Self {
        Self { inner }
    }
}

#[pymethods]
impl PyBlockResult {
    #[getter]
    fn status(&self) -> &'static str {
        self.inner.status.name()
    }
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.nbytes
    }
    #[getter]
    fn error(&self) -> Option<String> {
        self.inner.error.clone()
    }
    #[getter]
    fn ok(&self) -> bool {
        self.inner.status.is_ok()
    }
    fn __repr__(&self) -> String {
        match &self.inner.error {
            Some(e) => format!(
                "BlockResult({}, nbytes={}, error={e:?})",
                self.inner.status.name(),
                self.inner.nbytes
            ),
            None => format!("BlockResult({}, nbytes={})", self.inner.status.name(), self.inner.nbytes),
        }
    }
}

pub(super) fn wrap_results(py: Python<'_>, results: Vec<BlockResult>) -> PyResult<Bound<'_, PyList>> {
    let objs = results
        .into_iter()
        .map(|inner| Py::new(py, PyBlockResult { inner }))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, objs)
}

#[pyclass(name = "BatchHandle", module = "flexkv_py._native", frozen)]
pub struct PyBatchHandle {
    pub(super) batch: Arc<Batch>,
}

impl PyBatchHandle {
    /// A handle over any tier's batch (the SSD store's and the object tier's are one type).
    pub(crate) fn from_batch(batch: Arc<Batch>) -> Self {
        Self { batch }
    }
}

#[pymethods]
impl PyBatchHandle {
    fn done(&self) -> bool {
        self.batch.done()
    }

    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let timeout = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(pyo3::exceptions::PyValueError::new_err("timeout must be a finite number >= 0"))
            }
            Some(t) => Some(Duration::from_secs_f64(t)),
            None => None,
        };
        let batch = self.batch.clone();
        let results = py.detach(move || batch.wait(timeout)).map_err(to_py)?;
        wrap_results(py, results)
    }

    fn __len__(&self) -> usize {
        self.batch.len()
    }
}
