//! A tier's stats snapshot as a Python dict: the SSD store and the object tier both hand theirs
//! to Python this way.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::tier::{StatValue, StatsSnapshot};

pub(super) fn stats_dict(py: Python<'_>, stats: StatsSnapshot) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in stats {
        match value {
            StatValue::Int(v) => d.set_item(name, v)?,
            StatValue::Float(v) => d.set_item(name, v)?,
            StatValue::Text(v) => d.set_item(name, v)?,
        }
    }
    Ok(d)
}
