//! The object tier's tokio runtime: one per process, made on first use and remembered with the
//! PID that made it. A child made by `fork` inherits the parent's runtime object but none of its
//! threads; it sees the PID change and builds its own (the inherited one is leaked on purpose:
//! dropping it would wait for worker threads that do not exist in the child).

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::runtime::Runtime;

use super::error::{ObjectError, Result};

static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// Worker threads: the work is network waits plus hashing/copying one block at a time.
fn worker_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(2, 4)
}

/// This process's runtime, and whether it was just (re)built.
pub fn runtime() -> Result<(Arc<Runtime>, bool)> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock();
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return Ok((rt.clone(), false));
        }
    }
    if let Some(inherited) = slot.take() {
        std::mem::forget(inherited);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads())
        .thread_name("flexkv-object")
        .enable_all()
        .build()
        .map_err(|e| ObjectError::io("starting the object tier's runtime", e))?;
    let rt = Arc::new(rt);
    *slot = Some((pid, rt.clone()));
    Ok((rt, true))
}
