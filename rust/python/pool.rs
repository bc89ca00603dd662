//! `HostPool` for Python: the aligned, pre-faulted host region.

use pyo3::prelude::*;

use super::errors::to_py;
use crate::host_pool::HostPool;

#[pyclass(name = "HostPool", module = "flexkv_py._native")]
pub struct PyHostPool {
    pool: Option<HostPool>,
}

#[pymethods]
impl PyHostPool {
    #[new]
    #[pyo3(signature = (nbytes, *, huge_pages=false, touch_threads=0))]
    fn new(py: Python<'_>, nbytes: usize, huge_pages: bool, touch_threads: usize) -> PyResult<Self> {
        let pool = py.detach(move || HostPool::new(nbytes, huge_pages, touch_threads)).map_err(to_py)?;
        Ok(PyHostPool { pool: Some(pool) })
    }

    #[getter]
    fn address(&self) -> PyResult<usize> {
        Ok(self.live()?.as_ptr() as usize)
    }

    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        Ok(self.live()?.len())
    }

    #[getter]
    fn huge_pages(&self) -> PyResult<bool> {
        Ok(self.live()?.huge_pages())
    }

    /// A writable memoryview over the whole pool. It does not own the memory: keep the pool
    /// open while any view (or tensor made from it) is in use.
    fn memoryview<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pool = self.live()?;
        // SAFETY: the region is valid for len bytes while the pool is open (documented above).
        unsafe {
            let obj = pyo3::ffi::PyMemoryView_FromMemory(
                pool.as_ptr().cast(),
                pool.len() as pyo3::ffi::Py_ssize_t,
                0x200, // PyBUF_WRITE (not exported by pyo3::ffi under abi3)
            );
            Bound::from_owned_ptr_or_err(py, obj)
        }
    }

    fn close(&mut self) {
        self.pool.take();
    }
}

impl PyHostPool {
    fn live(&self) -> PyResult<&HostPool> {
        self.pool
            .as_ref()
            .ok_or_else(|| to_py(crate::error::StoreError::Config("host pool is closed".into())))
    }
}
