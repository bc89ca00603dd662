//! The Python exception hierarchy. Classes are created once at import (so they can also
//! inherit from ValueError / OSError / KeyError) and each StoreError variant maps to one.

use std::sync::OnceLock;

use pyo3::exceptions::{PyException, PyKeyError, PyOSError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::StoreError;

struct Classes {
    base: Py<PyType>,
    config: Py<PyType>,
    full: Py<PyType>,
    corrupt: Py<PyType>,
    io: Py<PyType>,
    locked: Py<PyType>,
    not_found: Py<PyType>,
}

static CLASSES: OnceLock<Classes> = OnceLock::new();

fn make(py: Python<'_>, name: &str, bases: Vec<Bound<'_, PyType>>, doc: &str) -> PyResult<Py<PyType>> {
    let type_fn = py.import("builtins")?.getattr("type")?;
    let ns = PyDict::new(py);
    ns.set_item("__module__", "flexkv_py._native")?;
    ns.set_item("__doc__", doc)?;
    let cls = type_fn.call1((name, PyTuple::new(py, bases)?, ns))?;
    Ok(cls.cast_into::<PyType>()?.unbind())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = make(py, "FlexKVError", vec![py.get_type::<PyException>()], "Base of every flexkv-py error.")?;
    let b = base.bind(py).clone();
    let classes = Classes {
        config: make(
            py,
            "ConfigError",
            vec![b.clone(), py.get_type::<PyValueError>()],
            "Bad configuration or input; the message names the key.",
        )?,
        full: make(py, "StorageFullError", vec![b.clone()], "The budget or the device has no room.")?,
        corrupt: make(py, "CorruptBlockError", vec![b.clone()], "Stored bytes failed verification.")?,
        io: make(
            py,
            "IoEngineError",
            vec![b.clone(), py.get_type::<PyOSError>()],
            "The device or I/O engine failed.",
        )?,
        locked: make(py, "StoreLockedError", vec![b.clone()], "Another process holds the cache directory.")?,
        not_found: make(
            py,
            "BlockNotFoundError",
            vec![b.clone(), py.get_type::<PyKeyError>()],
            "The key is not stored.",
        )?,
        base,
    };
    for (name, cls) in [
        ("FlexKVError", &classes.base),
        ("ConfigError", &classes.config),
        ("StorageFullError", &classes.full),
        ("CorruptBlockError", &classes.corrupt),
        ("IoEngineError", &classes.io),
        ("StoreLockedError", &classes.locked),
        ("BlockNotFoundError", &classes.not_found),
    ] {
        m.add(name, cls.clone_ref(py))?;
    }
    let _ = CLASSES.set(classes);
    Ok(())
}

pub fn to_py(err: StoreError) -> PyErr {
    let msg = err.to_string();
    let Some(c) = CLASSES.get() else { return PyException::new_err(msg) };
    let cls = match err {
        StoreError::Config(_) => &c.config,
        StoreError::Full(_) => &c.full,
        StoreError::Corrupt(_) => &c.corrupt,
        StoreError::Io(_) => &c.io,
        StoreError::Locked(_) => &c.locked,
        StoreError::NotFound(_) => &c.not_found,
        StoreError::Timeout(_) => return PyTimeoutError::new_err(msg),
    };
    Python::attach(|py| PyErr::from_type(cls.bind(py).clone(), msg))
}
