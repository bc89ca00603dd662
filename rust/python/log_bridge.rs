//! Rust log records → Python `logging`, without ever blocking a store thread on the GIL.
//! Records are formatted where they happen and handed to one forwarding thread, which alone
//! takes the GIL (through pyo3-log). A store thread that logs while holding the store lock
//! therefore cannot deadlock with a Python thread that holds the GIL and wants that lock.

use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_channel::{Sender, TrySendError};
use log::{Level, LevelFilter, Log, Metadata, Record};
use parking_lot::Mutex;
use pyo3::prelude::*;

/// Set at interpreter exit (atexit): the forwarder then drops records instead of calling into
/// a Python that is finalizing (which would abort the process).
static STOPPED: AtomicBool = AtomicBool::new(false);
/// Held by the forwarder while it is inside Python; `stop` takes it to wait for that call.
static IN_PYTHON: Mutex<()> = Mutex::new(());

/// Records waiting for the forwarder; beyond this, records are dropped (never block).
const QUEUE: usize = 4096;

struct Owned {
    level: Level,
    target: String,
    message: String,
}

struct ChannelLogger {
    tx: Sender<Owned>,
}

impl Log for ChannelLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let owned = Owned {
            level: record.level(),
            target: record.target().to_string(),
            message: record.args().to_string(),
        };
        if let Err(TrySendError::Disconnected(_)) = self.tx.try_send(owned) {
            // The forwarder is gone (interpreter shutting down): nothing to do.
        }
    }

    fn flush(&self) {}
}

pub fn init() {
    let (tx, rx) = crossbeam_channel::bounded::<Owned>(QUEUE);
    if log::set_boxed_logger(Box::new(ChannelLogger { tx })).is_err() {
        return; // already installed (module imported twice)
    }
    log::set_max_level(LevelFilter::Info);
    let python = pyo3_log::Logger::default();
    let spawned = std::thread::Builder::new().name("flexkv-log".into()).spawn(move || {
        while let Ok(r) = rx.recv() {
            let _in_python = IN_PYTHON.lock();
            if STOPPED.load(Ordering::Acquire) {
                continue;
            }
            python.log(
                &Record::builder()
                    .level(r.level)
                    .target(&r.target)
                    .args(format_args!("{}", r.message))
                    .build(),
            );
        }
    });
    if spawned.is_err() {
        eprintln!("flexkv_py: could not start the log forwarding thread; Rust logs are dropped");
    }
}

/// Registered with `atexit`: stop forwarding before the interpreter finalizes. Waits (with the
/// GIL released) for a record the forwarder may be passing to Python right now.
#[pyfunction]
pub fn _stop_log_forwarding(py: Python<'_>) {
    STOPPED.store(true, Ordering::Release);
    py.detach(|| drop(IN_PYTHON.lock()));
}

pub fn register_atexit(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let stop = wrap_pyfunction!(_stop_log_forwarding, m)?;
    m.py().import("atexit")?.call_method1("register", (stop,))?;
    Ok(())
}
