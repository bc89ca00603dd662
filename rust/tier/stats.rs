//! What every tier's `stats()` returns, before the Python layer turns it into a dict.

/// A point-in-time view, as name → value, in a stable order.
#[derive(Clone, Debug, PartialEq)]
pub enum StatValue {
    Int(u64),
    Float(f64),
    Text(String),
}

pub type StatsSnapshot = Vec<(&'static str, StatValue)>;
