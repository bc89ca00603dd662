//! PyO3 bindings: `flexkv_py._native`. Every call that does I/O, hashing or compression runs
//! with the GIL released (`py.detach`).

mod batch;
mod block_set;
mod block_set_args;
mod buffers;
mod errors;
mod log_bridge;
mod lookup_handle;
mod names;
mod object_tier;
mod pool;
mod stats;
mod store;

use pyo3::prelude::*;

#[pymodule]
#[pyo3(name = "_native")]
fn native_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Rust log records reach Python's `logging` under the "flexkv_native" logger.
    log_bridge::init();
    log_bridge::register_atexit(m)?;
    errors::register(m)?;
    names::register(m)?;
    m.add_class::<store::PyBlockStore>()?;
    m.add_class::<batch::PyBatchHandle>()?;
    m.add_class::<batch::PyBlockResult>()?;
    m.add_class::<lookup_handle::PyLookupHandle>()?;
    m.add_class::<pool::PyHostPool>()?;
    m.add_class::<block_set::PyBlockSet>()?;
    object_tier::register(m)?;
    m.add_function(wrap_pyfunction!(store::content_hash, m)?)?;
    m.add_function(wrap_pyfunction!(store::io_uring_available, m)?)?;
    m.add_function(wrap_pyfunction!(store::set_fault_delays, m)?)?;
    m.add_function(wrap_pyfunction!(store::store_capacity_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(store::block_pages, m)?)?;
    Ok(())
}
