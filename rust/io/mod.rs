//! I/O engines: how a batch of vectored reads/writes reaches a device. One queue (thread)
//! per cache directory owns its engine, so N directories on N disks run in parallel.

pub mod aligned;
pub mod fault;
pub mod psync;
pub mod queue;
pub mod uring;

use std::os::fd::RawFd;

use crate::error::{Result, StoreError};

/// Why one I/O failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoFailure {
    Errno(i32),
    /// Fewer bytes than asked (a truncated file, or a device that gave up mid-way).
    Short {
        done: usize,
        expected: usize,
    },
}

impl std::fmt::Display for IoFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoFailure::Errno(e) => write!(f, "{}", std::io::Error::from_raw_os_error(*e)),
            IoFailure::Short { done, expected } => write!(f, "short transfer: {done} of {expected} bytes"),
        }
    }
}

/// One positioned, vectored read or write on the file of the queue it is submitted to (the
/// device layer picks the queue; an op names no file itself). The iovecs point into memory
/// that the submitter keeps alive until the op comes back.
pub struct IoOp {
    pub offset: u64,
    pub iov: Vec<libc::iovec>,
    pub write: bool,
    pub result: std::result::Result<(), IoFailure>,
}

// SAFETY: the raw pointers in `iov` refer to buffers whose owner waits for the op's return.
unsafe impl Send for IoOp {}

impl IoOp {
    pub fn new(offset: u64, iov: Vec<libc::iovec>, write: bool) -> Self {
        IoOp { offset, iov, write, result: Err(IoFailure::Errno(libc::ECANCELED)) }
    }

    pub fn expected_len(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }
}

pub fn iovec(ptr: *mut u8, len: usize) -> libc::iovec {
    libc::iovec { iov_base: ptr.cast(), iov_len: len }
}

/// A completion: the tag given at `push` and the op's outcome.
pub type Completion = (u64, std::result::Result<(), IoFailure>);

/// An I/O engine keeps up to `capacity()` ops in flight. The device queue pushes ops as they
/// arrive and reaps completions, so the device never idles between batches.
pub trait IoEngine: Send {
    fn name(&self) -> &'static str;
    fn capacity(&self) -> usize;
    /// Start `op` on file `fd` (the op must stay put until its completion is reaped). False
    /// when full.
    fn push(&mut self, fd: RawFd, op: &IoOp, tag: u64) -> bool;
    /// Submit what was pushed and wait for at least `min` completions.
    fn reap(&mut self, min: usize, out: &mut Vec<Completion>);
    /// `reap`, but return after about `wait` even with fewer completions, so the device queue
    /// can push ops that arrived meanwhile (a read must not wait behind a slow write).
    fn reap_for(&mut self, min: usize, out: &mut Vec<Completion>, wait: std::time::Duration) {
        let _ = wait;
        self.reap(min, out)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    Auto,
    IoUring,
    Psync,
}

impl EngineChoice {
    /// The names `parse` accepts (aliases aside), exported to Python as `IO_ENGINES`.
    pub const NAMES: &'static [&'static str] = &["auto", "io_uring", "psync"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" | "" => Ok(EngineChoice::Auto),
            "io_uring" | "iouring" | "uring" => Ok(EngineChoice::IoUring),
            "psync" | "pread" | "sync" => Ok(EngineChoice::Psync),
            other => Err(StoreError::Config(format!(
                "io_engine: unknown engine {other:?} (expected \"auto\", \"io_uring\" or \"psync\")"
            ))),
        }
    }
}

const PSYNC_MAX_THREADS: u32 = 8;

/// Build the engine for one directory; `auto` falls back to psync (and logs why) when the
/// kernel or a seccomp profile refuses io_uring.
pub fn build_engine(choice: EngineChoice, queue_depth: u32) -> Result<Box<dyn IoEngine>> {
    // Threads of the fallback engine: enough to keep an SSD queue busy, bounded by the depth.
    let psync = || -> Result<Box<dyn IoEngine>> {
        let threads = queue_depth.clamp(1, PSYNC_MAX_THREADS) as usize;
        psync::PsyncEngine::new(threads)
            .map(|e| Box::new(e) as Box<dyn IoEngine>)
            .map_err(|e| StoreError::io("starting pread/pwrite threads", e))
    };
    match choice {
        EngineChoice::Psync => psync(),
        EngineChoice::IoUring => uring::UringEngine::new(queue_depth)
            .map(|e| Box::new(e) as Box<dyn IoEngine>)
            .map_err(|e| StoreError::io("io_engine=io_uring: io_uring_setup failed", e)),
        EngineChoice::Auto => match uring::UringEngine::new(queue_depth) {
            Ok(e) => Ok(Box::new(e)),
            Err(e) => {
                tracing::warn!("io_uring unavailable ({e}); falling back to the pread/pwrite engine");
                psync()
            }
        },
    }
}

pub fn io_uring_available() -> bool {
    uring::UringEngine::new(4).is_ok()
}

/// Largest merged I/O and most iovecs in one (Linux's IOV_MAX).
const MAX_MERGED_BYTES: usize = 8 << 20;
const MAX_IOVECS: usize = 1024;

/// Several block ops merged into one because they touch adjacent bytes of the same file.
pub struct MergedOp {
    /// The caller's ids of the merged ops, in file order.
    pub ids: Vec<usize>,
    /// Byte length of each merged op.
    pub lens: Vec<usize>,
    pub op: IoOp,
}

impl MergedOp {
    /// Each merged op's own outcome: on a short transfer, the ops that fit in the bytes that
    /// were transferred still succeed.
    pub fn split_result(&self) -> Vec<(usize, std::result::Result<(), IoFailure>)> {
        let mut start = 0usize;
        self.ids
            .iter()
            .zip(&self.lens)
            .map(|(&id, &len)| {
                let r = match self.op.result {
                    Err(IoFailure::Short { done, .. }) if start + len <= done => Ok(()),
                    Err(IoFailure::Short { done, .. }) => {
                        Err(IoFailure::Short { done: done.saturating_sub(start).min(len), expected: len })
                    }
                    other => other,
                };
                start += len;
                (id, r)
            })
            .collect()
    }
}

/// Merge ops on adjacent byte ranges of one file (all `ops` target the same one) into single
/// vectored ops: blocks allocated back to back then move in a few large I/Os, not many small.
pub fn coalesce(mut ops: Vec<(usize, IoOp)>) -> Vec<MergedOp> {
    ops.sort_by_key(|(_, op)| op.offset);
    let mut out: Vec<MergedOp> = Vec::new();
    for (id, op) in ops {
        let len = op.expected_len();
        if let Some(last) = out.last_mut() {
            let last_len = last.op.expected_len();
            let adjacent = last.op.write == op.write && last.op.offset + last_len as u64 == op.offset;
            if adjacent
                && last_len + len <= MAX_MERGED_BYTES
                && last.op.iov.len() + op.iov.len() <= MAX_IOVECS
            {
                last.op.iov.extend(op.iov);
                last.ids.push(id);
                last.lens.push(len);
                continue;
            }
        }
        out.push(MergedOp { ids: vec![id], lens: vec![len], op });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(offset: u64, len: usize) -> IoOp {
        IoOp::new(offset, vec![iovec(std::ptr::null_mut(), len)], true)
    }

    #[test]
    fn coalesces_adjacent_and_splits_short_results() {
        let merged = coalesce(vec![(0, op(8192, 4096)), (1, op(0, 8192)), (2, op(20480, 4096))]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].ids, vec![1, 0]);
        assert_eq!(merged[0].op.expected_len(), 12288);
        let mut m = merged.into_iter().next().unwrap();
        m.op.result = Err(IoFailure::Short { done: 9000, expected: 12288 });
        let split = m.split_result();
        assert_eq!(split[0], (1, Ok(())));
        assert!(matches!(split[1], (0, Err(IoFailure::Short { done: 808, expected: 4096 }))));
    }
}
