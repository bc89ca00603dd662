//! Fault injection for tests: an engine wrapper that fails every Nth read and/or write with a
//! chosen errno, so tests can prove that device faults become per-block errors, that a failed
//! put is never acknowledged, and that the store keeps serving. Off unless configured
//! (`fault_injection=` or the `FLEXKV_FAULT_INJECTION` environment variable).

use super::{Completion, IoEngine, IoFailure, IoOp};
use crate::error::{Result, StoreError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultPlan {
    pub reads: bool,
    pub writes: bool,
    /// Journal appends and rewrites (a failed append leaves half a record behind).
    pub journal: bool,
    pub errno: i32,
    /// Fail one op out of every `every` matching ops (the 1st, the (every+1)th, ...).
    pub every: u64,
}

impl FaultPlan {
    /// `"<read|write|any|journal>:<EIO|ENOSPC>:<every>"`, e.g. `"write:EIO:2"`.
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = || {
            StoreError::Config(format!("fault_injection: {spec:?} is not <read|write|any>:<EIO|ENOSPC>:<N>"))
        };
        let mut parts = spec.split(':');
        let (reads, writes, journal) = match parts.next() {
            Some("read") => (true, false, false),
            Some("write") => (false, true, false),
            Some("any") => (true, true, false),
            Some("journal") => (false, false, true),
            _ => return Err(bad()),
        };
        let errno = match parts.next() {
            Some("EIO") => libc::EIO,
            Some("ENOSPC") => libc::ENOSPC,
            _ => return Err(bad()),
        };
        let every = parts.next().and_then(|n| n.parse::<u64>().ok()).filter(|n| *n > 0).ok_or_else(bad)?;
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(FaultPlan { reads, writes, journal, errno, every })
    }
}

pub struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    plan: FaultPlan,
    seen: u64,
    injected: Vec<Completion>,
}

impl FaultyEngine {
    pub fn new(inner: Box<dyn IoEngine>, plan: FaultPlan) -> Self {
        tracing::warn!("fault injection is ON for this store: {plan:?}");
        FaultyEngine { inner, plan, seen: 0, injected: Vec::new() }
    }
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn push(&mut self, op: &IoOp, tag: u64) -> bool {
        if (op.write && self.plan.writes) || (!op.write && self.plan.reads) {
            self.seen += 1;
            if (self.seen - 1) % self.plan.every == 0 {
                self.injected.push((tag, Err(IoFailure::Errno(self.plan.errno))));
                return true;
            }
        }
        self.inner.push(op, tag)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) {
        let injected = self.injected.len();
        out.append(&mut self.injected);
        // Never block on the real engine for completions we already produced.
        self.inner.reap(min.saturating_sub(injected), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let p = FaultPlan::parse("write:EIO:3").unwrap();
        assert!(p.writes && !p.reads && p.errno == libc::EIO && p.every == 3);
        assert!(FaultPlan::parse("any:ENOSPC:1").unwrap().reads);
        for bad in ["", "write", "write:EBADF:1", "read:EIO:0", "read:EIO:x", "read:EIO:1:2"] {
            assert!(FaultPlan::parse(bad).is_err(), "{bad}");
        }
    }
}
