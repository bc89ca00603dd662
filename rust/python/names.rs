//! The names Rust accepts for its string options, as module constants (`IO_ENGINES`,
//! `COMPRESSIONS`, ...), so the Python schema's `Literal`s can be checked against the parsers
//! instead of being kept in step by hand.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::compression::Compression;
use crate::hashing::HashAlgo;
use crate::io::fault::FaultPlan;
use crate::io::EngineChoice;
use crate::store::Durability;
use crate::tier::Status;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let statuses: Vec<&str> = Status::ALL.iter().map(|s| s.name()).collect();
    for (name, values) in [
        ("IO_ENGINES", EngineChoice::NAMES),
        ("COMPRESSIONS", Compression::NAMES),
        ("CONTENT_HASHES", HashAlgo::NAMES),
        ("DURABILITIES", Durability::NAMES),
        ("FAULT_TARGETS", FaultPlan::TARGETS),
        ("FAULT_ERRNOS", FaultPlan::ERRNOS),
        ("STATUSES", statuses.as_slice()),
    ] {
        m.add(name, PyTuple::new(py, values)?)?;
    }
    // The journal format this build writes; a store of another version is set aside.
    m.add("JOURNAL_FORMAT_VERSION", crate::format::journal::FILE_VERSION)?;
    // The layout's units, for sizing a store by whole blocks (`store_capacity_blocks`).
    m.add("STORE_PAGE", crate::format::PAGE)?;
    m.add("SUPERBLOCK_PAGES", crate::format::layout::SUPERBLOCK_PAGES)?;
    Ok(())
}
