//! The object tier's errors: its own type, a sibling of the SSD store's `StoreError`. The
//! Python layer maps both onto the one exception hierarchy (`rust/python/errors.rs`).

use std::fmt::Display;
use std::io;

use crate::tier::TimedOut;

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// Bad configuration or input, or a store that refuses us (credentials, bucket): the
    /// message names the endpoint, never the secret (maps to `ConfigError`).
    #[error("{0}")]
    Config(String),
    /// The tier was closed; nothing more can be submitted to it (maps to `StoreClosedError`).
    #[error("object tier is closed")]
    Closed,
    /// A request to the object store failed or went unanswered within its budget (maps to
    /// `IoEngineError`).
    #[error("{0}")]
    Request(String),
    /// An operating-system call failed (maps to `IoEngineError`, with an `OSError` as its cause).
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// A wait ran out of time (maps to `TimeoutError`).
    #[error(transparent)]
    Timeout(#[from] TimedOut),
}

impl ObjectError {
    pub fn io(context: impl Display, source: io::Error) -> Self {
        ObjectError::Io { context: context.to_string(), source }
    }
}

pub type Result<T> = std::result::Result<T, ObjectError>;
