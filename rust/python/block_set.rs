//! `BlockSet` for Python: the compact presence set (`crate::index::block_set`) behind a mutex.
//!
//! Calls over many keys borrow the bytes objects with the GIL held (a reference to each keeps
//! it alive), then digest and look up with the GIL released. A call over a few keys stays under
//! the GIL: releasing it would cost more than the work. A contended lock is always waited for
//! with the GIL released, so a long call on another thread never stalls the interpreter.

use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySequence, PyString, PyTuple};

use crate::index::block_set::{digest, BlockSet, Digest, SetFull};

/// Below this many keys a call keeps the GIL.
const DETACH_MIN: usize = 64;
/// `prefix_run` borrows hashes in growing chunks, so a miss early in a long request does not
/// pay for borrowing all of it.
const FIRST_CHUNK: usize = 16;

fn full(_: SetFull) -> PyErr {
    PyValueError::new_err(SetFull.to_string())
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// Items `start..stop` of a list, tuple or other sequence of bytes, each kept alive by the
/// returned reference.
fn borrow_bytes<'py>(
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

fn as_sequence<'a, 'py>(seq: &'a Bound<'py, PyAny>, what: &str) -> PyResult<&'a Bound<'py, PySequence>> {
    let not_a_sequence =
        || PyTypeError::new_err(format!("{what} must be a sequence of bytes, not {}", type_name(seq)));
    // bytes and str are sequences too, of ints and of str: one is a key passed where a list goes.
    if seq.is_instance_of::<PyBytes>() || seq.is_instance_of::<PyString>() {
        return Err(not_a_sequence());
    }
    seq.cast::<PySequence>().map_err(|_| not_a_sequence())
}

fn seq_len(seq: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if let Ok(list) = seq.cast::<PyList>() {
        return Ok(list.len());
    }
    if let Ok(tuple) = seq.cast::<PyTuple>() {
        return Ok(tuple.len());
    }
    as_sequence(seq, what)?.len()
}

/// `start..stop` checked against `len`: no clamping, a bad range is the caller's bug.
fn span(start: i64, stop: i64, len: usize) -> PyResult<(usize, usize)> {
    if start < 0 || stop < 0 {
        return Err(PyValueError::new_err(format!("start and stop must be >= 0, got {start}, {stop}")));
    }
    if start > stop {
        return Err(PyValueError::new_err(format!("start {start} is past stop {stop}")));
    }
    if stop as u64 > len as u64 {
        return Err(PyValueError::new_err(format!("stop {stop} is past the end of hashes (len {len})")));
    }
    Ok((start as usize, stop as usize))
}

fn slices<'a>(objs: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
    objs.iter().map(|b| b.as_bytes()).collect()
}

fn to_digest(b: &[u8], i: usize) -> PyResult<Digest> {
    b.try_into().map_err(|_| PyValueError::new_err(format!("digests[{i}] must be 16 bytes, got {}", b.len())))
}

/// A set of block keys (namespace head + block hash) kept as 16-byte xxh3-128 digests of
/// `head || hash`, in least-recently-used order. A digest collision answers a false "present";
/// the worker's store verifies the full key in the block header, answers not_found, and the
/// block is recomputed.
#[pyclass(name = "BlockSet", module = "flexkv_py._native", frozen)]
pub struct PyBlockSet {
    inner: Mutex<BlockSet>,
}

impl PyBlockSet {
    /// Run `f` under the lock; wait for a contended lock with the GIL released.
    fn locked<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut BlockSet) -> R + Send) -> R {
        if let Some(mut guard) = self.inner.try_lock() {
            return f(&mut guard);
        }
        py.detach(|| f(&mut self.inner.lock()))
    }

    /// `locked`, with the GIL released when the work spans many keys.
    fn locked_for<R: Send>(&self, py: Python<'_>, n: usize, f: impl FnOnce(&mut BlockSet) -> R + Send) -> R {
        if n < DETACH_MIN {
            return self.locked(py, f);
        }
        py.detach(|| f(&mut self.inner.lock()))
    }

    fn add_all(&self, py: Python<'_>, digests: Vec<Digest>) -> PyResult<usize> {
        self.locked_for(py, digests.len(), |s| {
            let mut added = 0;
            for d in digests {
                added += s.insert(d)? as usize;
            }
            Ok(added)
        })
        .map_err(full)
    }

    fn read_digests(digests: &Bound<'_, PyAny>) -> PyResult<Vec<Digest>> {
        let n = seq_len(digests, "digests")?;
        let objs = borrow_bytes(digests, "digests", 0, n)?;
        objs.iter().enumerate().map(|(i, b)| to_digest(b.as_bytes(), i)).collect()
    }
}

#[pymethods]
impl PyBlockSet {
    #[new]
    fn new() -> Self {
        PyBlockSet { inner: Mutex::new(BlockSet::new()) }
    }

    /// True if newly added. Adding a present key keeps its place in the LRU order.
    fn add(&self, py: Python<'_>, head: &[u8], hash: &[u8]) -> PyResult<bool> {
        let d = digest(head, hash);
        self.locked(py, |s| s.insert(d)).map_err(full)
    }

    fn add_key(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        self.add(py, key, b"")
    }

    fn add_keys(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let objs = borrow_bytes(keys, "keys", 0, seq_len(keys, "keys")?)?;
        let keys = slices(&objs);
        let digests = if keys.len() < DETACH_MIN {
            keys.iter().map(|k| digest(k, b"")).collect()
        } else {
            py.detach(|| keys.iter().map(|k| digest(k, b"")).collect())
        };
        self.add_all(py, digests)
    }

    /// `add_keys` for digests already made (`digest`, `pop_lru`): each must be 16 bytes.
    fn add_digests(&self, py: Python<'_>, digests: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.add_all(py, Self::read_digests(digests)?)
    }

    fn discard(&self, py: Python<'_>, head: &[u8], hash: &[u8]) -> bool {
        let d = digest(head, hash);
        self.locked(py, |s| s.remove(&d))
    }

    fn discard_key(&self, py: Python<'_>, key: &[u8]) -> bool {
        self.discard(py, key, b"")
    }

    fn discard_keys(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let objs = borrow_bytes(keys, "keys", 0, seq_len(keys, "keys")?)?;
        let keys = slices(&objs);
        Ok(self.locked_for(py, keys.len(), |s| keys.iter().filter(|k| s.remove(&digest(k, b""))).count()))
    }

    fn discard_digests(&self, py: Python<'_>, digests: &Bound<'_, PyAny>) -> PyResult<usize> {
        let digests = Self::read_digests(digests)?;
        Ok(self.locked_for(py, digests.len(), |s| digests.iter().filter(|d| s.remove(d)).count()))
    }

    fn contains(&self, py: Python<'_>, head: &[u8], hash: &[u8]) -> bool {
        let d = digest(head, hash);
        self.locked(py, |s| s.contains(&d))
    }

    /// Full-key membership (`key in s`); only bytes can be members.
    fn __contains__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = key
            .cast::<PyBytes>()
            .map_err(|_| PyTypeError::new_err(format!("BlockSet keys are bytes, not {}", type_name(key))))?;
        Ok(self.contains(py, key.as_bytes(), b""))
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.locked(py, |s| s.len())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (len, bytes) = self.locked(py, |s| (s.len(), s.heap_bytes()));
        format!("BlockSet(len={len}, nbytes={bytes})")
    }

    /// How many consecutive `hashes[start:stop]` are present (stops at the first absent one).
    fn prefix_run(
        &self,
        py: Python<'_>,
        head: &[u8],
        hashes: &Bound<'_, PyAny>,
        start: i64,
        stop: i64,
    ) -> PyResult<usize> {
        let (start, stop) = span(start, stop, seq_len(hashes, "hashes")?)?;
        let mut at = start;
        let mut chunk = FIRST_CHUNK;
        while at < stop {
            let end = stop.min(at + chunk);
            let objs = borrow_bytes(hashes, "hashes", at, end)?;
            let hs = slices(&objs);
            let run = self
                .locked_for(py, hs.len(), |s| hs.iter().take_while(|h| s.contains(&digest(head, h))).count());
            at += run;
            if run < hs.len() {
                break;
            }
            chunk *= 8;
        }
        Ok(at - start)
    }

    /// One byte per `hashes[start:stop]`: 1 if present, 0 if not.
    fn present_mask<'py>(
        &self,
        py: Python<'py>,
        head: &[u8],
        hashes: &Bound<'py, PyAny>,
        start: i64,
        stop: i64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (start, stop) = span(start, stop, seq_len(hashes, "hashes")?)?;
        let objs = borrow_bytes(hashes, "hashes", start, stop)?;
        let hs = slices(&objs);
        let mask: Vec<u8> = self
            .locked_for(py, hs.len(), |s| hs.iter().map(|h| s.contains(&digest(head, h)) as u8).collect());
        Ok(PyBytes::new(py, &mask))
    }

    /// Move each present (head, hash) to the most recent end, in the order given.
    fn touch(&self, py: Python<'_>, head: &[u8], hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let objs = borrow_bytes(hashes, "hashes", 0, seq_len(hashes, "hashes")?)?;
        let hs = slices(&objs);
        self.locked_for(py, hs.len(), |s| {
            for h in &hs {
                s.touch(&digest(head, h));
            }
        });
        Ok(())
    }

    /// Remove and return up to `n` digests, least recently used first.
    fn pop_lru<'py>(&self, py: Python<'py>, n: i64) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        if n < 0 {
            return Err(PyValueError::new_err(format!("n must be >= 0, got {n}")));
        }
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        let popped: Vec<Digest> =
            self.locked_for(py, n, |s| std::iter::from_fn(|| s.pop_front()).take(n).collect());
        Ok(popped.iter().map(|d| PyBytes::new(py, d)).collect())
    }

    /// Every digest, least recently used first (diagnostics, tests).
    fn digests<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let all: Vec<Digest> = self.locked_for(py, DETACH_MIN, |s| s.iter().copied().collect());
        all.iter().map(|d| PyBytes::new(py, d)).collect()
    }

    /// The 16-byte digest a (head, hash) is kept as: xxh3-128 of head || hash, little-endian.
    #[staticmethod]
    fn digest<'py>(py: Python<'py>, head: &[u8], hash: &[u8]) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &digest(head, hash))
    }

    /// Keep only the digests also in `other` (e.g. what every TP rank holds); order kept.
    fn intersect_update(&self, py: Python<'_>, other: &Bound<'_, PyBlockSet>) {
        let other = other.get();
        if std::ptr::eq(self, other) {
            return;
        }
        py.detach(|| {
            // Lock in address order: a.intersect_update(b) beside b.intersect_update(a) is safe.
            let (mut mine, theirs) = if (self as *const Self) < (other as *const Self) {
                let mine = self.inner.lock();
                (mine, other.inner.lock())
            } else {
                let theirs = other.inner.lock();
                (self.inner.lock(), theirs)
            };
            mine.retain(|d| theirs.contains(d));
        });
    }

    /// Room for `additional` more keys without regrowing.
    fn reserve(&self, py: Python<'_>, additional: usize) {
        self.locked_for(py, additional, |s| s.reserve(additional));
    }

    /// Forget every key and release the memory.
    fn clear(&self, py: Python<'_>) {
        self.locked_for(py, DETACH_MIN, |s| s.clear());
    }

    /// Heap bytes held (table and arena capacities).
    fn nbytes(&self, py: Python<'_>) -> usize {
        self.locked(py, |s| s.heap_bytes())
    }
}
