//! One error type for the whole crate; the Python layer maps each variant to an exception class.

use std::fmt::Display;
use std::io;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Bad configuration or bad input from the caller (maps to `ConfigError`).
    #[error("{0}")]
    Config(String),
    /// The budget cannot hold the request (maps to `StorageFullError`).
    #[error("{0}")]
    Full(String),
    /// Stored bytes failed verification (maps to `CorruptBlockError`).
    #[error("{0}")]
    Corrupt(String),
    /// The device or the I/O engine failed (maps to `IoEngineError`).
    #[error("{0}")]
    Io(String),
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

impl StoreError {
    pub fn io(context: impl Display, err: io::Error) -> Self {
        StoreError::Io(format!("{context}: {err}"))
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;
