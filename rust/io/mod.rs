//! I/O engines: how a batch of vectored reads/writes reaches a device. One queue (thread)
//! per cache directory owns its engine, so N directories on N disks run in parallel.

pub mod aligned;
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
    Short { done: usize, expected: usize },
}

impl std::fmt::Display for IoFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoFailure::Errno(e) => write!(f, "{}", std::io::Error::from_raw_os_error(*e)),
            IoFailure::Short { done, expected } => write!(f, "short transfer: {done} of {expected} bytes"),
        }
    }
}

/// One positioned, vectored read or write. The iovecs point into memory that the submitter
/// keeps alive until the op comes back.
pub struct IoOp {
    pub fd: RawFd,
    pub offset: u64,
    pub iov: Vec<libc::iovec>,
    pub write: bool,
    pub result: std::result::Result<(), IoFailure>,
}

// SAFETY: the raw pointers in `iov` refer to buffers whose owner waits for the op's return.
unsafe impl Send for IoOp {}

impl IoOp {
    pub fn new(fd: RawFd, offset: u64, iov: Vec<libc::iovec>, write: bool) -> Self {
        IoOp { fd, offset, iov, write, result: Err(IoFailure::Errno(libc::ECANCELED)) }
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
    /// Start `op` (it must stay put until its completion is reaped). False when full.
    fn push(&mut self, op: &IoOp, tag: u64) -> bool;
    /// Submit what was pushed and wait for at least `min` completions.
    fn reap(&mut self, min: usize, out: &mut Vec<Completion>);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    Auto,
    IoUring,
    Psync,
}

impl EngineChoice {
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
