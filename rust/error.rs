//! The SSD block store's error type (the object tier has its own, `object::ObjectError`); the
//! Python layer maps each variant to an exception class (`rust/python/errors.rs`) and hands the `io::Error` behind an `Io` variant over as the
//! exception's `__cause__`.

use std::fmt::Display;
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Bad configuration or bad input from the caller (maps to `ConfigError`).
    #[error("{0}")]
    Config(String),
    /// The store was closed; nothing more can be submitted to it (maps to `StoreClosedError`).
    #[error("store is closed")]
    Closed,
    /// The budget cannot hold the request (maps to `StorageFullError`).
    #[error("{0}")]
    Full(String),
    /// Stored bytes failed verification: `what` (a file, a key) and why (maps to
    /// `CorruptBlockError`).
    #[error("{what}: {reason}")]
    Corrupt { what: String, reason: String },
    /// A file that is not a flexkv store's (foreign bytes where a journal belongs): refused,
    /// never overwritten (maps to `CorruptBlockError`).
    #[error("{}: not a flexkv {kind} ({reason})", path.display())]
    Foreign { path: PathBuf, kind: &'static str, reason: String },
    /// A flexkv store written by another on-disk format version: opened for writing, it is
    /// set aside and the store starts empty; a read-only view refuses it (maps to
    /// `CorruptBlockError`).
    #[error("{}: written by flexkv format v{found}, this build reads v{expected}", path.display())]
    FormatVersion { path: PathBuf, found: u32, expected: u32 },
    /// An operating-system call failed: what was being done (`context`, naming the path) and
    /// the error itself (maps to `IoEngineError`, with an `OSError` as its cause).
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// The device layer refused without an OS error (journal unwritable, read-only handle,
    /// engine gone) (maps to `IoEngineError`).
    #[error("{0}")]
    Device(String),
    /// Another process holds the directory (maps to `StoreLockedError`).
    #[error("{0}")]
    Locked(String),
    /// The key is not stored (maps to `BlockNotFoundError`).
    #[error("{0}")]
    NotFound(String),
    /// A wait ran out of time (maps to `TimeoutError`).
    #[error("timed out after {0:.3}s")]
    Timeout(f64),
}

impl From<crate::tier::TimedOut> for StoreError {
    fn from(t: crate::tier::TimedOut) -> Self {
        StoreError::Timeout(t.0)
    }
}

impl StoreError {
    pub fn io(context: impl Display, source: io::Error) -> Self {
        StoreError::Io { context: context.to_string(), source }
    }

    pub fn corrupt(what: impl Display, reason: impl Display) -> Self {
        StoreError::Corrupt { what: what.to_string(), reason: reason.to_string() }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_keeps_its_source_and_context() {
        let err = StoreError::io("appending to /x/j", io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(err.to_string().starts_with("appending to /x/j: "));
        let source = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<io::Error>());
        assert_eq!(source.and_then(io::Error::raw_os_error), Some(libc::ENOSPC));
        assert_eq!(StoreError::Closed.to_string(), "store is closed");
    }
}
