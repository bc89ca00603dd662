//! The Python exception hierarchy. Classes are created once at import (so they can also
//! inherit from ValueError / OSError / KeyError) and each variant of a tier's error type
//! (`StoreError`, `ObjectError`) maps to one. An
//! error with an OS error behind it carries that error (as the matching `OSError` subclass) as
//! the exception's `__cause__`.

use std::sync::OnceLock;

use pyo3::exceptions::{PyException, PyKeyError, PyOSError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::StoreError;
use crate::object::ObjectError;
use crate::tier::TimedOut;

struct Classes {
    base: Py<PyType>,
    config: Py<PyType>,
    full: Py<PyType>,
    corrupt: Py<PyType>,
    io: Py<PyType>,
    locked: Py<PyType>,
    not_found: Py<PyType>,
    closed: Py<PyType>,
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
        closed: make(
            py,
            "StoreClosedError",
            vec![b.clone()],
            "The store was closed; open it again to submit more work.",
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
        ("StoreClosedError", &classes.closed),
    ] {
        m.add(name, cls.clone_ref(py))?;
    }
    let _ = CLASSES.set(classes);
    Ok(())
}

/// An error the Python layer raises: each tier's error type maps its variants onto the one
/// hierarchy made in `register`.
pub trait ToPyErr {
    fn to_py_err(self) -> PyErr;
}

pub fn to_py(err: impl ToPyErr) -> PyErr {
    err.to_py_err()
}

/// The class `pick` chooses, with `source` (an OS error) as the exception's `__cause__`.
fn raise(msg: String, pick: fn(&Classes) -> &Py<PyType>, source: Option<std::io::Error>) -> PyErr {
    let Some(c) = CLASSES.get() else { return PyException::new_err(msg) };
    let cls = pick(c);
    Python::attach(|py| {
        let err = PyErr::from_type(cls.bind(py).clone(), msg);
        if let Some(source) = source {
            err.set_cause(py, Some(os_error(source)));
        }
        err
    })
}

impl ToPyErr for StoreError {
    fn to_py_err(self) -> PyErr {
        let msg = self.to_string();
        match self {
            StoreError::Config(_) => raise(msg, |c| &c.config, None),
            StoreError::Closed => raise(msg, |c| &c.closed, None),
            StoreError::Full(_) => raise(msg, |c| &c.full, None),
            StoreError::Corrupt { .. } | StoreError::Foreign { .. } | StoreError::FormatVersion { .. } => {
                raise(msg, |c| &c.corrupt, None)
            }
            StoreError::Io { source, .. } => raise(msg, |c| &c.io, Some(source)),
            StoreError::Device(_) => raise(msg, |c| &c.io, None),
            StoreError::Locked(_) => raise(msg, |c| &c.locked, None),
            StoreError::NotFound(_) => raise(msg, |c| &c.not_found, None),
            StoreError::Timeout(_) => PyTimeoutError::new_err(msg),
        }
    }
}

impl ToPyErr for ObjectError {
    fn to_py_err(self) -> PyErr {
        let msg = self.to_string();
        match self {
            ObjectError::Config(_) => raise(msg, |c| &c.config, None),
            ObjectError::Closed => raise(msg, |c| &c.closed, None),
            ObjectError::Request(_) => raise(msg, |c| &c.io, None),
            ObjectError::Io { source, .. } => raise(msg, |c| &c.io, Some(source)),
            ObjectError::Timeout(_) => PyTimeoutError::new_err(msg),
        }
    }
}

impl ToPyErr for TimedOut {
    fn to_py_err(self) -> PyErr {
        PyTimeoutError::new_err(self.to_string())
    }
}

/// `OSError(errno, strerror)`: Python picks the matching subclass (FileNotFoundError, ...) and
/// keeps `errno`, which pyo3's own conversion leaves unset.
fn os_error(source: std::io::Error) -> PyErr {
    match source.raw_os_error() {
        Some(code) => {
            let text = std::io::Error::from_raw_os_error(code).to_string();
            let text = text.split(" (os error").next().unwrap_or_default().to_string();
            PyOSError::new_err((code, text))
        }
        None => PyErr::from(source),
    }
}
