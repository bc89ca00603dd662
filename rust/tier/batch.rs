//! A submitted batch: per-block results filled in by a worker, waited on by the caller. Every
//! tier returns these, so nothing here names one tier's errors: a wait that runs out of time
//! is `TimedOut`, which each tier's error type takes in.

use std::any::Any;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// A wait ran out of time (maps to `TimeoutError`).
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("timed out after {0:.3}s")]
pub struct TimedOut(pub f64);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Deduped,
    NotFound,
    Corrupt,
    IoError,
    Rejected,
    NoSpace,
    BadBuffer,
}

impl Status {
    /// Every status, in declaration order (exported to Python as `STATUSES` by name).
    pub const ALL: [Status; 8] = [
        Status::Ok,
        Status::Deduped,
        Status::NotFound,
        Status::Corrupt,
        Status::IoError,
        Status::Rejected,
        Status::NoSpace,
        Status::BadBuffer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Deduped => "deduped",
            Status::NotFound => "not_found",
            Status::Corrupt => "corrupt",
            Status::IoError => "io_error",
            Status::Rejected => "rejected",
            Status::NoSpace => "no_space",
            Status::BadBuffer => "bad_buffer",
        }
    }

    pub fn is_ok(self) -> bool {
        matches!(self, Status::Ok | Status::Deduped)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockResult {
    pub status: Status,
    pub nbytes: u64,
    pub error: Option<String>,
}

impl BlockResult {
    pub fn new(status: Status, nbytes: u64) -> Self {
        BlockResult { status, nbytes, error: None }
    }
    pub fn failed(status: Status, error: impl Into<String>) -> Self {
        BlockResult { status, nbytes: 0, error: Some(error.into()) }
    }
}

/// Caller memory for one block. The submitter guarantees it stays valid (and, for reads,
/// unaliased) until the batch completes; `Batch::keepalive` holds whatever owns it.
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: see the type's contract; the store only touches the memory while the batch runs.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// The memory must be valid for reads of `len` bytes while the returned slice lives.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }
    /// # Safety
    /// The memory must be valid for writes of `len` bytes and not aliased.
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// Whatever owns the caller memory behind a batch's `RawBuf`s (e.g. Python buffer views);
/// dropped when the batch completes.
pub type Keepalive = Box<dyn Any + Send>;

pub struct Batch {
    len: usize,
    state: Mutex<Option<Vec<BlockResult>>>,
    cond: Condvar,
    /// Owner of the caller's buffers (e.g. Python buffer views), dropped at completion.
    keepalive: Mutex<Option<Keepalive>>,
}

impl Batch {
    pub fn new(len: usize, keepalive: Option<Keepalive>) -> Self {
        Batch { len, state: Mutex::new(None), cond: Condvar::new(), keepalive: Mutex::new(keepalive) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn complete(&self, results: Vec<BlockResult>) {
        // Release the caller's buffers before waking waiters: once `wait` returns, the store
        // no longer references their memory.
        let keep = self.keepalive.lock().take();
        drop(keep);
        *self.state.lock() = Some(results);
        self.cond.notify_all();
    }

    pub fn done(&self) -> bool {
        self.state.lock().is_some()
    }

    pub fn wait(&self, timeout: Option<Duration>) -> Result<Vec<BlockResult>, TimedOut> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut state = self.state.lock();
        loop {
            if let Some(results) = state.as_ref() {
                return Ok(results.clone());
            }
            match deadline {
                None => self.cond.wait(&mut state),
                Some(d) => {
                    if self.cond.wait_until(&mut state, d).timed_out() && state.is_none() {
                        return Err(TimedOut(timeout.unwrap_or_default().as_secs_f64()));
                    }
                }
            }
        }
    }
}
