//! `BlockSet` for Python: the compact presence set (`crate::index::block_set`) behind a mutex.
//!
//! Calls over many keys borrow the bytes objects with the GIL held (a reference to each keeps
//! it alive), then digest and look up with the GIL released. A call over a few keys stays under
//! the GIL: releasing it would cost more than the work. A contended lock is always waited for
//! with the GIL released, so a long call on another thread never stalls the interpreter.

use std::collections::HashSet;
use std::ops::Range;

use parking_lot::Mutex;
use pyo3::exceptions::{PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::block_set_args::{borrow_bytes, for_chunks, seq_len, slices, span, to_digest, type_name, CHUNK};
use crate::index::block_set::{
    digest, find_records, parent_name, BlockSet, Digest, ParentName, SetError, NO_PARENT,
};

/// An evicted chain tail: its digest, and its parent's name when no parent in the set counted it.
type Evicted<'py> = (Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>);

/// Below this many keys a call keeps the GIL.
const DETACH_MIN: usize = 64;
/// `prefix_run` borrows hashes in chunks growing 8x from this, so a miss early in a long
/// request does not pay for borrowing all of it (a miss at block 0 costs one borrow).
const FIRST_CHUNK: usize = 1;

/// A chain parent's name: 8 bytes (`parent_name`: the first 5 of the block's fingerprint, then
/// zeros; only those 5 count, so a full digest names its block too).
fn to_name(b: &[u8], what: &str) -> PyResult<ParentName> {
    b.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be an 8-byte parent name (`parent_name`), got {} bytes",
            b.len()
        ))
    })
}

fn set_error(e: SetError) -> PyErr {
    match e {
        SetError::Full => PyValueError::new_err(e.to_string()),
        SetError::NoMemory(_) => PyMemoryError::new_err(e.to_string()),
    }
}

/// A set of block keys (namespace head + block hash) kept as 8-byte fingerprints (xxh3-128) of
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
        .map_err(set_error)
    }

    fn read_digests(digests: &Bound<'_, PyAny>) -> PyResult<Vec<Digest>> {
        let n = seq_len(digests, "digests")?;
        let objs = borrow_bytes(digests, "digests", 0, n)?;
        objs.iter().enumerate().map(|(i, b)| to_digest(b.as_bytes(), i)).collect()
    }
}

#[pymethods]
impl PyBlockSet {
    /// `chains`: keep chain links (parents, child counts) for prefix-aware eviction.
    #[new]
    #[pyo3(signature = (chains = false))]
    fn new(chains: bool) -> Self {
        PyBlockSet { inner: Mutex::new(if chains { BlockSet::with_chains() } else { BlockSet::new() }) }
    }

    /// True if newly added. Adding a present key keeps its place in the LRU order.
    fn add(&self, py: Python<'_>, head: &[u8], hash: &[u8]) -> PyResult<bool> {
        let d = digest(head, hash);
        self.locked(py, |s| s.insert(d)).map_err(set_error)
    }

    fn add_key(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        self.add(py, key, b"")
    }

    fn add_keys(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = seq_len(keys, "keys")?;
        if n >= DETACH_MIN {
            // A first fill (a restart adopting its inventory) is sized once, not grown 1.25x
            // at a time: half the time per key. Failing is fine: growth will try again.
            self.locked_for(py, n, |s| s.is_empty() && s.reserve(n).is_ok());
        }
        let mut added = 0;
        for_chunks(keys, "keys", |ks| {
            added += self
                .locked_for(py, ks.len(), |s| {
                    ks.iter().try_fold(0, |n, k| Ok::<_, SetError>(n + s.insert(digest(k, b""))? as usize))
                })
                .map_err(set_error)?;
            Ok(())
        })?;
        Ok(added)
    }

    /// `add_keys` of keys joined into one buffer, each `width` bytes (`BlockStore.keys_joined`):
    /// no object per key. How many were newly added.
    fn add_joined(&self, py: Python<'_>, joined: &[u8], width: usize) -> PyResult<usize> {
        if width == 0 || joined.len() % width != 0 {
            return Err(PyValueError::new_err(format!(
                "joined keys of {} bytes are not whole keys of width {width}",
                joined.len()
            )));
        }
        let n = joined.len() / width;
        if n >= DETACH_MIN {
            self.locked_for(py, n, |s| s.is_empty() && s.reserve(n).is_ok());
        }
        let mut added = 0;
        for chunk in joined.chunks(CHUNK * width) {
            added += self
                .locked_for(py, chunk.len() / width, |s| {
                    chunk
                        .chunks_exact(width)
                        .try_fold(0, |n, k| Ok::<_, SetError>(n + s.insert(digest(k, b""))? as usize))
                })
                .map_err(set_error)?;
        }
        Ok(added)
    }

    /// `add_keys` for digests already made (`digest`, `pop_lru`): each must be 8 bytes.
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
        let mut removed = 0;
        for_chunks(keys, "keys", |ks| {
            removed +=
                self.locked_for(py, ks.len(), |s| ks.iter().filter(|k| s.remove(&digest(k, b""))).count());
            Ok(())
        })?;
        Ok(removed)
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
        let Range { start, end: stop } = span(start, stop, seq_len(hashes, "hashes")?)?;
        let mut at = start;
        let mut chunk = FIRST_CHUNK;
        while at < stop {
            let end = stop.min(at + chunk);
            let objs = borrow_bytes(hashes, "hashes", at, end)?;
            let hs = slices(&objs);
            let run = self.locked_for(py, hs.len(), |s| s.prefix_run(head, &hs));
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
        let Range { start, end: stop } = span(start, stop, seq_len(hashes, "hashes")?)?;
        let objs = borrow_bytes(hashes, "hashes", start, stop)?;
        let hs = slices(&objs);
        let mask: Vec<u8> = self.locked_for(py, hs.len(), |s| s.present_mask(head, &hs));
        Ok(PyBytes::new(py, &mask))
    }

    /// Move each present (head, hash) to the most recent end, in the order given.
    fn touch(&self, py: Python<'_>, head: &[u8], hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        for_chunks(hashes, "hashes", |hs| {
            self.locked_for(py, hs.len(), |s| {
                for h in hs {
                    s.touch(&digest(head, h));
                }
            });
            Ok(())
        })
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

    /// The 8-byte digest a (head, hash) is kept as: the first 8 bytes of xxh3-128 of head || hash,
    /// little-endian.
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
    fn reserve(&self, py: Python<'_>, additional: i64) -> PyResult<()> {
        let n = usize::try_from(additional)
            .map_err(|_| PyValueError::new_err(format!("additional must be >= 0, got {additional}")))?;
        self.locked_for(py, n, |s| s.reserve(n)).map_err(set_error)
    }

    // --- chain links (crate::index::block_set::chains): prefix-aware eviction order

    /// Add `key` extending the block named `parent` (`parent_name`; None: none known), with `kids`
    /// cached children counted against it. True if newly added.
    #[pyo3(signature = (key, parent, kids))]
    fn add_chained(&self, py: Python<'_>, key: &[u8], parent: Option<&[u8]>, kids: u32) -> PyResult<bool> {
        let parent = parent.map_or(Ok(NO_PARENT), |p| to_name(p, "parent"))?;
        let d = digest(key, b"");
        self.locked(py, |s| s.insert_chained(d, parent, kids)).map_err(set_error)
    }

    /// Is a block named by this parent name (or whose digest starts as this one does) here?
    fn has_digest(&self, py: Python<'_>, digest: &[u8]) -> PyResult<bool> {
        let name = to_name(digest, "digest")?;
        Ok(self.locked(py, |s| s.contains_name(&name)))
    }

    /// The 8-byte name chain links call the block of `key` by: the first 5 bytes of its digest,
    /// zero-padded (not its fingerprint: drops go by `digest`).
    #[staticmethod]
    fn parent_name<'py>(py: Python<'py>, key: &[u8]) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &parent_name(&digest(key, b"")))
    }

    /// Count one more cached child against the block named `parent`; False if absent.
    fn add_kid(&self, py: Python<'_>, parent: &[u8]) -> PyResult<bool> {
        let d = to_name(parent, "parent")?;
        Ok(self.locked(py, |s| s.add_kid(&d)))
    }

    /// A cached child of the block named `parent` left; False if no block of that name here
    /// has a child counted (the caller's count, if any, is the one to drop).
    fn drop_kid(&self, py: Python<'_>, parent: &[u8]) -> PyResult<bool> {
        let d = to_name(parent, "parent")?;
        Ok(self.locked(py, |s| s.drop_kid(&d)))
    }

    /// Remove `key`: (its parent's name or None, the children counted against it), or
    /// None if absent.
    fn take_chained<'py>(&self, py: Python<'py>, key: &[u8]) -> Option<(Option<Bound<'py, PyBytes>>, u32)> {
        let d = digest(key, b"");
        let (parent, kids) = self.locked(py, |s| s.take_chained(&d))?;
        Some(((parent != NO_PARENT).then(|| PyBytes::new(py, &parent)), kids))
    }

    /// Evict up to `n` chain tails, least recently used first (a parent left without a child
    /// here is a tail at once): (digest, the parent's name when the child was not counted off
    /// a parent in this set: the caller's count to drop).
    fn pop_tails<'py>(&self, py: Python<'py>, n: i64) -> PyResult<Vec<Evicted<'py>>> {
        let n = usize::try_from(n).map_err(|_| PyValueError::new_err(format!("n must be >= 0, got {n}")))?;
        let popped: Vec<(Digest, ParentName, bool)> =
            self.locked_for(py, n, |s| std::iter::from_fn(|| s.pop_tail()).take(n).collect());
        Ok(popped
            .iter()
            .map(|(d, p, here)| {
                let elsewhere = *p != NO_PARENT && !here;
                (PyBytes::new(py, d), elsewhere.then(|| PyBytes::new(py, p)))
            })
            .collect())
    }

    /// Children counted against `key` (None: absent).
    fn kids_of(&self, py: Python<'_>, key: &[u8]) -> Option<u32> {
        let d = digest(key, b"");
        self.locked(py, |s| s.kids(&d))
    }

    /// Link adopted blocks: `children[i]` extends `parents[i]` (keys, both present). Returns
    /// how many links were made (absent or already linked children are skipped).
    fn link_keys(
        &self,
        py: Python<'_>,
        children: &Bound<'_, PyAny>,
        parents: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let n = seq_len(children, "children")?;
        if seq_len(parents, "parents")? != n {
            return Err(PyValueError::new_err(format!(
                "{n} children but {} parents",
                seq_len(parents, "parents")?
            )));
        }
        let mut linked = 0;
        for at in (0..n).step_by(CHUNK) {
            let stop = n.min(at + CHUNK);
            let kids = borrow_bytes(children, "children", at, stop)?;
            let ups = borrow_bytes(parents, "parents", at, stop)?;
            let (kids, ups) = (slices(&kids), slices(&ups));
            linked += self.locked_for(py, kids.len(), |s| {
                kids.iter().zip(&ups).filter(|(c, p)| s.link(&digest(c, b""), &digest(p, b""))).count()
            });
        }
        Ok(linked)
    }

    /// `link_keys` of keys joined into buffers of `width`-byte keys (`BlockStore.
    /// inventory_joined`): `children[i]` extends `parents[i]`. No object per link.
    fn link_joined(&self, py: Python<'_>, children: &[u8], parents: &[u8], width: usize) -> PyResult<usize> {
        if width == 0 || children.len() % width != 0 || children.len() != parents.len() {
            return Err(PyValueError::new_err(format!(
                "{} bytes of children and {} of parents are not the same whole keys of width {width}",
                children.len(),
                parents.len()
            )));
        }
        let mut linked = 0;
        for (kids, ups) in children.chunks(CHUNK * width).zip(parents.chunks(CHUNK * width)) {
            linked += self.locked_for(py, kids.len() / width, |s| {
                kids.chunks_exact(width)
                    .zip(ups.chunks_exact(width))
                    .filter(|(c, p)| s.link(&digest(c, b""), &digest(p, b"")))
                    .count()
            });
        }
        Ok(linked)
    }

    /// Positions of the records of `hashes` (a bytes-like of `hash_len`-byte hashes) whose
    /// digest under `head` is one of `digests`: full keys for digests the set evicted.
    #[staticmethod]
    fn find_records(
        py: Python<'_>,
        head: &[u8],
        hashes: &[u8],
        hash_len: usize,
        digests: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<usize>> {
        let wanted: HashSet<Digest> = Self::read_digests(digests)?.into_iter().collect();
        Ok(py.detach(|| find_records(head, hashes, hash_len, &wanted)))
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
