//! `LookupHandle` for Python: a lookup running on the object tier's runtime
//! (`object::lookup_task`). `done` never blocks; `result` waits with the GIL released.
//! Dropping the handle before its answer aborts the lookup.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt};

use super::errors::to_py;
use crate::object::lookup_task::{Answer, LookupHandle};

#[pyclass(name = "LookupHandle", module = "flexkv_py._native", frozen)]
pub struct PyLookupHandle {
    inner: LookupHandle,
}

impl PyLookupHandle {
    pub(super) fn new(inner: LookupHandle) -> Self {
        Self { inner }
    }
}

/// Bit i set: `present[i]` (an int of any width: a probe may ask more than 64 keys).
fn bits<'py>(py: Python<'py>, present: &[bool]) -> PyResult<Bound<'py, PyAny>> {
    let mut bytes = vec![0u8; present.len().div_ceil(8)];
    for (i, _) in present.iter().enumerate().filter(|(_, p)| **p) {
        bytes[i / 8] |= 1 << (i % 8);
    }
    py.get_type::<PyInt>().call_method1("from_bytes", (PyBytes::new(py, &bytes), "little"))
}

#[pymethods]
impl PyLookupHandle {
    /// The answer is in.
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// The answer: a chain lookup's count of leading stored blocks, or a presence probe's bits.
    #[pyo3(signature = (timeout=None))]
    fn result<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyAny>> {
        let timeout = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(pyo3::exceptions::PyValueError::new_err("timeout must be a finite number >= 0"))
            }
            Some(t) => Some(Duration::from_secs_f64(t)),
            None => None,
        };
        let answer = py.detach(|| self.inner.wait(timeout)).map_err(to_py)?;
        match answer {
            Answer::Matched(n) => Ok(n.into_pyobject(py)?.into_any()),
            Answer::Present(present) => bits(py, &present),
        }
    }
}
