//! Argument helpers of `BlockSet`'s Python methods (block_set.rs): sequences of bytes
//! borrowed with their owners kept alive, checked ranges and digests.

use std::ops::Range;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySequence, PyString, PyTuple};

use crate::index::block_set::{check_span, Digest};

/// Calls over a whole key list work this many keys at a time.
pub(super) const CHUNK: usize = 1 << 16;

pub(super) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// Items `start..stop` of a list, tuple or other sequence of bytes, each kept alive by the
/// returned reference.
pub(super) fn borrow_bytes<'py>(
    seq: &Bound<'py, PyAny>,
    what: &str,
    start: usize,
    stop: usize,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let mut out = Vec::with_capacity(stop - start);
    let check = |i: usize, item: Bound<'py, PyAny>| -> PyResult<Bound<'py, PyBytes>> {
        item.cast_into::<PyBytes>().map_err(|e| {
            PyTypeError::new_err(format!(
                "{what}[{i}] must be bytes, not {}",
                type_name(e.into_inner().as_any())
            ))
        })
    };
    if let Ok(list) = seq.cast::<PyList>() {
        for i in start..stop {
            out.push(check(i, list.get_item(i)?)?);
        }
    } else if let Ok(tuple) = seq.cast::<PyTuple>() {
        for i in start..stop {
            out.push(check(i, tuple.get_item(i)?)?);
        }
    } else {
        let s = as_sequence(seq, what)?;
        for i in start..stop {
            out.push(check(i, s.get_item(i)?)?);
        }
    }
    Ok(out)
}

pub(super) fn as_sequence<'a, 'py>(
    seq: &'a Bound<'py, PyAny>,
    what: &str,
) -> PyResult<&'a Bound<'py, PySequence>> {
    let not_a_sequence =
        || PyTypeError::new_err(format!("{what} must be a sequence of bytes, not {}", type_name(seq)));
    // bytes and str are sequences too, of ints and of str: one is a key passed where a list goes.
    if seq.is_instance_of::<PyBytes>() || seq.is_instance_of::<PyString>() {
        return Err(not_a_sequence());
    }
    seq.cast::<PySequence>().map_err(|_| not_a_sequence())
}

pub(super) fn seq_len(seq: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if let Ok(list) = seq.cast::<PyList>() {
        return Ok(list.len());
    }
    if let Ok(tuple) = seq.cast::<PyTuple>() {
        return Ok(tuple.len());
    }
    as_sequence(seq, what)?.len()
}

pub(super) fn span(start: i64, stop: i64, len: usize) -> PyResult<Range<usize>> {
    check_span(start, stop, len).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Call `f` on the slices of `seq` (all bytes), `CHUNK` at a time, so a big call holds bounded
/// temporary memory. A non-bytes item anywhere fails the call before `f` sees any chunk.
pub(super) fn for_chunks(
    seq: &Bound<'_, PyAny>,
    what: &str,
    mut f: impl FnMut(&[&[u8]]) -> PyResult<()>,
) -> PyResult<()> {
    let n = seq_len(seq, what)?;
    if n > CHUNK {
        for at in (0..n).step_by(CHUNK) {
            borrow_bytes(seq, what, at, n.min(at + CHUNK))?;
        }
    }
    for at in (0..n).step_by(CHUNK) {
        let objs = borrow_bytes(seq, what, at, n.min(at + CHUNK))?;
        f(&slices(&objs))?;
    }
    Ok(())
}

pub(super) fn slices<'a>(objs: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
    objs.iter().map(|b| b.as_bytes()).collect()
}

pub(super) fn to_digest(b: &[u8], i: usize) -> PyResult<Digest> {
    b.try_into().map_err(|_| PyValueError::new_err(format!("digests[{i}] must be 8 bytes, got {}", b.len())))
}
