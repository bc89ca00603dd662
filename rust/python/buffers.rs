//! Caller buffers → raw pointers. Accepts `(address, nbytes)` pairs as they are, and any
//! buffer-protocol object through `flexkv_py._buffers.address_of` (the stable ABI for 3.10 has
//! no buffer API); the owners are kept alive until the batch completes.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::tier::RawBuf;

pub struct Extracted {
    pub items: Vec<(Vec<u8>, RawBuf)>,
    pub owners: Vec<Py<PyAny>>,
}

pub fn extract_items(py: Python<'_>, items: &Bound<'_, PyAny>, writable: bool) -> PyResult<Extracted> {
    let helper = py.import("flexkv_py._buffers")?.getattr("address_of")?;
    let mut out = Extracted { items: Vec::new(), owners: Vec::new() };
    for item in items.try_iter()? {
        let item = item?;
        let (key, buf): (Vec<u8>, Bound<'_, PyAny>) = item.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err("each item must be a (key: bytes, buffer) pair")
        })?;
        let (raw, owner) = extract_one(&helper, &buf, writable)?;
        out.owners.push(owner);
        out.items.push((key, raw));
    }
    Ok(out)
}

/// The raw view of one buffer and the object that keeps its memory alive.
pub fn extract_one(
    helper: &Bound<'_, PyAny>,
    buf: &Bound<'_, PyAny>,
    writable: bool,
) -> PyResult<(RawBuf, Py<PyAny>)> {
    if let Ok(pair) = buf.cast::<PyTuple>() {
        let (addr, len): (usize, usize) = pair.extract()?;
        if addr == 0 && len > 0 {
            return Err(pyo3::exceptions::PyValueError::new_err("buffer address is NULL"));
        }
        return Ok((RawBuf { ptr: addr as *mut u8, len }, buf.clone().unbind()));
    }
    let (addr, len, owner): (usize, usize, Bound<'_, PyAny>) = helper.call1((buf, writable))?.extract()?;
    Ok((RawBuf { ptr: addr as *mut u8, len }, owner.unbind()))
}
